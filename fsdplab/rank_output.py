"""What the ranks print, shown in the notebook while a call runs: labelled, batched, and collapsed.

Each line is labelled with its rank (`[rank 3] ...`); the same line printed by several ranks at about
the same time is shown once (`[ranks 0-7] loss 2.31`). Lines are written in one batch per poll, not one
message per line: a rank that prints 100,000 lines would otherwise flood Jupyter with 100,000 messages.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from .tracebacks import rank_list

# A line waits this long for the same line from the other ranks before it is shown alone.
HOLD_S = 0.2
# At most this many lines per rank are kept waiting; beyond it they are shown at once.
MAX_PENDING = 2000


class Echo:
    """Prints each rank's new output, whole lines at a time, while a call runs."""

    def __init__(self, enabled: bool, ranks=None, out=None, err=None, view: str = "lines", world_size: int = 0):
        self.enabled = enabled
        self.view, self.world_size = view, world_size  # "tabs": not built yet, shown as lines
        self.seen: dict = {}          # (rank, stream) -> characters already taken
        self.partial: dict = {}       # (rank, stream) -> unfinished last line
        self.pending: dict = {}       # stream -> rank -> [(arrival time, line)]
        self.ranks = ranks
        self._out, self._err = out, err

    def update(self, results: dict, final: bool = False) -> None:
        """Take new text from each rank's result and print what is due (everything when final)."""
        if not self.enabled:
            return
        now = time.monotonic()
        for r, ar in sorted(results.items()):
            for stream in ("stdout", "stderr"):
                self._take(r, stream, _stream_text(ar, stream), now, final)
        for stream in ("stdout", "stderr"):
            self._flush(stream, now, final, expected=len(results))

    def _take(self, rank: int, stream: str, text: str, now: float, final: bool) -> None:
        key = (rank, stream)
        start = self.seen.get(key, 0)
        if len(text) == start and not final:
            return
        self.seen[key] = len(text)
        lines = (self.partial.get(key, "") + text[start:]).split("\n")
        # An unfinished last line waits until it ends, or until the call does.
        self.partial[key] = "" if final else lines.pop()
        if final and lines and not lines[-1]:
            lines.pop()
        if lines:
            self.pending.setdefault(stream, {}).setdefault(rank, deque()).extend((now, ln) for ln in lines)

    def _flush(self, stream: str, now: float, final: bool, expected: int) -> None:
        queues = {r: q for r, q in self.pending.get(stream, {}).items() if q}
        out = []
        while queues:
            first = min(queues)
            arrived, line = queues[first][0]
            same = [r for r, q in queues.items() if q[0][1] == line]
            overfull = any(len(q) > MAX_PENDING for q in queues.values())
            # Wait for the other ranks' copy of this line unless it is old, every rank has it, or the call ended.
            if not (final or overfull or len(same) >= expected or now - arrived >= HOLD_S):
                break
            for r in same:
                queues[r].popleft()
            out.append(f"[{rank_list(same)}] {line}")
            queues = {r: q for r, q in queues.items() if q}
        if out:
            target = (self._err or sys.stderr) if stream == "stderr" else (self._out or sys.stdout)
            target.write("\n".join(out) + "\n")
            target.flush()


def _stream_text(ar, name: str) -> str:
    try:
        value = getattr(ar, name)
    except Exception:  # noqa: BLE001 - a result object mid-update has no text yet
        return ""
    if isinstance(value, list):
        return value[0] if value else ""
    return value or ""
