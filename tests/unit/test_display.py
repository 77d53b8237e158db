"""The shared drawing code: dashboards leave a static figure next to the widget, units follow the data, the
exact-estimate star is never clipped, hatching never hides a heat-map number."""

import base64

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from fsdplab import display as D  # noqa: E402
from fsdplab.settings import GIB, MIB  # noqa: E402


def shown_outputs(dash, monkeypatch):
    """What displaying `dash` sends to the notebook: a list of (bundle, raw) pairs."""
    import IPython.display

    sent = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: sent.append((obj, raw)))
    dash._ipython_display_()
    return sent


def test_dashboard_is_one_output_holding_the_widget_and_its_static_png(monkeypatch):
    dash = D.memory_dashboard(model="qwen-7b", world_size=8, gpu_mem_gib=24)
    first = dash.result["selected"].peak_bytes
    [(bundle, raw)] = shown_outputs(dash, monkeypatch)      # one output: a live front end never shows both
    assert raw and "application/vnd.jupyter.widget-view+json" in bundle and "VBox" not in bundle["text/plain"]
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(b"\x89PNG")
    # set() and figure still work after display; the static copy already sent does not change
    dash.set(model="llama2-70b", world_size=64)
    assert dash.result["selected"].peak_bytes != first and dash.figure.axes[0].get_title().startswith("llama2-70b")
    assert base64.b64decode(bundle["image/png"]) == png


def test_snapshot_names_the_controls_and_leaves_the_figure_as_it_was():
    dash = D.memory_dashboard(model="tiny", world_size=8, seq_len=128, gpu_mem_gib=16)
    texts_before = len(dash.figure.texts)
    assert dash.snapshot().startswith(b"\x89PNG")
    assert len(dash.figure.texts) == texts_before          # the caption is drawn for the snapshot only


def test_tiny_model_is_drawn_in_mib_without_a_far_away_gpu_line():
    dash = D.memory_dashboard(model="tiny", world_size=8, seq_len=128, gpu_mem_gib=16)
    ax = dash.figure.axes[0]
    assert ax.get_ylabel() == "memory per GPU (MiB)"
    tallest = max(r.peak_bytes for r in dash.result["reports"].values()) / MIB
    assert ax.get_ylim()[1] < 2 * tallest                  # the bars fill the plot
    assert any("16 GiB GPU" in t.get_text() and "x the tallest bar" in t.get_text() for t in ax.texts)
    big = D.memory_dashboard(model="qwen-7b", world_size=8, gpu_mem_gib=24)
    assert big.figure.axes[0].get_ylabel() == "memory per GPU (GiB)"


def test_unit_of_follows_the_largest_value():
    assert D.unit_of([3 * MIB, 100 * MIB]) == (MIB, "MiB")
    assert D.unit_of([3 * MIB, GIB]) == (GIB, "GiB")


def test_exact_star_is_not_clipped_at_the_top():
    fig, ax = plt.subplots()
    ax.bar([0, 1], [5.0, 10.0])
    top = ax.get_ylim()[1]
    D.exact_marker(ax, 1, top)                              # a star exactly at the old top
    assert ax.get_ylim()[1] > top * 1.1
    plt.close(fig)


def test_slider_accepts_a_value_between_its_stops():
    dash = D.memory_dashboard(model="qwen-7b", world_size=3, gpu_mem_gib=32)
    assert dash.values["world_size"] == 3 and dash.values["gpu_mem_gib"] == 32
    assert list(dash.controls["model"].options) == list(__import__("fsdplab.models", fromlist=["MODELS"]).MODELS)


def test_heatmap_numbers_stay_readable_over_hatching():
    fig, ax = plt.subplots()
    D.draw_heatmap(ax, [512, 1024], [1, 2], [[10.0, 20.0], [22.0, 36.7]], gpu_gib=24.0)
    hatched = [p for p in ax.patches if p.get_hatch()]
    over = [t for t in ax.texts if t.get_text().startswith("36.7")]
    assert len(hatched) == 1 and over and over[0].get_bbox_patch() is not None
    assert over[0].get_zorder() > hatched[0].get_zorder()
    plt.close(fig)


def test_draw_stacked_keeps_clipping_bars_far_above_the_line():
    from fsdplab.memory.formula import formula

    fig, ax = plt.subplots()
    reports = [formula(model="llama2-70b", world_size=64, strategy=s) for s in ("ddp", "full_shard")]
    heights = D.draw_stacked(ax, ["ddp", "full_shard"], reports, gpu_mem_gib=80)
    assert ax.get_ylim()[1] < heights[0] and any(t.get_text() == f"{heights[0]:.0f}" for t in ax.texts)
    assert heights == pytest.approx([r.peak_bytes / GIB for r in reports])
    plt.close(fig)


def test_dashboard_labels_are_whole_and_bars_carry_their_numbers():
    dash = D.memory_dashboard(model="qwen-7b", world_size=8, lora_rank=64, gpu_mem_gib=22.49)
    assert all(c.style.description_width == "initial" for c in dash.controls.values()
               if hasattr(c.style, "description_width")), "a label may be cut"
    heights = [r.peak_bytes / D.GIB for r in dash.result["reports"].values()]
    shown = {t.get_text() for t in dash.figure.axes[0].texts}
    assert all(f"{h:.1f}" in shown for h in heights), (heights, shown)


def test_dashboard_gives_a_clipped_bar_one_number():
    dash = D.memory_dashboard(model="llama2-70b", world_size=64, lora_rank=0, activation_checkpointing=True,
                              gpu_mem_gib=80)
    ax = dash.figure.axes[0]
    top = ax.get_ylim()[1]
    texts = [t for t in ax.texts if t.get_text() != "80 GiB GPU"]
    for x, (name, report) in enumerate(dash.result["reports"].items()):
        height = report.peak_bytes / D.GIB
        on_bar = [t for t in texts if t.get_position()[0] in (x, name)]   # a bar's index, or its category
        assert len(on_bar) == 1, (height, [t.get_text() for t in on_bar])
        assert on_bar[0].get_text() == (f"{height:.0f}" if height > top else f"{height:.1f}")


def test_the_exact_button_shows_its_stages_as_a_bar(monkeypatch):
    from fsdplab.memory import exact

    said, real_estimate = [], exact.estimate
    dash = D.memory_dashboard(model="tiny", world_size=2, seq_len=64, gpu_mem_gib=16)
    monkeypatch.setattr(dash, "say", said.append)

    def fake_estimate(setting, subprocess_mode=False, progress=None):
        for line in ("model built on the meta device", "sharded; running two training steps", "peak 3.7 MiB"):
            progress(line)
        return real_estimate(setting, progress=False, subprocess_mode=False)

    monkeypatch.setattr(exact, "estimate", fake_estimate)
    dash.exact(wait=True)
    bars = [line for line in said if "stage" in line]
    assert [b.split("stage ")[1][:1] for b in bars] == ["0", "1", "2", "3"], bars
    assert "[########################]" in bars[-1]
