"""The cluster on real 2-rank gloo groups: results, output, errors, hangs, deaths, restarts, orphans."""

import io
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import fsdplab
from fsdplab.runtime.magics import ranks_magic


def _all_reduce_rank():
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(fsdplab.rank())])
    dist.all_reduce(x)
    return fsdplab.rank(), fsdplab.world_size(), str(fsdplab.device()), x.item()


def test_run_returns_one_value_per_rank_in_order(cluster):
    assert cluster.run(_all_reduce_rank) == [(0, 2, "cpu", 1.0), (1, 2, "cpu", 1.0)]


def test_run_passes_arguments_and_closures(cluster):
    offset = 100

    def add(a, b=0):
        return fsdplab.rank() + a + b + offset

    assert cluster.run(add, 1, b=2) == [103, 104]


def test_run_passes_classes_whose_methods_call_super(cluster):
    """A class defined in the notebook (here: in a function, which ships it by value too) reaches the ranks as
    itself: its methods' super() without arguments works there, and what it makes is an instance of it."""
    class Base:
        def value(self):
            return 1

    class Child(Base):
        def __init__(self):
            super().__init__()

        def value(self):
            return super().value() + fsdplab.rank()

    Base.__module__ = Child.__module__ = "__main__"        # as a notebook cell defines them

    def use(cls):
        made = cls()
        return made.value(), isinstance(made, cls)

    assert cluster.run(use, Child) == [(1, True), (2, True)]


def test_ranks_have_env_mesh_and_split_threads(cluster):
    def info():
        import os

        import torch

        return (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
                fsdplab.mesh().size(), torch.get_num_threads())

    out = cluster.run(info)
    assert [o[:4] for o in out] == [("0", "2", "0", 2), ("1", "2", "1", 2)]
    assert all(o[4] == max(1, (psutil.cpu_count() or 1) // 2) for o in out)


def test_execute_keeps_state_and_pull_reads_it(cluster):
    cluster.execute("value = rank() * 10 + 1", quiet=True)
    cluster.execute("value += 1", quiet=True)
    assert cluster.pull("value") == [2, 12]


def test_output_is_labelled_per_rank(cluster, capsys):
    cluster.run(lambda: print("hello", fsdplab.rank()))
    out = capsys.readouterr().out
    assert "[rank 0] hello 0" in out and "[rank 1] hello 1" in out


class _TimedWriter(io.StringIO):
    def __init__(self):
        super().__init__()
        self.events = []

    def write(self, text):
        self.events.append((time.monotonic(), text))
        return super().write(text)


def test_ranks_magic_streams_output_while_the_cell_runs(cluster, monkeypatch):
    writer = _TimedWriter()
    monkeypatch.setattr(sys, "stdout", writer)
    t0 = time.monotonic()
    ranks_magic("-t 30", "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')", {"c": cluster})
    t_end = time.monotonic()
    first = [t for t, text in writer.events if "first" in text]
    # The same line from both ranks is shown once, labelled with both.
    assert len(first) == 1 and "[ranks 0-1] first" in writer.getvalue(), writer.getvalue()
    assert first[0] < t_end - 1.0, "the first line appeared only when the cell ended"
    assert "[ranks 0-1] second" in writer.getvalue()
    assert t_end - t0 >= 2


def test_ranks_magic_subset_and_bad_options(cluster, capsys):
    ranks_magic("-r 1", "print('only me')", {"c": cluster})
    out = capsys.readouterr().out
    assert "[rank 1] only me" in out and "[rank 0]" not in out
    with pytest.raises(ValueError, match="-r takes"):
        ranks_magic("-r one", "pass", {"c": cluster})
    with pytest.raises(ValueError, match="ranks \\[5\\] do not exist"):
        ranks_magic("-r 5", "pass", {"c": cluster})


def test_exception_on_one_rank_is_rank_error_with_traceback(cluster):
    def fail():
        if fsdplab.rank() == 1:
            raise KeyError("missing-thing")
        return "ok"

    with pytest.raises(fsdplab.RankError) as info:
        cluster.run(fail)
    assert list(info.value.errors) == [1]
    name, _, tb = info.value.errors[1]
    assert name == "KeyError" and "missing-thing" in tb and "\x1b[" not in tb
    assert cluster.run(lambda: "still fine") == ["still fine", "still fine"]


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match=">= 1"):
        fsdplab.Cluster(0)
    with pytest.raises(ValueError, match="backend must be"):
        fsdplab.Cluster(2, backend="mpi")
    import torch

    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="one GPU per rank|needs GPUs"):
            fsdplab.Cluster(64, backend="nccl")


def test_run_needs_a_running_cluster():
    with pytest.raises(RuntimeError, match="start"):
        fsdplab.Cluster(2).run(lambda: 1)


def test_rank_helpers_refuse_the_kernel():
    with pytest.raises(RuntimeError, match="only works on a rank"):
        fsdplab.rank()


def test_kernel_never_initialises_cuda(cluster):
    import torch

    assert not torch.cuda.is_initialized()


def test_hang_is_reported_with_stack_then_restart_recovers(capsys):
    with fsdplab.Cluster(2, backend="gloo") as c:
        t0 = time.monotonic()
        with pytest.raises(fsdplab.RankHang) as info:
            c.execute("dist.all_reduce(torch.ones(1))", ranks=[0], timeout=3)
        # reported, not left hanging: the timeout, then the ranks' stacks collected (slow on a loaded machine)
        assert time.monotonic() - t0 < 3 + 30
        assert isinstance(info.value, TimeoutError)
        assert info.value.ranks == [0]
        assert "all_reduce" in info.value.stacks[0]
        old = c.pids
        with pytest.raises(RuntimeError, match="restart"):
            c.run(lambda: 1)
        capsys.readouterr()
        c.restart(quiet=True)                     # for a caller that reports the restart itself
        assert "ready" not in capsys.readouterr().out and not c.quiet
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old)
        assert [r[3] for r in c.run(_all_reduce_rank)] == [1.0, 1.0]
        c.restart()
        assert "rank(s) ready" in capsys.readouterr().out     # spares joined, or a full start


def test_dead_rank_is_reported_with_exit_code(fault_on_fresh_pair):
    died = fault_on_fresh_pair("import os\nif rank() == 1: os._exit(7)\ndist.barrier()", fsdplab.RankDied,
                               within=30, timeout=60)   # RankDied, long before a hang's 60 s
    assert died.exits == {1: 7}


def alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _wait_gone(pids, seconds=15):
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


SCRIPT = """
import gc, sys, time, fsdplab
c = fsdplab.Cluster(2, backend="gloo", quiet=True).start()
controller = c._group.ipp.controller.process
pids = c.pids + [controller.pid] + [p.pid for p in controller.children(recursive=True)]
print(" ".join(map(str, pids)), flush=True)
if sys.argv[1] == "gc":
    del c
    gc.collect()
    print("collected", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["gc", "kill-kernel"])
def test_no_orphans_when_collected_or_when_the_kernel_is_killed(how, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(SCRIPT))
    owner = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) >= 3 and not _wait_gone([], 0)
        if how == "gc":
            assert owner.stdout.readline().strip() == "collected"
        else:
            owner.kill()  # SIGKILL: no atexit handler runs; the watcher must clean up
        assert _wait_gone(pids) == []
    finally:
        owner.kill()
        owner.wait()


def test_engines_wait_for_their_registration_as_long_as_the_start():
    # ipyparallel's engine gives up after 5 s without the controller's answer: on a loaded machine its ranks quit
    # and the start failed only at start_timeout ("did not start within 120 s").
    with fsdplab.Cluster(1, backend="gloo", quiet=True, spares=False, start_timeout=77) as c:
        [engine] = [psutil.Process(pid).cmdline() for pid in c.pids]
    assert "--IPEngine.timeout=77" in engine, engine


def test_stop_ends_every_process():
    c = fsdplab.Cluster(2, backend="gloo", quiet=True).start()
    pids = c.pids + [c._group.ipp.controller.process.pid]
    c.stop()
    assert _wait_gone(pids) == []


def test_the_only_rank_dying_is_rank_died():
    with fsdplab.Cluster(1, backend="gloo", quiet=True) as c:
        with pytest.raises(fsdplab.RankDied) as info:
            c.execute("import os\nos._exit(5)", timeout=60)
        assert info.value.exits == {0: 5}
