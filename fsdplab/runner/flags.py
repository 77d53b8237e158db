"""Checks of the command line's flags before anything runs: output folders and files, lists of numbers. Each
refusal is one line with the fix."""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_folder(flag: str, folder: Path, paths=()) -> Path:
    """Make `folder` (an output folder) or refuse it before anything runs: one line with the fix."""
    folder = Path(folder).expanduser().resolve()
    for path in paths:
        if Path(path).resolve().parent == folder:
            raise ValueError(f"{flag} {folder} is where the lesson {Path(path).name} lives: the executed copy would "
                             f"replace it. Choose another folder (the default is runs).")
    for above in (folder, *folder.parents):
        if above.exists() and not above.is_dir():
            raise ValueError(f"{flag} {folder}: cannot write there ({above} is a file, not a "
                             f"folder); choose a folder you can write to.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".fsdplab-write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {folder}: cannot write there ({err.strerror or err}); choose a folder you can "
                         f"write to.") from None
    return folder


def positive_ints(flag: str, text, most: int | None = None, why: str = "") -> list:
    """'512,1024' -> [512, 1024]: the values of a flag that takes one number or a comma list."""
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} takes positive integers separated by commas (e.g. {flag} 4,8), got {text!r}.")
    if most is not None and max(values) > most:
        raise ValueError(f"{flag} takes at most {most:,} ({why}), got {text!r}.")
    return list(dict.fromkeys(values))   # in the order given, each once


def at_least(flag: str, value, least: int, example: str):
    """`value` of an integer flag (None: not given) if it is `least` or more; else one line."""
    if value is not None and value < least:
        raise ValueError(f"{flag} takes an integer of {least} or more (e.g. {flag} {example}), "
                         f"got {value}.")
    return value


def check_output_file(flag: str, text) -> None:
    """Refuse a file an estimate would write at the end (a folder, a parent that is a file or
    read-only) before the estimate runs; a missing parent folder is made, as --out's is."""
    path = Path(text).expanduser().resolve()
    if path.is_dir():
        example = Path(text) / f"step{path.suffix or '.pickle'}"
        raise ValueError(f"{flag} {text} is a folder: give a file name in it "
                         f"(e.g. {flag} {example}).")
    check_folder(flag, path.parent)
