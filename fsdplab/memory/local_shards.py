"""Make an optimizer step FSDP2's local shards instead of its DTensor parameters (the estimator's fake steps)."""

from __future__ import annotations


def step_local_shards(optimizer) -> None:
    """Make `optimizer` step FSDP2's local shards instead of its DTensor parameters.

    On DTensors every foreach op of the step pays DTensor's sharding propagation over hundreds of parameters
    (seconds per op on fake tensors: a fifth of a 7B LoRA estimate), yet the memory is the local shards'
    either way: DTensor runs the same foreach ops on them, and those are what the tracker sees. A step
    pre-hook points the parameter groups at the shards and lends each shard its DTensor gradient's shard; a
    post-hook takes both back, so that zero_grad frees the gradients as before. The optimizer state is keyed
    by the shards, which FSDP2 settles in its lazy init (the first forward, before the first step)."""
    from torch.distributed.tensor import DTensor

    from .._torch_private import local_shard

    held = [list(group["params"]) for group in optimizer.param_groups]

    def lend(opt, args, kwargs):
        for group, params in zip(opt.param_groups, held):
            group["params"] = [local_shard(p) if isinstance(p, DTensor) else p for p in params]
            for p, shard in zip(params, group["params"]):
                if shard is not p:
                    shard.grad = None if p.grad is None else local_shard(p.grad)
        stepped = {id(shard) for group in opt.param_groups for shard in group["params"]}
        assert all(id(key) in stepped for key in opt.state), \
            "FSDP2 replaced a parameter's local shard after the optimizer state was keyed by it"

    def take_back(opt, args, kwargs):
        for group, params in zip(opt.param_groups, held):
            for p, shard in zip(params, group["params"]):
                if shard is not p:
                    shard.grad = None
            group["params"] = params

    optimizer.register_step_pre_hook(lend)
    optimizer.register_step_post_hook(take_back)
