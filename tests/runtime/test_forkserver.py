"""fsdplab.runner.forkserver: rank processes forked from one process that imported torch once (`fsdplab run`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

import fsdplab
import torch
from fsdplab.runner import cli
from fsdplab.runner import forkserver
from fsdplab.runtime.processes import PYTHON_COMMAND_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork servers run on Linux only")


@pytest.fixture()
def server(tmp_path):
    process = forkserver.start(str(tmp_path))
    assert process is not None and os.environ[forkserver.ENV] == str(tmp_path / "forkserver.sock")
    # clusters start their ranks through the server's client: the one thing the runtime knows of the runner
    assert json.loads(os.environ[PYTHON_COMMAND_ENV])[-1] == forkserver.CLIENT
    yield process
    forkserver.stop(process)
    assert forkserver.ENV not in os.environ and PYTHON_COMMAND_ENV not in os.environ


def _forks_of(server) -> list:
    return [p.pid for p in psutil.Process(server.pid).children()]


def _wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ranks_are_forks_that_take_the_kernels_environment(server, monkeypatch, tmp_path):
    monkeypatch.setenv("FSDPLAB_TEST_MARK", "from the kernel")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    with fsdplab.Cluster(2, spares=False, quiet=True) as c:
        assert set(c.pids) <= set(_forks_of(server)), "the ranks are not forks of the server"
        import torch.distributed as dist

        seen = c.run(lambda: (os.environ.get("FSDPLAB_TEST_MARK"), __import__("tempfile").gettempdir(),
                              os.environ.get("OMP_NUM_THREADS"), forkserver.ENV in os.environ,
                              "FSDPLAB_LAUNCHED_BY" in os.environ))
        assert seen == [("from the kernel", str(scratch), str(c.threads), True, False)] * 2
        # the server's imports are set aside (gc.freeze) before it forks: a rank's collections skip them
        frozen = c.run(lambda: (__import__("gc").isenabled(), __import__("gc").get_freeze_count()))
        assert all(enabled and count > 100_000 for enabled, count in frozen), frozen
        # what the first fully_shard imports is there already, and (torch without CUDA) what a LoRA model imports
        imported = c.run(lambda: [name in __import__("sys").modules for name in ("torch._dynamo", "peft")])
        assert imported == [[True, not torch.backends.cuda.is_built()]] * 2, imported
        assert c.run(lambda: (lambda t: (dist.all_reduce(t), t.item())[1])(__import__("torch").ones(1))) == [2.0, 2.0]
    _wait_for(lambda: not _forks_of(server))


def test_on_a_cuda_build_the_server_leaves_out_what_would_set_up_cuda_before_it_forks():
    # torchao's import (through peft and transformers) asks torch.cuda.is_available(), which on a CUDA build
    # sets up CUDA in the server; its forks could then use no GPU. Here a CPU build plays a CUDA one.
    code = ("import sys, torch\ntorch.backends.cuda.is_built = lambda: True\n"
            "from fsdplab.runner.forkserver import _warm\n_warm()\n"
            "print([name in sys.modules for name in ('torch._dynamo', 'torchao', 'peft', 'transformers')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    assert done.stdout.strip() == "[True, False, False, False]", done.stdout + done.stderr


def test_a_killed_fork_is_rank_died_with_its_signal(server, assert_killed_rank_is_died_then_restarts):
    with fsdplab.Cluster(2, spares=False, quiet=True) as c:
        # the server reaps its forks at once
        assert_killed_rank_is_died_then_restarts(c, lambda pid: _wait_for(lambda: not psutil.pid_exists(pid)))


def test_stand_in_passes_streams_exit_codes_and_signals(server):
    zen = subprocess.run(forkserver.command("this"), capture_output=True, text=True, timeout=60)
    assert zen.returncode == 0 and "Beautiful is better than ugly" in zen.stdout
    missing = subprocess.run(forkserver.command("json.tool") + ["/no/such/file"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "No such file" in missing.stderr   # argparse: exit 2
    sleeper = subprocess.Popen(forkserver.command("http.server") + ["0", "--bind", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: _forks_of(server))
    sleeper.terminate()   # SIGTERM to the stand-in reaches the fork, which ends by it
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    _wait_for(lambda: not _forks_of(server))


def test_an_uncaught_exception_goes_through_sys_excepthook_as_in_python(server, tmp_path):
    """torch.distributed's hook puts "[rankN]: " before each line of a rank's traceback, and torchrun's readers
    (lesson 11) look for it."""
    (tmp_path / "planted_raise.py").write_text(
        "import sys\nsys.excepthook = lambda kind, value, tb: print(f'HOOK {kind.__name__}: {value}', file=sys.stderr)"
        "\nraise ValueError('planted')\n")
    done = subprocess.run(forkserver.command("planted_raise"), capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == "HOOK ValueError: planted", done.stderr


def test_a_fork_dies_with_its_stand_in_and_with_the_server(server):
    first = subprocess.Popen(forkserver.command("http.server") + ["0", "--bind", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: len(_forks_of(server)) == 1)
    first.kill()   # a killed launcher (or a kernel's watcher killing it): the server kills the fork
    first.wait()
    _wait_for(lambda: not _forks_of(server))
    second = subprocess.Popen(forkserver.command("http.server") + ["0", "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: len(_forks_of(server)) == 1)
    fork = psutil.Process(_forks_of(server)[0])
    server.kill()   # the server gone: its forks go with it (PR_SET_PDEATHSIG), and the stand-in exits
    fork.wait(timeout=30)
    assert second.wait(timeout=30) != 0


def test_what_a_fork_forks_dies_with_it(server, tmp_path):
    """ipyparallel's controller forks its heart monitor with multiprocessing: a grandchild of the server that
    PR_SET_PDEATHSIG on the fork alone left running, re-parented to init, after a killed run."""
    (tmp_path / "forks_again.py").write_text(
        "import multiprocessing, time\n"
        "if __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,))\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(600)\n")
    client = subprocess.Popen(forkserver.command("forks_again"), cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    grandchild = psutil.Process(int(client.stdout.readline()))
    [fork] = [psutil.Process(pid) for pid in _forks_of(server)]
    assert grandchild.ppid() == fork.pid
    server.kill()   # the run is gone: the server, its fork, and the fork's own child with them
    fork.wait(timeout=30)
    grandchild.wait(timeout=30)
    client.wait(timeout=30)


def test_without_an_answering_server_ranks_start_as_usual(tmp_path, monkeypatch):
    monkeypatch.setenv(forkserver.ENV, str(tmp_path / "nobody-listens.sock"))
    monkeypatch.setenv(PYTHON_COMMAND_ENV, json.dumps([sys.executable, "-I", forkserver.CLIENT]))
    with fsdplab.Cluster(2, spares=False, quiet=True) as c:
        assert c.run(fsdplab.rank) == [0, 1]
        assert all(psutil.Process(pid).cmdline()[1:3] == ["-m", "fsdplab.runtime.engine"] for pid in c.pids)


def test_estimate_workers_are_forks_set_up_as_spawned_ones(server):
    """fsdplab.memory.workers under a fork server: each worker is a fork (no second import of torch and
    transformers), fed by multiprocessing's spawn pipes, in the background at the lowest priority, and gone when
    the pool stops; an estimate's progress lines come back as from a spawned worker."""
    from fsdplab.memory import estimate_elsewhere, estimate_here
    from fsdplab.memory.workers import Workers, forked_workers
    from fsdplab.settings import TrainSetting

    assert forked_workers()
    with Workers(2, background=True) as workers:
        facts = [workers.submit(fn, *args).result(timeout=60)
                 for fn, args in [(os.getppid, ()), (os.getsid, (0,)), (os.getpriority, (os.PRIO_PROCESS, 0))]]
        forks = _forks_of(server)
        assert facts[0] == server.pid and facts[1] in forks and facts[2] == 19, facts
    _wait_for(lambda: not set(forks) & set(_forks_of(server)))   # the pool stopped: its forks are gone
    lines = []
    report = estimate_elsewhere(estimate_here, TrainSetting(model="tiny", world_size=2, seq_len=64),
                                progress=lines.append)
    assert report.peak_bytes > 0 and lines, lines


def test_an_estimate_workers_fork_dies_with_the_process_that_started_it(server, tmp_path):
    (tmp_path / "starts_a_worker.py").write_text(
        "import os, time\n"
        "from fsdplab.memory.workers import Workers\n"
        "if __name__ == '__main__':\n"
        "    workers = Workers(1)\n"
        "    print(workers.submit(os.getpid).result(), flush=True)\n"
        "    time.sleep(600)\n")
    caller = subprocess.Popen([sys.executable, str(tmp_path / "starts_a_worker.py")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(Path(fsdplab.__file__).parents[1])})
    worker = psutil.Process(int(caller.stdout.readline()))
    assert worker.ppid() == server.pid
    caller.kill()   # a killed kernel: the fork server's client dies with it, and the server kills the fork
    worker.wait(timeout=30)
    caller.wait()


def test_without_an_answering_server_estimate_workers_are_spawned(tmp_path, monkeypatch):
    from fsdplab.memory.workers import Workers

    monkeypatch.setenv(forkserver.ENV, str(tmp_path / "nobody-listens.sock"))
    monkeypatch.setenv(PYTHON_COMMAND_ENV, json.dumps([sys.executable, "-I", forkserver.CLIENT]))
    with Workers(1) as workers:
        assert workers.submit(os.getppid).result(timeout=120) == os.getpid()   # the client became the worker


def test_a_pool_made_under_a_server_spawns_its_workers_once_the_server_is_gone(tmp_path, monkeypatch):
    from fsdplab.memory.workers import Workers

    monkeypatch.setenv(forkserver.ENV, str(tmp_path / "nobody-listens.sock"))
    monkeypatch.setenv(PYTHON_COMMAND_ENV, json.dumps([sys.executable, "-I", forkserver.CLIENT]))
    with Workers(1) as workers:   # made while a server ran; its workers start at the first task
        monkeypatch.delenv(PYTHON_COMMAND_ENV)   # the run's server stopped meanwhile (forkserver.stop unsets it)
        worker = psutil.Process(workers.submit(os.getpid).result(timeout=120))
        assert worker.ppid() == os.getpid() and "--multiprocessing-fork" in worker.cmdline()


def test_fsdplab_run_starts_one_server_forks_its_kernels_and_stops_it(tmp_path, monkeypatch):
    started, stopped = [], []
    real_start, real_stop = forkserver.start, forkserver.stop
    monkeypatch.setattr(forkserver, "start", lambda folder: started.append(real_start(folder)) or started[-1])
    monkeypatch.setattr(forkserver, "stop", lambda p: stopped.append(p) or real_stop(p))
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.environ.get('FSDPLAB_FORKSERVER'))"),
                nbformat.v4.new_code_cell("import psutil, sys\nprint(psutil.Process(os.getppid()).cmdline()[-2], "
                                          "'torch' in sys.modules)"),
                # the server imported ipywidgets before this kernel existed: its comm targets are registered all
                # the same (a reopened notebook's widgets ask for their state through them)
                nbformat.v4.new_code_cell("print(sorted(get_ipython().kernel.comm_manager.targets))")]
    paths = [tmp_path / "a.ipynb", tmp_path / "b.ipynb"]
    for path in paths:
        nbformat.write(nb, path)
    rows = cli.run_lessons(paths, tmp_path / "out", progress=False)
    assert [r[1] for r in rows] == ["ok", "ok"]
    assert len(started) == 1 and stopped == started and started[0].poll() is not None
    printed = [nbformat.read(tmp_path / "out" / p.name, 4).cells[0].outputs[0]["text"].strip() for p in paths]
    assert printed[0] == printed[1] and printed[0].endswith("forkserver.sock"), printed
    parents = [nbformat.read(tmp_path / "out" / p.name, 4).cells[1].outputs[0]["text"].strip() for p in paths]
    assert parents == ["import sys; from fsdplab.runner.forkserver import serve; serve(sys.argv[1]) True"] * 2, parents
    targets = nbformat.read(tmp_path / "out" / "a.ipynb", 4).cells[2].outputs[0]["text"].strip()
    assert targets == "['jupyter.widget', 'jupyter.widget.control']", targets
    assert forkserver.ENV not in os.environ


def test_a_run_where_a_server_runs_already_forks_from_it_and_leaves_it_running(server, tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "start", lambda folder: pytest.fail("the run started a second server"))
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os, psutil\nprint(psutil.Process(os.getppid()).pid)")]
    nbformat.write(nb, tmp_path / "a.ipynb")
    [row] = cli.run_lessons([tmp_path / "a.ipynb"], tmp_path / "out", progress=False)
    assert row[1] == "ok", row
    kernel_parent = int(nbformat.read(tmp_path / "out" / "a.ipynb", 4).cells[0].outputs[0]["text"])
    assert kernel_parent == server.pid                       # the kernel is a fork of the server that ran before
    assert server.poll() is None and forkserver.running() == str(tmp_path / "forkserver.sock")


def test_ranks_on_other_nodes_start_a_new_interpreter_there(monkeypatch, tmp_path):
    """The fork server forks on this machine: a Slurm or MPI rank started through it would run here, whatever
    node srun or mpiexec started its stand-in on (lesson 07's two Slurm nodes then shared one machine and its
    interface counters read 0). Those launchers take a new interpreter, even where `fsdplab run` set the
    command for this machine's ranks."""
    from traitlets.config import Config

    from fsdplab.runtime.launchers import Mpi, Slurm, mpi, slurm
    from fsdplab.runtime.processes import python_command

    monkeypatch.setenv(PYTHON_COMMAND_ENV, json.dumps([sys.executable, "-I", forkserver.CLIENT]))
    local = python_command("fsdplab.runtime.engine")
    assert local[:3] == [sys.executable, "-I", forkserver.CLIENT]
    fresh = [sys.executable, "-m", "fsdplab.runtime.engine"]
    monkeypatch.setattr(slurm, "batch_template", lambda plan: "#!/bin/sh\n")
    monkeypatch.setattr(mpi, "engine_settings", lambda ipp, env: ([], env))
    monkeypatch.setattr(mpi, "mpi_args", lambda plan, passed: [])
    for launcher, section in ((Slurm(nodes=2), "SlurmEngineSetLauncher"), (Mpi(), "MPIEngineSetLauncher")):
        ipp = type("Ipp", (), {"config": Config()})()
        ipp.config.LocalEngineSetLauncher.engine_cmd = local
        ipp.config.LocalEngineSetLauncher.engine_args = []
        launcher.configure(ipp, type("Plan", (), {"env": {}})(), {}, lambda name: str(tmp_path / name))
        assert ipp.config[section].engine_cmd == fresh, launcher
