"""Python's garbage collector in the `fsdplab` command's own process: paused while the command imports torch,
transformers and peft (and an estimate builds its model), then told to leave what exists by then alone.

Those objects (about 700,000: modules, classes, functions) live until the process exits, yet each full collection
scans them all again. In a 7B `fsdplab estimate` on 2 cores that was about 1.5 s of collections during the imports
and the final collection at exit (benchmarks/README.md, "The estimator"). Only the command's own process does
this (`command()`): a test or a notebook that calls `main()` keeps its collector as it was.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Collection off until `resume()`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Collection on again (if `pause()` stopped it), every object made so far set aside for good (gc.freeze):
    later collections, the one at exit too, scan only what the command makes from here on."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
