"""Lesson 06's code exercise, 06-lora-fsdp: the learner's LoRA + fully_shard next to the lab's recipe, on the ranks."""

from __future__ import annotations

import math

from ..settings import TrainSetting
from .checkers import exercise, first_line, ranks_not_ready


# --- LoRA on a sharded model, written by the learner ----------------------------------------------------------

def lora_fsdp_setting(lora_rank: int = 16, world_size: int = 2, batch_size: int = 4) -> TrainSetting:
    """The miniature as the exercise trains it: the lesson's recipe (LoRA of `lora_rank`, alpha 2 x rank, on every
    Linear of the decoder layers, one FSDP unit per layer and the root), in fp32 and without checkpointing, so
    the learner's model and the recipe's can be compared number for number."""
    from ..recipes.lora import StringTask, miniature_config

    task = StringTask("sort")
    return TrainSetting(model=miniature_config(task.tokenizer), world_size=world_size, lora_rank=lora_rank,
                        lora_alpha=2 * lora_rank, precision="fp32", activation_checkpointing=False,
                        seq_len=task.seq_len, batch_size=batch_size)


def _plain_name(name: str) -> str:
    """A parameter's name without peft's wrapper prefix: the same for peft's model and the model inside it."""
    return name.removeprefix("base_model.model.")


def _local(tensor):
    """This rank's part of a parameter or gradient: a DTensor's local shard, a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _targets(names) -> list:
    """The kinds of module that hold LoRA adapters (q_proj, ..., down_proj), in the model's order."""
    return list(dict.fromkeys(name.split(".lora_")[0].rpartition(".")[2] for name in names if "lora_" in name))


def _two_steps(model, batches, lr: float) -> dict:
    """Two training steps of `model` (AdamW over its trainable parameters): each step's loss and adapter
    gradients (this rank's shards, by name), the parameters that changed, and the bytes this rank keeps."""
    import torch

    from ..sharding import make_optimizer, train_step

    params = {_plain_name(name): p for name, p in model.named_parameters()}
    before = {name: _local(p).detach().clone() for name, p in params.items()}
    optimizer = make_optimizer(model, "adamw", lr=lr)
    out = {"losses": [], "grads": [], "grad_bytes": 0}

    def note_gradients():
        grads = {name: _local(p.grad).detach().double().clone() for name, p in params.items()
                 if p.grad is not None and "lora_" in name}
        out["grads"].append(grads)
        out["grad_bytes"] = sum(_local(p.grad).nbytes for p in params.values() if p.grad is not None)

    for batch in batches:
        out["losses"].append(float(train_step(model, optimizer, batch, after_backward=note_gradients)))
    with torch.no_grad():
        out["changed"] = [name for name, p in params.items() if not torch.equal(_local(p), before[name])]
    out["param_bytes"] = sum(_local(p).nbytes for p in params.values())
    out["state_bytes"] = sum(_local(t).nbytes for state in optimizer.state.values() for t in state.values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0)
    return out


def compare_lora_fsdp(fn, lora_rank: int = 16, batch_size: int = 4, lr: float = 2e-3, seed: int = 0) -> dict:
    """On a rank: the learner's `fn(model, mesh)` on the miniature's base model, next to the lab's recipe
    (`sharding.build_sharded`, as `fsdplab.recipes.lora` builds it). Returns what the learner's model trains and
    how it is sharded, then two training steps of each on this rank's batches: losses, adapter gradients, the
    parameters that changed and the bytes this rank keeps (parameters, gradients, optimizer state)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    from ..models import blocks_of
    from ..recipes.lora import StringTask
    from ..ranks import device, mesh, this_rank, world_size
    from ..sharding import build_model, build_sharded

    n, r, dev = world_size(), this_rank(), device()
    setting = lora_fsdp_setting(lora_rank, n, batch_size)
    task = StringTask("sort")
    batches = []
    for step in range(2):
        ids, labels = task.batch(batch_size, seed=seed + 100_003 * r + step)
        batches.append({"input_ids": ids.to(dev), "labels": labels.to(dev)})
    lab = build_sharded(setting, mesh(), device=dev, seed=seed)
    lab_params = {_plain_name(name): p for name, p in lab.named_parameters()}
    out = {"rank": r, "world_size": n, "lora_rank": lora_rank, "layers": len(blocks_of(lab)),
           "lab_trainable": sum(p.numel() for p in lab_params.values() if p.requires_grad),
           "lab_targets": _targets(lab_params)}
    # the base model as the recipe's rank 0 builds it (same seed), before its adapters
    model = build_model(setting.replace(lora_rank=None, lora_alpha=None), device=dev, seed=seed)
    layers = blocks_of(model)
    try:
        returned = fn(model, mesh())
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        # what the function had done before it raised (peft adds its adapters inside the model it is given)
        out["error"], out["layer_units"] = first_line(err), sum(isinstance(layer, FSDPModule) for layer in layers)
        out["all_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        return out
    out["returned"] = type(returned).__name__
    if not isinstance(returned, nn.Module):
        return out
    params = {_plain_name(name): p for name, p in returned.named_parameters()}
    lora = {name: p for name, p in params.items() if "lora_" in name}
    out["trainable"] = sum(p.numel() for p in params.values() if p.requires_grad)
    out["params_count"] = len(params)
    out["base_trainable"] = [name for name, p in params.items() if p.requires_grad and "lora_" not in name]
    out["targets"] = _targets(lora)
    out["ranks"] = sorted({p.shape[0] for name, p in lora.items() if "lora_A" in name})
    out["plain"] = [name for name, p in params.items() if not isinstance(p, DTensor)]
    out["misplaced"] = [(name, str(tuple(p.placements)), p.device_mesh.mesh.tolist()) for name, p in params.items()
                        if isinstance(p, DTensor) and (tuple(p.placements) != (Shard(0),)
                                                       or p.device_mesh.mesh.tolist() != mesh().mesh.tolist())]
    out["layer_units"] = sum(isinstance(layer, FSDPModule) for layer in layers)
    # peft draws each adapter's A from the random generator, where the learner's code may have drawn other
    # numbers first: both models start from the recipe's adapters, so the steps compare like with like
    with torch.no_grad():
        for name, p in lora.items():
            if name in lab_params and _local(p).shape == _local(lab_params[name]).shape:
                _local(p).copy_(_local(lab_params[name]))
    out["lab"] = lab_steps = _two_steps(lab, batches, lr)
    try:
        out["mine"] = mine = _two_steps(returned, batches, lr)
    except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
        out["run_error"] = first_line(err)
        lab_steps.pop("grads")
        return out
    # the adapter gradients of both steps, side by side; and the first step's ratio of sizes (LoRA's scale)
    diff = norm = first_mine = first_lab = 0.0
    for step, (got, expected) in enumerate(zip(mine.pop("grads"), lab_steps.pop("grads"))):
        for name, g in expected.items():
            mine_g = got.get(name)
            mine_g = torch.zeros_like(g) if mine_g is None or mine_g.shape != g.shape else mine_g
            diff += float((mine_g - g).pow(2).sum())
            norm += float(g.pow(2).sum())
            if step == 0:
                first_mine += float(mine_g.pow(2).sum())
                first_lab += float(g.pow(2).sum())
    out["grad_gap"] = math.sqrt(diff / (norm or 1.0))
    out["grad_ratio"] = math.sqrt(first_mine / (first_lab or 1.0))
    out["loss_gap"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine["losses"], lab_steps["losses"]))
    return out


def _listed(names) -> str:
    """'a', 'a and b', 'a, b and c'."""
    names = list(names)
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


def _kept(side: dict) -> int:
    """Bytes a rank keeps between steps: its parameter shards, their gradients and the optimizer state."""
    return side["param_bytes"] + side["grad_bytes"] + side["state_bytes"]


def _kib(nbytes: int) -> str:
    """Bytes as KiB, for the checker's messages: '2,774 KiB'."""
    return f"{nbytes / 1024:,.0f} KiB"


def _owners(names) -> str:
    """The modules that hold `names` (parameter names), listed: 'model.embed_tokens, model.norm and lm_head'."""
    return _listed(dict.fromkeys(name.rpartition(".")[0] for name in names))


@exercise("06-lora-fsdp")
def _lora_fsdp(answer, *, cluster, lora_rank: int = 16, rel: float = 1e-4):
    """The learner's `my_lora_fsdp(model, mesh)` on the miniature, next to the lab's recipe on the live ranks:
    what trains, how it is sharded, and two training steps (losses, adapter gradients, bytes kept per rank)."""
    if not callable(answer):
        return False, f"expected a function my_lora_fsdp(model, mesh) that returns the model, got {answer!r}."
    if (not_ready := ranks_not_ready(cluster, "before its summary")) is not None:
        return False, not_ready
    try:
        results = cluster.run(compare_lora_fsdp, answer, lora_rank, quiet=True)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    n, layers, want = out["world_size"], out["layers"], out["lab_trainable"]
    one = (" (on 1 rank a shard is the whole tensor, so how the bytes split cannot show here; what trains, what "
           "is a DTensor and which modules are units can)") if n == 1 else ""
    everywhere = "whole on the one rank" if n == 1 else "whole on every rank"
    recipe = f"the recipe trains peft's {want:,} adapter parameters (rank {lora_rank}) and keeps the base frozen"
    if "error" in out:
        if out["all_sharded"] and not out["layer_units"]:
            return False, ("the root was sharded before the decoder layers: its unit already held the layers' "
                           f"parameters, and your function then raised {out['error']}")
        return False, f"your function raised on the ranks: {out['error']}"
    if out["returned"] == "NoneType" or "trainable" not in out:
        return False, (f"your function returns {out['returned'] if out['returned'] != 'NoneType' else 'None'}: "
                       "return the model (peft's wrapper of it), which the training step goes on to use.")
    if not out["targets"]:
        if len(out["plain"]) == out["params_count"]:
            return False, (f"the model came back as it was given: no LoRA adapter, no parameter sharded, so all "
                           f"{out['trainable']:,} of its parameters would train, {everywhere}; {recipe}{one}.")
        return False, (f"the model is sharded but has no LoRA adapter: all {out['trainable']:,} of its parameters "
                       f"train, where {recipe}{one}.")
    plain_lora = [name for name in out["plain"] if "lora_" in name]
    if len(out["plain"]) == out["params_count"]:
        return False, (f"the adapters are there, but no parameter is sharded: every one is a plain tensor, "
                       f"{everywhere}{one}.")
    if plain_lora:
        if n == 1:
            return False, (f"the {len(plain_lora)} adapter weights are plain tensors: they were added after the "
                           "layers were sharded, so no FSDP unit holds them; on 2 or more ranks each rank would keep "
                           "them whole and train them on its own batch, their gradients never averaged (1 rank "
                           "cannot show that). Add the adapters first, then shard.")
        kept = (f" Rank {out['rank']} keeps {_kib(_kept(out['mine']))} where the recipe keeps "
                f"{_kib(_kept(out['lab']))}." if "mine" in out else "")
        return False, (f"the {len(plain_lora)} adapter weights are plain tensors, whole on every rank: they were "
                       "added after the layers were sharded, so no FSDP unit holds them and their gradients are "
                       f"never averaged over the ranks. Add the adapters first, then shard.{kept}")
    if out["base_trainable"]:
        base = out["base_trainable"]
        changed = ([name for name in out["mine"]["changed"] if "lora_" not in name] if "mine" in out else [])
        after = (f"; after two steps {len(changed)} base weights changed, and rank {out['rank']} keeps "
                 f"{_kib(_kept(out['mine']))} of parameters, gradients and optimizer state where the recipe keeps "
                 f"{_kib(_kept(out['lab']))}" if changed else "")
        return False, (f"the base is not frozen: {len(base)} of its weights train too (such as {base[0]}), "
                       f"{out['trainable']:,} trainable parameters where {recipe}{after}.")
    if set(out["targets"]) != set(out["lab_targets"]) or out["ranks"] != [lora_rank]:
        ranks = _listed(map(str, out["ranks"]))
        return False, (f"{out['trainable']:,} trainable parameters where peft counts {want:,} for the recipe's "
                       f"config: your adapters sit on {_listed(out['targets'])} with rank {ranks}; the recipe's "
                       f"on every Linear of the decoder layers ({_listed(out['lab_targets'])}) with rank {lora_rank}.")
    if out["trainable"] != want:
        return False, f"{out['trainable']:,} trainable parameters where {recipe}."
    if out["plain"]:
        return False, (f"the root was not sharded: the parameters of {_owners(out['plain'])} are plain tensors, "
                       f"{everywhere}{one}.")
    if out["misplaced"]:
        name, placements, ranks = out["misplaced"][0]
        return False, f"{name} is a DTensor {placements} over ranks {ranks}, not Shard(dim=0) over the mesh given."
    if out["layer_units"] < layers:
        what = (f"none of the {layers} decoder layers is an FSDP unit" if not out["layer_units"] else
                f"only {out['layer_units']} of the {layers} decoder layers are FSDP units")
        return False, (f"{what}, so the root's unit gathers {'them' if not out['layer_units'] else 'the rest'} "
                       "all at once in forward and backward; the recipe makes each decoder layer a unit of its own, "
                       f"then the root{one}.")
    if "run_error" in out:
        return False, f"the model your function returned raised in a training step: {out['run_error']}"
    base_changed = [name for name in out["mine"]["changed"] if "lora_" not in name]
    if base_changed:
        return False, (f"{len(base_changed)} base weights changed in two steps (such as {base_changed[0]}): only "
                       "the adapters may train.")
    worst = max(results, key=lambda x: max(x["loss_gap"], x["grad_gap"]))
    if max(worst["loss_gap"], worst["grad_gap"]) > rel:
        ratio = worst["grad_ratio"]
        if abs(ratio - 1) > 0.05:
            return False, (f"your adapters' first gradients are {ratio:.2f}x the recipe's: LoRA scales what the "
                           f"adapters add by lora_alpha / r, and the recipe's alpha is 2 x r = {2 * lora_rank}.")
        return False, (f"rank {worst['rank']}'s loss differs from the recipe's by {worst['loss_gap']:.1e} and its "
                       f"adapter gradients by {worst['grad_gap']:.1e} (relative): keep the model in fp32 as given "
                       "(no mixed precision here) and the adapters without dropout, as the recipe's config.")
    heavy = next((x for x in results if _kept(x["mine"]) != _kept(x["lab"])), None)
    if heavy:
        return False, (f"rank {heavy['rank']} keeps {_kib(_kept(heavy['mine']))} of parameters, gradients and "
                       f"optimizer state where the recipe keeps {_kib(_kept(heavy['lab']))}{one}.")
    kept = _kib(_kept(out["mine"]))
    sharded = "sharded on dim 0 over the one rank" if n == 1 else f"sharded on dim 0 over {n} ranks"
    return True, (f"{want:,} adapter parameters train, as peft counts for the recipe's config; every parameter is "
                  f"{sharded}, the {layers} decoder layers and the root are FSDP units; after two steps the base "
                  f"is bit-identical and loss and adapter gradients match the recipe's (worst relative gap "
                  f"{max(worst['loss_gap'], worst['grad_gap']):.1e}); rank 0 keeps {kept}, as the recipe does, "
                  f"the frozen base with no gradient or optimizer state{one}.")
