"""The 17 settings the estimator was first held against a GPU with (one H200, one rank, 2026-12-04), as
TrainSettings, and the arithmetic of the comparison: the error of an estimate, whether a setting fits in the free
memory of a GPU, and fp16 in place of bf16 where the GPU has no native bf16 (compute capability < 8.0).
A plain module (no GPU, no fixtures), so the CPU suite tests it."""

from __future__ import annotations

from fsdplab.models import MODELS, hf_config
from fsdplab.settings import GIB, TrainSetting

# A ~1.0B Qwen2: the registry's Qwen entry (config class and fields) at these sizes.
ONE_B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=6144, vocab_size=32000, max_position_embeddings=4096)
ONE_B_PARAMS = 1_003_653_120
AA7 = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
B16 = dict(base_dtype="bf16", precision="bf16")
LORA64 = dict(lora_rank=64, lora_alpha=128)
AC = dict(activation_checkpointing=True)

# name: (model, TrainSetting fields); world size 1, full_shard unless said. The two CPU-offload settings of that
# run are left out: it built them on the GPU first, unlike an offloading program.
CASES = {
    "1b-full": ("1b", dict(seq_len=2048)),
    "1b-full+ac": ("1b", dict(seq_len=2048, **AC)),
    "1b-lora": ("1b", dict(seq_len=2048, **LORA64)),
    "1b-lora+ac": ("1b", dict(seq_len=2048, **LORA64, **AC)),
    "qwen7b-lora64-ac-bf16": ("qwen-7b", dict(seq_len=2048, lora_rank=64, **AC, **B16)),
    "qwen7b-lora64-noac-bf16": ("qwen-7b", dict(seq_len=2048, lora_rank=64, **B16)),
    "qwen7b-lora64-ac-fp16": ("qwen-7b", dict(seq_len=2048, lora_rank=64, **AC, base_dtype="fp16", precision="fp16")),
    "llama2-7b-lora8qv-ac-b2s512": ("llama2-7b", dict(seq_len=512, batch_size=2, lora_rank=8, lora_alpha=16,
                                                      lora_targets=("q_proj", "v_proj"), **AC, **B16)),
    "llama2-7b-lora64aa7-ac-b1s2048": ("llama2-7b", dict(seq_len=2048, lora_rank=64, lora_alpha=16, lora_targets=AA7,
                                                         **AC, **B16)),
    "llama2-7b-lora64aa7-ac-b4s2048": ("llama2-7b", dict(seq_len=2048, batch_size=4, lora_rank=64, lora_alpha=16,
                                                         lora_targets=AA7, **AC, **B16)),
    "1b-lora+ac-ddp": ("1b", dict(seq_len=2048, **LORA64, **AC, strategy="ddp")),
    "1b-full+ac-ddp": ("1b", dict(seq_len=2048, **AC, strategy="ddp")),
    "llama2-7b-lora64aa7-ac-b4s2048-ddp": ("llama2-7b", dict(seq_len=2048, batch_size=4, lora_rank=64, lora_alpha=16,
                                                             lora_targets=AA7, **AC, strategy="ddp", **B16)),
    "qwen7b-lora64-ac-bf16-s8192": ("qwen-7b", dict(seq_len=8192, lora_rank=64, **AC, **B16)),
    "1b-full-chunks8": ("1b", dict(seq_len=2048, loss_chunks=8)),
    "1b-full-eager": ("1b", dict(seq_len=2048, attention="eager")),
    "1b-full-sac": ("1b", dict(seq_len=2048, activation_checkpointing="selective")),
}
# Bounds on |measured / estimated - 1|. On 2026-12-04 the worst were 1.0% (allocated), 11.8% (reserved, eager
# attention) and 14.2% (device in use: the CUDA context, cuBLAS and NCCL outside the allocator, 0.82 GiB there
# against 0.5 GiB assumed).
TOLERANCE = {"allocated": 0.05, "reserved": 0.15, "device_used": 0.20}
FIT_MARGIN = 1.15          # a setting runs only where the free memory holds its estimated device use this many times
FIT_SLACK = 1 * GIB        # plus this (the rank's CUDA context is counted in the estimate; fragmentation is not)


def one_b_config():
    import transformers

    entry = MODELS["qwen-7b"]
    return getattr(transformers, entry.config_class)(**{**entry.fields, **ONE_B})


def native_bf16(capability) -> bool:
    return tuple(capability) >= (8, 0)


def setting_of(name: str, capability=(9, 0)) -> TrainSetting:
    """The case's setting; bf16 becomes fp16 where the GPU has no native bf16 (on sm75, SDPA's math path keeps the
    score matrices in bf16 and the measured peak could not match the estimate's kernels)."""
    model, fields = CASES[name]
    config = one_b_config() if model == "1b" else hf_config(model)
    setting = TrainSetting(model=config, world_size=1, **{"strategy": "full_shard", **fields})
    if native_bf16(capability):
        return setting
    return setting.replace(**{k: "fp16" for k in ("precision", "base_dtype") if getattr(setting, k) == "bf16"})


def error(measured: float, estimated: float) -> float:
    """measured / estimated - 1 (inf for an estimate of 0 against something measured)."""
    if not estimated:
        return 0.0 if not measured else float("inf")
    return measured / estimated - 1


def needed_bytes(gpu_view: dict) -> int:
    return int(gpu_view["nvidia_smi"] * FIT_MARGIN + FIT_SLACK)


def skip_reason(gpu_view: dict, free_bytes: int) -> str | None:
    """Why a setting must not run on a GPU with `free_bytes` free (it would run out of memory), or None."""
    need = needed_bytes(gpu_view)
    if need <= free_bytes:
        return None
    return (f"needs about {need / GIB:.1f} GiB free ({FIT_MARGIN}x the estimated device use of "
            f"{gpu_view['nvidia_smi'] / GIB:.1f} GiB, + {FIT_SLACK / GIB:.0f} GiB); the GPU has {free_bytes / GIB:.1f} GiB free")


def rows(measured: dict, estimate) -> dict:
    """{quantity: (measured bytes, estimated bytes, error)} for allocated, reserved and device used."""
    pairs = {"allocated": (measured["allocated_peak"], estimate.peak_bytes),
             "reserved": (measured["reserved_peak"], estimate.gpu_view["reserved"]),
             "device_used": (measured["device_used"], estimate.gpu_view["nvidia_smi"])}
    return {k: (m, e, error(m, e)) for k, (m, e) in pairs.items()}


def line(name: str, table: dict) -> str:
    return f"{name:<36} " + "  ".join(f"{k} {m / GIB:.2f} vs {e / GIB:.2f} GiB ({err:+.1%})"
                                      for k, (m, e, err) in table.items())
