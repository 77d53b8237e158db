"""Lesson 03 (CPU offload) only: exact estimates of the posts' full fine-tune with and without CPU offload, the
verdicts of claim 7 computed from the lesson's numbers, and the lesson's exercise.
"""

from __future__ import annotations

from ..exercises import close, exercise
from ..settings import GIB
from .full_finetune import full_finetune_settings

# Labels of `exact_reports`, in order: the two settings of claim 15, then checkpointing with offload.
EXACT_LABELS = ("no checkpointing", "checkpointing", "checkpointing + offload")


def exact_settings() -> list:
    """Claim 15's two settings (full fine-tune of Qwen-7B, 8 ranks, the posts' precision and sequence length,
    without and with activation checkpointing) and the second with FSDP2's CPUOffloadPolicy."""
    plain, ckpt = full_finetune_settings()
    return [plain, ckpt, ckpt.replace(cpu_offload=True)]


def exact_reports(workers: int = 2, exact: bool = True) -> dict:
    """Per-GPU reports of `exact_settings()`, by EXACT_LABELS: exact (fake tensors, one pool of warm workers
    for all three; the first two are the reports `full_finetune.full_finetune_reports()` computes), or with
    exact=False the formula's (instant, approximate: for quick runs)."""
    if not exact:
        from ..formula import formula

        return {label: formula(s) for label, s in zip(EXACT_LABELS, exact_settings())}
    from ..sweep import estimate_all

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


def slowdown_verdict(low: float, high: float, claimed: float = 1.3) -> str:
    """'Offload costs ~30%', from the range of modelled slowdowns."""
    span = f"modelled slowdown {low:.1f}x to {high:.1f}x (posts: {claimed:g}x)"
    if high <= 1.15 * claimed:
        return f"RIGHT: {span}"
    if low <= 1.15 * claimed:
        return f"PARTLY: only the fastest GPU-CPU pairing comes near: {span}"
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
    """The learner's GiB per rank that offload keeps in host memory, against the exact estimate's."""
    return close(answer, measured, rel=0.05, unit=" GiB",
                 hint="offload keeps each rank's shard of the fp32 parameters, their fp32 gradients and AdamW's "
                      "two fp32 moments: bytes per parameter x parameters / ranks, then / 2**30.")
