"""Published per-GPU peaks against the estimate: `python benchmarks/published.py` prints the markdown table of
fsdplab.published.CASES (the data, with sources and tolerances). Each case is one full-scale estimate."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdplab.published import CASES, compare, table  # noqa: E402

if __name__ == "__main__":
    rows = []
    for case in CASES:
        rows.append(compare(case))
        print(f"{case.name}: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    for case in CASES:
        print(f"\n- {case.name}: {case.source}. Tolerance: {case.why}.")
