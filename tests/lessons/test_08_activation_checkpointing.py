"""Lesson 08's measurements (activation checkpointing, wrap policies) and its exercise checkers.

The numbers checked here do not depend on load: FLOP counts, bytes autograd keeps, unit counts, gradient
equality."""

import pytest
import torch

from fsdplab.exercises import check
from fsdplab.lessons import activation_checkpointing as A
from fsdplab.lessons import auto_wrap as W


@pytest.fixture(scope="module")
def twin():
    return A.twin_config(hidden=64, layers=2, vocab=128)


@pytest.fixture(scope="module")
def qwen():
    from fsdplab.models import causal_lm

    return causal_lm("qwen-7b")   # meta device


@pytest.fixture(scope="module")
def flops():
    wide = A.wide_config("qwen-7b", layers=2)
    return {"full": A.flop_table(wide, 256, modes=("none", "torch", "posts")),
            "lora": A.flop_table(wide, 256, modes=("none", "torch"), lora_rank=8)}


# --- claim 8: FLOPs -------------------------------------------------------------------------------------

def test_block_backward_is_twice_forward_without_checkpointing(flops):
    plain = flops["full"]["none"]
    assert plain["blocks_backward"] == 2 * plain["blocks_forward"]
    assert plain["layers"] == 2 and plain["block_backward"][0] == plain["block_backward"][1]


def test_a_lora_models_first_block_skips_its_input_gradient_and_deeper_ones_do_not(flops):
    """Scaling block 0 to 32 blocks was the bug: its input (the frozen embedding's output) needs no gradient."""
    lora = flops["lora"]["none"]
    first, deep = (b / f for b, f in zip(lora["block_backward"], lora["block_forward"]))
    assert first < 0.9 < 1.0 < deep < 1.2, (first, deep)


def test_reentrant_recomputes_the_whole_block(flops):
    assert A.recompute_ratio(flops["full"]["none"], flops["full"]["posts"]) == pytest.approx(4 / 3, rel=1e-9)


def test_non_reentrant_stops_early_and_lora_pays_more(flops):
    torch_ratio = A.recompute_ratio(flops["full"]["none"], flops["full"]["torch"])
    lora_ratio = A.recompute_ratio(flops["lora"]["none"], flops["lora"]["torch"])
    assert 1 < torch_ratio < 4 / 3
    assert lora_ratio > 4 / 3
    # the head is never recomputed: the whole step's ratio is below the block's
    assert A.recompute_ratio(flops["full"]["none"], flops["full"]["torch"], "model") < torch_ratio


def test_flops_at_depth_scales_blocks_only(flops):
    for counts in (flops["full"]["none"], flops["lora"]["none"]):
        two, three = A.flops_at_depth(counts, 2), A.flops_at_depth(counts, 3)
        assert two["total"] == counts["forward"] + counts["backward"]                  # as measured
        assert three["total"] - two["total"] == counts["block_forward"][-1] + counts["block_backward"][-1]
    with pytest.raises(ValueError, match="2 or more blocks"):
        A.flops_at_depth(A.flop_table(A.wide_config("qwen-7b", layers=1), 64, modes=("none",))["none"], 32)


# --- claim 8: bytes ---------------------------------------------------------------------------------------

def test_checkpointed_block_keeps_its_input_only(twin):
    batch = A.token_batch(twin, 2, 16)
    plain = A.saved_bytes(A.build(twin, "none"), batch)
    for mode in ("torch", "posts"):
        ckpt = A.saved_bytes(A.build(twin, mode), batch)
        hidden = 2 * 16 * twin.hidden_size * 4
        assert ckpt["regions"]["block 1"] == hidden               # one fp32 hidden state
        assert ckpt["regions"]["head"] == plain["regions"]["head"]    # the head is not checkpointed
        assert ckpt["logits"] == 2 * 16 * twin.vocab_size * 4
        saving = A.block_saving(plain, ckpt)
        assert saving["blocks"] > saving["model"] > 0


def test_checkpoint_warning_names_use_reentrant():
    assert "use_reentrant" in A.checkpoint_warning()


def test_the_note_under_the_warning_says_what_the_running_torch_does():
    running = str(torch.__version__).split("+")[0]
    passed = A.warning_deadline_note("Starting in PyTorch 2.0, calling checkpoint without use_reentrant will raise")
    assert running in passed and "still only warns" in passed and "2.0" in passed
    ahead = A.warning_deadline_note("Starting in PyTorch 99.0, calling checkpoint without use_reentrant will raise")
    assert "still" not in ahead and "99.0" not in ahead
    assert "still" not in A.warning_deadline_note("")


def test_posts_call_gives_lora_adapters_no_gradient(twin):
    result = A.posts_call_on_lora(twin, lora_rank=4)
    assert result["adapters"] > 0 and result["adapters_with_gradient"] == 0


def test_checkpoint_modes_keep_the_same_loss(twin):
    batch = A.token_batch(twin, 2, 16)
    from fsdplab.sharding import loss_of

    losses = {mode: loss_of(A.build(twin, mode), batch).item() for mode in A.CHECKPOINTING}
    assert len(set(losses.values())) == 1, losses


def test_unknown_mode_is_refused(twin):
    with pytest.raises(ValueError, match="checkpointing"):
        A.build(twin, "sometimes")


# --- claim 8: dropout under FSDP2 on live ranks ---------------------------------------------------------

def test_rng_state_decides_gradients_under_dropout(cluster):
    noisy = A.twin_config(hidden=64, layers=2, vocab=128, dropout=0.2)
    results = cluster.run(A.dropout_gradients, noisy, seq_len=16)
    assert all(r == results[0] for r in results)    # gradients are reduced: every rank sees the same
    assert results[0]["torch"] == 0.0
    assert results[0]["posts"] > 0 and results[0]["posts, non-reentrant"] > 0


# --- claim 11 -----------------------------------------------------------------------------------------------

def test_posts_policy_call_raises_type_error():
    assert W.posts_policy_error().startswith("TypeError")


def test_policy_units_of_qwen7b(qwen):
    units = W.policy_units(qwen, W.size_policy(1e7))
    names = [name for name, _ in units]
    linear = [n for n in names[:-1] if isinstance(qwen.get_submodule(n), torch.nn.Linear)]
    assert len(linear) == 7 * qwen.config.num_hidden_layers + 1          # every block Linear and the LM head
    assert "model.embed_tokens" in names and names[-1] == ""
    assert sum(n for _, n in units) == sum(p.numel() for p in qwen.parameters())
    blocks = W.block_units(qwen)
    assert len(blocks) == qwen.config.num_hidden_layers + 1
    assert sum(n for _, n in blocks) == sum(p.numel() for p in qwen.parameters())


def test_policy_units_record_each_units_own_parameters():
    model = W.qwen_v1_meta()
    units = W.policy_units(model, W.size_policy(5e7))   # here units nest: blocks inside `transformer`
    assert all(n >= 0 for _, n in units), [u for u in units if u[1] < 0]
    assert sum(n for _, n in units) == sum(p.numel() for p in model.parameters())
    # each parameter belongs to the innermost unit around it (the root, '', around all)
    names = [name for name, _ in units]
    own = dict.fromkeys(names, 0)
    for param_name, param in model.named_parameters():
        around = [n for n in names if n == "" or param_name.startswith(n + ".")]
        own[max(around, key=len)] += param.numel()
    assert dict(units) == own


def test_policy_units_match_real_fsdp1(cluster, twin):
    result = cluster.run(W.fsdp1_unit_count, twin, 4000)[0]
    assert result["fsdp1_units"] == result["predicted"] > 3


def test_smaller_units_mean_more_collectives(cluster, twin):
    per_linear = cluster.run(W.collectives_per_step, twin, "policy", 4000)[0]
    per_block = cluster.run(W.collectives_per_step, twin, "blocks")[0]
    assert per_linear["units"] > per_block["units"]
    assert per_linear["all_gathers"] > per_block["all_gathers"]
    assert per_linear["largest_all_gather"] < per_block["largest_all_gather"]


# --- claim 20 and the verdicts ---------------------------------------------------------------------------------

def test_swift_verdict_from_flags():
    flags, source = A.swift_flags()
    assert {"train_type", "lora_rank", "gradient_checkpointing"} <= flags and source
    assert A.claim20_verdict(flags)[0] == "wrong"
    assert A.claim20_verdict(flags | {"train", "activation_checkpointing"})[0] == "right"


def test_claim_verdicts_follow_the_numbers():
    base = dict(posts_full=1.31, torch_full=1.24, torch_lora=1.49, block_saving=0.95, model_saving=0.88,
                rng_posts=0.03, rng_torch=0.0)
    assert A.claim8_verdict(**base)[0] == "partly"
    assert A.claim8_verdict(**{**base, "rng_posts": 0.0})[0] == "right"
    assert A.claim8_verdict(**{**base, "posts_full": 1.6, "model_saving": 0.3})[0] == "wrong"
    assert W.claim11_verdict(error="TypeError: x", units=227, block_units=33)[0] == "wrong"
    assert W.claim11_verdict(error="", units=227, block_units=33)[0] == "right"


# --- the exercise checkers ----------------------------------------------------------------------------------

def test_lora_recompute_checker(flops):
    measured = A.recompute_ratio(flops["lora"]["none"], flops["lora"]["torch"])
    assert 1.4 < measured < 1.55, measured          # one more forward on a backward of about one forward
    assert check("08-lora-recompute", measured * 1.005, measured=measured)
    whole_step = (A.flops_at_depth(flops["lora"]["torch"], 32)["total"]
                  / A.flops_at_depth(flops["lora"]["none"], 32)["total"])
    assert abs(whole_step / measured - 1) > 0.01, (whole_step, measured)
    first_block = ((flops["lora"]["torch"]["block_forward"][0] + flops["lora"]["torch"]["block_backward"][0])
                   / (flops["lora"]["none"]["block_forward"][0] + flops["lora"]["none"]["block_backward"][0]))
    # the textbook 4/3, the first block's ratio (the old bug), a percentage, 1.0, a bool, text
    # ... the whole step's ratio, printed next to the block's
    for wrong in (4 / 3, first_block, whole_step, 47.6, 1.0, True, "1.48", float("nan")):
        assert not check("08-lora-recompute", wrong, measured=measured), wrong


def test_lora_recompute_checker_at_the_exercises_setting():
    lora = A.flop_table(A.wide_config("qwen-7b", layers=2), 512, modes=("none", "torch"), lora_rank=64)
    measured = A.recompute_ratio(lora["none"], lora["torch"])
    assert check("08-lora-recompute", measured * 0.997, measured=measured)
    # the naive 1 + 1/2 (one more forward on F + F), and the 2048-token ratio the lesson printed first
    at_2048 = A.flop_table(A.wide_config("qwen-7b", layers=2), 2048, modes=("none", "torch"), lora_rank=64)
    for wrong in (1.5, A.recompute_ratio(at_2048["none"], at_2048["torch"])):
        assert not check("08-lora-recompute", wrong, measured=measured), (wrong, measured)


def test_saved_per_block_checker(twin):
    saved = A.saved_bytes(A.build(twin, "torch"), A.token_batch(twin, 2, 16))["regions"]["block 1"]
    assert check("08-saved-per-block", 2 * 16 * twin.hidden_size * 4, measured=saved)
    assert not check("08-saved-per-block", 2 * 16 * twin.hidden_size * 2, measured=saved)
    for wrong in (16 * twin.hidden_size * 4, 2 * 16 * twin.hidden_size, 0, True, "8192", float("inf")):
        assert not check("08-saved-per-block", wrong, measured=saved), wrong


def test_units_checker():
    assert check("08-units", 163, min_num_params=1e7)                      # the posts' Qwen-7B v1
    assert check("08-units", 227, min_num_params=1e7, model="qwen-7b")     # the Qwen2 layout
    assert not check("08-units", 35, min_num_params=1e7)
    assert not check("08-units", "many", min_num_params=1e7)
    for wrong in (227, 33, 160, "163", True, 163.5, float("nan"), -163):   # Qwen2's count, per block, Linears only
        assert not check("08-units", wrong, min_num_params=1e7), wrong
