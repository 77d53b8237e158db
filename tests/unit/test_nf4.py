"""QLoRA's 4-bit base (fsdplab.nf4, base_dtype="nf4"): torchao's NF4 tensor in the model builder, the formula and
the exact estimator, which must agree with each other on what a rank stores."""

import pytest
import torch

from fsdplab import nf4
from fsdplab.memory import estimate, formula
from fsdplab.models import causal_lm, tiny_twin
from fsdplab.settings import NF4_BYTES_PER_WEIGHT, TrainSetting
from fsdplab.sharding import build_model

TWIN = tiny_twin("qwen-7b", hidden_size=256, num_layers=2, vocab_size=512)
TWIN.intermediate_size = 768
QLORA = TrainSetting(model=TWIN, world_size=2, lora_rank=4, base_dtype="nf4", precision="bf16", seq_len=32)


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", "")


def test_an_nf4_base_trains_only_with_adapters():
    with pytest.raises(ValueError, match="only with LoRA adapters"):
        TrainSetting(model=TWIN, base_dtype="nf4")
    with pytest.raises(ValueError, match="base_dtype"):
        TrainSetting(model=TWIN, lora_rank=4, base_dtype="int4")


def test_the_blocks_matrices_go_4_bit_and_the_rest_stays_bf16():
    model = build_model(QLORA, device="cpu", dtype="nf4", seed=0)
    _, _, nf4_tensor = nf4.nf4()
    quantized = {n for n, p in model.named_parameters() if isinstance(p, nf4_tensor)}
    assert quantized and all(".layers." in n and "lora_" not in n for n in quantized)
    assert len(quantized) == 2 * 7                  # q, k, v, o, gate, up, down in each of 2 blocks
    rest = {p.dtype for n, p in model.named_parameters() if n not in quantized and not p.requires_grad}
    assert rest == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    weight = next(p for n, p in model.named_parameters() if n in quantized)
    assert nf4.local_bytes(weight) == pytest.approx(weight.numel() * NF4_BYTES_PER_WEIGHT)


def test_a_matrix_that_cannot_be_nf4_shards_is_refused_before_anything_changes():
    model = causal_lm(tiny_twin("qwen-7b", hidden_size=128, num_layers=1, vocab_size=128), device="cpu")
    with pytest.raises(ValueError, match="cannot be NF4 shards over 2 rank"):
        nf4.apply_nf4(model, shards=2)
    assert not any(isinstance(m, nf4.NF4Linear) for m in model.modules())


def test_nf4_linear_is_close_to_the_bf16_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256, bias=True)
    quantized = nf4.NF4Linear.from_linear(linear)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x, linear.weight.bfloat16(), linear.bias.bfloat16())
    error = (quantized(x) - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.1           # 4 bits are not 16: close, never equal


def test_estimate_and_formula_agree_on_what_a_rank_stores():
    exact, analytic = estimate(QLORA, progress=False, subprocess_mode=False), formula(QLORA)
    assert exact.resident == analytic.resident
    bf16 = estimate(QLORA.replace(base_dtype="bf16"), progress=False, subprocess_mode=False)
    assert exact.resident["parameters"] < 0.6 * bf16.resident["parameters"]
    assert exact.peak_bytes < bf16.peak_bytes
    assert any(note.startswith("NF4 base") for note in exact.notes)
    assert any("frozen base stored as 4-bit NF4" in note for note in exact.notes)


def test_on_meta_the_codes_are_made_without_values_in_torchaos_shapes(monkeypatch):
    """fsdplab.nf4._codes_without_values: on the meta device the 4-bit codes skip torchao's quantization loop; every
    inner tensor keeps the shape, dtype and strides torchao's own conversion gives, and the loop is back after."""
    to_nf4, _, nf4_tensor = nf4.nf4()
    linear = torch.nn.Linear(512, 256, bias=False, device="meta")

    def no_loop(*args):
        raise AssertionError("torchao's quantization loop ran on the meta device")

    with monkeypatch.context() as patched:
        patched.setattr(nf4_tensor, "quantize_tensor_nearest", staticmethod(no_loop))
        made = nf4.NF4Linear.from_linear(linear).weight
    reference = to_nf4(linear.weight.detach().to(torch.bfloat16))       # torchao's loop, on meta
    assert (made.shape, made.stride(), made.dtype, made.device.type) == \
        (reference.shape, reference.stride(), reference.dtype, "meta")
    for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
        a, b = getattr(made, name), getattr(reference, name)
        assert (a.shape, a.stride(), a.dtype, a.device.type) == (b.shape, b.stride(), b.dtype, b.device.type), name
    assert isinstance(nf4_tensor.__dict__["convert_to_norm_float_weight"], staticmethod)
    assert nf4_tensor.convert_to_norm_float_weight.__module__.startswith("torchao")
