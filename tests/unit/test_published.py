"""Published per-GPU peaks measured on real GPUs (fsdplab.memory.published.CASES, with their sources): the estimate of
each stays within the tolerance the case states, for the reason it states."""

import pytest

from fsdplab.memory.published import CASES, compare


IN_CI = [c for c in CASES if c.in_ci]     # the others: python benchmarks/published.py (it fails as this does)


@pytest.mark.parametrize("case", IN_CI, ids=[c.name for c in IN_CI])
def test_the_estimate_stays_within_the_stated_tolerance_of_a_published_peak(case):
    row = compare(case)
    print(f"{case.name}: measured {case.measured_gib} GiB {case.kind}, active {row['active_gib']:.2f} GiB "
          f"({row['active_error']:+.1%}), reserved {row['reserved_gib']:.2f} GiB ({row['error']:+.1%})")
    assert abs(row["error"]) <= case.tolerance, row
    # The allocator model is what brings a reserved figure within reach: the active peak alone is far below it.
    if case.kind == "reserved":
        assert abs(row["error"]) < abs(row["active_error"])
