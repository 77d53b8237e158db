"""The 17 settings the estimator was first held against a GPU with (one H200, one rank, 2026-12-04), as
TrainSettings, and the arithmetic of the comparison: the error of an estimate, whether a setting fits in the free
memory of a GPU, and fp16 in place of bf16 where the GPU has no native bf16 (compute capability < 8.0).
A plain module (no GPU, no fixtures), so the CPU suite tests it."""

from __future__ import annotations

from fsdplab.memory import gpu_measured
from fsdplab.models import hf_config
from fsdplab.settings import GIB, native_bf16

# The settings of that run, as fsdplab.memory.gpu_measured keeps them with what the GPU measured: its comparable rows.
# The two CPU-offload settings are left out: it built them on the GPU first, unlike an offloading program.
CASES = {row.case: row for row in gpu_measured.COMPARABLE}
ONE_B_PARAMS = 1_003_653_120         # parameters of gpu_measured.one_b(), the run's ~1.0B Qwen2
# Bounds on |measured / estimated - 1|. On 2026-12-04 the worst were 1.0% (allocated), 11.8% (reserved, eager
# attention) and 14.2% (device in use: the CUDA context, cuBLAS and NCCL outside the allocator, 0.82 GiB there
# against 0.5 GiB assumed).
TOLERANCE = {"allocated": 0.05, "reserved": 0.15, "device_used": 0.20}
FIT_MARGIN = 1.15          # a setting runs only where the free memory holds its estimated device use this many times
FIT_SLACK = 1 * GIB        # plus this (the rank's CUDA context is counted in the estimate; fragmentation is not)


def one_b_config():
    return gpu_measured.one_b()


def setting_of(name: str, capability=(9, 0)):
    """The case's setting; bf16 becomes fp16 where the GPU has no native bf16 (on sm75, SDPA's math path keeps the
    score matrices in bf16 and the measured peak could not match the estimate's kernels)."""
    setting = CASES[name].train_setting()
    if isinstance(setting.model, str):
        setting = setting.replace(model=hf_config(setting.model))
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
            f"{gpu_view['nvidia_smi'] / GIB:.1f} GiB, + {FIT_SLACK / GIB:.0f} GiB); the GPU has "
            f"{free_bytes / GIB:.1f} GiB free")


def rows(measured: dict, estimate) -> dict:
    """{quantity: (measured bytes, estimated bytes, error)} for allocated, reserved and device used."""
    pairs = {"allocated": (measured["allocated_peak"], estimate.peak_bytes),
             "reserved": (measured["reserved_peak"], estimate.gpu_view["reserved"]),
             "device_used": (measured["device_used"], estimate.gpu_view["nvidia_smi"])}
    return {k: (m, e, error(m, e)) for k, (m, e) in pairs.items()}


def line(name: str, table: dict) -> str:
    return f"{name:<36} " + "  ".join(f"{k} {m / GIB:.2f} vs {e / GIB:.2f} GiB ({err:+.1%})"
                                      for k, (m, e, err) in table.items())
