"""Peaks measured on a real GPU against the exact estimate: one NVIDIA H200, torch 2.11.0+cu130, 17 settings
(and two under cpu_offload that are not comparable), kept as data with how each number was taken.

`python benchmarks/published.py --h200` prints the table afresh; tests/unit/test_gpu_measured.py holds the
estimator, run on this machine's CPU, to each small row's figures, so a change that breaks the agreement with
the GPU fails CI. The 7B rows take too long for CI: `benchmarks/published.py --h200 --all` checks them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import GIB, TrainSetting

MACHINE = {
    "date": "2026-12-04",
    "gpu": "one NVIDIA H200 (139.8 GiB, compute capability 9.0), driver 580.159.04",
    "software": "torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9, Python 3.12, transformers 5.17.0, peft 0.21.0",
    "lab": "fsdplab b7ea962",
}
METHOD = (
    "one nccl rank under torchrun (--nproc_per_node 1), all settings in one process; each setting built on the GPU "
    "with fsdplab.sharding.build_model + apply_data_parallel + make_optimizer, then three train_steps; per step "
    "after torch.cuda.reset_peak_memory_stats: torch.cuda.max_memory_allocated above what was allocated before "
    "the build ('allocated'), and torch.cuda.max_memory_reserved ('reserved'); the last step's figures. 'device "
    "used' is torch.cuda.mem_get_info's total - free after the steps, and 'outside the allocator' that minus "
    "torch.cuda.memory_reserved().")
ESTIMATED_WITH = ("`fsdplab estimate --world-size 1 --gpu-mem-gib 140 --json --attention sdpa` on a CPU machine "
                  "with torch 2.13.0 (fsdplab b7ea962)")

# Measured outside the caching allocator (mem_get_info's total - free, less memory_reserved) at world size 1:
# 877,461,504 B (0.82 GiB) on every FSDP2 setting run before the first replicate one (881,655,808 B with the Llama
# models); from the first replicate setting on, 1,389,166,592 B in the same process: 488 MiB more, which stayed.
# (The run named those settings "-ddp": the lab's ddp meant FSDP2's replicate() then. Its own files keep the names.)
# FSDP2 issues no collective at world size 1 (it copies the shards in place of an all-gather); replicate()'s
# first collective made NCCL's communicator. fsdplab.memory.allocator holds both figures (it sits below this module).
from .allocator import OUTSIDE_ALLOCATOR_AFTER_NCCL_WS1, OUTSIDE_ALLOCATOR_FSDP_WS1  # noqa: E402


def one_b():
    """The '1b' model of the run: Qwen-7B's Qwen2 layout at hidden 2048, 16 layers, MLP 6144, vocabulary 32,000."""
    import transformers

    from ..models import MODELS

    entry = MODELS["qwen-7b"]
    return getattr(transformers, entry.config_class)(**{**entry.fields, **dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=6144, vocab_size=32000, max_position_embeddings=4096)})


@dataclass
class Row:
    case: str
    model: str                    # "1b" (one_b) or a registry name
    setting: dict                 # TrainSetting fields besides model (world size 1, sdpa attention)
    allocated: int                # measured bytes: max_memory_allocated above the pre-build allocation
    reserved: int                 # measured bytes: max_memory_reserved
    device_used: int              # measured bytes: mem_get_info's total - free
    outside_allocator: int        # measured bytes: device_used - memory_reserved
    estimated_active: int         # the estimate made on CPU (ESTIMATED_WITH): peak_bytes
    estimated_reserved: int       # its gpu_view["reserved"] (0: the estimate of the time had no GPU view)
    in_ci: bool = False           # small enough for tests/unit/test_gpu_measured.py (a few seconds on 2 cores)
    not_comparable: str = ""      # why the row is no comparison, if it is not

    def train_setting(self) -> TrainSetting:
        model = one_b() if self.model == "1b" else self.model
        return TrainSetting(model=model, world_size=1, **{"attention": "sdpa", **self.setting})


_AA7 = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
_B16 = dict(base_dtype="bf16", precision="bf16")
_LORA_1B = dict(lora_rank=64, lora_alpha=128)
_OFF = ("sharding.apply_data_parallel passes no cpu_offload to fully_shard, so the measured program did not "
        "offload (its peaks are those of the same setting without offload), and it built the model on the GPU")

# case, model, setting, allocated, reserved, device used, outside the allocator, estimated active, reserved, in CI
_DATA = [
    ("1b-full", "1b", dict(seq_len=2048), 20141238784, 22257074176, 23134535680, 877461504,
     20073080080, 22959620096, False),
    ("1b-full+ac", "1b", dict(seq_len=2048, activation_checkpointing=True), 20074128896, 21533556736,
     22411018240, 877461504, 20073080080, 20531118080, True),
    ("1b-lora", "1b", dict(seq_len=2048, **_LORA_1B), 8564684800, 9359589376, 10237050880, 877461504,
     8552084872, 9076473856, False),
    ("1b-lora+ac", "1b", dict(seq_len=2048, activation_checkpointing=True, **_LORA_1B), 5724887040, 6496976896,
     7374438400, 877461504, 5718594952, 6050283520, True),
    ("qwen7b-lora64-ac-bf16", "qwen-7b", dict(seq_len=2048, lora_rank=64, activation_checkpointing=True, **_B16),
     24169998336, 26247954432, 27125415936, 877461504, 24156367112, 25985810432, False),
    ("qwen7b-lora64-noac-bf16", "qwen-7b", dict(seq_len=2048, lora_rank=64, **_B16), 34924726272, 38256246784,
     39133708288, 877461504, 34793621768, 36823891968, False),
    ("qwen7b-lora64-ac-fp16", "qwen-7b", dict(seq_len=2048, lora_rank=64, activation_checkpointing=True,
                                              base_dtype="fp16", precision="fp16"),
     24169998336, 26247954432, 27125415936, 877461504, 24156367112, 25985810432, False),
    ("llama2-7b-lora8qv-ac-b2s512", "llama2-7b", dict(seq_len=512, batch_size=2, lora_rank=8, lora_alpha=16,
                                                       lora_targets=("q_proj", "v_proj"),
                                                       activation_checkpointing=True, **_B16),
     14945049600, 15418261504, 16299917312, 881655808, 14944523272, 15353249792, False),
    ("llama2-7b-lora64aa7-ac-b1s2048", "llama2-7b", dict(seq_len=2048, lora_rank=64, lora_alpha=16, lora_targets=_AA7,
                                                          activation_checkpointing=True, **_B16),
     17218161664, 18809356288, 19691012096, 881655808, 17180280840, 18354274304, False),
    ("llama2-7b-lora64aa7-ac-b4s2048", "llama2-7b", dict(seq_len=2048, batch_size=4, lora_rank=64, lora_alpha=16,
                                                          lora_targets=_AA7, activation_checkpointing=True, **_B16),
     21147289600, 23957864448, 24839520256, 881655808, 21147289608, 23836229632, False),
    ("1b-lora+ac-replicate", "1b", dict(seq_len=2048, activation_checkpointing=True, strategy="replicate", **_LORA_1B),
     7626808320, 7964983296, 9354149888, 1389166592, 7547639176, 7897874432, True),
    ("1b-full+ac-replicate", "1b", dict(seq_len=2048, activation_checkpointing=True, strategy="replicate"),
     20073080320, 22041067520, 23430234112, 1389166592, 20073080080, 21441282048, False),
    ("llama2-7b-lora64aa7-ac-b4s2048-replicate", "llama2-7b", dict(seq_len=2048, batch_size=4, lora_rank=64,
                                                              lora_alpha=16, lora_targets=_AA7,
                                                              activation_checkpointing=True, strategy="replicate",
                                                              **_B16),
     34392508416, 36853252096, 38244515840, 1391263744, 34386085896, 36586913792, False),
    ("llama2-7b-lora64aa7-ac-b10s2048-off", "llama2-7b", dict(seq_len=2048, batch_size=10, lora_rank=64, lora_alpha=16,
                                                               lora_targets=_AA7, activation_checkpointing=True,
                                                               cpu_offload=True, **_B16),
     29289957376, 35043409920, 36434673664, 1391263744, 14094180872, 0, False),
    ("1b-full+ac-off", "1b", dict(seq_len=2048, activation_checkpointing=True, cpu_offload=True),
     20073080320, 21544042496, 22935306240, 1391263744, 1217442312, 0, False),
    ("qwen7b-lora64-ac-bf16-s8192", "qwen-7b", dict(seq_len=8192, lora_rank=64, activation_checkpointing=True, **_B16),
     37078812672, 42263904256, 43655168000, 1391263744, 37072849160, 41768976384, False),
    ("1b-full-chunks8", "1b", dict(seq_len=2048, loss_chunks=8), 20073080320, 21881683968, 23272947712, 1391263744,
     20073080080, 22854762496, False),
    ("1b-full-eager", "1b", dict(seq_len=2048, attention="eager"), 22831892480, 27904704512, 29295968256,
     1391263744, 22790984980, 24599592960, True),
    ("1b-full-sac", "1b", dict(seq_len=2048, activation_checkpointing="selective"), 20073080320, 21730689024,
     23121952768, 1391263744, 20073080080, 20736638976, False),
]
ROWS = [Row(case, model, dict(setting), *numbers, in_ci=ci, not_comparable=_OFF if setting.get("cpu_offload") else "")
        for case, model, setting, *numbers, ci in _DATA]
COMPARABLE = [r for r in ROWS if not r.not_comparable]

# How far the estimate may move from the figures it gave when the table was made before CI fails (a change to the
# estimator that moves them is a change to what the GPU agreed with), and how far from the GPU it may be.
ESTIMATE_DRIFT = 0.002
ACTIVE_TOLERANCE = 0.012          # the measured agreement: within 1.0% on every comparable row
RESERVED_TOLERANCE = 0.12         # measured: -11.8% .. +4.4%


def compare(row: Row, progress=False) -> dict:
    """A fresh estimate of `row` against what the GPU measured and what the estimate was when it was taken."""
    from .exact import estimate

    report = estimate(row.train_setting(), progress=progress)
    reserved = report.gpu_view.get("reserved", 0)
    return {"case": row.case, "allocated_gib": row.allocated / GIB, "reserved_measured_gib": row.reserved / GIB,
            "active_gib": report.peak_bytes / GIB, "reserved_gib": reserved / GIB,
            "active_error": report.peak_bytes / row.allocated - 1,
            "reserved_error": reserved / row.reserved - 1 if reserved else None,
            "active_drift": report.peak_bytes / row.estimated_active - 1,
            "reserved_drift": reserved / row.estimated_reserved - 1 if row.estimated_reserved else None,
            "seconds": report.seconds, "report": report}


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def table(rows=None) -> str:
    """The stored table: what the H200 measured and what the estimate on a CPU machine said (GiB)."""
    lines = ["| case | allocated, measured | estimate (active) | error | reserved, measured | estimate | error |"
             " device used | outside the allocator |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows or ROWS:
        reserved_error = r.estimated_reserved / r.reserved - 1 if r.estimated_reserved else None
        mark = " (†)" if r.not_comparable else ""
        lines.append(f"| {r.case}{mark} | {r.allocated / GIB:.2f} | {r.estimated_active / GIB:.2f} | "
                     f"{_pct(r.estimated_active / r.allocated - 1)} | {r.reserved / GIB:.2f} | "
                     f"{r.estimated_reserved / GIB:.2f} | {_pct(reserved_error)} | {r.device_used / GIB:.2f} | "
                     f"{r.outside_allocator / GIB:.2f} |")
    return "\n".join(lines)


def summary(rows=None) -> str:
    """One paragraph: the machine, the method and the spread over the comparable rows. `rows`: the table it is
    printed under (default: every row); the note on rows marked (†) only when one of them is."""
    active = [r.estimated_active / r.allocated - 1 for r in COMPARABLE]
    reserved = [r.estimated_reserved / r.reserved - 1 for r in COMPARABLE]
    return (f"measured on an H200 ({MACHINE['date']}; {MACHINE['software']}): {METHOD} Estimated: {ESTIMATED_WITH}. "
            f"Over the {len(COMPARABLE)} comparable settings the active estimate is within "
            f"{min(active):+.1%} .. {max(active):+.1%} of max_memory_allocated, the reserved estimate within "
            f"{min(reserved):+.1%} .. {max(reserved):+.1%} of max_memory_reserved."
            + (f" (†) {_OFF}." if any(r.not_comparable for r in (ROWS if rows is None else rows)) else ""))
