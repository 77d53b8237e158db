"""Lesson 01 (sharding math) only: what one rank keeps of a sharded parameter, and the per-rank bytes of the
tiny transformer trained under DDP, SHARD_GRAD_OP and FULL_SHARD over a growing group of ranks.

Both functions run on the ranks (inside `cluster.run`).
"""

from __future__ import annotations

import math

_GROUPS: dict = {}


def shard_layout(shapes=((8, 4), (7, 4))) -> list:
    """fully_shard a module holding one parameter per shape over all ranks and report what this rank keeps
    of each: local shape, placements, and the bytes of its (padded) storage."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ..dist import mesh

    module = nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"w{i}", nn.Parameter(torch.arange(math.prod(shape), dtype=torch.float32)
                                                        .reshape(shape)))
    fully_shard(module, mesh=mesh())
    rows = []
    for (name, p), shape in zip(module.named_parameters(), shapes):
        local = p.to_local()
        rows.append({"parameter": name, "global_shape": tuple(shape), "local_shape": tuple(local.shape),
                     "placements": str(p.placements), "local_values": local.tolist(),
                     "storage_bytes": local.untyped_storage().nbytes()})
    return rows


def _subgroup(size: int):
    """(process group of ranks 0..size-1, member?): every rank must call it, in the same order."""
    import torch.distributed as dist

    if size not in _GROUPS:
        _GROUPS[size] = dist.group.WORLD if size == dist.get_world_size() else dist.new_group(list(range(size)))
    return _GROUPS[size], dist.get_rank() < size


def replica_bytes(strategy: str = "full_shard", group_size: int | None = None, cfg=None, steps: int = 2,
                  batch_size: int = 2, per_block: bool = True, optimizer: str = "adamw"):
    """Train the tiny transformer (fp32, Adam) with `strategy` ('ddp' is real DDP, 'shard_grad_op',
    'full_shard') over ranks 0..group_size-1 and `measure` it. Ranks outside the group return None; members
    return their MemoryReport with `detail['params']` = the model's parameter count."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..dist import device, this_rank, world_size
    from ..memory import measure
    from ..models import TinyConfig, random_batch
    from ..settings import check_choice
    from ..sharding import apply_ddp, apply_fsdp, build_tiny, make_optimizer

    check_choice("strategy", strategy, ("ddp", "shard_grad_op", "full_shard"))
    group, member = _subgroup(group_size or world_size())
    if not member:
        return None
    cfg = cfg or TinyConfig()
    model = build_tiny(cfg, seed=0, device=device())
    params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        model = apply_ddp(model, device(), process_group=group)
    else:
        apply_fsdp(model, DeviceMesh.from_group(group, device().type), reshard_after_forward=strategy == "full_shard",
                   per_block=per_block)
    opt = make_optimizer(model, optimizer, lr=1e-3)
    report = measure(model, opt, random_batch(cfg, batch_size, seed=this_rank(), device=device()), steps=steps)
    report.detail["params"] = params
    report.settings.update(strategy=strategy, group_size=group_size or world_size(), per_block=per_block)
    return report
