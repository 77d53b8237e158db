"""Lesson 03 (CPU offload) only: exact estimates of the posts' full fine-tune with and without CPU offload, the
modelled cost tables, figures and dashboard (of `fsdplab.lessons.offload`'s models), the verdicts of claim 7 computed
from the lesson's numbers, and the lesson's exercises: the host memory offload fills, and an offloaded setup written
by the learner and run on the live ranks.
"""

from __future__ import annotations

from .checkers import close, exercise
from .offload import GPUS, RESERVE_GIB, plan, step_time
from ..settings import GIB, MIB
from .full_finetune import full_finetune_settings

# Labels of `exact_reports`, in order: the two settings of claim 15, then checkpointing with offload.
EXACT_LABELS = ("no checkpointing", "checkpointing", "checkpointing + offload")


def exact_settings() -> list:
    """Claim 15's two settings (full fine-tune of Qwen-7B, 8 ranks, the posts' precision and sequence length,
    without and with activation checkpointing) and the second with FSDP2's CPUOffloadPolicy."""
    plain, ckpt = full_finetune_settings()
    return [plain, ckpt, ckpt.replace(cpu_offload=True)]


def settings_ahead() -> list:
    """What a run of several lessons estimates ahead for this lesson (fsdplab.runner.estimates_ahead): the setting with
    offload. The other two of `exact_settings()` are lesson 01's, which starts them with its imports."""
    return exact_settings()[2:]   # with offload; the other two are lesson 01's


def exact_reports(workers: int = 2, exact: bool = True) -> dict:
    """Per-GPU reports of `exact_settings()`, by EXACT_LABELS: exact (fake tensors, one pool of warm workers
    for all three; the first two are the reports `full_finetune.full_finetune_reports()` computes), or with
    exact=False the formula's (instant, approximate: for quick runs)."""
    if not exact:
        from ..memory.formula import formula

        return {label: formula(s) for label, s in zip(EXACT_LABELS, exact_settings())}
    from ..memory.sweep import estimate_all

    return dict(zip(EXACT_LABELS, estimate_all(exact_settings(), workers=workers)))


def host_bytes(reports: dict) -> int:
    """Bytes each rank keeps in host memory under offload: the resident sharded states the estimator took
    off the device tally (fp32 parameters, gradients, AdamW moments)."""
    return sum(reports["checkpointing + offload"].resident.values())


def draw_exact(ax, reports: dict, gpu_gib: float, source: str = "exact estimate"):
    """Stacked bars: the GPU peak of each report of `exact_reports`, and the host memory offload fills."""
    from types import SimpleNamespace

    from ..display import draw_stacked

    offload = reports["checkpointing + offload"]
    host = SimpleNamespace(by_category=dict(offload.resident))
    labels = ["GPU:\nno checkpointing", "GPU:\ncheckpointing", "GPU:\ncheckpointing\n+ offload", "host, pinned:\noffload"]
    heights = draw_stacked(ax, labels, [*reports.values(), host], gpu_gib)
    for x, height in zip(labels, heights):
        ax.annotate(f"{height:.1f}", (x, height), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(f"GiB per rank ({source})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return heights


# --- the modelled cost of offload and which option fits: tables, figures, dashboard -----------------------------

def draw_plan(fig, rows: dict, gpu_mem_gib: float, title: str = ""):
    """Two panels: per-rank GPU memory against the budget, and the modelled step time by part."""
    names = list(rows)
    ax_mem, ax_time = fig.subplots(1, 2)
    colors = ["tab:green" if rows[k]["fits"] else "tab:red" for k in names]
    ax_mem.bar(names, [rows[k]["gpu_bytes"] / GIB for k in names], color=colors)
    ax_mem.axhline(gpu_mem_gib - RESERVE_GIB, color="k", ls="--",
                   label=f"usable: {gpu_mem_gib:g} GiB - {RESERVE_GIB:g} GiB reserve")
    for i, k in enumerate(names):
        if k == "more GPUs":
            n = rows[k]["world_size"]
            ax_mem.annotate(f"N={n}" if n else "no N fits", (i, rows[k]["gpu_bytes"] / GIB), ha="center",
                            va="bottom", fontsize=8)
    ax_mem.set(ylabel="per-rank GPU memory (GiB)", title="fits? (green: yes)")
    ax_mem.legend(loc="upper right", fontsize=8)
    bottom = [0.0] * len(names)
    for part, color in (("compute", "tab:blue"), ("transfer", "tab:orange"), ("optimizer", "tab:purple")):
        vals = [rows[k]["step"][part] for k in names]
        ax_time.bar(names, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_time.set_xticks(range(len(names)), [k if rows[k]["fits"] else f"{k}\n(does not fit)" for k in names])
    ax_time.set(ylabel="modelled step time per rank (s)", title="step time by part (copies not overlapped)")
    ax_time.legend(fontsize=8)
    for ax in (ax_mem, ax_time):
        ax.tick_params(axis="x", labelsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return rows


def dashboard(gpu_mem_gib: float = 22.49, params_b: float = 7.0, world_size: int = 8, gpu_name: str = "A10",
              cpu_adam_seconds_per_param: float = 3e-9, seq_len: int = 2048):
    """Sliders (GPU memory, model size, world size, GPU type) -> which option fits and its modelled step time."""
    import ipywidgets as W

    from ..display import Dashboard

    controls = {
        # fine steps: a card's usable memory is not a round number (an A10 shows 22.49 GiB)
        "gpu_mem_gib": W.FloatSlider(value=gpu_mem_gib, min=8, max=144, step=0.01, readout_format=".2f",
                                     description="GPU GiB"),
        "params_b": W.FloatSlider(value=params_b, min=0.5, max=72, step=0.5, description="params (B)"),
        "world_size": W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=world_size, description="GPUs"),
        "gpu_name": W.Dropdown(options=list(GPUS), value=gpu_name, description="GPU speed"),
    }

    def draw(fig, gpu_mem_gib, params_b, world_size, gpu_name):
        rows = plan(gpu_mem_gib, params_b * 1e9, world_size, gpu_name,
                    cpu_adam_seconds_per_param=cpu_adam_seconds_per_param, seq_len=seq_len)
        fitting = [k for k, r in rows.items() if r["fits"]]
        return draw_plan(fig, rows, gpu_mem_gib,
                         title=f"{params_b:g}B params on {world_size} x {gpu_name}-speed GPUs with {gpu_mem_gib:.2f} GiB "
                               f"(fits: {', '.join(fitting) or 'none'})")

    return Dashboard(controls, draw, title="Offload, more GPUs or LoRA?", figsize=(10, 4))


def cost_table(num_params: float, world_size: int, cpu_adam_seconds_per_param: float, seq_len: int = 2048) -> dict:
    """Modelled step time with and without offload on each GPU of GPUS, and the slowdown factor."""
    out = {}
    for name in GPUS:
        base = step_time(num_params, world_size, name, cpu_adam_seconds_per_param=cpu_adam_seconds_per_param,
                         tokens_per_rank=seq_len)
        off = step_time(num_params, world_size, name, cpu_offload=True, tokens_per_rank=seq_len,
                        cpu_adam_seconds_per_param=cpu_adam_seconds_per_param)
        out[name] = {"no offload": base, "offload": off, "slowdown": off["total"] / base["total"],
                     "slowdown_overlapped": off["total_overlapped"] / base["total"]}
    return out


# "Offload costs about 30%": 30% less throughput is a step 1 / (1 - 0.3) = 1.43x as long.
CLAIMED_SLOWDOWN = 1 / (1 - 0.3)


def draw_cost(fig, tables: dict, num_params: float, world_size: int, speeds: dict,
              claimed_slowdown: float = CLAIMED_SLOWDOWN,
              seq_len: int = 2048, title: str = "", reported=(3, 10), marked: dict | None = None):
    """Left: stacked step-time bars per GPU, without offload and with offload at each CPU AdamW speed.
    Right: the slowdown as a function of the CPU AdamW speed, each speed of `speeds` marked on the curves,
    against the posts' 30% (a 1.43x step) and the `reported` range of pytorch#74588.

    `speeds`: label -> CPU AdamW seconds per parameter; `tables`: label -> cost_table(...) at that speed.
    `marked`: more speeds (label -> seconds per parameter) marked on the right panel only, each with a star
    on every curve, and the lowest of them labelled with its slowdown: the case a verdict may rest on."""
    import numpy as np

    ax_time, ax_ratio = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    gpus = list(next(iter(tables.values())))
    columns = []
    for name in gpus:
        columns += [(name, None)] + [(name, label) for label in speeds]
    short = {label: f"offload {i + 1}" for i, label in enumerate(speeds)}
    labels = [f"{name}\n{'no offload' if label is None else short[label]}" for name, label in columns]
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    first = next(iter(tables.values()))
    for part, color, legend in (("compute", "tab:blue", "compute (fwd+bwd+recompute)"),
                                ("transfer", "tab:orange", "host<->device copies"),
                                ("optimizer", "tab:purple", "AdamW step (GPU / CPU)")):
        vals = [first[name]["no offload"][part] if label is None else tables[label][name]["offload"][part]
                for name, label in columns]
        ax_time.bar(x, vals, bottom=bottom, color=color, label=legend)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_time.set_ylim(0, 1.35 * max(bottom))   # headroom: the legend sits above the tallest bar
    ax_time.set_xticks(x, labels, fontsize=7)
    ax_time.set(ylabel="modelled step time per rank (s)",
                title=f"{num_params / 1e9:.2f}B params, {world_size} ranks, {seq_len} tokens/rank")
    ax_time.legend(fontsize=8, title="; ".join(f"{short[k]}: {k}" for k in speeds), title_fontsize=7)
    marked = marked or {}
    lo, hi = min([*speeds.values(), *marked.values()]), max([*speeds.values(), *marked.values()])
    grid = np.unique(np.concatenate([np.logspace(np.log10(lo) - 1, np.log10(hi) + 0.5, 60), list(speeds.values())]))
    markers = ["o", "s", "^", "D"]
    colors = {}
    for name in gpus:
        base = first[name]["no offload"]["total"]
        ratio = [step_time(num_params, world_size, name, cpu_offload=True, cpu_adam_seconds_per_param=s,
                           tokens_per_rank=seq_len)["total"] / base for s in grid]
        line, = ax_ratio.plot(grid * 1e9, ratio, label=name)
        colors[name] = line.get_color()
        for marker, (label, spp) in zip(markers, speeds.items()):
            ax_ratio.plot([spp * 1e9], [tables[label][name]["slowdown"]], marker, color=line.get_color())
    for marker, (label, spp) in zip(markers, speeds.items()):
        ax_ratio.plot([], [], marker, color="gray", label=short[label])
        ax_ratio.axvline(spp * 1e9, color="gray", ls=":", lw=1)
    for label, spp in marked.items():
        ratios = {}
        for name in gpus:
            base = first[name]["no offload"]["total"]
            ratios[name] = step_time(num_params, world_size, name, cpu_offload=True, cpu_adam_seconds_per_param=spp,
                                     tokens_per_rank=seq_len)["total"] / base
            ax_ratio.plot([spp * 1e9], [ratios[name]], "*", markersize=11, color=colors[name])
        ax_ratio.plot([], [], "*", markersize=11, color="gray", label=label)
        best = min(ratios, key=ratios.get)
        ax_ratio.annotate(f"{best}: {ratios[best]:.2f}x", (spp * 1e9, ratios[best]), xytext=(8, -12),
                          textcoords="offset points", fontsize=7)
    ax_ratio.axhline(claimed_slowdown, color="k", ls="--", label=f"posts: -30% throughput = {claimed_slowdown:.2f}x")
    ax_ratio.axhspan(*reported, color="tab:red", alpha=0.12, label=f"reported {reported[0]:g}-{reported[1]:g}x "
                                                                   "(pytorch#74588)")
    ax_ratio.set(xscale="log", yscale="log", xlabel="CPU AdamW time per parameter (ns)",
                 ylabel="step time with offload / without (x)", title="slowdown vs host CPU speed")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    # plain numbers on the log axes (1x, 2x, 5x; 0.1, 1), not mantissa-exponent labels
    ax_ratio.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax_ratio.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    for axis in (ax_ratio.xaxis, ax_ratio.yaxis):
        axis.set_minor_formatter(NullFormatter())
    for axis, limits in ((ax_ratio.yaxis, ax_ratio.get_ylim()), (ax_ratio.xaxis, ax_ratio.get_xlim())):
        axis.set_ticks([v for v in (0.1, 0.2, 0.5, 1, 1.5, 2, 3, 5, 10, 20, 50) if limits[0] <= v <= limits[1]])
    # below the panel: inside it, the legend covers the fastest GPU's curve
    ax_ratio.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return tables


# --- claim 7's verdicts, as functions of the lesson's numbers ----------------------------------------------------

def link_verdict(ratios: dict, claimed: float = 10.0) -> str:
    """'PCIe is ~1/10 of GPU memory bandwidth', from memory/link ratios (GPU name -> ratio)."""
    listed = ", ".join(f"{name} 1/{r:.0f}" for name, r in ratios.items())
    if all(r <= 1.25 * claimed for r in ratios.values()):
        return f"RIGHT: host link / GPU memory bandwidth is {listed}"
    if all(r > 1.25 * claimed for r in ratios.values()):
        return f"WRONG: the host link is further behind than 1/{claimed:g}: {listed}"
    return f"PARTLY: {listed}"


def slowdown_range(tables: dict) -> tuple:
    """(lowest, highest) modelled slowdown over every GPU and CPU speed: `tables` is label -> cost_table."""
    values = [row["slowdown"] for table in tables.values() for row in table.values()]
    return min(values), max(values)


def lowest_case(tables: dict) -> tuple:
    """(slowdown, GPU name, CPU speed label) of the cheapest case: `tables` is label -> cost_table."""
    return min((row["slowdown"], name, label) for label, table in tables.items() for name, row in table.items())


def slowdown_verdict(low: float, high: float, claimed: float = CLAIMED_SLOWDOWN, near: str = "") -> str:
    """'Offload costs ~30%' (30% less throughput: a 1.43x step), from the range of modelled slowdowns.
    `near` names the case that gives `low` (lowest_case), for the PARTLY wording."""
    span = f"modelled slowdown {low:.2f}x to {high:.1f}x (posts: 30% less throughput = {claimed:.2f}x)"
    if high <= 1.15 * claimed:
        return f"RIGHT: {span}"
    if low <= 1.15 * claimed:
        return f"PARTLY: only {near or 'the cheapest case modelled'} comes near: {span}"
    return f"WRONG: {span}"


def fsdp_offload_options() -> dict:
    """Every offload option torch.distributed.fsdp exports, with the fields it takes: what an FSDP user can
    offload to, read from the installed torch."""
    import dataclasses

    import torch.distributed.fsdp as fsdp

    options = {}
    for name in dir(fsdp):
        obj = getattr(fsdp, name)
        if "offload" in name.lower() and isinstance(obj, type):
            options[name] = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    return options


def has_disk_tier(options: dict) -> bool:
    """Whether any offload option names a tier below host memory (NVMe, disk, a path or a file)."""
    words = ("nvme", "disk", "path", "file", "swap")
    return any(w in text.lower() for name, fields in options.items() for text in [name, *fields] for w in words)


def nvme_verdict(options: dict) -> str:
    listed = "; ".join(f"{name}({', '.join(fields)})" for name, fields in options.items())
    if has_disk_tier(options):
        return f"RIGHT: FSDP can offload below host memory: {listed}"
    return (f"WRONG for FSDP: its offload options stop at host memory ({listed}); NVMe offload is DeepSpeed "
            "ZeRO-Infinity")


def claim15_label(reports: dict, gpu_gib: float) -> str:
    """Claim 15 ("sharding is why a 7B model fits on 8 x A10") in one word, from the exact peaks."""
    plain, ckpt = reports["no checkpointing"].peak_bytes / GIB, reports["checkpointing"].peak_bytes / GIB
    return "RIGHT" if plain <= gpu_gib else "PARTLY" if ckpt <= gpu_gib else "WRONG"


def markdown_table(verdicts: dict) -> str:
    """claim -> "LABEL: evidence" as a Markdown table with the label in bold."""
    rows = []
    for claim, text in verdicts.items():
        label, _, evidence = text.partition(": ")
        rows.append(f"| {claim} | **{label}** | {evidence} |")
    return "| claim | verdict | evidence |\n|---|---|---|\n" + "\n".join(rows)


# --- exercise -----------------------------------------------------------------------------------------------

@exercise("03-host-gib")
def _host_gib(answer, *, measured):
    """The learner's GiB per rank that offload keeps in host memory, against the value the lesson recomputed."""
    return close(answer, measured, rel=0.05, unit=" GiB",
                 hint="offload keeps each rank's shard of the fp32 parameters, their fp32 gradients and AdamW's "
                      "two fp32 moments: bytes per parameter x parameters / ranks, then / 2**30.")


# --- the offloaded setup, written by the learner -----------------------------------------------------------

def _first_line(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _owners(names) -> list:
    """The modules that own parameters `names`, in order: "embed.weight", "norm.bias" -> ["embed", "norm"]."""
    return list(dict.fromkeys(name.rpartition(".")[0] or name for name in names))


def _listed(names: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


def _unit_list(units) -> str:
    """Units by name, the root said as such: 'blocks.0, blocks.1 and the root'."""
    return _listed(["the root" if unit == "root" else unit for unit in units])


def offload_units(model) -> list:
    """Each FSDP unit of `model` as FSDP2 itself records it: its module path ("root" for the model), its offload
    policy's class ("none given" where fully_shard got none), whether its parameters offload to the host and
    whether that host memory is pinned (each parameter's `offload_to_cpu` and `pin_memory` in FSDP2's state), and
    the modules whose parameters it holds."""
    import inspect

    from torch.distributed.fsdp import FSDPModule, fully_shard

    from .._torch_private import fsdp_param_groups

    default = inspect.signature(fully_shard).parameters["offload_policy"].default
    names = {id(p): name for name, p in model.named_parameters()}
    units = []
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = fsdp_param_groups(module)
        params = [fp for group in groups for fp in group.fsdp_params]
        policies = sorted({"none given" if group.offload_policy is default else type(group.offload_policy).__name__
                           for group in groups})
        units.append({"unit": path or "root", "policy": ", ".join(policies) or "none given",
                      "offload": bool(params) and all(fp.offload_to_cpu for fp in params),
                      "pinned": bool(params) and all(fp.pin_memory for fp in params),
                      "owners": _owners(names.get(id(fp.sharded_param), "?") for fp in params)})
    return units


def _local(param):
    """A parameter's (or gradient's, or state's) tensor on this rank: its shard when it is a DTensor."""
    return param.to_local() if hasattr(param, "to_local") else param


def _one_step(model, opt, batch) -> dict:
    """One training step (`sharding.train_step`): the loss, each parameter's change on this rank, where the shards,
    their gradients and the optimizer state live (device types), and on a GPU the peak GPU bytes of the step."""
    import torch

    from ..ranks import device
    from ..sharding import train_step

    dev = device()
    params = dict(model.named_parameters())
    before = {name: _local(p).detach().cpu().clone() for name, p in params.items()}
    where = {}

    def after_backward():
        where["gradients"] = sorted({_local(p.grad).device.type for p in params.values() if p.grad is not None})

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    loss = train_step(model, opt, batch, after_backward=after_backward)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    where["parameters"] = sorted({_local(p).device.type for p in params.values()})
    where["optimizer state"] = sorted({_local(t).device.type for state in opt.state.values()
                                       for key, t in state.items() if key != "step" and hasattr(t, "device")})
    changes = {name: _local(p).detach().cpu() - before[name] for name, p in params.items()}
    return {"loss": float(loss), "changes": changes, "where": where, "peak": peak}


def compare_offload(setup_fn, num_blocks: int = 3, batch_size: int = 2, seq_len: int = 8, seed: int = 0,
                    lr: float = 1e-3) -> dict:
    """On a rank: lesson 01's MLPStack sharded per block and root WITHOUT offload, AdamW(lr) built after sharding,
    one step (the reference); then a fresh one through the learner's `setup_fn(model, mesh) -> optimizer` and one
    step with that optimizer. Returns FSDP2's record of each of the learner's units (`offload_units`), the
    parameters left plain, the parameters the optimizer does not hold, both losses, the relative gap between the
    two steps' parameter changes, the parameters the learner's step left as they were, and where each step's
    tensors lived with its peak GPU bytes (a GPU rank only)."""
    import gc
    import weakref

    import torch
    from torch.distributed.tensor import DTensor

    from ..ranks import device, mesh, this_rank, world_size
    from ..sharding import apply_fsdp
    from .sharding_math import build_mlp_stack

    n, r, dev = world_size(), this_rank(), device()
    ref_model = build_mlp_stack(num_blocks, seed, dev)
    gen = torch.Generator().manual_seed(seed + 1 + r)     # this rank's batch, drawn on the CPU: the same on any device
    tokens = torch.randint(0, ref_model.embed.num_embeddings, (batch_size, seq_len + 1), generator=gen)
    batch = (tokens[:, :-1].to(dev), tokens[:, 1:].to(dev))
    apply_fsdp(ref_model, mesh(), blocks=list(ref_model.blocks))
    ref = _one_step(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=lr), batch)
    del ref_model
    gc.collect()
    out = {"rank": r, "world_size": n, "device": dev.type, "blocks": [f"blocks.{i}" for i in range(num_blocks)],
           "ref_loss": ref["loss"], "ref_peak": ref["peak"]}
    model = build_mlp_stack(num_blocks, seed, dev)
    # weak references: an optimizer built before sharding keeps these alive; nothing else should (on a GPU they
    # would add to the step's peak)
    before = [weakref.ref(p) for p in model.parameters()]
    try:
        opt = setup_fn(model, mesh())
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        out["error"] = _first_line(err)
        return out
    out["units"] = offload_units(model)
    out["plain"] = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    out["returned"] = "None" if opt is None else type(opt).__name__
    out["optimizer"] = isinstance(opt, torch.optim.Optimizer)
    if out["plain"] or not out["optimizer"]:
        return out
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    params = list(model.named_parameters())
    out["params"] = len(params)
    out["not_held"] = [name for name, p in params if id(p) not in held]
    out["stale"] = [name for (name, _), old in zip(params, before) if old() is not None and id(old()) in held
                    and name in out["not_held"]]
    try:
        mine = _one_step(model, opt, batch)
    except Exception as err:  # noqa: BLE001 - the learner's optimizer is the answer to show
        out["run_error"] = _first_line(err)
        return out
    diff = sum(float((mine["changes"][k] - c).pow(2).sum()) for k, c in ref["changes"].items())
    norm = sum(float(c.pow(2).sum()) for c in ref["changes"].values()) or 1.0
    out.update(loss=mine["loss"], where=mine["where"], peak=mine["peak"], gap=(diff / norm) ** 0.5,
               unchanged=[k for k, c in mine["changes"].items() if not c.any() and ref["changes"][k].any()])
    return out


def _kept_text(kept: list, units: dict, blocks: list) -> str:
    """What stays on the device when the units `kept` do not offload, said by which units they are."""
    if kept == ["root"]:
        return (f"the {len(blocks)} blocks offload, but the root does not: {_listed(units['root']['owners'])} keep "
                "their shards, gradients and AdamW state on the device. Each fully_shard call takes its own policy.")
    if sorted(kept) == sorted(blocks):
        return (f"only the root offloads ({_listed(units['root']['owners'])}): the {len(blocks)} blocks, most of the "
                "model, keep their shards, gradients and AdamW state on the device. Each fully_shard call takes its "
                "own policy.")
    return (f"{len(kept)} of {len(units)} units do not offload ({_unit_list(kept)}): they keep their shards, gradients "
            "and AdamW state on the device. Each fully_shard call takes its own policy.")


@exercise("03-offload-setup")
def _offload_setup(answer, *, cluster):
    """The learner's `setup(model, mesh) -> optimizer` on the live ranks: FSDP2's record of each unit's offload,
    the optimizer it returns, and one step against the same model sharded without offload."""
    if not callable(answer):
        return False, ("expected a function setup(model, mesh) that shards the model with offload and returns its "
                       f"optimizer, got {answer!r}.")
    if not cluster.running:
        return False, "the ranks are stopped (the lesson stops them at its end): run cluster.start(), then this cell."
    if cluster.broken:
        return False, f"the ranks cannot run it ({cluster.broken.splitlines()[0]}): run cluster.restart(), then this cell."
    try:
        results = cluster.run(compare_offload, answer)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your setup raised on the ranks: {str(err).strip().splitlines()[0]}"
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    n, blocks, gpu = out["world_size"], out["blocks"], out["device"] == "cuda"
    if "error" in out:
        if "accelerator" in out["error"]:        # pinning host memory for a copy to a device the rank does not have
            return False, (f"your setup raised on the ranks: {out['error']} Pinned host memory serves copies to a "
                           "GPU, and these ranks have none: pin only where a GPU is.")
        return False, f"your setup raised on the ranks: {out['error']}"
    units = {u["unit"]: u for u in sorted(out["units"], key=lambda u: u["unit"] == "root")}   # the root last
    if not units:
        return False, "nothing was sharded: every parameter is still a plain tensor, whole on every rank."
    if "root" not in units:
        return False, (f"the root was not wrapped: {_listed(_owners(out['plain']))} stay plain tensors, whole on "
                       "every rank and never offloaded.")
    missing = [b for b in blocks if b not in units]
    if missing:
        return False, (f"{_listed(missing)} {'is not an FSDP unit' if len(missing) == 1 else 'are not FSDP units'} of "
                       "their own: the root's unit holds their parameters and gathers them all at once. Shard each "
                       "block, then the root.")
    if out["plain"]:
        return False, f"{_listed(out['plain'])} stayed plain tensors, whole on every rank and never offloaded."
    kept = [name for name, u in units.items() if not u["offload"]]
    if len(kept) == len(units):
        policies = {u["policy"] for u in units.values()}
        if policies == {"none given"}:
            return False, (f"no unit offloads: none of the {len(units)} fully_shard calls ({_unit_list(units)}) "
                           "got an offload policy, so FSDP2 keeps every unit's shards, gradients and AdamW state on "
                           "the rank's device.")
        if policies <= {"none given", "OffloadPolicy"}:
            return False, ("no unit offloads: OffloadPolicy is the base class, fully_shard's default, and means "
                           "'offload nothing'; its subclass for host memory is the one that moves shards, gradients "
                           "and AdamW state off the device.")
        return False, f"no unit offloads: FSDP2 offloads none of them under {_listed(sorted(policies))}."
    if kept:
        return False, _kept_text(kept, units, blocks)
    unpinned = [name for name, u in units.items() if not u["pinned"]]
    if gpu and unpinned:
        which = "to" if len(unpinned) == len(units) else f"{_unit_list(unpinned)} to"
        return False, (f"every unit offloads, but {which} unpinned host memory: each copy to the GPU then waits on "
                       "the CPU and cannot overlap compute. On a GPU rank, pin the host memory.")
    if not out["optimizer"]:
        return False, (f"every unit offloads, but your setup returns {out['returned']}, not an optimizer: return the "
                       "AdamW that trains the sharded model (the checker steps it once).")
    if "run_error" in out:
        return False, f"the step with your optimizer raised on rank {out['rank']}: {out['run_error']}"
    stale, missing = out["stale"], [name for name in out["not_held"] if name not in out["stale"]]
    if stale:
        left = [name for name in stale if name in out["unchanged"]]
        whose = "every shard" if len(left) == out["params"] else f"the shards of {_listed(_owners(left))}"
        held = f"all {len(stale)}" if len(stale) == out["params"] else f"{len(stale)} of the {out['params']}"
        return False, ((f"the step left {whose} as it was: " if left else "") + "your optimizer holds the model's "
                       f"parameters as they were before fully_shard replaced them with shards ({held}), and steps "
                       "those.")
    if missing:
        return False, (f"your optimizer does not hold the parameters of {_listed(_owners(missing))}: the step left "
                       "their shards as they were.")
    tolerance = 1e-4 if gpu else 1e-5        # fp32 on GPUs: AdamW on the host rounds otherwise than on the GPU
    worst = max(results, key=lambda x: abs(x["loss"] - x["ref_loss"]))
    if abs(worst["loss"] - worst["ref_loss"]) > tolerance * max(1.0, abs(worst["ref_loss"])):
        return False, (f"rank {worst['rank']}'s loss is {worst['loss']:.6f}, the un-offloaded reference's "
                       f"{worst['ref_loss']:.6f}: offload must leave what the model computes as it is (its values "
                       "and precision).")
    worst = max(results, key=lambda x: x["gap"])
    gap = worst["gap"]
    if gap > tolerance:
        return False, (f"the losses match, but rank {worst['rank']}'s step changed the shards otherwise than the "
                       f"reference's AdamW with lr=1e-3 over every parameter (relative gap {gap:.1e}): "
                       "return that optimizer.")
    if gpu:
        for what in ("parameters", "gradients", "optimizer state"):
            placed = next((x for x in results if x["where"].get(what) != ["cpu"]), None)
            if placed:
                return False, (f"every unit offloads by FSDP2's record, but rank {placed['rank']}'s sharded {what} "
                               f"lived on {', '.join(placed['where'].get(what) or ['no device'])}, not the CPU.")
        worst = max(results, key=lambda x: x["peak"] / x["ref_peak"])
        if worst["peak"] >= worst["ref_peak"]:
            return False, (f"every unit offloads, but rank {worst['rank']}'s step peaked at {worst['peak'] / MIB:.2f} "
                           f"MiB of GPU memory, the un-offloaded reference's at {worst['ref_peak'] / MIB:.2f} MiB: "
                           "offload should lower it.")
    record = (f"the {len(blocks)} blocks and the root offload by FSDP2's own record of each unit (shards, gradients "
              "and AdamW state to host memory)")
    ranks = (f"on every rank (worst relative gap {gap:.1e})" if n > 1 else
             f"(relative gap {gap:.1e}; on 1 rank each shard is the whole parameter)")
    match = f"one step's loss and updated shards match the un-offloaded reference's {ranks}"
    if gpu:
        best = results[0]
        return True, (f"{record}; rank 0's shards, gradients and AdamW state lived on the CPU and its step peaked at "
                      f"{best['peak'] / MIB:.2f} MiB of GPU memory, {best['ref_peak'] / MIB:.2f} MiB without "
                      f"offload; {match}.")
    return True, (f"{record}, and {match}. On CPU ranks the shards are in host memory with or without offload: "
                  "that it takes them off the GPU, and the GPU memory it saves, only a GPU rank shows.")
