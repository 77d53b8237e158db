"""Lesson 12, LoRA and QLoRA on FSDP2: the tiny twin, torchao's NF4 base, what one step holds and moves, and
the lesson's three exercises (12-peak-category, 12-uniform-dtype, 12-compute-dtype)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..nf4 import apply_nf4, check_shardable, local_bytes, nf4
from .checkers import exercise, first_line, ranks_not_ready


# --- the model ------------------------------------------------------------------------------------------------

def twin_config(hidden_size: int = 256, num_layers: int = 4, vocab_size: int = 4096, intermediate_size: int = 768,
                world_size: int = 2):
    """A Qwen-7B twin (Qwen2 layout, four heads, no grouped-query attention, biases on q/k/v) whose every decoder
    Linear can be quantized to NF4 and sharded over `world_size` ranks."""
    from ..models import tiny_twin

    config = tiny_twin("qwen-7b", hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size)
    config.intermediate_size = intermediate_size
    for name, numel in (("hidden_size x hidden_size", hidden_size * hidden_size),
                        ("hidden_size x intermediate_size", hidden_size * intermediate_size)):
        check_shardable(numel, world_size, name)
    return config


def base_bytes(model) -> int:
    """Bytes of the frozen base this rank holds."""
    return sum(local_bytes(p) for p in model.parameters() if not p.requires_grad)


def nf4_bytes_per_weight(model) -> float:
    """Bytes per weight of the NF4 parameters, as stored (codes, scalers, factors over the weights they code)."""
    _, _, nf4_tensor = nf4()
    from torch.distributed.tensor import DTensor

    stored = numel = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, nf4_tensor):
            stored, numel = stored + local_bytes(p), numel + local.numel()
    return stored / numel if numel else float("nan")


def token_batch(config, batch_size: int, seq_len: int, seed: int, device="cpu") -> dict:
    """Random tokens, their own labels: what a step's memory depends on is the shape, not the text."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g).to(device)
    return {"input_ids": tokens, "labels": tokens}


def step_report(model, optimizer, batch, steps: int = 2) -> dict:
    """On a rank: `steps` training steps under torch's memory tracker and the collective counter. Plain numbers:
    the peak and what it is made of, what stays between steps, bytes all-gathered and reduce-scattered in one step
    (full tensors, as the counter reports them; every step moves the same, the optimizer's step nothing), and the
    last step's loss."""
    from ..comms import CommCounter
    from ..memory import measure
    from ..step import loss_of

    losses = []

    def loss_fn(model, batch):
        loss = loss_of(model, batch)
        losses.append(loss.item())   # a number: no tensor kept alive between the tracked steps
        return loss

    with CommCounter(fsdp_labels=False) as counter:
        report = measure(model, optimizer, batch, steps=steps, loss_fn=loss_fn)
    dtypes = sorted({r["dtype"] for r in counter.records if r["kind"] == "all_gather"})
    return {"peak": report.peak_bytes, "by_category": dict(report.by_category), "resident": dict(report.resident),
            "base": base_bytes(model), "all_gather": counter.total("tensor_bytes", kind="all_gather") // steps,
            "reduce_scatter": counter.total("tensor_bytes", kind="reduce_scatter") // steps,
            "gather_dtypes": dtypes, "loss": losses[-1]}


def peak_category(run: dict) -> str:
    """The category that holds most of the peak."""
    return max(run["by_category"], key=run["by_category"].get)


def plant_outlier(model, scale: float, block: int = 1) -> None:
    """Scale one block's MLP input projections by `scale`: its activations grow as large as a trained LLM's few
    'massive' channels, which a random twin lacks. Call it on the base model, before quantizing."""
    from ..models import blocks_of

    mlp = blocks_of(model)[block].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(scale)
        mlp.up_proj.weight.mul_(scale)


def largest_mlp_activation(model, batch) -> float:
    """The largest |value| entering any block's down_proj in one forward (no grad), in float."""
    from ..models import blocks_of

    largest = [0.0]

    def note(_module, args):
        values = args[0].detach().float().abs()
        largest[0] = max(largest[0], float(values.max()) if torch.isfinite(values).all() else math.inf)

    hooks = [block.mlp.down_proj.register_forward_pre_hook(note) for block in blocks_of(model)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return largest[0]


# --- the estimator's settings ----------------------------------------------------------------------------------

BIG_MODELS = ("qwen-7b", "llama2-70b")


def big_settings() -> list:
    """LoRA at full size, as the estimator runs it: Qwen-7B and Llama-2-70B, r=64 on every Linear, 8 ranks, bf16
    compute, activation checkpointing, one sequence of 2048 tokens; with a bf16 base and with an NF4 base."""
    from ..settings import TrainSetting

    return [TrainSetting(model=model, world_size=8, lora_rank=64, base_dtype=base, precision="bf16", seq_len=2048,
                         batch_size=1, activation_checkpointing=True)
            for model in BIG_MODELS for base in ("bf16", "nf4")]


def twin_setting(config, world_size: int, lora_rank: int, seq_len: int, batch_size: int, base_dtype: str):
    """The lesson's measured twin run as a TrainSetting, for the estimator."""
    from ..settings import TrainSetting

    return TrainSetting(model=config, world_size=world_size, lora_rank=lora_rank, base_dtype=base_dtype,
                        precision="bf16", seq_len=seq_len, batch_size=batch_size)


def settings_ahead() -> list:
    """What a run of several lessons estimates ahead for this one: the full-size settings and, at the lesson's
    defaults, the twin's NF4 run."""
    return big_settings() + [twin_setting(twin_config(), 2, 8, 256, 4, "nf4")]


def big_table(reports: list) -> str:
    """One line per full-size estimate: the base's shard, the peak, and where the step is at the peak."""
    from ..settings import GIB

    lines = [f"{'model':12s}{'base':>6s}{'weight shard':>14s}{'peak':>8s}  (GiB per GPU)  the step at its peak"]
    for r in reports:
        s, m = r.settings, r.peak_moment
        where = m.get("module", "").replace("base_model.model.model.", "").replace("_checkpoint_wrapped_module.", "")
        lines.append(f"{s['model']:12s}{s['base_dtype']:>6s}{r.resident['parameters'] / GIB:14.2f}"
                     f"{r.peak_bytes / GIB:8.2f}  {m.get('phase', '?')}, {where or '-'}, {m.get('op', '-')}")
    return "\n".join(lines)


# --- exercise 1: where the peak lands -------------------------------------------------------------------------

@exercise("12-peak-category")
def _peak_category(answer, *, run: dict):
    """The learner names the category that holds most of a LoRA step's peak on the ranks."""
    from ..memory import CATEGORIES

    if answer not in CATEGORIES:
        return False, f"answer with one of {', '.join(repr(c) for c in CATEGORIES)}, not {answer!r}."
    measured = peak_category(run)
    share = run["by_category"][answer] / run["peak"]
    if answer != measured:
        return False, (f"{answer} held {share:.0%} of the peak. Think of what grows with tokens, not with "
                       "weights: the adapters and the 16-bit base are small next to it.")
    return True, f"{answer} held {share:.0%} of the peak ({run['by_category'][answer] / 2**20:.1f} MiB on rank 0)."


# --- exercise 2: trainable parameters of one dtype -------------------------------------------------------------


def planted_dtype_model(config, lora_rank: int, seed: int = 0):
    """On a rank: the planted failure, on the rank's device: a bf16 base, peft's adapters (fp32), and the RMSNorm
    weights trained too (bf16)."""
    from ..models import causal_lm
    from ..ranks import device
    from ..sharding import apply_lora

    torch.manual_seed(seed)
    model = apply_lora(causal_lm(config, device=device(), dtype=torch.bfloat16), lora_rank, device=device())
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(True)
    return model


def shard_and_step(model, batch, param_dtype=torch.bfloat16) -> float:
    """fully_shard each block, then the root (16-bit compute, fp32 reduce), and one AdamW step: the loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..models import blocks_of
    from ..ranks import mesh

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh(), mp_policy=policy)
    fully_shard(model, mesh=mesh(), mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def try_uniform(fn, hidden_size: int, lora_rank: int, seed: int = 0) -> dict:
    """On a rank: the planted model, the learner's `fn(model)`, then shard and step it. What trains, in which
    dtypes, the bytes of the frozen base before and after, and the loss or the error."""
    from ..ranks import device, this_rank, world_size

    config = twin_config(hidden_size=hidden_size, num_layers=2, vocab_size=512, world_size=world_size())
    model = planted_dtype_model(config, lora_rank, seed)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {"rank": this_rank(), "base_before": sum(p.nbytes for p in model.parameters() if not p.requires_grad)}
    try:
        returned = fn(model)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        out["error"] = first_line(err)
        return out
    model = returned if isinstance(returned, nn.Module) else model
    out["norms_train"] = all(p.requires_grad for n, p in model.named_parameters() if "norm" in n)
    out["lost"] = sorted(n for n, p in model.named_parameters() if n in trainable and not p.requires_grad)
    out["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    out["base_after"] = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    out["frozen_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    try:
        out["loss"] = shard_and_step(model, token_batch(config, 2, 16, seed + this_rank(), device()))
    except Exception as err:  # noqa: BLE001 - FSDP's refusal is the answer to show
        out["step_error"] = first_line(err)
    return out


@exercise("12-uniform-dtype")
def _uniform_dtype(answer, *, cluster, hidden_size: int = 256, lora_rank: int = 4):
    """The learner's `fix(model)` on the planted model (bf16 base, fp32 adapters, bf16 norms trained), then
    sharded and stepped on every rank."""
    if not callable(answer):
        return False, f"expected a function fix(model) that returns the model, got {answer!r}."
    if (not_ready := ranks_not_ready(cluster)) is not None:
        return False, not_ready
    try:
        results = cluster.run(try_uniform, answer, hidden_size, lora_rank)
    except Exception as err:  # noqa: BLE001
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((r for r in results if {"error", "step_error"} & set(r)), results[0])
    if "error" in out:
        return False, f"your function raised on rank {out['rank']}: {out['error']}"
    if out["lost"] or not out["norms_train"]:
        return False, (f"{len(out['lost'])} parameters that trained before no longer do: the norms are meant to train. "
                       "Change their dtype, not whether they train.")
    if "step_error" in out:
        return False, (f"the first step still raised on rank {out['rank']}: {out['step_error']} (your trainable "
                       f"parameters are {', '.join(out['trainable_dtypes'])}).")
    if out["base_after"] > out["base_before"]:
        return False, (f"it steps, but the frozen base grew from {out['base_before']:,} B to "
                       f"{out['base_after']:,} B on each rank before sharding: you cast the frozen weights too, which "
                       "the check never looked at.")
    if not math.isfinite(out["loss"]):
        return False, f"it steps, but the loss is {out['loss']}."
    return True, (f"trainable parameters all {out['trainable_dtypes'][0]}, the frozen base left "
                  f"{'/'.join(out['frozen_dtypes'])} ({out['base_after']:,} B per rank before sharding), and the step "
                  f"ran on every rank (loss {out['loss']:.3f}).")


# --- exercise 3: the compute dtype of a 4-bit base ---------------------------------------------------------------

def qlora_loss(config, param_dtype, outlier_scale: float, lora_rank: int, batch_size: int, seq_len: int,
               seed: int = 0) -> dict:
    """On a rank: the QLoRA twin with the planted outlier, sharded with `param_dtype` as compute dtype: the loss
    of one step and the largest MLP activation in that dtype."""
    from ..models import causal_lm
    from ..ranks import device, this_rank, world_size
    from ..sharding import apply_lora

    torch.manual_seed(seed)
    model = causal_lm(config, device=device(), dtype=torch.bfloat16)
    plant_outlier(model, outlier_scale)
    apply_nf4(model, world_size())
    model = apply_lora(model, lora_rank, device=device())
    batch = token_batch(config, batch_size, seq_len, seed + this_rank(), device())
    loss = shard_and_step(model, batch, param_dtype)
    return {"rank": this_rank(), "loss": loss, "largest": largest_mlp_activation(model, batch)}


@exercise("12-compute-dtype")
def _compute_dtype(answer, *, cluster, config, outlier_scale: float, lora_rank: int = 4, batch_size: int = 2,
                   seq_len: int = 64):
    """The learner's compute dtype for the QLoRA twin with the outlier: a finite loss in 16 bits."""
    if answer not in (torch.float16, torch.bfloat16, torch.float32):
        return False, f"answer with torch.float16, torch.bfloat16 or torch.float32, not {answer!r}."
    if (not_ready := ranks_not_ready(cluster)) is not None:
        return False, not_ready
    if cluster.world_size == 1:
        return False, ("on one rank FSDP2 breaks torchao's NF4 (pytorch/pytorch#197999): start the cluster with 2 or "
                       "more ranks (rerun the lesson with world_size = 2).")
    results = cluster.run(qlora_loss, config, answer, outlier_scale, lora_rank, batch_size, seq_len)
    worst = max(results, key=lambda r: r["largest"])
    bad = [r["rank"] for r in results if not math.isfinite(r["loss"])]
    name = str(answer).removeprefix("torch.")
    if bad:
        return False, (f"the loss is {results[bad[0]]['loss']} on rank {bad[0]}: the largest activation, "
                       f"{worst['largest']:.3g}, does not fit in {name}, whose largest number is "
                       f"{torch.finfo(answer).max:.6g}.")
    if answer is torch.float32:
        return False, ("finite, but the 4-bit weights are dequantized to fp32 for every matmul: twice the bytes of "
                       "a 16-bit compute dtype that holds the same range.")
    return True, (f"loss {results[0]['loss']:.3f} on rank 0; the largest activation, {worst['largest']:.3g}, "
                  f"fits in {name} (largest number {torch.finfo(answer).max:.3g}).")


# --- what the kernel prints --------------------------------------------------------------------------------------

def runs_table(runs: dict) -> str:
    """This rank's runs, one line each, in KiB: the frozen base's shard, the optimizer state kept between steps,
    the bytes all-gathered and reduce-scattered in one step, and the peak (what it is made of is exercise 1's
    question: the figure shows it)."""
    head = (f"{'run (KiB on this rank)':36s}{'base shard':>11s}{'opt. state':>11s}{'gathered':>10s}"
            f"{'scattered':>10s}{'peak':>9s}")
    lines = [head]
    for name, r in runs.items():
        lines.append(f"{name:36s}{r['base'] / 1024:11,.0f}{r['resident'].get('optimizer_state', 0) / 1024:11,.0f}"
                     f"{r['all_gather'] / 1024:10,.0f}{r['reduce_scatter'] / 1024:10,.0f}{r['peak'] / 1024:9,.0f}")
    return "\n".join(lines)


def draw_runs(ax, runs: dict, order: list) -> None:
    """Rank 0's peak of each run in `order`, stacked by category (MiB)."""
    from ..memory import CATEGORIES, CATEGORY_LABELS

    labels = [name.replace(", ", "\n") for name in order]
    bottom = [0.0] * len(order)
    for category in CATEGORIES:
        values = [runs[n]["by_category"].get(category, 0) / 2**20 for n in order]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=CATEGORY_LABELS.get(category, category))
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="peak memory on rank 0 (MiB)", xlabel="run")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

