"""What live ranks really hold, per category, as a `MemoryReport` (the same six categories as the estimate):
`measure(model, optimizer, batch)` for a model you built, `measure_setting(setting)` for the model `estimate`
sizes. Both run the training step of fsdplab.memory.exact under torch's memory tracker.
"""

from __future__ import annotations

import time

from . import ddp
from .. import custom as custom_model
from ..custom import custom_of
from .exact import _loss_fn, _resident, _run_steps
from .report import MemoryReport
from ..settings import EXACT_STRATEGIES, GIB, TrainSetting, as_setting, check_choice

__all__ = ["measure", "measure_setting"]


def measure(model, optimizer, batch, *, steps: int = 4, loss_fn=None, accumulate: int = 1,
            no_sync: bool = False) -> MemoryReport:
    """Per-category peak memory of this rank over `steps` real training steps (the lowest peak of the
    steps after the first, which creates the optimizer state; see _run_steps for why the lowest).

    Call it on every rank inside `cluster.run` (it runs collectives). `batch` is a dict of model kwargs
    (transformers: input_ids, labels), or (inputs, targets); `loss_fn(model, batch)` overrides the loss.
    Categories come from torch's memory tracker (FSDPMemTracker for FSDP2 models, MemTracker otherwise);
    on a GPU the notes add torch.cuda.max_memory_allocated over the steps (allocator's view, for comparison).
    """
    import torch

    from ..ranks import this_rank, this_world_size

    t0 = time.perf_counter()
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak, by_category, raw, category_peaks, after_backward, after_step, moment, timeline, _ = _run_steps(
        model, optimizer, batch, steps, loss_fn, accumulate=accumulate, no_sync=no_sync)
    notes = ["categories from torch's memory tracker (tensor storages, exact bytes on CPU)."]
    buckets = ddp.bucket_bytes(model)
    if buckets:
        by_category, category_peaks, unseen = ddp.relabel_measured(by_category, category_peaks, after_step, buckets)
        peak += unseen
        notes.append(f"DistributedDataParallel's {len(buckets)} gradient buckets ({sum(buckets)} B, as DDP reports "
                     "them) in communication_buffers.")
    if on_gpu:
        torch.cuda.synchronize()
        notes.append(f"tracker peak {peak / GIB:.3f} GiB; torch.cuda.max_memory_allocated "
                     f"{torch.cuda.max_memory_allocated() / GIB:.3f} GiB over the steps.")
    return MemoryReport(peak_bytes=int(peak), by_category=by_category, world_size=this_world_size(),
                        settings={"rank": this_rank(), "steps": steps},
                        notes=notes, source="measure", resident=_resident(after_backward, after_step),
                        detail=raw, category_peaks=category_peaks, peak_moment=moment, timeline=timeline,
                        seconds=round(time.perf_counter() - t0, 2))


def measure_setting(setting: TrainSetting | None = None, /, *, steps: int = 4, seed: int = 0,
                    **changes) -> MemoryReport:
    """On a live rank: build the model `estimate` sizes for `setting` (real weights), shard it over the rank's
    mesh and `measure` it. Returns this rank's report (call inside cluster.run on every rank; compare with
    `estimate(setting)`). setting.world_size must be the group's size."""
    import torch

    from ..ranks import device, mesh
    from ..models import config_of
    from ..sharding import apply_data_parallel, build_model, data_parallel_mesh, make_optimizer

    setting = as_setting(setting, **changes)
    check_choice("strategy (measured)", setting.strategy, EXACT_STRATEGIES)
    if setting.world_size != mesh().size():
        raise ValueError(f"setting.world_size is {setting.world_size} but the group has {mesh().size()} ranks: "
                         f"use setting.replace(world_size={mesh().size()}).")
    if setting.cpu_offload and device().type != "cuda":
        raise ValueError("cpu_offload is measured on GPU ranks only: FSDP2's CPUOffloadPolicy moves shards between "
                         "the host and an accelerator. On CPU ranks use estimate(setting), which models it.")
    torch.manual_seed(seed)
    config = config_of(setting.model)
    custom = custom_of(config)
    group = mesh() if setting.strategy != "hybrid_shard" else data_parallel_mesh(setting, device().type)
    if setting.cpu_offload and custom is not None:
        raise ValueError("cpu_offload of a custom model is estimated only (estimate(setting)), not measured.")
    if setting.cpu_offload:
        net = _build_offloaded(setting.replace(model=config), seed)
    else:
        net = build_model(setting.replace(model=config), device=device(), dtype=setting.base_dtype)
        net = apply_data_parallel(net, setting, group, custom_model.blocks(custom, net) if custom else None)
    opt = make_optimizer(net, setting.optimizer)
    if custom is not None:
        batch = custom_model.batch(custom, setting, device())
    else:
        tokens = torch.randint(0, config.vocab_size, (setting.batch_size, setting.seq_len), device=device())
        batch = {"input_ids": tokens, "labels": tokens}
    report = measure(net, opt, batch, steps=steps, loss_fn=_loss_fn(setting, device().type),
                     accumulate=setting.grad_accum, no_sync=setting.no_sync)
    report.settings.update(setting.to_dict())
    return report


def _build_offloaded(setting: TrainSetting, seed: int):
    """The model as an offloading program builds it: on the meta device, fully_shard with CPUOffloadPolicy, the
    shards placed in host memory by to_empty, the weights from rank 0 (sharding.build_sharded). Built on the GPU
    first, the model would leave there what offloading is meant to keep off it (and its peak would be that)."""
    from ..ranks import device, mesh
    from ..sharding import build_sharded

    check_choice("strategy (with cpu_offload)", setting.strategy, ("full_shard", "shard_grad_op"))
    return build_sharded(setting, mesh(), device=device(), seed=seed)
