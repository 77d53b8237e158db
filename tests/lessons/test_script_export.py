"""`fsdplab export`: a lesson as one torchrun script, and the script's cluster (fsdplab.runtime.script).

The exported script of lessons 02 and 09, run by torchrun on 2 gloo ranks, records what the notebook records:
every record the notebook made, the same within its tolerance (timings listed, not compared). The notebook's
records come from tests/lessons/test_notebooks.py's run in the same session when there was one (this file runs
after it), else from a run here."""

import ast
import json
import math
import os
import re
import subprocess
import sys

import nbformat
import pytest

from fsdplab import records
from fsdplab.runner import compare
from fsdplab.runner.cli import lesson_paths, main, run_lessons
from fsdplab.runner.export import export_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _torchrun(script, ranks: int, tmp_path, timeout: int = 400, options=()):
    jsonl = tmp_path / "records.jsonl"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *options,
           str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env=_env(FSDPLAB_RECORDS=str(jsonl), FSDPLAB_OUT=str(tmp_path / "out"),
                                   FSDPLAB_FIGURES=str(tmp_path / "figures"), TMPDIR=str(tmp_path / "tmp")))
    found = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    return proc, found


NOT_EXPORTED = {"00_start_here", "05_checkpoints", "10_debugging", "11_first_fsdp2_script"}


@pytest.mark.parametrize("path", lesson_paths(), ids=[p.stem for p in lesson_paths()])
def test_every_lesson_exports_to_python_or_says_why_not(path):
    if path.stem in NOT_EXPORTED:
        with pytest.raises(ValueError, match=rf"^{path.stem} does not export as one script: .+"):
            export_script(path)
        return
    text = export_script(path)
    ast.parse(text)
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "fsdplab.Cluster(" in line or line.lstrip().startswith(("%", "!"))]
    assert text.rstrip().endswith("script.end()")


def test_ranks_cells_run_inline_with_their_calls_written_out(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("world_size = 2", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_markdown_cell("## A heading\nprose that is not carried"),
        nbformat.v4.new_code_cell("%load_ext fsdplab\ncluster = fsdplab.Cluster(world_size).start()"),
        nbformat.v4.new_code_cell("%%ranks\nfrom fsdplab.ranks import rank, world_size, print0, first_ranks  # used\n"
                                  "x = torch.ones(2) * rank()\nprint0(world_size())"),
        nbformat.v4.new_code_cell("%%ranks -r 1\ny = 1"),
        nbformat.v4.new_code_cell("!echo {world_size}"),
        nbformat.v4.new_code_cell("open('f', 'w').write('x')", metadata={"tags": ["writes-files"]}),
    ])
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(nb, path)
    text = export_script(path, {"world_size": 3})
    ast.parse(text)
    assert "# ## A heading" in text and "prose" not in text
    assert "world_size = 3" in text                                   # -p as papermill injects it
    assert "# %load_ext fsdplab   (notebook only)" in text
    assert "cluster = script.Cluster(world_size).start()" in text
    assert 'if __name__ == "__main__":\n' in text                      # a worker process runs none of it
    assert "        x = torch.ones(2) * fsdplab.ranks.rank()" in text
    # the parameter world_size stays an int: the rank names are not imported into the script's one namespace
    assert "        import fsdplab.ranks; from fsdplab.ranks import first_ranks   # used" in text
    assert "        fsdplab.ranks.print0(fsdplab.ranks.world_size())" in text
    assert "if fsdplab.rank() in (1,):" in text and "            y = 1" in text
    assert "script.shell(f'echo {world_size}')" in text
    assert "for _turn in script.one_rank_at_a_time():\n        open('f', 'w').write('x')" in text


def test_a_cell_magic_a_script_cannot_run_is_named(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%%timeit\nx = 1")])
    nbformat.write(nb, tmp_path / "98_toy.ipynb")
    with pytest.raises(ValueError, match=r"cell 0 is a %%timeit cell"):
        export_script(tmp_path / "98_toy.ipynb")


def test_export_command_writes_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "02.py"
    assert main(["export", "02", "--out", str(out), "-p", "num_layers", "3"]) == 0
    assert "num_layers = 3" in out.read_text()
    assert "torchrun --standalone --nproc-per-node 2" in capsys.readouterr().out
    assert main(["export", "02", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["export", "02", "--out", str(tmp_path)]) == 2                 # a folder
    assert main(["export", "02", "-p", "num_layers", "three", "--out", str(tmp_path / "x.py")]) == 2


SCRIPT_CLUSTER = """
import json, sys
import torch, torch.distributed as dist
from fsdplab.runtime import script
script.begin()
cluster = script.Cluster(2).start()
x = torch.ones(1) * (dist.get_rank() + 1)
got = {"run": cluster.run(lambda: dist.get_rank() * 10), "pull": [t.item() for t in cluster.pull("x")],
       "only_1": cluster.run(lambda: "one", ranks=[1]), "backend": cluster.backend}
cluster.push(y=5)
for wrong in (lambda: script.Cluster(3), cluster.restart):
    try:
        wrong()
    except (ValueError, RuntimeError) as err:
        got.setdefault("refused", []).append(str(err).split(":")[0])
sys.stdout.write("RESULT " + json.dumps(got) + "\\n")
with script.ranks_output():
    print("from every rank")
cluster.stop()
script.end()
"""


def test_the_script_cluster_plays_the_notebook_cluster(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT_CLUSTER)
    proc, _ = _torchrun(script, 2, tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]   # rank 1 is quiet
    got = json.loads(line.split(" ", 1)[1])
    assert got["run"] == [0, 10] and got["pull"] == [1.0, 2.0] and got["only_1"] == ["one"]
    assert got["backend"] == "gloo"
    assert got["refused"] == ["this part of the lesson starts 3 ranks, and the script runs on 2",
                              "a script cannot restart its ranks"]
    assert "[rank 0] from every rank" in proc.stdout and "[rank 1] from every rank" in proc.stdout
    left = list((tmp_path / "tmp").glob("fsdplab*"))            # (torchrun keeps a torchelastic_* folder there)
    assert not left, f"the script left temporary folders behind: {left}"


def _executed(stem, executed_lessons, tmp_path):
    executed = executed_lessons / f"{stem}.ipynb"
    if not executed.exists():
        [(lesson, status, _, detail)] = run_lessons(lesson_paths([stem]), out_dir=tmp_path / "nb", progress=False)
        assert status == "ok", f"{lesson} failed at {detail}"
        executed = tmp_path / "nb" / f"{stem}.ipynb"
    return executed


def _notebook_records(stem, executed_lessons, tmp_path):
    return records.read(_executed(stem, executed_lessons, tmp_path))


@pytest.mark.notebook
@pytest.mark.parametrize("stem", ["02_prefetch", "09_training_loop"])
def test_the_exported_lesson_records_what_the_notebook_records(stem, tmp_path, executed_lessons, monkeypatch,
                                                               estimate_cache):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(estimate_cache))
    script = tmp_path / f"{stem}.py"
    script.write_text(export_script(lesson_paths([stem])[0]))
    proc, from_script = _torchrun(script, 2, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from_notebook = {r["name"]: r for r in _notebook_records(stem, executed_lessons, tmp_path)}
    from_script = {r["name"]: r for r in from_script}
    assert from_notebook, f"{stem}'s notebook recorded nothing"
    differ = {name: (rec.get("value", rec.get("ok")), (from_script.get(name) or {}).get("value"))
              for name, rec in from_notebook.items()
              if compare.status(rec, from_script.get(name)) not in (compare.SAME, compare.TIMING)}
    assert not differ, f"the script of {stem} records otherwise than its notebook: {differ}"


def test_sbatch_runs_one_torchrun_per_node(tmp_path, capsys):
    out = tmp_path / "lesson02.py"
    assert main(["export", "02", "--out", str(out), "--sbatch", "2", "--ranks-per-node", "8"]) == 0
    batch = (tmp_path / "lesson02.sbatch").read_text()
    assert "#SBATCH --nodes=2" in batch and "#SBATCH --gpus-per-node=8" in batch
    assert "--nnodes 2" in batch and "--nproc-per-node 8" in batch and '--rdzv-endpoint "$head:$port"' in batch
    assert batch.rstrip().endswith("lesson02.py")
    assert "sbatch" in capsys.readouterr().out
    assert subprocess.run(["bash", "-n", str(tmp_path / "lesson02.sbatch")]).returncode == 0   # valid shell
    assert main(["export", "02", "--out", str(out), "--sbatch", "2"]) == 2                      # exists: refused
    assert main(["export", "02", "--out", str(tmp_path / "c.py"), "--sbatch", "0"]) == 2
    assert main(["export", "02", "--out", str(tmp_path / "d.py"), "--sbatch", "1", "--cpu"]) == 0
    assert "gpus-per-node" not in (tmp_path / "d.sbatch").read_text()


# --- pasted by hand: the parameters cell and the %%ranks cells, nothing else ----------------------------------
# 05 restarts its ranks and changes their number, 11 is about the script itself (neither exports, see above);
# 01, 03, 04, 06, 07 and 08 pass functions to cluster.run, which only the export carries.
PASTED = ["00_start_here", "02_prefetch", "09_training_loop", "10_debugging", "12_lora_qlora", "13_compile_fsdp2"]


def pasted_script(path) -> str:
    """What a learner pastes into one file: the parameters cell, then every %%ranks cell's body in order, and what
    no cell has and every torchrun script does (lesson 11): joining the group first, leaving it last (a rank
    that exits while its peer still holds the group can abort gloo)."""
    cells = nbformat.read(path, as_version=4).cells
    parts = [c.source for c in cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    parts += [c.source.split("\n", 1)[1] for c in cells if c.cell_type == "code" and c.source.startswith("%%ranks")]
    return ('import torch.distributed as dist\ndist.init_process_group("gloo")\n\n' + "\n\n".join(parts)
            + "\n\ndist.barrier()\ndist.destroy_process_group()\n")


def _shown(lines) -> list:
    """Printed lines with paths (a run's folders differ) written as <path>, and the items of a printed set in
    order (a set of dtypes prints in another order in another process: "{torch.float32, torch.bfloat16}")."""
    def in_order(m):
        return "{" + ", ".join(sorted(item.strip() for item in m.group(1).split(","))) + "}"

    return [re.sub(r"\{([^{}:]+)\}", in_order, re.sub(r"/[^\s;,']+", "<path>", line)) for line in lines]


def _rank_0_lines(text: str) -> list:
    """The lines a %%ranks cell's output shows for rank 0: "[rank 0] x", or "[ranks 0-1] x" when ranks agree."""
    found = []
    for line in text.splitlines():
        m = re.match(r"\[ranks? ([\d,\- ]+)\] (.*)$", line)
        if m and any(part.strip().split("-")[0] == "0" for part in m.group(1).split(",")):
            found.append(m.group(2))
    return found


NUMBER = r"-?\d[\d,]*\.?\d*(?:e[+-]?\d+)?"


def _same_line(a: str, b: str, rel: float = 0.01) -> bool:
    """The same words, and numbers within `rel` of each other (09's init peak differs by 8 B of 1 MB, see its
    record's tolerance)."""
    if re.sub(NUMBER, "#", a) != re.sub(NUMBER, "#", b):
        return False
    pairs = zip(re.findall(NUMBER, a), re.findall(NUMBER, b))
    return all(math.isclose(float(x.replace(",", "")), float(y.replace(",", "")), rel_tol=rel) for x, y in pairs)


@pytest.mark.notebook
@pytest.mark.parametrize("stem", PASTED)
def test_ranks_cells_pasted_into_a_script_print_the_notebooks_numbers(stem, tmp_path, executed_lessons):
    path = lesson_paths([stem])[0]
    script = tmp_path / f"{stem}.py"
    script.write_text(pasted_script(path))
    proc, _ = _torchrun(script, 2, tmp_path, options=["--log-dir", str(tmp_path / "logs"), "--redirects", "3"])
    [rank_0_log] = (tmp_path / "logs").glob("*/attempt_0/0/stdout.log")
    assert proc.returncode == 0, rank_0_log.read_text()[-2000:] + proc.stderr[-3000:]
    from_script = _shown(rank_0_log.read_text().splitlines())
    cells = nbformat.read(_executed(stem, executed_lessons, tmp_path), as_version=4).cells
    from_notebook = _shown(line for c in cells if c.source.startswith("%%ranks") for out in c.outputs
                           if out.get("name") == "stdout" for line in _rank_0_lines(out["text"]))
    assert len(from_script) == len(from_notebook), (from_script, from_notebook)
    differ = [(a, b) for a, b in zip(from_script, from_notebook) if not _same_line(a, b)]
    assert not differ, f"the script printed otherwise than the notebook (script, notebook): {differ}"
