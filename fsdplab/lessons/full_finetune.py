"""Claim 15 ("sharding is why a 7B model fits on 8 x A10"), settled once with the exact estimator so that
lessons 01, 03 and 06 state the same verdict, in GiB: a full fine-tune of Qwen-7B on 8 ranks, the posts'
sequence length and precision, with and without activation checkpointing, against the A10's 24 GiB.
"""

from __future__ import annotations

from ..settings import GIB
from .posts import A10_GIB, POSTS_SETTING



def full_finetune_settings() -> list:
    """The posts' setting without LoRA (every weight trained), without and with activation checkpointing."""
    return [POSTS_SETTING.replace(lora_rank=None, lora_alpha=None, activation_checkpointing=ckpt)
            for ckpt in (False, True)]


def full_finetune_reports(workers: int = 2) -> list:
    """Exact per-GPU reports (fake tensors) for full_finetune_settings(), in order: [no checkpointing, with]."""
    return start_full_finetune_reports(workers).result()


def start_full_finetune_reports(workers: int = 2):
    """full_finetune_reports() started in worker processes, returning at once (a lesson starts them before
    its live ranks and collects them later): `.result()` gives [no checkpointing, with]."""
    from ..memory.sweep import start_estimates

    return start_estimates(full_finetune_settings(), workers=workers)


def full_finetune_verdict(reports, gpu_gib: float = A10_GIB) -> str:
    """One sentence computed from the two reports ([no checkpointing, with]): does a full fine-tune fit, and
    how much of the card the resident model states (sharded parameters, gradients, Adam state) take."""
    plain, ckpt = (r.peak_bytes / GIB for r in reports)
    states = sum(reports[0].resident.values()) / GIB
    peaks = f"peak {plain:.1f} GiB without activation checkpointing, {ckpt:.1f} GiB with"
    share = f"the model states alone take {states:.1f} GiB ({states / gpu_gib:.0%} of the card)"
    if plain <= gpu_gib:
        return f"a full fine-tune of Qwen-7B on 8 ranks fits on a {gpu_gib:.2f} GiB card: {peaks}; {share}."
    if ckpt <= gpu_gib:
        return (f"a full fine-tune of Qwen-7B on 8 ranks fits on a {gpu_gib:.2f} GiB card only with activation "
                f"checkpointing, with {gpu_gib - ckpt:.1f} GiB to spare before the CUDA context and fragmentation: "
                f"{peaks}; {share}.")
    return (f"a full fine-tune of Qwen-7B on 8 ranks does not fit on a {gpu_gib:.2f} GiB card: {peaks}; {share}. "
            "LoRA, not sharding, is what makes it fit.")


def claim15_word(full_reports, gpu_gib: float = A10_GIB) -> str:
    """The verdict word of claim 15 ("the A10s are consumer GPUs, and sharding is why a 7B model fits") from the
    exact full fine-tune reports [no checkpointing, with]. The first half is wrong whatever is measured (the A10
    is a datacenter card), so the claim is at best "partly" right: when a sharded full fine-tune fits in some
    form; "wrong" when it does not fit even with checkpointing."""
    return "partly" if min(r.peak_bytes for r in full_reports) / GIB <= gpu_gib else "wrong"


def draw_full_finetune(ax, full_reports, lora_report=None, gpu_gib: float = A10_GIB):
    """Claim 15 in one picture: exact per-GPU peaks by category of a full fine-tune of Qwen-7B on 8 ranks
    without and with activation checkpointing (and the posts' LoRA run when given) against the card."""
    from ..display import draw_stacked

    labels = ["full fine-tune\nno checkpointing", "full fine-tune\ncheckpointing"]
    reports = list(full_reports)
    if lora_report is not None:
        labels.append("LoRA r=64\n(the posts)")
        reports.append(lora_report)
    bottoms = draw_stacked(ax, labels, reports, gpu_mem_gib=gpu_gib)
    for x, height in enumerate(bottoms):
        ax.text(x, height, f"{height:.1f}", ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_ylim(0, max(max(bottoms), gpu_gib) * 1.15)
    ax.set_title(f"Qwen-7B on 8 GPUs, exact per-GPU peak (GiB) against an A10's {gpu_gib:.2f} GiB", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return bottoms
