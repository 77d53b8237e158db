"""LoRA fine-tuning of a transformers causal LM under FSDP2, as a torchrun script: the Qwen-7B-on-8xA10 case
study's recipe.

The same functions serve lesson 06 (a tiny twin on CPU ranks) and a reader with real GPUs and downloaded
weights:

    torchrun --nproc_per_node 8 -m fsdplab.recipes.lora --model-path PATH --lora-rank 64 --seq-len 2048

Across nodes, one torchrun per node (PATH on every node; rank 0 writes the adapter on its own node):

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:29500 \\
        --rdzv-id JOB_ID -m fsdplab.recipes.lora --model-path PATH --lora-rank 64 --seq-len 2048

The model is built and sharded by `fsdplab.sharding.build_sharded` (meta device, LoRA adapters and activation
checkpointing there, `fully_shard`, then `to_empty` and the weights); every step is `fsdplab.sharding.train_step`.
This module adds what only LoRA fine-tuning needs: a small instruction task the tiny twin learns in seconds,
greedy decoding, and saving / merging the adapter.
"""

from __future__ import annotations

import gc
import warnings

import torch
from torch import nn

from ..models import dtype_kwarg


def miniature_config(tokenizer: CharTokenizer | None = None, name: str = "qwen-7b", initializer_range: float = 0.1):
    """The tiny twin of `name` (same architecture: Qwen2 layout, MHA for Qwen-7B) with the task's vocabulary.

    initializer_range: transformers' default 0.02 gives a random *frozen* LM head whose logits cannot exceed
    about 0.02 * hidden = 2.6 after the final RMSNorm, so LoRA alone cannot make any prediction confident
    (the loss stalls near 0.58). A trained head has larger weights; 0.1 stands in for that.
    """
    from ..models import tiny_twin

    config = tiny_twin(name, vocab_size=(tokenizer or CharTokenizer()).vocab_size)
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
                seed: int = 0, log_every: int = 0, device=None, scaler=None) -> list:
    """Plain LoRA training loop; each rank draws its own batches. Returns this rank's losses.

    scaler: a GradScaler (`fsdplab.lessons.precision.loss_scaler`), which fp16 needs: without one, gradients below
    fp16's 6e-8 flush to zero and an overflow's inf reaches the weights. The log then shows its scale."""
    from ..ranks import this_rank
    from ..sharding import train_step

    rank = this_rank()
    device = device or compute_device(model)
    model.train()
    losses = []
    for step in range(steps):
        input_ids, labels = task.batch(batch_size, seed=seed + 100_003 * rank + step, seq_len=seq_len)
        batch = {"input_ids": input_ids.to(device), "labels": labels.to(device)}
        losses.append(train_step(model, optimizer, batch, scaler=scaler).item())
        if log_every and rank == 0 and (step % log_every == 0 or step == steps - 1):
            scale = f"  loss scale {scaler.get_scale():g}" if scaler is not None else ""
            print(f"step {step:4d}  loss {losses[-1]:.4f}{scale}", flush=True)
    return losses


def compute_device(model) -> torch.device:
    """Where `model` computes, so where its inputs go. A sharded model's parameters are DTensors on its mesh,
    and the mesh's device is where FSDP2 gathers them, even when CPUOffloadPolicy keeps the shards (and so
    `next(model.parameters()).device`) on the host; a plain model computes where its parameters are."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.device_type != "cpu":
        return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    return param.device


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
    ids = torch.tensor([tokenizer.prompt(text)], device=compute_device(model))
    for _ in range(max_new_tokens or len(text) + 1):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1).to(ids.device)], dim=1)
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

    from ..ranks import this_rank

    state = adapter_state_dict(model)
    path = None
    if this_rank() == 0:
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

    base = AutoModelForCausalLM.from_pretrained(str(base_path), **dtype_kwarg(dtype))
    with warnings.catch_warnings():
        # peft asks transformers for a property under its deprecated name while it loads the adapter
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


# --- torchrun entry point ------------------------------------------------------------------------------------

def parse_args(argv=None):
    import argparse

    from ..models import MODELS
    from ..settings import AUTO_PRECISION, PRECISIONS

    p = argparse.ArgumentParser(
        prog="python -m fsdplab.recipes.lora",
        description="LoRA fine-tuning under FSDP2 on every rank of a torchrun job (gloo on CPU, nccl on GPUs). "
                    "Trains on a synthetic string task; saves the adapter with peft.")
    p.add_argument("--model", default="tiny", choices=list(MODELS),
                   help="a registered model at real size (random init), or tiny: the miniature twin of Qwen-7B "
                        "with the task's vocabulary; ignored with --model-path")
    p.add_argument("--model-path", default=None, help="local directory of a transformers checkpoint (downloaded "
                   "weights), e.g. Qwen2-7B; Qwen-7B v1 checkpoints need --trust-remote-code and --lora-targets "
                   "with their module names (c_attn,c_proj,w1,w2)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-alpha", type=int, default=None, help="default: 2 x rank")
    p.add_argument("--lora-targets", default="all-linear",
                   help="all-linear, attention, or comma-separated module names")
    p.add_argument("--task", default="sort", choices=TASKS)
    p.add_argument("--seq-len", type=int, default=None, help="pad every sequence to this length (memory as in "
                                                             "real training); default: the task's length")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--precision", default=AUTO_PRECISION, choices=(AUTO_PRECISION,) + PRECISIONS,
                   help="compute dtype; auto: bf16 on GPUs with native bf16 (compute capability 8.0 on) and on "
                        "CPU ranks, else fp16 with a loss scaler (T4, V100); fp16 always trains with one")
    p.add_argument("--model-dtype", default=None, choices=PRECISIONS,
                   help="storage dtype of the frozen base (default fp32 = FSDP2's master copy)")
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-reshard-after-forward is SHARD_GRAD_OP")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPUOffloadPolicy (needs GPUs)")
    p.add_argument("--output-dir", default="lora-adapter", help="where rank 0 writes the peft adapter (on rank 0's "
                   "node only: across nodes without a shared filesystem, that is where it is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    if "," in args.lora_targets:
        args.lora_targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    return args


def main(argv=None) -> dict:
    import os
    import socket
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..lessons.precision import loss_scaler
    from ..runtime.hosts import gloo_interface_for_nodes
    from ..runtime.on_rank import rank_device
    from ..settings import AUTO_PRECISION, GIB, TrainSetting, resolve_precision
    from ..sharding import build_sharded, make_optimizer

    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if args.cpu_offload and not use_cuda:
        raise ValueError("--cpu-offload needs GPUs (FSDP2's CPUOffloadPolicy moves shards between host and GPU).")
    # One visible block of distributed setup: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*. The GPU
    # is this node's LOCAL_RANK-th (RANK counts across nodes), modulo the GPUs this process sees: where the
    # launcher binds one GPU per task (Slurm's --gpus-per-task), each rank sees only its own, as cuda:0.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = rank_device("nccl" if use_cuda else "gloo", local_rank)
    if interface := gloo_interface_for_nodes():
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        if local_rank == 0:
            print(f"{socket.gethostname()} resolves to a loopback address, which the other nodes cannot reach: "
                  f"gloo uses {interface} (set GLOO_SOCKET_IFNAME to choose another)", flush=True)
    # On GPUs, gloo too for collectives on CPU tensors: under --cpu-offload the gradient shards live on the host,
    # and the loss scaler's found-inf all-reduce over them would find no NCCL kernel for the CPU.
    # device_id binds NCCL's communicator to this GPU at once (else torch guesses it, warning, at each barrier).
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))
    precision = resolve_precision(args.precision, device)
    if rank == 0 and args.precision == AUTO_PRECISION:
        why = ("GPU without native bf16: fp16 with a loss scaler" if precision == "fp16"
               else "native bf16" if use_cuda else "CPU ranks")
        print(f"precision auto: {precision} ({why})", flush=True)

    try:
        task = StringTask(args.task)
        if args.model_path:
            from transformers import AutoConfig

            model = AutoConfig.from_pretrained(args.model_path, trust_remote_code=args.trust_remote_code)
        else:
            model = miniature_config(task.tokenizer) if args.model == "tiny" else args.model
        if rank == 0 and args.model != "tiny":
            print(f"{args.model_path or args.model}: the string task's character ids are used as token ids "
                  "(enough to measure memory and speed; bring your own data for a real fine-tune).", flush=True)
        # One setting for the run: the same object `fsdplab.memory.estimate` takes, so the estimate matches.
        setting = TrainSetting(model=model, world_size=world_size, precision=precision, lora_rank=args.lora_rank,
                               lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
                               seq_len=args.seq_len or task.seq_len, batch_size=args.batch_size,
                               base_dtype=args.model_dtype or "fp32",
                               activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
                               strategy="full_shard" if args.reshard_after_forward else "shard_grad_op")
        model = build_sharded(setting, mesh, model_path=args.model_path, device=device, seed=args.seed,
                              trust_remote_code=args.trust_remote_code)
        optimizer = make_optimizer(model, "adamw", lr=args.lr)
        # FSDP2's gradients are DTensors, so a plain GradScaler's inf check already agrees across ranks.
        scaler = loss_scaler(precision, device)
        if use_cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses = train_steps(model, optimizer, task, args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             seed=args.seed, log_every=args.log_every, device=device, scaler=scaler)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / GIB if use_cuda else None
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak)
        path = save_adapter(model, args.output_dir)
        result = {"rank": rank, "losses": losses, "seconds": seconds, "adapter": path, "peak_gib": peaks}
        if rank == 0:
            print(f"{args.steps} steps in {seconds:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
                  f"adapter saved to {path} on {socket.gethostname()}", flush=True)
            if use_cuda:
                print("peak memory allocated per rank (GiB): " + ", ".join(f"{p:.2f}" for p in peaks), flush=True)
        return result
    finally:
        # FSDP's hooks hold the model and its optimizer in reference cycles: freed here, while the group still
        # exists, not by Python's shutdown after destroy_process_group (lesson 11)
        model = optimizer = scaler = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
