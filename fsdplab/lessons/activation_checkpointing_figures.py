"""Lesson 08's printed tables, figures and verdict table: section 1's FLOPs, section 2's saved bytes, section 5's
verdicts. The numbers come from the notebook's cells; these functions only show them."""

from __future__ import annotations

import numpy as np

from ..display import COLORS
from ..settings import GIB, MIB


def print_flops(full, lora, block_ratio, lora_block_ratio, step_ratio, *, seq_len: int, layers: int,
                lora_rank: int) -> None:
    """Section 1's lines: a deep block's FLOPs, then each mode's ratio per block and per whole step."""
    plain, lora_plain = full["none"], lora["none"]
    print(f"\na deep block, seq {seq_len}: forward {plain['block_forward'][-1] / 1e12:.3f} TFLOP, backward "
          f"{plain['block_backward'][-1] / 1e12:.3f} TFLOP = "
          f"{plain['block_backward'][-1] / plain['block_forward'][-1]:.2f} x forward")
    for mode in full:
        print(f"  full fine-tune, {mode:5s}: block x{block_ratio[mode]:.3f}   whole step at {layers} blocks "
              f"x{step_ratio[('full', mode)]:.3f} ({step_ratio[('full', mode)] - 1:+.1%})")
    print(f"  LoRA r={lora_rank}, torch: block x{lora_block_ratio:.3f}   whole step "
          f"x{step_ratio[('LoRA', 'torch')]:.3f} ({step_ratio[('LoRA', 'torch')] - 1:+.1%}); a deep LoRA "
          f"block's backward is {lora_plain['block_backward'][-1] / lora_plain['block_forward'][-1]:.2f} x its "
          f"forward, the first block's {lora_plain['block_backward'][0] / lora_plain['block_forward'][0]:.2f} x")


def plot_recompute_flops(at_depth, step_ratio, *, seq_len: int, layers: int):
    """Section 1's figure: FLOPs of a whole step, forward, backward and recomputation, per mode; returns it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    bars = [("full", "none"), ("full", "torch"), ("full", "posts"), ("LoRA", "none"), ("LoRA", "torch")]
    labels = [f"{kind}\n{mode}" for kind, mode in bars]
    forward = np.array([at_depth[b]["forward"] for b in bars]) / 1e12
    backward = np.array([at_depth[(b[0], "none")]["backward"] for b in bars]) / 1e12
    recompute = np.array([at_depth[b]["backward"] - at_depth[(b[0], "none")]["backward"] for b in bars]) / 1e12
    ax.bar(labels, forward, color=COLORS["parameters"], label="forward")
    ax.bar(labels, backward, bottom=forward, color=COLORS["gradients"], label="backward")
    ax.bar(labels, recompute, bottom=forward + backward, color=COLORS["activations"], label="recomputation")
    for x, b in enumerate(bars):
        top = forward[x] + backward[x] + recompute[x]
        ax.text(x, top, f"x{step_ratio[b]:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.15 * max(forward + backward + recompute))
    ax.set(ylabel="TFLOP per step", title=f"Qwen-7B, one sequence of {seq_len} tokens: FLOPs of a training step "
           f"by checkpointing mode\n(counted by FlopCounterMode on two blocks, the deep one scaled to "
           f"{layers - 1}; x: over no checkpointing)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def print_saved(saved: dict, unit: int, *, seq_len: int, batch_size: int, hidden: int) -> None:
    """Section 2's table: the bytes each mode keeps for backward, by region, in units of one hidden state."""
    print(f"saved for backward, in units of s*b*h*4 = {unit / MIB:.3f} MiB (seq {seq_len}, batch {batch_size}, "
          f"hidden {hidden}):")
    print(f"{'region':12s}" + "".join(f"{mode:>10s}" for mode in saved))
    for region in saved["none"]["regions"]:
        print(f"{region:12s}" + "".join(f"{saved[mode]['regions'][region] / unit:10.2f}" for mode in saved))
    print(f"{'total':12s}" + "".join(f"{saved[mode]['total'] / unit:10.2f}" for mode in saved))


def plot_saved_bytes(saved: dict, saving: dict, *, seq_len: int, batch_size: int):
    """Section 2's figure: bytes kept for backward by region, without and with checkpointing; returns it."""
    import matplotlib.pyplot as plt

    regions = list(saved["none"]["regions"])
    x = np.arange(len(regions))
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    for offset, mode, color in ((-0.2, "none", COLORS["activations"]), (0.2, "torch", COLORS["parameters"])):
        values = [saved[mode]["regions"][r] / MIB for r in regions]
        ax.bar(x + offset, values, 0.4, color=color,
               label="no checkpointing" if mode == "none" else "every block checkpointed (the head is not)")
    for offset, mode in ((-0.2, "none"), (0.2, "torch")):   # the head keeps the logits either way
        ax.bar(x[-1] + offset, saved[mode]["logits"] / MIB, 0.4, fill=False, hatch="//", edgecolor="black",
               label="of which the logits" if mode == "none" else None)
    ax.set_xticks(x, regions)
    ax.set(ylabel="saved for backward (MiB)", title=f"Tiny Qwen-7B twin, seq {seq_len} x batch {batch_size}, "
           f"fp32: bytes autograd keeps, by region\nblocks: {saving['blocks']:.0%} less with checkpointing; "
           f"whole model: {saving['model']:.0%} less")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the bars, never on them
    fig.tight_layout()
    return fig


def verdict_table(v8: tuple, v11: tuple, v20: tuple, *, source: str, act: list, peak: list, full_saving: float,
                  posts_on_lora: dict, largest: dict, flags_from: str) -> str:
    """Section 5's table of verdicts, as Markdown: one row per claim, with what the lesson measured."""
    row8 = (f"{v8[1]}; at full scale ({source}) the posts' setting keeps {act[0] / GIB:.1f} GiB of activations "
            f"without, {act[1] / GIB:.1f} GiB with ({full_saving:.0%} less), peak {peak[0] / GIB:.1f} -> "
            f"{peak[1] / GIB:.1f} GiB; the posts' call on a LoRA twin leaves "
            f"{posts_on_lora['adapters_with_gradient']} of {posts_on_lora['adapters']} adapter weights with a "
            "gradient")
    row11 = (f"{v11[1]}; the largest unit gathered at once is {largest['1e7'] / GIB:.2f} GiB (1e7) against "
             f"{largest['per block'] / GIB:.2f} GiB (per block, the root) in fp16")
    return (f"\n| # | verdict | measured here |\n|---|---|---|\n| 8 | **{v8[0]}** | {row8} |\n"
            f"| 11 | **{v11[0]}** | {row11} |\n| 20 | **{v20[0]}** | {v20[1]}; checked against {flags_from} |\n")
