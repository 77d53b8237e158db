"""LoRA fine-tuning of a transformers causal LM under FSDP2: the Qwen-7B-on-8xA10 case study.

The same functions serve three callers: lesson 06 (a tiny twin on CPU ranks), `fsdplab.memory.estimate`
(the real sizes on fake tensors), and a reader with real GPUs and downloaded weights:

    torchrun --nproc_per_node 8 -m fsdplab.recipes.lora --model-path PATH --lora-rank 64 --seq-len 2048

Order of construction (pytorch/examples FSDP2 style): build on the meta device, add the LoRA adapters and
activation checkpointing there, shard with `fully_shard`, then materialise with `to_empty` and load or
initialise the weights.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = ("all-linear", "attention")


def lora_target_modules(target_modules="all-linear"):
    """peft's `target_modules` for 'all-linear' (every Linear in the blocks, not the LM head),
    'attention' (q/k/v/o projections) or an explicit list of module names."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return "all-linear"
        if target_modules == "attention":
            return list(ATTENTION_MODULES)
        raise ValueError(f"target_modules must be one of {TARGETS} or a list of module names such as "
                         f"{ATTENTION_MODULES}, got {target_modules!r}.")
    names = list(target_modules)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"target_modules as a list must hold module names such as {ATTENTION_MODULES}.")
    return names


def _resolve_config(config):
    from ..models import hf_config

    return hf_config(config) if isinstance(config, str) else config


def build_model(config=None, *, lora_rank=None, lora_alpha=None, target_modules="all-linear",
                activation_checkpointing=False, device="meta", model_path=None, dtype=None,
                lora_dropout=0.0, seed=None) -> nn.Module:
    """A transformers causal LM with (optionally) LoRA adapters and per-block activation checkpointing.

    config: a transformers config or a name for `fsdplab.models.hf_config` ('qwen-7b', 'qwen2-7b', 'tiny').
    model_path: a local checkpoint directory; its weights are loaded when `device` is a real device, and only
    its config is used on the meta device. With `lora_rank`, the base weights are frozen (peft) and only the
    adapters train; without it every parameter trains (a full fine-tune).
    dtype: storage dtype of the base model (None: fp32; the adapters stay fp32 either way).
    """
    if config is None and model_path is None:
        raise ValueError("pass a config (or a model name such as 'qwen-7b' / 'tiny') or model_path=DIR.")
    if isinstance(dtype, str):
        from ..parallel import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be a torch.dtype or one of {list(DTYPES)}, got {dtype!r}.")
        dtype = DTYPES[dtype]
    if lora_rank is not None and int(lora_rank) < 1:
        raise ValueError(f"lora_rank must be a positive integer (or None for a full fine-tune), got {lora_rank}.")
    if seed is not None:
        torch.manual_seed(seed)

    meta = torch.device(device).type == "meta"
    if model_path is not None and not meta:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(device)
    else:
        if model_path is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path)
        from ..models import causal_lm

        model = causal_lm(_resolve_config(config), device=device, dtype=dtype)
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # no KV cache while training: it would only hold memory

    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=int(lora_rank), lora_alpha=lora_alpha if lora_alpha is not None else 2 * int(lora_rank),
                          lora_dropout=lora_dropout, target_modules=lora_target_modules(target_modules),
                          bias="none", task_type="CAUSAL_LM")
        # Create the adapters on the same device as the base weights (on meta: no memory at all).
        with torch.device(device):
            model = get_peft_model(model, lora)
    if activation_checkpointing:
        from ..parallel import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    return model


def decoder_layers(model: nn.Module) -> list:
    """The decoder blocks, wherever peft and checkpoint wrappers put them."""
    from ..parallel import blocks_of

    return blocks_of(model)


def shard_model(model: nn.Module, mesh, *, precision="bf16", reshard_after_forward=True, cpu_offload=False,
                reduce_precision=None) -> nn.Module:
    """FSDP2 on each decoder layer, then the root (embeddings, final norm, LM head).

    reshard_after_forward=True is FULL_SHARD; False is SHARD_GRAD_OP. Gradients are reduced in fp32 by
    default (`reduce_precision`), the safe choice with fp16 compute.
    """
    from ..parallel import apply_fsdp

    return apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward, precision=precision,
                      reduce_precision=reduce_precision, cpu_offload=cpu_offload, blocks=decoder_layers(model))


def trainable_parameters(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, lr: float = 1e-4, weight_decay: float = 0.0):
    """AdamW over the trainable parameters only: frozen base weights get no optimizer state."""
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters: build it with lora_rank=... or unfreeze some.")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
