"""The estimator: how much memory one rank of an FSDP2 training step needs, without the GPUs.

- exact: the per-rank figure of a real step on fake tensors (`estimate`); live: the same step measured on
  live ranks (`measure`, `measure_setting`); ddp: torch's DDP in the estimate; block_repeat makes a deep
  model's step from a trace of a few blocks, allocator replays it through a model of the CUDA caching
  allocator, offload_view and local_shards are what stays on the GPU and what one rank holds
- formula: the analytic model (`formula`, `spec_of`), instant; report: `MemoryReport`, the answer
- checks: what the estimator rejects, said with the fix; sweep: many settings at once (`Sweep`,
  `start_estimates`); workers: the one way an estimate runs in another process; cache: one `fsdplab run`'s
  estimates, made once
- published, gpu_measured: peaks measured on real GPUs, with their sources
"""

from .exact import estimate, estimate_group, estimate_here, memory_snapshot
from .live import measure, measure_setting
from .formula import ModelSpec, formula, shard_numel, spec_of
from .report import CATEGORIES, CATEGORY_LABELS, MemoryReport
from .sweep import Estimates, Sweep, estimate_all, start_estimates
from .workers import Workers, estimate_elsewhere

__all__ = ["CATEGORIES", "CATEGORY_LABELS", "Estimates", "MemoryReport", "ModelSpec", "Sweep", "Workers",
           "estimate", "estimate_all", "estimate_elsewhere", "estimate_group", "estimate_here", "formula",
           "measure", "measure_setting", "memory_snapshot", "shard_numel", "spec_of", "start_estimates"]
