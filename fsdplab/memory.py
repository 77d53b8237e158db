"""How much memory one rank needs: three answers that must agree.

- `formula(...)`: the analytic model. Bytes per parameter for parameters, gradients and optimizer state
  under DDP, ZeRO-1/2 and FSDP (FULL_SHARD, SHARD_GRAD_OP, HYBRID), the unsharded unit in flight, and
  Korthikanti et al.'s activation model. Instant, any size: the dashboard draws it.
- `estimate(...)`: the exact per-rank figure of a real training step at full scale, without GPUs: a fake
  process group of any world size, fake tensors, FSDP2 and two optimizer steps under torch's FSDP memory
  tracker (see fsdplab/fake.py). Qwen-7B on 8 ranks takes seconds and a few hundred MB of RAM.
- `measure(...)`: what live ranks really hold, per category (inside `cluster.run`).

Every answer is a `MemoryReport` with the same six categories: parameters, gradients, optimizer_state,
activations, communication_buffers, other.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from .fake import CATEGORIES

GIB = 1024 ** 3
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
                   "activations": "activations", "communication_buffers": "communication buffers",
                   "other": "other (temporaries, buffers)"}
STRATEGIES = ("ddp", "zero1", "zero2", "shard_grad_op", "full_shard", "hybrid_shard")
OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")


# --- the report ---------------------------------------------------------------------------------------

@dataclass
class MemoryReport:
    """Per-rank memory of one training setup. Bytes throughout."""

    peak_bytes: int
    by_category: dict
    world_size: int
    settings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    source: str = "estimate"          # "formula", "estimate" (fake tensors) or "measure" (live ranks)
    resident: dict = field(default_factory=dict)   # steady-state sharded parameters / gradients / optimizer state
    detail: dict = field(default_factory=dict)     # the tracker's own categories at the peak, or formula terms
    category_peaks: dict = field(default_factory=dict)  # each category's own maximum over the step
    seconds: float = 0.0

    def fits(self, gpu_mem_gib: float, reserve_gib: float = 0.0) -> bool:
        """True if the peak fits in `gpu_mem_gib` GiB, keeping `reserve_gib` for the CUDA context and
        allocator fragmentation (which no estimate here includes)."""
        return self.peak_bytes <= (gpu_mem_gib - reserve_gib) * GIB

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryReport":
        return cls(**data)

    def table(self, gpu_mem_gib: float | None = None) -> str:
        """A readable per-category table (GiB), the peak and, with `gpu_mem_gib`, whether it fits."""
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        lines = [f"per-rank memory ({self.source}), world size {self.world_size}", f"  {settings}", ""]
        width = max(len(v) for v in CATEGORY_LABELS.values())
        unit, div = ("GiB", GIB) if self.peak_bytes >= GIB / 4 else ("MiB", 2 ** 20)
        for name in CATEGORIES:
            value = self.by_category.get(name, 0)
            share = value / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"  {CATEGORY_LABELS[name]:<{width}}  {value / div:9.3f} {unit}  {share:6.1%}")
        lines.append(f"  {'peak':<{width}}  {self.peak_bytes / div:9.3f} {unit}")
        if self.resident:
            lines.append("  resident shards: " + ", ".join(f"{k} {v / div:.3f} {unit}"
                                                          for k, v in self.resident.items()))
        if gpu_mem_gib is not None:
            verdict = "fits" if self.fits(gpu_mem_gib) else "does NOT fit"
            lines.append(f"  {verdict} in {gpu_mem_gib:g} GiB per GPU")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --- model sizes --------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """A decoder-only transformer's sizes (what the formula needs), or just a parameter count."""

    name: str
    hidden: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    intermediate: int = 0
    vocab: int = 0
    qkv_bias: bool = False
    tied: bool = False
    params: int | None = None     # a model that is only a parameter count (e.g. ResNet152)

    @property
    def is_transformer(self) -> bool:
        return self.params is None

    def block_shapes(self) -> list:
        """(name, shape) of every parameter of one decoder block (Llama/Qwen2: SwiGLU MLP, RMSNorm)."""
        h, kv = self.hidden, self.hidden // self.num_heads * self.num_kv_heads
        shapes = [("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h))]
        if self.qkv_bias:
            shapes += [("q_proj.bias", (h,)), ("k_proj.bias", (kv,)), ("v_proj.bias", (kv,))]
        shapes += [("o_proj", (h, h)), ("gate_proj", (self.intermediate, h)), ("up_proj", (self.intermediate, h)),
                   ("down_proj", (h, self.intermediate)), ("input_layernorm", (h,)),
                   ("post_attention_layernorm", (h,))]
        return shapes

    def root_shapes(self) -> list:
        shapes = [("embed_tokens", (self.vocab, self.hidden)), ("norm", (self.hidden,))]
        if not self.tied:
            shapes.append(("lm_head", (self.vocab, self.hidden)))
        return shapes

    def lora_shapes(self, rank: int, targets="all-linear") -> list:
        """(name, shape) of one block's LoRA adapters: A is (r, in), B is (out, r) for each targeted Linear."""
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]
        if targets == "all-linear":
            names += ["gate_proj", "up_proj", "down_proj"]
        elif targets != "attention":
            raise ValueError(f"lora_targets must be 'all-linear' or 'attention', got {targets!r}.")
        out = []
        for name, shape in self.block_shapes():
            if name in names:
                rows, cols = shape
                out += [(f"{name}.lora_A", (rank, cols)), (f"{name}.lora_B", (rows, rank))]
        return out

    def total_params(self) -> int:
        if not self.is_transformer:
            return int(self.params)
        numel = lambda shapes: sum(math.prod(s) for _, s in shapes)  # noqa: E731
        return self.num_layers * numel(self.block_shapes()) + numel(self.root_shapes())


# Sizes for the formula; the first four match fsdplab.models.hf_config exactly (tests check it).
MODEL_SPECS = {
    "tiny": ModelSpec("tiny", 128, 4, 4, 2, 256, 512, qkv_bias=True),
    "qwen-7b": ModelSpec("qwen-7b", 4096, 32, 32, 32, 11008, 151936, qkv_bias=True),
    "qwen2-7b": ModelSpec("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, qkv_bias=True),
    "llama2-7b": ModelSpec("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
    "llama2-13b": ModelSpec("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
    "llama2-70b": ModelSpec("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
}


def spec_of(model) -> ModelSpec:
    """A ModelSpec from a name in MODEL_SPECS, a transformers config, a ModelSpec, or a parameter count."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        if model not in MODEL_SPECS:
            raise ValueError(f"unknown model {model!r}: use one of {list(MODEL_SPECS)}, a transformers config, "
                             "or a parameter count such as 60.2e6.")
        return MODEL_SPECS[model]
    if isinstance(model, (int, float)):
        return ModelSpec(f"{model / 1e6:g}M params", params=int(model))
    if hasattr(model, "hidden_size"):
        c = model
        return ModelSpec(getattr(c, "name_or_path", "") or type(c).__name__, c.hidden_size, c.num_hidden_layers,
                         c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                         c.intermediate_size, c.vocab_size,
                         qkv_bias=getattr(c, "model_type", "") == "qwen2" or bool(getattr(c, "attention_bias", False)),
                         tied=bool(getattr(c, "tie_word_embeddings", False)))
    raise ValueError(f"model must be a name ({list(MODEL_SPECS)}), a transformers config or a parameter count; "
                     f"got {type(model).__name__}.")


def hf_config_of(model):
    """A transformers config for a model name (fsdplab.models.hf_config, plus llama2-13b/70b), or `model`."""
    if not isinstance(model, str):
        return model
    from .models import MODEL_NAMES, hf_config

    if model in MODEL_NAMES:
        return hf_config(model)
    if model in ("llama2-13b", "llama2-70b"):
        from transformers import LlamaConfig

        s = MODEL_SPECS[model]
        return LlamaConfig(hidden_size=s.hidden, num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                           num_key_value_heads=s.num_kv_heads, intermediate_size=s.intermediate,
                           vocab_size=s.vocab, max_position_embeddings=4096, use_cache=False)
    raise ValueError(f"unknown model {model!r}: use one of {list(MODEL_NAMES) + ['llama2-13b', 'llama2-70b']} "
                     "or pass a transformers config.")


# --- the formula --------------------------------------------------------------------------------------

def shard_numel(shape, shards: int) -> int:
    """Elements FSDP2 keeps per rank for one parameter: dim 0 is padded up to a multiple of `shards`."""
    rows = shape[0]
    return math.ceil(rows / shards) * math.prod(shape[1:])


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}.")


def formula(model="qwen-7b", world_size: int = 8, *, strategy: str = "full_shard", precision: str = "bf16",
            optimizer: str = "adamw", lora_rank: int | None = None, lora_targets: str = "all-linear",
            seq_len: int = 2048, batch_size: int = 1, activation_checkpointing: bool = False,
            cpu_offload: bool = False, per_block: bool = True, shard_group_size: int | None = None,
            flash_attention: bool = True, activation_bytes: int | None = None) -> MemoryReport:
    """Analytic per-rank memory. Model states follow two layouts that both cost 16 bytes per trained
    parameter with Adam (a parameter count such as 60.2e6 works too; transformer names or configs add the
    unit in flight and activations):

    - DDP / ZeRO-1 / ZeRO-2 (the ZeRO paper's mixed precision): 2-byte weights and gradients, 12 bytes of
      fp32 optimizer state (master copy, m, v). ZeRO-1 shards the optimizer state, ZeRO-2 also gradients.
    - FSDP2 (shard_grad_op, full_shard, hybrid_shard): the sharded fp32 parameters ARE the master copy
      (4 B), sharded gradients are fp32 (4 B), Adam keeps m and v (8 B); 16-bit copies exist only for the
      unit being computed ("in flight"). Each parameter's dim 0 is padded to a multiple of the shard count.

    With fp32 every layout is 4 + 4 + 8. SGD keeps one momentum buffer (4 B), no step counter. Frozen
    (LoRA base) weights keep no gradient and no optimizer state. Activations (transformers only):
    Korthikanti et al. s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations, where 5*a*s/h is the
    attention score matrices: flash / memory-efficient SDPA kernels (transformers' default, and what
    `estimate` runs) never store them, so `flash_attention=True` (the default) drops that term. With
    checkpointing 2*s*b*h per layer is kept, plus one layer recomputed at a time. Plus the logits
    s*b*vocab*(2 + 4 + 4) (16-bit logits, the fp32 copy the loss takes, the fp32 log-softmax).
    The categories are summed as if their peaks coincide, so the total is an upper estimate.
    """
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    spec = spec_of(model)
    n = world_size
    w = 4 if precision == "fp32" else 2         # bytes of a compute-dtype element
    state_bytes = 8 if optimizer in ("adam", "adamw") else 4
    notes, detail = [], {}

    # Parameter shapes: (shape, trainable, where) with where in {"block", "root"}.
    if spec.is_transformer:
        shapes = [(s, lora_rank is None, "block") for _, s in spec.block_shapes()] * spec.num_layers
        shapes += [(s, lora_rank is None, "root") for _, s in spec.root_shapes()]
        if lora_rank is not None:
            shapes += [(s, True, "block") for _, s in spec.lora_shapes(lora_rank, lora_targets)] * spec.num_layers
    else:
        if lora_rank is not None:
            raise ValueError("lora_rank needs a transformer model (a name or a config), not a parameter count.")
        shapes = [((spec.params,), True, "block")]
    total = sum(math.prod(s) for s, _, _ in shapes)
    trainable = sum(math.prod(s) for s, t, _ in shapes if t)
    n_trainable_tensors = sum(1 for _, t, _ in shapes if t)
    detail.update(total_params=total, trainable_params=trainable)

    fsdp = strategy in ("shard_grad_op", "full_shard", "hybrid_shard")
    if fsdp:
        shards = n if strategy != "hybrid_shard" else (shard_group_size or min(n, 8))
        if strategy == "hybrid_shard" and n % shards:
            raise ValueError(f"hybrid_shard needs world_size ({n}) to be a multiple of shard_group_size ({shards}).")
        local = lambda pred: sum(shard_numel(s, shards) for s, t, _ in shapes if pred(t))  # noqa: E731
        sharded_params = 4 * local(lambda t: True)
        sharded_grads = 4 * local(lambda t: t)
        opt = state_bytes * local(lambda t: t) + (4 * n_trainable_tensors if optimizer != "sgd" else 0)
        padding = 4 * (local(lambda t: True) - math.ceil(total / shards))
        detail.update(shards=shards, padding_bytes=padding)
        # The unsharded unit in flight, in the compute dtype.
        block_numel = sum(math.prod(s) for s, _, where in shapes if where == "block") // max(spec.num_layers, 1)
        block_trainable = sum(math.prod(s) for s, t, where in shapes if where == "block" and t) // max(spec.num_layers, 1)
        root_numel = sum(math.prod(s) for s, _, where in shapes if where == "root")
        if strategy == "shard_grad_op" or not per_block or not spec.is_transformer:
            in_flight = w * total       # everything stays gathered from forward to backward
            notes.append("shard_grad_op / whole-model wrapping keep every parameter unsharded between forward "
                         "and backward." if spec.is_transformer else "a parameter count has no blocks: "
                         "the whole model is one unit, gathered at once.")
        else:
            in_flight = w * (root_numel + 2 * block_numel)   # root unit + current and prefetched block
        params = sharded_params + in_flight
        grads = sharded_grads + w * block_trainable
        comm = w * block_numel + 4 * block_trainable        # all-gather output + fp32 reduce-scatter input
        resident = {"parameters": sharded_params, "gradients": sharded_grads, "optimizer_state": opt}
        detail.update(unsharded_in_flight=in_flight)
    else:
        mixed = precision != "fp32"
        weight_b = w if mixed else 4
        master = 4 if mixed else 0
        params = weight_b * total
        grads = weight_b * trainable / (n if strategy == "zero2" else 1)
        opt = (master + state_bytes) * trainable / (n if strategy in ("zero1", "zero2") else 1)
        if strategy == "ddp":
            comm = weight_b * trainable   # DDP's gradient buckets: a second copy of the gradients
            notes.append("DDP's gradient buckets are a second gradient copy (gradient_as_bucket_view=False).")
        else:
            comm = min(weight_b * trainable, 2 * 25 * 2 ** 20)  # two reduce buckets
        resident = {"parameters": params, "gradients": int(grads), "optimizer_state": int(opt)}

    # Activations.
    if activation_bytes is not None:
        acts = int(activation_bytes)
    elif spec.is_transformer:
        s, b, h, a, L = seq_len, batch_size, spec.hidden, spec.num_heads, spec.num_layers
        scale = w / 2                        # the paper counts 16-bit activations
        per_layer = s * b * h * (34 + (0 if flash_attention else 5 * a * s / h)) * scale
        blocks = L * 2 * s * b * h * scale + per_layer if activation_checkpointing else L * per_layer
        logits = s * b * spec.vocab * (w + 4 + 4)
        acts = int(blocks + logits)
        detail.update(activations_per_layer=int(per_layer), logits=int(logits))
    else:
        acts = 0
        notes.append("no activation model for a bare parameter count: pass activation_bytes=.")

    by_category = {"parameters": int(params), "gradients": int(grads), "optimizer_state": int(opt),
                   "activations": acts, "communication_buffers": int(comm), "other": 0}
    if cpu_offload:
        # FSDP offloads its shards (CPUOffloadPolicy); for DDP / ZeRO-1/2 only the optimizer state can
        # move (DeepSpeed's ZeRO-Offload): the working weights and gradients stay on the GPU.
        offloaded = ("parameters", "gradients", "optimizer_state") if fsdp else ("optimizer_state",)
        moved = {k: resident[k] for k in offloaded}
        for k, v in moved.items():
            by_category[k] -= v
        notes.append(f"cpu offload is modelled: {', '.join(offloaded)} ({sum(moved.values()) / GIB:.2f} GiB) "
                     "live in host memory, not on the GPU.")
    settings = dict(model=spec.name, strategy=strategy, precision=precision, optimizer=optimizer,
                    lora_rank=lora_rank, seq_len=seq_len, batch_size=batch_size,
                    activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
                    flash_attention=flash_attention)
    return MemoryReport(peak_bytes=sum(by_category.values()), by_category=by_category, world_size=n,
                        settings=settings, notes=notes, source="formula",
                        resident={k: int(v) for k, v in resident.items()}, detail=detail)


# --- building and stepping a model (shared by estimate and measure) ------------------------------------

def build_model(model="tiny", *, lora_rank=None, lora_alpha=None, lora_targets="all-linear",
                activation_checkpointing=False, device="meta"):
    """The causal LM the estimator sizes, with LoRA adapters and checkpointing applied (via
    fsdplab.recipes.lora.build_model)."""
    from .recipes.lora import build_model as lora_build_model

    return lora_build_model(hf_config_of(model), lora_rank=lora_rank, lora_alpha=lora_alpha,
                            target_modules=lora_targets, activation_checkpointing=activation_checkpointing,
                            device=device)


def make_optimizer(model, optimizer: str = "adamw", lr: float = 1e-4):
    """The optimizer over trainable parameters, with foreach=True as torch uses on GPUs (its
    temporaries are part of the peak)."""
    import torch

    _check_choice("optimizer", optimizer, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, foreach=True)


def _loss(model, batch):
    import torch

    if isinstance(batch, dict):
        return model(**batch).loss
    if callable(getattr(model, "loss", None)):
        return model.loss(*batch)
    inputs, targets = batch
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _run_steps(model, optimizer, batch, steps, loss_fn, progress=None, offload=False):
    """`steps` training steps under a tracker. Step 1 only creates the optimizer state; each later step's
    peak is recorded and the lowest is kept (identical on fake tensors; on CPU ranks gloo's worker thread
    sometimes frees a collective's buffer a moment late, which only ever adds). Returns
    (peak, by_category, raw, category_peaks, live categories after backward, after the optimizer step)."""
    from .fake import make_tracker

    if steps < 2:
        raise ValueError("steps must be at least 2: the first step creates the optimizer state.")
    tracker = make_tracker(model, optimizer)
    if isinstance(batch, dict):
        tracker_inputs = tuple(batch.values())
    else:
        tracker_inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    if hasattr(tracker, "track_inputs"):
        tracker.track_inputs(tracker_inputs)
    after_backward, after_step, records = {}, {}, []
    with tracker:
        for step in range(steps):
            if step > 0:
                tracker.reset_peak()
            loss = (loss_fn or _loss)(model, batch)
            loss.backward()
            after_backward = tracker.current()
            optimizer.step()
            after_step = tracker.current()
            optimizer.zero_grad(set_to_none=True)
            if step > 0:
                records.append((*tracker.peak(offload=offload), tracker.category_peaks(offload=offload)))
            if progress:
                progress(f"step {step + 1}/{steps} done")
    peak, by_category, raw, _ = min(records, key=lambda r: r[0])
    category_peaks = {c: min(r[3][c] for r in records) for c in records[0][3]}
    return peak, by_category, raw, category_peaks, after_backward, after_step


def _resident(after_backward: dict, after_step: dict) -> dict:
    pick = lambda snap, *names: int(sum(snap.get(k, 0) for k in names))  # noqa: E731
    return {"parameters": pick(after_step, "Sharded Param", "Parameter"),
            "gradients": pick(after_backward, "Sharded Grad", "Gradient"),
            "optimizer_state": pick(after_step, "OptState", "Optstate")}


# --- estimate: the exact figure on fake tensors ----------------------------------------------------------

def _settings(model, world_size, lora_rank, lora_alpha, lora_targets, seq_len, batch_size, precision,
              activation_checkpointing, reshard_after_forward, cpu_offload, optimizer):
    return dict(model=model if isinstance(model, str) else type(model).__name__, world_size=world_size,
                lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets, seq_len=seq_len,
                batch_size=batch_size, precision=precision, activation_checkpointing=activation_checkpointing,
                reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload, optimizer=optimizer)


def _validate(world_size, precision, optimizer, lora_rank, seq_len, batch_size, lora_targets):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("lora_targets", lora_targets, ("all-linear", "attention"))
    if lora_rank is not None and lora_rank < 1:
        raise ValueError(f"lora_rank must be a positive integer or None (full fine-tune), got {lora_rank}.")
    if seq_len < 1 or batch_size < 1:
        raise ValueError("seq_len and batch_size must be at least 1.")


def estimate(model="qwen-7b", world_size: int = 8, *, lora_rank=None, lora_alpha=None, lora_targets="all-linear",
             seq_len: int = 2048, batch_size: int = 1, precision: str = "bf16", activation_checkpointing=False,
             reshard_after_forward=True, cpu_offload=False, optimizer="adamw", progress=True,
             subprocess_mode=None) -> MemoryReport:
    """Exact per-rank memory of two FSDP2 training steps of `model` on `world_size` ranks, computed on fake
    tensors (no GPU, no real memory). The peak is the second step's (the first has no optimizer state).

    model: a name ('qwen-7b', 'qwen2-7b', 'llama2-7b', 'llama2-13b', 'llama2-70b', 'tiny') or a transformers
    config. precision: the compute dtype; parameters stay fp32 (the master copy) as FSDP2's
    MixedPrecisionPolicy keeps them, gradients are reduced in fp32. cpu_offload is modelled: FSDP2's
    CPUOffloadPolicy needs an accelerator, so the sharded parameters, gradients and optimizer state are
    taken off the device tally and the peak is the peak of what is left.

    A process can hold one process group: where one exists already (on a rank), the estimate runs in a
    fresh subprocess (`subprocess_mode=None` decides; True/False forces it).
    """
    _validate(world_size, precision, optimizer, lora_rank, seq_len, batch_size, lora_targets)
    kwargs = dict(world_size=world_size, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets,
                  seq_len=seq_len, batch_size=batch_size, precision=precision,
                  activation_checkpointing=activation_checkpointing, reshard_after_forward=reshard_after_forward,
                  cpu_offload=cpu_offload, optimizer=optimizer)
    import torch.distributed as dist

    if subprocess_mode is None:
        subprocess_mode = dist.is_available() and dist.is_initialized()
    if subprocess_mode:
        return _estimate_in_subprocess(model, kwargs, progress)
    return _estimate_here(model, progress=progress, **kwargs)


def _progress_printer(enabled, label, stream=None):
    start = time.perf_counter()

    def say(message):
        if enabled:
            print(f"[estimate {label}] {message} ({time.perf_counter() - start:.1f} s)",
                  file=stream or sys.stdout, flush=True)
    return say


def _estimate_here(model, *, world_size, lora_rank, lora_alpha, lora_targets, seq_len, batch_size, precision,
                   activation_checkpointing, reshard_after_forward, cpu_offload, optimizer, progress=True,
                   progress_stream=None) -> MemoryReport:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .fake import eager_attention_masks, fake_process_group, fake_tensor_mode
    from .parallel import apply_fsdp, blocks_of

    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    label = f"{model if isinstance(model, str) else type(model).__name__} x{world_size}"
    say = _progress_printer(progress, label, progress_stream)
    t0 = time.perf_counter()
    config = hf_config_of(model)
    with fake_process_group(world_size):
        # The mesh is built outside FakeTensorMode: it holds real (tiny) tensors of rank ids.
        mesh = init_device_mesh("cpu", (world_size,))
        net = build_model(config, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets,
                          activation_checkpointing=activation_checkpointing, device="meta")
        say("model built on the meta device")
        with fake_tensor_mode(), eager_attention_masks():
            # peft and .to(dtype) fail inside FakeTensorMode; building on meta first and materialising
            # here with to_empty avoids that.
            net.to_empty(device="cpu")
            apply_fsdp(net, mesh, reshard_after_forward=reshard_after_forward, precision=precision,
                       blocks=blocks_of(net))
            opt = make_optimizer(net, optimizer)
            tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))
            batch = {"input_ids": tokens, "labels": tokens}
            say("sharded; running two training steps")
            peak, by_category, raw, category_peaks, after_backward, after_step = _run_steps(
                net, opt, batch, 2, None, progress=say, offload=cpu_offload)
        del net, opt
    notes = ["exact for this program on fake tensors; the CUDA context (~0.3-0.5 GiB), allocator "
             "fragmentation and NCCL buffers come on top on a real GPU."]
    if cpu_offload:
        notes.append("cpu offload is modelled: sharded parameters, gradients and optimizer state are taken off "
                     "the device tally (FSDP2 CPUOffloadPolicy keeps them in host memory and steps the optimizer "
                     "there); the peak is that of what remains on the GPU.")
    if precision != "fp32":
        notes.append(f"{precision} compute with fp32 sharded parameters (the master copy) and fp32 gradient "
                     "reduction, as FSDP2's MixedPrecisionPolicy does.")
    notes.append("FSDP2 pads each parameter's dim 0 to a multiple of the world size: resident shards include it.")
    say(f"peak {peak / GIB:.2f} GiB" if peak > GIB / 4 else f"peak {peak / 2**20:.2f} MiB")
    return MemoryReport(peak_bytes=int(peak), by_category=by_category, world_size=world_size,
                        settings=_settings(model, world_size, lora_rank, lora_alpha, lora_targets, seq_len,
                                           batch_size, precision, activation_checkpointing,
                                           reshard_after_forward, cpu_offload, optimizer),
                        notes=notes, source="estimate", resident=_resident(after_backward, after_step),
                        detail=raw, category_peaks=category_peaks, seconds=round(time.perf_counter() - t0, 2))


def _estimate_in_subprocess(model, kwargs, progress) -> MemoryReport:
    if not isinstance(model, str):
        model = {"config_class": f"{type(model).__module__}.{type(model).__name__}", "config": model.to_dict()}
    payload = json.dumps({"model": model, "kwargs": kwargs, "progress": bool(progress)})
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)   # the child must not think it is a rank of the caller's group
    proc = subprocess.Popen([sys.executable, "-m", "fsdplab.memory", payload], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    err_lines = []
    for line in proc.stderr:                # progress lines, relayed as they come
        err_lines.append(line)
        if line.startswith("[estimate") and progress:
            print(line.rstrip(), flush=True)
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError("the estimate subprocess failed:\n" + "".join(err_lines[-30:]))
    return MemoryReport.from_dict(json.loads(out.strip().splitlines()[-1]))


def _subprocess_main(argv) -> int:
    payload = json.loads(argv[0])
    model = payload["model"]
    if isinstance(model, dict):
        import importlib

        module, _, name = model["config_class"].rpartition(".")
        model = getattr(importlib.import_module(module), name)(**model["config"])
    report = _estimate_here(model, progress=payload["progress"], progress_stream=sys.stderr, **payload["kwargs"])
    print(report.to_json(), flush=True)
    return 0


# --- measure: live ranks ---------------------------------------------------------------------------------

def measure(model, optimizer, batch, *, steps: int = 4, loss_fn=None) -> MemoryReport:
    """Per-category peak memory of this rank over `steps` real training steps (the lowest peak of the
    steps after the first, which creates the optimizer state; see _run_steps for why the lowest).

    Call it on every rank inside `cluster.run` (it runs collectives). `batch` is a dict of model kwargs
    (transformers: input_ids, labels), or (inputs, targets); `loss_fn(model, batch)` overrides the loss.
    Categories come from torch's memory tracker (FSDPMemTracker for FSDP2 models, MemTracker otherwise);
    on a GPU the notes add torch.cuda.max_memory_allocated over the steps (allocator's view, for comparison).
    """
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    peak, by_category, raw, category_peaks, after_backward, after_step = _run_steps(
        model, optimizer, batch, steps, loss_fn)
    notes = ["categories from torch's memory tracker (tensor storages, exact bytes on CPU)."]
    if on_gpu:
        torch.cuda.synchronize()
        notes.append(f"tracker peak {peak / GIB:.3f} GiB; torch.cuda.max_memory_allocated "
                     f"{torch.cuda.max_memory_allocated() / GIB:.3f} GiB over the steps.")
    world = dist.get_world_size() if dist.is_initialized() else 1
    return MemoryReport(peak_bytes=int(peak), by_category=by_category, world_size=world,
                        settings={"rank": dist.get_rank() if dist.is_initialized() else 0, "steps": steps},
                        notes=notes, source="measure", resident=_resident(after_backward, after_step),
                        detail=raw, category_peaks=category_peaks, seconds=round(time.perf_counter() - t0, 2))


def measure_setting(model="tiny", *, lora_rank=None, lora_alpha=None, lora_targets="all-linear", seq_len=64,
                    batch_size=1, precision="bf16", activation_checkpointing=False, reshard_after_forward=True,
                    optimizer="adamw", steps=4, seed=0) -> MemoryReport:
    """On a live rank: build the same model `estimate` sizes (real weights), shard it over the rank's mesh
    and `measure` it. Returns this rank's report (call inside cluster.run; compare with estimate)."""
    import torch

    from .dist import device, mesh
    from .parallel import apply_fsdp, blocks_of

    _validate(mesh().size(), precision, optimizer, lora_rank, seq_len, batch_size, lora_targets)
    torch.manual_seed(seed)
    config = hf_config_of(model)
    net = build_model(config, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets,
                      activation_checkpointing=activation_checkpointing, device=device())
    apply_fsdp(net, mesh(), reshard_after_forward=reshard_after_forward, precision=precision, blocks=blocks_of(net))
    opt = make_optimizer(net, optimizer)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device())
    report = measure(net, opt, {"input_ids": tokens, "labels": tokens}, steps=steps)
    report.settings.update(_settings(model, mesh().size(), lora_rank, lora_alpha, lora_targets, seq_len,
                                     batch_size, precision, activation_checkpointing, reshard_after_forward,
                                     False, optimizer))
    return report


# --- lesson functions (run on ranks) ----------------------------------------------------------------------

def shard_layout(shapes=((8, 4), (7, 4))) -> list:
    """On a rank: fully_shard a module holding one parameter per shape over all ranks and report what this
    rank keeps of each: local shape, placements, and the bytes of its (padded) storage."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from .dist import mesh

    module = nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"w{i}", nn.Parameter(torch.arange(math.prod(shape), dtype=torch.float32)
                                                        .reshape(shape)))
    fully_shard(module, mesh=mesh())
    rows = []
    for (name, p), shape in zip(module.named_parameters(), shapes):
        local = p.to_local()
        rows.append({"parameter": name, "global_shape": tuple(shape), "local_shape": tuple(local.shape),
                     "placements": str(p.placements), "local_values": local.tolist(),
                     "storage_bytes": local.untyped_storage().nbytes()})
    return rows


_GROUPS: dict = {}


def _subgroup(size: int):
    """(process group of ranks 0..size-1, member?) : every rank must call it, in the same order."""
    import torch.distributed as dist

    if size not in _GROUPS:
        _GROUPS[size] = dist.group.WORLD if size == dist.get_world_size() else dist.new_group(list(range(size)))
    return _GROUPS[size], dist.get_rank() < size


def replica_bytes(strategy: str = "full_shard", group_size: int | None = None, cfg=None, steps: int = 2,
                  batch_size: int = 2, per_block: bool = True, optimizer: str = "adamw"):
    """On every rank: train the tiny transformer (fp32, Adam) with `strategy` ('ddp' is real DDP,
    'shard_grad_op', 'full_shard') over ranks 0..group_size-1 and `measure` it. Ranks outside the group
    return None; members return their MemoryReport with `detail['params']` = the model's parameter count."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    from .dist import device, world_size
    from .models import TinyConfig, TinyTransformer, random_batch
    from .parallel import apply_fsdp

    _check_choice("strategy", strategy, ("ddp", "shard_grad_op", "full_shard"))
    group, member = _subgroup(group_size or world_size())
    if not member:
        return None
    cfg = cfg or TinyConfig()
    torch.manual_seed(0)
    model = TinyTransformer(cfg).to(device())
    params = sum(p.numel() for p in model.parameters())
    if strategy == "ddp":
        model = DistributedDataParallel(model, process_group=group)
    else:
        mesh = DeviceMesh.from_group(group, device().type)
        apply_fsdp(model, mesh, reshard_after_forward=strategy == "full_shard", per_block=per_block)
    opt = make_optimizer(model, optimizer, lr=1e-3)
    batch = random_batch(cfg, batch_size, seed=torch.distributed.get_rank(), device=device())
    report = measure(model, opt, batch, steps=steps,
                     loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()))
    report.detail["params"] = params
    report.settings.update(strategy=strategy, group_size=group_size or world_size(), per_block=per_block)
    return report


# --- the command line -----------------------------------------------------------------------------------

def estimate_command(args) -> int:
    """`fsdplab estimate`: print the per-category table (or one JSON object) and whether it fits."""
    report = estimate(args.model, args.world_size, lora_rank=args.lora_rank, seq_len=args.seq_len,
                      batch_size=args.batch_size, precision=args.precision,
                      activation_checkpointing=args.activation_checkpointing,
                      reshard_after_forward=args.reshard_after_forward, cpu_offload=args.cpu_offload,
                      progress=not args.json)
    if args.json:
        data = report.to_dict()
        data.update(gpu_mem_gib=args.gpu_mem_gib, fits=report.fits(args.gpu_mem_gib))
        print(json.dumps(data))
    else:
        print(report.table(gpu_mem_gib=args.gpu_mem_gib))
        print(f"  ({report.seconds:.1f} s on fake tensors)")
    return 0


# --- the dashboard -------------------------------------------------------------------------------------

DASHBOARD_MODELS = ("tiny", "qwen2-7b", "qwen-7b", "llama2-7b", "llama2-13b", "llama2-70b")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
          "activations": "#c44e52", "communication_buffers": "#8172b3", "other": "#937860"}


def draw_stacked(ax, labels, reports, gpu_mem_gib=None, highlight=None):
    """Stacked bars (GiB) of each report's categories, with an optional GPU-size line."""
    bottoms = [0.0] * len(reports)
    for name in CATEGORIES:
        values = [r.by_category.get(name, 0) / GIB for r in reports]
        ax.bar(labels, values, bottom=bottoms, color=COLORS[name], label=CATEGORY_LABELS[name])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if highlight is not None:
        ax.bar([labels[highlight]], [bottoms[highlight]], fill=False, edgecolor="black", linewidth=2)
    if gpu_mem_gib:
        # Keep the GPU line readable: bars far above it are clipped and labelled with their height.
        top = max(2.5 * gpu_mem_gib, 1.15 * (bottoms[highlight] if highlight is not None else 0))
        if max(bottoms) > top:
            ax.set_ylim(0, top)
            for x, height in zip(labels, bottoms):
                if height > top:
                    ax.text(x, top * 0.97, f"{height:.0f}", ha="center", va="top", fontsize=8, color="white",
                            fontweight="bold")
        ax.axhline(gpu_mem_gib, color="black", linestyle="--", linewidth=1)
        ax.text(len(labels) - 0.5, gpu_mem_gib, f" {gpu_mem_gib:g} GiB GPU", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("memory per GPU (GiB)")
    return bottoms


def memory_dashboard(model="qwen-7b", world_size=8, strategy="full_shard", precision="bf16", optimizer="adamw",
                     activation_checkpointing=False, lora_rank=0, seq_len=2048, gpu_mem_gib=24):
    """Sliders -> per-GPU memory of every strategy from `formula`, the chosen one outlined, against a GPU-size
    line. The "exact" button runs `estimate` (FSDP strategies) for the current setting and marks it."""
    import ipywidgets as W

    from .widgets import Dashboard

    controls = {
        "model": W.SelectionSlider(options=DASHBOARD_MODELS, value=model, description="model"),
        "world_size": W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=world_size, description="GPUs"),
        "strategy": W.Dropdown(options=STRATEGIES, value=strategy, description="strategy"),
        "precision": W.Dropdown(options=PRECISIONS, value=precision, description="precision"),
        "optimizer": W.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer"),
        "activation_checkpointing": W.Checkbox(value=activation_checkpointing, description="act. checkpointing"),
        "lora_rank": W.SelectionSlider(options=[0, 8, 16, 64, 128], value=lora_rank, description="LoRA r (0: full)"),
        "seq_len": W.SelectionSlider(options=[64, 128, 256, 512, 1024, 2048, 4096, 8192], value=seq_len,
                                     description="seq len"),
        "gpu_mem_gib": W.SelectionSlider(options=[16, 24, 40, 48, 80, 141], value=gpu_mem_gib, description="GPU GiB"),
    }
    exact: dict = {}

    def key(values):
        return tuple(sorted(values.items()))

    def draw(fig, model, world_size, strategy, precision, optimizer, activation_checkpointing, lora_rank,
             seq_len, gpu_mem_gib):
        common = dict(precision=precision, optimizer=optimizer, activation_checkpointing=activation_checkpointing,
                      lora_rank=lora_rank or None, seq_len=seq_len)
        reports = [formula(model, world_size, strategy=s, **common) for s in STRATEGIES]
        ax = fig.add_subplot(1, 1, 1)
        chosen = STRATEGIES.index(strategy)
        draw_stacked(ax, list(STRATEGIES), reports, gpu_mem_gib, highlight=chosen)
        found = exact.get(key(dict(model=model, world_size=world_size, strategy=strategy, **common)))
        if found is not None:
            ax.plot([chosen], [found.peak_bytes / GIB], marker="*", markersize=16, color="gold",
                    markeredgecolor="black", linestyle="none", label="exact (estimate)")
        lora = f"LoRA r={lora_rank}" if lora_rank else "full fine-tune"
        ax.set_title(f"{model}, {world_size} GPUs, {lora}, {precision}, {optimizer}, seq {seq_len}"
                     + (", checkpointing" if activation_checkpointing else ""), fontsize=10)
        ax.set_xlabel("strategy (formula; outlined: selected)")
        ax.tick_params(axis="x", labelsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return {"reports": dict(zip(STRATEGIES, reports)), "selected": reports[chosen], "exact": found}

    dash = Dashboard(controls, draw, title="Per-GPU memory by strategy (formula)", figsize=(9, 4.2))
    button = W.Button(description="exact estimate", tooltip="run fsdplab.memory.estimate for this setting")

    def run_exact(_button=None):
        v = dash.values
        if v["strategy"] not in ("full_shard", "shard_grad_op"):
            dash.say(f"exact estimates cover FSDP2 (full_shard, shard_grad_op), not {v['strategy']}.")
            return None
        dash.say("running fsdplab.memory.estimate ...")
        report = estimate(v["model"], v["world_size"], lora_rank=v["lora_rank"] or None, seq_len=v["seq_len"],
                          precision=v["precision"], optimizer=v["optimizer"],
                          activation_checkpointing=v["activation_checkpointing"],
                          reshard_after_forward=v["strategy"] == "full_shard")
        dash.say(report.table(gpu_mem_gib=v["gpu_mem_gib"]))
        common = {k: v[k] for k in ("model", "world_size", "strategy", "precision", "optimizer",
                                    "activation_checkpointing", "seq_len")}
        exact[key(dict(common, lora_rank=v["lora_rank"] or None))] = report
        dash.refresh()
        return report

    button.on_click(run_exact)
    dash.exact = run_exact
    dash.exact_button = button
    dash.widget = W.VBox([dash.widget, button])
    return dash


if __name__ == "__main__":
    sys.exit(_subprocess_main(sys.argv[1:]))
