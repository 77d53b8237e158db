"""Folders the lab writes into, empties or replaces: only ones it made, never a user's, never
through a symlink.

A folder is the lab's when it carries the mark (MARK, a small file the lab writes when it makes
the folder), is a real folder (not a symlink to one) and belongs to this user. Everything else is
refused in one line (`ValueError`: which folder, and to choose a new or empty one), never emptied.

- `make_owned(folder)`: the folder, made and marked when missing; an empty folder is marked; a
  marked one is taken as it is. `within=`: every part of the path below that folder (the temporary
  folder, which others can write to) must be a real folder of this user's, so a symlink planted
  there by someone else is not followed.
- `fresh_owned(folder)`: the same, emptied (what a lesson that starts from nothing needs).
- `clear_owned(folder)`: empty a folder of the lab's; the mark stays.
- `owned_temp(name)`: TMPDIR/name when it is the lab's (or missing), else a new folder with an
  unpredictable name.
- `lesson_folder(path, name)`: where a lesson writes its files: an empty folder of the lab's.
- `replace_owned(folder, build)`: build the new folder beside the old one, then swap them, so a
  failure leaves the old one whole.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

MARK = ".fsdplab-owned"
_MARK_TEXT = "fsdplab made this folder: it may empty or replace it. Remove this file to keep it.\n"
_FOREIGN = f"holds files the lab did not make (it has no {MARK} mark)"


def _mine(st: os.stat_result) -> bool:
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


def is_owned(folder) -> bool:
    """A real folder (not a symlink) of this user's, holding the lab's mark (a plain file)."""
    try:
        st, mark = os.lstat(folder), os.lstat(Path(folder) / MARK)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and stat.S_ISREG(mark.st_mode) and _mine(st) and _mine(mark)


def _mark(folder: Path) -> None:
    # O_EXCL|O_NOFOLLOW: a mark (or a symlink) already there is never written through.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(folder / MARK, flags, 0o644), "w") as f:
        f.write(_MARK_TEXT)


def _refuse(folder: Path, why: str, what: str) -> ValueError:
    label = f"{what} {folder}" if what else str(folder)
    return ValueError(f"{label} {why}: choose a new or empty folder (the lab never empties or "
                      f"writes through a folder it did not make).")


def _check_part(part: Path, what: str) -> bool:
    """True when `part` exists; refuses a symlink, a file, or a folder of another user's."""
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(part, "is a symlink", what)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(part, "is a file, not a folder", what)
    if not _mine(st):
        raise _refuse(part, "belongs to another user", what)
    return True


def make_owned(folder, *, within=None, mode: int = 0o777, what: str = "") -> Path:
    """`folder` as a folder of the lab's (absolute, its parents resolved): made (with `mode`) and
    marked when missing, marked when empty, taken as it is when marked; refused otherwise. `what`
    names it in the error (a parameter, a flag)."""
    folder = Path(os.path.abspath(os.fspath(folder)))
    if within is not None:
        within = Path(os.path.abspath(os.fspath(within)))
        if within not in folder.parents:
            raise _refuse(folder, f"is not inside {within}", what)
        # Each part below `within` must be a real folder of ours; a missing one is made with `mode`.
        for part in [p for p in reversed(folder.parents) if within in p.parents] + [folder]:
            if not _check_part(part, what):
                try:
                    os.mkdir(part, mode)
                except FileExistsError:     # made meanwhile: look again
                    pass
                _check_part(part, what)
    elif not _check_part(folder, what):
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(folder, mode)
        _mark(folder)
    if not is_owned(folder):
        if any(os.scandir(folder)):
            raise _refuse(folder, _FOREIGN, what)
        _mark(folder)
    return Path(os.path.realpath(folder.parent)) / folder.name


def clear_owned(folder) -> Path:
    """Empty a folder of the lab's (its mark stays); any other folder is refused, untouched."""
    folder = Path(folder)
    if not is_owned(folder):
        raise _refuse(folder, f"is not a folder the lab made (no {MARK} mark)", "")
    for entry in os.scandir(folder):
        if entry.name == MARK:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)           # a symlink inside is removed, never followed
    return folder


def fresh_owned(folder, **kwargs) -> Path:
    """`make_owned`, then emptied: an empty folder of the lab's."""
    return clear_owned(make_owned(folder, **kwargs))


def lesson_folder(path: str, name: str, *, what: str = "") -> tuple:
    """(folder, keep): an empty folder of the lab's where a lesson writes its files, not next to the
    notebooks.

    `path` given: that folder, kept (a relative path lies under the run's output folder, FSDPLAB_OUT,
    which `fsdplab run` sets, else under the temporary folder). Not given: `name` in FSDPLAB_OUT, kept
    with the run's other outputs, else a new temporary folder the lesson deletes at the end (keep
    False). A folder is emptied only when the lab made it: one that holds anything else, or is a
    symlink, is refused with a ValueError that names it (`what`: the parameter it came from)."""
    out = os.environ.get("FSDPLAB_OUT")
    if not path and not out:
        return Path(tempfile.mkdtemp(prefix=f"fsdplab-{name[:2]}-")).resolve(), False
    folder = Path(path or name).expanduser()
    if folder.is_absolute():
        return fresh_owned(folder, what=what), True
    if out:
        return fresh_owned(Path(out) / folder, what=what), True
    # Others can write to the temporary folder: nothing below it that is not ours is followed.
    temp = tempfile.gettempdir()
    return fresh_owned(Path(temp) / folder, within=temp, mode=0o700, what=what), True


def shared_lesson_folder(path: str, name: str, *, what: str = "") -> tuple:
    """`lesson_folder` for rank code: rank 0 of the default process group makes the folder and every rank gets
    its (folder, keep), so the ranks of one machine write and read one folder (a temporary folder made on each
    rank would differ). Every rank must call it. Without a process group: `lesson_folder`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return lesson_folder(path, name, what=what)
    made = [None]
    if dist.get_rank() == 0:
        try:
            folder, keep = lesson_folder(path, name, what=what)
            made = [(str(folder), keep, "")]
        except ValueError as err:            # every rank raises it, not rank 0 alone while the others wait
            made = [("", False, str(err))]
    dist.broadcast_object_list(made, src=0)
    folder, keep, error = made[0]
    if error:
        raise ValueError(error)
    return Path(folder), keep


_temp_fallbacks: dict = {}


def owned_temp(name: str) -> Path:
    """TMPDIR/`name`, made 0700 and marked, when nothing else sits there; else (a symlink or a
    folder planted by someone else) a new folder with an unpredictable name, the same one for the
    rest of this process."""
    root = Path(tempfile.gettempdir())
    if (root, name) in _temp_fallbacks:
        return _temp_fallbacks[(root, name)]
    try:
        return make_owned(root / name, within=root, mode=0o700)
    except (ValueError, OSError):
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        _mark(folder)
        _temp_fallbacks[(root, name)] = folder
        return folder


def _sibling(folder: Path, kind: str) -> Path:
    return folder.parent / f".{folder.name}.{kind}-{secrets.token_hex(4)}"


def replace_owned(folder, build, *, what: str = "") -> Path:
    """Replace `folder` with what `build(new)` writes into a new marked folder beside it.

    The old folder must be the lab's, empty or missing (refused first otherwise). It is renamed
    aside, the new one renamed in, and only then is the old one removed: a failure in `build` (an
    exception, a full disk, Ctrl-C) removes the new folder and leaves the old one whole."""
    folder = Path(os.path.abspath(os.fspath(folder)))
    existed = _check_part(folder, what)
    if existed and not is_owned(folder) and any(os.scandir(folder)):
        raise _refuse(folder, _FOREIGN, what)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # What replacements killed between build and swap left beside it, still marked as the lab's.
    prefixes = (f".{folder.name}.new-", f".{folder.name}.old-")
    for debris in folder.parent.iterdir():
        if debris.name.startswith(prefixes) and is_owned(debris):
            shutil.rmtree(debris, ignore_errors=True)
    new, aside = _sibling(folder, "new"), _sibling(folder, "old")
    os.mkdir(new)                       # the umask's mode, as a site a web server reads needs
    try:
        _mark(new)
        build(new)
        if existed:
            os.rename(folder, aside)
        try:
            os.rename(new, folder)
        except BaseException:
            if existed:
                os.rename(aside, folder)
            raise
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if existed:
        if is_owned(aside):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rmdir(aside)             # an empty folder of the user's: nothing of theirs is lost
    return folder
