"""Lesson 04 (mixed precision pitfalls) only: the claims' verdicts as functions of what the lesson measured,
the exercise checkers (one runs the learner's FSDP2 wrapping next to the lab's on the ranks), running a
`precision.*_on_rank` function on a group of the lesson's one cluster, and the lesson's figures.

Claim 9: "fp16 MixedPrecision; the optimizer keeps fp32". Claim 10: "`mixed_precision=torch.float16`; keep
LayerNorm in fp32 via `reduce_dtype=torch.float32`".
"""

from __future__ import annotations

import math

import torch
from matplotlib.ticker import MaxNLocator

from .checkers import exercise, first_line
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
                      f"bytes of reduce_dtype ({', '.join(dtypes)} here); param_dtype decides it only when "
                      "reduce_dtype is left out, and the number of ranks never does.")


# --- fp32 norms in a bf16 model, sharded by the learner ---------------------------------------------


def _unit_too_late(model, error: BaseException):
    """(module, the unit around it) when `error` came from fully_shard on a module of `model` that already sat
    inside a unit; None otherwise."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    tb = error.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("module") if tb.tb_frame.f_code.co_name == "fully_shard" else None
        if id(module) in names:
            name = names[id(module)]
            outer = [n for n, m in model.named_modules()
                     if isinstance(m, FSDPModule) and n != name and (n == "" or name.startswith(n + "."))]
            return (name, max(outer, key=len) or "the root") if outer else None
        tb = tb.tb_next
    return None


def compare_norm_units(shard_fn, cfg=None, seed: int = 0) -> dict:
    """On a rank: the lab's wrapping (each norm an fp32 unit, the rest bf16, reduced in fp32) and the learner's
    `shard_fn(model, mesh)` on the same tiny transformer, one forward and backward each. Returns the dtypes each
    norm and matmul module saw inside forward in both, the dtypes each unit's gradients were reduce-scattered
    in, the learner's first error and the gradients' worst distance from the reference's."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from ..comms import CommCounter
    from ..models import TinyConfig, random_batch
    from ..ranks import device, mesh, rank
    from ..sharding import apply_fsdp, build_tiny, loss_of
    from .precision import is_norm, probe_dtypes, shard_norms_fp32

    cfg = cfg or TinyConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, seq_len=16)
    batch = random_batch(cfg, 2, seed=seed + rank(), device=device())

    def probed(model, rows):
        probe_dtypes(model, rows, lambda m: is_norm(m) or isinstance(m, (nn.Linear, nn.MultiheadAttention)))
        return {n: "norm" if is_norm(m) else type(m).__name__ for n, m in model.named_modules()}

    def reduced(counter):
        return {r["unit"]: r["dtype"] for r in counter.records if r["kind"] == "reduce_scatter"}

    reference = build_tiny(cfg, seed=seed, device=device())
    shard_norms_fp32(reference, mesh(), torch.bfloat16)
    apply_fsdp(reference, mesh(), precision="bf16", reduce_precision="fp32")
    out = {"rank": rank(), "reference": [], "rows": [], "error": None, "raised_in": None, "too_late": None,
           "unsharded": [], "grad_error": 0.0, "grad_of": None}
    out["kinds"] = probed(reference, out["reference"])
    with CommCounter() as counter:
        loss_of(reference, batch).backward()
    out["reference_reduced"] = reduced(counter)
    model = build_tiny(cfg, seed=seed, device=device())
    try:
        shard_fn(model, mesh())
    except Exception as e:  # noqa: BLE001 - the learner's error is the answer to show
        out.update(error=first_line(e), raised_in="shard", too_late=_unit_too_late(model, e))
        return out
    out["unsharded"] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if out["unsharded"]:
        return out
    probed(model, out["rows"])
    try:
        with CommCounter() as counter:
            loss_of(model, batch).backward()
    except Exception as e:  # noqa: BLE001
        out.update(error=first_line(e), raised_in="step")
        return out
    out["reduced"] = reduced(counter)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = expected[name].grad.full_tensor()
        got = p.grad.full_tensor().to(want.dtype) if p.grad is not None else torch.zeros_like(want)
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        if err >= out["grad_error"]:
            out["grad_error"], out["grad_of"] = err, name
    return out


def _first_difference(result: dict):
    """(module, field, learner's dtype, reference's dtype) of the first forward record that differs from the
    reference's; None when all the learner's forward reached matches it."""
    rows = {}
    for row in result["rows"]:
        rows.setdefault(row["module"], row)
    for want in result["reference"]:
        got = rows.get(want["module"])
        if got is None:
            return None
        for field in ("weight", "input", "output"):
            if got[field] != want[field] and got[field] != "-":
                return want["module"], field, got[field], want[field]
    return None


@exercise("04-fp32-norms")
def _fp32_norms(answer, *, cluster, cfg=None, rel=1e-2):
    """The learner's `shard(model, mesh)` against the lab's wrapping: norms in fp32, matmuls in bf16, gradients."""
    if not callable(answer):
        return False, "expected a function shard(model, mesh) that calls fully_shard on the model's modules."
    try:
        results = cluster.run(compare_norm_units, answer, cfg)
    except Exception as e:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(e).strip().splitlines()[0]}"
    for r in results:
        rank = r["rank"]
        if r["too_late"]:
            module, outer = r["too_late"]
            return False, (f"rank {rank}'s fully_shard(`{module}`) raised ({r['error']}): it already sat inside the "
                           f"unit `{outer}`. Hint: fully_shard builds units from the inside out.")
        if r["raised_in"] == "shard":
            return False, f"your function raised on rank {rank}: {r['error']}"
        if r["unsharded"]:
            more = f" (and {len(r['unsharded']) - 1} more)" if len(r["unsharded"]) > 1 else ""
            return False, (f"rank {rank}'s `{r['unsharded'][0]}`{more} is not sharded after your function: every "
                           "parameter must belong to a fully_shard unit (the root's takes what the others leave).")
        diff = _first_difference(r)
        if diff:
            module, field, got, want = diff
            what = r["kinds"][module]
            raised = f"; the next layer raised: {r['error']}" if r["error"] else ""
            if field == "output":
                return False, (f"rank {rank}'s {what} `{module}` handed on a {got} output, the reference's a {want} "
                               f"one{raised}. Hint: the layer after a norm runs in the model's compute dtype.")
            if what != "norm":
                return False, (f"rank {rank}'s {what} `{module}` got a {got} {field} inside forward, the "
                               f"reference's a {want} one: only the norms keep fp32, the matmuls run in bf16.")
            if field == "weight":
                return False, (f"rank {rank}'s norm `{module}` ran with a {got} weight inside forward, the "
                               f"reference's with a {want} one. Hint: param_dtype casts every parameter of its "
                               "unit, norm weights included.")
            return False, (f"rank {rank}'s norm `{module}` received a {got} input inside forward, the reference's "
                           f"a {want} one: its statistics start from the input as it arrives. Hint: what does the "
                           "norm's policy do with the inputs of its forward?")
        if r["error"]:
            return False, f"the forward or backward raised on rank {rank}: {r['error']}"
        want = r["reference_reduced"]
        unit = next((u for u, dtype in r["reduced"].items() if want.get(u, dtype) != dtype), None)
        if unit is not None:
            return False, (f"the dtypes inside forward match the reference, but rank {rank} reduce-scattered the "
                           f"gradients of `{unit or 'the root'}` in {r['reduced'][unit]}, the reference in "
                           f"{want[unit]}. Hint: a unit's reduce_dtype is the dtype its gradients are summed in.")
    worst = max(results, key=lambda x: x["grad_error"])
    if worst["grad_error"] > rel:          # bf16 matmuls: GPU kernels need not give the same bits twice
        return False, (f"the dtypes match the reference, but rank {worst['rank']}'s gradient of "
                       f"`{worst['grad_of']}` differs from the reference's by {worst['grad_error']:.1e} (relative).")
    norm = next(row for row in results[0]["reference"] if results[0]["kinds"][row["module"]] == "norm")
    return True, (f"on each of {len(results)} ranks every norm ran with {norm['weight']} weights and inputs and "
                  f"handed on {norm['output']}, every matmul ran in bf16, as in the reference; gradients match it "
                  f"(worst relative error {worst['grad_error']:.1e}).")


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
