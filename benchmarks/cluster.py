"""How fast the lab's cluster is, next to torchrun: the whole process a user waits for (start, one all_reduce,
stop, exit), start-up with and without `fsdplab run`'s fork server, per-call overhead (collective record on and
off), hang detection, restart after a fault, stop, and a flood of output.

    python benchmarks/cluster.py [--world-size 2] [--calls 50] [--repeats 3] [--before COMMIT] [--start-only]

The first table times `python script.py` (fsdplab.Cluster with its defaults, one all_reduce) against `torchrun
--standalone` doing the same, as whole processes from the command's start to its exit, in alternating turns:
medians of wall time, CPU time (user+sys of the process and the processes it waited for) and peak RSS (its
largest process), and their ratios. --before COMMIT adds the same row for another commit's code (`git archive
COMMIT fsdplab`, unpacked in a temporary folder), measured in the same turns. --start-only prints that table
alone.

Timings depend on the machine and its load (printed before and after): run it on an idle machine, and compare
rows measured in the same run.
"""

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import psutil

import fsdplab
from fsdplab.runner import forkserver

# The same work for both launchers: start the ranks, one all_reduce, stop. The fsdplab script is what a user
# writes (the default backend, which on a machine without GPUs is gloo, like torchrun's script).
TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""
FSDPLAB_SCRIPT = """
import sys, fsdplab
with fsdplab.Cluster(int(sys.argv[1]), quiet=True) as cluster:
    cluster.execute("t = torch.ones(1); dist.all_reduce(t)", quiet=True)
"""


ROOT = str(Path(__file__).resolve().parent.parent)


def _whole_process(argv, code_root: str | None = None) -> tuple:
    """(wall seconds, CPU seconds, peak RSS in MiB) of one command, from its start to its exit. CPU is user+sys
    of the process and every process it waited for (the ranks, the controller); peak RSS is its largest
    process's, as /usr/bin/time reports it."""
    env = dict(os.environ, PYTHONPATH=code_root) if code_root else None
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=code_root)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here: Popen must not wait again
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}: {err.decode()[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def launcher_rows(world_size: int, repeats: int, before: str | None = None) -> list:
    """Start, one all_reduce and stop, timed as whole processes: torchrun, this tree's fsdplab and (with
    `before`) another commit's, in turns whose order rotates, so that each sees the same machine load.
    Rows: (name, wall, CPU, peak RSS, note), medians of `repeats`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from estimate import unpack   # the same `git archive` unpacking the estimator benchmark uses

    folder = Path(tempfile.mkdtemp(prefix="fsdplab-bench-"))
    (folder / "tr.py").write_text(TORCHRUN_SCRIPT)
    (folder / "lab.py").write_text(FSDPLAB_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                str(folder / "tr.py")]
    runs = {"torchrun": lambda: _whole_process(torchrun),
            "after": lambda: _whole_process([sys.executable, str(folder / "lab.py"), str(world_size)], ROOT)}
    if before:
        old = unpack(before, tempfile.mkdtemp(prefix="fsdplab-bench-before-"))
        runs["before"] = lambda: _whole_process([sys.executable, str(folder / "lab.py"), str(world_size)], old)
    measured = {name: [] for name in runs}
    names = list(runs)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            measured[name].append(runs[name]())
    median = {name: [statistics.median(m[k] for m in values) for k in range(3)]
              for name, values in measured.items()}
    t, f = median["torchrun"], median["after"]
    rows = [("torchrun: start, all_reduce, exit", *t, "whole process"),
            ("fsdplab: start, all_reduce, stop, exit", *f, "whole process, this tree"),
            ("fsdplab / torchrun", *(a / b for a, b in zip(f, t)), "ratios, target <= 1.0")]
    if before:
        b = median["before"]
        rows += [(f"fsdplab at {before[:12]}: the same", *b, "whole process"),
                 ("this tree / that commit", *(a / c for a, c in zip(f, b)), "ratios"),
                 ("that commit / torchrun", *(c / a for a, c in zip(t, b)), "ratios")]
    return rows


def forkserver_rows(world_size: int, repeats: int) -> list:
    """Start to ready group with ranks started from scratch and with ranks forked from a fork server (what
    `fsdplab run` does), in turns; and the CPU seconds the ranks spent getting there."""
    server = forkserver.start(tempfile.mkdtemp(prefix="fsdplab-bench-"))
    if server is None:
        return [("fork server", float("nan"), "not available on this platform")]
    path = os.environ[forkserver.ENV]
    forkserver.point_clusters_at(None)
    seconds, cpu = {False: [], True: []}, {False: [], True: []}
    try:
        for i in range(repeats + 1):   # the first round waits for the server's own imports: not counted
            for forked in (False, True):
                if forked:
                    forkserver.point_clusters_at(path)
                t = time.perf_counter()
                cluster = fsdplab.Cluster(world_size, backend="gloo", quiet=True, spares=False).start()
                elapsed = time.perf_counter() - t
                used = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in cluster.pids)
                cluster.stop()
                forkserver.point_clusters_at(None)
                if i:
                    seconds[forked].append(elapsed)
                    cpu[forked].append(used)
    finally:
        forkserver.stop(server)
    new, fork = statistics.median(seconds[False]), statistics.median(seconds[True])
    return [(f"start to ready, new rank processes (median of {repeats})", new, "in the kernel"),
            (f"start to ready, forked ranks (median of {repeats})", fork, f"fork server; ratio {fork / new:.2f}"),
            ("CPU seconds of all ranks to ready, new processes", statistics.median(cpu[False]), "median"),
            ("CPU seconds of all ranks to ready, forked", statistics.median(cpu[True]), "median")]


def _all_reduce_loop(n):
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    t = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return time.perf_counter() - t


def _timed(cluster, fn, *args) -> float:
    t = time.perf_counter()
    out = cluster.run(fn, *args, quiet=True)
    return time.perf_counter() - t if fn is not _all_reduce_loop else max(out) / args[0]


def record_rows(world_size: int, calls: int) -> list:
    """The collective record's cost: two clusters, record off and on, measured in turns (same load)."""
    clusters = {record: fsdplab.Cluster(world_size, backend="gloo", quiet=True, record_collectives=record).start()
                for record in (False, True)}
    noop, per_op = {False: [], True: []}, {False: [], True: []}
    try:
        for _ in range(calls):
            for record, cluster in clusters.items():
                noop[record].append(_timed(cluster, lambda: None))
        for _ in range(5):
            for record, cluster in clusters.items():
                per_op[record].append(_timed(cluster, _all_reduce_loop, 200))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    off, on = statistics.median(noop[False]), statistics.median(noop[True])
    op_off, op_on = statistics.median(per_op[False]), statistics.median(per_op[True])
    return [(f"no-op run, record off (median of {calls})", off, "target < 0.05 s"),
            (f"no-op run, record on (median of {calls})", on, f"{(on / off - 1) * 100:+.1f}% (target < +5%)"),
            ("1-float all_reduce on the ranks, record off", op_off, "median of 5 x 200"),
            ("1-float all_reduce on the ranks, record on", op_on, f"{(op_on / op_off - 1) * 100:+.1f}%")]


def fault_rows(world_size: int, hang_timeout: float) -> list:
    rows = []
    t = time.perf_counter()
    cluster = fsdplab.Cluster(world_size, backend="gloo", quiet=True).start()
    rows.append(("start to ready group (in the kernel)", time.perf_counter() - t, "target < 10 s"))

    t = time.perf_counter()
    try:
        cluster.execute("dist.all_reduce(torch.ones(1))", ranks=[0], timeout=hang_timeout, quiet=True)
    except fsdplab.RankHang:
        pass
    rows.append((f"hang detected and explained (timeout={hang_timeout:g} s)", time.perf_counter() - t,
                 f"target < {hang_timeout + 1:g} s"))
    t = time.perf_counter()
    cluster.restart()
    assert cluster.run(fsdplab.rank, quiet=True) == list(range(world_size))
    rows.append(("restart() after the hang", time.perf_counter() - t, "target <= 5 s"))

    t = time.perf_counter()
    try:
        cluster.execute("if rank() == 0:\n    raise ValueError('x')\ndist.barrier()", timeout=120, quiet=True)
    except fsdplab.RankError:
        pass
    rows.append(("raise on one rank, others in barrier -> RankError", time.perf_counter() - t,
                 "target: seconds, not the 120 s timeout"))
    cluster.restart()

    t = time.perf_counter()
    try:
        cluster.execute("import os\nif rank() == 0: os._exit(3)\ndist.barrier()", timeout=120, quiet=True)
    except fsdplab.RankDied:
        pass
    rows.append(("rank exits inside a collective -> RankDied", time.perf_counter() - t, "target < 1 s"))
    cluster.restart()

    sink = io.StringIO()
    t = time.perf_counter()
    with redirect_stdout(sink):
        cluster.quiet = False  # this row is about the echo
        cluster.execute("for i in range(100_000):\n    print('line', i)", timeout=300)
        cluster.quiet = True
    rows.append(("100,000 lines per rank reach the notebook", time.perf_counter() - t,
                 f"{sink.getvalue().count(chr(10)):,} lines shown for {100_000 * world_size:,} printed "
                 "(a line all ranks print at once is shown once)"))

    import _thread
    import threading

    threading.Timer(1.0, _thread.interrupt_main).start()
    t = time.perf_counter()
    try:
        cluster.execute("import time\nwhile True:\n    time.sleep(0.01)", timeout=120, quiet=True)
    except KeyboardInterrupt:
        pass
    rows.append(("interrupt a running cell (sent at 1.0 s)", time.perf_counter() - t,
                 "until KeyboardInterrupt in the kernel"))
    assert cluster.run(fsdplab.rank, quiet=True) == list(range(world_size))

    procs = [psutil.Process(p) for p in cluster._all_pids()]
    procs += [c for p in procs for c in p.children(recursive=True)]
    t = time.perf_counter()
    cluster.stop()
    left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    rows.append(("stop()", time.perf_counter() - t, f"processes left: {len(left)} of {len(procs)}"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=3.0)
    parser.add_argument("--before", help="a commit whose start to compare with, in the same run")
    parser.add_argument("--start-only", action="store_true", help="only the whole-process start rows")
    args = parser.parse_args()

    load = psutil.getloadavg()[0]
    rows = launcher_rows(args.world_size, args.repeats, args.before)
    _print_start(args, rows, load)
    if args.start_only:
        return
    rows = forkserver_rows(args.world_size, args.repeats)
    rows += record_rows(args.world_size, args.calls)
    rows += fault_rows(args.world_size, args.hang_timeout)
    _print(args, rows)


def _print_start(args, rows, load_before: float) -> None:
    print(f"\nWhole process, start to exit: world_size={args.world_size}, medians of {args.repeats} alternating "
          f"runs, {psutil.cpu_count()} CPU(s), load average {load_before:.1f} before, "
          f"{psutil.getloadavg()[0]:.1f} after")
    print(f"{'measure':<42} {'wall s':>7} {'CPU s':>7} {'peak RSS MiB':>12}  note")
    for name, wall, cpu, rss, note in rows:
        ratio = "ratio" in note
        print(f"{name:<42} {wall:7.2f} {cpu:7.2f} {rss:12.2f}  {note}" if ratio else
              f"{name:<42} {wall:7.2f} {cpu:7.2f} {rss:12.0f}  {note}")


def _print(args, rows) -> None:
    print(f"\nfsdplab cluster benchmark: world_size={args.world_size}, backend=gloo, "
          f"{psutil.cpu_count()} CPU(s), load average {psutil.getloadavg()[0]:.1f}")
    print(f"{'measure':<52} {'value':>9}  note")
    for name, value, note in rows:
        print(f"{name:<52} {value:9.4f}  {note}")


if __name__ == "__main__":
    main()
