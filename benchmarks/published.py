"""Published per-GPU peaks against the estimate: `python benchmarks/published.py` prints the markdown table of
fsdplab.memory.published.CASES (the data, with sources and tolerances). Each case is one full-scale estimate; it
exits 1 if one leaves its tolerance (CI's tests/unit/test_published.py checks the cases marked in_ci, this all).

`--h200` instead re-estimates the rows measured on an H200 (fsdplab.memory.gpu_measured) that CI does not (the 7B ones,
about 10 s each on 2 cores), checks each as tests/unit/test_gpu_measured.py checks the small ones, and prints them;
`--all` takes every comparable row."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdplab.memory import gpu_measured  # noqa: E402
from fsdplab.memory.published import CASES, compare, table  # noqa: E402


def h200(every: bool) -> int:
    failed = 0
    print("| case | allocated, measured | active now | error | drift | "
          "reserved, measured | reserved now | error | drift |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in gpu_measured.COMPARABLE:
        if row.in_ci and not every:
            continue
        r = gpu_measured.compare(row)
        ok = (abs(r["active_drift"]) <= gpu_measured.ESTIMATE_DRIFT
              and abs(r["reserved_drift"]) <= gpu_measured.ESTIMATE_DRIFT
              and abs(r["active_error"]) <= gpu_measured.ACTIVE_TOLERANCE
              and abs(r["reserved_error"]) <= gpu_measured.RESERVED_TOLERANCE)
        failed += not ok
        print(f"| {row.case}{'' if ok else ' FAILED'} | {r['allocated_gib']:.2f} | {r['active_gib']:.2f} | "
              f"{r['active_error']:+.1%} | {r['active_drift']:+.2%} | {r['reserved_measured_gib']:.2f} | "
              f"{r['reserved_gib']:.2f} | {r['reserved_error']:+.1%} | {r['reserved_drift']:+.2%} |", flush=True)
    print(f"\n{gpu_measured.summary()}")
    return 1 if failed else 0


if __name__ == "__main__":
    if "--h200" in sys.argv:
        sys.exit(h200("--all" in sys.argv))
    rows = []
    for case in CASES:
        rows.append(compare(case))
        print(f"{case.name}: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    for case in CASES:
        print(f"\n- {case.name}: {case.source}. Tolerance: {case.why}.")
    outside = [r["case"] for r in rows if abs(r["error"]) > r["tolerance"]]
    if outside:
        print(f"\noutside their tolerance: {', '.join(outside)}", file=sys.stderr)
        sys.exit(1)
