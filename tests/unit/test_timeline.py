"""fsdplab.timeline: the overlap simulator (pure Python) and per-rank profiler traces (2 gloo ranks)."""

import matplotlib

matplotlib.use("Agg")

import pytest

import fsdplab
from fsdplab import network, timeline
from fsdplab.models import TinyConfig

CFG = TinyConfig(dim=32, num_layers=3, seq_len=16)


def test_simulator_without_prefetch_is_serial():
    r = timeline.simulate_step(num_layers=4, layer_compute_s=0.01, layer_bytes=1e8, world_size=8, link="25 GbE",
                               prefetch=0)
    assert r["step_s"] == pytest.approx(r["compute_s"] + r["comm_s"])
    assert r["comm_s"] == pytest.approx(4 * (2 * r["all_gather_s"] + r["reduce_scatter_s"]))
    kinds = [i["kind"] for i in r["intervals"] if i["row"] == "comm"]
    assert kinds.count("all_gather") == 8 and kinds.count("reduce_scatter") == 4


def test_prefetch_never_hurts_and_is_bounded():
    for link in network.PRESETS:
        off = timeline.simulate_step(link=link, prefetch=0)
        on = timeline.simulate_step(link=link, prefetch=1)
        assert on["step_s"] <= off["step_s"] + 1e-12
        # overlap can hide at most the smaller of compute and communication
        assert on["step_s"] >= max(on["compute_s"], on["comm_s"]) - 1e-12


def test_forward_and_backward_prefetch_switch_separately():
    kw = dict(num_layers=6, layer_compute_s=0.01, layer_bytes=1e8, world_size=16, link="PCIe 4.0")
    none = timeline.simulate_step(forward_prefetch=0, backward_prefetch=0, **kw)
    bwd = timeline.simulate_step(forward_prefetch=0, backward_prefetch=1, **kw)
    fwd = timeline.simulate_step(forward_prefetch=1, backward_prefetch=0, **kw)
    both = timeline.simulate_step(prefetch=1, **kw)
    assert none["step_s"] > bwd["step_s"] > both["step_s"] and none["step_s"] > fwd["step_s"] > both["step_s"]
    assert (bwd["forward_prefetch"], bwd["backward_prefetch"]) == (0, 1)
    assert none["layer_forward_s"] == 0.01
    # forward intervals are the same with or without backward prefetch
    fwd_rows = [i for i in none["intervals"] if i["label"].startswith("fwd")]
    assert fwd_rows == [i for i in bwd["intervals"] if i["label"].startswith("fwd")]


def test_lesson_prefetch_gains_and_verdicts():
    from fsdplab.lessons import prefetch as L

    g = L.prefetch_gains("NVLink H100")
    assert 0 < g["gains"]["backward only (BACKWARD_PRE)"] < g["gains"]["both"]
    r = L.simulate("NVLink H100", num_layers=3)
    assert r["layer_forward_s"] == pytest.approx(2 * 200e6 * 4 * 1024 / 150e12)      # one layer, not the step
    assert g["ratio"] == pytest.approx(r["all_gather_s"] / r["layer_forward_s"])
    assert L.claim4_verdict(1.5) == "WRONG" and L.claim4_verdict(0.6) == "RIGHT"
    assert L.claim5_verdict(1.0, 1.5, 4, 4) == "PARTLY" and L.claim5_verdict(1.5, 1.5, 4, 4) == "WRONG"
    assert L.claim6_verdict(2, [0.05, 0.2]) == "PARTLY" and L.claim6_verdict(2, [0.2]) == "RIGHT"
    assert L.claim6_verdict(3, [0.05]) == "WRONG"


def test_draw_gains_labels_each_point_once():
    import matplotlib.pyplot as plt
    from fsdplab.lessons import prefetch as L

    presets = {name: L.prefetch_gains(name) for name in network.PRESETS}
    curve = [L.prefetch_gains(network.Link("x", b)) for b in (1.0, 10.0, 100.0)]
    fig, ax = plt.subplots()
    L.draw_gains(ax, curve, presets)
    labels = [t.get_text() for t in ax.texts]
    assert "IB 100 / 100 GbE" in labels and len(labels) == len(network.PRESETS) - 1
    plt.close(fig)


def test_simulator_limits_and_shard_grad_op():
    fast = timeline.simulate_step(link=network.Link("infinite", 1e9, 0.0), prefetch=1)
    assert fast["exposed_comm_s"] < 1e-6 * fast["step_s"] + 1e-9
    sgo = timeline.simulate_step(strategy="shard_grad_op", num_layers=5)
    assert [i["kind"] for i in sgo["intervals"] if i["row"] == "comm"].count("all_gather") == 5
    with pytest.raises(ValueError):
        timeline.simulate_step(prefetch=-1)


def test_draw_simulation_has_labelled_axes():
    ax = timeline.draw_timeline(timeline.simulate_step(num_layers=3), title="sim")
    assert ax.get_xlabel() == "time (ms)" and ax.get_title() == "sim"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["communication", "compute"]


def test_every_legend_entry_has_a_visible_swatch():
    ax = timeline.draw_timeline(timeline.simulate_step(num_layers=3), title="sim")
    legend = ax.get_legend()
    for text, patch in zip(legend.get_texts(), legend.get_patches()):
        face, edge = patch.get_facecolor(), patch.get_edgecolor()
        assert face[:3] != (1.0, 1.0, 1.0) or edge[3] > 0, f"{text.get_text()!r} has no swatch"


def test_fit_labels_keeps_the_names_that_fit_inside_their_bars():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2))              # narrow: not every bar can hold its name
    timeline.draw_timeline(timeline.simulate_step(num_layers=6), ax=ax, label_min_frac=0.0)
    drawn = len(ax.texts)
    timeline.fit_labels(ax)
    kept = list(ax.texts)
    assert 0 < len(kept) < drawn
    renderer = fig.canvas.get_renderer()
    bars = [ax.transData.transform(c.get_paths()[0].get_extents().get_points()) for c in ax.collections]
    for text in kept:
        box = text.get_window_extent(renderer)
        assert any(x0 <= box.x0 and box.x1 <= x1 for (x0, _), (x1, _) in bars), text.get_text()
        assert text.get_bbox_patch() is not None                 # on a white ground over the hatching
    plt.close(fig)
    closed = plt.figure(figsize=(6, 2))                         # a dashboard's figure: closed, a bare canvas
    plt.close(closed)
    ax = timeline.draw_timeline(timeline.simulate_step(num_layers=6), ax=closed.add_subplot(), fit=True)
    assert [t.get_text() for t in ax.texts] == [t.get_text() for t in kept]


@pytest.fixture(scope="module")
def traces(cluster):
    return cluster.run(_traced_step, quiet=True)


def _traced_step():
    import torch

    from fsdplab.models import blocks_of, random_batch
    from fsdplab.sharding import build_tiny, parallelize, train_step

    model = build_tiny(CFG)
    blocks = blocks_of(model)
    model = parallelize(model, "full_shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = random_batch(CFG, 2, seed=fsdplab.rank())
    return timeline.trace_step(lambda: train_step(model, opt, batch),
                               {f"layers.{i}": b for i, b in enumerate(blocks)})


def test_trace_compute_rows_in_layer_order(traces):
    for t in traces:
        labels = [e["label"] for e in sorted(t["events"], key=lambda e: e["start_us"]) if e["row"] == "compute"]
        assert labels == ["fwd layers.0", "fwd layers.1", "fwd layers.2", "bwd layers.2", "bwd layers.1",
                          "bwd layers.0", "optimizer"]
        assert all(e["end_us"] >= e["start_us"] for e in t["events"])


def test_trace_comm_rows_labelled_by_unit(traces):
    comm = [e for e in traces[0]["events"] if e["row"] == "comm"]
    assert [e["kind"] for e in comm].count("all_gather") == 2 * (CFG.num_layers + 1)
    assert [e["kind"] for e in comm].count("reduce_scatter") == CFG.num_layers + 1
    assert "all_gather layers.0" in [e["label"] for e in comm]
    assert all(e["backend_op"] in ("all_gather", "all_reduce", "reduce_scatter") for e in comm)


def test_draw_traces_one_row_per_rank_and_stream(traces):
    ax = timeline.draw_timeline(traces)
    assert [t.get_text() for t in ax.get_yticklabels()][::-1] == ["rank 0 compute", "rank 0 comm",
                                                                  "rank 1 compute", "rank 1 comm"]
    with pytest.raises(ValueError):
        timeline.draw_timeline([])
