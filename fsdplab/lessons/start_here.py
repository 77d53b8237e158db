"""Lesson 00 (start here): the checker of its exercise on collective sequence numbers."""

from __future__ import annotations

from .checkers import exercise


@exercise("00-hang-seq")
def _hang_seq(answer, *, measured):
    """The sequence number of the collective rank 0 waits in, against the one RankHang reported."""
    if isinstance(answer, bool):  # int(True) is 1: a yes/no is no sequence number
        return False, f"expected a whole number (a collective's sequence number), got {answer!r}."
    try:
        value = int(answer)
    except (TypeError, ValueError):
        return False, f"expected a whole number (a collective's sequence number), got {answer!r}."
    if value != answer:
        return False, f"expected a whole number, got {answer!r}."
    if value == measured:
        return True, (f"rank 0 waits in collective #{measured}: every collective a group runs, on every "
                      "rank, takes the next number, so the ranks agree on which call is which.")
    if value == measured - 1:
        hint = "that is the last one every rank finished; rank 0 is stuck in the next one."
    elif value < measured:
        hint = "count every collective the group ran since the restart, hello's all_reduce included."
    else:
        hint = "count only collectives this group ran since the restart (a restart starts from #1)."
    return False, f"{value} is not the number RankHang reports. Hint: {hint}"
