"""Lesson 04 (mixed precision pitfalls) only: the claims' verdicts as functions of what the lesson measured,
the exercise checker that answers with the lab's own gradients, running a `precision.*_on_rank` function on
a group of the lesson's one cluster, and the lesson's figures.

Claim 9: "fp16 MixedPrecision; the optimizer keeps fp32". Claim 10: "`mixed_precision=torch.float16`; keep
LayerNorm in fp32 via `reduce_dtype=torch.float32`".
"""

from __future__ import annotations

import math

import torch
from matplotlib.ticker import MaxNLocator

from .checkers import exercise
from .precision import underflow_fraction

FP16_MAX = torch.finfo(torch.float16).max
FP16_SMALLEST = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps   # subnormal


def claim9_verdict(adam: dict) -> str:
    """TRUE when AdamW kept fp32 state for the model wrapped in fp32 and for the one loaded in fp16, WRONG
    when for neither, PARTLY TRUE in between (`adam` is `precision.adam_state_dtypes()`)."""
    kept = [adam[name]["state_dtype"] == "float32" for name in ("fp32", "fp16")]
    return "TRUE" if all(kept) else "PARTLY TRUE" if any(kept) else "WRONG"


def claim10_verdict(posts_call: str, norm_weight_dtypes) -> str:
    """TRUE when the posts' `mixed_precision=torch.float16` is accepted and every norm weight ran in fp32
    with reduce_dtype=fp32; WRONG when neither holds; PARTLY TRUE otherwise."""
    accepted = posts_call == "no error"
    fp32_norms = all(d == "float32" for d in norm_weight_dtypes)
    return "TRUE" if accepted and fp32_norms else "WRONG" if not (accepted or fp32_norms) else "PARTLY TRUE"


def safe_loss_scales(grads: torch.Tensor, shrink: float = 1.0) -> tuple:
    """(smallest power of two that flushes none of `grads * shrink` to 0 in fp16, largest scale before the
    biggest of them passes fp16's max) for these gradients."""
    k = -30
    while underflow_fraction(grads, "fp16", 2.0 ** k, shrink) > 0 and k < 120:
        k += 1
    return 2.0 ** k, FP16_MAX / float(grads.abs().max() * shrink)


@exercise("04-loss-scale")
def _loss_scale(answer, *, grads, shrink):
    """A loss scale under which the gradients (x shrink) neither flush to 0 nor overflow in fp16."""
    try:
        scale = float(answer)
    except (TypeError, ValueError):
        return False, f"expected a number (a loss scale such as 2.0 ** 10), got {answer!r}."
    if isinstance(answer, bool) or not math.isfinite(scale) or scale <= 0:
        return False, (f"a loss scale multiplies the loss by a positive, finite number; {answer!r} is not one "
                       "(a negative scale flips every gradient's sign, nan or inf make every gradient nan or inf).")
    low, high = safe_loss_scales(grads, shrink)
    flushed = underflow_fraction(grads, "fp16", scale, shrink)
    biggest = float(grads.abs().max() * shrink * scale)
    if flushed > 0:
        return False, (f"{flushed:.2%} of the gradients still become 0 in fp16 at scale {scale:g}: scale up. Hint: "
                       f"the smallest |gradient| is {float(grads.abs().min() * shrink):.2e} and fp16's smallest "
                       f"subnormal is {FP16_SMALLEST:.2e}.")
    if biggest > FP16_MAX:
        return False, (f"the largest gradient times {scale:g} is {biggest:.3g}, above fp16's max {FP16_MAX:g}: "
                       "it would be inf and the scaler would skip the step. Scale down.")
    return True, (f"at {scale:g} no gradient flushes to 0 and the largest is {biggest:.3g} < {FP16_MAX:g}; "
                  f"the safe window for these gradients runs from {low:g} to {high:.3g}.")


@exercise("04-reduce-bytes")
def _reduce_bytes(answer, *, measured, params: int, dtypes):
    """Bytes the gradient reduce-scatters of one backward carried on one rank, as the cell re-measured them."""
    from .checkers import close

    return close(answer, measured, rel=0.02, unit=" B",
                 hint=f"a reduce-scatter takes every unsharded gradient as input: {params:,} parameters times the "
                      f"bytes of reduce_dtype ({', '.join(dtypes)} here); param_dtype does not decide it, and neither "
                      "does the number of ranks.")


# --- one cluster, groups of its ranks ---------------------------------------------------------------

def on_group(cluster, group_size: int, fn, *args, **kwargs) -> list:
    """`cluster.run(fn, ..., group_size=group_size)`: `fn` (a `precision.*_on_rank` function) runs on ranks
    0..group_size-1 of the lesson's one cluster; returns those ranks' values, in rank order."""
    return cluster.run(fn, *args, group_size=group_size, **kwargs)[:group_size]


# --- figures ---------------------------------------------------------------------------------------

def draw_ranges(fig, norms: dict, shrinks, underflow: dict):
    """Left: relative error of each real norm module's output in fp16 / bf16 vs activation size (`norm_errors`),
    a non-finite output drawn as x at the top, the scales where fp16 cannot hold the input shaded.
    Right: fraction of real gradients that become 0 in each dtype / loss scale vs how small they are."""
    ax_norm, ax_under = fig.subplots(1, 2)
    scales, top = norms["scales"], 2.0
    styles = {"LayerNorm": ("o", "-"), "RMSNorm": ("s", "--"), "naive RMSNorm": ("^", ":")}
    colours = {"fp16": "tab:red", "bf16": "tab:blue"}
    for (name, dtype), errs in norms["errors"].items():
        marker, ls = styles.get(name, ("o", "-"))
        ax_norm.plot(scales, [e if math.isfinite(e) else float("nan") for e in errs], marker=marker, ls=ls,
                     color=colours.get(dtype), alpha=0.8, label=f"{name}, {dtype}")
        bad = [s for s, e in zip(scales, errs) if not math.isfinite(e)]
        ax_norm.plot(bad, [top] * len(bad), "x", color=colours.get(dtype), markersize=10)
    first_inf = next((s for s, f in zip(scales, norms["input_inf"].get("fp16", [])) if f > 0), None)
    if first_inf is not None:
        ax_norm.axvspan(first_inf, scales[-1] * 1.5, color="tab:red", alpha=0.08,
                        label=f"fp16 input holds inf (|x| > {torch.finfo(torch.float16).max:g}); x: output NaN")
    ax_norm.set(xscale="log", yscale="log", ylim=(1e-7, top * 2), xlabel="activation RMS (scale of x)",
                ylabel="relative error of the norm's output", title="norm layers in fp16 and bf16 (real modules)")
    ax_norm.legend(fontsize=6.5, loc="lower left", ncol=2)
    for label, fractions in underflow.items():
        ax_under.plot(shrinks, fractions, marker="o", label=label)
    ax_under.set(xscale="log", xlabel="gradient size (x the tiny model's real gradients)",
                 ylabel="fraction of non-zero gradients that become 0", title="gradients: underflow to zero")
    ax_under.invert_xaxis()
    ax_under.legend(fontsize=7)
    fig.tight_layout()


def draw_scalers(fig, runs: dict, inf_step: int):
    """Per scaler kind: each rank's loss scale per step, and each rank's shard checksum minus the agreeing
    run's (0 = the same parameters)."""
    ax_scale, ax_sum = fig.subplots(1, 2)
    agree = {r["rank"]: r for r in runs["agree"]}
    same = len({tuple(r["scales"]) for r in runs["agree"]}) == 1
    for kind, ranks in runs.items():
        for r in ranks:
            diff = [abs(a - b) for a, b in zip(r["checksums"], agree[r["rank"]]["checksums"])]
            if kind == "agree":
                if same and r["rank"] != ranks[0]["rank"]:
                    continue     # identical on every rank: one band, named so
                # wide and pale, so the per-rank lines drawn over it stay visible
                label = "agreeing scaler, every rank (identical)" if same else f"agreeing scaler, rank {r['rank']}"
                ax_scale.plot(r["scales"], "-", color="grey", lw=7, alpha=0.35, label=label)
                continue
            ax_scale.plot(r["scales"], "--", marker="os"[r["rank"] % 2], label=f"per-rank scaler, rank {r['rank']}")
            ax_sum.plot(diff, "--", marker="o", label=f"per-rank vs agreeing, rank {r['rank']}")
    for ax in (ax_scale, ax_sum):
        ax.axvline(inf_step, color="gray", ls=":", label="inf on one rank")
        ax.set_xlabel("step")
        ax.set_xticks(range(len(runs["agree"][0]["scales"])))
        ax.legend(fontsize=7)
    values = sorted({v for ranks in runs.values() for r in ranks for v in r["scales"]})
    ax_scale.set_yscale("log")
    ax_scale.set_yticks(values, [f"{v:,.0f}" for v in values])
    ax_scale.minorticks_off()
    ax_scale.set(ylabel="loss scale (log axis)", title="loss scale per rank")
    ax_sum.set(ylabel="|shard checksum - agreeing run's|", title="parameters vs the agreeing scaler")
    fig.tight_layout()


def curve_spread(curves: dict, reference: str = "fp32") -> dict:
    """{mode: largest |loss - reference loss| over the steps where the mode's loss is finite}."""
    return {mode: max((abs(a - b) for a, b in zip(losses, curves[reference]) if math.isfinite(a)), default=float("nan"))
            for mode, losses in curves.items() if mode != reference}


def curve_line(mode: str, losses: list, reference: list) -> str:
    """One printed line per mode: first and last loss and the largest |loss - reference| over the finite steps.
    A curve that turns NaN says from which step, so it never reads as close to the reference (Python's `max`
    over comparisons with NaN would skip them)."""
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    finite = [abs(a - b) for a, b in zip(losses[:bad], reference)]
    if bad == 0:
        return f"{mode:<12} first {losses[0]:.4f}  last {losses[-1]:.4f}  NaN from step 0: no finite loss"
    diff = f"max |diff vs fp32| {max(finite):.2e}"
    if bad is None:
        return f"{mode:<12} first {losses[0]:.4f}  last {losses[-1]:.4f}  {diff}"
    return (f"{mode:<12} first {losses[0]:.4f}  last {losses[-1]:.4f}  NaN from step {bad}; "
            f"before it {diff}")


def draw_curves(fig, curves: dict, title: str = ""):
    """Left: loss per step for each precision mode. The finite curves lie on top of each other, so each mode
    gets its own marker, placed on different steps, and the panel states the largest distance from fp32; a
    mode that turned NaN is marked where it did. Right: each mode's |loss - fp32 loss| per step, log scale
    (where the modes actually differ)."""
    ax, ax_diff = fig.subplots(1, 2)
    markers = "osD^v"
    spread = curve_spread(curves)
    for k, (mode, losses) in enumerate(curves.items()):
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        # A mode that turns NaN has few finite points, each marked and drawn on top so none hides under fp32's.
        look = (dict(markevery=None, markersize=9, zorder=5) if bad is not None
                else dict(markevery=(k, len(curves)), markersize=6))
        line, = ax.plot(range(len(losses)), losses, label=mode, lw=2.5 if mode == "fp32" else 1.2,
                        ls="-" if mode in ("fp32", "bf16") else "--", marker=markers[k % len(markers)],
                        alpha=0.85, **look)
        if bad is not None:
            last = losses[bad - 1] if bad else losses[0]
            ax.plot([bad], [last], "X", color=line.get_color(), markersize=12, zorder=5)
            ax.annotate(f"{mode}: NaN from step {bad}\n(X: drawn at its last finite loss)", (bad, last),
                        xytext=(15, -30), textcoords="offset points", fontsize=8, color=line.get_color(),
                        arrowprops={"arrowstyle": "-", "color": "gray"})
        if mode != "fp32":
            diff = [abs(a - b) if math.isfinite(a) else float("nan") for a, b in zip(losses, curves["fp32"])]
            ax_diff.plot(range(len(diff)), [max(d, 1e-9) for d in diff], marker="v" if bad is not None else ".",
                         markersize=9 if bad is not None else 6, zorder=5 if bad is not None else 2,
                         color=line.get_color(), label=mode + (f" (finite until step {bad - 1})" if bad else ""))
    finite = {m: v for m, v in spread.items() if math.isfinite(v) and all(map(math.isfinite, curves[m]))}
    if finite:
        worst = max(finite, key=finite.get)
        ax.text(0.02, 0.03, f"the curves overlap: the finite ones stay within {finite[worst]:.1e} nats of fp32\n"
                f"(largest: {worst}); markers sit on different steps so each is visible",
                transform=ax.transAxes, fontsize=7.5, va="bottom",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
    for axis in (ax, ax_diff):      # steps are whole numbers: no 2.5 ticks
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats)", title="loss")
    ax.legend(fontsize=8)
    ax_diff.set(yscale="log", xlabel="step", ylabel="|loss - fp32 loss| (nats)", title="distance from fp32")
    ax_diff.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)   # off the data
    if title:
        fig.suptitle(title)
    fig.tight_layout()
