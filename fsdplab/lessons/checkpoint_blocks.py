"""Lesson 08's code exercise, 08-checkpoint-blocks: the learner's per-block checkpointing, trained on the ranks."""

from __future__ import annotations

import torch
from torch import nn

from .activation_checkpointing import build, checkpoint_blocks, same_gradients_bound, token_batch, twin_config
from .checkers import exercise, first_line, ranks_not_ready


# --- the checkpointing exercise: the learner's code, run on the live ranks --------------------------------


def _is_parameter(tensor) -> bool:
    """A parameter or a view of one (a Linear keeps its weight transposed): weights, not activations. Under
    fully_shard these are the unsharded copies it swaps in for forward, parameters too."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _sharded_step(model: nn.Module, blocks: list, batch, rng_seed: int) -> dict:
    """On a rank: one forward and backward of the sharded `model`, dropout drawn from `rng_seed`. Returns the
    bytes autograd kept for backward (counted with saved_tensors_hooks, each storage once, parameters left
    out), the blocks whose modules ran again in backward (the recomputation, in order), the all-gathers, and
    the gradients of the trainable parameters (in full; None where a parameter got none)."""
    from ..comms import CommCounter
    from ..sharding import loss_of

    phase, again = ["forward"], []

    def note(i):
        if phase[0] == "backward" and (not again or again[-1] != i):
            again.append(i)

    hooks = [module.register_forward_pre_hook(lambda *_, i=i: note(i))
             for i, block in enumerate(blocks) for module in block.modules()]
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in kept and not _is_parameter(tensor):
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    out = {}
    torch.manual_seed(rng_seed)          # the same dropout masks in every run's forward
    try:
        with CommCounter(fsdp_labels=False) as counter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = loss_of(model, batch)
            phase[0] = "backward"
            loss.backward()
    except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
        out["run_error"] = first_line(err)
    finally:
        for hook in hooks:
            hook.remove()
    trainable = [p for p in model.parameters() if p.requires_grad]
    out.update(kept=sum(kept.values()), again=again, gathers=sum(r["kind"] == "all_gather" for r in counter.records),
               grads=[None if p.grad is None else p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                      for p in trainable])
    return out


def compare_checkpointing(checkpoint_fn, layers: int = 3, lora_rank: int = 4, dropout: float = 0.1,
                          batch_size: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """On a rank: the learner's `checkpoint_fn(model)` on the tiny twin with LoRA adapters and attention
    dropout, next to the same model without checkpointing and with the lab's (`checkpoint_blocks`, 'torch'),
    each then sharded as `dropout_gradients` shards it and trained one step from the same weights, data and
    dropout seed. Returns what each kept for backward and ran again in backward, its all-gathers, and how far
    the learner's gradients are from those without checkpointing."""
    from ..models import blocks_of
    from ..ranks import mesh, this_rank, world_size
    from ..sharding import apply_fsdp

    config = twin_config(hidden=64, layers=layers, vocab=128, dropout=dropout)
    batch = token_batch(config, batch_size, seq_len, seed=seed + this_rank())
    rng_seed = 1000 + seed + this_rank()

    def fresh():
        model = build(config, lora_rank=lora_rank, seed=seed)
        return model, blocks_of(model)      # the decoder blocks themselves, before anything wraps them

    def step(model, blocks):
        apply_fsdp(model, mesh())           # one unit per block (per checkpointed block), then the root
        return _sharded_step(model, blocks, batch, rng_seed)

    plain = step(*fresh())
    model, blocks = fresh()
    lab = step(checkpoint_blocks(model, "torch"), blocks)
    out = {"rank": this_rank(), "world_size": world_size(), "device": mesh().device_type, "layers": layers,
           "plain_kept": plain["kept"], "lab_kept": lab["kept"], "lab_again": lab["again"],
           "lab_gathers": lab["gathers"], "trainable": len(plain["grads"])}
    model, blocks = fresh()
    try:
        returned = checkpoint_fn(model)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        out["error"] = first_line(err)
        return out
    out["returned"] = ("model" if returned is None or returned is model else
                       "a module" if isinstance(returned, nn.Module) else type(returned).__name__)
    try:
        mine = step(returned if isinstance(returned, nn.Module) else model, blocks)
    except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
        out["shard_error"] = first_line(err)
        return out
    grads = mine.pop("grads")
    out.update(mine)
    if len(grads) != len(plain["grads"]):
        out["trains"] = len(grads)
        return out
    out["missing"] = sum(g is None for g in grads)
    out["max_grad"] = max(float(g.abs().max()) for g in plain["grads"])
    out["lab_gap"] = max(float((g - r).abs().max()) for g, r in zip(lab["grads"], plain["grads"]))
    out["gap"] = (max(float((g - r).abs().max()) for g, r in zip(grads, plain["grads"])) if not out["missing"]
                  else float("inf"))
    return out


def _blocks_text(indices: list) -> str:
    """'block 1', 'blocks 0 and 2', 'blocks 0, 1 and 2'."""
    names = [str(i) for i in indices]
    listed = " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
    return f"block {listed}" if len(names) == 1 else f"blocks {listed}"


@exercise("08-checkpoint-blocks")
def _checkpoint_blocks(answer, *, cluster, layers: int = 3):
    """The learner's `my_checkpoint(model)` on a LoRA twin with dropout, sharded and trained one step on every
    rank, next to the same model without checkpointing and with the lab's checkpointing: gradients, what
    backward ran again, and the bytes autograd kept for backward."""
    if not callable(answer):
        return False, ("expected a function my_checkpoint(model) that checkpoints each block and returns the model, "
                       f"got {answer!r}.")
    if (not_ready := ranks_not_ready(cluster, "after its exercises")) is not None:
        return False, not_ready
    try:
        results = cluster.run(compare_checkpointing, answer, layers)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if {"error", "shard_error", "run_error"} & set(x)), results[0])
    if "error" in out:
        return False, f"your function raised on the ranks: {out['error']}"
    if "shard_error" in out:
        return False, (f"fully_shard raised on your checkpointed model: {out['shard_error'].rstrip(':.')}. Only "
                       "checkpoint: the checker shards the model itself, each block and then the root.")
    if out["returned"] not in ("model", "a module"):
        return False, (f"your function returns {out['returned']}: return the model, which the checker then shards "
                       "and trains.")
    if "run_error" in out:
        error = out["run_error"]
        if "does not require grad" in error:
            return False, ("no adapter got a gradient: backward refused with " + error + ". With the base frozen, a "
                           "block's input needs no gradient, and a reentrant checkpoint then records no graph "
                           "through the block: take the checkpoint the lesson recommends.")
        if "Unexpected keyword arguments" in error:
            return False, (f"the checkpointed model raised in forward: {error}. The blocks are called with keyword "
                           "arguments (the mask, the positions), which the reentrant checkpoint cannot pass on.")
        return False, f"the checkpointed model raised in forward or backward: {error}"
    if "trains" in out:
        return False, (f"your model trains {out['trains']} parameters where the LoRA model trains "
                       f"{out['trainable']}: checkpointing leaves which parameters train as they are.")
    if out["missing"]:
        return False, (f"{out['missing']} of the {out['trainable']} adapter weights on rank {out['rank']} got no "
                       "gradient: the checkpoint recorded no graph through some blocks.")
    worst = max(results, key=lambda x: x["gap"] / max(x["max_grad"], 1e-30))
    # what two runs of the same step differ by: none on CPU ranks, a GPU's run-to-run noise (the lab's own gap)
    bound = max(same_gradients_bound(worst["device"], worst["max_grad"]), 10 * max(x["lab_gap"] for x in results))
    if worst["gap"] > bound:
        return False, (f"rank {worst['rank']}'s adapter gradients differ from the run without checkpointing by up to "
                       f"{worst['gap']:.2g} (the largest gradient is {worst['max_grad']:.2g}): under dropout the "
                       "recomputation drew other masks than forward did. It must replay forward's random state, "
                       "which torch's checkpoint does unless told not to.")
    one_rank = (" On 1 rank fully_shard all-gathers nothing, so the step's all-gathers were not compared with "
                "the lab's."
                if out["world_size"] == 1 else "")
    kept, lab, plain, blocks = out["kept"], out["lab_kept"], out["plain_kept"], list(range(out["layers"]))
    mine = ("as much as without checkpointing" if kept >= plain else
            f"{1 - kept / plain:.0%} less than the {plain:,} B without checkpointing")
    bytes_text = (f"your model kept {kept:,} B for backward, {mine}, where the lab's keeps {lab:,} B "
                  f"({1 - lab / plain:.0%} less)")
    again = out["again"]
    if not again:
        return False, ("gradients match, but no block ran again in backward: nothing was checkpointed, and "
                       f"{bytes_text}.{one_rank}")
    skipped = [i for i in blocks if i not in again]
    if skipped:
        they = "it kept all its" if len(skipped) == 1 else "they kept all their"
        return False, (f"gradients match, but {_blocks_text(skipped)} did not run again in backward: not checkpointed, "
                       f"{they} activations, and {bytes_text}.{one_rank}")
    if again != out["lab_again"]:
        return False, (f"gradients match, but backward ran blocks {', '.join(map(str, again))} again in that "
                       "order, where the lab's runs each again on its own, just before its backward "
                       f"({', '.join(map(str, out['lab_again']))}): your checkpoint holds several blocks as one "
                       "piece, so backward rebuilds all their activations at once. Forward kept "
                       f"{kept:,} B, the lab's {lab:,} B: checkpoint each block on its own.{one_rank}")
    if kept > lab + 0.1 * (plain - lab):
        return False, (f"gradients match and each block ran again in backward, but {bytes_text}: checkpoint the whole "
                       f"block, not a part of it.{one_rank}")
    if out["world_size"] > 1 and out["gathers"] != out["lab_gathers"]:
        return False, (f"gradients and bytes match, but rank {out['rank']} all-gathered {out['gathers']} times in the "
                       f"step where the lab's gathers {out['lab_gathers']} times: let fully_shard gather each block "
                       "once in forward and once in backward.")
    gathered = f".{one_rank}" if one_rank else f"; rank 0 all-gathered {out['gathers']} times, as under the lab's."
    ranks = "on every rank " if out["world_size"] > 1 else ""
    return True, (f"adapter gradients equal those without checkpointing {ranks}(largest difference "
                  f"{worst['gap']:.1g}), each of the {len(blocks)} blocks ran again in backward on its own, and "
                  f"the model kept {kept:,} B for backward, {1 - kept / plain:.0%} less than without "
                  f"checkpointing ({plain:,} B), as the lab's does{gathered}")
