"""Apply data parallelism to a model, torchtitan style: small `apply_*` functions with plain keyword
arguments, and one `parallelize` that calls them in the order that matters.

FSDP here is FSDP2 (`fully_shard`), which runs on CPU ranks with gloo as well as on GPUs; the posts'
FSDP1 wrapper needs a GPU (see the lessons for the FSDP1 -> FSDP2 mapping).
"""

from __future__ import annotations

import torch
from torch import nn

STRATEGIES = ("ddp", "shard_grad_op", "full_shard", "no_shard")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def blocks_of(model: nn.Module) -> list:
    """The repeated transformer blocks: the units FSDP shards and gathers one at a time."""
    for path in ("layers", "model.layers", "base_model.model.model.layers", "transformer.h"):
        module = model
        try:
            for name in path.split("."):
                module = getattr(module, name)
        except AttributeError:
            continue
        return list(module)
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}; pass blocks= explicitly.")


def mixed_precision_policy(precision: str = "fp32", reduce_precision: str | None = None):
    """FSDP2 MixedPrecisionPolicy for 'fp32' (None: no casting), 'bf16' or 'fp16'."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {list(DTYPES)}, got {precision!r}.")
    if precision == "fp32" and reduce_precision is None:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision],
                                reduce_dtype=DTYPES[reduce_precision or "fp32"])


def apply_activation_checkpointing(model: nn.Module, blocks=None) -> None:
    """Recompute each block in backward instead of storing its activations (non-reentrant, as torch advises)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing as _apply, checkpoint_wrapper)

    targets = set(map(id, blocks if blocks is not None else blocks_of(model)))
    _apply(model, check_fn=lambda m: id(m) in targets,
           checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool = True, precision: str = "fp32",
               reduce_precision: str | None = None, cpu_offload: bool = False, per_block: bool = True,
               blocks=None) -> nn.Module:
    """fully_shard each block (so only one is gathered at a time), then the root for what is left.

    reshard_after_forward=True is FULL_SHARD (ZeRO-3); False is SHARD_GRAD_OP (ZeRO-2): parameters stay
    gathered from forward to backward, saving the backward all-gather at the cost of memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(precision, reduce_precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if per_block:
        for block in blocks if blocks is not None else blocks_of(model):
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: nn.Module, device=None) -> nn.Module:
    """Classic DDP: every rank keeps everything; gradients are all-reduced in buckets."""
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device(device or "cpu")
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def parallelize(model: nn.Module, strategy: str = "full_shard", *, mesh=None, device=None, precision="fp32",
                activation_checkpointing: bool = False, cpu_offload: bool = False) -> nn.Module:
    """The order matters: checkpointing wraps blocks before FSDP shards them, so each shard unit is a
    checkpointed block; the root is sharded last."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if strategy == "ddp":
        return apply_ddp(model, device)
    if mesh is None:
        from .dist import mesh as current_mesh

        mesh = current_mesh()
    if strategy == "no_shard":
        # FSDP2 has no NO_SHARD; replicate() is DDP built on the same machinery.
        from torch.distributed._composable.replicate import replicate

        return replicate(model)
    return apply_fsdp(model, mesh, reshard_after_forward=(strategy == "full_shard"), precision=precision,
                      cpu_offload=cpu_offload)


def backward_and_step(loss, optimizer, scaler=None) -> None:
    """loss.backward(), optimizer.step(), zero_grad(); through a GradScaler when one is given (fp16)."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_tiny(cfg=None, seed: int = 0, device="cpu") -> nn.Module:
    """The same TinyTransformer on every rank (same seed), on `device`."""
    from .models import TinyConfig, TinyTransformer

    torch.manual_seed(seed)
    return TinyTransformer(cfg or TinyConfig()).to(device)


def train(model, optimizer, steps: int, cfg, batch_size: int = 4, device="cpu", seed: int = 0,
          log_every: int = 0) -> list:
    """A plain training loop on the toy task; each rank gets its own slice of data. Returns the losses."""
    import torch.distributed as dist

    from .models import random_batch

    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in range(steps):
        tokens, targets = random_batch(cfg, batch_size, seed=seed + 1000 * step + rank, device=device)
        # Call the wrapper's forward (not model.module): DDP only synchronises gradients it saw a forward for.
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        backward_and_step(loss, optimizer)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1) and rank == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses
