"""What the kernel raises when ranks fail, and the text that explains it.

`RankError` (ranks raised), `RankHang` (a call outlived its timeout: each stuck rank's stack and the
collective it waits in), `RankDied` (a rank process exited, or its node stopped answering), plus the
helpers that turn rank records into those messages and into `Cluster.status()`'s table.
"""

from __future__ import annotations

import re
import signal

from . import introspect
from .tracebacks import describe_failures, group_same, rank_list

class _ShownInNotebook:
    """IPython shows these with the notebook's own frames only: the lab's frames that raised them mark
    themselves `__tracebackhide__`, and IPython would still show the last of them (the one that raised)."""

    def _render_traceback_(self) -> list:
        from .tracebacks import notebook_traceback

        return notebook_traceback(self)


class RankError(_ShownInNotebook, RuntimeError):
    """One or more ranks raised.

    `.errors` maps rank -> (exception name, message, traceback text); `.failures` rank -> the raw record
    (frames included); `.waiting` rank -> what a rank still running was doing (a collective it waits in
    for a failed rank, which leaves the group stuck)."""

    def __init__(self, errors: dict, failures: dict | None = None, waiting: dict | None = None):
        self.errors = dict(sorted(errors.items()))
        self.failures = dict(sorted((failures or {}).items()))
        self.waiting = dict(sorted((waiting or {}).items()))
        if self.failures:
            summary, blocks = describe_failures(self.failures)
        else:
            summary = [f"rank {r}: {name}: {msg}" for r, (name, msg, _) in self.errors.items()]
            blocks = [f"--- rank {r} ---\n{tb.rstrip()}" for r, (_, _, tb) in self.errors.items()]
        parts = list(summary)
        if self.waiting:
            parts.append("Meanwhile, " + "; ".join(self.waiting.values())
                         + ". They wait for the failed rank(s) forever: call cluster.restart().")
        super().__init__("\n".join(parts) + "\n\n" + "\n\n".join(blocks))


class RankHang(_ShownInNotebook, TimeoutError):
    """A call outlived its timeout. `.ranks`: ranks that did not finish; `.stacks`: rank -> Python stack;
    `.states`: rank -> one line on what it is doing (the collective it waits in, or finished last);
    `.collectives`: rank -> that collective as a dict (op, seq, group_size, sizes, dtypes, done);
    `.summary`: one line per group of ranks in the same state."""

    def __init__(self, ranks: list, stacks: dict, timeout: float, states: dict | None = None,
                 where: dict | None = None, collectives: dict | None = None):
        self.ranks, self.stacks, self.timeout = list(ranks), dict(stacks), timeout
        self.states = dict(sorted((states or {}).items()))
        self.collectives = dict(sorted((collectives or {}).items()))
        parts = [f"{rank_list(self.ranks)} did not finish within {timeout:g} s (a collective that only some "
                 "ranks entered, or work that needs a longer timeout=). The group is stuck: call "
                 "cluster.restart() to get a fresh one."]
        # Ranks in the same state share one line: `ranks 1-7 finished all_gather #2 (...), now idle`.
        same = group_same({r: line.split(" ", 2)[2] for r, line in self.states.items() if line.count(" ") >= 2})
        same.sort(key=lambda group: not set(group[0]) & set(self.ranks))  # the stuck ranks first
        # `.summary`: those lines alone, what a lesson prints when the stacks are not the point.
        same = [(ranks, _plural(rest) if len(ranks) > 1 else rest) for ranks, rest in same]
        self.summary = "\n".join(f"{rank_list(ranks)} {rest}" for ranks, rest in same)
        parts += [f"  {rank_list(ranks)} {rest}" for ranks, rest in same]
        for r in self.ranks:
            shown = (where or {}).get(r) or self.stacks.get(r, "(no stack captured)")
            parts.append(f"\n--- rank {r} is stuck here (most recent call last) ---\n" + shown.rstrip())
        super().__init__("\n".join(parts))


def _plural(state: str) -> str:
    """'waits in ...' -> 'wait in ...', 'has run ...' -> 'have run ...': a state shared by several ranks."""
    for one, many in (("waits ", "wait "), ("has ", "have ")):
        if state.startswith(one):
            return many + state[len(one):]
    return state


class RankDied(_ShownInNotebook, RuntimeError):
    """A rank process exited. `.exits` maps rank -> exit code (negative: killed by that signal; None:
    unknown); `.hosts` rank -> node, for ranks on another machine (lost contact: the launcher does not
    report their exit code)."""

    def __init__(self, exits: dict, hosts: dict | None = None):
        self.exits = dict(sorted(exits.items()))
        self.hosts = dict(hosts or {})
        described = []
        for r, code in self.exits.items():
            if code is None and r in self.hosts:
                described.append(f"rank {r} on {self.hosts[r]} (lost contact; exit status unknown)")
            elif code is None:
                described.append(f"rank {r} (exit status unknown)")
            elif code < 0:
                described.append(f"rank {r} (killed by signal {signal.Signals(-code).name})")
            else:
                described.append(f"rank {r} (exit code {code})")
        super().__init__("rank process died: " + ", ".join(described)
                         + ". The other ranks may be stuck in a collective: call cluster.restart().")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MACHINERY = re.compile(r"(ipykernel|IPython|ipyparallel|tornado|traitlets|asyncio|zmq)[/\\]|<frozen runpy>")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def stack_of_thread(dump: str, thread_id: int) -> str:
    """The block of a faulthandler dump that belongs to one thread, oldest call first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    wanted = f"0x{thread_id:016x}"
    for block in blocks:
        head, _, body = block.partition("\n")
        if wanted in head:
            # faulthandler lists the newest call first; drop the engine's own event-loop frames.
            lines = [ln.strip() for ln in body.splitlines()
                     if ln.strip().startswith("File") and not _MACHINERY.search(ln)]
            return "\n".join(reversed(lines))
    return dump.strip()


def is_failure(value) -> bool:
    from .on_rank import Failure

    return isinstance(value, Failure)


def failures_in(results: dict) -> dict:
    out = {}
    for r, ar in results.items():
        if ar.ready():
            try:
                value = ar.get(0)
            except Exception:  # noqa: BLE001 - reported when the call ends
                continue
            if is_failure(value):
                out[r] = value
    return out


def running_text(rank: int, state: dict, alive: bool) -> str:
    if not alive:
        return "dead"
    if not state:
        return "busy (did not answer)"
    return introspect.explain(rank, state).split(" ", 2)[2]


def status_table(rows: list) -> str:
    def gib(n):
        return "-" if n is None else f"{n / 2**30:.2f}"

    lines = [f"{'rank':>4} {'pid':>7} {'host':<14} {'device':<7} {'RSS GiB':>7} {'CUDA alloc/res GiB':>18}  now"]
    for row in rows:
        cuda = ("-" if row["cuda_allocated_bytes"] is None else
                f"{gib(row['cuda_allocated_bytes'])}/{gib(row['cuda_reserved_bytes'])}")
        lines.append(f"{row['rank']:>4} {row['pid']:>7} {row['host'][:14]:<14} {row['device']:<7} "
                     f"{gib(row['rss_bytes']):>7} {cuda:>18}  {row['running']}")
    return "\n".join(lines)

