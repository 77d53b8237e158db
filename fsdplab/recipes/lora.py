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


def _dtype_kwarg(dtype) -> dict:
    """from_pretrained's dtype keyword: `dtype` in transformers >= 4.56, `torch_dtype` before."""
    if dtype is None:
        return {}
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _resolve_config(config):
    from ..models import hf_config

    return hf_config(config) if isinstance(config, str) else config


def build_model(config=None, *, lora_rank=None, lora_alpha=None, target_modules="all-linear",
                activation_checkpointing=False, device="meta", model_path=None, dtype=None,
                lora_dropout=0.0, seed=None, trust_remote_code=False) -> nn.Module:
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

        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                                     **_dtype_kwarg(dtype)).to(device)
    else:
        if model_path is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        if trust_remote_code:
            from transformers import AutoModelForCausalLM

            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, **_dtype_kwarg(dtype))
        else:
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

        apply_activation_checkpointing(model, blocks=decoder_layers(model))
    return model


def decoder_layers(model: nn.Module) -> list:
    """The decoder blocks, wherever peft and checkpoint wrappers put them (for models outside
    `fsdplab.parallel.blocks_of`'s list: the ModuleList with one entry per hidden layer)."""
    from ..parallel import blocks_of

    try:
        return blocks_of(model)
    except ValueError:
        num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and num_layers and len(module) == num_layers:
                return list(module)
        raise


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


def _fix_nonpersistent_buffers(model: nn.Module, device) -> None:
    """`to_empty` leaves buffers that no checkpoint stores (RoPE's inv_freq) as garbage: rebuild them."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer.to(device))


def build_sharded(config=None, mesh=None, *, model_path=None, device=None, lora_rank=None, lora_alpha=None,
                  target_modules="all-linear", activation_checkpointing=False, dtype=None, precision="bf16",
                  reshard_after_forward=True, cpu_offload=False, seed=0, trust_remote_code=False) -> nn.Module:
    """The training model on every rank: meta build, LoRA + checkpointing, shard, `to_empty`, then the weights.

    Only rank 0 holds a full copy (random init from `seed`, or the checkpoint at `model_path`, plus the fresh
    adapters); every other rank receives just its shards by broadcast, so host memory stays one model, not N.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if mesh is None:
        from ..dist import mesh as current_mesh

        mesh = current_mesh()
    if device is None:
        device = ("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(*device) if isinstance(device, tuple) else torch.device(device)
    kwargs = dict(model_path=model_path, lora_rank=lora_rank, lora_alpha=lora_alpha, target_modules=target_modules,
                  dtype=dtype, trust_remote_code=trust_remote_code)
    model = build_model(config, device="meta", activation_checkpointing=activation_checkpointing, **kwargs)
    shard_model(model, mesh, precision=precision, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    full = {}
    if dist.get_rank() == 0:
        full = build_model(config, device="cpu", seed=seed, **kwargs).state_dict()
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _fix_nonpersistent_buffers(model, device)
    return model


def miniature_config(tokenizer: CharTokenizer | None = None, name: str = "qwen-7b", initializer_range: float = 0.1):
    """The tiny twin of `name` (same architecture: Qwen2 layout, MHA for Qwen-7B) with the task's vocabulary.

    initializer_range: transformers' default 0.02 gives a random *frozen* LM head whose logits cannot exceed
    about 0.02 * hidden = 2.6 after the final RMSNorm, so LoRA alone cannot make any prediction confident
    (the loss stalls near 0.58). A trained head has larger weights; 0.1 stands in for that.
    """
    from ..models import hf_config, tiny_twin

    config = tiny_twin(hf_config(name), vocab_size=(tokenizer or CharTokenizer()).vocab_size)
    config.initializer_range = initializer_range
    return config


# --- a small instruction task the tiny twin can learn in seconds ---------------------------------------

class CharTokenizer:
    """One token per character of `alphabet`, after four specials: PAD, BOS, SEP (end of prompt), EOS."""

    PAD, BOS, SEP, EOS = 0, 1, 2, 3
    SPECIALS = ("<pad>", "<bos>", "<sep>", "<eos>")

    def __init__(self, alphabet: str = "abcdef"):
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet must be non-empty with distinct characters, got {alphabet!r}.")
        self.alphabet = alphabet
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list:
        unknown = sorted(set(text) - set(self.alphabet))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the alphabet {self.alphabet!r}.")
        return [len(self.SPECIALS) + self.alphabet.index(c) for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in (int(t) for t in ids):
            if i == self.EOS:
                break
            if i >= len(self.SPECIALS):
                out.append(self.alphabet[i - len(self.SPECIALS)])
        return "".join(out)

    def prompt(self, text: str) -> list:
        return [self.BOS] + self.encode(text) + [self.SEP]

    def answer(self, text: str) -> list:
        return self.encode(text) + [self.EOS]


TASKS = ("reverse", "sort")


class StringTask:
    """An instruction on short strings of distinct characters: 'reverse' or 'sort' it.
    Prompt: BOS s SEP; answer: f(s) EOS; the loss counts the answer only."""

    def __init__(self, name: str = "reverse", tokenizer: CharTokenizer | None = None, min_len: int = 2,
                 max_len: int = 4):
        if name not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {name!r}.")
        self.tokenizer = tokenizer or CharTokenizer()
        if not 1 <= min_len <= max_len <= len(self.tokenizer.alphabet):
            raise ValueError(f"need 1 <= min_len <= max_len <= alphabet size ({len(self.tokenizer.alphabet)}), "
                             f"got {min_len}, {max_len}.")
        self.name, self.min_len, self.max_len = name, min_len, max_len
        self.seq_len = 2 * max_len + 3  # BOS + s + SEP + f(s) + EOS

    def solve(self, text: str) -> str:
        return text[::-1] if self.name == "reverse" else "".join(sorted(text))

    def sample(self, gen: torch.Generator) -> str:
        n = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=gen))
        idx = torch.randperm(len(self.tokenizer.alphabet), generator=gen)[:n]
        return "".join(self.tokenizer.alphabet[i] for i in idx.tolist())

    def batch(self, batch_size: int, seed: int = 0, seq_len: int | None = None):
        """(input_ids, labels), right-padded to `seq_len`; labels are -100 except on the answer tokens
        (transformers shifts them by one inside the model's loss)."""
        seq_len = seq_len or self.seq_len
        if seq_len < self.seq_len:
            raise ValueError(f"seq_len must be at least {self.seq_len} for strings of up to {self.max_len} chars.")
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.full((batch_size, seq_len), self.tokenizer.PAD, dtype=torch.long)
        labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
        for row in range(batch_size):
            text = self.sample(gen)
            prompt, answer = self.tokenizer.prompt(text), self.tokenizer.answer(self.solve(text))
            input_ids[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            labels[row, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)
        return input_ids, labels


def train_steps(model, optimizer, task: StringTask, steps: int, *, batch_size: int = 8, seq_len=None,
                seed: int = 0, log_every: int = 0, device=None) -> list:
    """Plain LoRA training loop; each rank draws its own batches. Returns this rank's losses."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    device = device or next(model.parameters()).device
    model.train()
    losses = []
    for step in range(steps):
        input_ids, labels = task.batch(batch_size, seed=seed + 100_003 * rank + step, seq_len=seq_len)
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


class _one_thread:
    """Tiny models decode fastest on one thread: more only spin and wait (worse on a busy machine)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def greedy_answer(model, tokenizer: CharTokenizer, text: str, max_new_tokens: int | None = None) -> str:
    """Greedy decoding (no KV cache: the prompts are a few tokens) until EOS."""
    with _one_thread():
        return _greedy(model, tokenizer, text, max_new_tokens)


@torch.no_grad()
def _greedy(model, tokenizer, text, max_new_tokens):
    model.eval()
    ids = torch.tensor([tokenizer.prompt(text)], device=next(model.parameters()).device)
    for _ in range(max_new_tokens or len(text) + 1):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        if int(next_id) == tokenizer.EOS:
            break
    return tokenizer.decode(ids[0, len(text) + 2:])


def accuracy(model, task: StringTask, n: int = 64, seed: int = 12345) -> float:
    """Exact-match rate of greedy answers on `n` fresh strings."""
    gen = torch.Generator().manual_seed(seed)
    texts = [task.sample(gen) for _ in range(n)]
    with _one_thread():
        return sum(_greedy(model, task.tokenizer, t, None) == task.solve(t) for t in texts) / n


# --- the adapter: save from the sharded model, reload and merge -----------------------------------------

def adapter_state_dict(model) -> dict:
    """Full (unsharded) LoRA weights on rank 0, `{}` elsewhere. A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                               ignore_frozen_params=True))


def save_adapter(model, output_dir, adapter_name: str = "default") -> str | None:
    """Gather the adapter (a collective: all ranks call it) and write it on rank 0 in peft's format:
    adapter_config.json + adapter_model.safetensors, loadable with `peft.PeftModel.from_pretrained(base, dir)`.

    peft's own `save_pretrained` finds adapters by module name, and the checkpoint wrappers rename the
    modules (`_checkpoint_wrapped_module`), so it would silently save nothing; the state-dict keys from
    torch.distributed.checkpoint are already clean, so the file is written here with peft's key convention
    (adapter name removed).
    """
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    state = adapter_state_dict(model)
    path = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        tag = f".{adapter_name}"
        tensors = {k.replace(tag + ".", ".").removesuffix(tag): v.contiguous()
                   for k, v in state.items() if "lora_" in k}
        expected = sum(1 for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
        assert len(tensors) == expected > 0, f"adapter has {len(tensors)} tensors, expected {expected}"
        os.makedirs(output_dir, exist_ok=True)
        model.peft_config[adapter_name].save_pretrained(str(output_dir))
        save_file(tensors, os.path.join(str(output_dir), "adapter_model.safetensors"), metadata={"format": "pt"})
        path = str(output_dir)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_merged(base_path, adapter_dir, dtype=None) -> nn.Module:
    """A plain transformers model: the base checkpoint with the LoRA update merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), **_dtype_kwarg(dtype))
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


# --- what FSDP1 (the posts' API) adds ----------------------------------------------------------------------

_UNIT_SIZES: dict = {}


def _unit_sizes(config, lora_rank, target_modules) -> list:
    """(frozen, trainable) element counts of each decoder layer, from a meta build (cached for named models)."""
    key = (config, lora_rank, str(target_modules)) if isinstance(config, str) else None
    if key in _UNIT_SIZES:
        return _UNIT_SIZES[key]
    model = build_model(config, lora_rank=lora_rank, target_modules=target_modules, device="meta")
    units = [(sum(p.numel() for p in layer.parameters() if not p.requires_grad),
              sum(p.numel() for p in layer.parameters() if p.requires_grad)) for layer in decoder_layers(model)]
    if key is not None:
        _UNIT_SIZES[key] = units
    return units


def fsdp1_frozen_gradients(config="qwen-7b", world_size: int = 8, *, lora_rank: int = 64,
                           target_modules="all-linear", model_dtype="fp32", precision="fp16",
                           reduce_precision="fp32") -> dict:
    """Gradient bytes per rank that FSDP1 (`FullyShardedDataParallel(use_orig_params=True)`, one unit per
    decoder layer, as the posts wrap) holds on top of FSDP2 for a LoRA model.

    FSDP1 flattens each unit into one FlatParameter. peft puts the frozen base weights and the trainable
    adapters of a layer in the same unit, so the FlatParameter requires grad, and FSDP1 allocates its gradient
    for the whole flat tensor: "gradient memory usage ... equivalent to not freezing those parameters"
    (FSDP docs). FSDP2 shards each parameter separately and gives frozen ones no gradient at all.

    - persistent: the sharded gradient of every frozen weight that shares a unit with an adapter,
      kept between backward and the optimizer step in the FlatParameter's dtype (`model_dtype`: fp32 when the
      model is loaded in fp32 and cast by MixedPrecision, fp16 when loaded with torch_dtype=fp16);
    - transient: the unsharded gradient of one unit's frozen weights in the compute dtype during its backward,
      plus its cast to `reduce_precision` for the reduce-scatter.
    The root unit (embeddings, final norm, LM head) holds no adapter, so its FlatParameter is frozen.
    """
    import math

    from ..parallel import DTYPES

    for name, value in (("model_dtype", model_dtype), ("precision", precision), ("reduce_precision", reduce_precision)):
        if value not in DTYPES:
            raise ValueError(f"{name} must be one of {list(DTYPES)}, got {value!r}.")
    nbytes = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
    units = _unit_sizes(config, lora_rank, target_modules)
    frozen_in_mixed = [f for f, t in units if t > 0]
    persistent = sum(math.ceil((f + t) / world_size) - math.ceil(t / world_size)
                     for f, t in units if t > 0) * nbytes[model_dtype]
    largest = max(frozen_in_mixed, default=0)
    transient = largest * (nbytes[precision] + (nbytes[reduce_precision] if reduce_precision != precision else 0))
    return {"persistent_bytes": int(persistent), "transient_bytes": int(transient),
            "extra_peak_bytes": int(persistent + transient), "mixed_units": len(frozen_in_mixed),
            "frozen_params_with_gradients": int(sum(frozen_in_mixed)), "world_size": world_size,
            "model_dtype": model_dtype, "precision": precision}


# --- the case study at full scale: settings, grids, figures (lesson 06) ----------------------------------

GIB = 1024 ** 3
# The posts' setup: Qwen-7B, LoRA r=64 on every linear layer, FULL_SHARD, fp16, activation checkpointing.
# Sequence length and micro-batch are not stated in the posts; 2048 x 1 is the common default.
POSTS_SETTING = dict(model="qwen-7b", world_size=8, lora_rank=64, lora_alpha=128, lora_targets="all-linear",
                     seq_len=2048, batch_size=1, precision="fp16", activation_checkpointing=True,
                     reshard_after_forward=True)
POSTS_BAND_GIB = (17.0, 19.0)   # "17-19 GB per card", read as nvidia-smi's GiB


def setting(**changes) -> dict:
    """The posts' setting with some knobs changed; ValueError for a knob that does not exist."""
    unknown = set(changes) - set(POSTS_SETTING)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}: use {sorted(POSTS_SETTING)}.")
    return {**POSTS_SETTING, **changes}


def exact(settings: list, workers: int = 2, progress: bool = False) -> list:
    """`fsdplab.memory.estimate` for each setting, `workers` at a time (each in its own process: one fake
    process group per process). Returns the reports in order."""
    from concurrent.futures import ThreadPoolExecutor

    from .. import memory

    def one(kw):
        kw = dict(kw)
        return memory.estimate(kw.pop("model"), kw.pop("world_size"), progress=progress, subprocess_mode=True, **kw)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, settings))


def formula(**kw):
    """`fsdplab.memory.formula` for a setting dict (as `setting()` makes it)."""
    from .. import memory

    kw = dict(kw)
    kw.pop("lora_alpha", None)
    reshard = kw.pop("reshard_after_forward", True)
    return memory.formula(kw.pop("model"), kw.pop("world_size"),
                          strategy="full_shard" if reshard else "shard_grad_op", **kw)


def formula_grid(seq_lens, batch_sizes, **kw):
    """Peak GiB from the formula: rows = micro-batch sizes, columns = sequence lengths."""
    return [[formula(**setting(**kw, seq_len=s, batch_size=b)).peak_bytes / GIB for s in seq_lens]
            for b in batch_sizes]


def draw_heatmap(ax, seq_lens, batch_sizes, grid_gib, exact_gib=None, gpu_gib=24.0):
    """Colour: the formula's peak per GPU; a cell with an exact estimate shows it in bold with a star.
    Cells over `gpu_gib` are hatched (does not fit)."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    grid = np.array(grid_gib, dtype=float)
    norm = TwoSlopeNorm(vmin=min(grid.min(), gpu_gib - 1), vcenter=gpu_gib, vmax=max(grid.max(), gpu_gib + 1))
    image = ax.imshow(grid, cmap="RdYlGn_r", norm=norm, origin="lower", aspect="auto")
    for i, b in enumerate(batch_sizes):
        for j, s in enumerate(seq_lens):
            found = (exact_gib or {}).get((s, b))
            text = f"{grid[i, j]:.1f}" + (f"\n★{found:.1f}" if found is not None else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    fontweight="bold" if found is not None else "normal")
            if grid[i, j] > gpu_gib:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="black",
                                       linewidth=0))
    ax.set_xticks(range(len(seq_lens)), [str(s) for s in seq_lens])
    ax.set_yticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("micro-batch per GPU (sequences)")
    return image


def draw_breakdown(ax, labels, reports, extras=None, gpu_gib=24.0, band=POSTS_BAND_GIB):
    """Stacked bars (GiB) of each report's categories; `extras[i]` (bytes) stacks FSDP1's frozen-weight
    gradients on top. The posts' band and the GPU size are drawn as horizontal lines."""
    from .. import memory

    bottoms = [0.0] * len(reports)
    for name in memory.CATEGORIES:
        values = [r.by_category.get(name, 0) / GIB for r in reports]
        ax.bar(labels, values, bottom=bottoms, color=memory.COLORS[name], label=memory.CATEGORY_LABELS[name])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if extras:
        values = [(e or 0) / GIB for e in extras]
        ax.bar(labels, values, bottom=bottoms, color="#bbbbbb", hatch="xx", edgecolor="#555555",
               label="FSDP1: gradients of frozen weights")
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if band:
        ax.axhspan(*band, color="gold", alpha=0.3, label=f"posts: {band[0]:g}-{band[1]:g} GB per card")
    if gpu_gib:
        ax.axhline(gpu_gib, color="black", linestyle="--", linewidth=1, label=f"A10: {gpu_gib:g} GiB")
    ax.set_ylabel("peak memory per GPU (GiB)")
    return bottoms


_FSDP1_CACHE: dict = {}


def fsdp1_extra_bytes(model="qwen-7b", world_size=8, lora_rank=64, lora_targets="all-linear", precision="fp16",
                      model_dtype="fp32") -> int:
    """Cached `fsdp1_frozen_gradients(...)["extra_peak_bytes"]` (a meta build of the model per new key)."""
    key = (model, world_size, lora_rank, lora_targets, precision, model_dtype)
    if key not in _FSDP1_CACHE:
        _FSDP1_CACHE[key] = fsdp1_frozen_gradients(model, world_size, lora_rank=lora_rank,
                                                   target_modules=lora_targets, precision=precision,
                                                   model_dtype=model_dtype)["extra_peak_bytes"]
    return _FSDP1_CACHE[key]


def lora_dashboard(gpu_gib: float = 24.0, **start):
    """Knobs of the posts' setup -> per-GPU breakdown (formula, instant) and "fits / does not fit" on an
    A10; the button runs the exact estimate for the current knobs (10-60 s) and marks it on the bar."""
    import ipywidgets as W

    from ..widgets import Dashboard

    s = setting(**start)
    controls = {
        "seq_len": W.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=s["seq_len"], description="seq len"),
        "batch_size": W.Dropdown(options=[1, 2, 4, 8], value=s["batch_size"], description="micro-batch"),
        "activation_checkpointing": W.Checkbox(value=s["activation_checkpointing"], description="checkpointing"),
        "strategy": W.Dropdown(options=["FULL_SHARD", "SHARD_GRAD_OP"],
                               value="FULL_SHARD" if s["reshard_after_forward"] else "SHARD_GRAD_OP",
                               description="strategy"),
        "precision": W.Dropdown(options=["fp16", "bf16"], value=s["precision"], description="precision"),
        "lora_rank": W.Dropdown(options=[8, 16, 32, 64, 128], value=s["lora_rank"], description="LoRA r"),
        "lora_targets": W.Dropdown(options=["all-linear", "attention"], value=s["lora_targets"], description="targets"),
        "api": W.Dropdown(options=["FSDP2", "FSDP1 use_orig_params"], value="FSDP2", description="API"),
    }
    found: dict = {}

    def knobs_to_setting(v):
        return setting(seq_len=v["seq_len"], batch_size=v["batch_size"], precision=v["precision"],
                       activation_checkpointing=v["activation_checkpointing"], lora_rank=v["lora_rank"],
                       lora_alpha=2 * v["lora_rank"], lora_targets=v["lora_targets"],
                       reshard_after_forward=v["strategy"] == "FULL_SHARD")

    def draw(fig, **v):
        kw = knobs_to_setting(v)
        report = formula(**kw)
        extra = fsdp1_extra_bytes(kw["model"], kw["world_size"], kw["lora_rank"], kw["lora_targets"],
                                  kw["precision"]) if v["api"] != "FSDP2" else 0
        total = (report.peak_bytes + extra) / GIB
        fits = total <= gpu_gib
        ax = fig.add_subplot(1, 1, 1)
        draw_breakdown(ax, ["formula"], [report], [extra], gpu_gib=gpu_gib)
        key = tuple(sorted(kw.items()))
        if key in found:
            ax.plot([0], [(found[key].peak_bytes + extra) / GIB], marker="*", markersize=16, color="gold",
                    markeredgecolor="black", linestyle="none", label="exact estimate")
        ax.set_ylim(0, max(gpu_gib * 1.15, total * 1.1))
        ax.set_title(f"Qwen-7B LoRA on 8 x A10: {total:.1f} GiB per GPU -> "
                     + ("fits" if fits else "does NOT fit"), fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return {"setting": kw, "report": report, "fsdp1_extra_bytes": extra, "total_gib": total, "fits": fits,
                "exact": found.get(key)}

    dash = Dashboard(controls, draw, title="Qwen-7B LoRA per-GPU memory (formula; button: exact)", figsize=(7, 4))
    button = W.Button(description="exact estimate")

    def run_exact(_button=None):
        kw = knobs_to_setting(dash.values)
        say = getattr(dash, "say", print)   # the Dashboard's status line (plain HTML, no output capture)
        say("running fsdplab.memory.estimate (tens of seconds) ...")
        [report] = exact([kw], workers=1)
        found[tuple(sorted(kw.items()))] = report
        result = dash.refresh()
        say(report.table(gpu_mem_gib=gpu_gib))
        return result

    button.on_click(run_exact)
    dash.exact = run_exact
    dash.widget = W.VBox([dash.widget, button])
    return dash


# --- torchrun entry point ------------------------------------------------------------------------------------

def parse_args(argv=None):
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m fsdplab.recipes.lora",
        description="LoRA fine-tuning under FSDP2 on every rank of a torchrun job (gloo on CPU, nccl on GPUs). "
                    "Trains on a synthetic string task; saves the adapter with peft.")
    p.add_argument("--model", default="tiny", help="qwen-7b, qwen2-7b or tiny (random init); ignored with --model-path")
    p.add_argument("--model-path", default=None, help="local directory of a transformers checkpoint (downloaded "
                   "weights), e.g. Qwen2-7B; Qwen-7B v1 checkpoints need --trust-remote-code and --lora-targets "
                   "with their module names (c_attn,c_proj,w1,w2)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--lora-targets", default="all-linear",
                   help="all-linear, attention, or comma-separated module names")
    p.add_argument("--task", default="sort", choices=TASKS)
    p.add_argument("--seq-len", type=int, default=None, help="pad every sequence to this length (memory as in "
                                                             "real training); default: the task's length")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--model-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="storage dtype of the frozen base (default fp32 = FSDP2's master copy)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-reshard-after-forward is SHARD_GRAD_OP")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy (needs GPUs)")
    p.add_argument("--output-dir", default="lora-adapter", help="where rank 0 writes the peft adapter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    if "," in args.lora_targets:
        args.lora_targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return args


def main(argv=None) -> dict:
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if args.cpu_offload and not use_cuda:
        raise ValueError("--cpu-offload needs GPUs (FSDP2's CPUOffloadPolicy moves shards between host and GPU).")
    # One visible block of distributed setup: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*.
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world_size,))

    task = StringTask(args.task)
    config = None if args.model_path else (miniature_config(task.tokenizer) if args.model == "tiny"
                                           else args.model)
    if rank == 0 and args.model != "tiny":
        print(f"{args.model_path or args.model}: the string task's character ids are used as token ids "
              "(enough to measure memory and speed; bring your own data for a real fine-tune).", flush=True)
    try:
        model = build_sharded(config, mesh, model_path=args.model_path, device=device, lora_rank=args.lora_rank,
                              lora_alpha=args.lora_alpha, target_modules=args.lora_targets,
                              activation_checkpointing=args.activation_checkpointing, dtype=args.model_dtype,
                              precision=args.precision, reshard_after_forward=args.reshard_after_forward,
                              cpu_offload=args.cpu_offload, seed=args.seed,
                              trust_remote_code=args.trust_remote_code)
        optimizer = make_optimizer(model, args.lr)
        if use_cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses = train_steps(model, optimizer, task, args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             seed=args.seed, log_every=args.log_every, device=device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if use_cuda else None
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak)
        path = save_adapter(model, args.output_dir)
        result = {"rank": rank, "losses": losses, "seconds": seconds, "adapter": path, "peak_gib": peaks}
        if rank == 0:
            print(f"{args.steps} steps in {seconds:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
                  f"adapter saved to {path}", flush=True)
            if use_cuda:
                print("peak memory allocated per rank (GiB): " + ", ".join(f"{p:.2f}" for p in peaks), flush=True)
        return result
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
