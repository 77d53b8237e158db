"""Lesson 08, claim 11 only: the posts' `size_based_auto_wrap_policy(min_num_params=1e7)` call, the
`functools.partial` form, and the units FSDP1's auto-wrap makes of a model with it (counted on the meta device,
checked against a real FSDP1 wrap on the ranks), with what the unit count does to the collectives of a step.
The models are `fsdplab.lessons.activation_checkpointing`'s.
"""

from __future__ import annotations

import functools
import warnings

from torch import nn

from .checkers import exercise
from .activation_checkpointing import block_names, build, token_batch
from .qwen_v1 import qwen_v1_model

# What the posts wrote, as data the lesson checks (not a verdict).
POSTS_MIN_NUM_PARAMS = 1e7


def posts_policy_error() -> str:
    """The posts' `size_based_auto_wrap_policy(min_num_params=1e7)`, evaluated: the TypeError's message."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    try:
        size_based_auto_wrap_policy(min_num_params=POSTS_MIN_NUM_PARAMS)
    except TypeError as e:
        return f"TypeError: {e}"
    return ""


def size_policy(min_num_params: float = POSTS_MIN_NUM_PARAMS):
    """The working form: `functools.partial(size_based_auto_wrap_policy, min_num_params=...)`, which FSDP1
    calls as `policy(module=..., recurse=..., nonwrapped_numel=...)` for every module."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    return functools.partial(size_based_auto_wrap_policy, min_num_params=int(min_num_params))


def policy_units(model: nn.Module, policy) -> list:
    """(name, parameters) of every unit FSDP1's auto-wrap makes of `model` with `policy`, children before
    parents, the root ('') last with what no unit took. A unit's parameters are its own, those no unit
    inside it took, so the sizes add up to the model's count.

    The walk FSDP1 does (torch.distributed.fsdp.wrap._recursive_wrap, called with only_wrap_children for the
    root, which FSDP1 wraps itself): ask `policy(recurse=True)` with the module's parameter count whether to
    look inside; wrap the children that qualify; then wrap the module itself if `policy(recurse=False)` says
    the parameters its children left over are enough. Runs on a meta-device model."""
    units = []

    def walk(module, name, is_root=False):
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(walk(child, f"{name}.{child_name}" if name else child_name)
                      for child_name, child in module.named_children())
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            units.append((name, numel - wrapped))   # its own: the units inside it hold the rest
            return numel
        return wrapped

    total = sum(p.numel() for p in model.parameters())
    walk(model, "", is_root=True)
    units.append(("", total - sum(n for _, n in units)))
    return units


def qwen_v1_meta(config=None) -> nn.Module:
    """Qwen-7B v1 as its own modeling code lays it out (the posts' model), on the meta device: per block ONE
    fused `attn.c_attn` (q, k and v together). The lab's Qwen2 classes split c_attn into q/k/v: more units at 1e7."""
    return qwen_v1_model(config)


def block_units(model: nn.Module) -> list:
    """(name, parameters) of the lab's layout (`apply_fsdp`): one unit per block, the root with the rest."""
    from ..models import blocks_of

    blocks = [(name, sum(p.numel() for p in block.parameters()))
              for name, block in zip(block_names(model), blocks_of(model))]
    return blocks + [("", sum(p.numel() for p in model.parameters()) - sum(n for _, n in blocks))]


def fsdp1_unit_count(config, min_num_params: float) -> dict:
    """Runs on every rank: wrap the model of `config` with real FSDP1 (FullyShardedDataParallel on this
    rank's device) and `size_policy(min_num_params)`; count the FSDP1 instances torch made, next to the
    count `policy_units` predicts on a meta-device copy."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ..ranks import device
    from ..sharding import apply_fsdp1

    predicted = len(policy_units(build(config, device="meta"), size_policy(min_num_params)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # FSDP1 warns that it is deprecated in favour of fully_shard
        model = apply_fsdp1(build(config, device=device()), device(), auto_wrap_policy=size_policy(min_num_params))
    made = sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    return {"fsdp1_units": made, "predicted": predicted}


def collectives_per_step(config, layout: str = "policy", min_num_params: float = 0, *, batch_size: int = 2,
                         seq_len: int = 32, shard=None) -> dict:
    """Runs on every rank: FSDP2 with one unit per module `policy_units` picks ('policy', at
    `min_num_params`) or per block ('blocks'); one counted training step. Returns the units, the all-gathers
    and reduce-scatters launched, and the largest all-gather (bytes). `shard(model, units)` applies FSDP2
    (lesson 08 writes it in a cell; default: `sharding.apply_fsdp`)."""
    from ..comms import CommCounter
    from ..ranks import device, mesh, this_rank
    from ..sharding import apply_fsdp, make_optimizer, train_step

    model = build(config, device=device())
    if layout == "policy":
        names = [name for name, _ in policy_units(model, size_policy(min_num_params))[:-1]]
        modules = [model.get_submodule(name) for name in names]
    else:
        modules = None   # apply_fsdp's default: the blocks
    if shard is None:
        apply_fsdp(model, mesh(), blocks=modules)
    else:
        from ..models import blocks_of

        shard(model, modules if modules is not None else blocks_of(model))
    optimizer = make_optimizer(model, "adamw")
    batch = token_batch(config, batch_size, seq_len, seed=this_rank())
    with CommCounter() as counter:
        train_step(model, optimizer, batch)
    gathers = [r for r in counter.records if r["kind"] == "all_gather"]
    return {"units": (len(modules) if modules is not None else len(block_units(model)) - 1) + 1,
            "all_gathers": len(gathers),
            "reduce_scatters": sum(r["kind"] == "reduce_scatter" for r in counter.records),
            "largest_all_gather": max((r["tensor_bytes"] for r in gathers), default=0)}


def claim11_verdict(*, error: str, units: int, block_units: int) -> tuple:
    """(verdict, reason) for passing `size_based_auto_wrap_policy(min_num_params=1e7)` directly."""
    runs = not error
    reason = (("the call runs" if runs else f"the call raises {error.split(':')[0]}") + "; with functools.partial, "
              f"1e7 makes {units} units of Qwen-7B (v1, fused c_attn) against {block_units} per block "
              f"({units / block_units:.1f}x the collectives)")
    return ("right" if runs else "wrong"), reason


# --- exercise -----------------------------------------------------------------------------------------------

@exercise("08-units")
def _units(answer, *, min_num_params, model="qwen-7b-v1"):
    """How many FSDP1 units `min_num_params` makes of `model` (default the posts' Qwen-7B v1, fused c_attn),
    against policy_units on its meta-device build."""
    from ..models import causal_lm

    built = qwen_v1_meta() if model == "qwen-7b-v1" else causal_lm(model, device="meta")
    measured = len(policy_units(built, size_policy(min_num_params)))
    if isinstance(answer, (bool, str)) or not isinstance(answer, (int, float)) or not float(answer).is_integer():
        return False, f"expected a whole number of units, got {answer!r}."
    value = int(answer)
    if value == measured:
        return True, f"{value} units, as the walk FSDP1 does counts them on {model}."
    return False, (f"{value} is {'too many' if value > measured else 'too few'}. Hint: list one block's Linear layers "
                   "with their parameter counts: which pass the threshold alone? What is left over in the block, "
                   "and does that pass it? Then the embedding, the LM head and the root.")
