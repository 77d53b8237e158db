"""Where the lab's time goes: run the lessons as `fsdplab run` does and split each one's seconds by what its cells do.

    python benchmarks/lessons.py [LESSON ...] [--out DIR] [--world-size N] [-p NAME VALUE] [--cells N]
                                 [--no-forkserver]

Prints one row per lesson: its wall-clock seconds (kernel start and saving included), then papermill's
per-cell durations summed by what each cell does, read from the cell's source:

    cluster    starts or restarts ranks         (`Cluster(`, `.start(`, `restart`)
    estimates  exact (fake-tensor) estimates    (`estimate`, `exact`, `full_finetune_reports`, `sweep`)
    training   training steps                   (`train`)
    other      every other cell
    kernel     the rest of the wall clock: kernel start, papermill's bookkeeping

A cell that matches several groups counts in the first one listed; `--cells N` also lists each lesson's N
slowest cells. Estimates a lesson starts in the background (`sweep.start_estimates`) run while its other cells
do; the estimates column shows only the wait where the lesson collects them (`.result()`). The last line
compares the total with the lab's target: every lesson at its defaults in 4 minutes. Timings depend on the
machine and its load: compare runs made back to back (`--no-forkserver` is the reference without the run's
fork server, where every rank process imports torch itself).
"""

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from fsdplab.runner import forkserver
from fsdplab.runner.cli import _value, lesson_paths, run_lessons

TARGET_S = 240.0
GROUPS = {   # group -> what a cell's source (comments removed) contains; the first match wins
    "cluster": re.compile(r"Cluster\(|\.start\(|restart"),
    "estimates": re.compile(r"estimate|exact|full_finetune_reports|sweep"),
    "training": re.compile(r"train"),
}
COLUMNS = [*GROUPS, "other", "kernel"]


def group_of(source: str) -> str:
    code = re.sub(r"#.*", "", source)   # a comment that mentions training is not a training step
    return next((name for name, pattern in GROUPS.items() if pattern.search(code)), "other")


def timed_cells(executed: Path) -> list:
    """(seconds, group, cell number, first line) of each code cell papermill ran."""
    cells = json.loads(executed.read_text())["cells"] if executed.exists() else []
    timed = []
    for number, cell in enumerate(cells):
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell["cell_type"] == "code" and duration:
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            first = next((line.strip() for line in source.splitlines() if line.strip()), "")
            timed.append((duration, group_of(source), number, first))
    return timed


def split_seconds(timed: list, wall_s: float) -> dict:
    """Seconds of one executed notebook by group."""
    seconds = dict.fromkeys(COLUMNS, 0.0)
    for duration, group, _, _ in timed:
        seconds[group] += duration
    seconds["kernel"] = max(0.0, wall_s - sum(seconds.values()))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lessons", nargs="*", help="lesson names or notebook paths (default: all)")
    parser.add_argument("--out", default=None, help="folder for the executed notebooks (default: a temporary one)")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[])
    parser.add_argument("--cells", type=int, default=0, metavar="N", help="also list each lesson's N slowest cells")
    parser.add_argument("--no-forkserver", action="store_true",
                        help="start every rank process from scratch, as without `fsdplab run` (a reference)")
    args = parser.parse_args(argv)
    if args.no_forkserver:
        forkserver.start = lambda folder: None

    paths = lesson_paths(args.lessons)
    out = Path(args.out or tempfile.mkdtemp(prefix="fsdplab-bench-"))
    params = {name: _value(value) for name, value in args.parameter}
    rows = run_lessons(paths, out, args.world_size, params, progress=False)

    width = max(len(lesson) for lesson, *_ in rows)
    print(f"\nfsdplab lessons benchmark (executed notebooks in {out.resolve()})")
    print(f"{'lesson':<{width}}  {'seconds':>7}  " + "  ".join(f"{c:>9}" for c in COLUMNS) + "  status")
    totals = dict.fromkeys(["seconds", *COLUMNS], 0.0)
    slowest = []
    for (lesson, status, wall_s, detail), path in zip(rows, paths):
        timed = timed_cells(out / path.name)
        slowest += [(lesson, *cell) for cell in sorted(timed, reverse=True)[:args.cells]]
        split = split_seconds(timed, wall_s)
        for key, value in [("seconds", wall_s), *split.items()]:
            totals[key] += value
        print(f"{lesson:<{width}}  {wall_s:7.1f}  " + "  ".join(f"{split[c]:9.1f}" for c in COLUMNS)
              + f"  {status} {detail}".rstrip())
    print(f"{'total':<{width}}  {totals['seconds']:7.1f}  " + "  ".join(f"{totals[c]:9.1f}" for c in COLUMNS))
    if slowest:
        print("\nslowest cells (notebook cell index, counted from 0 in the executed notebook)")
        for lesson, seconds, group, number, first in slowest:
            print(f"{lesson:<{width}}  {seconds:7.1f}  {group:<9}  cell {number:<3} {first[:60]}")
    total = totals["seconds"]
    verdict = "within" if total <= TARGET_S else f"over by {total - TARGET_S:.0f} s"
    print(f"\ntotal {total:.0f} s = {total / 60:.1f} min against the {TARGET_S / 60:.0f}-minute target: {verdict}")
    return 0 if all(status == "ok" for _, status, *_ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
