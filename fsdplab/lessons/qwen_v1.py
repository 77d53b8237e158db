"""Qwen-7B v1 as its own modeling code lays it out (the posts' model), for lessons 06 and 08: the lab builds
Qwen-7B with transformers' Qwen2 classes, whose q, k and v are three Linears where v1 has one fused c_attn."""

from __future__ import annotations

import torch
from torch import nn

from ..models import hf_config


def qwen_v1_layer(config=None):
    """One decoder layer of Qwen-7B v1 with the names of its own modeling code (QWenBlock), on the meta device:
    q, k and v in ONE fused Linear `attn.c_attn` (hidden -> 3 x hidden, with bias), `attn.c_proj`, and the
    SwiGLU MLP `mlp.w1`, `mlp.w2` (hidden -> intermediate) and `mlp.c_proj`. The lab builds Qwen-7B with
    transformers' Qwen2 classes, which hold the same weights as three separate q/k/v projections."""
    c = config or hf_config("qwen-7b")
    h, i = c.hidden_size, c.intermediate_size

    def named(**modules):
        module = nn.Module()
        for name, child in modules.items():
            module.add_module(name, child)
        return module

    with torch.device("meta"):
        return named(ln_1=nn.RMSNorm(h), attn=named(c_attn=nn.Linear(h, 3 * h), c_proj=nn.Linear(h, h, bias=False)),
                     ln_2=nn.RMSNorm(h), mlp=named(w1=nn.Linear(h, i, bias=False), w2=nn.Linear(h, i, bias=False),
                                                   c_proj=nn.Linear(i, h, bias=False)))


def qwen_v1_model(config=None):
    """Qwen-7B v1 whole, on the meta device: `transformer.wte`, `transformer.h` (v1 layers), `transformer.ln_f`,
    `lm_head`. For counting what a wrap policy makes of the posts' model (its fused c_attn makes fewer units
    than the Qwen2 layout's separate q/k/v)."""
    c = config or hf_config("qwen-7b")
    model = nn.Module()
    with torch.device("meta"):
        transformer = nn.Module()
        transformer.add_module("wte", nn.Embedding(c.vocab_size, c.hidden_size))
        transformer.add_module("h", nn.ModuleList(qwen_v1_layer(c) for _ in range(c.num_hidden_layers)))
        transformer.add_module("ln_f", nn.RMSNorm(c.hidden_size))
        model.add_module("transformer", transformer)
        model.add_module("lm_head", nn.Linear(c.hidden_size, c.vocab_size, bias=False))
    return model
