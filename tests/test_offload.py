"""fsdplab.offload: bandwidth constants, bytes moved, the per-rank ledger, the step-time model, the dashboard."""

import math

import pytest
import torch

from fsdplab import offload as O
from fsdplab.formula import spec_of
from fsdplab.settings import GIB


def test_host_link_is_far_below_one_tenth_of_gpu_memory():
    from fsdplab.network import get_link

    # One source for the PCIe figures: comms' link presets.
    assert O.PCIE_BYTES_PER_S == {"PCIe 4.0 x16": 31.5e9, "PCIe 5.0 x16": 63e9}
    assert all(bw == get_link(name).bytes_per_s for name, bw in O.PCIE_BYTES_PER_S.items())
    assert O.bandwidth_ratio("A10") == pytest.approx(600 / 31.5)
    assert O.bandwidth_ratio("A100-80GB") == pytest.approx(2000 / 31.5)
    assert O.bandwidth_ratio("H100-SXM") == pytest.approx(3350 / 63)
    assert all(O.bandwidth_ratio(name) > 10 for name in O.GPUS)
    with pytest.raises(ValueError, match="use one of"):
        O.gpu("V100")


def test_transfer_bytes_per_step():
    assert O.transfer_bytes_per_step(800, 8) == {"h2d": 2 * 100 * 4, "d2h": 100 * 4}
    assert O.transfer_bytes_per_step(800, 8, reshard_after_forward=False)["h2d"] == 100 * 4
    assert O.transfer_bytes_per_step(801, 8)["d2h"] == 101 * 4          # the last shard is padded
    with pytest.raises(ValueError):
        O.transfer_bytes_per_step(800, 0)


def test_ledger_moves_resident_shards_and_keeps_the_rest():
    plain = O.ledger("qwen-7b", 8)
    off = O.ledger("qwen-7b", 8, cpu_offload=True)
    resident = off["report"].resident
    assert off["gpu"]["optimizer_state"] == 0
    assert off["cpu"] == {**{k: 0 for k in off["gpu"]}, **resident}
    assert off["cpu_total"] == sum(resident.values()) > 0
    for kept in ("activations", "communication_buffers"):
        assert off["gpu"][kept] == plain["gpu"][kept]
    assert plain["gpu_total"] - off["gpu_total"] == off["cpu_total"]
    assert plain["total_params"] == 7_721_324_544


def test_llama_like_hits_the_requested_size():
    for params in (1e9, 7e9, 70e9):
        config = O.llama_like(params)
        assert spec_of(config).total_params() == pytest.approx(params, rel=0.05)
        assert O.ledger(params, 8)["total_params"] == spec_of(config).total_params()
    assert O.llama_like(13e9).name_or_path == "13B"
    with pytest.raises(ValueError, match="too small"):
        O.llama_like(1e6)


def test_step_time_model():
    base = O.step_time(7e9, 8, "A10")
    off = O.step_time(7e9, 8, "A10", cpu_offload=True, cpu_adam_seconds_per_param=2e-9)
    assert off["compute"] == base["compute"] and base["transfer"] == 0
    assert off["optimizer"] == pytest.approx(7e9 / 8 * 2e-9)
    assert off["transfer"] == pytest.approx((7e9 / 8 * 12) / (31.5e9 * 0.8), rel=1e-6)
    assert off["total"] > off["total_overlapped"] >= base["total"]
    lora = O.step_time(7e9, 8, "A10", trainable_params=1.6e8)
    assert lora["compute"] < base["compute"] and lora["optimizer"] < base["optimizer"]
    faster = O.step_time(7e9, 8, "H100-SXM")
    assert faster["compute"] < base["compute"]


def test_cost_table_slowdown_grows_with_gpu_speed():
    table = O.cost_table(7.72e9, 8, cpu_adam_seconds_per_param=5e-9)
    assert table["A10"]["slowdown"] < table["A100-80GB"]["slowdown"] < table["H100-SXM"]["slowdown"]
    assert all(row["slowdown"] > 1.3 for row in table.values())


def test_plan_and_dashboard():
    rows = O.plan(80, 70e9, 8, "H100-SXM")
    assert set(rows) == set(O.OPTIONS)
    assert not rows["nothing"]["fits"] and rows["offload"]["fits"] and rows["more GPUs"]["fits"]
    n = rows["more GPUs"]["world_size"]
    assert n > 8 and n & (n - 1) == 0
    assert rows["more GPUs"]["gpu_bytes"] <= (80 - O.RESERVE_GIB) * GIB
    with pytest.raises(ValueError):
        O.plan(0, 7e9, 8)
    dash = O.dashboard()
    assert dash.result["nothing"]["fits"]
    dash.set(params_b=70.0)
    assert not dash.result["nothing"]["fits"]
    axes = dash.figure.axes
    assert len(axes) == 2 and all(ax.get_ylabel() for ax in axes)


def test_time_adamw_step_runs_a_real_step():
    out = O.time_adamw_step(1_000_000, repeats=1, chunk=300_000)
    assert out["num_params"] == 1_000_000 and out["seconds"] > 0
    assert math.isclose(out["seconds_per_param"], out["seconds"] / 1_000_000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_host_bandwidth_needs_a_gpu():
    assert O.measure_host_bandwidth() is None
