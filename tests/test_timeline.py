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
