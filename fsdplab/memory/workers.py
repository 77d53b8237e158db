"""The one way the package runs exact estimates in other processes.

An estimate runs elsewhere when this process cannot run it (it holds a process group already: a rank, and the
estimator builds a fake one of its own), when the caller must go on meanwhile (a lesson's live ranks, a
dashboard that stays responsive), or when several run at once (a sweep's points, a run's estimates made ahead).
Every such process is a worker of `Workers`: spawned, never forked from the caller (a fork of a process that
holds torch's threads, or of a rank, is unsafe); under `fsdplab run`, a fork of the run's fork server, which
imported torch once and holds no thread (the end of this file). It is set up by `_set_up`: no rank variables
(RANK, MASTER_ADDR, ...: it is not a rank of the caller's group), one torch thread, SIGKILL when the process
that started it dies (Linux), and, for work in the background, the lowest CPU priority in a session of its own.
The callers: `memory.estimate` (one estimate, its progress lines relayed as they come; the dashboards through
it), `sweep.Estimates` (points on shared fake models, several workers) and `runner.estimates_ahead` (a run's later
estimates).

As with every spawned pool, a script run by path that estimates out of process must keep its top-level work
under `if __name__ == "__main__":` (a spawned worker imports the main script; a notebook kernel, an
ipyparallel engine and `python -m fsdplab` need nothing).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import queue as queue_module
import sys
from multiprocessing import context, popen_spawn_posix, reduction, resource_tracker, spawn, util

from ..runtime import collector
from ..runtime.processes import PYTHON_COMMAND_ENV

RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_progress = None   # in a worker: the queue progress lines go to (None: no one listens)


class Workers:
    """`count` worker processes (see the module's docstring), started at the first `submit`."""

    def __init__(self, count: int = 1, *, background: bool = False, progress: bool = False):
        from concurrent.futures import ProcessPoolExecutor

        context = _ThroughForkServer() if forked_workers() else multiprocessing.get_context("spawn")
        self.lines = context.Queue() if progress else None
        self.pool = ProcessPoolExecutor(max(1, count), mp_context=context, initializer=_set_up,
                                        initargs=(background, self.lines))

    def submit(self, fn, *args):
        """A Future of `fn(*args)` run in a worker (`fn` importable by name: the worker imports it)."""
        return self.pool.submit(fn, *args)

    def stop(self, wait: bool = True) -> None:
        """Cancel what has not started and end the workers, at once when `wait` is False (the run is over)."""
        kill = getattr(self.pool, "kill_workers", None)   # Python 3.14; before it, the executor's own table
        if not wait and kill is not None:
            kill()
        elif not wait:
            for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                process.kill()
        self.pool.shutdown(wait=wait, cancel_futures=True)
        if self.lines is not None:
            self.lines.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(wait=exc[0] is None)
        return False


def estimate_elsewhere(estimate, setting, progress=True):
    """`estimate(setting, progress=..., progress_stream=...)` (memory's, passed in: this module imports no
    estimator) in a worker; each progress line goes to `progress` (a function, True: print, False: nowhere) as it
    comes. The worker's error is raised here, with its message."""
    relay = progress if callable(progress) else (lambda line: print(line, flush=True)) if progress else None
    with Workers(1, progress=relay is not None) as workers:
        future = workers.submit(_with_progress, estimate, setting, relay is not None)
        while True:
            try:
                line = workers.lines.get(timeout=0.1) if relay is not None else None
            except queue_module.Empty:
                line = None
            if line is not None:
                relay(line)
            elif future.done():
                break
            elif relay is None:
                future.exception()   # nothing to relay: just wait
        return future.result()


def _with_progress(estimate, setting, progress: bool):
    """In a worker: one estimate, its progress lines sent to the caller."""
    return estimate(setting, progress=progress, progress_stream=_Lines() if progress else None)


class _Lines:
    """A text stream whose lines go to the caller's queue (what `print(..., file=)` writes to)."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip() and _progress is not None:
                _progress.put(line)
        return len(text)

    def flush(self) -> None:
        pass


def set_up_for_estimates() -> None:
    """This process estimates on its own: no rank variables that would make it a rank of the caller's group, one
    torch thread (one core per worker). The estimator's imports run with the garbage collector paused, and what
    they make is then set aside for good (fsdplab.runtime.collector): it lives as long as the worker, and every
    full collection would scan it again."""
    for name in RANK_ENV:
        os.environ.pop(name, None)
    with collector.set_aside():
        import torch
        import torch.distributed.fsdp  # noqa: F401

        from .. import models  # noqa: F401  (and transformers)

        torch.set_num_threads(1)


def _set_up(background: bool, lines) -> None:
    global _progress
    from ..runtime.processes import die_with_parent

    _progress = lines
    die_with_parent()
    if background:
        if os.getsid(0) != os.getpid():   # a fork server's fork leads a session of its own already
            os.setsid()
        lowest_priority()
    set_up_for_estimates()


def lowest_priority() -> None:
    """This process at nice 19, its session too. Linux's autogroups share the CPU between sessions before nice
    values count, and Jupyter starts each kernel in a session of its own: without the session's nice, a process
    in the background would take half the CPU from a lesson's kernel and ranks."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:   # no autogroups (not Linux, or a kernel without them): the process's nice is enough
        pass


# --- workers forked from the run's fork server ------------------------------------------------------------
# Under `fsdplab run` (fsdplab.runner.forkserver), a spawned worker would import torch, transformers and peft
# again, 3-5 s of CPU before its first estimate, beside the lesson's ranks. There, a worker is a fork of the
# server, which imported them once: multiprocessing's spawn with the server's client (runner/fork_client.py,
# `--multiprocessing`) in place of a new interpreter. The client passes the server the descriptors spawn passes
# the new interpreter (its pipes, the resource tracker's, the queues'), and the fork runs `spawn_main` with them at
# the same numbers: the worker is set up (`_set_up`), fed and watched as a spawned one.

def forked_workers() -> bool:
    """Whether workers are forks of a fork server: one runs for this process (Linux only)."""
    return bool(os.environ.get(PYTHON_COMMAND_ENV)) and sys.platform.startswith("linux")


class _ForkServerPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn on POSIX (Python 3.10-3.13: `popen_spawn_posix.Popen._launch`, the same there),
    starting the fork server's client instead of a new interpreter."""

    def _launch(self, process_obj):
        if not os.environ.get(PYTHON_COMMAND_ENV):   # the server stopped after the pool was made: a plain spawn
            return super()._launch(process_obj)
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)   # adds the descriptors of the queues it holds to self._fds
        finally:
            context.set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            self._fds.extend([child_r, child_w])
            command = json.loads(os.environ[PYTHON_COMMAND_ENV]) + [
                "--multiprocessing", str(tracker_fd), str(child_r), ",".join(map(str, self._fds))]
            self.pid = util.spawnv_passfds(os.fsencode(command[0]), command, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _ForkServerProcess(context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        return _ForkServerPopen(process_obj)


class _ThroughForkServer(context.SpawnContext):
    """The "spawn" context whose processes are forks of the fork server (`forked_workers`)."""

    Process = _ForkServerProcess
