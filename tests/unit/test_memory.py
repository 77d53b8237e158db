"""fsdplab.memory: the formula, the fake-tensor estimate and live measurement agree where they must."""

import dataclasses
import json
import math

import pytest

from fsdplab._torch_private import CATEGORIES
from fsdplab.display import memory_dashboard
from fsdplab.memory.formula import formula, spec_of
from fsdplab.memory import MemoryReport, estimate, measure_setting
from fsdplab.settings import GIB, TrainSetting


def test_lora_trainable_count_of_qwen2_7b():
    assert formula(model="qwen2-7b", world_size=8, lora_rank=64).detail["trainable_params"] == 161_480_704


def test_model_state_bytes_per_parameter():
    p = 60_200_000                               # ResNet152: a bare parameter count
    ddp = formula(model=p, world_size=8, strategy="ddp", precision="bf16")
    adam_step = 4                                # one fp32 step counter per parameter tensor
    assert (ddp.resident["parameters"], ddp.resident["gradients"], ddp.resident["optimizer_state"]) == \
        (2 * p, 2 * p, 12 * p + adam_step)
    z1 = formula(model=p, world_size=8, strategy="zero1", precision="bf16").resident
    z2 = formula(model=p, world_size=8, strategy="zero2", precision="bf16").resident
    assert z1["optimizer_state"] == 12 * p // 8 and z1["gradients"] == 2 * p
    assert z2["gradients"] == 2 * p // 8
    full = formula(model=p, world_size=8, strategy="full_shard", precision="fp32").resident
    assert sum(full.values()) == 16 * math.ceil(p / 8) + adam_step
    sgd = formula(model=p, world_size=8, strategy="ddp", precision="fp32", optimizer="sgd").resident
    assert sgd["optimizer_state"] == 4 * p
    # Hybrid sharding divides by the shard group, not the world.
    hsdp = formula(model=p, world_size=16, strategy="hybrid_shard", shard_group_size=8).resident
    assert hsdp["parameters"] == full["parameters"]


def test_activation_model_is_korthikanti():
    s, b = 2048, 1
    spec = spec_of("qwen-7b")
    report = formula(model="qwen-7b", world_size=8, seq_len=s, batch_size=b, attention="eager")
    h, a = spec.hidden, spec.num_heads
    assert report.detail["activations_per_layer"] == int(s * b * h * (34 + 5 * a * s / h))
    # Flash / SDPA kernels never store the a*s*s score matrices: the 5*a*s/h term goes.
    assert formula(model="qwen-7b", world_size=8, seq_len=s).detail["activations_per_layer"] == s * b * h * 34
    ckpt = formula(model="qwen-7b", world_size=8, seq_len=s, activation_checkpointing=True)
    assert ckpt.by_category["activations"] < report.by_category["activations"] / 5
    assert formula(model="qwen-7b", world_size=8, strategy="shard_grad_op").by_category["parameters"] > \
        formula(model="qwen-7b", world_size=8, strategy="full_shard").by_category["parameters"]


def test_bad_settings_raise_value_errors():
    with pytest.raises(ValueError, match="strategy"):
        formula(model="tiny", world_size=2, strategy="zero9")
    with pytest.raises(ValueError, match="unknown model"):
        formula(model="gpt-9", world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        estimate(model="tiny", world_size=0)
    with pytest.raises(ValueError, match="exact estimates"):
        estimate(model="tiny", world_size=2, strategy="zero1")
    with pytest.raises(ValueError, match="multiple of shard_group_size"):
        TrainSetting(world_size=12, strategy="hybrid_shard", shard_group_size=8)
    with pytest.raises(ValueError, match="lora_rank"):
        TrainSetting(lora_rank=0)


@pytest.mark.parametrize("world_size, extra", [(2, {}), (3, {}), (2, dict(lora_rank=8, base_dtype="bf16")),
                                               (2, dict(lora_rank=8, base_dtype="bf16", adapter_dtype="bf16")),
                                               (3, dict(base_dtype="fp16", precision="fp16"))])
def test_estimate_and_formula_agree_exactly_on_resident_shards(world_size, extra):
    # World size 3 pads: kv projections have 64 rows, each rank keeps ceil(64/3) = 22.
    est = estimate(model="tiny", world_size=world_size, seq_len=32, progress=False, **extra)
    form = formula(model="tiny", world_size=world_size, seq_len=32, **extra)
    assert est.resident == form.resident
    assert (form.detail["padding_bytes"] > 0) == (world_size == 3)
    assert est.peak_bytes == sum(est.by_category.values())


@pytest.mark.parametrize("extra", [dict(strategy="hybrid_shard", shard_group_size=2),
                                   dict(strategy="hybrid_shard", shard_group_size=2, precision="fp32", lora_rank=8),
                                   dict(strategy="ddp", precision="fp32"), dict(strategy="ddp", lora_rank=8),
                                   dict(strategy="replicate"), dict(strategy="replicate", lora_rank=8)])
def test_exact_hsdp_and_ddp_agree_with_the_formula(extra):
    est = estimate(model="tiny", world_size=4, seq_len=32, progress=False, **extra)
    form = formula(model="tiny", world_size=4, seq_len=32, **extra)
    if extra["strategy"] == "ddp" and extra.get("precision") != "fp32":
        # The formula's DDP is the ZeRO paper's 2 + 2 + 12 bytes; DDP under autocast keeps fp32 weights and
        # gradients and m, v: the same bytes in all, another split.
        assert sum(est.resident.values()) == sum(form.resident.values())
        assert est.resident["gradients"] == 2 * form.resident["gradients"]
    else:
        assert est.resident == form.resident
    shards = extra.get("shard_group_size", 1)
    assert est.resident["parameters"] == estimate(model="tiny", world_size=shards, seq_len=32, progress=False,
                                                  **{k: v for k, v in extra.items() if k not in
                                                     ("strategy", "shard_group_size")}).resident["parameters"]
    assert any(extra["strategy"] in note for note in est.notes)


def test_lora_dropout_keeps_the_adapted_inputs_and_16_bit_adapters_halve_their_state():
    plain = estimate(model="tiny", world_size=2, seq_len=64, lora_rank=8, progress=False)
    dropped = estimate(model="tiny", world_size=2, seq_len=64, lora_rank=8, lora_dropout=0.1, progress=False)
    assert dropped.category_peaks["activations"] > plain.category_peaks["activations"]
    assert dropped.resident == plain.resident and any("LoRA dropout 0.1" in n for n in dropped.notes)
    half = estimate(model="tiny", world_size=2, seq_len=64, lora_rank=8, adapter_dtype="bf16", progress=False)
    assert 2 * half.resident["gradients"] == plain.resident["gradients"]
    assert any("bf16 LoRA adapters" in n for n in half.notes)
    with pytest.raises(ValueError, match="set lora_rank"):
        TrainSetting(lora_dropout=0.1)
    with pytest.raises(ValueError, match="probability"):
        TrainSetting(lora_rank=8, lora_dropout=1.5)


def test_accumulating_without_sync_holds_the_unsharded_gradients_until_the_last_micro_batch():
    one = estimate(model="tiny", world_size=2, seq_len=64, progress=False)
    synced = estimate(model="tiny", world_size=2, seq_len=64, grad_accum=4, progress=False)
    held = estimate(model="tiny", world_size=2, seq_len=64, grad_accum=4, no_sync=True, progress=False)
    whole = 2 * one.resident["gradients"]                # 2 ranks: a shard each
    # synced, the sharded gradients accumulate; held, the unsharded ones (under 'other': the tracker's 'Temp')
    assert synced.category_peaks["gradients"] > one.category_peaks["gradients"]
    assert held.category_peaks["other"] - synced.category_peaks["other"] >= 0.85 * whole
    assert held.peak_bytes > synced.peak_bytes
    assert synced.resident == held.resident == one.resident
    assert any("no_sync" in n for n in held.notes)
    with pytest.raises(ValueError, match="grad_accum to 2 or more"):
        TrainSetting(no_sync=True)


def test_fsdp1_is_traced_itself_and_modelled_as_its_fsdp2_layout():
    one = dict(model="tiny", world_size=2, seq_len=64, precision="fp32")
    fsdp1 = estimate(strategy="fsdp1_full_shard", progress=False, **one)
    fsdp2 = estimate(strategy="full_shard", progress=False, **one)
    assert fsdp1.resident["parameters"] == fsdp2.resident["parameters"]   # a shard of the whole model each
    assert fsdp1.peak_bytes != fsdp2.peak_bytes and any("FSDP1" in n for n in fsdp1.notes)
    assert formula(strategy="fsdp1_shard_grad_op", **one).resident == formula(strategy="shard_grad_op",
                                                                               **one).resident
    with pytest.raises(ValueError, match="FSDP1 with LoRA"):
        TrainSetting(strategy="fsdp1_full_shard", lora_rank=8)


def test_a_16_bit_base_halves_the_frozen_weights():
    fp32 = formula(model="qwen-7b", world_size=8, lora_rank=64).resident
    bf16 = formula(model="qwen-7b", world_size=8, lora_rank=64, base_dtype="bf16").resident
    adapters = bf16["gradients"]                 # fp32 LoRA weights: their sharded gradients have the same bytes
    assert bf16["parameters"] - adapters == pytest.approx((fp32["parameters"] - adapters) / 2, rel=1e-6)
    assert bf16["optimizer_state"] == fp32["optimizer_state"]
    # Llama-2-7B trained in pure bf16 under DDP: 2 + 2 + 4 bytes per parameter, no master copy.
    pure = formula(model="llama2-7b", world_size=8, strategy="ddp", base_dtype="bf16").resident
    tensors = 32 * 9 + 3                         # 9 weights per block; embedding, final norm, lm_head
    assert sum(pure.values()) == 8 * 6_738_415_616 + 4 * tensors


def test_cpu_offload_is_modelled_and_said():
    base = estimate(model="tiny", world_size=2, seq_len=32, progress=False)
    off = estimate(model="tiny", world_size=2, seq_len=32, cpu_offload=True, progress=False)
    assert off.peak_bytes < base.peak_bytes
    assert any("cpu offload is modelled" in n for n in off.notes)
    assert off.by_category["optimizer_state"] == 0


def test_report_methods():
    report = formula(model="qwen-7b", world_size=8)
    assert report.fits(1000) and not report.fits(1)
    data = json.loads(report.to_json())
    assert set(data["by_category"]) == set(CATEGORIES) and data["peak_bytes"] == report.peak_bytes
    assert MemoryReport.from_dict(data) == report
    assert "peak" in report.table(gpu_mem_gib=24) and "GiB per GPU" in report.table(gpu_mem_gib=24)


def test_cli_json(capsys):
    from fsdplab.runner.cli import main

    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--seq-len", "32", "--lora-rank", "8",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(data["by_category"]) == set(CATEGORIES)
    assert data["peak_bytes"] == sum(data["by_category"].values()) and data["fits"] is True


def _close(a, b, rel=0.02):
    return abs(a - b) <= rel * max(a, b, 1)


def _match_live(cluster, est, **setting) -> None:
    """The estimate must match live ranks category by category. On gloo a collective's buffers are freed when
    gloo's worker thread lets go of them, which on a busy machine can be after the next unit's buffers are made:
    such a late free only ever adds to a rank's count (seen on one rank in about one run of three with
    grad_accum=2, 81-148 KiB more 'other'). So the program's own numbers are the smallest a rank shows: up to
    three measurements are taken, and each category's smallest value over every rank of them must match."""
    reports = []
    for _ in range(3):
        attempt = cluster.run(measure_setting, **setting)
        if not any(_live_mismatches(report, est) for report in attempt):
            return
        reports += attempt
    smallest = min(reports, key=lambda r: r.peak_bytes)
    smallest = dataclasses.replace(smallest, category_peaks={
        name: min(r.category_peaks[name] for r in reports) for name in CATEGORIES})
    problems = [p for p in _live_mismatches(smallest, est) if p[0] != "resident"]
    problems += [("resident", r.resident, est.resident) for r in reports if r.resident != est.resident][:1]
    assert not problems, (f"the estimate matched no rank's smallest live numbers over {len(reports)} rank "
                          f"measurements: {problems}; every mismatch: {[_live_mismatches(r, est) for r in reports]}")


def _live_mismatches(report, est) -> list:
    problems = [] if report.resident == est.resident else [("resident", report.resident, est.resident)]
    problems += [(name, report.category_peaks[name], est.category_peaks[name]) for name in CATEGORIES
                 if not _close(report.category_peaks[name], est.category_peaks[name])]
    # The split at the single peak moment is not compared: on gloo, when two moments of a step are
    # within a few % of each other, which one wins depends on when gloo's worker thread releases
    # the collectives' buffers, and it changes from run to run (each category's own peak does not).
    if not _close(report.peak_bytes, est.peak_bytes, rel=0.05):
        problems.append(("peak", report.peak_bytes, est.peak_bytes))
    return problems


@pytest.mark.parametrize("setting", [dict(), dict(lora_rank=8), dict(activation_checkpointing=True),
                                     dict(strategy="ddp", precision="fp32"), dict(strategy="ddp", lora_rank=8),
                                     dict(strategy="ddp"), dict(strategy="replicate"), dict(attention="eager"),
                                     dict(lora_rank=8, lora_dropout=0.1), dict(grad_accum=2),
                                     dict(grad_accum=2, no_sync=True),
                                     dict(strategy="ddp", precision="fp32", grad_accum=2, no_sync=True),
                                     dict(strategy="fsdp1_full_shard", precision="fp32"),
                                     dict(strategy="fsdp1_shard_grad_op", precision="fp32"),
                                     dict(strategy="fsdp1_no_shard", precision="fp32"),
                                     dict(lora_rank=8, adapter_dtype="bf16", base_dtype="bf16"),
                                     dict(loss_chunks=4), dict(activation_checkpointing="selective"),
                                     dict(activation_checkpointing=2), dict(use_cache=True),
                                     dict(embed_head_units=True), dict(activation_checkpointing="reentrant")])
def test_estimate_matches_live_ranks_per_category(cluster, setting):
    est = estimate(model="tiny", world_size=2, seq_len=64, progress=False, **setting)
    _match_live(cluster, est, model="tiny", world_size=2, seq_len=64, **setting)


def test_reentrant_checkpointing_of_lora_is_within_its_stated_gap_of_live_ranks(cluster):
    """Reentrant checkpointing under LoRA: what lasts over the step is exact; a live rank holds a little more
    than the trace in activations and 'other', in proportion to the tokens: at most 6 tensors of [seq_len,
    head_dim] fp32, the rotary tables' size (docs/estimator.md), under 2% of the peak here."""
    from fsdplab.models import config_of

    config = config_of("tiny")
    table = 64 * config.hidden_size // config.num_attention_heads * 4
    setting = dict(model="tiny", world_size=2, seq_len=64, lora_rank=8, activation_checkpointing="reentrant")
    est = estimate(progress=False, **setting)
    for report in cluster.run(measure_setting, **setting):
        assert report.resident == est.resident
        for name in ("parameters", "gradients", "optimizer_state", "communication_buffers"):
            assert report.category_peaks[name] == est.category_peaks[name], name
        for name in ("activations", "other"):
            assert 0 <= report.category_peaks[name] - est.category_peaks[name] <= 6 * table, name
        assert 0 <= report.peak_bytes - est.peak_bytes <= 0.02 * est.peak_bytes


TINY_TRANSFORMER = "fsdplab.memory.published:lightning_transformer_tiny"


@pytest.mark.parametrize("setting", [dict(), dict(strategy="ddp"), dict(strategy="ddp", precision="bf16"),
                                     dict(strategy="replicate"), dict(activation_checkpointing=True),
                                     dict(strategy="shard_grad_op", precision="bf16")])
def test_a_custom_models_estimate_matches_live_ranks_per_category(cluster, setting):
    # an nn.Transformer of the user's own (fsdplab.custom), its encoder and decoder layers the units
    setting = dict(dict(model=TINY_TRANSFORMER, world_size=2, seq_len=35, batch_size=2, precision="fp32"), **setting)
    est = estimate(progress=False, **setting)
    _match_live(cluster, est, **setting)


def _ddp_buckets_after_three_steps(lora_rank):
    import torch

    from fsdplab.memory import ddp
    from fsdplab.models import config_of
    from fsdplab.sharding import apply_ddp, build_model, make_optimizer, train_step

    setting = TrainSetting(model="tiny", world_size=2, seq_len=16, lora_rank=lora_rank)
    model = apply_ddp(build_model(setting.replace(model=config_of("tiny")), device="cpu"))
    optimizer = make_optimizer(model)
    tokens = torch.randint(0, config_of("tiny").vocab_size, (1, 16))
    for _ in range(3):     # DDP rebuilds its buckets in step 2's forward and reports them in step 3's
        train_step(model, optimizer, {"input_ids": tokens, "labels": tokens})
    return ddp.bucket_bytes(model)


@pytest.mark.parametrize("lora_rank", [None, 8])
def test_the_estimators_ddp_buckets_are_those_torchs_ddp_rebuilds(cluster, lora_rank):
    from fsdplab.memory import ddp
    from fsdplab.models import config_of
    from fsdplab.sharding import build_model

    live = cluster.run(_ddp_buckets_after_three_steps, lora_rank, quiet=True)
    model = build_model(TrainSetting(model=config_of("tiny"), lora_rank=lora_rank), device="meta")
    modelled = ddp.bucket_sizes(model)
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # the same buckets in all; a boundary may sit a parameter away (bucket_sizes says why)
    assert live[0] == live[1] and sum(live[0]) == sum(modelled) == trained and len(live[0]) == len(modelled)
    assert all(abs(a - b) <= 4096 for a, b in zip(live[0], modelled)), (live[0], modelled)
    if lora_rank is None:
        assert len(modelled) > 1       # the first bucket's 1 MiB cap splits them


def test_estimate_runs_in_a_subprocess_when_a_group_exists(cluster):
    # On a rank a process group exists: estimate() must move to a fresh process and still answer.
    def on_rank():
        from fsdplab.memory import estimate

        return estimate(model="tiny", world_size=4, seq_len=32, lora_rank=8, progress=False).peak_bytes

    here = estimate(model="tiny", world_size=4, seq_len=32, lora_rank=8, progress=False).peak_bytes
    assert cluster.run(on_rank, ranks=[0], timeout=120) == [here]


def test_dashboard_draws_formula_and_set_changes_it():
    dash = memory_dashboard(model="qwen-7b", world_size=8, gpu_mem_gib=24)
    first = dash.result["selected"].peak_bytes
    dash.set(model="llama2-70b", world_size=64, lora_rank=0)
    second = dash.result["selected"]
    assert second.settings["model"] == "llama2-70b" and second.world_size == 64 and second.peak_bytes != first
    ax = dash.figure.axes[0]
    assert ax.get_ylabel() == "memory per GPU (GiB)" and ax.get_title()
    dash.set(model="tiny", world_size=2, seq_len=256)
    report = dash.exact()
    assert report.source == "estimate" and dash.result["exact"] is report
    assert report.peak_bytes < GIB
    # A click runs the estimate in a thread: the call returns at once, the status line shows progress, the
    # button is disabled until the report is drawn.
    shown = []
    dash.say = lambda text, say=dash.say: (shown.append(text), say(text))
    dash.set(seq_len=128)
    thread = dash.exact(wait=False)
    assert dash.exact_button.disabled
    thread.join(timeout=120)
    assert not dash.exact_button.disabled and dash.result["exact"].settings["seq_len"] == 128
    assert any("step 2/2 done" in text for text in shown) and "per-rank memory (estimate)" in shown[-1]


def test_tied_embeddings_count_once(cluster):
    """A model whose output layer shares the input embedding (gemma, small Qwen2 and Llama): one weight, in
    the estimate, the formula and on live ranks alike."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, max_position_embeddings=128,
                         tie_word_embeddings=True)
    untied = LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False})
    est = estimate(model=config, world_size=2, seq_len=32, progress=False)
    assert est.resident == formula(model=config, world_size=2, seq_len=32).resident
    embedding = 512 * 64 * 4 // 2                # fp32, half of it on each of 2 ranks
    assert estimate(model=untied, world_size=2, seq_len=32, progress=False).resident["parameters"] \
        == est.resident["parameters"] + embedding
    for report in cluster.run(measure_setting, model=config, world_size=2, seq_len=32):
        assert report.resident == est.resident


def test_a_run_reuses_an_estimate_it_made(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    first = estimate(model="tiny", world_size=2, seq_len=32, progress=False)
    again = estimate(model="tiny", world_size=2, seq_len=32, progress=False)
    other = estimate(model="tiny", world_size=2, seq_len=48, progress=False)
    assert len(list(tmp_path.glob("*.json"))) == 2 and not list(tmp_path.glob("*.tmp"))
    assert again.by_category == first.by_category and again.resident == first.resident
    assert any(note.startswith("reused") for note in again.notes)
    assert not any(note.startswith("reused") for note in first.notes + other.notes)
    monkeypatch.delenv("FSDPLAB_ESTIMATE_CACHE")
    assert not any(note.startswith("reused") for note in estimate(model="tiny", world_size=2, seq_len=32,
                                                                   progress=False).notes)


@pytest.mark.parametrize("lora_rank", [None, 8])
def test_skipping_in_place_foreach_kernels_on_fake_tensors_changes_no_number(monkeypatch, lora_rank):
    # The tracker skips FakeTensorMode's kernel for in-place foreach ops (the optimizer step, FSDP2's copy-in):
    # they allocate nothing on fake tensors. The whole report must be what the kernels give, and the Adam
    # step counts (fake tensors with a value) must still advance, or the step divides by zero.
    from fsdplab._torch_private import tracker

    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", "")
    trackers = []
    make = tracker.make_tracker
    monkeypatch.setattr(tracker, "make_tracker", lambda *a, **k: trackers.append(make(*a, **k)) or trackers[-1])
    setting = TrainSetting(model="tiny", world_size=2, seq_len=64, lora_rank=lora_rank, optimizer="adamw")
    reports = {}
    for skip in (False, True):
        monkeypatch.setattr(tracker._PeakTracker, "skip_inplace_foreach", skip)
        report = estimate(setting, progress=False, subprocess_mode=False).to_dict()
        reports[skip] = {k: v for k, v in report.items() if k not in ("seconds", "notes")}
        skipped = sum(made.skipped_kernels for made in trackers)
        trackers.clear()
        assert (skipped > 0) == skip, (skip, skipped)
    assert reports[True] == reports[False]


def test_cpu_offload_has_a_gpu_view_of_what_stays_on_the_gpu():
    """Under CPUOffloadPolicy the GPU still holds the units in flight, activations and the comm buffers: the
    report's GPU view replays that part (it was empty), below the view of the same step without offload."""
    on = estimate(model="tiny", world_size=2, seq_len=64, progress=False)
    off = estimate(model="tiny", world_size=2, seq_len=64, cpu_offload=True, progress=False)
    view = off.gpu_view
    assert view and "offload" in view and "on a GPU under cpu offload" in off.table()
    # the replayed GPU part peaks where the tracker's on-device tally does (each tensor rounded to 512 B)
    assert off.peak_bytes <= view["allocated_peak_rounded"] < off.peak_bytes * 1.05
    assert view["reserved"] >= view["allocated_peak_rounded"]
    assert (view["reserved"] < on.gpu_view["reserved"]
            and view["allocated_peak_rounded"] < on.gpu_view["allocated_peak_rounded"])


def test_the_gpu_side_of_an_offloaded_step():
    from fsdplab.memory.offload_view import gpu_side_log

    preloaded = [(1, 4096, "Sharded Param"), (2, 1024, "Buffer")]
    events = [("+", 3, 8192, "Unsharded Param"), ("c", {}), ("+", 4, 2048, "Reduce Scatter"),
              ("r", 4, 2048, "Reduce Scatter", "Sharded Grad"),      # copied to the host: freed on the GPU
              ("-", 3, 8192, "Unsharded Param"), ("m", "after backward"),
              ("+", 5, 4096, "OptState"), ("+", 6, 512, "Temp"), ("-", 6, 512, "Temp"), ("-", 4, 2048, "Sharded Grad")]
    log, count = gpu_side_log(preloaded, events)
    assert count == 1 and log == [("+", 2, 1024, 0, "Buffer"), ("+", 3, 8192, 0, "Unsharded Param"),
                                  ("+", 4, 2048, 2, "Reduce Scatter"), ("-", 4), ("-", 3)]


class _OneRankMesh:
    def size(self):
        return 1


def test_measure_setting_builds_an_offloaded_model_as_offloading_programs_do(monkeypatch):
    """Not on the GPU first (which leaves there what offloading keeps off it): on meta, sharded with the offload
    policy, placed on the host (sharding.build_sharded)."""
    import torch

    from fsdplab import ranks, sharding

    calls = []

    class Stop(Exception):
        pass

    def build_model(setting, device=None, **kwargs):
        calls.append(("build_model", str(device)))
        raise Stop

    def build_sharded(setting, mesh, device=None, seed=0, **kwargs):
        calls.append(("build_sharded", setting.cpu_offload))
        raise Stop

    monkeypatch.setattr(ranks, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(ranks, "mesh", lambda: _OneRankMesh())
    monkeypatch.setattr(sharding, "build_model", build_model)
    monkeypatch.setattr(sharding, "build_sharded", build_sharded)
    with pytest.raises(Stop):
        measure_setting(model="tiny", world_size=1, cpu_offload=True)
    assert calls == [("build_sharded", True)]
    with pytest.raises(ValueError, match="strategy"):
        measure_setting(model="tiny", world_size=1, cpu_offload=True, strategy="ddp")


def test_measure_setting_refuses_cpu_offload_on_cpu_ranks(monkeypatch):
    import torch

    from fsdplab import ranks

    monkeypatch.setattr(ranks, "device", lambda: torch.device("cpu"))
    monkeypatch.setattr(ranks, "mesh", lambda: _OneRankMesh())
    with pytest.raises(ValueError, match="estimate"):
        measure_setting(model="tiny", world_size=1, cpu_offload=True)
