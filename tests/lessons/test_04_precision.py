"""fsdplab.lessons.precision: fp16 range facts on real tensors, and the mixed-precision behaviour of real ranks."""

import math

import pytest
import torch

from fsdplab.lessons import precision as P
from fsdplab.models import TinyConfig

CFG = TinyConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2, seq_len=16)


@pytest.mark.parametrize("capability,expected", [((7, 5), "fp16"), ((7, 0), "fp16"), ((8, 0), "bf16"),
                                                 ((8, 6), "bf16"), ((9, 0), "bf16")])
def test_auto_precision_is_bf16_only_with_native_bf16(monkeypatch, capability, expected):
    from fsdplab.settings import auto_precision, resolve_precision

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    assert resolve_precision("auto", "cuda:1") == expected and asked == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert auto_precision() == expected                       # no device: the current GPU
    assert resolve_precision("fp32", "cuda:0") == "fp32"      # a named precision stays as it is


def test_auto_precision_on_cpu_ranks_and_mistakes(monkeypatch):
    from fsdplab.settings import auto_precision, resolve_precision

    def no_gpu(*args, **kwargs):
        raise AssertionError("a CPU rank asked CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert resolve_precision("auto", "cpu") == "bf16" and auto_precision("cpu", cpu="fp32") == "fp32"
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'fp16', 'auto'\]"):
        resolve_precision("fp8", "cpu")


def test_loss_scaler_only_for_fp16():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert P.loss_scaler("bf16", "cpu") is None and P.loss_scaler("fp32", "cpu") is None
    scaler = P.loss_scaler("fp16", torch.device("cpu"))
    assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == 2.0 ** 16
    assert isinstance(P.loss_scaler("fp16", "cpu", sharded=True), ShardedGradScaler)
    with pytest.raises(ValueError, match="precision must be one of"):
        P.loss_scaler("auto", "cpu")                          # resolve "auto" on the rank first


def test_dtype_table_and_adam_eps():
    rows = {r["dtype"]: r for r in P.dtype_table()}
    assert rows["fp16"]["max"] == 65504 and rows["fp16"]["smallest_subnormal"] == 2.0 ** -24
    assert rows["fp16"]["adam_eps_1e-8"] == 0.0
    assert rows["bf16"]["adam_eps_1e-8"] > 0 and rows["bf16"]["max"] > 1e38


def test_norm_kernels_hold_in_fp16_until_the_input_overflows():
    out = P.norm_errors([1, 1000, 1e5], dim=256)
    for name in ("LayerNorm", "RMSNorm"):
        fp16 = out["errors"][(name, "fp16")]
        assert fp16[0] < 1e-3 and fp16[1] < 1e-3 and math.isnan(fp16[2])   # 1e5 RMS: the fp16 input holds inf
    assert out["errors"][("naive RMSNorm", "fp16")][1] > 0.5                # x*x overflowed inside the norm
    assert out["input_inf"]["fp16"][:2] == [0.0, 0.0] and out["input_inf"]["fp16"][2] > 0
    assert all(math.isfinite(e) and e < 0.02 for n in P.NORM_MODULES for e in out["errors"][(n, "bf16")])
    with pytest.raises(ValueError):
        P.norm_errors([1], norms=("BatchNorm",))


def test_curve_spread_skips_nan():
    from fsdplab.lessons.mixed_precision import curve_spread

    spread = curve_spread({"fp32": [1.0, 2.0], "bf16": [1.1, 2.0], "fp16 model": [1.0, float("nan")]})
    assert spread["bf16"] == pytest.approx(0.1) and spread["fp16 model"] == 0.0


def test_curve_line_says_where_a_curve_turns_nan():
    from fsdplab.lessons.mixed_precision import curve_line

    nan = float("nan")
    fp32 = [4.0, 3.5, 3.0]
    assert "max |diff vs fp32| 1.00e-01" in curve_line("bf16", [4.0, 3.6, 3.0], fp32)
    late = curve_line("fp16 model", [4.0, nan, nan], fp32)     # max() alone would print 0.00e+00 here
    assert "last nan" in late and "NaN from step 1; before it max |diff vs fp32| 0.00e+00" in late
    assert "NaN from step 0" in curve_line("fp16", [nan, nan, nan], fp32)


def test_loss_curves_tick_whole_steps():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from fsdplab.lessons.mixed_precision import draw_curves

    fp32 = [4.0 - 0.1 * i for i in range(20)]         # the lesson's 20 steps, at its figure size
    fig = plt.figure(figsize=(11, 4.2))
    draw_curves(fig, {"fp32": fp32, "bf16": [v + 1e-3 for v in fp32],
                      "fp16 model": [fp32[0]] + [float("nan")] * 19})
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    plt.close(fig)


def test_loss_scale_checker_and_verdicts():
    from fsdplab.exercises import check
    from fsdplab.lessons import mixed_precision as M

    grads = P.tiny_gradients(CFG)
    low, high = M.safe_loss_scales(grads, 1e-4)
    assert P.underflow_fraction(grads, "fp16", low, 1e-4) == 0 < P.underflow_fraction(grads, "fp16", low / 2, 1e-4)
    assert check("04-loss-scale", low, grads=grads, shrink=1e-4).ok
    too_small = check("04-loss-scale", 1.0, grads=grads, shrink=1e-4)
    assert not too_small.ok and "scale up" in too_small.message
    too_big = check("04-loss-scale", high * 4, grads=grads, shrink=1e-4)
    assert not too_big.ok and "Scale down" in too_big.message
    assert not check("04-loss-scale", None, grads=grads, shrink=1e-4).ok
    # What else a learner types: the safe scale with a minus sign, nan or inf, zero, a yes, text.
    for wrong in (-low, -high * 4, float("nan"), float("inf"), 0.0, True, "2**10"):
        assert not check("04-loss-scale", wrong, grads=grads, shrink=1e-4).ok, wrong
    adam = P.adam_state_dtypes()
    assert M.claim9_verdict(adam) == "PARTLY TRUE"
    assert M.claim9_verdict({k: {"state_dtype": "float32"} for k in adam}) == "TRUE"
    assert M.claim10_verdict("AttributeError: x", ["bfloat16"]) == "WRONG"
    assert M.claim10_verdict("no error", ["float32"]) == "TRUE"


def test_reduce_bytes_checker_takes_the_remeasured_bytes_only():
    from fsdplab.exercises import check

    params, measured = 30_080, 30_080 * 2          # what the lesson's cell measures with reduce_dtype=bf16
    assert check("04-reduce-bytes", measured, measured=measured, params=params, dtypes=["bfloat16"]).ok
    # the fp32 bytes before the change, per rank divided by N, params only, bits not bytes, a bool, text, nan
    for wrong in (4 * params, measured / 2, params, 16 * params, True, "60160", float("nan"), -measured):
        verdict = check("04-reduce-bytes", wrong, measured=measured, params=params, dtypes=["bfloat16"])
        assert not verdict.ok, wrong
    assert "reduce_dtype" in check("04-reduce-bytes", 4 * params, measured=measured, params=params,
                                   dtypes=["bfloat16"]).message


def test_underflow_fraction():
    grads = torch.tensor([1e-9, 1e-3])
    assert P.underflow_fraction(grads, "fp16") == 0.5
    assert P.underflow_fraction(grads, "fp16", loss_scale=2.0 ** 16) == 0.0
    assert P.underflow_fraction(grads, "bf16") == 0.0
    assert (P.tiny_gradients(CFG) != 0).all()


def test_adam_state_follows_the_model_dtype():
    out = P.adam_state_dtypes(grad_value=1e-4)
    assert out["fp32"]["state_dtype"] == "float32" and out["fp32"]["nonfinite_params"] == 0
    assert out["fp16"]["state_dtype"] == "float16" and out["fp16"]["exp_avg_sq"] == 0.0
    assert out["fp16"]["nonfinite_params"] == out["fp16"]["num_params"]


def test_probe_norms_records_dtypes_without_ranks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    records = []
    handles = P.probe_norms(model, records)
    model(torch.randn(2, 4, dtype=torch.bfloat16))
    assert records == [{"module": "1", "weight": "bfloat16", "input": "bfloat16", "output": "bfloat16"}]
    for h in handles:
        h.remove()


def test_norms_run_in_param_dtype_despite_fp32_reduce(cluster):
    records = cluster.run(P.norm_dtypes_on_rank, "bf16", "fp32", cfg=CFG, verbose=False)
    assert all(r["weight"] == "bfloat16" for rank_rows in records for r in rank_rows)
    assert len(records[0]) == 2 * CFG.num_layers + 1
    kept = cluster.run(P.norm_dtypes_on_rank, "fp16", "fp32", keep_norms_fp32=True, cfg=CFG, verbose=False)
    assert all(r["weight"] == "float32" and r["input"] == "float32" and r["output"] == "float16" for r in kept[0])


def test_fsdp1_rejects_a_dtype_and_casts_layernorm(cluster):
    out = cluster.run(P.fsdp1_mixed_precision_on_rank, CFG)[0]
    assert out["posts_call"].startswith("AttributeError") and "param_dtype" in out["posts_call"]
    assert out["norms"] and all(r["weight"] == "float16" for r in out["norms"])


def test_per_rank_scaler_tears_the_step_and_agreeing_one_does_not(cluster):
    per_rank = cluster.run(P.scaler_agreement_on_rank, "per-rank", steps=3, inf_step=1, cfg=CFG)
    agree = cluster.run(P.scaler_agreement_on_rank, "agree", steps=3, inf_step=1, cfg=CFG)
    assert [r["stepped"][1] for r in per_rank] == [True, False]
    assert per_rank[0]["scales"][-1] == 2 * per_rank[1]["scales"][-1]
    assert [r["stepped"][1] for r in agree] == [False, False] and agree[0]["scales"] == agree[1]["scales"]
    fsdp2 = cluster.run(P.fsdp2_scaler_on_rank, cfg=CFG)
    assert fsdp2[0]["scale"] == fsdp2[1]["scale"]
    with pytest.raises(ValueError):
        P.scaler_agreement_on_rank("sometimes")


def test_reduce_error_by_dtype(cluster):
    fp32 = cluster.run(P.reduce_error_on_rank, "fp32", 1.0, CFG)
    fp16 = cluster.run(P.reduce_error_on_rank, "fp16", 1.0, CFG)
    assert fp32[0] == fp32[1] and fp32[0]["rel_error"] < 1e-6
    assert 1e-5 < fp16[0]["rel_error"] < 1e-2 and fp16[0]["nonfinite"] == 0


def test_a_group_of_the_cluster_runs_alone(cluster):
    # lesson 04 starts one cluster and runs smaller groups on its first ranks; the others return None
    from fsdplab.lessons.mixed_precision import on_group

    alone = cluster.run(P.reduce_error_on_rank, "fp32", 1.0, CFG, group_size=1)
    assert alone[1] is None and alone[0]["world_size"] == 1 and alone[0]["rel_error"] < 1e-6
    curves = on_group(cluster, 1, P.train_curve_on_rank, "fp32", 2, CFG)
    assert len(curves) == 1 and all(math.isfinite(v) for v in curves[0])
    assert on_group(cluster, 1, P.scaler_agreement_on_rank, "agree", steps=2, inf_step=1, inf_rank=0,
                    cfg=CFG)[0]["stepped"] == [True, False]


def test_fp16_model_goes_nan_and_bf16_trains(cluster):
    nan_run = cluster.run(P.train_curve_on_rank, "fp16 model", 3, CFG)[0]
    assert math.isfinite(nan_run[0]) and math.isnan(nan_run[-1])
    bf16 = cluster.run(P.train_curve_on_rank, "bf16", 8, CFG)[0]
    assert all(math.isfinite(v) for v in bf16) and bf16[-1] < bf16[0]
    with pytest.raises(ValueError):
        P.train_curve_on_rank("fp8")
