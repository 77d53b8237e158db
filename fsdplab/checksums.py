"""Checksums that make a damaged checkpoint fail loudly instead of loading garbage.

DCP checks no content: a shard with flipped bytes loads without a word (a weight of 3411.4 that was -0.0013,
an `exp_avg_sq` of -1.3e11, then a NaN loss), and a truncated or missing one fails deep inside DCP with a
traceback that names no file. So a save records the size and SHA-256 of every file it wrote, in
`checksums.json`, before the checkpoint is committed; a load verifies them first and refuses a damaged
checkpoint in one line that names the file and the step. Checkpoints written before this existed have no
manifest and load unverified.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "checksums.json"
SIDECAR = ".sha256"          # beside a single-file checkpoint (save_full): "<hex>  <bytes>"


class CheckpointDamaged(ValueError):
    """A checkpoint's files differ from what its save recorded (flipped, truncated or missing)."""


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Record every file of `folder` (a finished DCP save, before its commit: the folder's rename publishes the
    manifest with the shards, so the file itself needs no atomic write)."""
    import os

    folder = Path(folder)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": digest(p)}
               for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    with open(folder / MANIFEST, "wb") as f:
        f.write(json.dumps(entries, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    return folder / MANIFEST


def damaged(folder: Path, names=None) -> list:
    """(file name, what is wrong) for each recorded file of `folder` (or of `names` among them) that is missing
    or differs; [] when all match or the folder has no manifest."""
    folder = Path(folder)
    try:
        entries = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as err:
        return [(MANIFEST, f"unreadable ({err})")]
    wrong = []
    for name in (sorted(entries) if names is None else names):
        path, want = folder / name, entries[name]
        if not path.is_file():
            wrong.append((name, "missing"))
        elif path.stat().st_size != want["bytes"]:
            wrong.append((name, f"{path.stat().st_size:,} bytes, saved as {want['bytes']:,}"))
        elif digest(path) != want["sha256"]:
            wrong.append((name, "content differs from the save (SHA-256)"))
    return wrong


def verify_folder(folder: Path, rank: int = 0, world_size: int = 1) -> None:
    """Every rank checks its share of the files (each file once in all), then all learn the verdict: a damaged
    checkpoint is refused on every rank with one line. Collective when a process group is running."""
    import torch.distributed as dist

    folder = Path(folder)
    try:
        names = sorted(json.loads((folder / MANIFEST).read_text()))
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        names = None
    if names is not None:
        mine = damaged(folder, names[rank::world_size])
    else:                                        # the manifest itself is unreadable: one rank says so
        mine = damaged(folder) if rank == 0 else []
    found = [mine]
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        found = [None] * world_size
        dist.all_gather_object(found, mine)
    wrong = [w for part in found for w in part]
    if wrong:
        listed = "; ".join(f"{name}: {what}" for name, what in wrong[:3]) + (" ..." if len(wrong) > 3 else "")
        raise CheckpointDamaged(f"checkpoint {folder.name} in {folder.parent} is damaged ({listed}): nothing was "
                                f"loaded. Load an earlier step (load_sharded(..., fallback=True) takes the newest "
                                f"undamaged one) or save again.")


def write_sidecar(path: Path) -> Path:
    """Record a single-file checkpoint's SHA-256 and size beside it (`<file>.sha256`)."""
    from .safe_files import atomic_write_bytes

    path = Path(path)
    return atomic_write_bytes(path.with_name(path.name + SIDECAR), f"{digest(path)}  {path.stat().st_size}\n".encode())


def verify_file(path: Path) -> None:
    """Refuse a single-file checkpoint whose bytes differ from its sidecar (none: unverified, as before)."""
    path = Path(path)
    sidecar = path.with_name(path.name + SIDECAR)
    if not sidecar.is_file():
        return
    want, size = sidecar.read_text().split()
    if not path.is_file():
        raise CheckpointDamaged(f"{path} is missing (its checksum file {sidecar.name} is there): save it again.")
    if path.stat().st_size != int(size) or digest(path) != want:
        raise CheckpointDamaged(f"{path} is damaged: its bytes differ from the save ({path.stat().st_size:,} bytes, "
                                f"saved as {int(size):,}; SHA-256 recorded in {sidecar.name}). Nothing was loaded.")
