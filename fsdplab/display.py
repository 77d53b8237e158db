"""Everything the lab draws that more than one lesson shares: colours, the stacked memory bars, the heat
map, the figure files, and the `Dashboard` (ipywidgets controls that redraw a matplotlib figure) with the
memory dashboards built on it.

`Dashboard` works without a browser: `dashboard.set(...)` changes controls from code (tests and papermill
runs do this) and `dashboard.figure` is the figure drawn for the current values, so what a reader sees can be
checked. Figures that belong to one topic only (a timeline, loss curves) live with that topic's module.
"""

from __future__ import annotations

import html
import io
import os
import textwrap
from pathlib import Path

from ._torch_private import CATEGORIES
from .owned_folders import owned_temp
from .memory.report import CATEGORY_LABELS
from .settings import GIB, MIB

COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
          "activations": "#c44e52", "communication_buffers": "#8172b3", "other": "#937860"}
# The README's pictures. Runs never write there: `fsdplab run` saves into its output folder, a notebook opened
# by hand into a temporary folder; `fsdplab run --figures docs/figures` regenerates the README's pictures.
FIGURE_DIR = Path(__file__).resolve().parent.parent / "docs" / "figures"


def figure_dir() -> Path:
    """Where save_figure writes: FSDPLAB_FIGURES (read at each save), made if missing, else
    TMPDIR/fsdplab-figures when that is the lab's own folder (a symlink or a folder someone else
    planted there is never followed: a new temporary folder is used instead)."""
    chosen = os.environ.get("FSDPLAB_FIGURES")
    if not chosen:
        return owned_temp("fsdplab-figures")
    Path(chosen).mkdir(parents=True, exist_ok=True)
    return Path(chosen)


def save_figure(fig, name: str, dpi: int = 110) -> Path:
    """Save `fig` as NAME.png in figure_dir()."""
    folder = figure_dir()
    path = folder / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


# --- memory bars ---------------------------------------------------------------------------------------------

def unit_of(byte_counts) -> tuple:
    """(bytes per unit, unit name) for drawing `byte_counts`: GiB, or MiB when the largest is under a quarter
    GiB (a tiny model's bars would be invisible on a GiB axis)."""
    largest = max((b for b in byte_counts if b is not None), default=0)
    return (GIB, "GiB") if largest >= GIB / 4 else (MIB, "MiB")


def draw_stacked(ax, labels, reports, gpu_mem_gib=None, highlight=None, extras=None, extra_label=None,
                 unit=GIB, unit_name="GiB"):
    """Stacked bars of each report's six categories (in `unit`), with an optional GPU-size line, an outlined
    `highlight` bar, and `extras[i]` bytes stacked on top (hatched, labelled `extra_label`). Returns the
    bar heights."""
    bottoms = [0.0] * len(reports)
    for name in CATEGORIES:
        values = [r.by_category.get(name, 0) / unit for r in reports]
        ax.bar(labels, values, bottom=bottoms, color=COLORS[name], label=CATEGORY_LABELS[name])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if extras:
        values = [(e or 0) / unit for e in extras]
        ax.bar(labels, values, bottom=bottoms, color="#bbbbbb", hatch="xx", edgecolor="#555555", label=extra_label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if highlight is not None:
        ax.bar([labels[highlight]], [bottoms[highlight]], fill=False, edgecolor="black", linewidth=2)
    if gpu_mem_gib:
        _gpu_line(ax, labels, bottoms, gpu_mem_gib, gpu_mem_gib * GIB / unit, highlight)
    ax.set_ylabel(f"memory per GPU ({unit_name})")
    return bottoms


def _gpu_line(ax, labels, bottoms, gpu_mem_gib, card, highlight):
    """The GPU-size line at height `card` (the plot's unit), keeping bars and line readable together."""
    tallest = max(bottoms, default=0.0)
    if tallest and card > 10 * tallest:
        # A line ten times above every bar would flatten them: name the card instead of drawing it.
        ax.set_ylim(0, 1.15 * tallest)   # room for the note above the tallest bar
        ax.text(0.99, 0.98, f"{gpu_mem_gib:.4g} GiB GPU: {card / tallest:,.0f}x the tallest bar",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
        return
    # Bars far above the line are clipped, broken (two white slashes) and labelled with their height.
    top = max(2.5 * card, 1.15 * (bottoms[highlight] if highlight is not None else 0))
    if tallest > top:
        ax.set_ylim(0, top)
        for x, height in zip(labels, bottoms):
            if height > top:
                ax.text(x, top * 0.97, f"{height:.0f}", ha="center", va="top", fontsize=8, color="white",
                        fontweight="bold")
                ax.plot([x, x], [top * 0.84, top * 0.80], linestyle="none", marker=[(-1, -0.4), (1, 0.4)],
                        markersize=14, markeredgewidth=2.5, color="white")
    ax.axhline(card, color="black", linestyle="--", linewidth=1)
    # inside the plot, clear of the right spine (x in axes units, y in data units), over whatever it crosses
    ax.text(0.985, card, f"{gpu_mem_gib:.4g} GiB GPU", transform=ax.get_yaxis_transform(), va="bottom", ha="right",
            fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


def memory_over_step_figure(report, path=None, ax=None):
    """`report.timeline` as a stacked area per category over the step's allocation events (forward, backward
    and optimizer step shaded), the peak marked and named by its moment. Saved to `path` when given."""
    import matplotlib.pyplot as plt

    line = report.timeline
    if not line or not line.get("phase"):
        raise ValueError("this report has no memory-over-step record: it comes from an estimate or a measurement "
                         "(memory.estimate / measure_setting), not from the formula or an older cached estimate.")
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3.8))
    unit, unit_name = unit_of([sum(line[c][i] for c in CATEGORIES) for i in range(len(line["phase"]))])
    x = list(range(len(line["phase"])))
    ax.stackplot(x, *[[v / unit for v in line[c]] for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES],
                 labels=[CATEGORY_LABELS[c] for c in CATEGORIES], alpha=0.9)
    start = 0
    shades = {"forward": "#ffffff", "backward": "#f0f0f0", "optimizer step": "#d8e4f0"}
    for i in range(1, len(x) + 1):
        if i == len(x) or line["phase"][i] != line["phase"][start]:
            ax.axvspan(start - 0.5, i - 0.5, color=shades.get(line["phase"][start], "#ffffff"), zorder=-1)
            if i - start >= 0.08 * len(x) or line["phase"][start] == "optimizer step":
                ax.text((start + i) / 2, 0, line["phase"][start].replace("optimizer step", "optimizer\nstep"),
                        ha="center", va="bottom", fontsize=8, color="#444")
            start = i
    totals = [sum(line[c][i] for c in CATEGORIES) for i in x]
    top = max(x, key=totals.__getitem__)
    m = report.peak_moment or {}
    where = ", ".join(v for v in (m.get("phase"), m.get("module")) if v)
    ax.annotate(f"peak {totals[top] / unit:.2f} {unit_name}" + (f"\n{where}" if where else ""),
                xy=(top, totals[top] / unit), xytext=(0.02, 0.96), textcoords="axes fraction", va="top", fontsize=9,
                arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_xlabel("allocation events through one training step")
    ax.set_ylabel(unit_name)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_title(f"{report.settings.get('model', '')}: memory over one step, per rank ({report.source})", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    if fig is not None and path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig if fig is not None else ax.figure


def draw_heatmap(ax, seq_lens, batch_sizes, grid_gib, exact_gib=None, gpu_gib=24.0):
    """Colour: the formula's peak per GPU (GiB); a cell with an exact estimate shows it in bold with a star.
    Cells over `gpu_gib` are hatched (does not fit)."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    grid = np.array(grid_gib, dtype=float)
    norm = TwoSlopeNorm(vmin=min(grid.min(), gpu_gib - 1), vcenter=gpu_gib, vmax=max(grid.max(), gpu_gib + 1))
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=norm, origin="lower", aspect="auto")
    for i, b in enumerate(batch_sizes):
        for j, s in enumerate(seq_lens):
            found = (exact_gib or {}).get((s, b))
            text = f"{grid[i, j]:.1f}" + (f"\n★{found:.1f}" if found is not None else "")
            over = grid[i, j] > gpu_gib
            # Over the card: hatched, with the number on a white patch so the hatching cannot hide it.
            ax.text(j, i, text, ha="center", va="center", fontsize=8, zorder=3,
                    fontweight="bold" if found is not None else "normal",
                    bbox=dict(facecolor="white", alpha=0.85, edgecolor="none", pad=1.5) if over else None)
            if over:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="black",
                                       linewidth=0, zorder=2))
    ax.set_xticks(range(len(seq_lens)), [str(s) for s in seq_lens])
    ax.set_yticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("micro-batch per GPU (sequences)")
    return image


def plot_sweep(sweep, path) -> None:
    """A heat map per world size of a memory.Sweep (rows micro-batch, columns sequence length), hatched over
    the card, saved at `path`."""
    from matplotlib.figure import Figure

    unit, per = sweep.unit()
    capacity = sweep.gpu_mem_gib * GIB / per     # the card, in the plot's unit
    panels = len(sweep.world_sizes)
    fig = Figure(figsize=(max(6.5, (2.4 + 0.9 * len(sweep.seq_lens)) * panels),
                          1.8 + 0.6 * len(sweep.batch_sizes)), layout="constrained")
    for ax, world_size in zip(fig.subplots(1, panels, squeeze=False)[0], sweep.world_sizes):
        image = draw_heatmap(ax, sweep.seq_lens, sweep.batch_sizes, sweep.grid(world_size, per),
                             gpu_gib=capacity)
        bar = fig.colorbar(image, ax=ax, label=f"peak per GPU ({unit})")
        bar.ax.axhline(capacity, color="black", linewidth=2)
        low, high = image.norm.vmin, image.norm.vmax   # a tick at the card, none crowding it
        bar.set_ticks([t for t in bar.get_ticks()
                       if low <= t <= high and abs(t - capacity) > (high - low) / 12] + [capacity])
        ax.set_title(f"world size {world_size}", fontsize=10)
    fig.suptitle(f"{sweep.setting.model_name}: {sweep.description()}\nexact peak per GPU ({unit}); "
                 f"hatched: over the {sweep.gpu_mem_gib:g} GiB card (black line)", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")

def exact_marker(ax, x, height, label="exact (estimate)"):
    """The gold star that marks an exact estimate on a formula bar (`height` in the axis' unit). The axis is
    raised where the star would touch its top, so the star is never cut in half."""
    ax.plot([x], [height], marker="*", markersize=16, color="gold", markeredgecolor="black", linestyle="none",
            label=label, clip_on=False, zorder=4)
    bottom, top = ax.get_ylim()
    if height > 0.92 * top:
        ax.set_ylim(bottom, height / 0.88)


# --- dashboards ----------------------------------------------------------------------------------------------

class Dashboard:
    """`controls`: name -> ipywidgets control; `draw(fig, **values)` draws into a cleared figure.

    The figure reaches the page as PNG bytes in an `ipywidgets.Image`, not through an `Output` widget:
    an Output widget captures messages from whichever cell runs next, which papermill's client mimics
    imperfectly (executions were seen to stall); an Image is plain widget state.

    Displaying a dashboard leaves one output with two forms: the widget, and a static PNG of the figure as it
    is at that moment. A front end shows the widget where it can and the PNG where widgets do not render
    (GitHub, nbviewer, a PDF, an executed notebook opened without its kernel), never both.
    """

    def __init__(self, controls: dict, draw, title: str = "", figsize=(8, 4), dpi: int = 90):
        import threading

        import ipywidgets as W
        import matplotlib.pyplot as plt

        self._lock = threading.Lock()
        self.controls, self.draw, self.title, self.dpi = controls, draw, title, dpi
        self.figure = plt.figure(figsize=figsize)
        # Closed figures stay drawable but are no longer shown by the inline backend at the end of the
        # cell: the dashboard shows its figure once, in its own image.
        plt.close(self.figure)
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.status = W.HTML()
        self.widget = W.VBox([W.HTML(f"<b>{title}</b>") if title else W.HTML(""),
                              W.HBox(list(controls.values()), layout=W.Layout(flex_flow="row wrap")),
                              self.image, self.status])
        for control in controls.values():
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def refresh(self):
        # One redraw at a time: an exact estimate finishing in its thread may redraw while a control moves.
        with self._lock:
            self.figure.clear()
            self.result = self.draw(self.figure, **self.values)
            self.image.value = self._png()
            return self.result

    def _png(self, caption: str = "") -> bytes:
        buffer = io.BytesIO()
        note = None
        if caption:
            # under everything drawn (axis labels included), left-aligned with it
            canvas = self.figure.canvas
            if not hasattr(canvas, "get_renderer"):   # a closed figure keeps a bare canvas: draw with Agg
                from matplotlib.backends.backend_agg import FigureCanvasAgg

                canvas = FigureCanvasAgg(self.figure)
            box = self.figure.get_tightbbox(canvas.get_renderer())
            width, height = self.figure.get_size_inches()
            note = self.figure.text(box.x0 / width, box.y0 / height - 0.02, caption, fontsize=8, color="#555555",
                                    va="top")
        try:
            self.figure.savefig(buffer, format="png", dpi=self.dpi, bbox_inches="tight")
        finally:
            if note is not None:
                note.remove()
        return buffer.getvalue()

    def snapshot(self) -> bytes:
        """PNG bytes of the figure as it is now, captioned with the controls' values: the static copy shown
        next to the widget."""
        with self._lock:
            shown = ", ".join(f"{name}={_shown(control)}" for name, control in self.controls.items())
            caption = (f"static copy of the dashboard when this cell ran ({shown}); "
                       "move the controls in a live notebook to redraw it")
            return self._png(textwrap.fill(caption, width=int(self.figure.get_figwidth() * 15)))

    def say(self, text: str) -> None:
        """Show `text` (monospace) under the figure, replacing what was there."""
        self.status.value = f"<pre style='font-size: 11px'>{html.escape(text)}</pre>" if text else ""

    def set(self, **values):
        """Change controls as a reader would; the figure redraws once per change."""
        for name, value in values.items():
            if name not in self.controls:
                raise ValueError(f"no control {name!r}; this dashboard has {list(self.controls)}.")
            self.controls[name].value = value
        return self.result

    def _ipython_display_(self):
        import base64

        from IPython.display import display

        # One output holding both: JupyterLab (and any front end with the widget manager) draws the live widget;
        # where widgets do not render (GitHub, nbviewer, a PDF, an executed notebook opened without its kernel)
        # the same output shows the PNG. Two outputs used to show the live chart and a stale copy side by side.
        bundle = self.widget._repr_mimebundle_()
        bundle["image/png"] = base64.b64encode(self.snapshot()).decode("ascii")
        bundle["text/plain"] = f"[interactive dashboard: {self.title or 'controls'}; needs a running kernel]"
        display(bundle, raw=True)


def _shown(control) -> str:
    """A control's value as the reader sees it (a Dropdown of (label, value) pairs shows the label)."""
    import ipywidgets as W

    return str(control.label if isinstance(control, W.Dropdown) else control.value)


def exact_in_background(dash, button, setting, done, wait: bool = False):
    """Run `memory.estimate(setting)` in a subprocess from a worker thread, showing its progress lines in the
    dashboard's status line and disabling `button` meanwhile; `done(report)` runs when it finishes.
    wait=True (code, tests, papermill) blocks and returns the report; a click returns at once, so the
    notebook stays usable for the tens of seconds a 7B estimate takes."""
    import threading

    from .memory.exact import estimate

    result: dict = {}

    import time

    start = time.monotonic()
    lines = [f"exact estimate of {setting.model_name} on {setting.world_size} ranks (fake tensors) ..."]

    def progress(line):
        # the estimate's stages, as it reports them: built on meta, sharded + two steps running, the peak
        done = 3 if line.startswith(("peak", "reused")) else 2 if "sharded" in line else 1 if "built" in line else 0
        bar = "#" * (8 * done) + "." * (8 * (3 - done))
        dash.say(f"{lines[0]}\n[{bar}] stage {done} of 3, {time.monotonic() - start:.0f} s: {line}")

    def work():
        progress("starting")
        try:
            result["report"] = estimate(setting, subprocess_mode=True, progress=progress)
            done(result["report"])
        except Exception as e:  # noqa: BLE001 - shown in the dashboard; the notebook must not see a thread die
            result["error"] = e
            dash.say(f"exact estimate failed: {e}")
        finally:
            button.disabled = False

    button.disabled = True     # before the thread starts: a second click cannot start a second estimate
    thread = threading.Thread(target=work, daemon=True, name="fsdplab-exact-estimate")
    thread.start()
    if not wait:
        return thread
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["report"]


def _with(options: list, value) -> list:
    """A slider's stops with the starting value among them (a value between stops would be refused)."""
    return sorted(set(options) | {value})


def memory_dashboard(model="qwen-7b", world_size=8, strategy="full_shard", precision="bf16", optimizer="adamw",
                     activation_checkpointing=False, lora_rank=0, seq_len=2048, gpu_mem_gib=22.49):
    """Controls -> per-GPU memory of every strategy from `formula`, the chosen one outlined, against a GPU-size
    line. The "exact" button runs `estimate` (FSDP strategies) for the current setting and marks it."""
    import ipywidgets as W

    from .memory.formula import formula
    from .models import MODELS
    from .settings import STRATEGIES as ALL_STRATEGIES, EXACT_STRATEGIES, OPTIMIZERS, PRECISIONS, TrainSetting

    # the posts' layouts; FSDP2's replicate() is DDP's layout again (fsdplab estimate --strategy replicate)
    STRATEGIES = tuple(s for s in ALL_STRATEGIES if s != "replicate")
    wide = {"description_width": "initial"}    # a label as long as it needs, never cut to "LoRA r (0:..."
    slider = lambda stops, value, label: W.SelectionSlider(options=_with(stops, value), value=value,  # noqa: E731
                                                           description=label, style=wide)
    controls = {
        # every registered model
        "model": W.Dropdown(options=list(MODELS), value=model, description="model", style=wide),
        "world_size": slider([1, 2, 4, 8, 16, 32, 64], world_size, "GPUs"),
        "strategy": W.Dropdown(options=STRATEGIES, value=strategy, description="strategy", style=wide),
        "precision": W.Dropdown(options=PRECISIONS, value=precision, description="precision", style=wide),
        "optimizer": W.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer", style=wide),
        "activation_checkpointing": W.Checkbox(value=activation_checkpointing, description="act. checkpointing",
                                               style=wide),
        "lora_rank": slider([0, 8, 16, 32, 64, 128], lora_rank, "LoRA r (0: full)"),
        "seq_len": slider([64, 128, 256, 512, 1024, 2048, 4096, 8192], seq_len, "seq len"),
        "gpu_mem_gib": slider([16, 22.49, 40, 48, 80, 141], gpu_mem_gib, "GPU GiB"),
    }
    exact: dict = {}

    def setting_of(v) -> TrainSetting:
        return TrainSetting(model=v["model"], world_size=v["world_size"], strategy=v["strategy"],
                            precision=v["precision"], optimizer=v["optimizer"],
                            activation_checkpointing=v["activation_checkpointing"], lora_rank=v["lora_rank"] or None,
                            seq_len=v["seq_len"])

    def draw(fig, gpu_mem_gib, **v):
        chosen = setting_of(v)
        reports = [formula(chosen, strategy=s) for s in STRATEGIES]
        ax = fig.add_subplot(1, 1, 1)
        index = STRATEGIES.index(chosen.strategy)
        found = exact.get(chosen)
        # the unit follows the bars: a tiny model's MiB would be invisible on a GiB axis
        unit, unit_name = unit_of([r.peak_bytes for r in reports] + [found.peak_bytes if found else None])
        heights = draw_stacked(ax, list(STRATEGIES), reports, gpu_mem_gib, highlight=index, unit=unit,
                               unit_name=unit_name)
        top = ax.get_ylim()[1]
        if max(heights) <= top:                   # nothing clipped: room above the tallest bar for its number
            card = gpu_mem_gib * GIB / unit if gpu_mem_gib else 0
            top = 1.12 * max(max(heights), card if card <= 10 * max(heights) else 0)   # a far card is not drawn
            ax.set_ylim(0, top)
        for x, height in enumerate(heights):      # the number on each bar; a clipped bar has its own (_gpu_line)
            if height <= top:
                ax.text(x, height, f"{height:.1f}", ha="center", va="bottom" if height < top * 0.9 else "top",
                        fontsize=7)
        if found is not None:
            exact_marker(ax, index, found.peak_bytes / unit)
        lora = f"LoRA r={chosen.lora_rank}" if chosen.lora_rank else "full fine-tune"
        ax.set_title(f"{chosen.model}, {chosen.world_size} GPUs, {lora}, {chosen.precision}, {chosen.optimizer}, "
                     f"seq {chosen.seq_len}" + (", checkpointing" if chosen.activation_checkpointing else ""),
                     fontsize=10)
        ax.set_xlabel("strategy (formula; outlined: selected)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return {"reports": dict(zip(STRATEGIES, reports)), "selected": reports[index], "exact": found}

    dash = Dashboard(controls, draw, title="Per-GPU memory by strategy (formula)", figsize=(9, 4.2))
    button = W.Button(description="exact estimate", tooltip="run fsdplab.memory.estimate for this setting")

    def run_exact(_button=None, wait=True):
        chosen = setting_of(dash.values)
        if chosen.strategy not in EXACT_STRATEGIES:
            dash.say(f"exact estimates cover {', '.join(EXACT_STRATEGIES)}, not {chosen.strategy} (DeepSpeed's).")
            return None

        def done(report):
            exact[chosen] = report
            dash.refresh()
            dash.say(report.table(gpu_mem_gib=dash.values["gpu_mem_gib"]))

        return exact_in_background(dash, button, chosen, done, wait=wait)

    button.on_click(lambda _button: run_exact(wait=False))   # the kernel stays free while it runs
    dash.exact = run_exact
    dash.exact_button = button
    dash.widget = W.VBox([dash.widget, button])
    return dash
