"""The analytic memory model: bytes per rank from the model's shapes and the setting, instantly, at any
size (the dashboards draw it on every slider move). `fsdplab.memory.estimate` is the exact counterpart on
fake tensors; the two agree byte for byte on the resident sharded states (tests/unit/test_memory.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .report import MemoryReport
from ..settings import FSDP1_STRATEGIES, FSDP_STRATEGIES, GIB, NF4_BYTES_PER_WEIGHT, TrainSetting, as_setting


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


@functools.lru_cache(maxsize=None)
def _registered_spec(name: str) -> ModelSpec:
    from ..models import hf_config

    return _spec_from_config(hf_config(name), name)


def _spec_from_config(c, name: str) -> ModelSpec:
    return ModelSpec(name, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                     getattr(c, "num_key_value_heads", None) or c.num_attention_heads, c.intermediate_size,
                     c.vocab_size,
                     qkv_bias=getattr(c, "model_type", "") == "qwen2" or bool(getattr(c, "attention_bias", False)),
                     tied=bool(getattr(c, "tie_word_embeddings", False)))


def spec_of(model) -> ModelSpec:
    """The formula's sizes of a registered model name, a transformers config, a ModelSpec, or a parameter
    count (the registry in fsdplab.models is the one source of the named models' shapes)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        from ..models import MODELS

        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}: use one of {list(MODELS)}, a transformers config, "
                             "or a parameter count such as 60.2e6.")
        return _registered_spec(model)
    if isinstance(model, (int, float)):
        return ModelSpec(f"{model / 1e6:g}M params", params=int(model))
    if hasattr(model, "hidden_size"):
        return _spec_from_config(model, getattr(model, "name_or_path", "") or type(model).__name__)
    raise ValueError(f"model must be a registered name, a transformers config or a parameter count; "
                     f"got {type(model).__name__}.")


# --- the formula --------------------------------------------------------------------------------------

def shard_numel(shape, shards: int) -> int:
    """Elements FSDP2 keeps per rank for one parameter: dim 0 is padded up to a multiple of `shards`."""
    rows = shape[0]
    return math.ceil(rows / shards) * math.prod(shape[1:])


def formula(setting: TrainSetting | None = None, /, *, activation_bytes: int | None = None,
            **changes) -> MemoryReport:
    """Analytic per-rank memory. Model states follow two layouts that both cost 16 bytes per trained
    parameter with Adam (a parameter count such as 60.2e6 works too; transformer names or configs add the
    unit in flight and activations):

    - DDP / ZeRO-1 / ZeRO-2 (the ZeRO paper's mixed precision): 2-byte weights and gradients, 12 bytes of
      fp32 optimizer state (master copy, m, v). ZeRO-1 shards the optimizer state, ZeRO-2 also gradients.
      DDP adds its gradient buckets, a second copy of the gradients. (torch's DDP with autocast keeps fp32
      parameters and gradients plus m and v: the same 16 bytes, another split.)
    - FSDP2 (shard_grad_op, full_shard, hybrid_shard, and replicate, unsharded): the sharded fp32 parameters ARE the
      master copy (4 B), sharded gradients are fp32 (4 B), Adam keeps m and v (8 B); 16-bit copies exist only for
      the unit being computed ("in flight"). Each parameter's dim 0 is padded to a multiple of the shard count.

    With fp32 every layout is 4 + 4 + 8. SGD keeps one momentum buffer (4 B), no step counter. Frozen
    (LoRA base) weights keep no gradient and no optimizer state. `base_dtype` bf16/fp16 stores the base weights
    in 2 bytes (LoRA adapters stay fp32); a 16-bit base that is trained (no LoRA) keeps its gradients and
    Adam's m and v in 16 bits too, with no fp32 master copy (2 + 2 + 4 bytes). Activations (transformers only):
    Korthikanti et al. s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations, where 5*a*s/h is the
    attention score matrices: flash / memory-efficient SDPA kernels (transformers' default, and what
    `estimate` runs) never store them, so `flash_attention=True` (the default) drops that term. With
    checkpointing 2*s*b*h per layer is kept, plus one layer recomputed at a time (every k-th layer: the others
    keep all; torchtitan's per-op policy: about half the Linear outputs and the attention output as well);
    `use_cache` adds nothing (attention keeps the cached keys and values for backward anyway). Plus the logits
    s*b*vocab*(2 + 4/k + 4) (16-bit logits, the fp32 copy the loss takes, of one chunk at a time with
    k = loss_chunks, the fp32 log-softmax). `embed_head_units`: the root unit in flight is the larger of the
    embedding and the head, not both.
    The categories are summed as if their peaks coincide, so the total is an upper estimate.

    `setting` is a TrainSetting; keyword `changes` replace its fields (or build one: formula(model="qwen-7b",
    world_size=8, strategy="ddp")). activation_bytes overrides the activation model (e.g. a measured figure).
    """
    setting = as_setting(setting, **changes)
    from ..custom import custom_of

    if custom_of(setting.model) is not None:
        raise ValueError("the formula knows transformers models and parameter counts: estimate(setting) traces a "
                         "custom model.")
    spec = spec_of(setting.model)
    notes = []
    if setting.strategy in FSDP1_STRATEGIES:
        notes.append(f"{setting.strategy} is modelled as FSDP2's {FSDP1_STRATEGIES[setting.strategy]} (estimate() "
                     "traces FSDP1 itself).")
        setting = setting.replace(strategy=FSDP1_STRATEGIES[setting.strategy])
    if setting.grad_accum > 1:
        notes.append("gradient accumulation is not in the formula (estimate() traces it): one micro-batch's step.")
    n, strategy, precision, optimizer = setting.world_size, setting.strategy, setting.precision, setting.optimizer
    lora_rank, lora_targets, per_block = setting.lora_rank, setting.lora_targets, setting.per_block
    seq_len, batch_size, flash_attention = setting.seq_len, setting.batch_size, setting.flash_attention
    activation_checkpointing, cpu_offload = setting.activation_checkpointing, setting.cpu_offload
    w = 4 if precision == "fp32" else 2         # bytes of a compute-dtype element
    base_b = 4 if setting.base_dtype == "fp32" else 2   # bytes of a stored base weight (an NF4 base's rest: bf16)
    nf4 = setting.base_dtype == "nf4"

    def stored(shape, trained, where) -> float:
        """Bytes of one stored element: LoRA adapters fp32, an NF4 base's block matrices 4-bit, else base_b."""
        if trained and lora_rank is not None:
            return 2 if setting.adapter_dtype != "fp32" else 4
        if nf4 and not trained and where == "block" and len(shape) == 2:
            return NF4_BYTES_PER_WEIGHT
        return base_b

    state_bytes = 8 if optimizer in ("adam", "adamw") else 4
    detail = {}

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

    fsdp = strategy in FSDP_STRATEGIES
    if fsdp or strategy == "replicate":
        shards = setting.shards
        # Sharded gradients and Adam's m and v take the parameter's own dtype.
        local = lambda pred: int(sum(shard_numel(s, shards) * stored(s, t, w_) for s, t, w_ in shapes  # noqa: E731
                                     if pred(t)))
        sharded_params = local(lambda t: True)
        sharded_grads = local(lambda t: t)
        opt = state_bytes // 4 * local(lambda t: t) + (4 * n_trainable_tensors if optimizer != "sgd" else 0)
        padding = sharded_params - int(sum(math.ceil(math.prod(s) / shards) * stored(s, t, w_)
                                           for s, t, w_ in shapes))
        detail.update(shards=shards, padding_bytes=padding)
        # The unsharded unit in flight, in the compute dtype.
        block_numel = sum(math.prod(s) for s, _, where in shapes if where == "block") // max(spec.num_layers, 1)
        block_trainable = (sum(math.prod(s) for s, t, where in shapes if where == "block" and t)
                           // max(spec.num_layers, 1))
        root_numel = sum(math.prod(s) for s, _, where in shapes if where == "root")
        # an NF4 base gathers its blocks' matrices as 4-bit codes with their scales, the rest in the compute dtype
        block_gathered = sum(math.prod(s) * (NF4_BYTES_PER_WEIGHT if stored(s, t, where) < 2 else w)
                             for s, t, where in shapes if where == "block") / max(spec.num_layers, 1)
        if strategy == "shard_grad_op" or not per_block or not spec.is_transformer:
            in_flight = w * total       # everything stays gathered from forward to backward
            notes.append("shard_grad_op / whole-model wrapping keep every parameter unsharded between forward "
                         "and backward." if spec.is_transformer else "a parameter count has no blocks: "
                         "the whole model is one unit, gathered at once.")
        elif setting.embed_head_units and not spec.tied:
            # The root keeps the final norm; the embedding and the head are gathered one at a time.
            largest = max(math.prod(s) for name, s in spec.root_shapes() if name != "norm")
            in_flight = w * (spec.hidden + largest + 2 * block_numel)
        elif nf4:
            # the gathered codes of the current and the prefetched block, one matrix dequantized at a time
            largest = max(math.prod(s) for s, t, where in shapes if where == "block" and len(s) == 2 and not t)
            in_flight = int(w * root_numel + 2 * block_gathered + w * largest)
            notes.append("NF4 base: the blocks' matrices are stored and all-gathered as 4-bit codes with their scales "
                         f"({NF4_BYTES_PER_WEIGHT:.4f} B per weight), and dequantized one at a time.")
        else:
            in_flight = w * (root_numel + 2 * block_numel)   # root unit + current and prefetched block
        if setting.reshard_to and setting.reshard_to != shards and strategy == "full_shard" and per_block:
            # Between its forward and its backward every block keeps a shard over `reshard_to` ranks.
            in_flight += spec.num_layers * w * block_numel // setting.reshard_to
        params = sharded_params + in_flight
        grads = sharded_grads + w * block_trainable
        comm = int(block_gathered + 4 * block_trainable)    # all-gather output + fp32 reduce-scatter input
        resident = {"parameters": sharded_params, "gradients": sharded_grads, "optimizer_state": opt}
        detail.update(unsharded_in_flight=in_flight)
    else:
        mixed = precision != "fp32"
        weight_b = w if mixed else 4
        master = 4 if mixed else 0
        if base_b == 2 and lora_rank is None:
            # a 16-bit base trained as it is ("pure" bf16/fp16): no fp32 master copy, Adam's m and v in 16 bits
            weight_b, master, state_bytes = 2, 0, state_bytes // 2
            notes.append(f"{setting.base_dtype} base trained in place: no fp32 master copy, optimizer state in "
                         f"{setting.base_dtype}.")
        frozen_bytes = sum(math.prod(s) * stored(s, t, where) for s, t, where in shapes if not t)
        params = int(weight_b * trainable + frozen_bytes)   # the frozen base stays as stored
        grads = weight_b * trainable / (n if strategy == "zero2" else 1)
        opt = (master + state_bytes) * trainable / (n if strategy in ("zero1", "zero2") else 1)
        if strategy == "ddp" and optimizer != "sgd":
            opt += 4 * n_trainable_tensors   # torch's Adam keeps a step counter per parameter
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
        if setting.lora_dropout and lora_rank is not None:
            # peft keeps each adapted Linear's dropped input (and dropout's 1-byte mask) for lora_A's backward
            inputs = sum(shape[1] for name, shape in spec.lora_shapes(1, lora_targets) if name.endswith("lora_A"))
            per_layer += s * b * inputs * (w + 1)
            notes.append(f"LoRA dropout {setting.lora_dropout}: each adapted Linear's dropped input is kept.")
        every = setting.checkpointed_every
        if activation_checkpointing == "selective":
            # torchtitan's per-op policy keeps the block input, the attention output and every other matmul
            # output: about half of all Linear outputs.
            linear_out = sum(shape[0] for name, shape in spec.block_shapes() if not name.endswith(("bias", "norm")))
            kept = 2 * s * b * h * scale + s * b * h * w + s * b * linear_out * w / 2
            blocks = L * kept + per_layer
        elif every is not None:
            checkpointed = math.ceil(L / every)
            blocks = checkpointed * 2 * s * b * h * scale + (L - checkpointed) * per_layer + per_layer
        else:
            blocks = L * per_layer
        # The logits: 16-bit logits, the fp32 copy the loss takes (one chunk's at a time with chunked
        # cross-entropy), the fp32 log-softmax the loss keeps for backward.
        logits = s * b * spec.vocab * (w + 4 / setting.loss_chunks + 4)
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
    return MemoryReport(peak_bytes=sum(by_category.values()), by_category=by_category, world_size=n,
                        settings=dict(setting.to_dict(), model=spec.name), notes=notes, source="formula",
                        resident={k: int(v) for k, v in resident.items()}, detail=detail)
