"""What the checkpoint checksums cost: a save records the SHA-256 of every file it wrote, a load verifies them.

    python benchmarks/checksums.py [--gib 1] [--repeats 3]

Prints a table: the lesson-sized sharded checkpoint (the tiny transformer with AdamW, saved and loaded in one
process) with the hashing time next to the save and load times, and the hash rate on a file of --gib GiB.
Timings depend on the machine and its load: compare rows of the same run.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from fsdplab import checkpoint as ck
from fsdplab import checksums
from fsdplab.models import TinyConfig


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, opt = ck.sharded_tiny(TinyConfig(), seed=0)
        ck.train_steps(model, opt, TinyConfig(), 1, global_batch=4)
        save = timed(lambda: ck.save_sharded(model, opt, root, step=1), args.repeats)
        folder = ck.latest_checkpoint(root)
        size = sum(p.stat().st_size for p in folder.iterdir())
        manifest = timed(lambda: checksums.write_manifest(folder), args.repeats)
        verify = timed(lambda: checksums.verify_folder(folder), args.repeats)
        load = timed(lambda: ck.load_sharded(model, opt, root), args.repeats)
        big = root / "big.bin"
        with open(big, "wb") as f:
            for _ in range(int(args.gib * 1024)):
                f.write(os.urandom(1 << 20))
        digest = timed(lambda: checksums.digest(big), args.repeats)
        print(f"{'what':46} {'seconds':>8} {'share':>7}")
        print(f"{f'lesson checkpoint ({size / 2**20:.1f} MiB): save_sharded':46} {save:8.3f}")
        print(f"{'  of which recording the checksums':46} {manifest:8.3f} {manifest / save:7.1%}")
        print(f"{'  load_sharded':46} {load:8.3f}")
        print(f"{'  of which verifying the checksums':46} {verify:8.3f} {verify / load:7.1%}")
        print(f"{f'SHA-256 of {args.gib:g} GiB':46} {digest:8.3f}   {args.gib / digest:.2f} GiB/s")


if __name__ == "__main__":
    main()
