"""Lesson 02 (prefetch and communication) only: the overlap simulator at the lesson's sizes, the lesson's two
figures (bytes per step, prefetch gains), the claims' verdicts as functions of what the lesson measured, the
summary table, and the exercise checkers.

Claim 4: "FSDP's communication is 40% lower than DDP's". Claim 5: "< 13B or LoRA: use SHARD_GRAD_OP; 70B must
use FULL_SHARD". Claim 6: "BACKWARD_PRE gives +15-25% throughput, holds two layers' params; forward prefetch
is experimental".
"""

from __future__ import annotations

from .checkers import exercise
from ..comms import summarize
from ..timeline import simulate_step

CLAIM4_RATIO = 0.6          # "40% lower": FSDP = 0.6 x DDP
CLAIM6_GAIN = (0.15, 0.25)  # "+15-25% throughput"
# Short names for figure labels, in PRESETS order.
SHORT_NAMES = {"NVLink A100 (300 GB/s)": "NVLink A100", "NVLink H100 (450 GB/s)": "NVLink H100",
               "PCIe 4.0 x16 (31.5 GB/s)": "PCIe 4", "PCIe 5.0 x16 (63 GB/s)": "PCIe 5",
               "InfiniBand 100 Gb/s (12.5 GB/s)": "IB 100", "InfiniBand 200 Gb/s (25 GB/s)": "IB 200",
               "InfiniBand 400 Gb/s (50 GB/s)": "IB 400", "Ethernet 10 GbE (1.25 GB/s)": "10 GbE",
               "Ethernet 25 GbE (3.125 GB/s)": "25 GbE", "Ethernet 100 GbE (12.5 GB/s)": "100 GbE"}
# The three switches compared, as (forward prefetch depth, backward prefetch depth).
PREFETCH_CASES = {"none": (0, 0), "backward only (BACKWARD_PRE)": (0, 1), "forward only": (1, 0), "both": (1, 1)}


# --- the bytes-per-step figure --------------------------------------------------------------------------

def draw_bytes_per_step(ax, runs: dict, unit: float, ddp_sent: float, claim=CLAIM4_RATIO):
    """Stacked bars of the bytes rank 0 sent in one step, per strategy and (phase, collective), in units of
    `unit` bytes ((N-1)/N x P), and a dashed line at the claim: `claim` x DDP's `ddp_sent` bytes."""
    stack = {("forward", "all_gather"): "tab:blue", ("backward", "all_gather"): "tab:cyan",    # bottom to top
             ("backward", "reduce_scatter"): "tab:orange", ("backward", "all_reduce"): "tab:red"}
    drawn = {}
    for x, (s, out) in enumerate(runs.items()):
        table, bottom = summarize([e for e in out[0]["events"] if e["event"] == "collective"]), 0.0
        for key in sorted(table, key=lambda k: list(stack).index(k) if k in stack else len(stack)):
            height = table[key]["sent_bytes"] / unit
            drawn[key] = ax.bar(x, height, bottom=bottom, color=stack.get(key, "lightgray"))
            bottom += height
    claim_line = ax.axhline(claim * ddp_sent / unit, ls="--", color="k")
    order = sorted(drawn, key=lambda k: -list(stack).index(k) if k in stack else 1)   # top of the stack first
    ax.legend([drawn[k] for k in order] + [claim_line],
              [" ".join(k) for k in order] + [f"posts' claim: FSDP = {claim} x DDP"], fontsize=8, loc="upper left")
    ax.set_xticks(range(len(runs)), [s.upper() for s in runs])
    ax.set_ylabel("bytes sent per rank per step / ((N-1)/N x P bytes)")


# --- the simulator at the lesson's sizes ----------------------------------------------------------------

def simulate(link, layer_mparams: float = 200, world_size: int = 16, tokens_k: float = 4, num_layers: int = 6,
             flops_per_s: float = 150e12, forward_prefetch: bool = False, backward_prefetch: bool = True) -> dict:
    """One FULL_SHARD step of `num_layers` layers of `layer_mparams` million parameters, `tokens_k` thousand
    tokens per GPU: forward compute 2 x params x tokens / flops_per_s per layer, bf16 all-gathers."""
    params = layer_mparams * 1e6
    return simulate_step(num_layers=num_layers, layer_compute_s=2 * params * tokens_k * 1024 / flops_per_s,
                         layer_bytes=2 * params, world_size=world_size, link=link,
                         forward_prefetch=int(forward_prefetch), backward_prefetch=int(backward_prefetch))


def prefetch_gains(link, **sizes) -> dict:
    """Throughput gain of each prefetch case over no prefetch, and the ratio that decides it: one layer's
    all-gather time / one layer's forward compute time (both read from the simulation)."""
    steps = {case: simulate(link, forward_prefetch=bool(f), backward_prefetch=bool(b), **sizes)
             for case, (f, b) in PREFETCH_CASES.items()}
    none = steps["none"]
    gains = {case: none["step_s"] / r["step_s"] - 1 for case, r in steps.items() if case != "none"}
    return {"ratio": none["all_gather_s"] / none["layer_forward_s"], "gains": gains,
            "step_s": {case: r["step_s"] for case, r in steps.items()}}


def draw_gains(ax, curve: list, presets: dict, claim=CLAIM6_GAIN):
    """Gain vs all-gather / forward ratio for each prefetch case (`curve`: prefetch_gains over a bandwidth
    sweep), the presets as points on the backward-only line, labelled without overlap, the claim's band."""
    styles = {"backward only (BACKWARD_PRE)": ("-", "tab:blue"), "forward only": (":", "tab:green"),
              "both": ("--", "tab:purple")}
    xs = [c["ratio"] for c in curve]
    for case, (ls, colour) in styles.items():
        ax.semilogx(xs, [c["gains"][case] * 100 for c in curve], ls, color=colour, label=case)
    key = "backward only (BACKWARD_PRE)"
    # Presets on (nearly) the same point share one label. Labels sit where the curve is not: left and above
    # or right and below on its rising side, above at the peak, right and above on its falling side.
    points: list = []
    for name, g in sorted(presets.items(), key=lambda item: item[1]["ratio"]):
        x, y = g["ratio"], g["gains"][key] * 100
        if points and abs(x / points[-1][0] - 1) < 0.03 and abs(y - points[-1][1]) < 1.0:
            points[-1][2].append(SHORT_NAMES.get(name, name))
        else:
            points.append((x, y, [SHORT_NAMES.get(name, name)]))
    peak = max(points, key=lambda p: p[1])[0] if points else None
    rising = 0
    for x, y, names in points:
        if x < peak:
            offset, ha = ((-7, 6), "right") if rising % 2 == 0 else ((7, -11), "left")
            rising += 1
        elif x == peak:
            offset, ha = (0, 8), "center"
        else:
            offset, ha = (6, 5), "left"
        ax.plot(x, y, "o", color="tab:orange", zorder=3)
        ax.annotate(" / ".join(names), (x, y), xytext=offset, textcoords="offset points", ha=ha, fontsize=7)
    ax.axhspan(claim[0] * 100, claim[1] * 100, color="tab:red", alpha=0.12, label="posts' claim 6: +15-25%")
    ax.set_xlabel("one layer's all-gather time / its forward compute time")
    ax.set_ylabel("throughput gain over no prefetch (%)")
    ax.set_ylim(bottom=-5)
    ax.legend(fontsize=8, loc="upper left")


# --- verdicts -------------------------------------------------------------------------------------------

def claim4_verdict(full_shard_vs_ddp: float, tolerance: float = 0.05) -> str:
    """RIGHT when FULL_SHARD's measured bytes are within `tolerance` of the claimed 0.6 x DDP, else WRONG."""
    return "RIGHT" if abs(full_shard_vs_ddp - CLAIM4_RATIO) <= tolerance else "WRONG"


def claim5_verdict(shard_grad_op_vs_ddp: float, full_shard_vs_ddp: float, units_kept: int, num_units: int) -> str:
    """RIGHT when SHARD_GRAD_OP sends fewer bytes than FULL_SHARD and keeps fewer than all units gathered,
    PARTLY when it saves bytes but keeps every unit gathered (its memory cost), WRONG when it saves nothing."""
    if shard_grad_op_vs_ddp >= full_shard_vs_ddp:
        return "WRONG"
    return "PARTLY" if units_kept >= num_units else "RIGHT"


def claim6_verdict(backward_units: int, gains, claim=CLAIM6_GAIN) -> str:
    """RIGHT when backward prefetch holds two units and every simulated gain falls in the claimed band; PARTLY
    when one of the two holds (or only some gains are in the band); WRONG when neither."""
    inside = [claim[0] <= g <= claim[1] for g in gains]
    two = backward_units == 2
    if two and all(inside):
        return "RIGHT"
    return "PARTLY" if two or any(inside) else "WRONG"


def summary_table(verdicts, *, ranks: int, num_layers: int, ratio: dict, sent: dict, unit: float, peaks: dict,
                  fp16_7b_gib: float, live: dict, bwd_gains: list, preset_gain: dict, best: dict, seq: dict) -> str:
    """The summary's Markdown table: claims 4, 5 and 6, their `verdicts`, and the numbers measured for each
    (`unit`: (N-1)/N x P bytes; the rest as the lesson's cells name them)."""
    v4, v5, v6 = verdicts
    bwd = "backward only (BACKWARD_PRE)"
    h100 = preset_gain["NVLink H100 (450 GB/s)"]["gains"][bwd]
    empty_is_default = seq["backward empty list"] == seq["implicit (default)"]
    rows = [
        ("4", "FSDP's communication is 40% lower than DDP's", v4,
         f"bytes sent per rank per step on {ranks} ranks: FULL_SHARD {ratio['full_shard']:.2f} x DDP "
         f"({sent['full_shard'] / unit:.2f} vs {sent['ddp'] / unit:.2f} x (N-1)/N x P), "
         f"SHARD_GRAD_OP {ratio['shard_grad_op']:.2f} x DDP; the claim is {CLAIM4_RATIO:.2f} x"),
        ("5", "< 13B or LoRA: use SHARD_GRAD_OP", v5,
         f"SHARD_GRAD_OP sends {ratio['shard_grad_op'] / ratio['full_shard']:.2f} x FULL_SHARD's bytes but keeps "
         f"{peaks['shard_grad_op']['forward']} of {num_layers} blocks gathered from forward to backward (FULL_SHARD "
         f"{peaks['full_shard']['forward']}): for a 7B model in fp16, {fp16_7b_gib:.1f} GiB on every GPU"),
        ("6", "BACKWARD_PRE +15-25% throughput, holds two layers", v6,
         f"blocks unsharded at the backward peak: {live['implicit (default)']['backward']} (the default already); "
         f"backward prefetch alone gains {min(bwd_gains) * 100:.1f}% to {max(bwd_gains) * 100:.0f}% over the link "
         f"presets ({h100 * 100:.1f}% on H100 NVLink), at most {best['gains'][bwd] * 100:.0f}% where an all-gather "
         f"takes {best['ratio']:.2f} x a layer's forward (simulated); `set_modules_to_backward_prefetch([])` "
         + ("keeps the default order" if empty_is_default else "changes the order")),
    ]
    return ("| # | the posts say | verdict | measured here |\n|---|---|---|---|\n"
            + "\n".join(f"| {n} | {claim} | **{verdict}** | {number} |" for n, claim, verdict, number in rows))


# --- exercises ------------------------------------------------------------------------------------------

@exercise("02-bytes")
def _bytes(answer, *, measured: dict, param_bytes: int):
    """The bytes one rank sends per FULL_SHARD step (ring model) as a formula `answer(P, N)`, checked at every
    group size N the lesson measured (`measured`: N -> counted bytes) and, where it did not measure them, at
    N = 4 and 8 against the ring byte model the lesson's checks hold the counts to: with only N = 1 and 2
    measured, (N-1)/N cannot be told from (N-1)/2 or N(N-1)/4."""
    from ..network import step_sent_bytes

    hint = ("one all-gather of every unit in forward, one more in backward (FULL_SHARD frees them after forward), "
            "one reduce-scatter of the gradients; each moves (N-1)/N of the full fp32 tensor per rank.")
    if not callable(answer):
        return False, (f"expected a formula of P and N, such as lambda P, N: 2 * P, got {answer!r}: one number "
                       f"cannot be checked at every group size.")
    modelled = {n: step_sent_bytes("full_shard", param_bytes, n) for n in (4, 8) if n not in measured}
    cases = [(n, b, "the ranks sent") for n, b in sorted(measured.items())]
    cases += [(n, b, "the ring model (which the counts above match) gives") for n, b in modelled.items()]
    for n, expected, source in cases:
        try:
            value = float(answer(param_bytes, n))
        except Exception as err:  # noqa: BLE001 - the learner's code: say what it raised
            return False, f"your formula raised {type(err).__name__}: {err} at P={param_bytes}, N={n}."
        if not abs(value - expected) <= 0.01 * max(expected, 1.0):
            return False, f"at N={n} your formula gives {value:,.0f} B, {source} {expected:,.0f} B. Hint: {hint}"
    also = f", and the ring model at N = {', '.join(map(str, modelled))}" if modelled else ""
    return True, f"your formula matches the counted bytes at N = {', '.join(map(str, sorted(measured)))}{also}."


@exercise("02-live-blocks")
def _live_blocks(answer, *, measured: int, prefetch: int, num_layers: int):
    """Blocks unsharded at once at the forward peak with explicit prefetch `prefetch`, as re-measured."""
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not float(answer).is_integer():
        return False, f"expected a whole number of blocks, got {answer!r}."
    if int(answer) == measured:
        return True, f"{int(answer)} blocks, as the counter saw with prefetch={prefetch}."
    return False, (f"{answer} is {'too many' if answer > measured else 'too few'}. Hint: the block computing, plus "
                   f"the ones its forward prefetch list asked for, but never more than the {num_layers} blocks "
                   "there are.")


# --- the sharded data-parallel step, written by the learner -----------------------------------------------

def toy_loss(weight, batch):
    """The exercise's model and loss: one bias-free Linear (`weight` is out x in), mean of squared outputs."""
    return (batch @ weight.t()).pow(2).mean()


def compare_sharded_step(step_fn, dim: int = 8, batch_size: int = 4, seed: int = 0) -> dict:
    """On a rank: run the learner's `step_fn(shard, batch) -> gradient shard` and the same step under
    `fully_shard`, each inside a CommCounter. The weight has `dim x world_size` rows, so dim 0 splits evenly;
    each rank's batch differs. Returns this rank's relative gradient error and both byte counts (ring model)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from ..comms import CommCounter
    from ..ranks import device, mesh, this_rank, world_size

    n, r = world_size(), this_rank()
    # drawn on the CPU (the same numbers on any device), then on the rank's device, where fully_shard's
    # gradient will be: the learner's collectives then run on the backend a GPU rank has for them
    weight = torch.randn(dim * n, dim, generator=torch.Generator().manual_seed(seed)).to(device())
    batch = torch.randn(batch_size, dim, generator=torch.Generator().manual_seed(seed + 1 + r)).to(device())
    with CommCounter(fsdp_labels=False) as mine:
        got = step_fn(weight.chunk(n)[r].clone(), batch)
    linear = nn.Linear(dim, dim * n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    fully_shard(linear, mesh=mesh())
    with CommCounter(fsdp_labels=False) as ref:
        linear(batch).pow(2).mean().backward()
    expected = linear.weight.grad.to_local()
    out = {"rank": r, "sent": mine.total("sent_bytes"), "fsdp_sent": ref.total("sent_bytes"),
           "kinds": [c["kind"] for c in mine.records], "fsdp_kinds": [c["kind"] for c in ref.records],
           "shape": tuple(getattr(got, "shape", ())), "expected_shape": tuple(expected.shape)}
    if isinstance(got, torch.Tensor) and got.shape == expected.shape:
        out["rel_error"] = float((got.detach().to(expected.device) - expected).norm() / expected.norm())
    else:
        out["rel_error"] = float("inf")
    return out


@exercise("02-sharded-step")
def _sharded_step(answer, *, cluster, rel=1e-5):
    """The learner's all-gather / compute / reduce-scatter step against fully_shard: gradients and bytes."""
    if not callable(answer):
        return False, "expected a function step(shard, batch) that returns this rank's gradient shard."
    try:
        results = cluster.run(compare_sharded_step, answer)
    except Exception as e:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your step raised on the ranks: {str(e).strip().splitlines()[0]}"
    worst = max(results, key=lambda x: x["rel_error"])
    sent, fsdp = results[0]["sent"], results[0]["fsdp_sent"]
    if worst["shape"] == ():
        return False, ("your step returned no tensor: return this rank's rows of the averaged gradient "
                       "(the output of the reduce-scatter).")
    if worst["shape"] != worst["expected_shape"]:
        return False, (f"rank {worst['rank']} returned shape {worst['shape']}, fully_shard keeps "
                       f"{worst['expected_shape']}: return only this rank's rows of the gradient (a reduce-scatter).")
    if worst["rel_error"] > rel:
        return False, (f"rank {worst['rank']}'s gradient differs from fully_shard's by {worst['rel_error']:.1e} "
                       "(relative). Hint: fully_shard averages over ranks: divide the summed gradient by N.")
    if sent != fsdp:
        return False, (f"gradients match, but rank 0 sent {sent:,.0f} B with {results[0]['kinds']} where "
                       f"fully_shard sent {fsdp:,.0f} B with {results[0]['fsdp_kinds']}: one all-gather of "
                       "the weight, one reduce-scatter of its gradient.")
    return True, (f"gradients match fully_shard's on every rank (worst relative error {worst['rel_error']:.1e}) and "
                  f"rank 0 sent {sent:,.0f} B, as fully_shard did ({' + '.join(results[0]['fsdp_kinds'])}).")
