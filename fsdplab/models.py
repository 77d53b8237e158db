"""Models the lessons shard: a tiny transformer written out in full, and transformers configs with the
real sizes of the posts' models (built on the meta device: shapes without memory) plus tiny twins of the
same architecture that train in seconds on CPU ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Parameter counts checked against the models' published sizes (see tests/test_models.py).
PARAM_COUNTS = {"qwen-7b": 7_721_324_544, "qwen2-7b": 7_615_616_512, "llama2-7b": 6_738_415_616}


@dataclass
class TinyConfig:
    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    seq_len: int = 32
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm transformer block: the unit FSDP shards and gathers one at a time."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.num_heads, dropout=cfg.dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x):
        seq_len = x.shape[1]
        causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A small GPT: token + position embedding, `num_layers` blocks, a final norm and an untied head."""

    def __init__(self, cfg: TinyConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens, targets):
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def random_batch(cfg: TinyConfig, batch_size: int = 4, seed: int = 0, device="cpu"):
    """(tokens, targets) of a learnable toy task: each target is the next token of a repeating sequence."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    step = torch.randint(1, 7, (batch_size, 1), generator=gen)
    seq = (start + step * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


# --- transformers configs with the real sizes -------------------------------------------------------

def hf_config(name: str):
    """transformers config for 'qwen-7b' (Qwen v1 sizes on the Qwen2 architecture), 'qwen2-7b',
    'llama2-7b', or a tiny twin: 'tiny' / 'tiny-qwen' (hidden 128, 4 layers)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, use_cache=False)
    if name == "qwen-7b":
        # Qwen v1 7B: no GQA, MLP 11008, bias on q/k/v: exactly Qwen2's architecture at these sizes.
        return Qwen2Config(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           intermediate_size=11008, vocab_size=151936, max_position_embeddings=8192, **common)
    if name == "qwen2-7b":
        return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                           intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
                           rope_theta=1_000_000.0, **common)
    if name == "llama2-7b":
        return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                           intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                           use_cache=False)
    if name in ("tiny", "tiny-qwen"):
        return Qwen2Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=256, vocab_size=512, max_position_embeddings=512, **common)
    raise ValueError(f"unknown model {name!r}: use one of {MODEL_NAMES}.")


MODEL_NAMES = ("qwen-7b", "qwen2-7b", "llama2-7b", "tiny")


def tiny_twin(config, hidden_size: int = 128, num_layers: int = 4, vocab_size: int = 512):
    """Same architecture as `config` (attention layout, GQA ratio, MLP ratio), small enough for CPU ranks."""
    twin = config.__class__(**config.to_dict())
    heads = 4
    kv_ratio = max(1, config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads))
    twin.hidden_size, twin.num_hidden_layers, twin.num_attention_heads = hidden_size, num_layers, heads
    twin.num_key_value_heads = max(1, heads // kv_ratio)
    twin.intermediate_size = int(hidden_size * config.intermediate_size / config.hidden_size)
    twin.vocab_size = vocab_size
    if hasattr(twin, "head_dim"):
        twin.head_dim = hidden_size // heads
    if getattr(twin, "layer_types", None) is not None:
        # Per-layer attention kinds: one entry per layer, or save_pretrained refuses the config.
        twin.layer_types = list(config.layer_types)[:num_layers]
    return twin


def causal_lm(config, device="meta", dtype=None):
    """A transformers causal LM from `config`; on the meta device by default (no memory used)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype) if dtype else \
            AutoModelForCausalLM.from_config(config)
    return model


def count_params(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
