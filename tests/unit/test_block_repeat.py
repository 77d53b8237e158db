"""The estimator traces 8 blocks of a deep model and repeats a middle one (fsdplab.memory.block_repeat): the step it
makes must be the step a trace of every block gives, event by event, and so must every number of the report."""

import pytest

from fsdplab.memory import block_repeat, exact
from fsdplab.memory import estimate
from fsdplab.models import tiny_twin
from fsdplab.settings import TrainSetting

DEEP = tiny_twin("qwen-7b", hidden_size=128, num_layers=13, vocab_size=512)
# QLoRA's NF4 base needs matrices of whole 64 x 256 groups per rank
DEEP_NF4 = tiny_twin("qwen-7b", hidden_size=256, num_layers=13, vocab_size=512)
DEEP_NF4.intermediate_size = 768
BASE = TrainSetting(model=DEEP, world_size=2, seq_len=64)
NUMBERS = ("peak_bytes", "by_category", "category_peaks", "resident", "detail", "peak_moment", "timeline",
           "gpu_view")

SETTINGS = {
    "full fine-tune": {},
    "lora": dict(lora_rank=8),
    "lora, checkpointing, fp16, offload": dict(lora_rank=8, activation_checkpointing=True, precision="fp16",
                                                cpu_offload=True),
    "hybrid, selective checkpointing, bf16": dict(world_size=4, strategy="hybrid_shard", shard_group_size=2,
                                                  activation_checkpointing="selective", precision="bf16"),
    "shard_grad_op, own embedding and head units, chunked loss": dict(strategy="shard_grad_op",
                                                                      embed_head_units=True, loss_chunks=4),
    "replicate, eager attention, sgd": dict(strategy="replicate", attention="eager", optimizer="sgd"),
    "ddp (torch's), lora, autocast bf16": dict(strategy="ddp", lora_rank=8, precision="bf16"),
    "ddp (torch's), full fine-tune, fp32": dict(strategy="ddp", precision="fp32"),
    "lora, reentrant checkpointing, bf16": dict(lora_rank=8, activation_checkpointing="reentrant", precision="bf16"),
    "qlora: nf4 base, checkpointing, bf16": dict(model=DEEP_NF4, lora_rank=8, base_dtype="nf4",
                                                 activation_checkpointing=True, precision="bf16"),
}


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", "")


@pytest.mark.parametrize("change", SETTINGS.values(), ids=SETTINGS.keys())
def test_the_repeated_step_is_the_traced_step_event_by_event(monkeypatch, change):
    """deepen() of 8 traced blocks against deepen() of all 13 traced (nothing to repeat: only renumbered)."""
    setting = BASE.replace(**change)
    made = []
    original = block_repeat.deepen

    def keep(record, depth):
        made.append(original(record, depth))
        return made[-1]

    monkeypatch.setattr(block_repeat, "deepen", keep)
    say = lambda message: None   # noqa: E731
    exact._trace_steps(setting, block_repeat.shallow_twin(setting, setting.model), say, True, repeat_to=13)
    exact._trace_steps(setting, setting.model, say, True, repeat_to=13)
    (pre_repeated, repeated, m), (pre_traced, traced, _) = made
    assert 2 <= m <= 5
    if setting.base_dtype == "nf4":
        # torchao's NF4 tensor hands the tracker its inner tensors in an order that changes from one trace to the
        # next (two full traces differ too): the same tensors must be alive before the step, in any order
        assert sorted(p[1:] for p in pre_repeated) == sorted(p[1:] for p in pre_traced)
    else:
        assert pre_repeated == pre_traced
    assert len(repeated) == len(traced)
    # torch.autocast (ddp in 16 bits) frees its cache of cast weights as forward ends in the order of a hash
    # table keyed by tensor address, which changes from run to run: frees in a row are compared as a set.
    repeated, traced = _frees_in_a_row_sorted(repeated), _frees_in_a_row_sorted(traced)
    first = next((i for i, (a, b) in enumerate(zip(repeated, traced)) if a != b), None)
    assert first is None, (first, repeated[first], traced[first])


def _frees_in_a_row_sorted(events: list) -> list:
    out, run = [], []
    for event in events + [None]:
        if event is not None and event[0] == "-":
            run.append(event)
            continue
        out += sorted(run, key=repr) + ([event] if event is not None else [])
        run = []
    return out


NUMBER_CASES = ("full fine-tune", "lora, checkpointing, fp16, offload", "qlora: nf4 base, checkpointing, bf16",
                "ddp (torch's), lora, autocast bf16")


@pytest.mark.parametrize("change", [SETTINGS[name] for name in NUMBER_CASES], ids=NUMBER_CASES)
def test_every_number_of_the_report_is_that_of_a_full_trace(monkeypatch, change):
    setting = BASE.replace(**change)
    repeated = estimate(setting, progress=False, subprocess_mode=False)
    monkeypatch.setenv("FSDPLAB_TRACE_ALL_BLOCKS", "1")
    traced = estimate(setting, progress=False, subprocess_mode=False)
    for name in NUMBERS:
        assert getattr(repeated, name) == getattr(traced, name), name
    assert any(n.startswith("8 of the 13 blocks traced") for n in repeated.notes)
    assert not any("blocks traced" in n for n in traced.notes)


def test_where_blocks_differ_or_are_few_every_block_is_traced():
    assert block_repeat.shallow_twin(BASE, DEEP).num_hidden_layers == block_repeat.TRACED
    assert block_repeat.shallow_twin(BASE.replace(activation_checkpointing=2), DEEP) is None   # every 2nd block
    assert block_repeat.shallow_twin(BASE.replace(per_block=False), DEEP) is None
    assert block_repeat.shallow_twin(BASE, tiny_twin("qwen-7b", num_layers=11)) is None
    mixed = tiny_twin("qwen-7b", num_layers=13)
    mixed.layer_types = ["full_attention", "sliding_attention"] * 6 + ["full_attention"]
    assert block_repeat.shallow_twin(BASE, mixed) is None


def test_a_step_whose_blocks_do_not_repeat_is_traced_in_full(monkeypatch):
    """If the traced blocks do not match their neighbours, the estimate says so and traces every block."""
    def refuse(self):
        raise block_repeat.NotRepeatable("made up for the test")

    lines = []
    monkeypatch.setattr(block_repeat._Step, "middle", refuse)
    report = estimate(BASE, progress=False, subprocess_mode=False)
    runs = exact._fake_steps(BASE, DEEP, lines.append, True)
    assert [traced for _, _, traced in runs] == [None]
    assert any("do not repeat exactly (made up for the test): tracing all 13" in line for line in lines)
    assert not any("blocks traced" in n for n in report.notes)
    monkeypatch.undo()
    assert estimate(BASE, progress=False, subprocess_mode=False).peak_bytes == report.peak_bytes


def test_a_sweep_repeats_the_blocks_for_each_point(monkeypatch):
    from fsdplab.memory import estimate_group

    points = [BASE.replace(seq_len=32), BASE.replace(seq_len=96, batch_size=2)]
    grouped = estimate_group(points)
    monkeypatch.setenv("FSDPLAB_TRACE_ALL_BLOCKS", "1")
    for point, report in zip(points, grouped):
        alone = estimate(point, progress=False, subprocess_mode=False)
        assert any(n.startswith("8 of the 13 blocks traced") for n in report.notes)
        for name in NUMBERS:
            assert getattr(report, name) == getattr(alone, name), (point.seq_len, name)


def test_a_run_caches_repeated_and_fully_traced_estimates_apart(monkeypatch, tmp_path):
    from fsdplab.memory import cache as estimate_cache

    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    repeated = estimate_cache.cache_path(BASE)
    monkeypatch.setenv("FSDPLAB_TRACE_ALL_BLOCKS", "1")
    assert estimate_cache.cache_path(BASE) != repeated
