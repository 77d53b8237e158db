"""fsdplab.lessons.offload: bandwidth constants, bytes moved, the per-rank ledger, the step-time model; lesson 03's
module (fsdplab.lessons.cpu_offload): its cost tables, figure, dashboard, verdicts and exercise."""

import math

import pytest
import torch

from fsdplab.lessons import offload as O
from fsdplab.memory.formula import spec_of
from fsdplab.lessons import cpu_offload as L
from fsdplab.lessons.posts import usable_gib
from fsdplab.settings import GIB


def test_host_link_is_far_below_one_tenth_of_gpu_memory():
    from fsdplab.network import get_link

    # One source for the PCIe figures: comms' link presets.
    assert O.PCIE_BYTES_PER_S == {"PCIe 4.0 x16": 31.5e9, "PCIe 5.0 x16": 63e9}
    assert all(bw == get_link(name).bytes_per_s for name, bw in O.PCIE_BYTES_PER_S.items())
    assert O.bandwidth_ratio("A10") == pytest.approx(600 / 31.5)
    assert O.bandwidth_ratio("A100-80GB") == pytest.approx(2039 / 31.5)     # the SXM card
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
    table = L.cost_table(7.72e9, 8, cpu_adam_seconds_per_param=5e-9)
    assert table["A10"]["slowdown"] < table["A100-80GB"]["slowdown"] < table["H100-SXM"]["slowdown"]
    assert all(row["slowdown"] > 1.3 for row in table.values())


def test_plan_and_dashboard():
    rows = O.plan(80, 70e9, 8, "H100-SXM")
    assert set(rows) == set(O.OPTIONS)
    assert not rows["nothing"]["fits"] and rows["offload"]["fits"] and rows["more GPUs"]["fits"]
    n = rows["more GPUs"]["world_size"]
    assert n > 8 and n & (n - 1) == 0
    assert rows["more GPUs"]["gpu_bytes"] <= usable_gib(80) * GIB == 79 * GIB
    with pytest.raises(ValueError):
        O.plan(0, 7e9, 8)
    dash = L.dashboard()
    assert dash.result["nothing"]["fits"]
    dash.set(params_b=70.0)
    assert not dash.result["nothing"]["fits"]
    axes = dash.figure.axes
    assert len(axes) == 2 and all(ax.get_ylabel() for ax in axes)


def test_time_adamw_step_runs_a_real_step():
    before = torch.get_num_threads()
    out = O.time_adamw_step(1_000_000, repeats=2, chunk=300_000, threads=1)
    assert out["num_params"] == 1_000_000 and out["seconds"] > 0 and out["threads"] == 1
    assert math.isclose(out["seconds_per_param"], out["seconds"] / 1_000_000)
    assert 0 < out["cpu_seconds"] and math.isclose(out["cpu_seconds_per_param"], out["cpu_seconds"] / 1_000_000)
    assert torch.get_num_threads() == before                      # the caller's setting is restored
    assert O.time_adamw_step(200_000, repeats=1, fused=True)["fused"]
    assert O.cpu_cores() >= 1
    with pytest.raises(ValueError):
        O.time_adamw_step(0)


def test_rank_adamw_extrapolation_takes_the_slower_bound():
    cores = O.rank_adamw_seconds_per_param(12e-9, 12, 410e9, 8)
    assert cores["threads_bound"] == pytest.approx(1e-9) and cores["limited_by"] == "cores"
    assert cores["memory_bound"] == pytest.approx(28 * 8 / 410e9)
    memory = O.rank_adamw_seconds_per_param(3e-9, 12, 410e9, 8)
    assert memory["limited_by"] == "memory bandwidth"
    assert memory["seconds_per_param"] == memory["memory_bound"] > memory["threads_bound"]
    loop = O.rank_adamw_seconds_per_param(3e-9, 12, 410e9, 8, O.ADAMW_FOR_LOOP_BYTES_PER_PARAM)
    assert loop["memory_bound"] == pytest.approx(80 * 8 / 410e9) and loop["memory_bound"] > memory["memory_bound"]
    with pytest.raises(ValueError):
        O.rank_adamw_seconds_per_param(1e-9, 0, 410e9, 8)


def test_cost_figure_marks_each_speed_on_its_curve():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = {"slow": 20e-9, "fast": 1e-9}      # the slow one is beyond the old fixed 10 ns axis
    tables = {k: L.cost_table(7.72e9, 8, v) for k, v in speeds.items()}
    fig = plt.figure()
    L.draw_cost(fig, tables, 7.72e9, 8, speeds)
    ax = fig.axes[1]
    curves = [line for line in ax.lines if len(line.get_xdata()) > 2]
    points = [line for line in ax.lines if len(line.get_xdata()) == 1]
    assert len(curves) == len(O.GPUS) and len(points) == len(O.GPUS) * len(speeds)
    for point in points:
        x, y = point.get_xdata()[0], point.get_ydata()[0]
        on = [c for c in curves if c.get_color() == point.get_color()][0]
        xs, ys = list(on.get_xdata()), list(on.get_ydata())
        assert x in xs and ys[xs.index(x)] == pytest.approx(y)
    plt.close(fig)


def test_cost_figure_ns_ticks_leave_room_between_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = {"here": 4.2e-9, "host": 1.56e-9}     # the run whose 1.5 and 2 ns ticks ran together
    fig = plt.figure()
    L.draw_cost(fig, {k: L.cost_table(7.72e9, 8, v) for k, v in speeds.items()}, 7.72e9, 8, speeds)
    ticks = sorted(fig.axes[1].get_xticks())
    assert 1.5 not in ticks and all(b / a >= 2 for a, b in zip(ticks, ticks[1:]))
    assert 1.5 in fig.axes[1].get_yticks()      # the posts' 1.43x still has its tick on the slowdown axis
    plt.close(fig)


def test_loss_temporaries_are_counted_in_fp32_logits():
    logits = 2048 * 151936 * 4
    line = L.loss_temporaries_line(4 * logits + 16384, 2048, 1, 151936)
    assert "= 4.0 x the fp32 logits" in line and "1.16 GiB" in line and "4.64 GiB" in line


def test_cost_figure_stars_the_marked_speed_and_labels_its_lowest_case():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = {"default": 3e-9, "here": 20e-9}
    tables = {k: L.cost_table(7.72e9, 8, v) for k, v in speeds.items()}
    fused = L.cost_table(7.72e9, 8, 0.5e-9)
    fig = plt.figure()
    L.draw_cost(fig, tables, 7.72e9, 8, speeds, marked={"fused": 0.5e-9})
    ax = fig.axes[1]
    stars = [ln for ln in ax.lines if ln.get_marker() == "*" and len(ln.get_xdata()) == 1]
    assert sorted(ln.get_ydata()[0] for ln in stars) == pytest.approx(sorted(r["slowdown"] for r in fused.values()))
    assert "fused" in [t.get_text() for t in ax.get_legend().get_texts()]
    slowdown, name, label = L.lowest_case({**tables, "fused": fused})
    assert label == "fused" and slowdown == fused[name]["slowdown"] < tables["default"][name]["slowdown"]
    assert f"{name}: {slowdown:.2f}x" in [t.get_text() for t in ax.texts]
    plt.close(fig)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_host_bandwidth_needs_a_gpu():
    assert O.measure_host_bandwidth() is None


class _Timed(Exception):
    pass


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize("capability,precision,scaled", [((7, 5), "fp16", True), ((9, 0), "bf16", False)])
def test_offload_run_picks_fp16_with_a_scaler_without_native_bf16(monkeypatch, capability, precision, scaled):
    """offload_run on a (monkeypatched) GPU rank: a T4 gets fp16 and a GradScaler, an H100 bf16 and none.
    The FSDP calls are stubbed: this CPU machine cannot shard onto a GPU."""
    import fsdplab.ranks
    import fsdplab.sharding
    from fsdplab.sharding import build_tiny

    seen = {}
    monkeypatch.setattr(fsdplab.ranks, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(fsdplab.ranks, "mesh", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(fsdplab.sharding, "build_tiny", lambda cfg=None, seed=0, device="cpu": build_tiny(cfg, seed))
    monkeypatch.setattr(fsdplab.sharding, "apply_fsdp", lambda model, mesh, **kw: seen.update(kw) or model)

    def timed(model, opt, cfg, steps, dev, scaler=None):
        seen["scaler"] = scaler
        raise _Timed

    monkeypatch.setattr(O, "_seconds_per_step", timed)
    with pytest.raises(_Timed):
        O.offload_run(steps=1)
    assert seen["precision"] == precision
    assert isinstance(seen["scaler"], torch.amp.GradScaler) == scaled
    with pytest.raises(_Timed):
        O.offload_run(steps=1, precision="fp32")
    assert seen["precision"] == "fp32" and seen["scaler"] is None


# --- lesson 03's module: verdicts computed from numbers, the exercise's checker ---------------------------------

def test_lesson03_verdicts_follow_the_numbers():
    assert L.link_verdict({"A": 19.0, "B": 63.0}).startswith("WRONG")
    assert L.link_verdict({"A": 9.0, "B": 11.0}).startswith("RIGHT")
    assert L.link_verdict({"A": 9.0, "B": 63.0}).startswith("PARTLY")
    assert L.slowdown_verdict(1.8, 63.0).startswith("WRONG")
    assert L.slowdown_verdict(1.35, 20.0).startswith("PARTLY")
    near = L.slowdown_verdict(1.37, 25.7, near="A10 with CPU AdamW(fused=True)")
    assert near.startswith("PARTLY: only A10 with CPU AdamW(fused=True) comes near") and "fastest" not in near
    assert L.slowdown_verdict(1.1, 1.4).startswith("RIGHT")
    tables = {"a": L.cost_table(7.72e9, 8, 2e-9), "b": L.cost_table(7.72e9, 8, 20e-9)}
    low, high = L.slowdown_range(tables)
    assert low == tables["a"]["A10"]["slowdown"] and high == tables["b"]["H100-SXM"]["slowdown"]
    options = L.fsdp_offload_options()
    assert "CPUOffloadPolicy" in options and "CPUOffload" in options and not L.has_disk_tier(options)
    assert L.nvme_verdict(options).startswith("WRONG")
    assert L.has_disk_tier({"NVMeOffloadPolicy": ["nvme_path"]})
    table = L.markdown_table({"#7 x": "WRONG: because", "#15 y": "PARTLY: only with"})
    assert "| #7 x | **WRONG** | because |" in table


def test_lesson03_claim15_label():
    from types import SimpleNamespace

    def reports(plain, ckpt):
        return {"no checkpointing": SimpleNamespace(peak_bytes=plain * GIB),
                "checkpointing": SimpleNamespace(peak_bytes=ckpt * GIB)}

    assert L.claim15_label(reports(28.4, 20.8), 24) == "PARTLY"
    assert L.claim15_label(reports(20.0, 15.0), 24) == "RIGHT"
    assert L.claim15_label(reports(40.0, 30.0), 24) == "WRONG"


def test_lesson03_host_gib_checker_right_and_wrong():
    from fsdplab.exercises import check, keys
    from fsdplab.memory.formula import formula
    from fsdplab.models import PARAM_COUNTS

    assert "03-host-gib" in keys()
    offloaded = L.exact_settings()[2]
    assert offloaded.cpu_offload and offloaded.activation_checkpointing and offloaded.lora_rank is None
    # the exact estimate's resident states, which the lesson passes as `measured`, agree with the formula's
    measured = sum(formula(offloaded).resident.values()) / GIB
    params, ranks = PARAM_COUNTS[offloaded.model_name], offloaded.world_size
    assert check("03-host-gib", 16 * params / ranks / GIB, measured=measured)     # fp32 param + grad + 2 moments
    wrong = check("03-host-gib", 12 * params / ranks / GIB, measured=measured)    # forgot the gradients
    assert not wrong and "Hint" in wrong.message
    assert not check("03-host-gib", ..., measured=measured)
    # all on one rank, GB for GiB, the GPU's share with offload, a bool, text
    for answer in (16 * params / GIB, 16 * params / ranks / 1e9, 0.0, True, "14.4", float("nan")):
        assert not check("03-host-gib", answer, measured=measured), answer


def test_lesson03_quick_reports_keep_the_verdict():
    from fsdplab.lessons.full_finetune import full_finetune_verdict

    reports = L.exact_reports(exact=False)              # the formula: what a quick run (exact_estimates False) uses
    assert list(reports) == list(L.EXACT_LABELS)
    plain, ckpt, off = reports.values()
    assert off.peak_bytes < ckpt.peak_bytes < plain.peak_bytes
    assert dict(off.resident) == dict(ckpt.resident) and L.host_bytes(reports) == sum(ckpt.resident.values())
    # the formula is approximate: near the A10's 22.49 GiB it can say "does not fit" where the exact estimate
    # says "fits with checkpointing" (the lesson's verdict comes from the exact estimate unless asked otherwise)
    assert "Qwen-7B on 8 ranks" in full_finetune_verdict([plain, ckpt])
