"""What the ranks print, shown in the notebook while a call runs: labelled, batched, and collapsed.

Each line is labelled with its rank (`[rank 3] ...`); the same line printed by several ranks at about
the same time is shown once (`[ranks 0-7] loss 2.31`). Lines are written in one batch per poll, not one
message per line: a rank that prints 100,000 lines would otherwise flood Jupyter with 100,000 messages.

With `Cluster(..., output="tabs")` (or `%%ranks --tabs`) each call instead shows one ipywidgets Tab with
a tab per rank, holding that rank's last TAB_LINES lines (stderr marked), redrawn at most every
TAB_REFRESH_S. Tabs need a frontend that renders widgets (JupyterLab); everywhere else (papermill and
`fsdplab run`, terminals, scripts) the labelled lines are shown, with a one-line note the first time.
"""

from __future__ import annotations

import html
import importlib.util
import os
import sys
import time
from collections import deque

from .tracebacks import rank_list

# A line waits this long for the same line from the other ranks before it is shown alone.
HOLD_S = 0.2
# At most this many lines per rank are kept waiting; beyond it they are shown at once.
MAX_PENDING = 2000
# A rank's tab keeps its last this-many lines; earlier ones are counted and noted, not kept (a tab
# holding 100,000 lines would make every redraw send megabytes to the browser).
TAB_LINES = 2000
# While a call runs, the tabs are redrawn at most this often (and once more when it ends).
TAB_REFRESH_S = 0.1

_fallback_said = False  # the "tabs shown as lines here" note is printed once per process


class Echo:
    """Prints each rank's new output, whole lines at a time, while a call runs."""

    def __init__(self, enabled: bool, out=None, err=None, view: str = "lines"):
        self.enabled = enabled
        self.seen: dict = {}          # (rank, stream) -> characters already taken
        self.partial: dict = {}       # (rank, stream) -> unfinished last line
        self.pending: dict = {}       # stream -> rank -> [(arrival time, line)]
        self._out, self._err = out, err
        self.tabs: RankTabs | None = None  # made when the first line arrives
        self._use_tabs = enabled and view == "tabs" and _tabs_possible(out)

    def update(self, results: dict, final: bool = False) -> None:
        """Take new text from each rank's result and print what is due (everything when final)."""
        if not self.enabled:
            return
        now = time.monotonic()
        for r, ar in sorted(results.items()):
            for stream in ("stdout", "stderr"):
                lines = self._new_lines(r, stream, _stream_text(ar, stream), final)
                if not lines:
                    continue
                if not self._use_tabs:
                    self.pending.setdefault(stream, {}).setdefault(r, deque()).extend((now, ln) for ln in lines)
                    continue
                if self.tabs is None:
                    # Made at the first line: each widget is a message to the browser and lives in the
                    # kernel until closed, so a call that prints nothing makes none.
                    self.tabs = RankTabs(sorted(results))
                self.tabs.add(r, lines, stderr=stream == "stderr")
        if not self._use_tabs:
            for stream in ("stdout", "stderr"):
                self._flush(stream, now, final, expected=len(results))
        elif self.tabs is not None:
            self.tabs.draw(now, final)

    def _new_lines(self, rank: int, stream: str, text: str, final: bool) -> list:
        """The whole lines of `text` not taken before (and, when final, the unfinished last one)."""
        key = (rank, stream)
        start = self.seen.get(key, 0)
        if len(text) == start and not final:
            return []
        self.seen[key] = len(text)
        lines = (self.partial.get(key, "") + text[start:]).split("\n")
        # An unfinished last line waits until it ends, or until the call does.
        self.partial[key] = "" if final else lines.pop()
        if final and lines and not lines[-1]:
            lines.pop()
        return lines

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


class RankTabs:
    """One ipywidgets Tab for one call: a tab per rank ("rank N") with that rank's last lines.

    Lines are only stored by `add`; `draw` sends them, one widget update per rank whose text changed,
    at most every TAB_REFRESH_S, so the number of messages does not grow with the number of lines."""

    def __init__(self, ranks: list, max_lines: int | None = None):
        import ipywidgets as widgets

        max_lines = TAB_LINES if max_lines is None else max_lines
        self.ranks = list(ranks)
        self.lines = {r: deque(maxlen=max_lines) for r in self.ranks}   # (is stderr, text)
        self.dropped = dict.fromkeys(self.ranks, 0)                     # lines no longer kept
        self.pages = {r: widgets.HTML() for r in self.ranks}
        self.widget = widgets.Tab(children=[self.pages[r] for r in self.ranks],
                                  titles=[f"rank {r}" for r in self.ranks])
        self._changed: set = set()
        self._drawn_at = None
        self.shown = False

    def add(self, rank: int, lines: list, stderr: bool = False) -> None:
        kept = self.lines[rank]
        self.dropped[rank] += max(0, len(kept) + len(lines) - kept.maxlen)
        kept.extend((stderr, line) for line in lines[-kept.maxlen:])
        self._changed.add(rank)

    def draw(self, now: float, final: bool = False) -> None:
        """Show the tab (the first time a rank printed) and update the ranks whose text changed."""
        recent = self._drawn_at is not None and now - self._drawn_at < TAB_REFRESH_S
        if not self._changed or (recent and not final):
            return
        if not self.shown:
            _display(self.widget)
            self.shown = True
        for r in sorted(self._changed):
            self.pages[r].value = _page_html(self.lines[r], self.dropped[r])
        self._changed.clear()
        self._drawn_at = now

    def text(self, rank: int) -> str:
        """What the rank's tab shows, as plain text (for tests and for reading it back)."""
        note = [f"… {self.dropped[rank]} earlier lines not shown"] if self.dropped[rank] else []
        return "\n".join(note + [("[stderr] " if err else "") + line for err, line in self.lines[rank]])


def _page_html(lines, dropped: int) -> str:
    rows = [f'<span style="color:#888">… {dropped} earlier lines not shown</span>'] if dropped else []
    for err, line in lines:
        text = html.escape(line)
        rows.append(f'<span style="color:#c62828">[stderr] {text}</span>' if err else text)
    # A fixed height with its own scroll bar, so a talkative rank does not push the notebook down;
    # column-reverse keeps the scroll position at the newest line, as a terminal would (flex:none and
    # overflow:visible stop JupyterLab's own <pre> style from making the <pre> the scrolling box).
    return ('<div style="max-height:24em;overflow:auto;display:flex;flex-direction:column-reverse">'
            '<pre style="flex:none;margin:0;font-size:12px;line-height:1.3;overflow:visible">'
            + "\n".join(rows) + "</pre></div>")


def _display(widget) -> None:
    from IPython.display import display

    display(widget)


def widgets_missing() -> str | None:
    """None where a Tab renders as a live widget; otherwise why it would not, in a few words.

    A kernel alone is not enough: papermill runs one too, and a Tab it executes is saved as a widget
    model that GitHub and nbconvert show as `Tab(...)`. JupyterLab (any Jupyter server) starts its
    kernels with JPY_SESSION_NAME set; papermill and `fsdplab run` (which sets FSDPLAB_OUT) do not."""
    if os.environ.get("FSDPLAB_OUT"):
        return "this notebook is executed by `fsdplab run`"
    try:
        from IPython import get_ipython
    except ImportError:
        return "not in a Jupyter kernel"
    shell = get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return "not in a Jupyter kernel"
    if not os.environ.get("JPY_SESSION_NAME"):
        return "this kernel was not started by JupyterLab (papermill, a console)"
    if importlib.util.find_spec("ipywidgets") is None:
        return "ipywidgets is not installed (pip install ipywidgets)"
    return None


def _tabs_possible(out) -> bool:
    """Whether tabs can be shown here; says once per process why not when they cannot."""
    global _fallback_said
    reason = widgets_missing()
    if reason is not None and not _fallback_said:
        _fallback_said = True
        target = out or sys.stdout
        target.write(f"(output='tabs' is shown as labelled lines here: {reason}; tabs need JupyterLab.)\n")
        target.flush()
    return reason is None


def _stream_text(ar, name: str) -> str:
    try:
        value = getattr(ar, name)
    except Exception:  # noqa: BLE001 - a result object mid-update has no text yet
        return ""
    if isinstance(value, list):
        return value[0] if value else ""
    return value or ""
