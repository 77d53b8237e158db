"""Lesson 08 (activation checkpointing and wrap policies: claims 8, 11 and 20) only: the models, claims 8 and 20.

- claim 8: what recomputation costs (FLOPs counted by torch's FlopCounterMode), what it saves (bytes of the
  tensors autograd keeps for backward, counted with saved_tensors_hooks), and what the posts'
  `checkpoint(..., preserve_rng_state=False)` does to gradients when the block has dropout (on live ranks);
- claim 11 (the posts' auto-wrap policy and the units it makes) is `fsdplab.lessons.auto_wrap`;
- claim 20: the posts' ms-swift keys against ms-swift's documented command-line flags;
- the code exercise ("08-checkpoint-blocks") is in `checkpoint_blocks`;
- the printed tables, figures and verdict table are in `activation_checkpointing_figures`.
"""

from __future__ import annotations

import functools
import re
import warnings

import torch
from torch import nn

from .activation_checkpointing_figures import plot_recompute_flops, plot_saved_bytes  # noqa: F401 (the notebook's)
from .activation_checkpointing_figures import print_flops, print_saved, verdict_table  # noqa: F401 (the notebook's)
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


def warning_deadline_note(message: str) -> str:
    """One line on the release torch's use_reentrant warning names ("Starting in PyTorch 2.9, ... will raise"),
    against the torch running here, on which `checkpoint_warning` just ran the call: it warned, and did not raise."""
    running = str(torch.__version__).split("+")[0]
    named = re.search(r"PyTorch (\d+(?:\.\d+)+)", message)
    if named and torch.__version__ >= named.group(1):
        return (f"(torch {running} still only warns, and ran the call: the release the message names, "
                f"{named.group(1)}, came without the change)")
    return f"(torch {running} warns, and ran the call)"


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
