"""Peak memory of each lesson at its default parameters: the kernel and every rank together.

    python benchmarks/lesson_memory.py [NOTEBOOK ...]

Runs each lesson with papermill in a child process and samples the memory of that process tree
(papermill, the kernel, the ranks, the controller) every 0.5 s: the sum of PSS (proportional set size:
a shared library page counted once across the processes that share it, which is what a container's
memory limit sees) and, for comparison, the sum of RSS (shared pages counted in every process).
Binder gives about 2 GB, so every lesson must stay below that in PSS. Prints a table.
"""

import subprocess
import sys
import tempfile
import threading
import time

import psutil

from fsdplab.runner.cli import lesson_paths

BINDER_BYTES = 2 * 1024 ** 3


def tree_memory(root: psutil.Process) -> tuple:
    """(sum of PSS, sum of RSS) over `root` and all its descendants, in bytes."""
    pss = rss = 0
    for proc in [root] + root.children(recursive=True):
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return pss, rss


def peak_of_lesson(path) -> tuple:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fsdplab.runner.cli", "run", str(path), "--out", out, "--no-progress"]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        root, peak = psutil.Process(child.pid), [0, 0]

        def sample():
            while child.poll() is None:
                pss, rss = tree_memory(root)
                peak[0], peak[1] = max(peak[0], pss), max(peak[1], rss)
                time.sleep(0.5)

        sampler = threading.Thread(target=sample)
        sampler.start()
        output = child.communicate()[0]
        sampler.join()
        status = "ok" if child.returncode == 0 else "FAILED"
        return status, time.perf_counter() - t0, tuple(peak), output


def main():
    rows = []
    for path in lesson_paths(sys.argv[1:]):
        status, seconds, (pss, rss), output = peak_of_lesson(path)
        rows.append((path.stem, status, seconds, pss, rss))
        print(f"{path.stem}: {status}, {seconds:.0f} s, peak PSS {pss / 1024**2:.0f} MiB", flush=True)
        if status != "ok":
            print(output[-2000:])
    print(f"\n{'lesson':<28} {'status':<7} {'seconds':>8} {'peak PSS MiB':>13} {'peak RSS MiB':>13}  fits 2 GB")
    for name, status, seconds, pss, rss in rows:
        print(f"{name:<28} {status:<7} {seconds:8.1f} {pss / 1024**2:13.0f} {rss / 1024**2:13.0f}  "
              f"{'yes' if pss < BINDER_BYTES else 'NO'}")


if __name__ == "__main__":
    main()
