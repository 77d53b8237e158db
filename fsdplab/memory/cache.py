"""The run's estimate cache: `fsdplab run` sets FSDPLAB_ESTIMATE_CACHE (a folder) so that lessons, and the
estimates made ahead (fsdplab.runner.estimates_ahead), work out each exact estimate once. A report is kept under a hash
of its setting, the torch version and fsdplab's code; a `.pending` marker beside it names the process making it,
so that another process waits for it instead of making it twice. Without the variable nothing is cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from .report import MemoryReport
from ..settings import TrainSetting, setting_payload


# How long a process waits for another's estimate before it makes its own: an exact 7B estimate takes about a
# minute on two busy cores; a maker that takes ten has stalled, and estimating again is the way out.
WAIT_SECONDS = 600.0


def _warn(message: str) -> None:
    print(f"fsdplab: estimate cache: {message}", file=sys.stderr, flush=True)


def cached_estimate(setting: TrainSetting) -> MemoryReport | None:
    """The report this run already made for `setting` (FSDPLAB_ESTIMATE_CACHE), with a note saying so; None
    when there is none (or no cache). An entry that cannot be read as a report (a torn or hand-edited file) is
    a miss: it is removed, with one line naming it, and the estimate is made again."""
    cached = cache_path(setting)
    if cached is None or not cached.exists():
        return None
    try:
        report = MemoryReport.from_dict(json.loads(cached.read_text()))
    except Exception as err:  # noqa: BLE001 - any unreadable entry: recompute rather than fail every later run
        _warn(f"ignored the unreadable entry {cached} ({type(err).__name__}: {err}); estimating again")
        with contextlib.suppress(OSError):
            cached.unlink()
        return None
    report.notes.append(f"reused: this run estimated the same setting before, with the same fsdplab code and "
                        f"torch ({report.seconds:.1f} s then); FSDPLAB_ESTIMATE_CACHE={cached.parent}")
    return report


def store(setting: TrainSetting, report: MemoryReport) -> None:
    """Keep `report` as `setting`'s in the run's cache (nothing without one). Atomic: a reader sees the whole
    report or none. A cache that cannot be written is no cache: one line says so, the report is kept."""
    cached = cache_path(setting)
    if cached is None:
        return
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(report.to_json())
        os.replace(tmp, cached)
    except OSError as err:
        _warn(f"could not keep the estimate in {cached.parent} ({err.strerror or err}); it is not cached")
        with contextlib.suppress(OSError):
            tmp.unlink()


def _maker_identity(pid: int) -> dict:
    """What names a process beyond its pid, which the system reuses: the host and the process's start time."""
    import socket

    import psutil

    return {"pid": pid, "host": socket.gethostname(), "started": psutil.Process(pid).create_time()}


def _marker_maker(marker: Path) -> dict | None:
    try:
        maker = json.loads(marker.read_text())
        return maker if isinstance(maker, dict) and isinstance(maker.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def estimate_under_way(setting: TrainSetting) -> bool:
    """Whether another live process is estimating `setting` now (fsdplab.runner.estimates_ahead). A marker whose maker
    is gone (an interrupted run; its pid now someone else's) is stale: it is removed."""
    marker = pending_path(setting)
    if marker is None or not marker.exists():
        return False
    maker = _marker_maker(marker)
    if maker is not None and maker["pid"] == os.getpid():
        return False
    if maker is not None and _maker_alive(maker):
        return True
    with contextlib.suppress(OSError):
        marker.unlink()
    return False


def _maker_alive(maker: dict) -> bool:
    import psutil

    from ..runtime.processes import alive as _alive

    try:
        now = _maker_identity(maker["pid"])
        return (now["host"] == maker.get("host") and abs(now["started"] - float(maker.get("started", -1))) < 0.01
                and _alive(psutil.Process(maker["pid"])))
    except (psutil.Error, TypeError, ValueError):
        return False


def wait_for_estimate(setting: TrainSetting, timeout: float | None = None, say=None) -> MemoryReport | None:
    """The report of an estimate another process is making (`estimate_under_way`), once it is there; None when
    none is under way, that process ended without one, or `timeout` seconds (WAIT_SECONDS) passed: the caller
    then estimates it itself. Waiting rather than estimating the same setting again in parallel leaves that
    process the whole CPU. `say(line)` hears what is waited for, every 30 s."""
    limit = WAIT_SECONDS if timeout is None else timeout
    start = last_said = time.monotonic()
    while (report := cached_estimate(setting)) is None and estimate_under_way(setting):
        waited = time.monotonic() - start
        if waited >= limit:
            maker = _marker_maker(pending_path(setting)) or {}
            _warn(f"waited {waited:.0f} s for process {maker.get('pid')} to estimate {setting.model_name} on "
                  f"{setting.world_size} ranks; estimating it here instead")
            return None
        if say is not None and time.monotonic() - last_said >= 30:
            say(f"still waiting for another process's estimate ({waited:.0f} s of at most {limit:.0f} s)")
            last_said = time.monotonic()
        time.sleep(0.2)
    # read once more after the maker ended: it stores its report before it removes its marker
    return report if report is not None else cached_estimate(setting)


@contextlib.contextmanager
def marked_under_way(setting: TrainSetting):
    """While the block runs, other processes see `setting` as under way here (and wait for it). The marker
    names this process by host, pid and start time, so a marker left by a killed run is known as stale."""
    marker = pending_path(setting)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(_maker_identity(os.getpid())))
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
    source file of fsdplab (a changed estimator never reuses an old figure) and FSDPLAB_TRACE_ALL_BLOCKS. None when
    the variable is unset."""
    folder = os.environ.get("FSDPLAB_ESTIMATE_CACHE")
    from ..custom import custom_of

    if not folder or custom_of(setting.model) is not None:    # its code is not in the fingerprint
        return None
    import torch

    key = hashlib.sha256(json.dumps(setting_payload(setting), sort_keys=True, default=str).encode())
    key.update(torch.__version__.encode())
    key.update(_code_fingerprint().encode())
    key.update(os.environ.get("FSDPLAB_TRACE_ALL_BLOCKS", "").encode())   # the report's notes say which
    return Path(folder) / f"{key.hexdigest()[:24]}.json"


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of every source file of the fsdplab package."""
    digest = hashlib.sha256()
    for path in code_files():
        digest.update(path.read_bytes())
    return digest.hexdigest()


def code_files() -> list:
    """The files the fingerprint covers: all of fsdplab, not this wing alone (a report depends on the
    settings, the models and the step as much as on the estimator)."""
    return sorted(Path(__file__).resolve().parent.parent.rglob("*.py"))
