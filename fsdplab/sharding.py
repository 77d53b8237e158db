"""Build a model and apply parallelism to it, torchtitan style: small `apply_*` functions with plain keyword
arguments, and `parallelize` and `build_sharded` that call them in the order that matters. The one
`train_step` every training loop in the lab runs is `fsdplab.step`'s (imported here as well).

FSDP here is FSDP2 (`fully_shard`), which runs on CPU ranks with gloo as well as on GPUs; the posts' FSDP1
wrapper needs a GPU (see the lessons for the FSDP1 -> FSDP2 mapping).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from .ranks import this_rank
from .models import blocks_of, causal_lm, config_of, dtype_kwarg
from .custom import custom_of
from .step import loss_for, loss_of, train_step  # noqa: F401 (the lab imports them from here too)
from .settings import FSDP1_STRATEGIES, OPTIMIZERS, RUNNABLE_STRATEGIES, TrainSetting, check_choice, torch_dtype

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


# --- the pieces ---------------------------------------------------------------------------------------------

def mixed_precision_policy(precision: str = "fp32", reduce_precision: str | None = None):
    """FSDP2 MixedPrecisionPolicy for 'fp32' (None: no casting), 'bf16' or 'fp16'; gradients are reduced in
    `reduce_precision` (fp32 unless told otherwise: the safe choice with fp16 compute)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = torch_dtype(precision)
    if precision == "fp32" and reduce_precision is None:
        return None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch_dtype(reduce_precision or "fp32"))


def lora_target_modules(targets="all-linear"):
    """peft's `target_modules` for 'all-linear' (every Linear in the blocks, not the LM head), 'attention'
    (q/k/v/o projections) or an explicit list of module names."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return "all-linear"
        if targets == "attention":
            return list(ATTENTION_MODULES)
        raise ValueError(f"lora targets must be 'all-linear', 'attention' or a list of module names such as "
                         f"{ATTENTION_MODULES}, got {targets!r}.")
    names = list(targets)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"lora targets as a list must hold module names such as {ATTENTION_MODULES}.")
    return names


def apply_lora(model: nn.Module, rank: int, *, alpha: int | None = None, targets="all-linear",
               dropout: float = 0.0, device="meta") -> nn.Module:
    """Freeze the base and add peft LoRA adapters (created on `device`: on meta they take no memory)."""
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank must be a positive integer, got {rank!r}.")
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                        target_modules=lora_target_modules(targets), bias="none", task_type="CAUSAL_LM")
    with torch.device(device), warnings.catch_warnings():
        # peft asks transformers' deprecated is_gradient_checkpointing: a FutureWarning nobody asked for
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def adapters_to(model: nn.Module, dtype: str) -> None:
    """Store `model`'s LoRA adapters in `dtype` (peft makes them fp32), as torchtune and LitGPT keep them."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (".lora_A." in f".{name}." or ".lora_B." in f".{name}."):
            module.to(torch_dtype(dtype))


def apply_activation_checkpointing(model: nn.Module, blocks=None, *, every: int = 1, selective: bool = False,
                                   reentrant: bool = False) -> None:
    """Recompute blocks in backward instead of storing their activations (non-reentrant, as torch advises):
    every block, every `every`-th block (the first, the (1+every)-th, ...), or with `selective=True` every
    block under torchtitan's per-op policy (`_torch_private.selective_checkpoint_context`). `reentrant`: the
    older autograd.Function checkpoint (use_reentrant=True, still many trainers' default); a model whose
    blocks' inputs need no gradient (a frozen embedding under LoRA) needs `enable_input_require_grads`."""
    import functools

    from ._torch_private import checkpoint_wrapper_fn, selective_checkpoint_context

    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive integer (1: every block), got {every!r}.")
    apply, wrapper = checkpoint_wrapper_fn(reentrant)
    if selective:
        wrapper = functools.partial(wrapper, context_fn=selective_checkpoint_context)
    chosen = list(blocks if blocks is not None else blocks_of(model))[::every]
    targets = set(map(id, chosen))
    apply(model, check_fn=lambda m: id(m) in targets, checkpoint_wrapper_fn=wrapper)


def checkpoint_setting(model: nn.Module, activation_checkpointing, blocks=None) -> None:
    """A TrainSetting's `activation_checkpointing` (False, True, k, "selective" or "reentrant") applied to
    `model`. Reentrant checkpointing computes a block's gradients only when its input needs one: where the input
    embedding is frozen (LoRA), transformers' `enable_input_require_grads` makes its output need one, as a
    Trainer does when it turns on gradient checkpointing (once: each call adds a hook)."""
    ac = activation_checkpointing
    if ac is False or ac is None:
        return
    reentrant = ac == "reentrant"
    apply_activation_checkpointing(model, blocks, every=ac if type(ac) is int else 1,
                                   selective=ac == "selective", reentrant=reentrant)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if reentrant and embed is not None and not embed.weight.requires_grad:
        if hasattr(model, "enable_input_require_grads"):
            if not getattr(model, "_require_grads_hooks", None):
                model.enable_input_require_grads()
        else:   # a model of the user's own with the same door
            embed.register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool | None = True, precision: str = "fp32",
               reduce_precision: str | None = None, cpu_offload: bool = False, per_block: bool = True,
               blocks=None, embed_head_units: bool = False) -> nn.Module:
    """fully_shard each block (so only one is gathered at a time), then the root for what is left.

    reshard_after_forward=True is FULL_SHARD (ZeRO-3); False is SHARD_GRAD_OP (ZeRO-2): parameters stay
    gathered from forward to backward, saving the backward all-gather at the cost of memory. None is
    fully_shard's own default: blocks reshard after forward, the root (resharded last anyway) does not. A 2-D
    mesh (replicate, shard) is HSDP: sharded inside a node, replicated across nodes. embed_head_units: the
    input embedding and the output head become units of their own (as torchtitan wraps them), so the root
    keeps only the final norm; a model whose head shares the embedding's weight cannot split them.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(precision, reduce_precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if per_block:
        for block in blocks if blocks is not None else blocks_of(model):
            fully_shard(block, **kwargs)
    if embed_head_units:
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError("embed_head_units needs a model with input and output embeddings (a transformers LM).")
        if head.weight is embed.weight:
            raise ValueError("embed_head_units: this model ties its output head to its input embedding (one "
                             "weight), which cannot be two FSDP units: keep them in the root unit.")
        fully_shard(embed, **kwargs)
        fully_shard(head, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_replicate(model: nn.Module, mesh, *, precision: str = "fp32", reduce_precision: str | None = None,
                    per_block: bool = True, blocks=None) -> nn.Module:
    """DDP's layout on FSDP2's machinery (torch's FSDP2-based `replicate`): every rank keeps all parameters,
    gradients and optimizer state; each unit's gradients are all-reduced as its backward ends. Units as in
    apply_fsdp, with the same mixed-precision policy (strategy "replicate"; "ddp" is torch's DDP)."""
    from ._torch_private import replicate_fn

    replicate = replicate_fn()
    kwargs = {"mesh": mesh}
    policy = mixed_precision_policy(precision, reduce_precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if per_block:
        for block in blocks if blocks is not None else blocks_of(model):
            replicate(block, **kwargs)
    replicate(model, **kwargs)
    return model


def data_parallel_mesh(setting, device_type: str = "cpu"):
    """The mesh `setting`'s strategy runs on: 1-D over all ranks; for hybrid_shard 2-D (replicate across
    shard groups, shard inside one). Built outside FakeTensorMode: a mesh holds real tensors of rank ids."""
    from torch.distributed.device_mesh import init_device_mesh

    if setting.strategy == "hybrid_shard":
        return init_device_mesh(device_type, (setting.world_size // setting.shards, setting.shards),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (setting.world_size,))


def apply_data_parallel(model: nn.Module, setting, mesh, blocks=None) -> nn.Module:
    """`setting`'s strategy on `model` over `mesh` (from data_parallel_mesh): FSDP2 for full_shard,
    shard_grad_op and hybrid_shard; FSDP2's replicate for replicate; torch's DistributedDataParallel for ddp
    (which computes in 16 bits under torch.autocast: memory.ddp.autocast_loss). The one place the estimator
    and the live measurement choose how a TrainSetting is parallelised. `blocks`: the units (default
    blocks_of(model); [] makes the whole model one unit, as a custom model without blocks is)."""
    per_block = setting.per_block and blocks != []
    if setting.strategy == "ddp":
        return apply_ddp(model, process_group=mesh.get_group())
    if setting.strategy in FSDP1_STRATEGIES:
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

        mixed = None if setting.precision == "fp32" else MixedPrecision(
            param_dtype=torch_dtype(setting.precision), reduce_dtype=torch.float32)
        return apply_fsdp1(model, mesh.device_type, per_block=per_block, blocks=blocks, mixed_precision=mixed,
                           sharding_strategy=getattr(ShardingStrategy, setting.strategy.removeprefix("fsdp1_").upper()),
                           process_group=mesh.get_group())
    if setting.strategy == "replicate":
        return apply_replicate(model, mesh, precision=setting.precision, per_block=per_block, blocks=blocks)
    if setting.strategy not in ("full_shard", "shard_grad_op", "hybrid_shard"):
        raise ValueError(f"strategy {setting.strategy!r} has no FSDP2 implementation (ZeRO-1/2 are DeepSpeed's): "
                         "use ddp, replicate, shard_grad_op, full_shard or hybrid_shard.")
    return apply_fsdp(model, mesh, reshard_after_forward=setting.reshard_after_forward, precision=setting.precision,
                      per_block=per_block, blocks=blocks, embed_head_units=setting.embed_head_units)


def apply_fsdp1(model: nn.Module, device, *, per_block: bool = True, blocks=None, **fsdp1_options) -> nn.Module:
    """The posts' API: `FullyShardedDataParallel(model, ...)` with one unit per block (ModuleWrapPolicy over
    the blocks' class) when `per_block`, the whole model as one unit otherwise. `fsdp1_options` go to
    FullyShardedDataParallel as they are (sharding_strategy, backward_prefetch, cpu_offload,
    mixed_precision, ...). FSDP1 refuses CPU ranks for training; some lessons run single steps on a CPU
    device anyway (device_id=cpu), which is enough for what they show."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if per_block:
        units = blocks if blocks else blocks_of(model)
        fsdp1_options.setdefault("auto_wrap_policy", ModuleWrapPolicy({type(b) for b in units}))
    return FullyShardedDataParallel(model, device_id=torch.device(device), **fsdp1_options)


def apply_ddp(model: nn.Module, device=None, process_group=None) -> nn.Module:
    """Classic DDP: every rank keeps everything; gradients are all-reduced in buckets. The model goes to
    `device` (None: this rank's): DDP, unlike fully_shard, leaves a model where it is."""
    from torch.nn.parallel import DistributedDataParallel

    from .models import default_device

    device = default_device(device)
    model.to(device)
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   process_group=process_group)


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Megatron-style tensor parallelism of each block's MLP (the tiny transformer's `mlp[0]`, `mlp[2]`): the
    first Linear ColwiseParallel, the second RowwiseParallel, so the pair needs one all-reduce in forward and
    one in backward over `tp_mesh`. Attention stays replicated (nn.MultiheadAttention's fused in-projection
    does not split by ColwiseParallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in blocks_of(model):
        parallelize_module(block.mlp, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


# --- the orchestrators --------------------------------------------------------------------------------------

def parallelize(model: nn.Module, strategy: str = "full_shard", *, mesh=None, device=None, precision="fp32",
                reduce_precision=None, activation_checkpointing: bool = False, cpu_offload: bool = False,
                per_block: bool = True, blocks=None) -> nn.Module:
    """The order matters: checkpointing wraps blocks before FSDP shards them, so each shard unit is a
    checkpointed block; the root is sharded last. hybrid_shard needs a 2-D mesh (replicate, shard)."""
    check_choice("strategy", strategy, RUNNABLE_STRATEGIES)
    blocks = blocks if blocks is not None else blocks_of(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model, blocks)
        blocks = blocks_of(model)   # the wrappers replaced the blocks in their ModuleList
    if strategy == "ddp":
        return apply_ddp(model, device)
    if mesh is None:
        from .ranks import mesh as current_mesh

        mesh = current_mesh()
    if strategy == "replicate":
        return apply_replicate(model, mesh, precision=precision, reduce_precision=reduce_precision,
                               per_block=per_block, blocks=blocks)
    if strategy == "hybrid_shard" and mesh.ndim != 2:
        raise ValueError("hybrid_shard needs a 2-D mesh (replicate, shard), e.g. "
                         "init_device_mesh(device, (nodes, gpus_per_node)).")
    return apply_fsdp(model, mesh, reshard_after_forward=strategy != "shard_grad_op", precision=precision,
                      reduce_precision=reduce_precision, cpu_offload=cpu_offload, per_block=per_block, blocks=blocks)


def build_model(setting: TrainSetting, *, device="meta", dtype=None, model_path=None, seed=None,
                lora_dropout: float | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The transformers causal LM of `setting.model` with its LoRA adapters and per-block activation
    checkpointing, unsharded (on the meta device by default: shapes, no memory).

    model_path: a local checkpoint directory; its weights are loaded when `device` is a real device (on meta,
    `setting.model` gives the shapes). With `setting.lora_rank` the base is frozen and only the adapters train;
    without it every parameter trains. dtype: storage dtype of the base ('fp32', 'bf16', 'fp16', a torch dtype,
    or 'nf4': QLoRA's 4-bit blocks, `fsdplab.nf4`; None is fp32); the adapters stay fp32 either way.
    """
    custom = custom_of(setting.model)
    if custom is not None:
        return _build_custom(custom, setting, device, dtype, seed)
    quantize = dtype == "nf4"
    if quantize:
        dtype = "bf16"                  # the embedding, the head and the norms; the blocks' Linears go 4-bit
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if seed is not None:
        torch.manual_seed(seed)
    attention = attention_implementation(setting.attention_kind, device)
    if model_path is not None and torch.device(device).type != "meta":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                     attn_implementation=attention, **dtype_kwarg(dtype)).to(device)
    else:
        config = copy.deepcopy(config_of(setting.model))   # the caller's config stays as it was
        config._attn_implementation = attention
        model = causal_lm(config, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    if hasattr(model.config, "use_cache"):
        # Off unless asked for: a KV cache while training only holds memory.
        model.config.use_cache = setting.use_cache
    if quantize:
        from .nf4 import apply_nf4

        apply_nf4(model, shards=setting.shards)
    if setting.lora_rank is not None:
        model = apply_lora(model, setting.lora_rank, alpha=setting.lora_alpha, targets=setting.lora_targets,
                           dropout=setting.lora_dropout if lora_dropout is None else lora_dropout, device=device)
        if setting.adapter_dtype != "fp32":
            adapters_to(model, setting.adapter_dtype)
    checkpoint_setting(model, setting.activation_checkpointing)
    return model


def _build_custom(custom, setting: TrainSetting, device, dtype, seed) -> nn.Module:
    """A model of your own (fsdplab.custom) as build_model makes a transformers one: built on `device`, its base
    in `dtype`, its blocks checkpointed as the setting asks (TrainSetting has checked what it can take)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = custom.build()
    if dtype is not None and dtype != "fp32":
        model.to(torch_dtype(dtype) if isinstance(dtype, str) else dtype)
    if setting.activation_checkpointing:
        checkpoint_setting(model, setting.activation_checkpointing, custom.blocks(model))
    return model


def attention_implementation(attention: str, device="meta") -> str:
    """transformers' attn_implementation for a setting's `attention`: "flash" is flash_attention_2 where the
    flash-attn package and a GPU are there, else "sdpa" (the same memory: neither stores the score matrix)."""
    check_choice("attention", attention, ("sdpa", "flash", "eager"))
    if attention != "flash":
        return attention
    import importlib.util

    on_gpu = torch.device(device).type == "cuda"
    return "flash_attention_2" if on_gpu and importlib.util.find_spec("flash_attn") else "sdpa"


def _fix_nonpersistent_buffers(model: nn.Module, device) -> None:
    """`to_empty` leaves buffers that no checkpoint stores (RoPE's inv_freq) as garbage: rebuild them."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer.to(device))


def build_sharded(setting: TrainSetting, mesh=None, *, device=None, model_path=None, seed: int = 0,
                  trust_remote_code: bool = False) -> nn.Module:
    """The training model on every rank: meta build, LoRA + checkpointing, shard, `to_empty`, then the weights.

    Only rank 0 holds a full copy (random init from `seed`, or the checkpoint at `model_path`, plus the fresh
    adapters); every other rank receives just its shards by broadcast, so host memory stays one model, not N.
    A random init is drawn on rank 0's GPU when the full copy fits in its free memory (`full_copy_device`): a
    7B model is ready in about a second there, against minutes on the CPU. The base weights are stored in
    `setting.base_dtype`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    check_choice("strategy", setting.strategy, ("shard_grad_op", "full_shard"))
    if setting.base_dtype == "nf4":
        raise ValueError("build_sharded loads full weights by broadcast, which an NF4 base does not support yet: "
                         "build the model on every rank with build_model(setting, device=..., dtype='nf4') and "
                         "shard it (lesson 12 shows it).")
    if mesh is None:
        from .ranks import mesh as current_mesh

        mesh = current_mesh()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    build = dict(dtype=setting.base_dtype, model_path=model_path, trust_remote_code=trust_remote_code)
    model = build_model(setting, device="meta", **build)
    apply_fsdp(model, mesh, reshard_after_forward=setting.reshard_after_forward, precision=setting.precision,
               cpu_offload=setting.cpu_offload, per_block=setting.per_block)
    model.to_empty(device="cpu" if setting.cpu_offload else device)
    full = {}
    if this_rank() == 0:
        where = full_copy_device(model, device, model_path)
        full = build_model(setting.replace(activation_checkpointing=False), device=where, seed=seed,
                           **build).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _fix_nonpersistent_buffers(model, device)
    return model


def full_copy_device(model: nn.Module, device, model_path=None) -> torch.device:
    """Where rank 0 builds the full copy `build_sharded` broadcasts: a random init (no `model_path`) on a GPU
    `device` when the model's bytes fit in 90% of its free memory, else the CPU. A checkpoint is read on the
    CPU (transformers loads it there first anyway). On the CPU the numbers are those of every earlier build; on
    a GPU they come from its own generator, the same for the same seed."""
    device = torch.device(device)
    if model_path is not None or device.type != "cuda":
        return torch.device("cpu")
    # `model` is the sharded one, on meta or already on its device: numel() of a DTensor is the full tensor's.
    full_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free, _ = torch.cuda.mem_get_info(device)
    return device if full_bytes < 0.9 * free else torch.device("cpu")


def build_tiny(cfg=None, seed: int = 0, device="cpu") -> nn.Module:
    """The same TinyTransformer on every rank (same seed), on `device`."""
    from .models import TinyConfig, TinyTransformer

    torch.manual_seed(seed)
    return TinyTransformer(cfg or TinyConfig()).to(device)


# --- one training step --------------------------------------------------------------------------------------

def make_optimizer(model: nn.Module, name: str = "adamw", *, lr: float = 1e-4, weight_decay: float = 0.0,
                   momentum: float = 0.9, foreach: bool | None = True):
    """The optimizer over the trainable parameters only (frozen base weights get no state). foreach=True, as
    torch picks on GPUs: its temporaries are part of the peak the lab measures."""
    check_choice("optimizer", name, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: build it with lora_rank=... or unfreeze some.")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=foreach)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, weight_decay=weight_decay, foreach=foreach)
