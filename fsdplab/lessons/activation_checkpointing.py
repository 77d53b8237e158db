"""Lesson 08 (activation checkpointing and wrap policies: claims 8, 11 and 20) only: the models, claims 8 and 20.

- claim 8: what recomputation costs (FLOPs counted by torch's FlopCounterMode), what it saves (bytes of the
  tensors autograd keeps for backward, counted with saved_tensors_hooks), and what the posts'
  `checkpoint(..., preserve_rng_state=False)` does to gradients when the block has dropout (on live ranks);
- claim 11 (the posts' auto-wrap policy and the units it makes) is `fsdplab.lessons.auto_wrap`;
- claim 20: the posts' ms-swift keys against ms-swift's documented command-line flags;
- the checkpointing exercise ("08-checkpoint-blocks"): the learner's checkpointing of a LoRA twin with dropout
  under fully_shard, run on the live ranks next to the lab's.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from .checkers import close, exercise

# What the posts wrote, as data the lesson checks (not verdicts).
POSTS_SWIFT_KEYS = ("train", "activation_checkpointing")   # `train: activation_checkpointing: true`

CHECKPOINTING = ("none", "torch", "posts", "posts, non-reentrant")


# --- models --------------------------------------------------------------------------------------------

def estimate_settings() -> list:
    """The posts' Qwen-7B LoRA setting without and with activation checkpointing (the lesson's exact
    full-scale estimates)."""
    from .posts import POSTS_SETTING

    return [POSTS_SETTING.replace(activation_checkpointing=False), POSTS_SETTING]


def settings_ahead() -> list:
    """What a run of several lessons estimates ahead for this lesson (fsdplab.runner.estimates_ahead): both of
    `estimate_settings()`, which the lesson needs in its section 3."""
    return estimate_settings()


def twin_config(hidden: int = 128, layers: int = 4, vocab: int = 512, *, dropout: float = 0.0, attention=None):
    """A tiny Qwen-7B twin (Qwen2 layout, hidden `hidden`, `layers` blocks) with attention dropout `dropout`;
    `attention="eager"` makes attention plain matmuls (FlopCounterMode does not count CPU's SDPA kernel)."""
    from ..models import tiny_twin

    config = tiny_twin("qwen-7b", hidden_size=hidden, num_layers=layers, vocab_size=vocab)
    config.attention_dropout = dropout
    if attention is not None:
        config._attn_implementation = attention
    return config


def wide_config(model: str = "qwen-7b", layers: int = 1, attention: str = "eager"):
    """`model` at its real width (hidden size, MLP, vocabulary) with only `layers` blocks: FLOPs and bytes per
    block are those of the full model, and a meta-device build costs nothing."""
    from ..models import hf_config

    config = hf_config(model)
    config.num_hidden_layers = layers
    config._attn_implementation = attention
    return config


class BlockCheckpoint(nn.Module):
    """The posts' code around one block:

        def forward(self, x):
            return checkpoint(self._inner_forward, x, preserve_rng_state=False)

    The posts pass no `use_reentrant`: torch then warns and takes the reentrant variant (use_reentrant=True),
    which is what runs here by default, stated explicitly so that no warning is printed. The block's keyword
    arguments (RoPE's cos/sin, the mask) reach it through the closure, as `self._inner_forward` reaches
    them in the posts' class."""

    def __init__(self, block: nn.Module, *, use_reentrant: bool = True, preserve_rng_state: bool = False):
        super().__init__()
        self.block, self.use_reentrant, self.preserve_rng_state = block, use_reentrant, preserve_rng_state

    def forward(self, hidden_states, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        def inner_forward(x):
            return self.block(x, *args, **kwargs)

        return checkpoint(inner_forward, hidden_states, use_reentrant=self.use_reentrant,
                          preserve_rng_state=self.preserve_rng_state)


def checkpoint_blocks(model: nn.Module, mode: str = "torch") -> nn.Module:
    """Checkpoint every block of `model` in place: 'none'; 'torch' (the lab's `apply_activation_checkpointing`:
    non-reentrant, RNG state restored for the recomputation); 'posts' (the posts' reentrant call with
    preserve_rng_state=False); 'posts, non-reentrant' (preserve_rng_state=False alone)."""
    from ..models import blocks_of
    from ..settings import check_choice
    from ..sharding import apply_activation_checkpointing

    check_choice("checkpointing", mode, CHECKPOINTING)
    if mode == "torch":
        apply_activation_checkpointing(model)
    elif mode != "none":
        wrap = functools.partial(BlockCheckpoint, use_reentrant=mode == "posts", preserve_rng_state=False)
        targets = {id(block) for block in blocks_of(model)}
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(id(c) in targets for c in m)]
        for module_list in lists:
            for i, child in enumerate(module_list):
                if id(child) in targets:
                    module_list[i] = wrap(child)
    return model


def build(config, checkpointing: str = "none", *, lora_rank=None, device="cpu", seed: int = 0) -> nn.Module:
    """The causal LM of `config` (same weights for the same seed), LoRA adapters when `lora_rank`, blocks
    checkpointed by `checkpointing` (see `checkpoint_blocks`), in training mode (dropout on)."""
    from ..settings import TrainSetting
    from ..sharding import build_model

    model = build_model(TrainSetting(model=config, lora_rank=lora_rank), device=device, seed=seed)
    checkpoint_blocks(model, checkpointing)
    return model.train()


def token_batch(config, batch_size: int, seq_len: int, seed: int = 0, device="cpu") -> dict:
    """Random tokens as transformers keywords: the model predicts its own input shifted by one."""
    if torch.device(device).type == "meta":
        tokens = torch.zeros((batch_size, seq_len), dtype=torch.long, device="meta")
    else:
        tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len),
                               generator=torch.Generator().manual_seed(seed)).to(device)
    return {"input_ids": tokens, "labels": tokens}


def block_names(model: nn.Module) -> list:
    """Qualified names of the blocks (the checkpoint wrappers once wrapped)."""
    from ..models import blocks_of

    ids = {id(b): i for i, b in enumerate(blocks_of(model))}
    names = [None] * len(ids)
    for name, module in model.named_modules():
        if id(module) in ids and names[ids[id(module)]] is None:
            names[ids[id(module)]] = name
    return names


# --- claim 8: compute ------------------------------------------------------------------------------------

def flop_counts(model: nn.Module, batch) -> dict:
    """FLOPs of one forward and one backward of `loss_of(model, batch)`, counted by FlopCounterMode (matmuls
    and attention kernels), in total and inside the blocks (their recomputation in backward included).

    Works on meta tensors: FLOPs depend on shapes only, so the real model's width costs no memory."""
    from torch.utils.flop_counter import FlopCounterMode

    from .._torch_private import eager_attention_masks
    from ..sharding import loss_of

    keys = [f"{type(model).__name__}.{name}" for name in block_names(model)]

    def count(counter, key="Global"):
        return int(sum(counter.get_flop_counts().get(key, {}).values()))

    # One counter for the whole step: it attributes backward FLOPs (recomputation included) to the modules
    # only if it also saw their forward. The forward's share is read before backward starts.
    with eager_attention_masks(), FlopCounterMode(display=False) as counter:   # the masks: see the shim
        loss = loss_of(model, batch)
        forward, each_forward = count(counter), [count(counter, k) for k in keys]
        loss.backward()
        total, each_total = count(counter), [count(counter, k) for k in keys]
    each_backward = [t - f for t, f in zip(each_total, each_forward)]
    # Per block, both ends: the first block's input is the embedding's output, which needs no gradient when
    # the embedding is frozen (LoRA), so its backward skips a matmul the deeper blocks do. Scale with a deep one.
    return {"forward": forward, "backward": total - forward, "blocks_forward": sum(each_forward),
            "blocks_backward": sum(each_backward), "layers": len(keys), "block_forward": each_forward,
            "block_backward": each_backward}


def flops_at_depth(counts: dict, layers: int) -> dict:
    """`flop_counts` of a shallow model (at least 2 blocks) scaled to `layers` blocks: the first block as
    measured, every later one as the deepest measured block (a first block can cost less: see flop_counts),
    the rest (embedding, LM head, loss) once. Returns forward, backward and total."""
    if counts["layers"] < 2:
        raise ValueError("flops_at_depth needs a model of 2 or more blocks: the first block's backward can differ "
                         "from a deeper one's (build it with wide_config(..., layers=2)).")
    rest_fwd, rest_bwd = counts["forward"] - counts["blocks_forward"], counts["backward"] - counts["blocks_backward"]
    forward = rest_fwd + counts["block_forward"][0] + (layers - 1) * counts["block_forward"][-1]
    backward = rest_bwd + counts["block_backward"][0] + (layers - 1) * counts["block_backward"][-1]
    return {"forward": forward, "backward": backward, "total": forward + backward}


def recompute_ratio(plain: dict, checkpointed: dict, part: str = "blocks") -> float:
    """(forward + backward) FLOPs with checkpointing over without, for the blocks alone or the whole step."""
    if part == "blocks":       # a deep block: its input needs a gradient, as every block's but the first does
        return ((checkpointed["block_forward"][-1] + checkpointed["block_backward"][-1])
                / (plain["block_forward"][-1] + plain["block_backward"][-1]))
    return (checkpointed["forward"] + checkpointed["backward"]) / (plain["forward"] + plain["backward"])


def flop_table(config, seq_len: int, modes=("none", "torch", "posts"), lora_rank=None, batch_size: int = 1) -> dict:
    """flop_counts of the meta-device model of `config` for each checkpointing mode."""
    table = {}
    for mode in modes:
        model = build(config, mode, lora_rank=lora_rank, device="meta")
        table[mode] = flop_counts(model, token_batch(config, batch_size, seq_len, device="meta"))
    return table


# --- claim 8: memory ---------------------------------------------------------------------------------------

def saved_bytes(model: nn.Module, batch) -> dict:
    """Bytes of the tensors autograd keeps from forward for backward, by where they were saved: 'embedding'
    (before the first block), 'block i', 'head' (after the last block: final norm, LM head, loss).

    Counted with torch.autograd.graph.saved_tensors_hooks: each saved tensor's storage once (views of one
    storage, or a tensor saved twice, count once, where first saved); parameters are not activations and
    are left out. A checkpointed block keeps only what the checkpoint saves: its inputs. Also returns the
    bytes of the logits tensor, the largest single activation the blocks' checkpointing does not cover."""
    from ..models import blocks_of
    from ..sharding import loss_of

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = ["embedding"], {}
    hooks = []
    for i, block in enumerate(blocks_of(model)):
        hooks.append(block.register_forward_pre_hook(lambda module, args, i=i: where.__setitem__(0, f"block {i}")))
        hooks.append(block.register_forward_hook(lambda module, args, out: where.__setitem__(0, "head")))

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen[key] = (where[0], storage.nbytes())
        return tensor

    logits = {}

    def note_logits(module, args, out):   # a forward hook's return value would replace the output
        logits["bytes"] = out.nbytes

    hooks.append(model.get_output_embeddings().register_forward_hook(note_logits))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_of(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    regions = {"embedding": 0, **{f"block {i}": 0 for i in range(len(blocks_of(model)))}, "head": 0}
    for region, nbytes in seen.values():
        regions[region] += nbytes
    del loss
    return {"regions": regions, "total": sum(regions.values()), "logits": logits.get("bytes", 0)}


def block_saving(plain: dict, checkpointed: dict) -> dict:
    """Fractions of saved bytes that checkpointing removes: inside the blocks, and for the whole model."""
    blocks = lambda r: sum(v for k, v in r["regions"].items() if k.startswith("block"))  # noqa: E731
    return {"blocks": 1 - blocks(checkpointed) / blocks(plain), "model": 1 - checkpointed["total"] / plain["total"]}


def checkpoint_warning() -> str:
    """What torch says about the posts' call `checkpoint(fn, x, preserve_rng_state=False)` (no use_reentrant):
    the warning's text, caught here rather than printed by torch."""
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint(torch.sin, x, preserve_rng_state=False)
    found = [str(w.message) for w in caught if "use_reentrant" in str(w.message)]
    return found[0] if found else ""


def posts_call_on_lora(config, lora_rank: int = 8, batch_size: int = 1, seq_len: int = 16) -> dict:
    """The posts' reentrant `checkpoint(..., preserve_rng_state=False)` on a LoRA model (their setting): the
    frozen embedding's output does not require grad, so the reentrant checkpoint records no graph for the
    blocks. Returns what torch warns and raises, and how many adapter weights got a gradient."""
    from ..sharding import loss_of

    model = build(config, "posts", lora_rank=lora_rank)
    error = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loss_of(model, token_batch(config, batch_size, seq_len)).backward()
        except RuntimeError as e:
            error = str(e).splitlines()[0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"warnings": sorted({str(w.message) for w in caught}), "error": error,
            "adapters": len(trainable), "adapters_with_gradient": sum(p.grad is not None for p in trainable)}


# --- claim 8: dropout and the RNG state, on the ranks ------------------------------------------------------

def dropout_gradients(config, modes=("torch", "posts", "posts, non-reentrant"), *, batch_size: int = 2,
                      seq_len: int = 32, seed: int = 0) -> dict:
    """Runs on every rank (inside cluster.run). Trains one step of the model of `config` (it should have
    dropout) under FSDP2 over all ranks, once without checkpointing and once per mode, from the same
    weights, data and RNG seed; returns each mode's largest gradient difference from the plain run
    (gradients reduced over the ranks, compared in full) and the largest plain gradient, for scale."""
    from ..ranks import mesh, this_rank
    from ..sharding import apply_fsdp, loss_of

    batch = token_batch(config, batch_size, seq_len, seed=seed + this_rank())

    def gradients(mode):
        model = build(config, mode, seed=seed)
        apply_fsdp(model, mesh())   # one unit per block (per checkpointed block), then the root
        torch.manual_seed(1000 + seed + this_rank())   # the same dropout masks in every run's forward
        loss_of(model, batch).backward()
        # the same parameters in the same order whatever wraps the blocks (their names gain a prefix)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads), f"{mode}: a parameter got no gradient"
        return [g.full_tensor() for g in grads]

    reference = gradients("none")
    result = {"max_grad": max(float(g.abs().max()) for g in reference), "device": mesh().device_type}
    for mode in modes:
        result[mode] = max(float((g - r).abs().max()) for g, r in zip(gradients(mode), reference))
    return result


def same_gradients_bound(device_type: str, max_grad: float) -> float:
    """The largest gradient difference between two runs of the same step that counts as none. On CPU ranks
    two runs are bit-equal (0.0): the same kernels, the same order. On GPUs fp32 attention's backward (the
    memory-efficient SDPA kernel) accumulates with atomics, in an order that changes from run to run: a
    millionth of the largest gradient, far below what another dropout mask changes (percents of it)."""
    return 0.0 if torch.device(device_type).type == "cpu" else 1e-6 * max_grad


# --- claim 20: ms-swift -----------------------------------------------------------------------------------

# ms-swift's documented command-line flags for what the posts configure (docs/source_en/Instruction/
# Command-line-parameters.md of modelscope/ms-swift, v3.x; newer releases rename train_type to tuner_type).
SWIFT_FLAGS = {"train_type": "lora or full (default lora); tuner_type in newer releases",
               "lora_rank": "LoRA rank (default 8)",
               "gradient_checkpointing": "recompute activations (default true)",
               "gradient_checkpointing_kwargs": "passed to torch.utils.checkpoint, e.g. use_reentrant false"}


def swift_flags() -> tuple:
    """(flag names, where they come from): read from an installed ms-swift's TrainArguments when present,
    otherwise ms-swift's documented flags (SWIFT_FLAGS)."""
    import importlib.util

    if importlib.util.find_spec("swift") is not None:
        try:
            import dataclasses

            from swift.llm import TrainArguments

            return {f.name for f in dataclasses.fields(TrainArguments)}, "the installed ms-swift's TrainArguments"
        except Exception:
            pass
    return set(SWIFT_FLAGS), "ms-swift's documented command-line flags, as ms-swift is not installed here"


# --- verdicts, computed from what the lesson measured ----------------------------------------------------------

def _word(holds: list) -> str:
    return "right" if all(holds) else ("wrong" if not any(holds) else "partly")


def claim8_verdict(*, posts_full: float, torch_full: float, torch_lora: float, block_saving: float,
                   model_saving: float, rng_posts: float, rng_torch: float, claimed_compute: float = 0.30,
                   claimed_saving: float = 0.80, tolerance: float = 0.05) -> tuple:
    """(verdict, reason) for "+30% compute, saves up to 80% of activation memory" with the posts'
    preserve_rng_state=False, from measured FLOP ratios (whole step), saved-byte fractions and gradient
    differences under dropout."""
    compute = abs(posts_full - 1 - claimed_compute) <= tolerance
    memory = model_saving >= claimed_saving - tolerance
    rng = rng_posts == 0.0
    reason = (f"recompute costs +{posts_full - 1:.0%} with the posts' reentrant call on a full fine-tune "
              f"({'in line with' if compute else 'unlike'} +{claimed_compute:.0%}), +{torch_full - 1:.0%} with "
              f"torch's non-reentrant default, +{torch_lora - 1:.0%} for LoRA; checkpointing removes "
              f"{block_saving:.0%} of the blocks' saved bytes and {model_saving:.0%} of the whole model's "
              f"(logits not covered); preserve_rng_state=False with dropout "
              + ("leaves gradients unchanged" if rng else f"changes gradients by up to {rng_posts:.3g}")
              + f" (default: {rng_torch:.3g})")
    return _word([compute and memory, rng]), reason


def claim20_verdict(flags, keys=POSTS_SWIFT_KEYS) -> tuple:
    """(verdict, reason): are the posts' config keys among ms-swift's flags?"""
    missing = [k for k in keys if k not in flags]
    have = [k for k in ("train_type", "lora_rank", "gradient_checkpointing") if k in flags]
    reason = (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not ms-swift flags" if missing
              else "the keys exist") + "; its flags are " + ", ".join(f"--{k}" for k in have)
    return ("wrong" if missing else "right"), reason


# --- exercises -----------------------------------------------------------------------------------------------

@exercise("08-lora-recompute")
def _lora_recompute(answer, *, measured):
    """The FLOP ratio (with / without checkpointing) of a LoRA model's blocks, against the measured one."""
    # 0.5%: the whole step's ratio (3% lower) and the naive 1 + 1/2 (under 1% higher at 512 tokens) are
    # wrong answers, and they lie close to the block's
    return close(answer, measured, rel=0.005,
                 hint="with the base frozen, backward computes no weight gradients for it: about one forward, "
                      "not two. What does one more forward add to F + F?")


@exercise("08-saved-per-block")
def _saved_per_block(answer, *, measured):
    """Bytes one checkpointed block keeps for backward, against the measured bytes."""
    return close(answer, measured, rel=0.02, unit=" B",
                 hint="a checkpointed block keeps its input hidden states: batch x sequence x hidden elements, "
                      "4 bytes each in fp32.")


# --- the checkpointing exercise: the learner's code, run on the live ranks --------------------------------

def _first_line(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


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
        out["run_error"] = _first_line(err)
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
        out["error"] = _first_line(err)
        return out
    out["returned"] = ("model" if returned is None or returned is model else
                       "a module" if isinstance(returned, nn.Module) else type(returned).__name__)
    try:
        mine = step(returned if isinstance(returned, nn.Module) else model, blocks)
    except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
        out["shard_error"] = _first_line(err)
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
        return False, f"expected a function my_checkpoint(model) that checkpoints each block and returns the model, got {answer!r}."
    if not cluster.running:
        return False, "the ranks are stopped (the lesson stops them after its exercises): run cluster.start(), then this cell."
    if cluster.broken:
        return False, f"the ranks cannot run it ({cluster.broken.splitlines()[0]}): run cluster.restart(), then this cell."
    try:
        results = cluster.run(compare_checkpointing, answer, layers)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if {"error", "shard_error", "run_error"} & set(x)), results[0])
    if "error" in out:
        return False, f"your function raised on the ranks: {out['error']}"
    if "shard_error" in out:
        return False, (f"fully_shard raised on your checkpointed model: {out['shard_error'].rstrip(':.')}. Only checkpoint: the "
                       "checker shards the model itself, each block and then the root.")
    if out["returned"] not in ("model", "a module"):
        return False, f"your function returns {out['returned']}: return the model, which the checker then shards and trains."
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
    one_rank = (" On 1 rank fully_shard all-gathers nothing, so the step's all-gathers were not compared with the lab's."
                if out["world_size"] == 1 else "")
    kept, lab, plain, blocks = out["kept"], out["lab_kept"], out["plain_kept"], list(range(out["layers"]))
    mine = ("as much as without checkpointing" if kept >= plain else
            f"{1 - kept / plain:.0%} less than the {plain:,} B without checkpointing")
    bytes_text = f"your model kept {kept:,} B for backward, {mine}, where the lab's keeps {lab:,} B ({1 - lab / plain:.0%} less)"
    again = out["again"]
    if not again:
        return False, f"gradients match, but no block ran again in backward: nothing was checkpointed, and {bytes_text}.{one_rank}"
    skipped = [i for i in blocks if i not in again]
    if skipped:
        they = "it kept all its" if len(skipped) == 1 else "they kept all their"
        return False, (f"gradients match, but {_blocks_text(skipped)} did not run again in backward: not checkpointed, "
                       f"{they} activations, and {bytes_text}.{one_rank}")
    if again != out["lab_again"]:
        return False, (f"gradients match, but backward ran blocks {', '.join(map(str, again))} again in that order, where "
                       f"the lab's runs each again on its own, just before its backward "
                       f"({', '.join(map(str, out['lab_again']))}): your checkpoint holds several blocks as one piece, so "
                       f"backward rebuilds all their activations at once. Forward kept {kept:,} B, the lab's {lab:,} B: "
                       f"checkpoint each block on its own.{one_rank}")
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
