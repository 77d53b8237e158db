"""Exact estimates over a grid of sequence lengths, micro-batches and world sizes: "which of these runs fit on
my GPUs?" as a table, one JSON object or a heat map.

`sweep(...)` checks the setting first (fsdplab.memory.checks), then estimates every point in worker processes,
one per core: each estimate is single-threaded Python dispatch on fake tensors, so two processes on two cores
take about half the time of one, and a worker that stays up pays the cold start (imports, first-call set-up:
about 10 s at 7B) once, not once per point.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field

from .checks import check
from ..settings import GIB, MIB, TrainSetting


# --- the grid ---------------------------------------------------------------------------------------------------

@dataclass
class Sweep:
    """Reports of one setting at every (world_size, seq_len, batch_size) of a grid."""

    setting: TrainSetting
    seq_lens: list
    batch_sizes: list
    world_sizes: list
    gpu_mem_gib: float
    reports: dict = field(default_factory=dict)   # (world_size, seq_len, batch_size) -> MemoryReport
    seconds: float = 0.0
    workers: int = 1

    def points(self):
        """(world_size, seq_len, batch_size) in table order."""
        return list(itertools.product(self.world_sizes, self.seq_lens, self.batch_sizes))

    def unit(self):
        """("GiB", bytes per GiB), or MiB for models too small to show in GiB."""
        largest = max(report.peak_bytes for report in self.reports.values())
        return ("GiB", GIB) if largest >= GIB / 4 else ("MiB", MIB)

    def grid(self, world_size: int, per=GIB) -> list:
        """Peak per GPU in units of `per` bytes, rows micro-batch, columns sequence length (the heat map's
        layout)."""
        return [[self.reports[world_size, s, b].peak_bytes / per for s in self.seq_lens] for b in self.batch_sizes]

    def table(self) -> str:
        s = self.setting
        unit, per = self.unit()
        lines = [f"exact per-GPU peak ({unit}) of {s.model_name}, {_describe(s)}: {len(self.reports)} points in "
                 f"{self.seconds:.0f} s ({self.workers} worker{'s' if self.workers > 1 else ''}); "
                 f"* = does not fit in {self.gpu_mem_gib:g} GiB"]
        for world_size in self.world_sizes:
            lines += ["", f"world size {world_size}", "  batch \\ seq " + "".join(f"{s:>10}" for s in self.seq_lens)]
            for b, row in zip(self.batch_sizes, self.grid(world_size, per)):
                cells = "".join(f"{value:9.2f}{'*' if value * per > self.gpu_mem_gib * GIB else ' '}" for value in row)
                lines.append(f"  {b:>11} " + cells)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        points = []
        for key in self.points():
            report = self.reports[key]
            point = dict(zip(("world_size", "seq_len", "batch_size"), key))
            point.update(peak_gib=round(report.peak_bytes / GIB, 4), fits=report.fits(self.gpu_mem_gib),
                         **{k: v for k, v in report.to_dict().items() if k != "world_size"})
            points.append(point)
        return {"setting": self.setting.to_dict(), "gpu_mem_gib": self.gpu_mem_gib, "seq_lens": self.seq_lens,
                "batch_sizes": self.batch_sizes, "world_sizes": self.world_sizes, "seconds": self.seconds,
                "workers": self.workers, "points": points}

    def description(self) -> str:
        """The setting in words, as the table's and the heat map's titles give it."""
        return _describe(self.setting)

def _describe(s: TrainSetting) -> str:
    parts = [f"LoRA r={s.lora_rank}" if s.lora_rank else "full fine-tune", s.strategy, f"{s.precision} compute",
             f"{s.base_dtype} base", s.optimizer]
    ac = s.activation_checkpointing
    if ac:
        parts.append("checkpointing" if ac is True else f"{ac} checkpointing" if ac in ("selective", "reentrant")
                     else f"checkpointing every {ac} blocks")
    if s.cpu_offload:
        parts.append("cpu offload")
    if s.attention_kind != "sdpa":
        parts.append(f"{s.attention_kind} attention")
    if s.loss_chunks > 1:
        parts.append(f"loss in {s.loss_chunks} chunks")
    if s.embed_head_units:
        parts.append("embedding and head as units")
    if s.use_cache:
        parts.append("KV cache on")
    return ", ".join(parts)


def sweep(setting: TrainSetting, *, seq_lens=None, batch_sizes=None, world_sizes=None, gpu_mem_gib=24.0,
          workers: int = 2, progress: bool = True) -> Sweep:
    """Exact estimates of `setting` at every combination of the given values (None: the setting's own),
    `workers` at a time in worker processes; a progress bar on stderr while they run."""
    from tqdm.auto import tqdm

    result = Sweep(setting, list(seq_lens or [setting.seq_len]), list(batch_sizes or [setting.batch_size]),
                   list(world_sizes or [setting.world_size]), gpu_mem_gib)
    settings = {key: setting.replace(world_size=key[0], seq_len=key[1], batch_size=key[2])
                for key in result.points()}
    # what check() rejects depends on the model, LoRA and the longest sequence only
    check(max(settings.values(), key=lambda point: point.seq_len))
    result.workers = max(1, min(workers, len(settings)))
    t0 = time.perf_counter()
    with tqdm(total=len(settings), desc="estimate", unit="point", file=sys.stderr, disable=not progress) as bar:
        def done(point, report):
            key = (point.world_size, point.seq_len, point.batch_size)
            bar.set_postfix_str(f"world {key[0]} seq {key[1]} x{key[2]}: {report.peak_bytes / GIB:.2f} GiB")
            bar.update()

        reports = estimate_all(list(settings.values()), workers=result.workers, on_done=done)
    result.reports.update(zip(settings, reports))
    result.seconds = round(time.perf_counter() - t0, 1)
    return result


def estimate_all(settings: list, workers: int = 2, on_done=None) -> list:
    """`memory.estimate` of each setting, `workers` at a time in warm worker processes (each pays the imports
    once, not once per setting); `on_done(setting, report)` as each finishes. Returns the reports in order."""
    return start_estimates(settings, workers, on_done).result()


def start_estimates(settings: list, workers: int = 2, on_done=None) -> "Estimates":
    """Start `estimate_all(settings)` and return at once: the estimates run in worker processes while the
    caller goes on (a lesson's live ranks, say); `.result()` waits for them and returns the reports in order.

    A setting listed twice is estimated once, and one this run already estimated (FSDPLAB_ESTIMATE_CACHE,
    which `fsdplab run` shares between its lessons) is read back without starting a worker."""
    return Estimates(list(settings), workers, on_done)


class Estimates:
    """Exact estimates under way in worker processes (see `start_estimates`)."""

    def __init__(self, settings: list, workers: int = 2, on_done=None):
        from .cache import cached_estimate, estimate_under_way

        self.settings, self.on_done = settings, on_done
        self.reports: list = [None] * len(settings)
        # settings may hold unhashable configs (a miniature's transformers config): compare, do not hash
        self._first = [next(j for j in range(i + 1) if settings[j] == s) for i, s in enumerate(settings)]
        todo, self._waiting = [], []
        for i in sorted(set(self._first)):
            self.reports[i] = cached_estimate(settings[i])
            if self.reports[i] is None:   # another process of the run (estimates ahead) may be at it already
                (self._waiting if estimate_under_way(settings[i]) else todo).append(i)
        self._pool, self._futures, self._finished, self._error = None, {}, False, None
        self._workers = workers
        self._submit(todo)

    def _submit(self, indices: list) -> None:
        """Start estimating the settings at `indices` in worker processes (fsdplab.memory.workers)."""
        from .workers import Workers
        from .exact import estimate_group

        if not indices:
            return
        if self._pool is None:
            self._pool = Workers(min(self._workers, len(indices)))
        for chunk in _chunks(self.settings, indices, self._workers):
            self._futures[self._pool.submit(estimate_group, [self.settings[i] for i in chunk])] = chunk

    def result(self) -> list:
        """Wait for every estimate; the reports in the order of the settings (`on_done` runs as each arrives)."""
        from concurrent.futures import as_completed

        if self._error is not None:   # a second call after a failure: the same error, not a list of None
            raise RuntimeError(f"these estimates failed earlier ({type(self._error).__name__}: {self._error}); "
                               f"start them again with start_estimates(...)") from self._error
        if self._finished:
            return [self.reports[first] for first in self._first]
        from .cache import wait_for_estimate

        late = []
        for i in self._waiting:   # made by another process of the run: wait for it, or estimate it here after all
            self.reports[i] = wait_for_estimate(self.settings[i])
            if self.reports[i] is None:
                late.append(i)
        self._waiting = []
        self._submit(late)
        pending = {i for chunk in self._futures.values() for i in chunk}
        for i in sorted(set(self._first) - pending):     # read back from the cache
            self._done(i)
        if self._pool is not None:
            try:
                for future in as_completed(self._futures):
                    for i, report in zip(self._futures[future], future.result()):
                        self.reports[i] = report
                        self._done(i)
            except BaseException as e:   # a failed point or Ctrl-C: do not start the points still queued
                for future in self._futures:
                    future.cancel()
                self._error = e
                raise
            finally:
                self._pool.stop()
                self._pool, self._futures = None, {}
        self._finished = True
        return [self.reports[first] for first in self._first]

    def _done(self, i: int) -> None:
        """Fill in, and announce, every setting equal to the i-th once its report is there."""
        for j, first in enumerate(self._first):
            if first == i:
                self.reports[j] = self.reports[i]
                if self.on_done is not None:
                    self.on_done(self.settings[j], self.reports[j])


def _chunks(settings: list, indices: list, workers: int) -> list:
    """`indices` in groups that share a fake model (settings equal but for seq_len and batch_size), each group
    cut into at most `workers` chunks so that the workers share it: one task per chunk, one build per task."""
    groups = []
    for i in indices:
        base = settings[i].replace(seq_len=1, batch_size=1)
        group = next((g for g in groups if g[0] == base), None)
        if group is None:
            groups.append(group := (base, []))
        group[1].append(i)
    chunks = []
    for _, members in groups:
        n = max(1, min(workers, len(members)))
        chunks += [members[k::n] for k in range(n)]
    return chunks


