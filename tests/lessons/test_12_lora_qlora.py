"""Lesson 12's exercises and measurements on the live ranks: where a LoRA step's peak lands, the uniform-dtype
fix, and the compute dtype of a 4-bit base. The right answers pass; the wrong ones a learner writes each hear
what is wrong, and no message gives the code away."""

import pytest
import torch

import fsdplab
from fsdplab.exercises import check
from fsdplab.lessons import lora_qlora as lesson


def _not_yet(verdict, *words):
    assert not verdict.ok and all(word in verdict.message for word in words), verdict
    for key in ("requires_grad_(", ".float()", "p.data", "\n"):
        assert key not in verdict.message, verdict


def _lora_run(base_dtype, quantize: bool = False) -> dict:
    """On a rank: the lesson's LoRA twin (one block fewer, shorter sequences), sharded, one measured step."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdplab.models import blocks_of, causal_lm
    from fsdplab.nf4 import apply_nf4
    from fsdplab.ranks import mesh, this_rank, world_size

    config = lesson.twin_config(num_layers=2, vocab_size=1024)
    torch.manual_seed(0)
    model = causal_lm(config, device="cpu", dtype=base_dtype)
    if quantize:
        apply_nf4(model, world_size())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh(), mp_policy=policy)
    fully_shard(model, mesh=mesh(), mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    run = lesson.step_report(model, optimizer, lesson.token_batch(config, 2, 128, seed=this_rank()))
    run["per_weight"] = lesson.nf4_bytes_per_weight(model)
    return run


@pytest.fixture(scope="module")
def runs(cluster):
    return {name: cluster.run(_lora_run, dtype, quantize)[0]
            for name, dtype, quantize in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                          ("nf4", torch.bfloat16, True))}


def test_bytes_of_the_bases_and_what_the_gathers_move(runs):
    fp32, bf16, nf4 = runs["fp32"], runs["bf16"], runs["nf4"]
    # the base's shard: 4, 2, then about half a byte per block weight (embedding and head stay bf16)
    assert bf16["base"] * 2 == fp32["base"]
    assert nf4["base"] < 0.7 * bf16["base"]
    # a bf16 policy casts before gathering: the same bytes, in bf16, for both 16- and 32-bit bases
    assert fp32["all_gather"] == bf16["all_gather"] and fp32["gather_dtypes"] == ["bfloat16"]
    assert "uint8" in nf4["gather_dtypes"] and nf4["all_gather"] < 0.6 * bf16["all_gather"]
    assert fp32["reduce_scatter"] == bf16["reduce_scatter"] == nf4["reduce_scatter"] > 0
    # 4 bits per weight, one int8 scaler per 64 weights, one bf16 factor per 256 scalers
    assert nf4["per_weight"] == pytest.approx(0.5 + 1 / 64 + 2 / (64 * 256))
    assert abs(nf4["loss"] - bf16["loss"]) < 0.05 * bf16["loss"]


def test_peak_category(runs):
    run = runs["bf16"]
    assert lesson.peak_category(run) == "activations"
    assert "activations" not in lesson.runs_table({"bf16 base": run})    # the table printed before the check
    assert check("12-peak-category", "activations", run=run).ok
    _not_yet(check("12-peak-category", "parameters", run=run), "parameters held", "grows with tokens")
    _not_yet(check("12-peak-category", "optimizer_state", run=run), "optimizer_state held")
    _not_yet(check("12-peak-category", "weights", run=run), "answer with one of")


def _fix(how):
    def fix(model):
        if how == "trainable fp32":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        elif how == "trainable bf16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.bfloat16()
        elif how == "everything fp32":
            model = model.float()
        elif how == "freeze the norms":
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.requires_grad_(False)
        elif how == "raises":
            model.no_such_module.float()
        return model
    return fix


def test_uniform_dtype_right_answers(cluster):
    verdict = check("12-uniform-dtype", _fix("trainable fp32"), cluster=cluster)
    assert verdict.ok and "trainable parameters all torch.float32" in verdict.message, verdict
    assert "frozen base left torch.bfloat16" in verdict.message, verdict
    assert check("12-uniform-dtype", _fix("trainable bf16"), cluster=cluster).ok


def test_uniform_dtype_wrong_answers(cluster):
    _not_yet(check("12-uniform-dtype", _fix("nothing"), cluster=cluster),
             "still raised", "uniform original parameter dtype")
    _not_yet(check("12-uniform-dtype", _fix("everything fp32"), cluster=cluster),
             "frozen base grew", "cast the frozen weights too")
    _not_yet(check("12-uniform-dtype", _fix("freeze the norms"), cluster=cluster),
             "no longer do", "Change their dtype")
    _not_yet(check("12-uniform-dtype", _fix("raises"), cluster=cluster), "raised on rank", "AttributeError")
    _not_yet(check("12-uniform-dtype", None, cluster=cluster), "no answer yet")
    _not_yet(check("12-uniform-dtype", 3, cluster=cluster), "expected a function")
    _not_yet(check("12-uniform-dtype", _fix("trainable fp32"), cluster=fsdplab.Cluster(2)),
             "stopped", "cluster.start()")


def test_compute_dtype(cluster):
    config = lesson.twin_config(num_layers=2, vocab_size=512)
    kw = dict(cluster=cluster, config=config, outlier_scale=300.0)
    right = check("12-compute-dtype", torch.bfloat16, **kw)
    assert right.ok and "fits in bfloat16" in right.message, right
    _not_yet(check("12-compute-dtype", torch.float16, **kw), "the loss is nan", "does not fit in float16", "65504")
    _not_yet(check("12-compute-dtype", torch.float32, **kw), "finite, but", "twice the bytes")
    _not_yet(check("12-compute-dtype", "bf16", **kw), "answer with torch.float16")
    # without the outlier fp16 holds the twin's activations: the NaN is the outlier's, not fp16's alone
    assert check("12-compute-dtype", torch.float16, cluster=cluster, config=config, outlier_scale=1.0).ok


def test_nf4_sizes_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"16,384 weights, which cannot be NF4 shards over 2 rank\(s\)"):
        lesson.twin_config(hidden_size=128)
    with pytest.raises(ValueError, match=r"multiple of 16,384 x 4"):
        lesson.twin_config(hidden_size=256, intermediate_size=320, world_size=4)
