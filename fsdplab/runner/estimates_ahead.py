"""Exact estimates of later lessons, made ahead while earlier lessons run (`fsdplab run` with several lessons).

A lesson's `start_estimates` reads a setting back from the run's estimate cache (FSDPLAB_ESTIMATE_CACHE) when
it is already there. While the run goes on, one background process fills that cache with the full-scale
settings later lessons will ask for, at the lowest CPU priority: it takes the time the lessons leave the
cores idle (waiting on ranks, kernels and hang timeouts) and yields to them otherwise. A setting it has not
finished when a lesson needs it is estimated by the lesson, as without it. Only runs at the lessons' default
parameters make estimates ahead: other parameters may ask for other settings.

`start` runs `estimate_for` in one background worker of fsdplab.memory.workers (lowest priority, a session
of its own, gone with the run).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .. import lessons


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


def start(paths, cache: str):
    """Start estimating `settings_for(paths)` into `cache` in a background worker at the lowest priority; returns
    the worker and its future (for `stop`). The worker itself works out the settings: importing the lesson
    modules takes CPU the first lesson needs."""
    from ..memory.workers import Workers

    worker = Workers(1, background=True)
    return worker, worker.submit(estimate_for, [Path(p).stem for p in paths], str(cache))


def stop(started) -> None:
    """End the background estimates (the run is over, or was interrupted)."""
    if started is not None:
        started[0].stop(wait=False)


def estimate_missing(settings) -> None:
    """Estimate each of `settings` that is not yet in the run's cache (which the estimates fill)."""
    from ..memory.cache import cached_estimate, estimate_under_way, marked_under_way
    from ..memory.exact import estimate   # looked up at each call: a test replaces it

    for setting in settings:
        if cached_estimate(setting) is None and not estimate_under_way(setting):
            with marked_under_way(setting):   # a lesson that needs it now waits for it rather than start again
                estimate(setting, progress=False, subprocess_mode=False)   # writes the run's cache


def estimate_for(stems: list, cache: str) -> int:
    """In the background worker: estimate what the lessons named by `stems` will need, into the run's `cache`;
    returns how many settings that was."""
    os.environ["FSDPLAB_ESTIMATE_CACHE"] = cache
    settings = settings_for(stems)
    estimate_missing(settings)
    return len(settings)
