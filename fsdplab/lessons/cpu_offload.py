"""Lesson 03 (CPU offload) only: exact estimates of the posts' full fine-tune with and without CPU offload, the
modelled cost tables, figures and dashboard (of `fsdplab.lessons.offload`'s models), the verdicts of claim 7 computed
from the lesson's numbers, the plumbing of section 5 (clip_grad_norm_ with offload) and the lesson's exercises on
the host memory offload fills and on the group a clip with offload needs (its code exercise is in `offload_setup`).
"""

from __future__ import annotations

from .checkers import close, exercise, first_line, ranks_not_ready
from .offload import GPUS, plan, step_time
from .posts import CARD_RESERVE_GIB, usable_gib
from ..settings import GIB
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


def loss_temporaries_line(other_bytes: int, seq_len: int, batch_size: int, vocab_size: int) -> str:
    """The 'other' category that offload leaves on the GPU, counted in fp32 buffers the size of the logits
    (`batch_size` x `seq_len` tokens x `vocab_size` words x 4 B): the loss's temporaries."""
    logits = batch_size * seq_len * vocab_size * 4
    return (f"'other' on the GPU with offload: {other_bytes / GIB:.2f} GiB = {other_bytes / logits:.1f} x the fp32 "
            f"logits ({batch_size} x {seq_len} tokens x {vocab_size:,} words x 4 B = {logits / GIB:.2f} GiB): the "
            "loss's temporaries, which offload cannot move")


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
    labels = ["GPU:\nno checkpointing", "GPU:\ncheckpointing", "GPU:\ncheckpointing\n+ offload",
              "host, pinned:\noffload"]
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
    ax_mem.axhline(usable_gib(gpu_mem_gib), color="k", ls="--",
                   label=f"usable: {gpu_mem_gib:g} GiB - {CARD_RESERVE_GIB:g} GiB reserve")
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
                         title=f"{params_b:g}B params on {world_size} x {gpu_name}-speed GPUs with "
                               f"{gpu_mem_gib:.2f} GiB (fits: {', '.join(fitting) or 'none'})")

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
    # 1.5 on the slowdown axis only (the posts' 1.43x sits there): on the ns axis it would crowd 2
    for axis, limits, ticks in ((ax_ratio.yaxis, ax_ratio.get_ylim(), (1, 1.5, 2, 3, 5, 10, 20, 50)),
                                (ax_ratio.xaxis, ax_ratio.get_xlim(), (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50))):
        axis.set_ticks([v for v in ticks if limits[0] <= v <= limits[1]])
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


# --- section 5: clip_grad_norm_ with offload, and exercise 6 -------------------------------------------------------

def placed(dtensor) -> str:
    """Where a DTensor lives, in words: 'DTensor, local shard on cpu, placements (Shard(dim=0),)'."""
    return f"DTensor, local shard on {dtensor.to_local().device.type}, placements {tuple(dtensor.placements)}"


def grads_on(model, mesh) -> list:
    """A sharded `model`'s parameters as DTensors of `mesh`, each with its gradient: the same local shards (no copy),
    so `clip_grad_norm_` on them scales the model's gradients with its all-reduce in `mesh`'s group. `mesh` must
    have the shards' device type: `DTensor.from_local` moves a local tensor to its mesh's device."""
    from torch.distributed.tensor import DTensor

    def view(t):
        return DTensor.from_local(t.to_local(), mesh, t.placements, shape=t.shape, stride=t.stride())

    views = [view(param.detach()) for param in model.parameters()]
    for shard, param in zip(views, model.parameters()):
        shard.grad = view(param.grad)
    return views


def clip_sentence(where: dict, norm_gap: float, collectives: list, clip_over_step: float, error) -> str:
    """Section 5's numbers in one Markdown sentence, for the end of the lesson."""
    sent = sum(c["sent_bytes"] for c in collectives)
    kinds = ", ".join(sorted({c["kind"].replace("_", "-") for c in collectives})) or "no collective"
    said = error.split(": ", 1)[-1].rsplit("  (", 1)[0] if error else ""    # the exception, without ranks and cell
    failed = f"in a group without a CPU backend it failed: `{said}`" if error else "without a CPU backend it passed"
    return (f"**Clipping with offload (section 5):** the gradient was a {where['gradient']}; the total norm matched "
            f"the norm without offload to {norm_gap:.1e}; the clip sent {sent:.0f} B per rank ({kinds}) and took "
            f"{clip_over_step:.2f}x the time of the AdamW step; {failed}.")


def device_backends(text: str) -> dict:
    """Device type -> backend, as `init_process_group(backend=text)` serves them ('nccl': cuda only). ValueError in
    one line naming no right answer (torch's own message names one) for a string torch would refuse or misread."""
    import torch.distributed as dist

    capability, text = dist.Backend.backend_capability, text.strip().lower()
    known = ", ".join(sorted(capability))
    if ":" not in text:
        if text not in capability:
            raise ValueError(f"{text!r} is neither a backend torch knows ({known}) nor 'device:backend' pairs.")
        return {device: text for device in capability[text]}
    served = {}
    for part in text.split(","):
        device, _, backend = (word.strip() for word in part.partition(":"))
        if not device or not backend or ":" in backend:
            raise ValueError(f"{part.strip()!r} is not a 'device:backend' pair (pairs are joined by commas).")
        if device not in ("cpu", "cuda") or backend not in capability or device in served:
            raise ValueError(f"{part.strip()!r}: " + (
                "name the devices 'cpu' and 'cuda'" if device not in ("cpu", "cuda")
                else f"torch knows the backends {known}" if backend not in capability
                else f"{device} is named twice, and a group has one backend per device type") + ".")
        served[device] = backend
    return served


def clip_in_group(served: dict, max_norm: float = 0.5, seed: int = 0) -> dict:
    """On a rank: the tiny transformer sharded with CPU offload in the lab's group, one backward, its global norm,
    then `clip_grad_norm_` with its all-reduce in a new group serving each device as `served` says (gloo stands in
    for nccl where NCCL is not built): the clipped norm and the bytes sent, or the error and if the group was made."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from ..comms import CommCounter
    from ..models import TinyConfig, random_batch
    from ..ranks import device, mesh, this_rank
    from ..sharding import build_tiny, loss_of

    stand_in = {"nccl": "nccl" if dist.is_nccl_available() else "gloo"}
    cfg, policy = TinyConfig(), CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    model = build_tiny(cfg, seed=seed, device=device())
    for block in [*model.layers, model]:
        fully_shard(block, mesh=mesh(), offload_policy=policy)
    loss_of(model, random_batch(cfg, 2, seed=seed + 1 + this_rank(), device=device())).backward()
    out = {"rank": this_rank(),
           "lab_norm": torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()}
    group = None
    try:   # every rank makes every group, in the same order; it stays (destroying one prints c10d warnings)
        group = dist.new_group(backend=",".join(f"{d}:{stand_in.get(b, b)}" for d, b in served.items()))
        # a mesh name of its own: DTensor caches by mesh, and meshes over the same ranks are equal whatever the group
        clip_mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"clip_{group.group_name}",))
        with CommCounter(fsdp_labels=False) as comms:
            out["norm"] = torch.nn.utils.clip_grad_norm_(grads_on(model, clip_mesh), max_norm).full_tensor().item()
        out["bytes"] = comms.total("sent_bytes")
    except (RuntimeError, ValueError, AssertionError) as err:   # torch's refusal: the learner's answer to show
        out.update(error=first_line(err), made=group is not None)
    return out


@exercise("03-clip-backend")
def _clip_backend(answer, *, cluster):
    """The learner's `init_process_group` backend for GPU ranks that offload and clip: made on the live ranks, an
    offloaded model's gradients clipped in it against the global norm, and what it would serve CUDA tensors with."""
    import torch.distributed as dist

    if not isinstance(answer, str):
        return False, f"expected the backend string init_process_group takes, got {answer!r}."
    try:
        served = device_backends(answer)
    except ValueError as err:
        return False, str(err)
    capability = dist.Backend.backend_capability
    unable = [f"{name} cannot move {dev.upper()} tensors (torch lists it for {', '.join(capability[name])} only)"
              for dev, name in served.items() if dev not in capability[name]]
    if unable:
        return False, "; ".join(unable) + "."
    if (not_ready := ranks_not_ready(cluster, "at its end")) is not None:
        return False, not_ready
    try:
        results = cluster.run(clip_in_group, served)
    except Exception as err:  # noqa: BLE001 - the learner's group is the answer to show
        return False, f"your group raised on the ranks: {first_line(err)}"
    failed = next((r for r in results if "error" in r), None)
    if failed:
        if not failed["made"]:
            return False, f"torch could not make your group on rank {failed['rank']}: {failed['error']}"
        return False, (f"clip_grad_norm_ failed on rank {failed['rank']} ({failed['error']})" + (
            ": your group has no backend for CPU tensors, and with offload the gradient shards, their norm and its "
            "all-reduce are on the CPU." if "cpu" not in served else "."))
    if "cpu" not in served:             # one rank all-reduces nothing, so nothing failed
        return False, ("your group has no backend for CPU tensors: with offload the gradient shards, their norm and "
                       "its all-reduce are on the CPU, and on more than one rank the clip fails.")
    worst = max(results, key=lambda r: abs(r["norm"] - r["lab_norm"]))
    if abs(worst["norm"] - worst["lab_norm"]) > 1e-6 * max(1.0, worst["lab_norm"]):
        return False, f"rank {worst['rank']} clipped by {worst['norm']:.6f}, not the global {worst['lab_norm']:.6f}."
    if "cuda" not in served:
        return False, ("the clip ran, its all-reduce on the CPU, but your group has no backend for CUDA tensors: on "
                       "GPU ranks FSDP's all-gathers and reduce-scatters would fail ('No backend type associated with "
                       "device type cuda').")
    if served["cuda"] != "nccl":
        return False, (f"the clip ran, but {served['cuda']} would also carry FSDP's all-gathers and reduce-scatters of "
                       "CUDA tensors on GPU ranks, NCCL's work (torch's backend table lists gloo on GPUs for "
                       "broadcast and all-reduce only).")
    stood_in = "" if dist.is_nccl_available() else " (gloo stood in for nccl on these GPU-less ranks)"
    return True, (f"the group serves CPU tensors with {served['cpu']} and CUDA tensors with nccl{stood_in}: "
                  f"clip_grad_norm_ all-reduced the offloaded gradients' norm on the CPU ({results[0]['bytes']:.0f} B "
                  f"sent per rank) and every rank clipped by the global norm, {results[0]['lab_norm']:.4f}.")
