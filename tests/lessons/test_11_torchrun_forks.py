"""Lesson 11's torchrun under `fsdplab run`: torchrun is a fork of the run's fork server and its ranks are plain
`python SCRIPT` processes, and torchrun does what it does unforked (the failing rank named as the root cause, a
stopped run's ranks gone); without a server the command runs as written."""

import os
import sys
import textwrap

import psutil
import pytest

from fsdplab.lessons import first_fsdp2_script as lesson
from fsdplab.runner import forkserver

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="fork servers run on Linux only")

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} of {dist.get_world_size()} starting, torchrun attempt "
          f"{os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    if "--fail" in sys.argv and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if "--hang" in sys.argv:
        time.sleep(600)
    total = torch.ones(1)
    dist.all_reduce(total)
    agent = os.getppid()
    agent_parent = int(open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()[1])
    print("RESULT " + json.dumps({"rank": rank, "sum": total.item(), "agent": agent, "agent_parent": agent_parent,
                                  "argv": sys.argv}), flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture()
def server(tmp_path):
    folder = tmp_path / "server"
    folder.mkdir()
    process = forkserver.start(str(folder))
    assert process is not None
    yield process
    forkserver.stop(process)


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_torchrun_is_a_fork_and_its_ranks_run_the_script_as_python_does(server, script):
    command = lesson.torchrun(script, 2, "--max-restarts", "0") + ["--flag", "x"]
    assert lesson.forked(command) == [sys.executable, "-I", forkserver.CLIENT, *command[2:]]
    run = lesson.launch(command, quiet=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(run.results) == [0, 1] and {r["sum"] for r in run.results.values()} == {2.0}
    assert {r["agent_parent"] for r in run.results.values()} == {server.pid}, "torchrun is not a fork of the server"
    assert all(r["argv"] == [str(script), "--flag", "x"] for r in run.results.values())
    assert run.command == command


def test_a_failing_rank_is_named_as_torchrun_names_it(server, script):
    run = lesson.launch(lesson.torchrun(script, 2) + ["--fail"], quiet=True)
    assert run.returncode != 0 and "[rank1]: RuntimeError: rank 1 fails on purpose" in run.stderr
    assert "  root cause rank: 1 (local_rank: 1)" in run.summary() and f"torchrun: {script} FAILED" in run.summary()


def test_a_timeout_stops_torchrun_and_its_forked_ranks(server, script):
    for timeout in (15, 60):        # both ranks must have started before the timeout: longer on a loaded machine
        run = lesson.launch(lesson.torchrun(script, 2) + ["--hang"], quiet=True, timeout=timeout)
        if run.starts == 2:
            break
    assert run.returncode == 124 and run.starts == 2, run.stdout
    left = [p for p in psutil.Process(server.pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline())[:100] for p in left]


def test_without_a_fork_server_the_command_runs_as_written(script, monkeypatch):
    monkeypatch.delenv(forkserver.ENV, raising=False)
    monkeypatch.delenv("FSDPLAB_PYTHON_COMMAND", raising=False)
    command = lesson.torchrun(script, 2)
    assert lesson.forked(command) == command
    run = lesson.launch(command, quiet=True)
    assert run.returncode == 0 and {r["agent_parent"] for r in run.results.values()} == {os.getpid()}


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "plain"])
def test_an_interrupt_stops_torchrun_and_its_ranks(forked, script, tmp_path, monkeypatch):
    """The learner interrupts the kernel while torchrun runs: the cell stops, and no rank is left running."""
    import signal
    import threading

    server = None
    if forked:
        (tmp_path / "server").mkdir()
        server = forkserver.start(str(tmp_path / "server"))
    else:
        monkeypatch.delenv(forkserver.ENV, raising=False)
        monkeypatch.delenv("FSDPLAB_PYTHON_COMMAND", raising=False)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ranks = []

    def interrupt_once_the_ranks_run():
        while len(ranks) < 2:
            ranks[:] = [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])
                        and "torch.distributed.run" not in " ".join(p.info["cmdline"])]
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_the_ranks_run, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            lesson.launch(lesson.torchrun(script, 2) + ["--hang"], quiet=True, timeout=120)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, [p.pid for p in alive]
        left = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert not [p for p in map(psutil.Process, left) if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        forkserver.stop(server)


def test_the_summary_counts_the_errors_each_restart_repeats():
    """With --max-restarts 1 every attempt fails alike: each error line is shown once, with how often it came
    (a peer's port differs between attempts); one attempt's lines carry no count."""
    def attempt(port):
        return ["[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: rank 1 fails at step 2",
                f"[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:{port}. A remote worker crashed."]

    twice = lesson.Run([], 1, 1.0, "", "\n".join(attempt(4765) + attempt(3472)))
    assert twice.summary() == ["[rank1]: RuntimeError: rank 1 fails at step 2  (x2)",
                               "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:4765. A remote worker "
                               "crashed.  (x2)"]
    once = lesson.Run([], 1, 1.0, "", "\n".join(attempt(4765)))
    assert once.summary() == [line.removesuffix("  (x2)") for line in twice.summary()]
