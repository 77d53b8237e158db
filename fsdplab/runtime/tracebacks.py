"""Tracebacks from the ranks, told in the notebook's terms: `Cell In[N], line L`, the user's frames first.

A rank sends back the frames of its exception (fsdplab.runtime.on_rank.Failure). The kernel formats them: a frame
in code the notebook ran is named by its cell, as IPython does; the lab's own plumbing (ipyparallel,
fsdplab.runtime, fsdplab.ranks) is dropped; a run of library frames (torch, the standard library) shrinks
to its last frame and a count.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import types

# Frames that are the lab's plumbing, never the user's code.
_PLUMBING = re.compile(r"[/\\](ipyparallel|ipykernel|IPython|tornado|zmq|traitlets)[/\\]"
                       r"|[/\\]fsdplab[/\\]runtime[/\\](cluster|call|on_rank|magics)\.py$"
                       r"|[/\\]fsdplab[/\\]ranks\.py$|^<frozen runpy>$")
# Longest first: site-packages lives inside the standard library's folder.
_LIBRARY_ROOTS = tuple(sorted({os.path.realpath(p) + os.sep for p in
                               (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                sysconfig.get_paths()["stdlib"]) if p}, key=len, reverse=True))
_SOURCE_PREFIX = "<ranks source"   # filename of execute() source that came from no notebook cell


def _filename_map() -> dict:
    """IPython's filename -> execution count of every cell it compiled in this kernel ({} outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return getattr(getattr(shell, "compile", None), "_filename_map", None) or {}


def cell_of(filename: str):
    """The notebook execution count IPython compiled `filename` for, or None."""
    return _filename_map().get(filename)


def current_cell_filename():
    """The filename IPython compiled the running cell under (what its frames carry), or None.

    Read off the stack (the outermost frame of code compiled from a cell), not from `execution_count`: IPython
    9 counts that up before the cell runs, IPython 8 after."""
    mapping = _filename_map()
    found, frame = None, sys._getframe(1)
    while frame is not None and mapping:
        if frame.f_code.co_filename in mapping:
            found = frame.f_code.co_filename
        frame = frame.f_back
    return found


def location(filename: str, lineno: int) -> str:
    """`Cell In[N], line L` for notebook code, `line L of the code Cell In[N] ran on the ranks` for execute() text,
    else `file:L`."""
    cell = cell_of(filename)
    if cell is not None:
        return f"Cell In[{cell}], line {lineno}"
    if filename.startswith(_SOURCE_PREFIX):
        caller = re.search(r"from (Cell In\[\d+\])", filename)
        return f"line {lineno} of the code {caller.group(1) if caller else 'execute()'} ran on the ranks"
    return f"{filename}:{lineno}"


def _library(filename: str):
    """'torch', 'python' (the standard library), ... for a library frame; None for user code."""
    path = os.path.realpath(filename)
    if "fsdplab" in path.split(os.sep):
        return None
    for root in _LIBRARY_ROOTS:
        if path.startswith(root):
            rest = path[len(root):].split(os.sep)
            return "python" if "site-packages" not in root and "dist-packages" not in root else rest[0].split(".")[0]
    return None


def _source_line(filename: str, lineno: int, fallback: str) -> str:
    line = linecache.getline(filename, lineno).strip()
    return line or fallback.strip()


def user_frames(frames: list, collapse: bool = True) -> list:
    """The frames worth showing: plumbing dropped, each run of library frames cut to its last frame
    (all kept when not `collapse`).

    Returns (location, function, source line, skipped library frames before it, library name) tuples."""
    kept, skipped = [], []
    for filename, lineno, name, line in frames:
        if _PLUMBING.search(filename):
            continue
        lib = _library(filename) if collapse else None
        if lib is not None:
            skipped.append((filename, lineno, name, line, lib))
            continue
        if skipped:
            kept.append(_library_entry(skipped))
            skipped = []
        kept.append((location(filename, lineno), name, _source_line(filename, lineno, line), 0, None))
    if skipped:
        kept.append(_library_entry(skipped))
    return kept


def _library_entry(run: list):
    filename, lineno, name, line, lib = run[-1]
    return (f"{_short(filename)}:{lineno}", name, _source_line(filename, lineno, line), len(run) - 1, lib)


def _short(filename: str) -> str:
    """A library file relative to its install folder: torch/distributed/distributed_c10d.py."""
    path = os.path.realpath(filename)
    for root in _LIBRARY_ROOTS:
        if path.startswith(root):
            return path[len(root):]
    return filename


def innermost_user_location(frames: list):
    """Where in the user's code the exception came from (the newest non-library frame), or None."""
    for loc, _name, _line, _skipped, lib in reversed(user_frames(frames)):
        if lib is None:
            return loc
    return None


def format_frames(frames: list, indent: str = "  ", collapse: bool = True) -> str:
    """Frames as traceback text, oldest call first."""
    out = []
    for loc, name, line, skipped, lib in user_frames(frames, collapse):
        if skipped:
            out.append(f"{indent}... {skipped} more frame(s) in {lib}")
        out.append(f"{indent}{loc}, in {name}")
        if line:
            out.append(f"{indent}    {line}")
    return "\n".join(out)


def rank_list(ranks) -> str:
    """'rank 3', 'ranks 0-7', 'ranks 0, 2, 5': ranks written the short way."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return "ranks " + ", ".join(runs)


def group_same(items: dict) -> list:
    """[(ranks, value)] with ranks whose values are equal put together, in rank order."""
    groups: list = []
    for rank, value in sorted(items.items()):
        for ranks, seen in groups:
            if seen == value:
                ranks.append(rank)
                break
        else:
            groups.append(([rank], value))
    return groups


def describe_failures(failures: dict) -> tuple:
    """(summary lines, traceback blocks) for rank -> Failure; equal failures on several ranks are shown once."""
    keyed = {r: (f.ename, f.evalue, tuple(map(tuple, f.frames))) for r, f in failures.items()}
    summary, blocks = [], []
    for ranks, (ename, evalue, frames) in group_same(keyed):
        where = innermost_user_location(list(frames))
        first_line = (evalue.strip().splitlines() or [""])[0]
        summary.append(f"{rank_list(ranks)}: {ename}: {first_line}" + (f"  ({where})" if where else ""))
        body = format_frames(list(frames))
        blocks.append(f"--- {rank_list(ranks)} (most recent call last) ---\n"
                      + (body + "\n" if body else "") + f"{ename}: {evalue}".rstrip())
    return summary, blocks


def failure_text(failure) -> str:
    """One rank's failure as traceback text."""
    body = format_frames(failure.frames)
    return (body + "\n" if body else "") + f"{failure.ename}: {failure.evalue}".rstrip()



def _plumbing_frame(tb) -> bool:
    return bool(tb.tb_frame.f_locals.get("__tracebackhide__")) or bool(_PLUMBING.search(tb.tb_frame.f_code.co_filename))


# The line IPython runs for a `%%ranks` / `%ranks_status` cell: the whole cell as one string, not the learner's.
_MAGIC_CALL = re.compile(r"get_ipython\(\)\.run_(cell|line)_magic\('ranks(_status)?'")


def _magic_call_frame(tb) -> bool:
    """True for a cell's frame whose line is IPython's call of the lab's magic (the rank's error says the rest)."""
    code = tb.tb_frame.f_code
    return bool(_MAGIC_CALL.search(linecache.getline(code.co_filename, tb.tb_lineno)))


def _without_hidden(tb):
    """Traceback chain `tb` cut after its last frame that is the user's, not plumbing (a frame marked
    `__tracebackhide__`, IPython's own `run_cell_magic`): IPython hides marked frames before that one itself, but
    always shows the last frame, here the lab's own that raised. None when the only frame left is IPython's
    call of `%%ranks`."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    shown = [i for i, entry in enumerate(entries) if not _plumbing_frame(entry)]
    if shown and all(_magic_call_frame(entries[i]) for i in shown):
        return None
    if not shown:
        return entries[0] if entries else None
    chain = None
    for entry in reversed(entries[:shown[-1] + 1]):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def notebook_traceback(exc: BaseException) -> list:
    """IPython's traceback text for `exc` (a RankError, RankHang, RankDied): the user's own frames in the
    kernel, then the message, which holds each rank's error or stack."""
    from IPython import get_ipython

    shell = get_ipython()
    tb = _without_hidden(exc.__traceback__)
    if shell is None or not hasattr(shell, "InteractiveTB"):
        import traceback
        return traceback.format_exception(type(exc), exc, tb)
    return shell.InteractiveTB.structured_traceback(type(exc), exc, tb)
