"""Lesson 06's package code: Qwen-7B v1's own layout and its LoRA size, the exercise checkers (a right and a
wrong answer each), the verdicts of claims 15 and 16, reuse of estimates, and a parameters cell papermill
parses line by line."""

import logging
from pathlib import Path
from types import SimpleNamespace

import papermill as pm
import pytest

from fsdplab.exercises import check
from fsdplab.memory.formula import formula
from fsdplab.lessons import full_finetune as F, qwen7b_lora as Q
from fsdplab.lessons.full_finetune import full_finetune_settings
from fsdplab.lessons.posts import CARD_RESERVE_GIB
from fsdplab.models import PARAM_COUNTS, hf_config
from fsdplab.settings import GIB

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_qwen7b_lora_8xA10.ipynb"


def v1_lora_by_hand(rank):
    c = hf_config("qwen-7b")
    h, i = c.hidden_size, c.intermediate_size
    per_layer = (h + 3 * h) + (h + h) + 2 * (h + i) + (i + h)        # c_attn, attn.c_proj, w1, w2, mlp.c_proj
    return rank * per_layer * c.num_hidden_layers


def test_qwen_v1_layout_holds_the_same_weights_and_a_smaller_lora():
    counts = Q.qwen_v1_counts(64)
    assert counts["base"] == PARAM_COUNTS["qwen-7b"]
    assert counts["lora"] == v1_lora_by_hand(64)
    qwen2_layout = formula(Q.POSTS_SETTING).detail["trainable_params"]      # three q/k/v adapters
    assert counts["lora"] < qwen2_layout


def test_lora_params_checker():
    assert check("06-lora-params", v1_lora_by_hand(16), rank=16)
    wrong = check("06-lora-params", formula(Q.setting(lora_rank=16, lora_alpha=32)).detail["trainable_params"], rank=16)
    assert not wrong and "c_attn" in wrong.message


def test_shard_gib_checker():
    report = formula(Q.POSTS_SETTING)                                   # has the same resident shards as estimate
    assert check("06-shard-gib", report.resident["parameters"] / GIB, report=report)
    assert not check("06-shard-gib", 4 * PARAM_COUNTS["qwen-7b"] / GIB, report=report)     # forgot to shard
    sixteen = formula(Q.setting(world_size=16))                          # what the lesson's exercise recomputes
    right = sixteen.resident["parameters"] / GIB
    assert check("06-shard-gib", right, report=sixteen)
    # the 8-rank figure, fp16 bytes, GB for GiB, the adapters only, a bool, text
    for answer in (report.resident["parameters"] / GIB, right / 2, right * GIB / 1e9, 0.1, True, "1.8"):
        assert not check("06-shard-gib", answer, report=sixteen), answer


def reports(*gib):
    return [SimpleNamespace(peak_bytes=g * GIB) for g in gib]


def test_claim15_word():
    assert F.claim15_word(reports(28.4, 20.8), 24) == "partly"
    assert F.claim15_word(reports(40, 30), 24) == "wrong"


def test_claim16_verdict_is_computed():
    text = Q.claim16_verdict(10.5, {(2048, 1): 14.7, (4096, 1): 18.8}, source={(4096, 1): "formula"})
    assert text.startswith("plausible with FSDP1") and "seq 4096 x 1 (formula)" in text and "10.5" in text
    assert Q.claim16_verdict(18.0, {(2048, 1): 22.0}).startswith("right")
    assert Q.claim16_verdict(10.5, {(2048, 1): 14.7}).startswith("not reproduced")


def test_full_finetune_variant_reuses_the_claim15_estimate():
    assert Q.setting(**Q.VARIANTS["full fine-tune"]) == full_finetune_settings()[1]
    assert Q.setting(**Q.VARIANTS["posts"]) == Q.POSTS_SETTING


def test_parameters_parse_and_world_size_is_declared(caplog):
    with caplog.at_level(logging.WARNING):
        declared = pm.inspect_notebook(str(NOTEBOOK))
    assert "Unable to parse" not in caplog.text
    assert {"world_size", "exact_seq_lens", "exact_variants", "mini_steps"} <= set(declared)


def test_fixed_statements_stay_fixed():
    text = NOTEBOOK.read_text()
    assert "one_gpu < gpu_gib < states" not in text and "159_907_840" not in text and "161_480_704" not in text
    # the one-card verdict is the H200's measurement, not a sum; KiB are KiB
    assert "by addition" not in text and "a few hundred MiB" not in text and r'KB\"' not in text   # KiB, not KB
    assert "Activation checkpointing and sequence length matter most" not in text


def test_one_card_verdict_is_what_the_h200_measured():
    one = Q.one_gpu_measured(22.49)
    assert one["case"] == "qwen7b-lora64-ac-fp16" and not one["fits"] and one["allocated"] > 22.49
    assert "25.26 GiB on the device" in one["words"] and "does not fit in 22.49 GiB" in one["words"]
    assert "0.82 GiB" in one["words"]                       # the context as measured, not a guess
    assert "the live tensors would" in Q.one_gpu_measured(24.0)["words"]
    assert Q.one_gpu_measured(40.0)["fits"]
    text = Q.summary_markdown(claim15="partly", ff_verdict="x.", one_gpu=one, lora_16bit_gib=16.8, claim16="right",
                              view={}, v1_lora=1, lora_gap=1, first=2.0, last=0.1, mini_gap=0.0, mini_accuracy=1.0)
    assert "25.26 GiB" in text and "sharding is needed too" in text


def test_knob_line_follows_the_bars():
    bars = {name: formula(Q.setting(**kw)).peak_bytes / GIB for name, kw in Q.VARIANTS.items()}
    moved, small, over = Q.knob_line(bars, 22.49, {"full fine-tune": 20.8}).splitlines()
    largest = max((n for n in bars if n != "posts"), key=lambda n: abs(bars[n] - bars["posts"]))
    assert moved.split(": ", 1)[1].startswith(largest + " ")
    assert "r=8" in small and "attention only" in small and "r=8" not in moved
    assert "SHARD_GRAD_OP" in over and "micro-batch 4" in over and "(exact 20.8)" in over and "seq 4096" not in over
    assert Q.knob_line(bars, 80.0).endswith("none.")


def test_one_fit_rule_for_lessons_03_and_06():
    assert Q.usable_gib(22.49) == pytest.approx(22.49 - CARD_RESERVE_GIB)
    assert Q.usable_gib(22.49) < formula(Q.setting(batch_size=4)).peak_bytes / GIB < 22.49   # over, though < card
    from fsdplab.memory import gpu_measured

    assert "(†)" not in gpu_measured.summary(Q.h200_rows())
    assert "(†)" in gpu_measured.summary() == gpu_measured.summary(gpu_measured.ROWS)   # where a row is marked


def test_estimates_read_back_and_deduplicated_start_no_worker(tmp_path, monkeypatch):
    # an estimate this run already made (FSDPLAB_ESTIMATE_CACHE) is read back, and a setting listed twice is
    # looked up once: with every setting cached, no worker process starts
    from fsdplab import memory
    from fsdplab.memory import cache as estimate_cache
    from fsdplab.memory.sweep import start_estimates

    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    plain, ckpt = full_finetune_settings()
    for setting, peak in ((plain, 28), (ckpt, 21)):
        path = estimate_cache.cache_path(setting)
        path.write_text(memory.MemoryReport(peak_bytes=peak, by_category={}, world_size=8).to_json())
    seen = []
    pending = start_estimates([plain, ckpt, plain], on_done=lambda s, r: seen.append(r.peak_bytes))
    assert pending._pool is None
    reports = pending.result()
    assert [r.peak_bytes for r in reports] == [28, 21, 28] and sorted(seen) == [21, 28, 28]
    assert "reused" in reports[0].notes[-1] and pending.result() == reports and len(seen) == 3


def test_estimates_that_failed_fail_again_when_asked_twice(tmp_path, monkeypatch):
    # a failed estimate is an error at every result(), never a list of None the second time
    from fsdplab.memory.sweep import start_estimates

    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    bad = full_finetune_settings()[0].replace(model="tiny", world_size=2, lora_rank=8, lora_targets=("no_such_layer",))
    pending = start_estimates([bad], workers=1)
    with pytest.raises(Exception) as first:
        pending.result()
    with pytest.raises(RuntimeError, match="failed earlier") as second:
        pending.result()
    assert second.value.__cause__ is first.value


def test_the_miniatures_gap_bound_is_per_device_and_the_notebook_uses_it():
    """The estimate is traced through CPU SDPA: on CPU ranks the bound stays 2%; on GPU ranks the CUDA kernels keep
    other auxiliaries for backward, and the bound says so; a backend the lab does not run is a ValueError."""
    import nbformat

    assert Q.mini_gap_bound("gloo") == 0.02
    assert Q.mini_gap_bound("nccl") > Q.mini_gap_bound("gloo")
    with pytest.raises(ValueError):
        Q.mini_gap_bound("mpi")
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK, 4).cells if c.cell_type == "code")
    assert "Q.mini_gap_bound(cluster.backend)" in source and "mini_gap < mini_gap_bound" in source
    assert "mini_gap < 0.02" not in source


def test_the_lesson_shows_what_an_h200_measured_of_its_model():
    from fsdplab.memory import gpu_measured

    rows = Q.h200_rows()
    assert rows and all(r.model == "qwen-7b" and not r.not_comparable for r in rows)
    text = gpu_measured.table(rows)
    assert all(r.case in text for r in rows) and "torch 2.11.0+cu130" in gpu_measured.summary()
