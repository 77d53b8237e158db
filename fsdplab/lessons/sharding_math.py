"""Lesson 01 (sharding math) only: the verdict words of the lesson's claims, each a function of what the
notebook measured (its experiments, `fully_shard` and DDP on live ranks, are written in its cells), the
verdict table, section 2's figure (`plot_replica_table`), the lesson's exercises, and the model of its
wrapping exercise, which the lesson has not seen before.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .checkers import close, exercise, first_line, ranks_not_ready
from .posts import CLAIM17_GB
from ..display import COLORS
from ..settings import GIB, MIB

NOT_AT_ONE_RANK = "not tested at world size 1"


# --- verdicts: each a function of the measured values ------------------------------------------------------

def claim1_word(layouts, world_size: int) -> str:
    """Claim 1 ("an 8x4 matrix on 4 cards keeps 8x1 each", split by column) from `shard_layout`'s rows."""
    if world_size == 1:
        return NOT_AT_ONE_RANK
    shapes = {rows[0]["local_shape"] for rows in layouts}
    if shapes == {(math.ceil(8 / world_size), 4)}:
        return "wrong"
    return "right" if shapes == {(8, math.ceil(4 / world_size))} else "unclear"


def claim1_measured(layouts, world_size: int) -> str:
    """The "measured here" text of claim 1's row, from `shard_layout`'s rows of the 8x4 and 7x4 weights: what
    each rank keeps, against the column split the claim expects; at one rank, that nothing is cut."""
    local_8x4 = sorted({rows[0]["local_shape"] for rows in layouts})
    real_7x4 = [rows[1]["local_shape"][0] for rows in layouts]                 # the rows each rank really holds
    buffer_7x4 = {rows[1]["storage_bytes"] // (4 * 4) for rows in layouts}     # fp32 rows of 4 in its storage
    placement = layouts[0][0]["placements"].removeprefix("(").removesuffix(",)")
    if world_size == 1:
        return (f"on 1 rank the 8x4 weight stays whole, {local_8x4[0]} (`{placement}` over one rank), and the 7x4 "
                f"one keeps all {real_7x4[0]} rows: nothing is cut, so rows vs columns cannot show; run with 2 or "
                "more ranks")
    text = (f"8x4 on {world_size} ranks: each keeps {', '.join(map(str, local_8x4))} (`{placement}`, whole rows), "
            f"not (8, {math.ceil(4 / world_size)}) columns")
    if len(set(real_7x4)) > 1:
        text += (f"; a 7x4 weight leaves the ranks {', '.join(map(str, real_7x4))} real rows in buffers of "
                 f"{', '.join(map(str, sorted(buffer_7x4)))} rows each: the short shards are padded")
    return text


def claim2_word(ddp_state_bytes: list, sharded_state_bytes: list) -> str:
    """Claim 2 ("DP and DDP differ in replica counts"; ZeRO-2 keeps one gradient copy) from the per-rank model
    state of DDP and of a sharded strategy at each group size (two or more sizes needed)."""
    if len(ddp_state_bytes) < 2:
        return NOT_AT_ONE_RANK
    full_copy_everywhere = len(set(ddp_state_bytes)) == 1
    sharded_shrinks = all(b < a for a, b in zip(sharded_state_bytes, sharded_state_bytes[1:]))
    return "wrong" if full_copy_everywhere and sharded_shrinks else "unclear"


def claim3_word(state_over_16p_n: float, peak_over_16p_n: float, world_size: int) -> str:
    """Claim 3 ("Adam costs O(3 x params) and FSDP divides it by N") from FULL_SHARD's measured model state and
    peak, each divided by 16 bytes x params / N."""
    if world_size == 1:
        return NOT_AT_ONE_RANK
    divides = abs(state_over_16p_n - 1) < 0.01
    return "partly" if divides and peak_over_16p_n > 1.1 else ("right" if divides else "wrong")


def claim12_word(whole_model_peak: int, per_block_peak: int, world_size: int) -> str:
    """Claim 12 ("three lines: FSDP(model) then Adam") from the peaks of whole-model and per-block wrapping."""
    if world_size == 1:
        return NOT_AT_ONE_RANK
    return "partly" if whole_model_peak > 1.05 * per_block_peak else "right"


def claim2_measured(ddp_state_bytes: list, full_state_last: int, params: int, world_sizes: list,
                    sgo_peak: int, full_peak: int) -> str:
    """The "measured here" text of claim 2's row; at one rank, that there is nothing to replicate or shard."""
    last = world_sizes[-1]
    if last == 1:
        return (f"on 1 rank every strategy keeps the whole model state, {ddp_state_bytes[0] / params:.2f} B/param: "
                "replicas and shards only differ from 2 ranks on")
    return (f"DDP holds {ddp_state_bytes[0] / params:.2f} B/param on every rank at N = {world_sizes} "
            "(nn.DataParallel, the posts' DP, is not measured); sharded strategies hold "
            f"{full_state_last / params:.2f} B/param at N={last}. FSDP2's "
            f"SHARD_GRAD_OP keeps the same shards at rest as FULL_SHARD and differs in the peak ({sgo_peak / MIB:.2f} "
            f"vs {full_peak / MIB:.2f} MiB): parameters stay gathered from forward to backward")


def claim3_measured(state_bytes: int, full_state_last: int, full_peak: int, params: int, last: int) -> str:
    """The "measured here" text of claim 3's row; at one rank there is no N to divide by."""
    per_param = f"model state is {state_bytes / params:.0f} B/param (not 3x)"
    if last == 1:
        return per_param + "; on 1 rank there is no N to divide it by: run with 2 or more ranks"
    return (f"{per_param}, and FULL_SHARD divides it by N: {full_state_last / (16 * params / last):.3f} x 16P/N at "
            f"N={last}; the step peak is {full_peak / (16 * params / last):.2f} x 16P/N")


def claim12_measured(whole_model_peak: int, per_block_peak: int, last: int) -> str:
    """The "measured here" text of claim 12's row; at one rank nothing is gathered, so wrapping cannot show."""
    peaks = (f"whole-model wrapping peaks at {whole_model_peak / MIB:.2f} MiB vs {per_block_peak / MIB:.2f} MiB "
             "per block")
    if last == 1:
        return peaks + " on 1 rank, where nothing is sharded or gathered: run with 2 or more ranks"
    return f"{peaks} ({1 - per_block_peak / whole_model_peak:.0%} lower) on {last} ranks"


def claim17_word(mixed_state_bytes: int, pure_bf16_peak_bytes: int, card_gib: float = 80.0,
                 fsdp_peak_bytes: int | None = None, offload_peak_bytes: int | None = None) -> str:
    """Claim 17 ("Llama-7B: DDP 78 GB, FSDP 24 GB, FSDP + offload 12 GB") from the formula: DDP's model state with
    mixed-precision Adam and its peak with pure bf16 weights and bf16 Adam (no fp32 master copy) against an 80 GiB
    card, and, when given, the FSDP and offload peaks per rank against the posts' 24 GB and 12 GB. A peak above
    the posts' number makes that number too low: wrong; below it, a bigger batch or sequence can reach it."""
    posts = [(fsdp_peak_bytes, CLAIM17_GB["fsdp"]), (offload_peak_bytes, CLAIM17_GB["offload"])]
    if pure_bf16_peak_bytes / GIB > card_gib or any(b is not None and b > gb * 1e9 for b, gb in posts):
        return "wrong"
    return "plausible" if mixed_state_bytes / GIB <= card_gib else "partly"


def claim18_word(max_saving_bytes: float, claimed_saving_bytes: float) -> str:
    """Claim 18 ("ResNet152: DDP 23 GB vs FSDP 9 GB") from the most FSDP can save (the whole model state minus
    one shard) against the claimed saving."""
    return "wrong" if max_saving_bytes < 0.5 * claimed_saving_bytes else "plausible"


def claim17_measured(mixed_state_bytes: int, pure_state_bytes: int, pure_peak_bytes: int,
                     card_gib: float = 80.0, fsdp_peak_bytes: int | None = None,
                     offload_peak_bytes: int | None = None) -> str:
    """The "measured here" text of claim 17's row: Llama-7B's DDP model state and peak per rank, and, when given,
    the FSDP and offload peaks per rank, each beside the posts' number."""
    over = "more" if mixed_state_bytes / GIB > card_gib else "less"
    pure_gb, ddp_gb = pure_peak_bytes / 1e9, CLAIM17_GB["ddp"]
    side = "below" if pure_gb <= ddp_gb else "above"
    nearer = "nearer to" if abs(pure_gb - ddp_gb) < abs(mixed_state_bytes / 1e9 - ddp_gb) else "farther from"
    text = (f"Llama-7B under DDP with mixed-precision Adam needs {mixed_state_bytes / GIB:.1f} GiB "
            f"({mixed_state_bytes / 1e9:.0f} GB) of model state per rank, {over} than an 80 GiB card holds "
            f"before a single activation; pure bf16 weights with bf16 Adam need {pure_state_bytes / GIB:.1f} GiB "
            f"({pure_state_bytes / 1e9:.0f} GB) of state and {pure_peak_bytes / GIB:.1f} GiB ({pure_gb:.1f} GB) at "
            f"the peak (seq 2048, batch 1), {abs(pure_gb / ddp_gb - 1):.0%} {side} "
            f"the posts' {ddp_gb} GB: of the two readings, this one is {nearer} it")
    for name, peak in (("FSDP", fsdp_peak_bytes), ("FSDP + offload", offload_peak_bytes)):
        if peak is not None:
            gb = CLAIM17_GB["fsdp" if name == "FSDP" else "offload"]
            text += (f"; {name} on 8 ranks peaks at {peak / GIB:.1f} GiB ({peak / 1e9:.1f} GB) per rank, "
                     f"{'below' if peak <= gb * 1e9 else 'above'} the posts' {gb} GB")
    if fsdp_peak_bytes is not None or offload_peak_bytes is not None:
        text += " (the posts give no batch size or sequence length: larger ones than here raise every peak)"
    return text


def claim18_measured(state_bytes: float, max_saving_bytes: float, claimed_saving_bytes: float) -> str:
    """The "measured here" text of claim 18's row: ResNet152's model state and the most FSDP can save."""
    return (f"ResNet152's model state is {state_bytes / 1e9:.2f} GB: FSDP can save at most "
            f"{max_saving_bytes / 1e9:.2f} GB of the claimed {claimed_saving_bytes / 1e9:.0f} GB")


def verdict_table(words: dict, measured: dict) -> str:
    """The lesson's verdict table in Markdown: one row per claim, its verdict word and what was measured."""
    rows = "".join(f"| {claim} | **{words[claim]}** | {measured[claim]} |\n" for claim in words)
    return "\n| # | verdict | measured here |\n|---|---|---|\n" + rows


# --- section 2's figure ------------------------------------------------------------------------------------

def plot_replica_table(table: dict, strategies: list, world_sizes: list, params: int):
    """Section 2's figure: model state per rank by category, the step peak and 16P/N, for each strategy and
    group size of `table` (reports by (strategy, group size)); returns it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    colors = {name: COLORS[name] for name in ("parameters", "gradients", "optimizer_state")}
    abbr = {"ddp": "DDP", "shard_grad_op": "SGO", "full_shard": "FULL"}
    width, ticks, names, seen = 0.28, [], [], set()
    for i, size in enumerate(world_sizes):
        for j, strategy in enumerate(strategies):
            r, x, bottom = table[strategy, size], i + (j - 1) * width, 0.0
            for cat, color in colors.items():
                value = r.resident[cat] / 2**20
                ax.bar(x, value, width * 0.9, bottom=bottom, color=color,
                       label=None if cat in seen else cat.replace("_", " "))
                seen.add(cat)
                bottom += value
            ax.plot(x, r.peak_bytes / 2**20, marker="v", color="black", linestyle="none",
                    label=None if "peak" in seen else "step peak")
            seen.add("peak")
            ticks.append(x)
            names.append(f"{abbr[strategy]}\nN={size}" if j == 1 else abbr[strategy])
        ax.hlines(16 * params / size / 2**20, i - 1.5 * width, i + 1.5 * width, colors="black", linestyles="--",
                  label=None if "16" in seen else "16P/N")
        seen.add("16")
    ax.set_xticks(ticks, names, fontsize=8)
    ax.set_ylabel("memory per rank (MiB)")
    ax.set_xlabel("strategy and ranks in the group (SGO: SHARD_GRAD_OP, FULL: FULL_SHARD)")
    ax.set_title("Replica table, measured: model state per rank vs 16P/N (tiny transformer, fp32 Adam)")
    ax.legend(fontsize=8, loc="upper right")
    return fig


# --- exercises ---------------------------------------------------------------------------------------------

@exercise("01-shard-bytes")
def _shard_bytes(answer, *, shape, world_size: int, itemsize: int = 4):
    """Bytes one rank stores of a weight of `shape` sharded over `world_size` ranks by FSDP2 (fp32)."""
    from ..memory.formula import shard_numel

    return close(answer, shard_numel(shape, world_size) * itemsize, rel=0.0, unit=" B",
                 hint="FSDP2 cuts dim 0 (rows) into world_size equal chunks of ceil(rows / world_size) rows; "
                      "a rank with fewer real rows still stores a full, padded chunk.")


@exercise("01-state-bytes")
def _state_bytes(answer, *, report, params: int):
    """Model-state bytes per parameter one rank holds (parameters + gradients + optimizer state), against a
    report measured by `replica_bytes`."""
    measured = sum(report.resident.values()) / params
    return close(answer, measured, rel=0.03, unit=" B/param",
                 hint="count 4 bytes per fp32 weight, 4 per gradient, and the optimizer's buffers (Adam: two, "
                      "SGD with momentum: one), then divide by the ranks that share them.")


@exercise("01-pure-bf16-gib")
def _pure_bf16(answer, *, model: str = "llama2-7b"):
    """GiB of model state per DDP rank with bf16 weights, bf16 gradients and bf16 Adam moments (no fp32
    master copy), against the lab's formula."""
    from ..memory.formula import formula

    report = formula(model=model, world_size=8, strategy="ddp", precision="bf16", base_dtype="bf16")
    return close(answer, sum(report.resident.values()) / GIB, rel=0.03, unit=" GiB",
                 hint="2 bytes per weight + 2 per gradient + 2 x 2 for Adam's moments; DDP keeps all of it on "
                      "every rank; 1 GiB is 2**30 bytes.")


# --- the wrapping exercise: a model of a new shape, wrapped by the learner on the live ranks ----------------

class MLPBlock(nn.Module):
    """A residual MLP block: x + down(gelu(up(norm(x))))."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    """The wrapping exercise's model: a token embedding `embed`, MLP blocks in `blocks`, a final `norm`, a `head`."""

    def __init__(self, vocab_size: int = 96, dim: int = 32, num_blocks: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.Sequential(*(MLPBlock(dim) for _ in range(num_blocks)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def build_mlp_stack(num_blocks: int = 3, seed: int = 0, device="cpu") -> MLPStack:
    """The same MLPStack on every rank (same seed), on `device`."""
    torch.manual_seed(seed)
    return MLPStack(num_blocks=num_blocks).to(device)


def _units(model: nn.Module) -> list:
    """The FSDP units of `model`, by module path ("root" for the model itself), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [name or "root" for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _forward_backward(model: nn.Module, batch) -> tuple:
    """One forward and backward of the lab's loss, counted: (loss, the units all-gathered in forward, in order)."""
    from ..comms import CommCounter
    from ..sharding import loss_of

    with CommCounter() as counter:
        loss = loss_of(model, batch)
        loss.backward()
    gathered = [r["unit"] for r in counter.records if r["kind"] == "all_gather" and r["phase"] == "forward"]
    return loss.item(), gathered


def compare_wrap(wrap_fn, num_blocks: int = 3, batch_size: int = 2, seq_len: int = 8, seed: int = 0) -> dict:
    """On a rank: the learner's `wrap_fn(model, mesh)` on a fresh MLPStack, next to the lab's own wrap of it
    (`sharding.apply_fsdp` on its blocks) and the unsharded model. Returns the units, the parameters left plain
    or sharded otherwise than on dim 0 over the mesh, the units all-gathered in forward, this rank's loss and
    each parameter's relative gradient error (the unsharded gradient over every rank's batch, as FSDP averages)."""
    from torch.distributed.tensor import DTensor, Shard

    from ..ranks import device, mesh, this_rank, world_size
    from ..sharding import apply_fsdp, loss_of

    n, r, dev = world_size(), this_rank(), device()
    plain = build_mlp_stack(num_blocks, seed, dev)
    batches = []
    for k in range(n):              # every rank's batch, drawn on the CPU: the same numbers on any device
        gen = torch.Generator().manual_seed(seed + 1 + k)
        tokens = torch.randint(0, plain.embed.num_embeddings, (batch_size, seq_len + 1), generator=gen)
        batches.append((tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)))
    with torch.no_grad():
        plain_loss = loss_of(plain, batches[r]).item()
    loss_of(plain, tuple(torch.cat(parts) for parts in zip(*batches))).backward()
    lab = build_mlp_stack(num_blocks, seed, dev)
    apply_fsdp(lab, mesh(), blocks=list(lab.blocks))
    out = {"rank": r, "world_size": n, "blocks": [f"blocks.{i}" for i in range(num_blocks)],
           "lab_units": _units(lab), "lab_gathered": _forward_backward(lab, batches[r])[1]}
    model = build_mlp_stack(num_blocks, seed, dev)
    try:
        returned = wrap_fn(model, mesh())
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        out["error"], returned = first_line(err), model
    out["units"] = _units(model)
    out["returned"] = "model" if returned is model else "None" if returned is None else type(returned).__name__
    params = dict(model.named_parameters())
    out["plain"] = [name for name, p in params.items() if not isinstance(p, DTensor)]
    out["misplaced"] = [(name, str(tuple(p.placements)), p.device_mesh.mesh.tolist()) for name, p in params.items()
                        if isinstance(p, DTensor) and (tuple(p.placements) != (Shard(0),)
                                                       or p.device_mesh.mesh.tolist() != mesh().mesh.tolist())]
    if "error" in out:
        return out
    try:
        out["loss"], out["gathered"] = _forward_backward(model, batches[r])
    except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
        out["run_error"] = first_line(err)
        return out
    out["plain_loss"], out["grad_errors"] = plain_loss, {}
    for name, p in params.items():
        expected = plain.get_parameter(name).grad
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out["grad_errors"][name] = (float((grad - expected).norm() / expected.norm()) if grad is not None
                                    else float("inf"))
    return out


def _listed(names: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


def _units_text(out: dict) -> str:
    """What the learner's wrap made of the model, next to the lab's wrap: the units forward all-gathered where
    the ranks gather (2 or more), else the units themselves."""
    gathered, lab_gathered = out.get("gathered"), out["lab_gathered"]
    if out["world_size"] > 1 and gathered is not None:
        if gathered == ["root"]:
            return "forward all-gathered once, the whole model as one unit"
        return (f"forward all-gathered {len(gathered)} unit(s) ({', '.join(gathered) or 'none'}) where the lab's "
                f"wrap gathers {len(lab_gathered)} ({', '.join(lab_gathered)})")
    if out["units"] == ["root"]:
        return "the root is the only unit, the whole model in one"
    return f"the units are {', '.join(out['units'])} where the lab's wrap makes {', '.join(out['lab_units'])}"


@exercise("01-wrap")
def _wrap(answer, *, cluster, rel: float = 1e-4):
    """The learner's `wrap(model, mesh)` on the exercise's MLPStack, run on every rank: units, placements and
    forward all-gathers against the lab's own wrap, loss and gradients against the unsharded model."""
    if not callable(answer):
        return False, f"expected a function wrap(model, mesh) that returns the model, got {answer!r}."
    if (not_ready := ranks_not_ready(cluster, "after section 3")) is not None:
        return False, not_ready
    try:
        results = cluster.run(compare_wrap, answer)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your wrap raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    blocks, units, n = out["blocks"], out["units"], out["world_size"]
    missing = [b for b in blocks if b not in units]
    if "error" in out:
        if "root" in units and missing:
            return False, ("the root was wrapped before the blocks: its unit already held the blocks' parameters, "
                           f"and your wrap then raised {out['error']}")
        return False, f"your wrap raised on the ranks: {out['error']}"
    if not units:
        return False, "nothing was sharded: every parameter is still a plain tensor, whole on every rank."
    if "root" not in units:
        owners = list(dict.fromkeys(name.rpartition(".")[0] for name in out["plain"]))
        if owners:
            return False, (f"the root was not wrapped: the parameters of {_listed(owners)} are plain tensors, "
                           "whole on every rank.")
        return False, f"the root was not wrapped: only its parts ({', '.join(units)}) are FSDP units."
    if missing:
        what = (f"none of the {len(blocks)} blocks is an FSDP unit" if len(missing) == len(blocks) else
                f"{len(missing)} of {len(blocks)} blocks ({', '.join(missing)}) are not FSDP units")
        return False, f"{what}: {_units_text(out)}."
    if out["plain"]:
        return False, f"{_listed(out['plain'])} stayed plain tensors, whole on every rank."
    if out["misplaced"]:
        name, placements, ranks = out["misplaced"][0]
        return False, f"{name} is a DTensor {placements} over ranks {ranks}, not Shard(dim=0) over the mesh given."
    if "run_error" in out:
        return False, f"the wrapped model raised in forward or backward: {out['run_error']}"
    for block in blocks:
        count, lab_count = out["gathered"].count(block), out["lab_gathered"].count(block)
        if count != lab_count:
            return False, (f"{block} was all-gathered {count} time(s) in forward, {lab_count} under the lab's wrap: "
                           f"{_units_text(out)}.")
    if out["returned"] != "model":
        return False, (f"your wrap shards the model but returns {out['returned']}: return the model it was given, "
                       "which the training code goes on to use.")
    worst_loss = max(results, key=lambda x: abs(x["loss"] - x["plain_loss"]))
    if abs(worst_loss["loss"] - worst_loss["plain_loss"]) > rel * max(1.0, abs(worst_loss["plain_loss"])):
        return False, (f"rank {worst_loss['rank']}'s loss is {worst_loss['loss']:.6f}, the unsharded model's "
                       f"{worst_loss['plain_loss']:.6f}: the wrap must leave the model's values and "
                       "precision as they are.")
    name, error = max(out["grad_errors"].items(), key=lambda item: item[1])
    if error > rel:
        return False, (f"{name}'s gradient differs from the unsharded model's by {error:.1e} (relative): keep the "
                       "parameters in fp32 and let FSDP average the gradients over the ranks.")
    gathered = (f", and forward all-gathered each once ({', '.join(out['gathered'])})" if n > 1 else
                " (on 1 rank forward gathers nothing)")
    return True, (f"the {len(blocks)} blocks and the root are FSDP units{gathered}; every parameter is sharded "
                  f"on dim 0 over {n} rank(s); loss and gradients match the unsharded model's "
                  f"(worst relative error {error:.1e}).")
