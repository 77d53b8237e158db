"""Exact estimates of later lessons, made ahead while earlier lessons run (`fsdplab run` with several lessons).

A lesson's `start_estimates` reads a setting back from the run's estimate cache (FSDPLAB_ESTIMATE_CACHE) when
it is already there. While the run goes on, one background process fills that cache with the full-scale
settings later lessons will ask for, at the lowest CPU priority: it takes the time the lessons leave the
cores idle (waiting on ranks, kernels and hang timeouts) and yields to them otherwise. A setting it has not
finished when a lesson needs it is estimated by the lesson, as without it. Only runs at the lessons' default
parameters make estimates ahead: other parameters may ask for other settings.

    python -m fsdplab.estimates_ahead < SETTINGS.json     (what `start` runs: the settings as a JSON list)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def lesson_settings(stem: str) -> list:
    """The full-scale settings lesson `stem` estimates at its defaults and does not start itself at once
    (lesson 01 starts its two with its imports; 03, 06 and 08 need theirs later or share them)."""
    number = stem[:2]
    if number == "03":
        from .lessons.cpu_offload import exact_settings

        return exact_settings()[2:]            # with offload; the other two are lesson 01's
    if number == "06":
        from .lessons.qwen7b_lora import POSTS_SETTING

        return [POSTS_SETTING]
    if number == "08":
        from .lessons.activation_checkpointing import estimate_settings

        return estimate_settings()
    return []


def settings_for(paths) -> list:
    """Every setting the lessons in `paths` would estimate later, once each, in lesson order."""
    settings = []
    for path in paths:
        settings += [s for s in lesson_settings(Path(path).stem) if s not in settings]
    return settings


def start(paths, cache: str) -> subprocess.Popen | None:
    """Start estimating `settings_for(paths)` into `cache` in a background process at the lowest priority;
    None when there is nothing to estimate."""
    from .memory import _setting_payload

    settings = settings_for(paths)
    if not settings:
        return None
    env = {**os.environ, "FSDPLAB_ESTIMATE_CACHE": str(cache)}
    process = subprocess.Popen([sys.executable, "-m", "fsdplab.estimates_ahead"], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True, preexec_fn=_lowest_priority)
    with process.stdin:   # the settings, as JSON on its standard input
        process.stdin.write(json.dumps([_setting_payload(s) for s in settings], default=str))
    return process


def _lowest_priority() -> None:
    """In the new process: nice 19, for its session too. Linux's autogroups share the CPU between sessions
    before nice values count, and Jupyter starts each kernel in a session of its own: without the session's
    nice, this process would take half the CPU from a lesson's kernel and ranks."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:   # no autogroups (not Linux, or a kernel without them): the process's nice is enough
        pass


def stop(process: subprocess.Popen | None) -> None:
    """End the background estimates (the run is over, or was interrupted)."""
    if process is None or process.poll() is not None:
        return
    process.kill()
    process.wait()


def main(stdin: str | None = None) -> int:
    """Estimate each setting of the JSON list on standard input (or `stdin`) not yet in the run's cache."""
    from .memory import _setting_from_payload, cached_estimate, estimate
    from .sweep import _init_worker

    payloads = json.loads(sys.stdin.read() if stdin is None else stdin)
    _init_worker()   # one thread, no rank variables: the estimator's own process group
    for payload in payloads:
        setting = _setting_from_payload(payload)
        if cached_estimate(setting) is None:
            estimate(setting, progress=False, subprocess_mode=False)   # writes the run's cache
    return 0


if __name__ == "__main__":
    sys.exit(main())
