"""Exact estimates of later lessons, made ahead while earlier lessons run (`fsdplab run` with several lessons).

A lesson's `start_estimates` reads a setting back from the run's estimate cache (FSDPLAB_ESTIMATE_CACHE) when
it is already there. While the run goes on, one background process fills that cache with the full-scale
settings later lessons will ask for, at the lowest CPU priority: it takes the time the lessons leave the
cores idle (waiting on ranks, kernels and hang timeouts) and yields to them otherwise. A setting it has not
finished when a lesson needs it is estimated by the lesson, as without it. Only runs at the lessons' default
parameters make estimates ahead: other parameters may ask for other settings.

    python -m fsdplab.estimates_ahead < LESSONS.json     (what `start` runs: notebook names as a JSON list)
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from . import lessons


def lesson_settings(stem: str) -> list:
    """The full-scale settings the lesson of notebook `stem` estimates at its defaults and does not start itself
    at once: its module's `settings_ahead()` (fsdplab.lessons.MODULES names each lesson's module, by the number
    that starts the notebook's name); none for a module without one (lesson 01 starts its two with its imports)."""
    name = lessons.MODULES.get(stem[:2])
    if name is None:
        return []
    module = importlib.import_module(f"{lessons.__name__}.{name}")
    return module.settings_ahead() if hasattr(module, "settings_ahead") else []


def settings_for(paths) -> list:
    """Every setting the lessons in `paths` would estimate later, once each, in lesson order."""
    settings = []
    for path in paths:
        settings += [s for s in lesson_settings(Path(path).stem) if s not in settings]
    return settings


def start(paths, cache: str) -> subprocess.Popen:
    """Start estimating `settings_for(paths)` into `cache` in a background process at the lowest priority.
    The process itself works out the settings: importing the lesson modules takes CPU the first lesson needs."""
    env = {**os.environ, "FSDPLAB_ESTIMATE_CACHE": str(cache)}
    process = subprocess.Popen([sys.executable, "-m", "fsdplab.estimates_ahead"], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True, preexec_fn=_lowest_priority)
    with process.stdin:   # the lessons' notebook names, as JSON on its standard input
        process.stdin.write(json.dumps([Path(p).stem for p in paths]))
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


def estimate_missing(settings) -> None:
    """Estimate each of `settings` that is not yet in the run's cache (which the estimates fill)."""
    from .estimate_cache import cached_estimate, estimate_under_way, marked_under_way
    from .memory import estimate   # looked up at each call: a test replaces it

    for setting in settings:
        if cached_estimate(setting) is None and not estimate_under_way(setting):
            with marked_under_way(setting):   # a lesson that needs it now waits for it rather than start again
                estimate(setting, progress=False, subprocess_mode=False)   # writes the run's cache


def main(stdin: str | None = None) -> int:
    """Estimate ahead what the lessons named by the JSON list on standard input (or `stdin`) will need."""
    from .sweep import init_estimate_process

    stems = json.loads(sys.stdin.read() if stdin is None else stdin)
    init_estimate_process()   # one thread, no rank variables: the estimator's own process group
    estimate_missing(settings_for(stems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
