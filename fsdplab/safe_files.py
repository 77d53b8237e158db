"""Files that survive crashes and full disks: the file-system side of `fsdplab.checkpoint`.

- `atomic_write_bytes` / `atomic_save_tensors`: temp name, fsync, `os.replace`, fsync of the folder: a
  reader sees the old file or the new one, never half of one, and a failure leaves no temp file behind.
- `clear_debris`: what failed or crashed sharded saves left in a checkpoint folder (`step-N.tmp`, parked
  `step-N.old` copies, temp files of `latest`), cleared before the next save so it does not keep a disk full.
- `disk_full_cause` / `disk_full_error`: a full disk (ENOSPC, EDQUOT), however deep DCP wrapped it, told as
  one line (`CheckpointDiskFull`): what failed where, what was cleaned up, what is still safe, what to do.

Every deletion goes through `remove`, every rename through `os.replace`: the crash tests count them.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import torch

from .ranks import this_rank

STEP_DIR = re.compile(r"^step-(\d+)$")
OLD_DIR = re.compile(r"^step-(\d+)\.old$")          # the previous copy of a step while it is re-saved
# What a failed or crashed save leaves behind: unfinished step folders and temp files of `latest`
# (`.step-N.old-PID` is the parked copy's name in earlier versions of the checkpoint module).
DEBRIS = re.compile(r"^(step-\d+\.tmp|\.latest\.tmp-\d+|\.step-\d+\.old-\d+)$")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointDiskFull(OSError):
    """A save ran out of disk space (ENOSPC or a quota). Its one-line message names the folder, what was
    cleaned up, the checkpoint still in charge and what to do; `errno` is the original error number."""


def remove(path: Path) -> None:
    """Delete a file or a folder if it is there (best effort: what is left is cleared by the next save)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# --- a full disk ---------------------------------------------------------------------------------------

def disk_full_cause(err: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `err`, if any: DCP wraps each rank's failure in a
    CheckpointException (`.failures`: rank -> (exception, traceback)), and errors chain."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e
        todo += [e.__cause__, e.__context__]
        todo += [pair[0] for pair in getattr(e, "failures", {}).values() if isinstance(pair, tuple)]
    return None


def disk_full_ranks(err: BaseException) -> list:
    """Ranks whose own write hit the full disk (from DCP's per-rank failures), else [this rank]."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        ranks = sorted(r for r, pair in failures.items()
                       if isinstance(pair, tuple) and disk_full_cause(pair[0]) is not None)
        if ranks:
            return ranks
    return [this_rank()]


def _free_bytes(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.1f} MiB free there now"
    except OSError:
        return "free space unknown"


def disk_full_error(cause: OSError, what: str, folder: Path, cleaned: str, still: str) -> CheckpointDiskFull:
    """The one line a full disk deserves: cause, where, what was cleaned up, what is safe, what to do."""
    strerror = cause.strerror or os.strerror(cause.errno)
    name = errno.errorcode.get(cause.errno, str(cause.errno))
    return CheckpointDiskFull(cause.errno, f"{strerror} ({name}) while {what} in {folder} "
                              f"({_free_bytes(folder)}); {cleaned}; {still}. Free space on that disk "
                              f"or save to a folder on another one, then save again.")


# --- atomic files --------------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    # A rename is durable only once the folder that holds the name is synced too.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(path: Path, write) -> Path:
    """`write(tmp)` fills a temp file next to `path` (and fsyncs it); then `os.replace` puts it in place and the
    folder is synced. On any failure (a full disk, an interrupt) the temp file is removed and the error raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)   # a full disk (or an interrupt) must not leave a partial temp file behind
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write `data` to `path` so that readers see the old file or the new one, never half of one."""
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return _write_atomically(Path(path), write)


def atomic_save_tensors(state: dict, path: Path, metadata: dict | None = None) -> Path:
    """safetensors when the name ends in .safetensors, else torch.save; temp name + fsync + os.replace. A full
    disk is raised as one line (`CheckpointDiskFull`)."""
    def write(tmp):
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            # safetensors refuses views that share memory; contiguous copies are what the file holds anyway.
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp),
                      metadata={"format": "pt", **(metadata or {})})
        else:
            torch.save(state, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

    try:
        return _write_atomically(path, write)
    except BaseException as err:
        cause = disk_full_cause(err)
        if cause is not None:
            raise disk_full_error(cause, f"writing {path.name}", path.parent, "removed the partial file",
                                  "an older file under that name is untouched") from None
        raise


def read_tensors(path: Path) -> dict:
    """What `atomic_save_tensors` wrote: a safetensors file or a torch.save file (weights only)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


# --- what failed and crashed sharded saves leave -----------------------------------------------------------

def complete(folder: Path) -> bool:
    # DCP writes `.metadata` last, on the coordinator, after every rank has reported its shards written.
    return folder.is_dir() and (folder / ".metadata").is_file()


def clear_debris(root: Path) -> None:
    """Rank 0, before a save: undo what failed or crashed saves left. A `step-N.old` whose `step-N` is
    missing (a re-save crashed between its renames) is renamed back; every other parked copy, every
    `step-N.tmp` and every temp file of `latest` is deleted, so a save that died of a full disk does not
    keep the disk full."""
    for p in sorted(root.iterdir()):
        old = OLD_DIR.match(p.name)
        if old and complete(p) and not (root / f"step-{old.group(1)}").exists():
            os.replace(p, root / f"step-{old.group(1)}")
        elif old or DEBRIS.match(p.name):
            remove(p)
