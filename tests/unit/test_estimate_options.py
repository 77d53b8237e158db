"""The user's program as TrainSetting fields: attention kernel, activation checkpointing modes, chunked loss,
embedding and head as FSDP units, the KV cache. Each is honoured by the formula, the exact estimate and the live
measurement (tests/unit/test_memory.py compares the last two per category), and reaches the CLI."""

import json

import pytest
import torch

from fsdplab.runner.cli import main
from fsdplab.memory.formula import formula
from fsdplab.memory import estimate
from fsdplab.models import tiny_twin
from fsdplab.settings import TrainSetting
from fsdplab.sharding import build_model, loss_of

# Qwen-7B's layout at a small width, a real vocabulary (the logits matter) and a sequence long enough for
# activations to dominate: every option below moves the peak.
CONFIG = tiny_twin("qwen-7b", hidden_size=256, num_layers=4, vocab_size=32000)
BASE = TrainSetting(model=CONFIG, world_size=2, seq_len=1024, batch_size=2)


@pytest.fixture(scope="module")
def peaks():
    cache = {}

    def peak(**change):
        key = tuple(sorted(change.items()))
        if key not in cache:
            cache[key] = estimate(BASE.replace(**change), progress=False)
        return cache[key]
    return peak


def test_checkpointing_modes_are_validated_and_normalised():
    modes = [False, True, 0, 1, "none", "full", 2, "selective", None]
    assert [TrainSetting(activation_checkpointing=m).activation_checkpointing for m in modes] == \
        [False, True, False, True, False, True, 2, "selective", False]
    for bad in (-1, "sometimes", 1.5):
        with pytest.raises(ValueError, match="every k-th block"):
            TrainSetting(activation_checkpointing=bad)
    for bad in (0, -2, 1.0, True):
        with pytest.raises(ValueError, match="loss_chunks"):
            TrainSetting(loss_chunks=bad)
    # The recomputed forward would append to the KV cache again and attend to twice the keys.
    with pytest.raises(ValueError, match="twice the keys"):
        TrainSetting(use_cache=True, activation_checkpointing="selective")
    with pytest.raises(ValueError, match="attention"):
        TrainSetting(attention="flash2")
    assert TrainSetting(attention="eager").flash_attention is False and TrainSetting().flash_attention
    # Unset, the attention is the one the model's config names (lesson 08's eager twins), else sdpa.
    eager_config = tiny_twin("qwen-7b", hidden_size=64, num_layers=2, vocab_size=300)
    eager_config._attn_implementation = "eager"
    assert TrainSetting(model=eager_config).attention_kind == "eager"
    assert build_model(TrainSetting(model=eager_config)).config._attn_implementation == "eager"
    assert build_model(TrainSetting(model=eager_config, attention="sdpa")).config._attn_implementation == "sdpa"
    assert eager_config._attn_implementation == "eager"      # the caller's config is left as it was
    assert TrainSetting(model="tiny").attention_kind == "sdpa"


def test_each_option_moves_the_exact_peak_the_way_the_program_does(peaks):
    sdpa, eager = peaks(), peaks(attention="eager")
    # eager keeps each layer's b x heads x s x s scores and softmax (fp32 softmax, bf16 scores): at least that much more
    heads = CONFIG.num_attention_heads
    assert eager.by_category["activations"] - sdpa.by_category["activations"] >= 4 * 2 * heads * 1024 ** 2 * 2
    assert peaks(attention="flash").peak_bytes == sdpa.peak_bytes     # traced as SDPA, said in a note
    assert any("flash attention traced as SDPA" in n for n in peaks(attention="flash").notes)
    # Checkpointing: full < selective < every 2nd block < none.
    full, sel, half = (peaks(activation_checkpointing=m).peak_bytes for m in (True, "selective", 2))
    assert full < sel < half < sdpa.peak_bytes, (full, sel, half, sdpa.peak_bytes)
    # The chunked loss takes one chunk's fp32 logits at a time: at least 3/4 of one fp32 copy less.
    fp32_logits = 2 * 1024 * 32000 * 4
    assert sdpa.peak_bytes - peaks(loss_chunks=8).peak_bytes >= fp32_logits * 3 // 4
    # Embedding and head as units: they are gathered one at a time, never with each other.
    units = peaks(embed_head_units=True)
    assert units.category_peaks["parameters"] < sdpa.category_peaks["parameters"]
    # The KV cache costs nothing at the peak (attention keeps the same K and V for backward anyway).
    assert peaks(use_cache=True).peak_bytes == sdpa.peak_bytes


def test_the_formula_honours_each_option():
    f = lambda **c: formula(BASE.replace(**c))  # noqa: E731
    plain = f()
    assert f(attention="eager").by_category["activations"] > plain.by_category["activations"]
    assert f(loss_chunks=8).detail["logits"] == 2 * 1024 * 32000 * (2 + 4 / 8 + 4)
    assert plain.detail["logits"] == 2 * 1024 * 32000 * (2 + 4 + 4)
    acts = [f(activation_checkpointing=m).by_category["activations"] for m in (True, "selective", 2, False)]
    assert acts == sorted(acts) and len(set(acts)) == 4, acts
    assert f(embed_head_units=True).by_category["parameters"] < plain.by_category["parameters"]
    assert f(use_cache=True).by_category["activations"] == plain.by_category["activations"]


def test_the_chunked_loss_is_the_models_own_loss():
    config = tiny_twin("qwen-7b", hidden_size=64, num_layers=2, vocab_size=300)
    model = build_model(TrainSetting(model=config), device="cpu", seed=0)
    tokens = torch.randint(0, 300, (2, 37))
    labels = tokens.clone()
    labels[0, :5] = -100                       # a masked prompt
    batch = {"input_ids": tokens, "labels": labels}
    plain = loss_of(model, batch)
    for chunks in (2, 3, 8):
        chunked = loss_of(model, batch, chunks)
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(model.get_output_embeddings())    # the head is left as it was


def test_a_tied_head_cannot_be_a_unit_of_its_own():
    config = tiny_twin("qwen-7b", hidden_size=64, num_layers=2, vocab_size=300)
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="ties its output head"):
        estimate(model=config, world_size=2, seq_len=16, embed_head_units=True, progress=False)


def test_the_cli_takes_every_option(capsys):
    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--seq-len", "32", "--attention", "eager",
                 "--activation-checkpointing", "selective", "--loss-chunks", "4", "--embed-head-units",
                 "--json"]) == 0
    settings = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]
    assert (settings["attention"], settings["activation_checkpointing"], settings["loss_chunks"],
            settings["embed_head_units"]) == ("eager", "selective", 4, True)
    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--seq-len", "32", "--use-cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]["use_cache"] is True
    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--seq-len", "32",
                 "--activation-checkpointing", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]["activation_checkpointing"] is True
    assert main(["estimate", "--model", "tiny", "--activation-checkpointing", "often"]) == 2
    assert "every K-th block" in capsys.readouterr().err


def test_the_report_says_where_the_peak_falls_and_draws_the_step(peaks, tmp_path, capsys):
    report = peaks()
    line = report.timeline
    totals = [sum(line[c][i] for c in line if c != "phase") for i in range(len(line["phase"]))]
    assert max(totals) == report.peak_bytes          # the figure's highest point is the reported peak
    phases = [p for i, p in enumerate(line["phase"]) if i == 0 or p != line["phase"][i - 1]]
    assert phases.index("forward") < phases.index("backward") < phases.index("optimizer step"), phases
    # At this sequence length the peak is in backward at the loss: the fp32 logits are alive, no block's
    # gradient exists yet.
    assert report.peak_moment["phase"] == "backward" and report.peak_moment["op"].startswith("aten.")
    assert report.by_category["gradients"] == 0 and max(report.phase_peaks().values()) == report.peak_bytes
    assert report.phase_peaks()["optimizer step"] < report.peak_bytes
    assert "peak at: backward" in report.table()
    png = tmp_path / "step.png"
    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--seq-len", "32", "--timeline", str(png)]) == 0
    assert png.stat().st_size > 10_000 and "memory over the step" in capsys.readouterr().out
    assert main(["estimate", "--model", "tiny", "--seq-len", "32,64", "--timeline", str(png)]) == 2
    assert main(["estimate", "--model", "tiny", "--timeline", str(tmp_path / "step.svg")]) == 2
    assert "one setting's step" in capsys.readouterr().err


def test_resharding_to_a_smaller_group_holds_more_between_forward_and_backward(capsys):
    peaks = [estimate(model="tiny", world_size=8, seq_len=64, reshard_to=r, progress=False).peak_bytes
             for r in (None, 4, 2)]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    formulas = [formula(model="tiny", world_size=8, seq_len=64, reshard_to=r).peak_bytes for r in (None, 4, 2)]
    assert formulas[0] < formulas[1] < formulas[2], formulas
    assert TrainSetting(world_size=8, reshard_to=8).reshard_after_forward is True
    for bad in (1, 3, 0, 16):
        with pytest.raises(ValueError, match="reshard_to"):
            TrainSetting(world_size=8, reshard_to=bad)
    with pytest.raises(ValueError, match="applies to full_shard"):
        TrainSetting(world_size=8, reshard_to=4, strategy="shard_grad_op")
    assert main(["estimate", "--model", "tiny", "--world-size", "8", "--seq-len", "64", "--reshard-to", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["settings"]["reshard_to"] == 4


def test_a_sweep_builds_its_fake_model_once_and_gets_every_points_own_numbers(tmp_path, monkeypatch):
    from fsdplab.memory import estimate_group
    from fsdplab.memory.sweep import _chunks

    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    points = [BASE.replace(seq_len=s, batch_size=b, lora_rank=8) for s in (256, 512) for b in (1, 2)]
    together = estimate_group(points)
    monkeypatch.delenv("FSDPLAB_ESTIMATE_CACHE")
    for point, report in zip(points, together):
        alone = estimate(point, progress=False)
        assert (report.peak_bytes, report.by_category, report.category_peaks, report.resident, report.detail,
                report.gpu_view) == (alone.peak_bytes, alone.by_category, alone.category_peaks, alone.resident,
                                     alone.detail, alone.gpu_view), point
    assert len(list(tmp_path.glob("*.json"))) == 4              # each point stored, as estimate() stores it
    with pytest.raises(ValueError, match="seq_len and batch_size only"):
        estimate_group([BASE, BASE.replace(world_size=4)])
    # Points that share a model are cut into one chunk per worker; another world size is another model.
    settings = points + [BASE.replace(world_size=4)]
    assert _chunks(settings, list(range(5)), workers=2) == [[0, 2], [1, 3], [4]]
