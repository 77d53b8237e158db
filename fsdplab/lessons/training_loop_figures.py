"""Lesson 09's two figures: section 6's loss of the ranks against one process, section 7's memory of each init,
load and accumulation path."""

from __future__ import annotations


def plot_one_process(loss_one, loss_cut, loss_ranks, gap_ranks, gap_cut, tolerance, *, world_size: int,
                     micro_batches: int, steps: int):
    """Section 6's figure: the loss per step on the ranks and in one process, and their gap; returns it."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2))
    ax.plot(loss_one, "k-", lw=3, alpha=0.35, label="1 process")
    ax.plot(loss_cut, "C2+", ms=8, label=f"1 process, {world_size * micro_batches} micro-batches")
    ax.plot(loss_ranks, "C0o", ms=5, mfc="none", label=f"{world_size} rank{'s' if world_size > 1 else ''}, "
            f"{micro_batches} micro-batches each")
    ax.set(title=f"The same {steps} steps on {world_size} rank{'s' if world_size > 1 else ''} and in one "
                 "process\n(bf16 compute, accumulation, clipping, AdamW)",
           xlabel="optimizer step", ylabel="loss (cross-entropy, nats)")
    ax.legend(fontsize=8)
    floor = 1e-9
    bx.semilogy([max(g, floor) for g in gap_ranks], "C0o-", ms=4, label=f"|{world_size} ranks - 1 process|")
    bx.semilogy([max(g, floor) for g in gap_cut], "C2+-", ms=6, label="|1 process, finer cut - 1 process| (rounding)")
    bx.axhline(tolerance, color="C3", ls="--", label=f"tolerance {tolerance:.1e}")
    bx.set(title="Difference per step (values below 1e-9 drawn at 1e-9)", xlabel="optimizer step",
           ylabel="|loss difference|", ylim=(floor / 2, max(1e-2, 10 * tolerance)))
    bx.legend(fontsize=8)
    for axis in (ax, bx):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
    fig.tight_layout()
    return fig


def plot_memory(init_by_rank, load_by_rank, big, costs, *, big_model: str, big_world_size: int,
                micro_batches: int, world_size: int):
    """Section 7's figure: peak bytes per init and load path, the big model's, each accumulation's; returns it."""
    import matplotlib.pyplot as plt

    from ..settings import GIB, MIB

    fig = plt.figure(figsize=(12, 9.5))
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 1.05))
    ax, bx, cx = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    paths = list(init_by_rank[0]) + list(load_by_rank[0])
    x = range(len(paths))
    for r in range(world_size):
        w = 0.8 / world_size
        values = [(init_by_rank[r] | load_by_rank[r])[p] / MIB for p in paths]
        bars = ax.bar([i - 0.4 + w * (r + 0.5) for i in x], values, w, label=f"rank {r}", color=f"C{r}")
        ax.bar_label(bars, fmt="%.2f", fontsize=9 if world_size <= 2 else 8)
    ax.set_xticks(list(x), [p.replace(": ", ":\n") for p in paths], fontsize=10)
    ax.set(title="Tiny twin, live: peak tensor MiB per rank (init: TinyTransformer; load: tiny Qwen2)", ylabel="MiB")
    ax.margins(y=0.12)
    ax.legend(fontsize=10)
    labels = ["whole model\nper rank", "meta + shard\nper rank", f"whole model\n{big_world_size} ranks\nof a node",
              f"meta + shard\n{big_world_size} ranks\nof a node"]
    values = [big["full"], big["shard"], big_world_size * big["full"], big_world_size * big["shard"]]
    bars = bx.bar(range(4), [v / GIB for v in values], color=["C3", "C0", "C3", "C0"])
    bx.bar_label(bars, fmt="%.1f", fontsize=10)
    bx.set_xticks(range(4), labels, fontsize=10)
    bx.margins(y=0.12)
    bx.set(title=f"{big_model}: fp32 parameter GiB while initialising\n(meta-device shapes, {big_world_size} ranks)",
           ylabel="GiB")
    names = list(costs)
    # broken at the comma and between words, never inside an identifier
    short = [n.replace(", ", ",\n").replace("set_requires_", "").replace("every micro-batch", "every\nmicro-batch")
             for n in names]
    xs = range(len(names))
    b1 = cx.bar([i - 0.2 for i in xs], [costs[n]["sent"] / MIB for n in names], 0.4, color="C1",
                label="MiB sent (one step)")
    b2 = cx.bar([i + 0.2 for i in xs], [costs[n]["held"] / MIB for n in names], 0.4, color="C4",
                label="MiB of gradients held\nbetween micro-batches")
    cx.bar_label(b1, fmt="%.2f", fontsize=9, rotation=90, padding=3)
    cx.bar_label(b2, fmt="%.2f", fontsize=9, rotation=90, padding=3)
    cx.set_xticks(list(xs), short, fontsize=9)
    cx.margins(y=0.25)
    cx.set(title=f"Accumulating {micro_batches} micro-batches,\nrank 0 of {world_size}", ylabel="MiB")
    cx.legend(fontsize=9, loc="upper right")
    for axis in (ax, bx, cx):
        axis.title.set_fontsize(12)
        axis.yaxis.label.set_fontsize(11)
        axis.tick_params(axis="y", labelsize=10)
    fig.tight_layout()
    return fig
