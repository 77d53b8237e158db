"""Checksums that make a damaged checkpoint fail loudly instead of loading garbage.

DCP checks no content: a shard with flipped bytes loads without a word (a weight of 3411.4 that was
-0.0013, an `exp_avg_sq` of -1.3e11, then a NaN loss), and a truncated or missing one fails deep
inside DCP with a traceback that names no file. So a save records the size and SHA-256 of every file
it wrote, in `checksums.json`, before the checkpoint is committed; a load verifies them first and
refuses a damaged checkpoint in one line that names the file and the step.

The checksums are part of the checkpoint: a manifest or sidecar that is missing, empty, not what a
save writes, or unreadable makes the checkpoint damaged too, never "unverified". A checkpoint
written before checksums existed is refused as `CheckpointUnverified` until a load says
`trust_unverified=True`, which records the checksums from the files as they are now (once: later
loads verify against them). In a process group rank 0 reads the manifest and sends the verdict to
every rank, and each rank's findings about its share of the files reach all ranks: every rank raises
the same line, none waits in a collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

MANIFEST = "checksums.json"
SIDECAR = ".sha256"          # beside a single-file checkpoint (save_full): "<hex>  <bytes>"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SIDECAR_LINE = re.compile(r"^([0-9a-f]{64})  ([0-9]+)\n?$")
_EARLIER = ("load an earlier step (load_sharded(..., fallback=True) takes the newest undamaged "
            "one) or save again")
_FALLBACK = _EARLIER[0].upper() + _EARLIER[1:]


class CheckpointDamaged(ValueError):
    """A checkpoint's files differ from what its save recorded (flipped, truncated or missing), or
    the record itself (checksums.json, a .sha256 sidecar) is missing, malformed or unreadable."""


class CheckpointUnverified(CheckpointDamaged):
    """A checkpoint with no checksums at all: written before they existed, or its record deleted."""


class _Bad(Exception):
    """What is wrong with a manifest or sidecar (`what`), before it becomes a one-line refusal."""

    def __init__(self, what: str, missing: bool = False):
        super().__init__(what)
        self.what, self.missing = what, missing


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _read_record(path: Path) -> str:
    """The text of a manifest or sidecar, or _Bad saying why there is none to trust."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise _Bad("missing", missing=True) from None
    except OSError as err:
        raise _Bad(f"unreadable ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):           # a FIFO would block the open below forever
        raise _Bad("not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise _Bad(f"unreadable ({err.strerror or err})") from None
    if not data.strip():
        raise _Bad("empty")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise _Bad("not text") from None


def _entries(folder: Path) -> dict:
    """The manifest of `folder`, checked to be what `write_manifest` writes, covering every file."""
    text = _read_record(folder / MANIFEST)
    try:
        entries = json.loads(text)
    except ValueError:
        raise _Bad("not JSON") from None
    if not isinstance(entries, dict):
        raise _Bad(f"not a JSON object of file entries (a {type(entries).__name__})")
    if not entries:
        raise _Bad("records no files")
    for name, want in entries.items():
        if not name or "/" in name or "\\" in name or name in (".", "..", MANIFEST):
            raise _Bad(f"records {name!r}, which is not a file name of the folder")
        want = want if isinstance(want, dict) else {}
        sha, size = want.get("sha256"), want.get("bytes")
        if not (isinstance(sha, str) and _SHA256.match(sha) and type(size) is int and size >= 0):
            raise _Bad(f"the entry of {name} is not {{'bytes': <int>, 'sha256': <64 hex digits>}}")
    if ".metadata" not in entries:
        raise _Bad("does not record .metadata")
    # The temp file of a manifest write that died (trust_unverified) is debris, not saved data.
    unrecorded = sorted(p.name for p in folder.iterdir() if p.name not in entries
                        and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}.tmp-"))
    if unrecorded:
        more = " ..." if len(unrecorded) > 3 else ""
        raise _Bad(f"does not record {', '.join(unrecorded[:3])}{more}")
    return entries


def write_manifest(folder: Path, atomic: bool = False) -> Path:
    """Record every file of `folder`. A save calls it on the finished DCP folder before its commit
    (the folder's rename publishes the manifest with the shards); `atomic` is for a folder already
    published."""
    from .safe_files import atomic_write_bytes

    folder = Path(folder)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": digest(p)}
               for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    data = json.dumps(entries, indent=1).encode()
    if atomic:
        return atomic_write_bytes(folder / MANIFEST, data)
    with open(folder / MANIFEST, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return folder / MANIFEST


def _file_findings(folder: Path, entries: dict, names) -> list:
    """(file name, what is wrong) for each of `names` that is missing or differs from its entry."""
    wrong = []
    for name in names:
        path, want = folder / name, entries[name]
        try:
            info = os.stat(path)
            if not stat.S_ISREG(info.st_mode):
                wrong.append((name, "missing" if not path.exists() else "not a regular file"))
            elif info.st_size != want["bytes"]:
                wrong.append((name, f"{info.st_size:,} bytes, saved as {want['bytes']:,}"))
            elif digest(path) != want["sha256"]:
                wrong.append((name, "content differs from the save (SHA-256)"))
        except FileNotFoundError:
            wrong.append((name, "missing"))
        except OSError as err:
            wrong.append((name, f"unreadable ({err.strerror or err})"))
    return wrong


def damaged(folder: Path, names=None) -> list:
    """(file name, what is wrong) for each recorded file of `folder` (or of `names` among them)
    that is missing or differs, or [(checksums.json, what is wrong)] when the manifest cannot be
    trusted; [] when all match."""
    folder = Path(folder)
    try:
        entries = _entries(folder)
    except _Bad as bad:
        return [(MANIFEST, bad.what)]
    except OSError as err:
        return [(MANIFEST, f"the folder is unreadable ({err.strerror or err})")]
    if names is None:
        return _file_findings(folder, entries, sorted(entries))
    unknown = [(name, f"not recorded in {MANIFEST}") for name in names if name not in entries]
    return unknown + _file_findings(folder, entries, [n for n in names if n in entries])


def _refusal(folder: Path, wrong: list) -> CheckpointDamaged:
    listed = "; ".join(f"{name}: {what}" for name, what in wrong[:3])
    listed += " ..." if wrong[3:] else ""
    return CheckpointDamaged(f"checkpoint {folder.name} in {folder.parent} is damaged ({listed}): "
                             f"nothing was loaded. {_FALLBACK}.")


def _manifest_verdict(folder: Path, trust_unverified: bool):
    """Rank 0's part: ("ok", entries), or (error type name, one-line message) for every rank."""
    where = f"checkpoint {folder.name} in {folder.parent}"
    if not folder.is_dir():
        return "ValueError", (f"{folder} is not a checkpoint folder (no such folder): pass "
                              f"root= (a folder of step-N checkpoints) or checkpoint= (one).")
    try:
        return "ok", _entries(folder)
    except _Bad as bad:
        if not bad.missing:
            return "CheckpointDamaged", (
                f"{where} is damaged ({MANIFEST}: {bad.what}): nothing was loaded. {_FALLBACK}; if "
                f"you trust its files as they are, delete {folder / MANIFEST} and load once with "
                f"trust_unverified=True.")
        if not trust_unverified:
            return "CheckpointUnverified", (
                f"{where} has no {MANIFEST} (written before checksums existed, or it was deleted): "
                f"nothing was loaded. If you trust its files as they are, load it once with "
                f"trust_unverified=True, which records {MANIFEST} from them; else {_EARLIER}.")
    write_manifest(folder, atomic=True)
    print(f"fsdplab: recorded {folder / MANIFEST} from the files as they are now "
          f"(trust_unverified=True); later loads verify against it.", flush=True)
    return "ok", _entries(folder)


def verify_folder(folder: Path, rank: int | None = None, world_size: int | None = None,
                  trust_unverified: bool = False) -> None:
    """Refuse a damaged checkpoint folder (or one whose manifest is missing, malformed or
    unreadable) in one line, on every rank. Collective when a process group is running: rank 0
    checks the manifest and sends the verdict, then every rank checks its share of the files (each
    file once in all) and all learn what each found. `rank`/`world_size` are ignored (kept for older
    callers): the group's own are used, and with no group one process checks every file.
    `trust_unverified=True` records a missing manifest from the files as they are, once."""
    import torch.distributed as dist

    folder = Path(folder)
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    verdict = [None]
    if rank == 0:
        try:
            verdict = [_manifest_verdict(folder, trust_unverified)]
        except Exception as err:      # whatever it was, every rank must hear it rather than wait
            verdict = [("CheckpointDamaged", f"checkpoint {folder.name} in {folder.parent} could "
                        f"not be checked ({type(err).__name__}: {err}): nothing was loaded. "
                        f"{_FALLBACK}.")]
    if group:
        dist.broadcast_object_list(verdict, src=0)
    kind, detail = verdict[0]
    if kind != "ok":
        raise {"ValueError": ValueError, "CheckpointUnverified": CheckpointUnverified}.get(
            kind, CheckpointDamaged)(detail)
    try:
        mine = _file_findings(folder, detail, sorted(detail)[rank::world_size])
    except Exception as err:
        mine = [(f"rank {rank}'s files", f"could not be checked ({type(err).__name__}: {err})")]
    found = [mine]
    if group:
        found = [None] * world_size
        dist.all_gather_object(found, mine)
    wrong = [w for part in found for w in part]
    if wrong:
        raise _refusal(folder, wrong)


def write_sidecar(path: Path) -> Path:
    """Record a single-file checkpoint's SHA-256 and size beside it (`<file>.sha256`)."""
    from .safe_files import atomic_write_bytes

    path = Path(path)
    line = f"{digest(path)}  {path.stat().st_size}\n"
    return atomic_write_bytes(path.with_name(path.name + SIDECAR), line.encode())


def verify_file(path: Path, trust_unverified: bool = False) -> None:
    """Refuse a single-file checkpoint whose bytes differ from its sidecar, or whose sidecar is
    missing, malformed or unreadable (one line, CheckpointDamaged). `trust_unverified=True` accepts
    a file that has no sidecar (saved before sidecars existed) and records one from its bytes as
    they are, once."""
    path = Path(path)
    sidecar = path.with_name(path.name + SIDECAR)
    try:
        line = _read_record(sidecar)
        match = _SIDECAR_LINE.match(line)
        if not match:
            raise _Bad("not a checksum line ('<64 hex digits>  <bytes>')")
        want, size = match.group(1), int(match.group(2))
    except _Bad as bad:
        if not bad.missing:
            raise CheckpointDamaged(
                f"{path} is refused: its checksum file {sidecar.name} is {bad.what}. Nothing was "
                f"loaded. Save it again; if you trust the file as it is, delete {sidecar.name} and "
                f"load once with trust_unverified=True.") from None
        if not os.path.lexists(path):
            raise ValueError(f"no file {path} (and no {sidecar.name}): check the path, or "
                             f"save_full(...) first.") from None
        if not trust_unverified:
            raise CheckpointUnverified(
                f"{path} has no checksum file {sidecar.name} (saved before checksums existed, or "
                f"it was deleted): nothing was loaded. If you trust the file as it is, load it "
                f"once with trust_unverified=True, which records {sidecar.name} from it; else "
                f"save it again.") from None
        _check_regular(path, sidecar)
        write_sidecar(path)
        print(f"fsdplab: recorded {sidecar} from the file as it is now (trust_unverified=True); "
              f"later loads verify against it.", flush=True)
        return
    _check_regular(path, sidecar)
    try:
        actual = os.stat(path).st_size
        same = actual == size and digest(path) == want
    except OSError as err:
        raise _unreadable(path, err) from None
    if not same:
        raise CheckpointDamaged(f"{path} is damaged: its bytes differ from the save ({actual:,} "
                                f"bytes, saved as {size:,}; SHA-256 recorded in {sidecar.name}). "
                                f"Nothing was loaded.")


def _unreadable(path: Path, err: OSError) -> CheckpointDamaged:
    return CheckpointDamaged(f"{path} is unreadable ({err.strerror or err}): nothing was loaded.")


def _check_regular(path: Path, sidecar: Path) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing (its checksum file {sidecar.name} is there): "
                                f"save it again.") from None
    except OSError as err:
        raise _unreadable(path, err) from None
    if not stat.S_ISREG(mode):
        raise CheckpointDamaged(f"{path} is not a regular file: nothing was loaded. Save it again.")
