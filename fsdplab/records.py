"""Regression records: the numbers a lesson measured and the checks it passed, kept in the executed notebook.

`record(name, value, unit)` in a lesson's cell stores one record in that cell's outputs; `check(name, ok, detail)`
stores a check and raises when it fails. `read(path)` gets them back from an executed notebook, from a run's
records.json (written by `fsdplab run`) or from a JSON-lines file; `fsdplab compare RUN_A RUN_B` lists what moved.
Scrapbook's glue convention (a JSON MIME bundle in a cell's outputs), done small: scrapbook 0.5.0 (2021, unmaintained)
imports pandas, pyarrow and six.

In a Jupyter kernel a record is one display output holding MIME_TYPE (the record dict) and a short text/plain line.
Outside a kernel (a torchrun script, a notebook's rank) only rank 0 (RANK unset or "0") records: one JSON line
appended to the file named by FSDPLAB_RECORDS, else a printed line `record NAME = VALUE UNIT`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path

MIME_TYPE = "application/vnd.fsdplab.record+json"
TIMING = "timing"            # tolerance of a record that depends on load: compare lists it, never flags it
FLOAT_TOLERANCE = 1e-6       # relative, for floats recorded without a tolerance
_NAME = re.compile(r"^\d\d-[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _plain(value, name: str):
    """`value` as JSON data (numpy and torch scalars become int/float; a NaN or an infinity, which JSON has no
    number for, the string "nan", "inf" or "-inf"); ValueError naming the record otherwise."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        # a kernel sends a record as JSON, and jupyter_client warns in the notebook on a NaN it cannot send
        return float(value) if math.isfinite(value) else str(float(value))
    if isinstance(value, (list, tuple)):
        return [_plain(v, name) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, name) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:   # a 0-d tensor or array
        return _plain(value.item(), name)
    raise ValueError(f"record {name}: a value of type {type(value).__name__} cannot be recorded; pass a number, "
                     f"string, bool, or a list/dict of those (a tensor: .item() or .tolist()).")


def _check_name(name) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"record name {name!r} is not of the form 'NN-short-key' (the lesson's number, a dash, a "
                         f"key of letters, digits, '-', '_' or '.'), e.g. '02-bytes'.")


def _shown(value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:,.4g}"
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    else:
        text = "[" + ", ".join(_shown(v) for v in value) + "]"
    return text if len(text) <= 80 else text[:77] + "..."


def line(rec: dict) -> str:
    """The one short line a record shows: `record 02-bytes = 1,234 B`, `check 02-order ok`."""
    if rec.get("kind") == "check":
        return f"check {rec['name']} " + ("ok" if rec["ok"] else f"FAILED: {rec.get('detail', '')}")
    unit = f" {rec['unit']}" if rec.get("unit") else ""
    return f"record {rec['name']} = {_shown(rec['value'])}{unit}"


def _in_kernel() -> bool:
    """A Jupyter kernel of the notebook itself (not one of its ranks, which have RANK set)."""
    if "RANK" in os.environ:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _emit(rec: dict) -> None:
    if _in_kernel():
        from IPython.display import display

        display({MIME_TYPE: rec, "text/plain": line(rec)}, raw=True)
        return
    if os.environ.get("RANK", "0") != "0":
        return
    path = os.environ.get("FSDPLAB_RECORDS")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(rec) + "\n")
    else:
        print(line(rec), flush=True)


def record(name, value, unit="", *, claim=None, tolerance=None, note=""):
    """Record a number the lesson measured or concluded; returns `value` unchanged.

    tolerance: relative tolerance for `fsdplab compare` (None: exact for ints, strings and bools, 1e-6 relative
    for floats); "timing" for a number that depends on the machine's load: compared runs list it, never flag it."""
    _check_name(name)
    if tolerance is not None and tolerance != TIMING:
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0:
            raise ValueError(f"record {name}: tolerance {tolerance!r} is neither a relative tolerance (a number "
                             f">= 0, e.g. 0.05) nor 'timing' (for a number that depends on load).")
        tolerance = float(tolerance)
    if claim is not None and (isinstance(claim, bool) or not isinstance(claim, numbers.Integral)):
        raise ValueError(f"record {name}: claim {claim!r} is not a claim number; pass an int (the posts' claim) "
                         f"or None.")
    rec = {"name": name, "kind": "value", "value": _plain(value, name), "unit": str(unit),
           "claim": None if claim is None else int(claim), "tolerance": tolerance, "note": str(note)}
    _emit(rec)
    return value


def check(name, ok, detail="") -> None:
    """Record a lesson's check; raises AssertionError(f"{name}: {detail}") when `ok` is false."""
    _check_name(name)
    rec = {"name": name, "kind": "check", "ok": bool(ok), "detail": str(detail)}
    _emit(rec)
    if not rec["ok"]:
        raise AssertionError(f"{name}: {detail}")


def from_notebook(nb) -> list:
    """The records in an executed notebook's outputs (a dict or nbformat node), in the order they were made."""
    found = []
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) or []:
            if out.get("output_type") in ("display_data", "execute_result") and MIME_TYPE in out.get("data", {}):
                rec = out["data"][MIME_TYPE]
                found.append(json.loads(rec) if isinstance(rec, str) else dict(rec))
    return found


def read_run(path) -> dict:
    """A run's records.json as {lesson: [records...]}; ValueError with one line when it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / "records.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: run the lessons first (`fsdplab run --out {path.parent}`), "
                         f"which writes it.") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}): run the lessons again to rewrite it.") from None
    if not isinstance(data, dict) or not isinstance(data.get("lessons"), dict):
        raise ValueError(f"{path} is not a run's records.json (no 'lessons' map): pass a folder `fsdplab run` "
                         f"wrote.")
    return data["lessons"]


def read(path) -> list:
    """The records in an executed .ipynb, a run's records.json (each record gains "lesson"), or a JSON-lines file."""
    path = Path(path)
    if path.is_dir() or path.name == "records.json":
        return [dict(rec, lesson=lesson) for lesson, recs in read_run(path).items() for rec in recs]
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read records from {path} ({e.strerror}): pass an executed notebook, a "
                         f"records.json or a JSON-lines file.") from None
    if path.suffix == ".ipynb":
        try:
            return from_notebook(json.loads(text))
        except ValueError:
            raise ValueError(f"{path} is not a notebook (not JSON): pass an executed lesson notebook.") from None
    records = []
    for number, row in enumerate(text.splitlines(), 1):
        if row.strip():
            try:
                rec = json.loads(row)
            except ValueError:
                raise ValueError(f"{path} line {number} is not a JSON record: pass a file that record() "
                                 f"appended to (FSDPLAB_RECORDS).") from None
            records.append(rec)
    return records


def by_name(records) -> dict:
    """{name: record}; where a name is recorded twice (a cell run again), the later record."""
    return {rec["name"]: rec for rec in records}
