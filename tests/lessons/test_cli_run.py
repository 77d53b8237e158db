"""`fsdplab run`: parameters reach the lessons, mistakes are named, runs write only under their output folder,
and every lesson runs at any world size."""

import ast
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import papermill as pm
import psutil
import pytest
from papermill.translators import PythonTranslator

from fsdplab.runner.cli import declared_parameters, lesson_paths, main, run_lessons

LESSONS = lesson_paths()
IDS = [p.stem for p in LESSONS]


def parameters_cell(path: Path) -> tuple:
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if "parameters" in cell.metadata.get("tags", []):
            return index, cell
    raise AssertionError(f"{path.name} has no cell tagged parameters")


def executed_cells(path: Path) -> list:
    return nbformat.read(path, as_version=4).cells


def injected_source(path: Path) -> str:
    [cell] = [c for c in executed_cells(path) if "injected-parameters" in c.metadata.get("tags", [])]
    return cell.source


def stream_text(path: Path) -> str:
    return "".join(out.get("text", "") for cell in executed_cells(path) for out in cell.get("outputs", []))


def tiny_notebook(path: Path, *cells: str) -> Path:
    """A notebook with a parameters cell (`steps`, `label`) followed by `cells`."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('steps = 3          # optimizer steps\nlabel = "tiny"     # a name')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(nb, path)
    return path


# --- the notebooks as committed -------------------------------------------------------------------------
@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_lesson_is_committed_clean(path):
    """Cell ids (papermill warns without them), no outputs, one cell tagged parameters."""
    cells = json.loads(path.read_text())["cells"]
    assert all("id" in cell for cell in cells), f"{path.name}: cells without an id (nbformat.validator.normalize)"
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), f"{path.name} holds outputs"
    assert sum("parameters" in c.get("metadata", {}).get("tags", []) for c in cells) == 1


# --- the parameters cells -------------------------------------------------------------------------------
@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_parameters_line_parses(path, caplog):
    """Each line of the cell is `name = literal  # comment`, and papermill declares exactly those names."""
    _, cell = parameters_cell(path)
    assigned = []
    for line in cell.source.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        [node] = ast.parse(line).body
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), \
            f"{path.name}: {line!r} is not `name = literal  # comment`, so papermill cannot take it as a parameter"
        ast.literal_eval(node.value)   # papermill replaces the value: it must be a literal
        assigned.append(node.targets[0].id)
    with caplog.at_level(logging.WARNING, logger="papermill"):
        declared = declared_parameters(path)
    unparsed = [r.getMessage() for r in caplog.records if "Unable to parse" in r.getMessage()]
    assert not unparsed, f"{path.name}: papermill cannot parse {unparsed}"
    assert declared == assigned, f"{path.name}: papermill declares {declared}, the cell assigns {assigned}"


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_declared_parameters_are_injected_and_read(path, tmp_path):
    """papermill injects every declared parameter after the cell, and a later cell reads each of them."""
    index, _ = parameters_cell(path)
    declared = pm.inspect_notebook(str(path))
    values = {name: ast.literal_eval(info["default"]) for name, info in declared.items()}
    pm.execute_notebook(str(path), str(tmp_path / path.name), parameters=values, prepare_only=True,
                        kernel_name="python3", progress_bar=False)
    injected = injected_source(tmp_path / path.name)
    for name, value in values.items():
        assert PythonTranslator.assign(name, PythonTranslator.translate(value)) in injected, \
            f"{path.name}: {name} was not injected"
    later = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells[index + 1:] if c.cell_type == "code")
    unread = [name for name in declared if not re.search(rf"\b{re.escape(name)}\b", later)]
    assert not unread, f"{path.name}: parameters no cell reads: {unread}"


def test_every_lesson_takes_world_size():
    """`fsdplab run --world-size N` reaches a lesson through its `world_size` parameter."""
    missing = [p.stem for p in LESSONS if "world_size" not in declared_parameters(p)]
    assert not missing, f"lessons without a world_size parameter: {missing}"


# --- the runner ---------------------------------------------------------------------------------------
def test_unknown_lesson_lists_the_lessons(capsys):
    assert main(["run", "99"]) == 2
    err = capsys.readouterr().err
    assert "'99'" in err and all(stem in err for stem in IDS), err


def test_output_folders_and_parameters_are_checked_before_anything_runs(tmp_path, capsys):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", "print(steps)")
    (tmp_path / "a_file").write_text("")
    cases = {("--out", str(tmp_path)): "is where the lesson tiny.ipynb lives",       # would overwrite the source
             ("--out", str(tmp_path / "a_file" / "x")): "cannot write there",
             ("--figures", str(tmp_path / "a_file")): "cannot write there",
             ("-p", "steps", "3O"): "is not a Python literal of one (e.g. -p steps"}   # a letter O for a zero
    for flags, message in cases.items():
        argv = ["run", str(nb), "--no-progress", *flags]
        if "--out" not in flags:
            argv += ["--out", str(tmp_path / "out")]
        assert main(argv) == 2, flags
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Executing" not in captured.out, (flags, captured)
    assert not (tmp_path / "out" / "tiny.ipynb").exists()


def test_a_dead_fork_server_is_named_and_the_run_goes_on_without_it(tmp_path):
    from fsdplab.runner import forkserver

    if not forkserver.available():
        pytest.skip("no fork server on this platform")
    killer = tiny_notebook(tmp_path / "a.ipynb", "import os, signal\nos.kill(int(os.environ['FSDPLAB_TEST_SERVER']), "
                                                 "signal.SIGKILL)\nimport time; time.sleep(30)")
    after = tiny_notebook(tmp_path / "b.ipynb", "print('b ran')")
    real_start = forkserver.start

    def start(folder, *a, **kw):
        server = real_start(folder, *a, **kw)
        os.environ["FSDPLAB_TEST_SERVER"] = str(server.pid)
        return server

    try:
        forkserver.start = start
        rows = run_lessons([killer, after], tmp_path / "out", progress=False)
    finally:
        forkserver.start = real_start
        os.environ.pop("FSDPLAB_TEST_SERVER", None)
    (a, status_a, _, detail_a), (b, status_b, _, _) = rows
    assert status_a == "FAILED" and "fork server" in detail_a and "SIGKILL" in detail_a, rows
    assert status_b == "ok", rows


def test_a_second_run_into_the_same_out_is_refused_naming_the_first(tmp_path, capsys):
    from fsdplab.runner.run import output_lock

    nb = tiny_notebook(tmp_path / "tiny.ipynb", "print(steps)")
    (tmp_path / "out").mkdir()
    with output_lock(tmp_path / "out"):                       # a first run, in progress
        assert main(["run", str(nb), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is in use by another fsdplab run (pid {os.getpid()})" in err[0], err
    assert main(["run", str(nb), "--out", str(tmp_path / "out"), "--no-progress"]) == 0   # free again


def test_a_torn_executed_notebook_never_replaces_the_last_whole_one(tmp_path):
    from fsdplab.runner.run import _put_in_place

    final, running = tmp_path / "05.ipynb", tmp_path / ".05.running.ipynb"
    final.write_text('{"cells": []}')
    running.write_text('{"cells": [{"cell_ty')                  # what a full disk leaves
    assert not _put_in_place(running, final) and final.read_text() == '{"cells": []}' and not running.exists()
    running.write_text('{"cells": [1]}')
    assert _put_in_place(running, final) and final.read_text() == '{"cells": [1]}'


def test_sigterm_ends_a_run_like_ctrl_c_with_a_summary_and_nothing_left(tmp_path):
    """`timeout` and CI cancellations send SIGTERM: the run prints its summary, marks what never ran, and
    leaves no scratch folder, no estimate cache and no process behind."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    first = tiny_notebook(tmp_path / "a.ipynb", "print('STA' + 'RTED', flush=True)", "import time; time.sleep(120)",
                          "print('never')")
    second = tiny_notebook(tmp_path / "b.ipynb", "print('b')")
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "FSDPLAB_TEST_MARK": str(tmp_path)}
    env.pop("FSDPLAB_ESTIMATE_CACHE", None)
    (tmp_path / "tmp").mkdir()
    runner = subprocess.Popen([sys.executable, "-m", "fsdplab", "run", str(first), str(second), "--out",
                               str(tmp_path / "out"), "--no-progress"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    running = tmp_path / "out" / ".a.running.ipynb"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _cell_running(running, "time.sleep(120)"):
        time.sleep(0.2)
    runner.send_signal(signal.SIGTERM)
    out, _ = runner.communicate(timeout=60)
    assert runner.returncode == 130, out
    assert re.search(r"^a +interrupted ", out, re.M) and re.search(r"^b +not run ", out, re.M), out
    assert "Traceback" not in out, out
    executed = json.loads((tmp_path / "out" / "a.ipynb").read_text())
    states = [c["metadata"]["papermill"]["status"] for c in executed["cells"]]
    assert states[-2:] == ["interrupted", "pending"] and executed["metadata"]["papermill"]["interrupted"]
    assert not (tmp_path / "out" / "b.ipynb").exists() and not running.exists()
    time.sleep(1)
    assert list((tmp_path / "tmp").iterdir()) == [], "temporary folders outlived the run"
    left = [p for p in psutil.process_iter(["pid"]) if _environ_has(p, "FSDPLAB_TEST_MARK", str(tmp_path))]
    assert left == [], f"processes outlived the run: {[p.cmdline() for p in left]}"


def _cell_running(notebook: Path, source: str) -> bool:
    """papermill marked the cell holding `source` as running (a cell's output alone can come before its end)."""
    try:
        cells = json.loads(notebook.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return False
    return any(source in "".join(c["source"]) and c["metadata"].get("papermill", {}).get("status") == "running"
               for c in cells)


def _environ_has(process, name, value) -> bool:
    try:
        return process.environ().get(name) == value
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def test_run_takes_parameters_warns_and_says_where(tmp_path, capsys, monkeypatch):
    """A successful run: declared parameters injected, an undeclared one named on stderr, the output folder
    printed; the kernel runs in it with FSDPLAB_OUT and FSDPLAB_FIGURES set and a temporary folder of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FSDPLAB_ESTIMATE_CACHE", raising=False)
    nb = tiny_notebook(tmp_path / "tiny.ipynb",
                       "import os, tempfile\n"
                       "for name in ('FSDPLAB_OUT', 'FSDPLAB_FIGURES', 'FSDPLAB_ESTIMATE_CACHE'):\n"
                       "    print(name, os.environ[name])\n"
                       "print('cwd', os.getcwd())\nprint('tmp', tempfile.gettempdir())\nprint('steps', steps)")
    code = main(["run", str(nb), "--out", "out", "--figures", "figs", "--no-progress",
                 "-p", "steps", "7", "-p", "stepz", "1"])
    captured = capsys.readouterr()
    out = (tmp_path / "out").resolve()
    assert code == 0, captured
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "no selected lesson declares parameter 'stepz'" in warnings[0], captured.err
    assert f"executed notebooks: {out}" in captured.out

    executed = out / "tiny.ipynb"
    assert "steps = 7" in injected_source(executed) and "stepz" not in injected_source(executed)
    lines = dict(line.split(" ", 1) for line in stream_text(executed).splitlines())
    assert lines["steps"] == "7"
    assert lines["FSDPLAB_OUT"] == lines["cwd"] == str(out)
    assert lines["FSDPLAB_FIGURES"] == str((tmp_path / "figs").resolve())
    assert not Path(lines["tmp"]).exists(), "the kernel's temporary folder outlived the run"
    assert not Path(lines["FSDPLAB_ESTIMATE_CACHE"]).exists(), "the run's estimate cache outlived it"
    assert {p.name for p in tmp_path.iterdir()} <= {"figs", "out", "tiny.ipynb"}   # nothing else written


def test_backend_reaches_the_kernels_environment_and_is_put_back(tmp_path, capsys, monkeypatch):
    """--backend gloo sets FSDPLAB_BACKEND for the lessons' kernels (their clusters read it); the run's own
    process gets the user's value back, and without the flag the user's value passes as it is."""
    monkeypatch.setenv("FSDPLAB_BACKEND", "nccl")
    nb = tiny_notebook(tmp_path / "backend.ipynb", "import os\nprint('backend', os.environ.get('FSDPLAB_BACKEND'))")
    assert main(["run", str(nb), "--out", str(tmp_path / "a"), "--no-progress", "--backend", "gloo"]) == 0
    assert "backend gloo" in stream_text(tmp_path / "a" / "backend.ipynb")
    assert os.environ["FSDPLAB_BACKEND"] == "nccl"
    assert main(["run", str(nb), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "backend nccl" in stream_text(tmp_path / "b" / "backend.ipynb")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["run", str(nb), "--backend", "mpi"])
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


def test_failed_run_leaves_no_scratch(tmp_path, capsys, monkeypatch):
    """A cell fails after starting ranks: the summary names the cell, exit code 1, and neither the kernel's
    temporary folder nor the cluster's scratch folder is left; figures default to OUT/figures."""
    monkeypatch.delenv("FSDPLAB_FIGURES", raising=False)
    nb = tiny_notebook(tmp_path / "fails.ipynb",
                       "import os, tempfile, fsdplab\ncluster = fsdplab.Cluster(1, quiet=True).start()\n"
                       "print('tmp', tempfile.gettempdir())\nprint('cluster', cluster._group.workdir)\n"
                       "print('figures', os.environ['FSDPLAB_FIGURES'])\n"
                       "print('pids', ' '.join(str(p.pid) for p in cluster._group.procs.values()))",
                       "raise RuntimeError('planted failure')")
    code = main(["run", str(nb), "--out", str(tmp_path / "out"), "--no-progress"])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert re.search(r"fails\s+FAILED .*RuntimeError: planted failure", captured.out), captured.out
    lines = dict(line.split(" ", 1) for line in stream_text(tmp_path / "out" / "fails.ipynb").splitlines())
    assert Path(lines["cluster"]).is_relative_to(lines["tmp"])
    assert not Path(lines["tmp"]).exists() and not Path(lines["cluster"]).exists()
    assert lines["figures"] == str((tmp_path / "out" / "figures").resolve())
    assert "Kernel is running over TCP" not in captured.err + captured.out
    # the run ends the kernel at once; its watcher ends the ranks it left running
    def running(pid):   # a zombie waiting for its parent's reap has ended
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    ranks = [int(pid) for pid in lines["pids"].split()]
    deadline = time.monotonic() + 15
    while any(map(running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in ranks if running(pid)], "ranks outlived the run's kernel"


# --- any world size -------------------------------------------------------------------------------------
# Parameters that shorten what does not depend on the world size and that no lesson check rests on (only the
# names a lesson declares are passed): a smaller timed AdamW step, the formula instead of exact estimates.
SMALL = {"adam_params": 2_000_000, "exact_estimates": False}


def _default_world_size(path: Path):
    info = pm.inspect_notebook(str(path)).get("world_size")
    return ast.literal_eval(info["default"]) if info else None


WORLD_SIZE_RUNS = [(path, n) for path in LESSONS for n in (1, 2, 4) if n != _default_world_size(path)]
# One `fsdplab run --world-size N` of every lesson the session selected at N, as a user runs the lab: one process,
# one fork server and one estimate cache for all of them (a process per lesson paid its imports and its fork
# server's 32 times). FSDPLAB_MATRIX_JOBS=N runs N world sizes side by side (on more cores; on 2 cores two lesson
# runs at a time took as long as one at a time, 610 s against 626 s: a lesson run keeps both cores busy).
MATRIX_JOBS = max(1, int(os.environ.get("FSDPLAB_MATRIX_JOBS", "1")))


def _matrix_id(path: Path, world_size: int) -> str:
    return f"{path.stem[:2]}-ws{world_size}"


@pytest.fixture(scope="module")
def matrix_runs(request, tmp_path_factory, estimate_cache) -> dict:
    """world size -> (its output folder, the finished `fsdplab run` process), for the world sizes of the matrix
    runs this session selected, MATRIX_JOBS at a time, 4 ranks (the longest) first."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {item.callspec.id for item in request.session.items
                if item.originalname == "test_lesson_runs_at_any_world_size"}
    lessons = {}
    for path, n in WORLD_SIZE_RUNS:
        if _matrix_id(path, n) in selected:
            lessons.setdefault(n, []).append(path)
    base = tmp_path_factory.mktemp("matrix")

    def run(world_size: int):
        out = base / f"ws{world_size}"
        declared = set().union(*(declared_parameters(p) for p in lessons[world_size]))
        flags = [arg for name, value in SMALL.items() if name in declared for arg in ("-p", name, repr(value))]
        env = {**os.environ, "FSDPLAB_FIGURES": str(out / "figures"), "FSDPLAB_ESTIMATE_CACHE": str(estimate_cache)}
        done = subprocess.run([sys.executable, "-m", "fsdplab", "run", *map(str, lessons[world_size]),
                               "--world-size", str(world_size), "--out", str(out), "--no-progress", *flags],
                              capture_output=True, text=True, env=env, timeout=3000)
        return out, done

    with ThreadPoolExecutor(MATRIX_JOBS) as pool:
        futures = {n: pool.submit(run, n) for n in sorted(lessons, reverse=True)}
    return {n: future.result() for n, future in futures.items()}


def summary_row(stdout: str, stem: str) -> tuple:
    """(status, detail) of `stem` in the summary table `fsdplab run` prints last, or (None, '')."""
    rows = re.findall(rf"^{re.escape(stem)}\s+(\S+)\s+\d+\.\d\s+(.*)$", stdout, re.M)
    return rows[-1] if rows else (None, "")


@pytest.mark.matrix
@pytest.mark.timeout(3600)                  # the first one waits for the whole matrix (matrix_runs)
@pytest.mark.parametrize("path,world_size", WORLD_SIZE_RUNS, ids=[_matrix_id(p, n) for p, n in WORLD_SIZE_RUNS])
def test_lesson_runs_at_any_world_size(path, world_size, matrix_runs):
    """Each lesson runs at the world sizes its default does not cover (tests/lessons/test_notebooks.py runs that)."""
    assert "world_size" in declared_parameters(path), f"{path.name} has no world_size parameter for --world-size"
    out, done = matrix_runs[world_size]
    status, detail = summary_row(done.stdout, path.stem)
    assert status == "ok", (f"{path.stem} at world size {world_size}: {status} {detail}; see {out / path.name}:\n"
                            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    assert f"world_size = {world_size}" in injected_source(out / path.name)


def test_no_progress_bars_in_a_log(tmp_path):
    # stderr a file, as in CI or `fsdplab run > run.log 2>&1`: the log holds the lesson lines and the summary only.
    nb = tiny_notebook(tmp_path / "tiny.ipynb", "print(steps)")
    with open(tmp_path / "log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "fsdplab", "run", str(nb), "--out", str(tmp_path / "out")],
                              stdout=log, stderr=log, timeout=300)
    text = (tmp_path / "log").read_text()
    assert done.returncode == 0, text
    assert "Executing" not in text and "tiny" in text, text


def test_kernels_talk_over_unix_sockets_and_remove_them(tmp_path):
    """jupyter_client's TCP ports are free when picked and can be taken before the kernel binds them (a kernel
    died on "Address already in use" in a CI run): the run's kernels bind Unix sockets, gone after the run."""
    nb = tiny_notebook(tmp_path / "tiny.ipynb", "import json\nfrom ipykernel.connect import get_connection_info\n"
                       "info = json.loads(get_connection_info())\nprint(info['transport'], info['ip'])")
    run_lessons([nb], tmp_path / "out", progress=False)
    transport, prefix = stream_text(tmp_path / "out" / "tiny.ipynb").split()
    assert transport == "ipc" and os.path.isabs(prefix) and len(prefix) < 100, prefix
    assert not list(Path(prefix).parent.glob(Path(prefix).name + "*")) and not Path(prefix).parent.exists()


def test_run_writes_each_lessons_records_and_keeps_the_other_lessons(tmp_path):
    from fsdplab.records import read_run

    first = tiny_notebook(tmp_path / "a.ipynb", "from fsdplab.records import record, check\n"
                                                "record('00-steps', steps * 2, 'x')\ncheck('00-ok', steps == 3)")
    second = tiny_notebook(tmp_path / "b.ipynb", "from fsdplab.records import record\nrecord('01-label', label)")
    out = tmp_path / "out"
    run_lessons([first, second], out, progress=False)
    lessons = read_run(out)
    assert [(r["name"], r.get("value", r.get("ok"))) for r in lessons["a"]] == [("00-steps", 6), ("00-ok", True)]
    assert [r["value"] for r in lessons["b"]] == ["tiny"]
    run_lessons([first], out, parameters={"steps": 5}, progress=False)   # one lesson again: b's records stay
    lessons = read_run(out)
    assert lessons["a"][0]["value"] == 10 and lessons["a"][1]["ok"] is False and lessons["b"][0]["value"] == "tiny"
    assert json.loads((out / "records.json").read_text())["run_info"]["torch"]
