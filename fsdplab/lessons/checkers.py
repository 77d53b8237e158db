"""The checker registry: each lesson module registers its exercises' checkers here, and `check` finds them.

A lesson registers a checker in its module with `@exercise("02-bytes")`; the learner calls
`check("02-bytes", answer)` (plus whatever measured values the checker needs, as keywords) and gets a verdict
with a hint. A checker compares the answer with the lab's own measurement or formula, never with a number
typed into the checker. Notebooks import `check` and `reveal` from `fsdplab.exercises`.

    @exercise("02-bytes")
    def _bytes(answer, *, measured):
        return close(answer, measured, rel=0.05, hint="count one all-gather in forward and one in backward")
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

_CHECKERS: dict = {}


@dataclass(frozen=True)
class Verdict:
    """What `check` answers: `ok` and a message (the hint when not ok). True in an `if` when ok."""

    key: str
    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return f"{self.key}: {'correct' if self.ok else 'not yet'} - {self.message}"

    __repr__ = __str__

    def _ipython_display_(self):
        """`check` printed the verdict already: a bare `check(...)` ending a cell shows it once, not twice."""


class _Line(str):
    """reveal's printed line, returned for tests; like a Verdict, not displayed a second time in a notebook."""

    def _ipython_display_(self):
        pass


def exercise(key: str):
    """Register `fn(answer, **measured) -> (ok, message)` as the checker of exercise `key` ("NN-name")."""
    def register(fn):
        if key in _CHECKERS and _CHECKERS[key] is not fn:
            raise ValueError(f"exercise {key!r} is registered twice ({_CHECKERS[key].__module__} and "
                             f"{fn.__module__}): give one of them another name.")
        _CHECKERS[key] = fn
        return fn
    return register


def _load_lessons(key: str | None = None) -> None:
    """Import the lesson module that registers exercise `key` ("02-bytes": lesson 02's module), or every lesson
    module when `key` is None; their @exercise decorators fill the registry."""
    from . import CODE_EXERCISES, MODULES

    numbers = [key[:2]] if key and key[:2] in MODULES else list(MODULES)
    for number in numbers:
        importlib.import_module(f"{__package__}.{MODULES[number]}")
        if number in CODE_EXERCISES:
            importlib.import_module(f"{__package__}.{CODE_EXERCISES[number]}")


def keys() -> list:
    """Every registered exercise, sorted (lesson number first)."""
    _load_lessons()
    return sorted(_CHECKERS)


def check(key: str, answer, /, **measured) -> Verdict:
    """Check `answer` to exercise `key`; prints the verdict (so a bare call in a cell shows it) and returns it."""
    _load_lessons(key)
    if key not in _CHECKERS:
        _load_lessons()         # a key with a typo in its number: name every exercise in the error
        import difflib

        close_keys = difflib.get_close_matches(key, _CHECKERS, n=3)
        hint = f" Did you mean {', '.join(map(repr, close_keys))}?" if close_keys else ""
        raise ValueError(f"no exercise {key!r}.{hint} Known: {', '.join(sorted(_CHECKERS))}.")
    if answer is None or answer is ...:
        verdict = Verdict(key, False, "no answer yet: replace the placeholder with your answer and run the cell again.")
    else:
        ok, message = _CHECKERS[key](answer, **measured)
        verdict = Verdict(key, bool(ok), message)
    print(verdict)
    return verdict


def first_line(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message (what a checker tells the learner)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def is_stub(fn) -> bool:
    """A function whose body is only a docstring and `...`: a code exercise's skeleton, not yet written."""
    import dis

    def stub():
        ...
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and ([(i.opname, i.argval) for i in dis.get_instructions(code)]
                                 == [(i.opname, i.argval) for i in dis.get_instructions(stub)])


def ranks_not_ready(cluster, stopped_when: str = "at its end") -> str | None:
    """Why a code exercise's checker cannot run the learner's code on the lesson's ranks now, and what to do;
    None when it can. `stopped_when` says where the lesson stops its cluster ("after section 3")."""
    if not cluster.running:
        return f"the ranks are stopped (the lesson stops them {stopped_when}): run cluster.start(), then this cell."
    if cluster.broken:
        return f"the ranks cannot run it ({cluster.broken.splitlines()[0]}): run cluster.restart(), then this cell."
    return None


def run_on_ranks(cluster, fn, *args, what: str = "your code", said=None, hang_hint: str = "", **kwargs) -> tuple:
    """Run a code exercise's check on the lesson's ranks: (each rank's result, None), or (None, one line that says
    why not: the ranks not ready, what `what` raised on how many ranks, a hang or a dead rank plus `hang_hint`).
    `said(message)` shortens a rank's error message (default: its first line). A group the check broke is
    restarted, so the cells after it still work."""
    from .. import RankDied, RankError, RankHang

    why = ranks_not_ready(cluster)
    if why:
        return None, why
    try:
        return cluster.run(fn, *args, **kwargs), None
    except RankError as err:
        name, message, _ = err.errors[min(err.errors)]
        line = said(message) if said else (str(message).strip().splitlines() or [""])[0]
        return None, f"{what} raised on {len(err.errors)} rank(s): {name}: {line}"
    except (RankHang, RankDied) as err:
        return None, f"the check did not finish: {str(err).strip().splitlines()[0]}{hang_hint}"
    except Exception as err:            # noqa: BLE001 - e.g. the learner's class cannot travel to the ranks
        return None, f"{what} raised: {first_line(err)}"
    finally:
        if cluster.running and cluster.broken:
            cluster.restart()


def close(answer, expected, *, rel: float = 0.05, hint: str = "", unit: str = "") -> tuple:
    """(ok, message) for a numeric answer within `rel` (relative) of `expected`."""
    if isinstance(answer, (bool, str)):      # float(True) is 1.0 and float("2") is 2.0: neither is an answer
        return False, f"expected a number, got {answer!r}."
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return False, f"expected a number, got {answer!r}."
    if not math.isfinite(value):
        return False, f"expected a finite number, got {value!r}."
    expected = float(expected)
    off = abs(value - expected) / max(abs(expected), 1e-300)
    if off <= rel:
        return True, f"{value:g}{unit} is within {rel:.0%} of the measured {expected:g}{unit}."
    direction = "high" if value > expected else "low"
    return False, f"{value:g}{unit} is {off:.0%} too {direction}." + (f" Hint: {hint}" if hint else "")


def reveal(prediction, measured, what: str, unit: str = "") -> str:
    """The line after a "predict, then run" prompt: the learner's prediction next to the measured value."""
    if prediction is None or prediction is ...:
        line = f"{what}: measured {measured:g}{unit} (no prediction made: set it before running next time)"
    else:
        off = (float(prediction) - measured) / measured if measured else float("inf")
        line = f"{what}: you predicted {float(prediction):g}{unit}, measured {measured:g}{unit} ({off:+.0%})"
    print(line)
    return _Line(line)
