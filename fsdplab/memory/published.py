"""Per-GPU peaks other people measured on real GPUs, kept as data with their sources and settings, and the
estimate of each (`python benchmarks/published.py` prints the table; tests/unit/test_published.py holds each case to
its tolerance). Only cases whose program the estimator can express are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..settings import GIB, TrainSetting


def llama31_8b():
    """Llama 3.1 8B's shapes as a transformers config (torchtitan trains its own implementation of them)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, use_cache=False,
                       name_or_path="llama-3.1-8b")


@dataclass
class Case:
    name: str
    source: str
    measured_gib: float
    kind: str                    # "reserved" (torch.cuda.max_memory_reserved) or "active" (max_memory_allocated)
    setting: dict
    tolerance: float             # |estimate / measured - 1| allowed
    why: str                     # the reason for the tolerance
    model: object = field(default=None, repr=False)

    def train_setting(self) -> TrainSetting:
        return TrainSetting(model=self.model(), **self.setting)


_TORCHTITAN = ("torchtitan docs/performance.md, tables 1 and 3 (torchtitan 9dec370, torch 1963fc8, December 2024; "
               "H100 96 GB; memory is torchtitan's logged max_reserved_gib)")
_TITAN_SETTING = dict(seq_len=8192, batch_size=2, precision="bf16", activation_checkpointing="selective",
                      embed_head_units=True, attention="sdpa")

CASES = [
    Case("torchtitan Llama 3.1 8B, FSDP, 8 GPUs", _TORCHTITAN, 82.4, "reserved",
         dict(world_size=8, **_TITAN_SETTING), 0.12,
         "transformers' Llama is traced, not torchtitan's model code (complex RoPE, fused AdamW); and at 8 GPUs the "
         "real run holds about 5 GiB more that scales with 1/N than the traced step does at its peak (the open part "
         "of the 8-against-128 difference, docs/estimator.md)", llama31_8b),
    Case("torchtitan Llama 3.1 8B, FSDP, 128 GPUs", _TORCHTITAN, 67.0, "reserved",
         dict(world_size=128, **_TITAN_SETTING), 0.06,
         "transformers' Llama is traced, not torchtitan's model code; the allocator model assigns streams by tensor "
         "kind", llama31_8b),
]


def compare(case: Case, progress=False) -> dict:
    """The estimate of `case`: its active peak, the allocator model's reserved, and the errors against the
    published figure."""
    from .exact import estimate

    report = estimate(case.train_setting(), progress=progress)
    predicted = report.gpu_view["reserved"] if case.kind == "reserved" else report.peak_bytes
    return {"case": case.name, "measured_gib": case.measured_gib, "kind": case.kind,
            "active_gib": report.peak_bytes / GIB, "reserved_gib": report.gpu_view["reserved"] / GIB,
            "active_error": report.peak_bytes / GIB / case.measured_gib - 1,
            "error": predicted / GIB / case.measured_gib - 1, "tolerance": case.tolerance,
            "seconds": report.seconds}


def table(rows: list) -> str:
    lines = ["| case | measured (GiB) | active peak estimate | error | reserved estimate | error | tolerance |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['measured_gib']:.1f} {r['kind']} | {r['active_gib']:.2f} | "
                     f"{r['active_error']:+.1%} | {r['reserved_gib']:.2f} | {r['error']:+.1%} | ±{r['tolerance']:.0%} |")
    return "\n".join(lines)
