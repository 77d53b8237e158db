"""Models the lessons shard: a tiny transformer written out in full, and one registry of named transformers
models at their real sizes (built on the meta device: shapes without memory), plus tiny twins of the same
architecture that train in seconds on CPU ranks.

Adding a model is one entry in `MODELS`: the formula's sizes, the CLI's model names, the dashboards' lists and
the tiny twins all derive from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

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


def default_device(device=None) -> torch.device:
    """`device` as a torch.device; None means where this process computes: `fsdplab.device()` on a rank
    (cuda:LOCAL_RANK under nccl), the current GPU in an nccl group started otherwise (torchrun), else the CPU
    (a gloo rank, the notebook kernel). Defaults of rank code use it: an nccl rank has no CPU collectives, and
    FSDP2 moves a model's inputs to its device but nothing else (the loss's targets, a reference)."""
    if device is not None:
        return torch.device(device)
    from .runtime.on_rank import STATE

    if STATE.get("device"):
        return torch.device(STATE["device"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):   # "cpu:gloo,cuda:nccl" too
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def random_batch(cfg: TinyConfig, batch_size: int = 4, seed: int = 0, device=None):
    """(tokens, targets) of a learnable toy task: each target is the next token of a repeating sequence. On
    `device` (None: this rank's, `default_device`); drawn on the CPU first, so the same seed gives the same batch
    on every device."""
    device = default_device(device)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=gen)
    step = torch.randint(1, 7, (batch_size, 1), generator=gen)
    seq = (start + step * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


# --- the registry: transformers configs with the real sizes ------------------------------------------

@dataclass(frozen=True)
class ModelEntry:
    """A named model: its transformers config class and the fields that differ from that class's defaults."""

    name: str
    config_class: str                 # a class of `transformers`, e.g. "Qwen2Config"
    fields: dict = field(default_factory=dict)
    params: int | None = None         # published parameter count (tests/lessons/test_06_qwen7b_lora.py checks
                                      # Qwen-7B's)
    about: str = ""


_NO_CACHE = dict(use_cache=False)
_QWEN = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, **_NO_CACHE)

MODELS = {entry.name: entry for entry in (
    ModelEntry("qwen-7b", "Qwen2Config", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=151936, max_position_embeddings=8192, **_QWEN),
        params=7_721_324_544,
        about="Qwen v1 7B (the posts' model): no GQA, MLP 11008, bias on q/k/v: Qwen2's architecture at these sizes"),
    ModelEntry("qwen2-7b", "Qwen2Config", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, rope_theta=1_000_000.0, **_QWEN),
        params=7_615_616_512, about="Qwen2 7B"),
    ModelEntry("llama2-7b", "LlamaConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, **_NO_CACHE),
        params=6_738_415_616, about="Llama 2 7B"),
    ModelEntry("llama2-13b", "LlamaConfig", dict(
        hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096, **_NO_CACHE),
        params=13_015_864_320, about="Llama 2 13B"),
    ModelEntry("llama2-70b", "LlamaConfig", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, **_NO_CACHE),
        params=68_976_648_192, about="Llama 2 70B"),
    ModelEntry("tiny", "Qwen2Config", dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, vocab_size=512, max_position_embeddings=512, **_QWEN),
        about="a tiny Qwen2 (hidden 128, 4 layers) that trains in seconds on CPU ranks"),
)}
PARAM_COUNTS = {name: entry.params for name, entry in MODELS.items() if entry.params}


def hf_config(name: str):
    """The transformers config of a registered model (see `MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {list(MODELS)}.")
    import transformers

    entry = MODELS[name]
    return getattr(transformers, entry.config_class)(**entry.fields)


def config_of(model):
    """A transformers config for a registered name, or `model` itself when it already is a config; a custom
    model (fsdplab.custom) as its CustomModel."""
    if isinstance(model, str) and ":" in model:
        from .custom import load

        return load(model)
    return hf_config(model) if isinstance(model, str) else model


def tiny_twin(config, hidden_size: int = 128, num_layers: int = 4, vocab_size: int = 512):
    """Same architecture as `config` (a config or a registered name: attention layout, GQA ratio, MLP
    ratio), small enough for CPU ranks."""
    config = config_of(config)
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


def dtype_kwarg(dtype) -> dict:
    """transformers' dtype keyword: `dtype` in transformers >= 4.56, `torch_dtype` before."""
    if dtype is None:
        return {}
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def causal_lm(config, device="meta", dtype=None, trust_remote_code: bool = False):
    """A transformers causal LM from `config` (or a registered name); on the meta device by default (no
    memory used)."""
    from transformers import AutoModelForCausalLM

    extra = {"trust_remote_code": True} if trust_remote_code else {}
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config_of(config), **dtype_kwarg(dtype), **extra)


def count_params(model, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# --- where the blocks are -----------------------------------------------------------------------------

def blocks_of(model: nn.Module) -> list:
    """The repeated transformer blocks: the units FSDP shards and gathers one at a time. Known paths first
    (the tiny transformer, transformers' decoders, peft-wrapped decoders, GPT-2 style), then the ModuleList
    with one entry per hidden layer."""
    for path in ("layers", "model.layers", "base_model.model.model.layers", "transformer.h"):
        module = model
        try:
            for name in path.split("."):
                module = getattr(module, name)
        except AttributeError:
            continue
        return list(module)
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and num_layers and len(module) == num_layers:
            return list(module)
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}; pass blocks= explicitly.")


# --- the user's own model: a config file, a model folder or a Hub id --------------------------------------

def resolve_model(text: str):
    """What `--model TEXT` names: a registered name (returned as is), or the transformers config of a local
    config.json, a model folder, or a Hub id ("org/name": the local Hugging Face cache first, offline, then
    the Hub), or a model of your own as "package.module:function" (fsdplab.custom; returned as is once it
    loads). Every other case raises ValueError with the fix."""
    from pathlib import Path

    if text in MODELS:
        return text
    path = Path(text).expanduser()
    if ":" in text and not path.exists():
        from .custom import load

        load(text)
        return text
    if path.exists():
        return _config_from_path(path, text)
    if text.endswith(".json") or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ValueError(f"no such file or folder: {text}; pass a config.json, a model folder, a registered "
                         f"name ({', '.join(MODELS)}) or a Hub id such as Qwen/Qwen2-7B.")
    config = _config_from_cache(text)
    if config is None and "/" in text:
        config = _config_from_hub(text)
    if config is None:
        raise ValueError(_unknown_name(text))
    return _named(check_config_sizes(check_causal_lm(config), text), text)


def _unknown_name(text: str) -> str:
    import difflib

    close = difflib.get_close_matches(text, list(MODELS), n=3, cutoff=0.5)
    listed = " or ".join(close) if len(close) < 3 else f"{', '.join(close[:-1])} or {close[-1]}"
    hint = f"did you mean {listed}? " if close else ""
    return (f"unknown model {text!r}: {hint}Use a registered name ({', '.join(MODELS)}), a config.json, a model "
            f"folder, or a Hub id such as Qwen/Qwen2-7B.")


def _config_from_path(path, text: str):
    """The config of a config.json or of a folder holding one; the JSON is read here first so that a file
    that does not parse is named with the line and column."""
    import json

    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{text} has no config.json: pass the folder of a Hugging Face model (the one holding "
                         f"config.json) or the config file itself.")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ValueError(f"{file} is not valid JSON ({where}); fix the file or download it again.") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{file} has no \"model_type\" key, so transformers cannot tell which architecture it "
                         "describes; add one (e.g. \"model_type\": \"llama\") or use the model's own config.json.")
    _check_raw_sizes(data, file)
    try:
        config = AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except ValueError as e:
        raise ValueError(_config_error(file, e, data)) from None
    except Exception as e:
        raise ValueError(_refused(file, e)) from None
    return _named(check_config_sizes(check_causal_lm(config), str(file)), text)


def _refused(where, error) -> str:
    """transformers' own validation of a config's fields (a strict dataclass error, not a
    ValueError) as one line: the field it names and why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = lines or [type(error).__name__]
    return f"{where}: transformers refuses the config ({lines[-1]}); fix that field."


def _config_error(where, error, data=None) -> str:
    """AutoConfig's refusal of a config that parsed, as one line with the fix."""
    import transformers

    model_type = f"model type {data['model_type']!r}" if data else "its model type"
    if (data and "auto_map" in data) or "trust_remote_code" in str(error):
        return (f"{where}: {model_type} needs the model's own Python code (auto_map), which the estimator does "
                "not run; use a model whose architecture transformers ships.")
    return (f"{where}: transformers {transformers.__version__} does not know {model_type}; upgrade "
            "transformers (pip install -U transformers) or fix model_type in the config.")


def _config_from_cache(repo_id: str):
    """The config of `repo_id` from the local Hugging Face cache, or None when it is not there."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(repo_id, local_files_only=True, trust_remote_code=False)
    except OSError:
        return None
    except ValueError as e:
        raise ValueError(_config_error(repo_id, e)) from None


def _config_from_hub(repo_id: str):
    """The config of `repo_id` from the Hub. The Hub is probed first: without a network, transformers retries
    for half a minute before it gives up."""
    import os
    import socket
    from urllib.parse import urlparse

    from transformers import AutoConfig

    fix = (f"download it where there is a network (hf download {repo_id} config.json, or copy its config.json "
           "here) and pass the file or folder, or copy the Hugging Face cache (~/.cache/huggingface) here.")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {fix}")
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        raise ValueError(f"{repo_id} is not in the local Hugging Face cache and the Hub ({host}) cannot be "
                         f"reached: {fix}") from None
    try:
        return AutoConfig.from_pretrained(repo_id, trust_remote_code=False)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load the config of {repo_id} from the Hub ({first}); check the name, or log in "
                         "(hf auth login) for a gated model.") from None
    except ValueError as e:
        raise ValueError(_config_error(repo_id, e)) from None


# The sizes every decoder config has, and those some leave out (None: derived, as GPT-2's MLP).
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings")
# The estimate traces every block, so its time grows with the layers (100,000 ran for minutes
# without a word); the deepest released decoder, Llama 3.1 405B, has 126.
MAX_LAYERS = 512
LAYERS_BOUND = "4 times Llama 3.1 405B's 126 layers; the estimate traces every block"


def check_config_sizes(config, where: str | None = None):
    """`config` (a transformers config) if its sizes make a decoder; else ValueError, one line
    naming the field, its value and what is allowed. `resolve_model` and `TrainSetting` check it
    before any work."""
    where = where or getattr(config, "name_or_path", "") or type(config).__name__

    def get(name):
        try:
            return name, getattr(config, name)
        except AttributeError:
            return None
    _check_sizes(get, where)
    return config


def _check_raw_sizes(data: dict, file) -> None:
    """The sizes of a config.json as written, before transformers fills a missing one with its
    class's default or refuses one with a traceback. Fields are named as the file spells them
    (GPT-2's n_embd)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = data.get("model_type")
    # CONFIG_MAPPING is lazy: its .get answers None even for a known type
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING or "text_config" in data:
        return               # an unknown type, an encoder-decoder, a multimodal model: named later
    aliases = getattr(config_class, "attribute_map", {}) or {}

    def get(name):
        for key in (name, aliases.get(name)):
            if key in data:
                return key, data[key]
        return None
    for name in REQUIRED_SIZES:
        if get(name) is None:
            alias = f" (or {aliases[name]})" if name in aliases else ""
            raise ValueError(f"{file} has no {name}{alias} field: the estimator needs every one of "
                             f"{', '.join(REQUIRED_SIZES)}; use the model's own config.json.")
    _check_sizes(get, file)


def _check_sizes(get, where) -> None:
    """Type, range and divisibility of the sizes; `get(name)`: (the key as spelt, value) or None."""
    values = {}
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        found = get(name)
        if found is None or (found[1] is None and name in OPTIONAL_SIZES):
            continue
        key, value = found
        if type(value) is not int or value < 1:     # a bool or a float is no size either
            kind = "" if value is None or type(value) is int else f" (a {type(value).__name__})"
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}{kind}.")
        if name == "num_hidden_layers" and value > MAX_LAYERS:
            raise ValueError(f"{where}: {key} must be at most {MAX_LAYERS:,} ({LAYERS_BOUND}), "
                             f"got {value!r}.")
        values[name] = (key, value)
    if not {"hidden_size", "num_attention_heads"} <= set(values):
        return
    (hidden_key, hidden), (heads_key, heads) = values["hidden_size"], values["num_attention_heads"]
    head_dim = values.get("head_dim", (None, hidden // heads))[1]
    # An explicit head_dim of its own (Gemma: 3072 wide, 16 heads of 256) lets the width differ from
    # heads x head_dim; without one, transformers floors the division and builds a wrong model.
    if hidden % heads and head_dim == hidden // heads:
        raise ValueError(f"{where}: {hidden_key} ({hidden}) must be a multiple of {heads_key} "
                         f"({heads}), each head being {hidden_key} / {heads_key} wide; fix one of "
                         f"them.")
    if "num_key_value_heads" in values:
        kv_key, kv_heads = values["num_key_value_heads"]
        if heads % kv_heads:
            raise ValueError(f"{where}: {kv_key} ({kv_heads}) must divide {heads_key} ({heads}): "
                             f"each key/value head serves a whole group of query heads "
                             f"(e.g. {kv_key} 1, or {heads}).")


def _named(config, text: str):
    config.name_or_path = text     # the model's label in reports: what the user typed
    return config


def architecture_of(config) -> str:
    """A config's architecture as people name it: its `architectures` entry, else the causal-LM class
    transformers builds for it, else its config class."""
    names = getattr(config, "architectures", None) or []
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    return f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r})"


def check_causal_lm(config):
    """`config`, if transformers can build it as a causal (decoder-only) LM; else ValueError naming it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers cannot build {architecture_of(config)} as a causal language model "
                         "(AutoModelForCausalLM): the estimator sizes decoder-only models such as Llama, Qwen2, "
                         "Mistral, Gemma or GPT-NeoX.")
    if not hasattr(config, "hidden_size"):   # a multimodal model: the language model's sizes are nested
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
        text_type = f"model_type {text.model_type!r}" if text is not None and text is not config else "its text model"
        raise ValueError(f"{architecture_of(config)} is a multimodal model (its language model's sizes are in a nested "
                         f"text config); the estimator sizes the language model alone: pass a config.json holding "
                         f"its text_config section with {text_type}.")
    return config
