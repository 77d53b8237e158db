"""The cluster's second round: errors at the user's line, the hang explainer, early fault reports, threads,
interrupts, loopback-only sockets, and nothing left behind (processes, scratch folders) whatever dies first."""

import _thread
import io
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import fsdplab
from fsdplab.runtime.output import Echo
from fsdplab.runtime.tracebacks import format_frames, rank_list


def _raise_on_last_rank():
    if fsdplab.rank() == fsdplab.world_size() - 1:
        raise ValueError("a bad batch")
    return "fine"


def test_rank_error_starts_with_one_line_per_rank_and_shows_only_user_frames(cluster):
    with pytest.raises(fsdplab.RankError) as info:
        cluster.run(_raise_on_last_rank)
    text = str(info.value)
    first = text.splitlines()[0]
    assert first.startswith("rank 1: ValueError: a bad batch") and "test_cluster_faults.py" in first, text
    assert 'raise ValueError("a bad batch")' in text
    assert "ipyparallel" not in text and "fsdplab/runtime/" not in text and "fsdplab/ranks.py" not in text
    assert info.value.errors[1][0] == "ValueError"


def test_equal_errors_on_every_rank_are_shown_once(cluster):
    with pytest.raises(fsdplab.RankError) as info:
        cluster.execute("raise RuntimeError('same everywhere')")
    assert str(info.value).splitlines()[0].startswith("ranks 0-1: RuntimeError: same everywhere")
    assert sorted(info.value.errors) == [0, 1]


def test_system_exit_on_a_rank_is_a_rank_error_and_the_rank_lives(cluster):
    with pytest.raises(fsdplab.RankError, match="SystemExit"):
        cluster.execute("import sys\nif rank() == 0: sys.exit(3)")
    assert cluster.run(fsdplab.rank) == [0, 1]


def test_syntax_error_names_the_line(cluster):
    with pytest.raises(fsdplab.RankError) as info:
        cluster.execute("x = 1\ny = (\n", quiet=True)
    assert "SyntaxError" in str(info.value) and "line" in str(info.value)


def test_hang_says_which_collective_each_rank_is_in():
    with fsdplab.Cluster(2, backend="gloo", quiet=True) as c:
        c.execute("dist.all_reduce(torch.ones(3))")
        with pytest.raises(fsdplab.RankHang) as info:
            c.execute("dist.all_reduce(torch.ones(1))", ranks=[0], timeout=2)
        states = info.value.states
        assert states[0].startswith("rank 0 waits in all_reduce #2 (group of 2, 1 float32)"), states
        assert states[1].startswith("rank 1 finished all_reduce #1 (group of 2, 3 float32), now idle"), states
        assert "all_reduce" in info.value.stacks[0]
        c.restart()
        assert c.run(fsdplab.rank) == [0, 1]


def test_a_rank_raising_while_others_wait_in_a_collective_is_reported_at_once(fault_on_fresh_pair):
    # Long before the 120 s timeout (a RankHang would only come then).
    error = fault_on_fresh_pair("if rank() == 1:\n    raise SystemExit(2)\ndist.barrier()", fsdplab.RankError,
                                within=60, timeout=120)
    assert list(error.errors) == [1] and 0 in error.waiting
    assert "waits in barrier" in error.waiting[0]
    assert "restart" in str(error)


def test_a_rank_killed_while_idle_is_rank_died_at_the_next_call(assert_killed_rank_is_died_then_restarts):
    def wait_until_dead(pid):
        # Wait until it is dead without reaping it: the cluster's own wait reads its exit code.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)

    with fsdplab.Cluster(2, backend="gloo", quiet=True) as c:
        assert_killed_rank_is_died_then_restarts(c, wait_until_dead)


def test_timeouts_must_be_positive(cluster):
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ValueError, match="> 0"):
            cluster.run(fsdplab.rank, timeout=bad)
        with pytest.raises(ValueError, match="> 0"):
            cluster.execute("pass", timeout=bad)
    with pytest.raises(ValueError, match="> 0"):
        fsdplab.Cluster(2, timeout=0)
    assert cluster.run(fsdplab.rank) == [0, 1]  # nothing was sent, nothing broke


def test_a_world_size_the_machine_cannot_start_is_refused_before_anything_starts():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="world_size<="):
        fsdplab.Cluster(100000, backend="gloo")
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_threads_sharing_a_cluster_never_mix_results(cluster):
    def tagged(tag):
        import torch
        import torch.distributed as dist

        x = torch.tensor([float(tag)])
        dist.all_reduce(x)
        return x.item()

    wrong = []

    def worker(tag):
        for _ in range(15):
            out = cluster.run(tagged, tag, quiet=True)
            if out != [2.0 * tag] * 2:
                wrong.append((tag, out))

    threads = [threading.Thread(target=worker, args=(t,)) for t in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_nothing_listens_outside_loopback(cluster):
    procs = []
    for pid in cluster._all_pids():
        proc = psutil.Process(pid)
        procs += [proc] + proc.children(recursive=True)
    listening = [(p.pid, c.laddr) for p in procs for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "expected the store, gloo and the controller to listen"
    assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening


def test_stop_returns_when_every_process_and_the_scratch_folder_are_gone():
    c = fsdplab.Cluster(2, backend="gloo", quiet=True).start()
    procs = [psutil.Process(p) for p in c._all_pids()]
    procs += [child for p in procs for child in p.children(recursive=True)]
    workdir = c._group.workdir
    c.stop()
    assert [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not os.path.exists(workdir)


OWNER = """
import os, sys, time, fsdplab
c = fsdplab.Cluster(2, backend="gloo", quiet=True)
if sys.argv[1] == "during-start":
    # Killed after the engines are up and before they join the group.
    def report_then_wait(self):
        print(c._group.workdir, flush=True)
        time.sleep(120)
    fsdplab.Cluster._join_group = report_then_wait
c.start()
print(c._group.workdir, flush=True)
if sys.argv[1] == "gc":
    del c
    import gc; gc.collect()
    print("collected", flush=True)
time.sleep(120)
"""


def _processes_naming(workdir):
    found = []
    for proc in psutil.process_iter():
        try:
            if any(workdir in arg for arg in proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def _wait_until(predicate, seconds=20):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.2)
    return predicate()


@pytest.mark.parametrize("how", ["during-start", "after-start", "gc"])
def test_nothing_outlives_the_kernel_or_the_cluster_object(how, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(OWNER))
    owner = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    try:
        workdir = owner.stdout.readline().strip()
        assert workdir and _processes_naming(workdir), "the cluster's processes should be running"
        if how == "gc":
            assert owner.stdout.readline().strip() == "collected"
        else:
            owner.kill()  # SIGKILL: no atexit handler runs; the watcher must clean up
        assert _wait_until(lambda: not _processes_naming(workdir)), _processes_naming(workdir)
        assert _wait_until(lambda: not os.path.exists(workdir)), f"{workdir} was left behind"
    finally:
        owner.kill()
        owner.wait()


def test_interrupt_reaches_the_ranks_and_keeps_the_group(cluster):
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="still usable"):
        cluster.execute("import time\nfor i in range(600):\n    time.sleep(0.1)", timeout=120, quiet=True)
    assert time.monotonic() - t0 < 60
    assert cluster.run(fsdplab.rank) == [0, 1]


def test_interrupt_inside_a_collective_asks_for_a_restart(cluster):
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt, match="restart"):
        cluster.execute("dist.barrier()", ranks=[0], timeout=120, quiet=True)
    cluster.restart()
    assert cluster.run(fsdplab.rank) == [0, 1]


def test_many_lines_arrive_in_few_writes(cluster):
    class CountingWriter(io.StringIO):
        writes = 0

        def write(self, text):
            CountingWriter.writes += 1
            return super().write(text)

    out = CountingWriter()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        cluster.execute("for i in range(20000):\n    print('line', i)", timeout=120)
    finally:
        sys.stdout = sys_stdout
    # Every line of both ranks arrives (collapsed into one when the ranks printed it together).
    seen = {0: [], 1: []}
    for line in out.getvalue().splitlines():
        label, text = line.split("] ", 1)
        for r in ((0, 1) if label == "[ranks 0-1" else (int(label.split()[-1]),)):
            seen[r].append(text)
    assert seen[0] == seen[1] == [f"line {i}" for i in range(20000)]
    assert CountingWriter.writes < 2000  # batches, not one write per line


def test_echo_collapses_identical_lines_and_keeps_different_ones():
    class Result:
        def __init__(self, text):
            self.stdout, self.stderr = text, ""

    out = io.StringIO()
    echo = Echo(True, out=out)
    echo.update({r: Result("loss 2.31\nrank %d\n" % r) for r in range(8)}, final=True)
    assert out.getvalue().splitlines() == ["[ranks 0-7] loss 2.31"] + [f"[rank {r}] rank {r}" for r in range(8)]


def test_status_shows_each_rank(cluster, capsys):
    rows = cluster.status()
    assert [r["rank"] for r in rows] == [0, 1] and [r["pid"] for r in rows] == cluster.pids
    assert all(r["rss_bytes"] > 10 * 2**20 and r["running"] for r in rows)
    assert "RSS" in capsys.readouterr().out


def test_rank_lists_and_frames_read_well():
    assert rank_list([3]) == "rank 3" and rank_list([0, 1, 2]) == "ranks 0-2" and rank_list([0, 2]) == "ranks 0, 2"
    frames = [("/x/site-packages/ipyparallel/engine/kernel.py", 1, "do_apply", "exec(code)"),
              ("/home/me/train.py", 7, "step", "loss.backward()")]
    text = format_frames(frames)
    assert "ipyparallel" not in text and "/home/me/train.py:7, in step" in text


def test_status_magic_prints_the_table(cluster, capsys):
    from fsdplab.runtime.magics import status_magic

    status_magic("", {"c": cluster})
    out = capsys.readouterr().out
    assert "RSS" in out and str(cluster.pids[1]) in out


def test_line_numbers_count_the_sources_leading_blank_lines(cluster):
    # IPython drops leading blank lines before it compiles; the traceback shows the source as given.
    with pytest.raises(fsdplab.RankError) as info:
        cluster.execute("\n\nx = 1\nraise ValueError('here')\n", ranks=0)
    assert "line 4" in str(info.value).splitlines()[0]
    assert "raise ValueError('here')" in str(info.value)
