"""The run's estimate cache: `fsdplab run` sets FSDPLAB_ESTIMATE_CACHE (a folder) so that lessons, and the
estimates made ahead (fsdplab.estimates_ahead), work out each exact estimate once. A report is kept under a hash
of its setting, the torch version and fsdplab's code; a `.pending` marker beside it names the process making it,
so that another process waits for it instead of making it twice. Without the variable nothing is cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from pathlib import Path

from .report import MemoryReport
from .settings import TrainSetting, setting_payload


def cached_estimate(setting: TrainSetting) -> MemoryReport | None:
    """The report this run already made for `setting` (FSDPLAB_ESTIMATE_CACHE), with a note saying so; None
    when there is none (or no cache)."""
    cached = cache_path(setting)
    if cached is None or not cached.exists():
        return None
    report = MemoryReport.from_dict(json.loads(cached.read_text()))
    report.notes.append(f"reused: this run estimated the same setting before, with the same fsdplab code and "
                        f"torch ({report.seconds:.1f} s then); FSDPLAB_ESTIMATE_CACHE={cached.parent}")
    return report


def store(setting: TrainSetting, report: MemoryReport) -> None:
    """Keep `report` as `setting`'s in the run's cache (nothing without one). Atomic: a reader sees the whole
    report or none."""
    cached = cache_path(setting)
    if cached is None:
        return
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    tmp.write_text(report.to_json())
    os.replace(tmp, cached)


def estimate_under_way(setting: TrainSetting) -> bool:
    """Whether another live process of this run is estimating `setting` now (fsdplab.estimates_ahead)."""
    marker = pending_path(setting)
    if marker is None:
        return False
    try:
        pid = int(marker.read_text())
    except (OSError, ValueError):
        return False
    import psutil

    from .processes import _alive

    try:
        return pid != os.getpid() and _alive(psutil.Process(pid))
    except psutil.Error:
        return False


def wait_for_estimate(setting: TrainSetting) -> MemoryReport | None:
    """The report of an estimate another process of this run is making (`estimate_under_way`), once it is
    there; None when none is under way or that process ended without one. Waiting rather than estimating the
    same setting again in parallel leaves that process the whole CPU."""
    while (report := cached_estimate(setting)) is None and estimate_under_way(setting):
        time.sleep(0.2)
    # read once more after the maker ended: it stores its report before it removes its marker
    return report if report is not None else cached_estimate(setting)


@contextlib.contextmanager
def marked_under_way(setting: TrainSetting):
    """While the block runs, other processes of this run see `setting` as under way here (and wait for it)."""
    marker = pending_path(setting)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
    try:
        yield
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def pending_path(setting: TrainSetting) -> Path | None:
    """The marker a process writes its pid to while it estimates `setting`; None without a cache."""
    cached = cache_path(setting)
    return None if cached is None else cached.with_suffix(".pending")


def cache_path(setting: TrainSetting) -> Path | None:
    """Where FSDPLAB_ESTIMATE_CACHE (a folder; `fsdplab run` sets one per run so that lessons sharing a setting
    estimate it once) keeps `setting`'s report: named by a hash of the setting, the torch version and every
    source file of fsdplab, so a changed estimator never reuses an old figure. None when the variable is unset."""
    folder = os.environ.get("FSDPLAB_ESTIMATE_CACHE")
    if not folder:
        return None
    import torch

    key = hashlib.sha256(json.dumps(setting_payload(setting), sort_keys=True, default=str).encode())
    key.update(torch.__version__.encode())
    key.update(_code_fingerprint().encode())
    return Path(folder) / f"{key.hexdigest()[:24]}.json"


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of every source file of the fsdplab package (this module's folder)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
