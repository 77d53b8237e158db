"""Lesson 01 (sharding math) only: the verdict words of the lesson's claims, each a function of what the
notebook measured (its experiments, `fully_shard` and DDP on live ranks, are written in its cells), and the
lesson's exercises.
"""

from __future__ import annotations

import math

from .checkers import close, exercise
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
            f"(nn.DataParallel, the posts' DP, is not measured); sharded strategies hold {full_state_last / params:.2f} B/param at N={last}. FSDP2's "
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
    peaks = f"whole-model wrapping peaks at {whole_model_peak / MIB:.2f} MiB vs {per_block_peak / MIB:.2f} MiB per block"
    if last == 1:
        return peaks + " on 1 rank, where nothing is sharded or gathered: run with 2 or more ranks"
    return f"{peaks} ({1 - per_block_peak / whole_model_peak:.0%} lower) on {last} ranks"


def claim17_word(mixed_state_bytes: int, pure_bf16_peak_bytes: int, card_gib: float = 80.0) -> str:
    """Claim 17 ("Llama-7B: DDP 78 GB") from the formula's DDP model state with mixed-precision Adam and the
    DDP peak with pure bf16 weights and bf16 Adam (no fp32 master copy), against an 80 GiB card."""
    if mixed_state_bytes / GIB <= card_gib:
        return "plausible"
    return "partly" if pure_bf16_peak_bytes / GIB <= card_gib else "wrong"


def claim18_word(max_saving_bytes: float, claimed_saving_bytes: float) -> str:
    """Claim 18 ("ResNet152: DDP 23 GB vs FSDP 9 GB") from the most FSDP can save (the whole model state minus
    one shard) against the claimed saving."""
    return "wrong" if max_saving_bytes < 0.5 * claimed_saving_bytes else "plausible"


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
