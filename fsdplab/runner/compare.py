"""`fsdplab compare RUN_A RUN_B [--all]`: the records of two runs (CPU vs GPU, 2 vs 4 ranks, two releases) side by
side; what moved beyond its tolerance, and what only one run has. Records of tolerance "timing" are listed, never
flagged: they follow the machine's load."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import records as records_module

MOVED, ONLY_A, ONLY_B, TIMING, SAME = "moved", "only in A", "only in B", "timing", "same"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(a, b, tolerance) -> bool:
    """Whether value `b` stays within `tolerance` (relative; None: exact, 1e-6 for floats) of value `a`."""
    if _number(a) and _number(b):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        if tolerance is None:
            if isinstance(a, int) and isinstance(b, int):
                return a == b
            tolerance = records_module.FLOAT_TOLERANCE
        return abs(a - b) <= tolerance * max(abs(a), abs(b)) or a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tolerance) for k in a)
    return type(a) is type(b) and a == b


def status(a: dict | None, b: dict | None) -> str:
    """How record `b` (run B) stands against record `a` (run A) of the same name."""
    if b is None:
        return ONLY_A
    if a is None:
        return ONLY_B
    if a.get("kind") == "check" or b.get("kind") == "check":
        return SAME if (a.get("kind"), a.get("ok")) == (b.get("kind"), b.get("ok")) else MOVED
    tolerance = b.get("tolerance", a.get("tolerance"))
    if TIMING in (a.get("tolerance"), b.get("tolerance")):
        return TIMING
    return SAME if _close(a.get("value"), b.get("value"), tolerance) else MOVED


def _shown(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if rec.get("kind") == "check":
        return "ok" if rec.get("ok") else "FAILED"
    text = records_module.line(rec).split(" = ", 1)[1]
    return text if len(text) <= 28 else text[:25] + "..."


def _change(a: dict | None, b: dict | None) -> str:
    if a is None or b is None or not (_number(a.get("value")) and _number(b.get("value"))):
        return ""
    x, y = a["value"], b["value"]
    if x == 0:
        return "" if y == 0 else "new non-zero"
    return f"{(y - x) / abs(x):+.1%}"


def _tolerance(a: dict | None, b: dict | None) -> str:
    rec = b or a
    if rec.get("kind") == "check":
        return "check"
    tol = rec.get("tolerance")
    if tol is None:
        return "exact" if isinstance(rec.get("value"), (int, str, bool)) else "1e-06"
    return tol if isinstance(tol, str) else f"{tol:g}"


def load(path) -> tuple:
    """(records by lesson, run_info) of a run folder or its records.json; ValueError with one line when bad."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist: pass a folder that `fsdplab run --out` wrote, or its records.json.")
    lessons = records_module.read_run(path)
    file = path / "records.json" if path.is_dir() else path
    info = json.loads(file.read_text()).get("run_info") or {}
    return lessons, info


def rows(run_a, run_b, everything=False) -> list:
    """(lesson, name, A, B, change, tolerance, status) for each record that moved, is in one run only, or is a
    timing; `everything`: the unchanged ones too. In lesson order, then the order the lesson recorded them."""
    found = []
    for lesson in dict.fromkeys(list(run_a) + list(run_b)):
        a = records_module.by_name(run_a.get(lesson, []))
        b = records_module.by_name(run_b.get(lesson, []))
        for name in dict.fromkeys(list(a) + list(b)):
            state = status(a.get(name), b.get(name))
            if state != SAME or everything:
                found.append((lesson, name, _shown(a.get(name)), _shown(b.get(name)),
                              _change(a.get(name), b.get(name)), _tolerance(a.get(name), b.get(name)), state))
    return found


def _machine(info: dict) -> str:
    return ", ".join(f"{key} {info[key]}" for key in ("device", "torch", "date") if info.get(key)) or "machine unknown"


def compare(path_a, path_b, everything=False) -> int:
    """Print the table; 0 (what moved is information, not an error)."""
    run_a, info_a = load(path_a)
    run_b, info_b = load(path_b)
    print(f"A: {path_a} ({_machine(info_a)})")
    print(f"B: {path_b} ({_machine(info_b)})")
    table = rows(run_a, run_b, everything)
    flagged = sum(1 for row in table if row[-1] in (MOVED, ONLY_A, ONLY_B))
    total = len({(lesson, rec["name"]) for run in (run_a, run_b) for lesson, recs in run.items() for rec in recs})
    if not table:
        print(f"all {total} records agree within their tolerances")
        return 0
    head = ("lesson", "record", "A", "B", "change", "tolerance", "")
    widths = [max(len(str(row[i])) for row in [head, *table]) for i in range(len(head))]
    for row in [head, *table]:
        print("  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)).rstrip())
    timing = sum(1 for row in table if row[-1] == TIMING)
    print(f"\n{flagged} of {total} records moved beyond their tolerance or are in one run only"
          + (f"; {timing} timings listed, never flagged" if timing else ""))
    return 0


def compare_command(args) -> int:
    try:
        return compare(args.run_a, args.run_b, everything=args.all)
    except ValueError as e:
        import sys

        print(f"fsdplab compare: {e}", file=sys.stderr)
        return 2
