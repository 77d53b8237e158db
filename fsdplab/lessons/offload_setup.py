"""Lesson 03's code exercise, 03-offload-setup: the learner's offloaded wrap and optimizer, stepped on the ranks."""

from __future__ import annotations

from ..settings import MIB
from .checkers import exercise, first_line, ranks_not_ready


# --- the offloaded setup, written by the learner -----------------------------------------------------------


def _owners(names) -> list:
    """The modules that own parameters `names`, in order: "embed.weight", "norm.bias" -> ["embed", "norm"]."""
    return list(dict.fromkeys(name.rpartition(".")[0] or name for name in names))


def _listed(names: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


def _unit_list(units) -> str:
    """Units by name, the root said as such: 'blocks.0, blocks.1 and the root'."""
    return _listed(["the root" if unit == "root" else unit for unit in units])


def offload_units(model) -> list:
    """Each FSDP unit of `model` as FSDP2 itself records it: its module path ("root" for the model), its offload
    policy's class ("none given" where fully_shard got none), whether its parameters offload to the host and
    whether that host memory is pinned (each parameter's `offload_to_cpu` and `pin_memory` in FSDP2's state), and
    the modules whose parameters it holds."""
    import inspect

    from torch.distributed.fsdp import FSDPModule, fully_shard

    from .._torch_private import fsdp_param_groups

    default = inspect.signature(fully_shard).parameters["offload_policy"].default
    names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = fsdp_param_groups(module)
        params = [fp for group in groups for fp in group.fsdp_params]
        policies = sorted({"none given" if group.offload_policy is default else type(group.offload_policy).__name__
                           for group in groups})
        units.append({"unit": path or "root", "policy": ", ".join(policies) or "none given",
                      "offload": bool(params) and all(fp.offload_to_cpu for fp in params),
                      "pinned": bool(params) and all(fp.pin_memory for fp in params),
                      "owners": _owners(names.get(id(fp.sharded_param), "?") for fp in params)})
    return units


def _local(param):
    """A parameter's (or gradient's, or state's) tensor on this rank: its shard when it is a DTensor."""
    return param.to_local() if hasattr(param, "to_local") else param


def _one_step(model, opt, batch) -> dict:
    """One training step (`sharding.train_step`): the loss, each parameter's change on this rank, where the shards,
    their gradients and the optimizer state live (device types), and on a GPU the peak GPU bytes of the step."""
    import torch

    from ..ranks import device
    from ..sharding import train_step

    dev = device()
    params = dict(model.named_parameters())
    before = {name: _local(p).detach().cpu().clone() for name, p in params.items()}
    where = {}

    def after_backward():
        where["gradients"] = sorted({_local(p.grad).device.type for p in params.values() if p.grad is not None})

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    loss = train_step(model, opt, batch, after_backward=after_backward)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    where["parameters"] = sorted({_local(p).device.type for p in params.values()})
    where["optimizer state"] = sorted({_local(t).device.type for state in opt.state.values()
                                       for key, t in state.items() if key != "step" and hasattr(t, "device")})
    changes = {name: _local(p).detach().cpu() - before[name] for name, p in params.items()}
    return {"loss": float(loss), "changes": changes, "where": where, "peak": peak}


def compare_offload(setup_fn, num_blocks: int = 3, batch_size: int = 2, seq_len: int = 8, seed: int = 0,
                    lr: float = 1e-3) -> dict:
    """On a rank: lesson 01's MLPStack sharded per block and root WITHOUT offload, AdamW(lr) built after sharding,
    one step (the reference); then a fresh one through the learner's `setup_fn(model, mesh) -> optimizer` and one
    step with that optimizer. Returns FSDP2's record of each of the learner's units (`offload_units`), the
    parameters left plain, the parameters the optimizer does not hold, both losses, the relative gap between the
    two steps' parameter changes, the parameters the learner's step left as they were, and where each step's
    tensors lived with its peak GPU bytes (a GPU rank only)."""
    import gc
    import weakref

    import torch
    from torch.distributed.tensor import DTensor

    from ..ranks import device, mesh, this_rank, world_size
    from ..sharding import apply_fsdp
    from .sharding_math import build_mlp_stack

    n, r, dev = world_size(), this_rank(), device()
    ref_model = build_mlp_stack(num_blocks, seed, dev)
    gen = torch.Generator().manual_seed(seed + 1 + r)     # this rank's batch, drawn on the CPU: the same on any device
    tokens = torch.randint(0, ref_model.embed.num_embeddings, (batch_size, seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    apply_fsdp(ref_model, mesh(), blocks=list(ref_model.blocks))
    ref = _one_step(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=lr), batch)
    del ref_model
    gc.collect()
    out = {"rank": r, "world_size": n, "device": dev.type, "blocks": [f"blocks.{i}" for i in range(num_blocks)],
           "ref_loss": ref["loss"], "ref_peak": ref["peak"]}
    model = build_mlp_stack(num_blocks, seed, dev)
    # weak references: an optimizer built before sharding keeps these alive; nothing else should (on a GPU they
    # would add to the step's peak)
    before = [weakref.ref(p) for p in model.parameters()]
    try:
        opt = setup_fn(model, mesh())
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        out["error"] = first_line(err)
        return out
    out["units"] = offload_units(model)
    out["plain"] = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    out["returned"] = "None" if opt is None else type(opt).__name__
    out["optimizer"] = isinstance(opt, torch.optim.Optimizer)
    if out["plain"] or not out["optimizer"]:
        return out
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    params = list(model.named_parameters())
    out["params"] = len(params)
    out["not_held"] = [name for name, p in params if id(p) not in held]
    out["stale"] = [name for (name, _), old in zip(params, before) if old() is not None and id(old()) in held
                    and name in out["not_held"]]
    try:
        mine = _one_step(model, opt, batch)
    except Exception as err:  # noqa: BLE001 - the learner's optimizer is the answer to show
        out["run_error"] = first_line(err)
        return out
    diff = sum(float((mine["changes"][k] - c).pow(2).sum()) for k, c in ref["changes"].items())
    norm = sum(float(c.pow(2).sum()) for c in ref["changes"].values()) or 1.0
    out.update(loss=mine["loss"], where=mine["where"], peak=mine["peak"], gap=(diff / norm) ** 0.5,
               unchanged=[k for k, c in mine["changes"].items() if not c.any() and ref["changes"][k].any()])
    return out


def _kept_text(kept: list, units: dict, blocks: list) -> str:
    """What stays on the device when the units `kept` do not offload, said by which units they are."""
    if kept == ["root"]:
        return (f"the {len(blocks)} blocks offload, but the root does not: {_listed(units['root']['owners'])} keep "
                "their shards, gradients and AdamW state on the device. Each fully_shard call takes its own policy.")
    if sorted(kept) == sorted(blocks):
        return (f"only the root offloads ({_listed(units['root']['owners'])}): the {len(blocks)} blocks, most of the "
                "model, keep their shards, gradients and AdamW state on the device. Each fully_shard call takes its "
                "own policy.")
    return (f"{len(kept)} of {len(units)} units do not offload ({_unit_list(kept)}): they keep their shards, gradients "
            "and AdamW state on the device. Each fully_shard call takes its own policy.")


@exercise("03-offload-setup")
def _offload_setup(answer, *, cluster):
    """The learner's `setup(model, mesh) -> optimizer` on the live ranks: FSDP2's record of each unit's offload,
    the optimizer it returns, and one step against the same model sharded without offload."""
    if not callable(answer):
        return False, ("expected a function setup(model, mesh) that shards the model with offload and returns its "
                       f"optimizer, got {answer!r}.")
    if (not_ready := ranks_not_ready(cluster, "at its end")) is not None:
        return False, not_ready
    try:
        results = cluster.run(compare_offload, answer)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your setup raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    n, blocks, gpu = out["world_size"], out["blocks"], out["device"] == "cuda"
    if "error" in out:
        if "accelerator" in out["error"]:        # pinning host memory for a copy to a device the rank does not have
            return False, (f"your setup raised on the ranks: {out['error']} Pinned host memory serves copies to a "
                           "GPU, and these ranks have none: pin only where a GPU is.")
        return False, f"your setup raised on the ranks: {out['error']}"
    units = {u["unit"]: u for u in sorted(out["units"], key=lambda u: u["unit"] == "root")}   # the root last
    if not units:
        return False, "nothing was sharded: every parameter is still a plain tensor, whole on every rank."
    if "root" not in units:
        return False, (f"the root was not wrapped: {_listed(_owners(out['plain']))} stay plain tensors, whole on "
                       "every rank and never offloaded.")
    missing = [b for b in blocks if b not in units]
    if missing:
        return False, (f"{_listed(missing)} {'is not an FSDP unit' if len(missing) == 1 else 'are not FSDP units'} of "
                       "their own: the root's unit holds their parameters and gathers them all at once. Shard each "
                       "block, then the root.")
    if out["plain"]:
        return False, f"{_listed(out['plain'])} stayed plain tensors, whole on every rank and never offloaded."
    kept = [name for name, u in units.items() if not u["offload"]]
    if len(kept) == len(units):
        policies = {u["policy"] for u in units.values()}
        if policies == {"none given"}:
            return False, (f"no unit offloads: none of the {len(units)} fully_shard calls ({_unit_list(units)}) "
                           "got an offload policy, so FSDP2 keeps every unit's shards, gradients and AdamW state on "
                           "the rank's device.")
        if policies <= {"none given", "OffloadPolicy"}:
            return False, ("no unit offloads: OffloadPolicy is the base class, fully_shard's default, and means "
                           "'offload nothing'; its subclass for host memory is the one that moves shards, gradients "
                           "and AdamW state off the device.")
        return False, f"no unit offloads: FSDP2 offloads none of them under {_listed(sorted(policies))}."
    if kept:
        return False, _kept_text(kept, units, blocks)
    unpinned = [name for name, u in units.items() if not u["pinned"]]
    if gpu and unpinned:
        which = "to" if len(unpinned) == len(units) else f"{_unit_list(unpinned)} to"
        return False, (f"every unit offloads, but {which} unpinned host memory: each copy to the GPU then waits on "
                       "the CPU and cannot overlap compute. On a GPU rank, pin the host memory.")
    if not out["optimizer"]:
        return False, (f"every unit offloads, but your setup returns {out['returned']}, not an optimizer: return the "
                       "AdamW that trains the sharded model (the checker steps it once).")
    if "run_error" in out:
        return False, f"the step with your optimizer raised on rank {out['rank']}: {out['run_error']}"
    stale, missing = out["stale"], [name for name in out["not_held"] if name not in out["stale"]]
    if stale:
        left = [name for name in stale if name in out["unchanged"]]
        whose = "every shard" if len(left) == out["params"] else f"the shards of {_listed(_owners(left))}"
        held = f"all {len(stale)}" if len(stale) == out["params"] else f"{len(stale)} of the {out['params']}"
        return False, ((f"the step left {whose} as it was: " if left else "") + "your optimizer holds the model's "
                       f"parameters as they were before fully_shard replaced them with shards ({held}), and steps "
                       "those.")
    if missing:
        return False, (f"your optimizer does not hold the parameters of {_listed(_owners(missing))}: the step left "
                       "their shards as they were.")
    tolerance = 1e-4 if gpu else 1e-5        # fp32 on GPUs: AdamW on the host rounds otherwise than on the GPU
    worst = max(results, key=lambda x: abs(x["loss"] - x["ref_loss"]))
    if abs(worst["loss"] - worst["ref_loss"]) > tolerance * max(1.0, abs(worst["ref_loss"])):
        return False, (f"rank {worst['rank']}'s loss is {worst['loss']:.6f}, the un-offloaded reference's "
                       f"{worst['ref_loss']:.6f}: offload must leave what the model computes as it is (its values "
                       "and precision).")
    worst = max(results, key=lambda x: x["gap"])
    gap = worst["gap"]
    if gap > tolerance:
        return False, (f"the losses match, but rank {worst['rank']}'s step changed the shards otherwise than the "
                       f"reference's AdamW with lr=1e-3 over every parameter (relative gap {gap:.1e}): "
                       "return that optimizer.")
    if gpu:
        for what in ("parameters", "gradients", "optimizer state"):
            placed = next((x for x in results if x["where"].get(what) != ["cpu"]), None)
            if placed:
                return False, (f"every unit offloads by FSDP2's record, but rank {placed['rank']}'s sharded {what} "
                               f"lived on {', '.join(placed['where'].get(what) or ['no device'])}, not the CPU.")
        worst = max(results, key=lambda x: x["peak"] / x["ref_peak"])
        if worst["peak"] >= worst["ref_peak"]:
            return False, (f"every unit offloads, but rank {worst['rank']}'s step peaked at {worst['peak'] / MIB:.2f} "
                           f"MiB of GPU memory, the un-offloaded reference's at {worst['ref_peak'] / MIB:.2f} MiB: "
                           "offload should lower it.")
    record = (f"the {len(blocks)} blocks and the root offload by FSDP2's own record of each unit (shards, gradients "
              "and AdamW state to host memory)")
    ranks = (f"on every rank (worst relative gap {gap:.1e})" if n > 1 else
             f"(relative gap {gap:.1e}; on 1 rank each shard is the whole parameter)")
    match = f"one step's loss and updated shards match the un-offloaded reference's {ranks}"
    if gpu:
        best = results[0]
        return True, (f"{record}; rank 0's shards, gradients and AdamW state lived on the CPU and its step peaked at "
                      f"{best['peak'] / MIB:.2f} MiB of GPU memory, {best['ref_peak'] / MIB:.2f} MiB without "
                      f"offload; {match}.")
    return True, (f"{record}, and {match}. On CPU ranks the shards are in host memory with or without offload: "
                  "that it takes them off the GPU, and the GPU memory it saves, only a GPU rank shows.")
