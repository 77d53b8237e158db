"""One training setting, validated once: what `formula`, `estimate`, `measure`, the CLI and the LoRA recipe
take. Variants are `dataclasses.replace(setting, field=value)` (or `setting.replace(...)`);
`setting_payload` / `setting_from_payload` carry one through JSON (the estimate cache's key, an estimate
subprocess).

Also the lab's shared vocabulary: the strategy, precision and optimizer names, dtypes and byte units,
each defined here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024 ** 3   # memory is counted in binary units: GiB is what nvidia-smi and torch.cuda report
MIB = 1024 ** 2

# Every data-parallel layout the lab talks about. The formula models all of them; live ranks run the ones in
# RUNNABLE (ZeRO-1/2 are DeepSpeed's, modelled only); the exact estimator runs the ones in EXACT. ddp is torch's
# DistributedDataParallel; replicate is FSDP2's replicate(), DDP's layout on FSDP2's machinery, which holds each
# unit's unsharded copy while it computes.
STRATEGIES = ("ddp", "replicate", "zero1", "zero2", "shard_grad_op", "full_shard", "hybrid_shard")
RUNNABLE_STRATEGIES = ("ddp", "replicate", "shard_grad_op", "full_shard", "hybrid_shard")
FSDP_STRATEGIES = ("shard_grad_op", "full_shard", "hybrid_shard")
# FSDP1 (FullyShardedDataParallel, the posts' API) as its ShardingStrategy names it, and the FSDP2 layout each
# matches (the formula's model of it).
FSDP1_STRATEGIES = {"fsdp1_full_shard": "full_shard", "fsdp1_shard_grad_op": "shard_grad_op",
                    "fsdp1_no_shard": "replicate"}
EXACT_STRATEGIES = ("ddp", "replicate", "shard_grad_op", "full_shard", "hybrid_shard", *FSDP1_STRATEGIES)
PRECISIONS = ("fp32", "bf16", "fp16")
# How the base model's weights are stored: a precision, or QLoRA's 4-bit NF4 (fsdplab.nf4) for the decoder
# blocks' Linear weights, the rest in bf16.
BASE_DTYPES = PRECISIONS + ("nf4",)
# torchao's NF4 layout: a 4-bit code per weight, an int8 scaler per 64 weights, a bf16 factor per 256 scalers.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + 2 / (NF4_BLOCK * NF4_SCALER_BLOCK)
OPTIMIZERS = ("adamw", "adam", "sgd")
LORA_TARGETS = ("all-linear", "attention")
ATTENTIONS = ("sdpa", "flash", "eager")


def torch_dtype(name: str):
    """'fp32' / 'bf16' / 'fp16' -> the torch dtype (torch is imported only when a dtype is needed)."""
    import torch

    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    check_choice("precision", name, table)
    return table[name]


# Native bf16 (tensor cores, flash attention) starts with compute capability 8.0 (A100, A10, L4, H100). Below
# it (T4 7.5, V100 7.0) torch still says bf16 is supported, by emulation: slow, with math-path attention.
NATIVE_BF16_CAPABILITY = (8, 0)
AUTO_PRECISION = "auto"


def native_bf16(capability) -> bool:
    """Whether a GPU of compute capability (major, minor) computes bf16 natively."""
    return tuple(capability) >= NATIVE_BF16_CAPABILITY


def auto_precision(device=None, cpu: str = "bf16") -> str:
    """The compute dtype "auto" means on `device` (default: the current GPU if there is one, else the CPU):
    bf16 where the GPU has native bf16, else fp16, which trains only with a loss scaler
    (`fsdplab.lessons.precision.loss_scaler`); on CPU ranks `cpu`, the lab's choice there (bf16 needs no scaler).
    Asks CUDA for the capability: call it on a rank or in a script, never in a notebook's kernel."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        check_choice("cpu precision", cpu, PRECISIONS)
        return cpu
    return "bf16" if native_bf16(torch.cuda.get_device_capability(device)) else "fp16"


def resolve_precision(precision: str, device=None, cpu: str = "bf16") -> str:
    """`precision` itself, or for "auto" what `auto_precision` picks on `device`."""
    if precision == AUTO_PRECISION:
        return auto_precision(device, cpu)
    check_choice("precision", precision, PRECISIONS + (AUTO_PRECISION,))
    return precision


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}.")


# Bounds on what makes an estimate's work grow: far beyond any released run, so they refuse typos,
# not plans. The fake process group's cost grows with the ranks (16,384 took 16 s, 100,000 took
# 165 s and 2**31 ran out of memory); Llama 3's largest run used 16,384 GPUs.
MAX_WORLD_SIZE = 65_536
WORLD_SIZE_BOUND = "4 times Llama 3's 16,384 GPUs; the estimate's fake process group grows with it"


def check_positive_int(name: str, value, most: int | None = None, why: str = "") -> int:
    """`value` if an int (not a bool) from 1 to `most`; else ValueError, one line naming `name`."""
    if type(value) is not int or value < 1:
        kind = "" if value is None or type(value) is int else f" (a {type(value).__name__})"
        raise ValueError(f"{name} must be a positive integer, got {value!r}{kind}.")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most:,} ({why}), got {value!r}.")
    return value


@dataclass(frozen=True)
class TrainSetting:
    """One fine-tuning run as one rank sees it. Every field has a default that is the posts' setting or the
    most common choice; `__post_init__` rejects bad values with the fix in the message."""

    # A registered model name (fsdplab.models.MODELS), a transformers config, or a bare parameter count
    # (e.g. 60.2e6 for ResNet152: the formula then has no blocks and no activation model).
    model: object = "qwen-7b"
    # Ranks (GPUs) in the data-parallel group.
    world_size: int = 8
    # How model states are split: see STRATEGIES. full_shard is FSDP's ZeRO-3, shard_grad_op its ZeRO-2.
    strategy: str = "full_shard"
    # Compute dtype. FSDP keeps fp32 sharded parameters (the master copy) and reduces gradients in fp32.
    precision: str = "bf16"
    # Storage dtype of the base model's weights: fp32 (the master copy FSDP casts from), or 16-bit as most
    # LoRA runs load the frozen base (torch_dtype=bfloat16), or "nf4" (QLoRA: the blocks' Linear weights in
    # torchao's 4-bit NF4, the rest bf16; LoRA only). LoRA adapters stay fp32 either way.
    base_dtype: str = "fp32"
    # Optimizer: Adam/AdamW keep two fp32 states per trained parameter, SGD (momentum) one.
    optimizer: str = "adamw"
    # LoRA rank; None is a full fine-tune. alpha defaults to 2 * rank.
    lora_rank: int | None = None
    lora_alpha: int | None = None
    # Which Linear layers get adapters: every Linear in the blocks, q/k/v/o only, or a tuple of module names
    # (the formula knows the first two only).
    lora_targets: str | tuple = "all-linear"
    # Tokens per sequence and sequences per rank per step (micro-batch).
    seq_len: int = 2048
    batch_size: int = 1
    # Activation checkpointing (recompute in backward instead of keeping): False (none), True (every block),
    # an int k (every k-th block, from the first, as torchtitan's `selective_ac_option = k`), or "selective"
    # (torchtitan's per-op policy: every block keeps its attention outputs and every other matmul output).
    activation_checkpointing: bool | int | str = False
    # FSDP: sharded parameters, gradients and optimizer state live in host memory (CPUOffloadPolicy).
    cpu_offload: bool = False
    # FSDP: one unit per transformer block (True) or the whole model as one unit.
    per_block: bool = True
    # hybrid_shard: ranks in one shard group (one node); None means min(world_size, 8).
    shard_group_size: int | None = None
    # full_shard: after forward, keep each unit's parameters sharded over this many ranks instead of all of them
    # (FSDP2's reshard_after_forward=int, torchtitan's "reshard to a smaller group": e.g. 8, one node), so the
    # backward all-gather stays inside that group; None reshards to the full world as FULL_SHARD does.
    reshard_to: int | None = None
    # The attention implementation transformers runs: "sdpa" (its default; memory-efficient kernels that never
    # store the score matrix), "flash" (flash_attention_2: the same memory; traced as sdpa where flash-attn is
    # not installed) or "eager" (plain matmuls: the b*heads*s*s scores and softmax are stored). None: what the
    # model's config names (config._attn_implementation), else sdpa.
    attention: str | None = None
    # The loss: 1 is plain cross-entropy on the whole logits (transformers' own, with its fp32 copy); k > 1
    # applies the output head and the fp32 cross-entropy to k chunks of the sequence (torchtune's
    # CEWithChunkedOutputLoss), so one chunk's fp32 copy exists at a time.
    loss_chunks: int = 1
    # FSDP: the input embedding and the output head as FSDP units of their own (torchtitan wraps them so),
    # instead of in the root unit with the final norm.
    embed_head_units: bool = False
    # transformers' KV cache during the training forward (use_cache=True). Without checkpointing it costs no
    # memory at the peak (attention keeps the same keys and values for backward). With checkpointing it is
    # refused: the recomputed forward appends to the cache again, so the recomputed attention sees twice the
    # keys (wrong gradients with SDPA, a shape error with eager); transformers turns it off under its own
    # gradient checkpointing for this reason.
    use_cache: bool = False
    # LoRA dropout on the adapters' input (peft's lora_dropout; 0.1 in many recipes): peft then keeps the dropped
    # input of each adapted Linear for lora_A's backward, one more activation per adapted layer.
    lora_dropout: float = 0.0
    # Storage dtype of the LoRA adapters: fp32 (peft's default, the master copy) or 16-bit, as torchtune and LitGPT
    # keep them; their gradients and Adam's m and v take the same dtype.
    adapter_dtype: str = "fp32"
    # Gradient accumulation: micro-batches per optimizer step (each of batch_size sequences), and whether their
    # gradients are reduced only after the last (no_sync: FSDP2 then keeps every unit's unsharded gradients
    # from the first micro-batch's backward to the last).
    grad_accum: int = 1
    no_sync: bool = False

    def __post_init__(self):
        check_positive_int("world_size", self.world_size, MAX_WORLD_SIZE, WORLD_SIZE_BOUND)
        check_choice("strategy", self.strategy, STRATEGIES + tuple(FSDP1_STRATEGIES))
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("base_dtype", self.base_dtype, BASE_DTYPES)
        if self.base_dtype == "nf4" and self.lora_rank is None:
            raise ValueError("an NF4 base is frozen 4-bit weights: it trains only with LoRA adapters (QLoRA). Set "
                             "lora_rank, or use base_dtype 'bf16' for a full fine-tune.")
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if isinstance(self.lora_targets, (list, tuple)):
            if not self.lora_targets or not all(isinstance(n, str) for n in self.lora_targets):
                raise ValueError("lora_targets as a list must hold module names such as ('q_proj', 'v_proj').")
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        else:
            check_choice("lora_targets", self.lora_targets, LORA_TARGETS)
        if self.lora_rank is not None and (type(self.lora_rank) is not int or self.lora_rank < 1):
            raise ValueError(f"lora_rank must be a positive integer or None (full fine-tune), got {self.lora_rank!r}.")
        # a bool is no length
        if any(type(v) is not int or v < 1 for v in (self.seq_len, self.batch_size)):
            raise ValueError(f"seq_len and batch_size must be positive integers, got {self.seq_len!r} and "
                             f"{self.batch_size!r}.")
        if isinstance(self.model, (int, float)) and not isinstance(self.model, bool):
            if not 0 < self.model < float("inf"):
                raise ValueError(f"model as a parameter count must be a positive number "
                                 f"(e.g. 60.2e6), got {self.model!r}.")
            if self.lora_rank is not None:
                raise ValueError("lora_rank needs a transformer model (a name or a config), not a parameter count.")
        elif isinstance(self.model, str) and ":" in self.model or type(self.model).__name__ == "CustomModel":
            from .custom import check, custom_of

            check(custom_of(self.model), self)
        elif isinstance(self.model, str):
            from .models import MODELS

            if self.model not in MODELS:
                raise ValueError(f"unknown model {self.model!r}: use one of {list(MODELS)}, a transformers config, "
                                 "or a parameter count such as 60.2e6.")
        elif not hasattr(self.model, "hidden_size"):
            from .models import MODELS

            raise ValueError(f"model must be a name ({'/'.join(MODELS)}), a transformers config, a parameter "
                             f"count or a fsdplab.custom.CustomModel; got {type(self.model).__name__}.")
        else:
            from .models import check_config_sizes

            check_config_sizes(self.model)
        if self.attention is not None:
            check_choice("attention", self.attention, ATTENTIONS)
        ac = self.activation_checkpointing
        if ac is None or ac == "none" or (type(ac) is int and ac == 0):
            object.__setattr__(self, "activation_checkpointing", False)
        elif ac == "full" or (type(ac) is int and ac == 1):
            object.__setattr__(self, "activation_checkpointing", True)
        elif not (isinstance(ac, bool) or ac in ("selective", "reentrant") or (isinstance(ac, int) and ac > 1)):
            raise ValueError(f"activation_checkpointing must be False, True (every block), an int k > 1 (every "
                             f"k-th block), 'selective' (per-op) or 'reentrant' (every block, use_reentrant=True), "
                             f"got {ac!r}.")
        if not isinstance(self.loss_chunks, int) or isinstance(self.loss_chunks, bool) or self.loss_chunks < 1:
            raise ValueError(f"loss_chunks must be a positive integer (1: plain cross-entropy; 8 is torchtune's "
                             f"chunked loss), got {self.loss_chunks!r}.")
        if self.reshard_to is not None:
            if self.strategy != "full_shard":
                raise ValueError(f"reshard_to applies to full_shard (it replaces resharding to every rank after "
                                 f"forward), not {self.strategy}.")
            if not isinstance(self.reshard_to, int) or isinstance(self.reshard_to, bool) or self.reshard_to < 2 \
                    or self.world_size % self.reshard_to:
                raise ValueError(f"reshard_to must be a number of ranks (2 or more) that divides world_size "
                                 f"({self.world_size}), e.g. 8 for one node; got {self.reshard_to!r} (to keep whole "
                                 f"parameters after forward, use strategy='shard_grad_op').")
        if self.use_cache and self.activation_checkpointing:
            raise ValueError("use_cache=True with activation checkpointing: the recomputed forward appends to "
                             "transformers' KV cache again and attends to twice the keys (wrong gradients). Keep "
                             "use_cache=False when training with checkpointing, as transformers does.")
        if self.strategy == "hybrid_shard" and self.world_size % self.shards:
            raise ValueError(f"hybrid_shard needs world_size ({self.world_size}) to be a multiple of "
                             f"shard_group_size ({self.shards}).")
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) \
                or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout is a probability in [0, 1) (e.g. 0.05), got {self.lora_dropout!r}.")
        check_choice("adapter_dtype", self.adapter_dtype, PRECISIONS)
        if type(self.grad_accum) is not int or self.grad_accum < 1:
            raise ValueError(f"grad_accum is a number of micro-batches per optimizer step (1 or more), got "
                             f"{self.grad_accum!r}.")
        if self.strategy in FSDP1_STRATEGIES and self.lora_rank is not None:
            raise ValueError("FSDP1 with LoRA needs use_orig_params=True (a unit then mixes frozen and trained "
                             "parameters in one flat parameter), and a trace of that does not match live ranks yet: "
                             "use FSDP2 (full_shard, shard_grad_op) for LoRA.")
        if self.no_sync and self.grad_accum == 1:
            raise ValueError("no_sync skips the gradient reduction of all micro-batches but the last: set "
                             "grad_accum to 2 or more.")
        if self.lora_rank is None and (self.lora_dropout or self.adapter_dtype != "fp32"):
            raise ValueError("lora_dropout and adapter_dtype describe LoRA adapters: set lora_rank (e.g. 16) too.")

    # -- derived values
    @property
    def model_name(self) -> str:
        """The model as a short label."""
        if isinstance(self.model, str):
            return self.model
        if isinstance(self.model, (int, float)):
            return f"{self.model / 1e6:g}M params"
        return getattr(self.model, "name_or_path", "") or type(self.model).__name__

    @property
    def reshard_after_forward(self) -> bool | int:
        """FSDP2's reshard_after_forward: True (FULL_SHARD), False (SHARD_GRAD_OP), or `reshard_to` ranks."""
        if self.reshard_to is not None and self.reshard_to != self.world_size:
            return self.reshard_to
        return self.strategy not in ("shard_grad_op", "fsdp1_shard_grad_op")

    @property
    def attention_kind(self) -> str:
        """`attention`, or where it is None the model config's own choice: "sdpa", "flash" or "eager"."""
        if self.attention is not None:
            return self.attention
        named = getattr(self.model, "_attn_implementation", None) if hasattr(self.model, "hidden_size") else None
        return {"flash_attention_2": "flash", "eager": "eager"}.get(named, "sdpa")

    @property
    def flash_attention(self) -> bool:
        """Attention that never stores the score matrix (sdpa and flash do; eager does)."""
        return self.attention_kind != "eager"

    @property
    def checkpointed_every(self) -> int | None:
        """Every how many blocks one is checkpointed as a whole (1: all), or None (none, or per-op)."""
        ac = self.activation_checkpointing
        return None if ac is False or ac == "selective" else 1 if ac in (True, "reentrant") else ac

    @property
    def shards(self) -> int:
        """Ranks one parameter is split over (1 for DDP and ZeRO's replicated weights)."""
        if self.strategy == "hybrid_shard":
            return self.shard_group_size or min(self.world_size, 8)
        strategy = FSDP1_STRATEGIES.get(self.strategy, self.strategy)
        return self.world_size if strategy in FSDP_STRATEGIES else 1

    @property
    def alpha(self) -> int | None:
        return None if self.lora_rank is None else (self.lora_alpha or 2 * self.lora_rank)

    def replace(self, **changes) -> "TrainSetting":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain values (the model as its label): what a report records."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["model"] = self.model_name
        data["attention"] = self.attention_kind     # what runs, where the setting left it to the model's config
        return data


def as_setting(setting: TrainSetting | None = None, **changes) -> TrainSetting:
    """`setting` with `changes` applied, or a new TrainSetting from `changes`: the one entry point that
    turns keyword arguments into a validated setting."""
    if setting is None:
        return TrainSetting(**changes)
    if not isinstance(setting, TrainSetting):
        raise ValueError(f"expected a TrainSetting, got {type(setting).__name__}: pass fields as keywords, e.g. "
                         "model='qwen-7b', world_size=8.")
    return dataclasses.replace(setting, **changes) if changes else setting


def setting_payload(setting: TrainSetting) -> dict:
    """`setting` as JSON-ready values, a transformers config as its class and dict: what the estimate cache
    hashes and what an estimate subprocess receives (`setting_from_payload` turns it back)."""
    data = {name: getattr(setting, name) for name in setting.__dataclass_fields__}
    if type(setting.model).__name__ == "CustomModel":
        if setting.model.spec is None:
            raise ValueError("a CustomModel made in this process cannot go to another one: define the function "
                             "that returns it in a module and pass 'package.module:function' as the model.")
        data["model"] = setting.model.spec
    elif not isinstance(setting.model, (str, int, float)):
        config = setting.model
        data["model"] = {"config_class": f"{type(config).__module__}.{type(config).__name__}",
                         "config": config.to_dict()}
    return data


def setting_from_payload(data: dict) -> TrainSetting:
    """The TrainSetting of a `setting_payload`."""
    model = data["model"]
    if isinstance(model, dict):
        import importlib

        module, _, name = model["config_class"].rpartition(".")
        data = dict(data, model=getattr(importlib.import_module(module), name)(**model["config"]))
    return TrainSetting(**data)
