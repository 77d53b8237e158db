"""`fsdplab run` stopped by real signals at chosen moments: a second Ctrl-C, SIGTERM while a kernel
starts, Ctrl-C while estimates run in the background. Each ends with the summary and exit 130, no
traceback, no temporary folder or `.running.ipynb` left, and a notebook that says what ran. What a
SIGKILL left in the temporary folder is removed by the next run, and only that."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from fsdplab.runner.run import OWNER_FILE, remove_stale_temp


def tiny_notebook(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("steps = 3          # optimizer steps")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(nb, path)
    return path


class Run:
    """`fsdplab run NOTEBOOKS` in a process of its own, with a temporary folder of its own."""

    def __init__(self, tmp_path: Path, *notebooks: Path):
        self.tmp, self.out = tmp_path / "tmp", tmp_path / "out"
        self.tmp.mkdir(exist_ok=True)
        self.mark = str(tmp_path)
        env = {**os.environ, "TMPDIR": str(self.tmp), "FSDPLAB_TEST_MARK": self.mark}
        env.pop("FSDPLAB_ESTIMATE_CACHE", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fsdplab", "run", *map(str, notebooks), "--out", str(self.out),
             "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, ready, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def wait_for_cell_output(self, stem: str, text: str) -> None:
        running = self.out / f".{stem}.running.ipynb"
        self.wait_for(lambda: running.exists() and text in running.read_text(errors="replace"), repr(text))

    def wait_for_cell_running(self, stem: str, source: str) -> None:
        """Until papermill has marked the cell whose source holds `source` as running: a cell's output
        can be written before its own cell has finished, so output alone does not say which cell runs."""
        running = self.out / f".{stem}.running.ipynb"

        def started() -> bool:
            try:
                cells = json.loads(running.read_text())["cells"]
            except (OSError, ValueError, KeyError):
                return False   # not written yet, or caught mid-write
            return any(source in "".join(c["source"]) and
                       c["metadata"].get("papermill", {}).get("status") == "running" for c in cells)
        self.wait_for(started, f"the cell with {source!r} running")

    def signal(self, signum) -> None:
        try:
            self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def finish(self) -> str:
        self.process.wait(timeout=120)
        self.reader.join(timeout=10)
        return self.output()

    def output(self) -> str:
        return "".join(self.lines)

    def processes_left(self) -> list:
        left = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("FSDPLAB_TEST_MARK") == self.mark:
                    left.append(process.cmdline())
            except psutil.Error:
                pass
        return left


def assert_ended_cleanly(run: Run, output: str) -> None:
    assert run.process.returncode == 130, output
    assert "Traceback" not in output, output
    assert re.search(r"^interrupted; the executed notebooks so far are in ", output, re.M), output
    time.sleep(1)   # a fork the server's death killed may still be exiting
    assert sorted(p.name for p in run.tmp.iterdir()) == [], \
        f"temporary entries outlived the run: {list(run.tmp.rglob('*'))} {run.processes_left()}"
    assert not list(run.out.glob(".*.running.ipynb")), "papermill's working copy was left"
    assert run.processes_left() == [], "processes outlived the run"


def code_states(path: Path) -> list:
    nb = json.loads(path.read_text())
    assert nb["metadata"]["papermill"]["interrupted"], "the notebook does not say it was interrupted"
    return [(c["execution_count"], c["metadata"]["papermill"]["status"])
            for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("when", ["at_once", "after_the_summary"])
def test_a_second_ctrl_c_still_ends_with_the_summary(tmp_path, when):
    """The second Ctrl-C comes while the first one's cleanup runs, or once the summary is printed
    (while the interpreter shuts down): either way the cleanup finishes and the exit code is 130."""
    first = tiny_notebook(tmp_path / "a.ipynb", "print('STA' + 'RTED', flush=True)",
                          "import time; time.sleep(120)", "print('never')")
    run = Run(tmp_path, first, tiny_notebook(tmp_path / "b.ipynb", "print('b')"))
    run.wait_for_cell_running("a", "time.sleep(120)")
    run.signal(signal.SIGINT)
    if when == "after_the_summary":
        run.wait_for(lambda: "interrupted; the executed" in run.output(), "summary", timeout=60)
    run.signal(signal.SIGINT)
    output = run.finish()
    assert_ended_cleanly(run, output)
    assert re.search(r"^a +interrupted ", output, re.M) and re.search(r"^b +not run ", output, re.M)
    # papermill marks a cell running before the kernel takes it up: a Ctrl-C in between leaves it without
    # an execution count, still the one interrupted, and the cell before it completed
    assert code_states(run.out / "a.ipynb") in ([(1, "completed"), (2, "completed"), (3, "interrupted"),
                                                 (None, "pending")],
                                                [(1, "completed"), (2, "completed"), (None, "interrupted"),
                                                 (None, "pending")])


def _kernel_launching(run: Run) -> bool:
    try:
        children = psutil.Process(run.process.pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in children:
        try:
            if "ipykernel_launcher" in " ".join(child.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def test_sigterm_while_the_kernel_starts(tmp_path):
    """SIGTERM as soon as the kernel's process exists, before any cell ran: no cell shows as run."""
    lesson = tiny_notebook(tmp_path / "a.ipynb", "print('ran')")
    run = Run(tmp_path, lesson, tiny_notebook(tmp_path / "b.ipynb", "print('b')"))
    run.wait_for(lambda: _kernel_launching(run), "kernel process")
    run.signal(signal.SIGTERM)
    output = run.finish()
    assert_ended_cleanly(run, output)
    assert re.search(r"^a +interrupted ", output, re.M) and re.search(r"^b +not run ", output, re.M)
    executed = run.out / "a.ipynb"
    if executed.exists():   # papermill had written its first copy
        assert code_states(executed) in ([(None, "pending"), (None, "pending")],
                                         [(None, "interrupted"), (None, "pending")])


def test_ctrl_c_while_estimates_run_in_the_background(tmp_path):
    """A lesson has started exact estimates in worker processes (as lessons 01 and 06 do) and goes on:
    Ctrl-C ends the workers with the kernel, and the run's estimate cache is removed."""
    lesson = tiny_notebook(
        tmp_path / "a.ipynb",
        "from fsdplab.models import resolve_model\nfrom fsdplab.settings import TrainSetting\n"
        "from fsdplab.memory.sweep import start_estimates\n"
        "pending = start_estimates([TrainSetting(model=resolve_model('tiny'), world_size=2, seq_len=s)"
        " for s in (64, 128, 256, 512)], workers=2)\nprint('SWE' + 'EPING', flush=True)",
        "import time; time.sleep(120)", "pending.result()")
    run = Run(tmp_path, lesson, tiny_notebook(tmp_path / "b.ipynb", "print('b')"))
    run.wait_for_cell_running("a", "time.sleep(120)")
    run.wait_for(lambda: len(run.processes_left()) >= 4, "estimate workers")   # + kernel, its client
    run.signal(signal.SIGINT)
    output = run.finish()
    assert_ended_cleanly(run, output)
    # papermill marks a cell running before the kernel starts it: a Ctrl-C in between (a loaded machine) leaves
    # it without an execution count; either way the workers and the cache are gone (assert_ended_cleanly)
    assert code_states(run.out / "a.ipynb")[2:] in ([(3, "interrupted"), (None, "pending")],
                                                    [(None, "interrupted"), (None, "pending")])


def test_what_a_killed_run_left_is_removed_by_the_next(tmp_path):
    """SIGKILL leaves the lesson's, the fork server's and the estimate cache's folders; the next run
    removes them (their recorded run is gone) and leaves its own nothing."""
    lesson = tiny_notebook(tmp_path / "a.ipynb", "print('STA' + 'RTED', flush=True)",
                           "import time; time.sleep(120)")
    run = Run(tmp_path, lesson, tiny_notebook(tmp_path / "b.ipynb", "print('b')"))
    run.wait_for_cell_output("a", "STARTED")
    run.signal(signal.SIGKILL)
    run.finish()
    # the fork server's folder is in /tmp when TMPDIR is too long for a socket's path
    left = [p for folder in (run.tmp, Path("/tmp")) for p in folder.glob("fsdplab-*")
            if _owner_pid(p) == run.process.pid]
    assert sorted(re.sub(r"-[^-]+$", "-", p.name) for p in left) == \
        ["fsdplab-estimates-", "fsdplab-forkserver-", "fsdplab-run-a-"], left
    deadline = time.monotonic() + 30   # the server's forks die with it (PR_SET_PDEATHSIG)
    while run.processes_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    (tmp_path / "out").rename(tmp_path / "killed")
    after = Run(tmp_path, tiny_notebook(tmp_path / "c.ipynb", "print('c')"))
    assert after.finish() and after.process.returncode == 0, after.output()
    assert sorted(p.name for p in run.tmp.iterdir()) == []
    assert not [p for p in left if p.exists()]


def _owner_pid(folder: Path):
    try:
        return json.loads((folder / OWNER_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _owned(folder: Path, pid, started=None) -> Path:
    folder.mkdir()
    (folder / OWNER_FILE).write_text(json.dumps({"pid": pid, "started": started}))
    (folder / "rank0.log").write_text("")
    return folder


def test_only_the_lab_s_own_entries_of_gone_runs_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)
    me = psutil.Process()
    dead = _owned(tmp_path / "fsdplab-run-01-dead", dead_pid)
    reused = _owned(tmp_path / "fsdplab-forkserver-reused", os.getpid(), me.create_time() - 1000)
    live = _owned(tmp_path / "fsdplab-estimates-live", os.getpid(), me.create_time())
    unnamed = _owned(tmp_path / "someone-else", dead_pid)
    no_owner = tmp_path / "fsdplab-run-02-older-release"
    no_owner.mkdir()
    target = _owned(tmp_path / "elsewhere", dead_pid)
    (tmp_path / "fsdplab-run-03-link").symlink_to(target)
    removed = remove_stale_temp([str(tmp_path)])
    assert sorted(Path(p).name for p in removed) == sorted([dead.name, reused.name])
    assert not dead.exists() and not reused.exists()
    for kept in (live, unnamed, no_owner, target, tmp_path / "fsdplab-run-03-link"):
        assert kept.exists(), kept
    assert (target / "rank0.log").exists()


def test_the_cell_started_last_is_the_one_interrupted(tmp_path):
    """A Ctrl-C after papermill started a cell but before the kernel took it up: that cell (no execution count
    yet) is the one interrupted, the one before it stays completed, the rest are pending."""
    from fsdplab.runner.run import _mark_unfinished

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(str(i)) for i in range(4)]
    for i, cell in enumerate(nb.cells):   # as papermill leaves them after an interrupt
        cell.metadata["papermill"] = {"status": "completed", "start_time": "t" if i < 3 else None}
        cell.execution_count = i + 1 if i < 2 else None
    path = tmp_path / "a.ipynb"
    nbformat.write(nb, path)
    _mark_unfinished(path)
    assert code_states(path) == [(1, "completed"), (2, "completed"), (None, "interrupted"), (None, "pending")]
