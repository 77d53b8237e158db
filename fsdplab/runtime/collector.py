"""Python's garbage collector in a process that imports torch once and then lives on it: paused through the
imports, then told to leave what exists by then alone (gc.freeze).

Those objects (about 700,000 for torch, transformers and peft: modules, classes, functions) live until the process
exits, yet each full collection scans them all again. Three kinds of process do this: the `fsdplab` command
(a 7B `fsdplab estimate` on 2 cores spent about 1.5 s in collections during its imports and the final one at exit;
benchmarks/README.md, "The estimator"; one estimate keeps it paused through the estimate, whose model's build
imports the model's module and peft), the run's fork server before it forks ranks and kernels (a fork's
collections would otherwise write to those pages and copy them into every fork), and the estimator's workers.
A test or a notebook that calls `fsdplab.runner.cli.main()` keeps its collector as it was.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

_paused = False


def pause() -> None:
    """Collection off until `resume()`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collection on again (if `pause()` stopped it), every object made so far set aside for good (gc.freeze):
    later collections, the one at exit too, scan only what the process makes from here on."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


@contextmanager
def set_aside():
    """`pause()` for the block, `resume()` after it: what the block imports is never scanned again."""
    pause()
    try:
        yield
    finally:
        resume()
