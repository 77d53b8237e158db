"""How fast the lab's cluster is: start-up, per-call overhead, hang detection and recovery.

    python benchmarks/cluster.py [--world-size 2] [--calls 50]

Prints a table. Timings depend on the machine and its load: run it on an idle machine.
"""

import argparse
import statistics
import time

import fsdplab


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--hang-timeout", type=float, default=3.0)
    args = parser.parse_args()

    rows = []
    t0 = time.perf_counter()
    cluster = fsdplab.Cluster(args.world_size, quiet=True).start()
    rows.append(("start to ready group", time.perf_counter() - t0, "target < 10 s"))

    cluster.run(lambda: None)  # warm the path once
    samples = []
    for _ in range(args.calls):
        t = time.perf_counter()
        cluster.run(lambda: None, quiet=True)
        samples.append(time.perf_counter() - t)
    rows.append((f"no-op run, median of {args.calls}", statistics.median(samples), "target < 0.05 s"))

    t = time.perf_counter()
    try:
        cluster.execute("dist.all_reduce(torch.ones(1))", ranks=[0], timeout=args.hang_timeout, quiet=True)
    except fsdplab.RankHang:
        pass
    rows.append((f"hang detected (timeout={args.hang_timeout:g} s)", time.perf_counter() - t,
                 f"target < {args.hang_timeout + 5:g} s"))

    t = time.perf_counter()
    cluster.restart()
    assert cluster.run(lambda: fsdplab.rank(), quiet=True) == list(range(args.world_size))
    rows.append(("restart() after the hang", time.perf_counter() - t, "target < 15 s"))
    cluster.stop()

    print(f"\nfsdplab cluster benchmark: world_size={args.world_size}, backend={cluster.backend}")
    print(f"{'measure':<34} {'seconds':>9}  target")
    for name, seconds, target in rows:
        print(f"{name:<34} {seconds:9.3f}  {target}")


if __name__ == "__main__":
    main()
