"""CPU offload: what it moves, what it costs, and a step-time model to decide when it is worth it (lesson 03's
tables, figures and dashboard of these models are `fsdplab.lessons.cpu_offload`'s).

FSDP2's `CPUOffloadPolicy` (FSDP1: `CPUOffload(offload_params=True)`) keeps each rank's *sharded*
parameters, their gradients and the optimizer state in (pinned) host memory. Every all-gather first
copies the rank's fp32 shard host-to-device, then casts and gathers it on the GPU; every reduce-scatter
copies the rank's gradient shard device-to-host; and because the parameters live on the CPU, the
optimizer step runs on the CPU. What stays on the GPU: the gathered (unsharded) units in flight, their
gradients before the reduce-scatter, the activations and the communication buffers.

Bandwidth figures (vendor specifications, per direction, theoretical peak):

- PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s ("~32 GB/s"); PCIe 5.0 x16: 63 GB/s
  ("~64 GB/s"). The figures are `fsdplab.network.PRESETS`' (one definition for the lab). Pinned-memory copies
  reach only part of the peak; `step_time` assumes 80%.
- GPU memory bandwidth: NVIDIA A10 600 GB/s (GDDR6, 24 GB; PCIe 4.0 card); A100 80GB SXM ~2 TB/s
  (2,039 GB/s HBM2e; PCIe 4.0 host link); H100 SXM 3.35 TB/s (HBM3; PCIe 5.0 host link).
- Dense bf16 tensor-core peak: A10 125 TFLOP/s, A100 312 TFLOP/s, H100 SXM 989 TFLOP/s (the data sheets'
  larger numbers assume 2:4 sparsity).
- The host CPU (lesson 03's defaults for `rank_adamw_seconds_per_param`): an 8-GPU A10 server such as AWS
  g5.48xlarge has 96 physical cores (192 vCPUs, two AMD EPYC sockets), 12 per GPU; two sockets of 8
  DDR4-3200 channels give 2 x 8 x 25.6 = 410 GB/s of memory bandwidth, shared by the 8 ranks' optimizer steps.

So the host link is ~1/19 of an A10's memory bandwidth, ~1/64 of an A100's and ~1/53 of an H100's (PCIe 5),
not "1/10". Reported end-to-end slowdowns of FSDP CPU offload with AdamW are 3-10x, not 30%, and the
profile there shows the CPU optimizer step, not the device-to-host copies, as the cause (pytorch/pytorch#74588).

FSDP has no NVMe tier: offloading optimizer state or parameters to NVMe is DeepSpeed ZeRO-Infinity.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from ..network import get_link
from ..settings import GIB
from .posts import usable_gib

# Host links by the short name a GPU's `host_link` uses; the bandwidths are network.PRESETS' (per direction).
PCIE_BYTES_PER_S = {name: get_link(name).bytes_per_s for name in ("PCIe 4.0 x16", "PCIe 5.0 x16")}


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float          # usable device memory
    memory_bytes_per_s: float  # HBM / GDDR bandwidth
    bf16_flops: float          # dense tensor-core peak
    host_link: str             # key of PCIE_BYTES_PER_S

    @property
    def host_bytes_per_s(self) -> float:
        return PCIE_BYTES_PER_S[self.host_link]


GPUS = {
    # usable memory as nvidia-smi reports it: an A10 shows 23,028 MiB, not the data sheet's 24 GB
    "A10": GPU("A10", 23_028 / 1024, 600e9, 125e12, "PCIe 4.0 x16"),
    "A100-80GB": GPU("A100-80GB", 80, 2.039e12, 312e12, "PCIe 4.0 x16"),   # SXM; the PCIe card has 1,935 GB/s
    "H100-SXM": GPU("H100-SXM", 80, 3.35e12, 989e12, "PCIe 5.0 x16"),
}


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: use one of {list(GPUS)}.")
    return GPUS[name]


def bandwidth_ratio(gpu_name: str, link: str | None = None) -> float:
    """GPU memory bandwidth / host-link bandwidth (how many times slower the link is)."""
    g = gpu(gpu_name)
    return g.memory_bytes_per_s / PCIE_BYTES_PER_S[link or g.host_link]


# --- what moves ------------------------------------------------------------------------------------

def transfer_bytes_per_step(num_params: int, world_size: int, *, reshard_after_forward: bool = True,
                            master_bytes: int = 4, grad_bytes: int = 4) -> dict:
    """Host<->device bytes one rank moves per optimizer step under CPU offload.

    FSDP2 copies the fp32 shard host-to-device before *each* all-gather (forward, and again in backward when
    units are resharded after forward) and casts to the compute dtype on the GPU; the reduced gradient shard
    goes device-to-host once.
    """
    if world_size < 1 or num_params < 1:
        raise ValueError("num_params and world_size must be >= 1.")
    shard = math.ceil(num_params / world_size)
    gathers = 2 if reshard_after_forward else 1
    return {"h2d": gathers * shard * master_bytes, "d2h": shard * grad_bytes}


def ledger(model="qwen-7b", world_size: int = 8, *, cpu_offload: bool = False, lora_rank: int | None = None,
           seq_len: int = 2048, batch_size: int = 1, precision: str = "bf16",
           activation_checkpointing: bool = True) -> dict:
    """Per-rank bytes on the GPU and on the host, by category, for FSDP2 FULL_SHARD + AdamW
    (`fsdplab.memory.formula`). Offload moves the resident shards (fp32 parameters, gradients, optimizer
    state) to the host; the gathered units in flight, their gradients, activations and buffers stay.

    `model`: a name of `fsdplab.models.MODELS`, a transformers config, or a parameter count such as 13e9
    (a Llama-like shape is derived: see `llama_like`).
    """
    from ..memory.formula import formula

    if isinstance(model, (int, float)):
        model = llama_like(model)
    report = formula(model=model, world_size=world_size, strategy="full_shard", precision=precision,
                     lora_rank=lora_rank, seq_len=seq_len, batch_size=batch_size,
                     activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload)
    cpu = {k: (report.resident.get(k, 0) if cpu_offload else 0) for k in report.by_category}
    return {"gpu": dict(report.by_category), "cpu": cpu, "gpu_total": report.peak_bytes,
            "cpu_total": sum(cpu.values()), "total_params": report.detail["total_params"],
            "trainable_params": report.detail["trainable_params"], "report": report}


def llama_like(num_params: float):
    """A Llama-like transformers config (named e.g. "13B") with about `num_params` parameters: SwiGLU blocks
    of 12*h^2 parameters, L = h/128 layers, 128-wide heads, no GQA, untied embeddings, vocab 32000. A config
    rather than a `ModelSpec`: it is what a TrainSetting (and so the formula) takes as a model."""
    from transformers import LlamaConfig

    if num_params < 1e7:
        raise ValueError(f"num_params={num_params:g} is too small for this shape rule; use at least 1e7.")
    hidden = max(256, int(round((num_params * 128 / 12) ** (1 / 3) / 128)) * 128)
    num_layers = max(2, int(round((num_params - 2 * 32000 * hidden) / (12 * hidden ** 2))))
    heads = hidden // 128
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=int(round(8 * hidden / 3)), vocab_size=32000,
                       use_cache=False, name_or_path=f"{num_params / 1e9:g}B")


# --- what it costs ---------------------------------------------------------------------------------

def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def time_adamw_step(num_params: int = 20_000_000, repeats: int = 3, chunk: int = 4_000_000, seed: int = 0,
                    threads: int | None = None, fused: bool | None = None) -> dict:
    """Time a real torch.optim.AdamW step on this process's CPU over `num_params` fp32 parameters.

    Parameters come in `chunk`-sized tensors (like a rank's shards). `threads`: torch's intra-op threads for
    the timing (restored afterwards; None keeps the current setting). `fused`: AdamW's fused CPU kernel (one
    pass over memory) instead of the default per-op loop. The first step (which allocates the state) is not
    timed; the result is the median of `repeats` steps, on the wall clock ("seconds") and in CPU time of this
    process, all threads ("cpu_seconds": on one thread, the time the step kept a core busy, which other
    processes on a shared machine do not inflate). Returns both, per parameter too, and the threads.
    """
    import torch

    if num_params < 1 or repeats < 1:
        raise ValueError("num_params and repeats must be >= 1.")
    chunk = min(chunk, num_params)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(seed)
        sizes = [chunk] * (num_params // chunk) + ([num_params % chunk] if num_params % chunk else [])
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
        opt.step()
        times, cpu_times = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    seconds, cpu_seconds = statistics.median(times), statistics.median(cpu_times)
    return {"num_params": num_params, "seconds": seconds, "seconds_per_param": seconds / num_params,
            "cpu_seconds": cpu_seconds, "cpu_seconds_per_param": cpu_seconds / num_params,
            "threads": used, "fused": bool(fused)}


# Bytes AdamW reads and writes per fp32 parameter in one pass (a fused kernel): parameter, gradient and the
# two moments read, parameter and moments written, 4 x 4 + 3 x 4.
ADAMW_BYTES_PER_PARAM = 28
# torch's default AdamW on CPU tensors (the single-tensor loop) makes one pass per op, 4 bytes per element
# read or written: param.mul_ 8, exp_avg.lerp_ 12, exp_avg_sq.mul_ 8 and .addcmul_ 12, denom = sqrt 8,
# / 8, .add_ 8, param.addcdiv_ 16.
ADAMW_FOR_LOOP_BYTES_PER_PARAM = 80


def rank_adamw_seconds_per_param(one_thread_seconds_per_param: float, cores_per_rank: int,
                                 host_memory_bytes_per_s: float, ranks_per_host: int,
                                 bytes_per_param: int = ADAMW_BYTES_PER_PARAM) -> dict:
    """CPU AdamW seconds per parameter on one rank of a host, extrapolated from a one-thread measurement.

    Threads: `cores_per_rank` threads are assumed to split the work perfectly (an optimistic bound: measured
    scaling is lower). Memory: the step cannot beat `bytes_per_param` (ADAMW_BYTES_PER_PARAM for a fused
    step, ADAMW_FOR_LOOP_BYTES_PER_PARAM for torch's default on CPU) at the rank's share of the host's memory
    bandwidth, `host_memory_bytes_per_s / ranks_per_host` (all ranks step at once). The result is the larger
    of the two, so it is a lower bound on the real time.
    """
    if min(one_thread_seconds_per_param, cores_per_rank, host_memory_bytes_per_s, ranks_per_host, bytes_per_param) <= 0:
        raise ValueError("the measured time, cores_per_rank, host memory bandwidth and ranks_per_host must be > 0.")
    threads = one_thread_seconds_per_param / cores_per_rank
    memory = bytes_per_param * ranks_per_host / host_memory_bytes_per_s
    return {"threads_bound": threads, "memory_bound": memory, "seconds_per_param": max(threads, memory),
            "limited_by": "memory bandwidth" if memory > threads else "cores"}


def measure_host_bandwidth(megabytes: int = 256, repeats: int = 5) -> dict | None:
    """Pinned host<->device copy bandwidth on this process's current GPU: the lab's one measurement of the
    host link (lesson 03 and the GPU checks both call it, so they cannot disagree).

    megabytes: size of each copy in MiB (a float32 buffer of megabytes * 2**20 bytes); repeats: timed copies
    per direction, after one untimed warm-up copy. Each direction is timed on the wall clock from a
    synchronised device to a synchronised device, copies `non_blocking` from / to pinned host memory
    (how FSDP's CPUOffloadPolicy copies).

    Returns {"h2d": bytes/s host-to-device, "d2h": bytes/s device-to-host} (decimal: divide by 1e9 for
    GB/s, the unit of the PCIe figures), or None when CUDA is not available.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", torch.cuda.current_device())
    n = megabytes * 2 ** 20 // 4
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    device_buf = torch.empty(n, dtype=torch.float32, device=dev)
    out = {}
    for name, copy in (("h2d", lambda: device_buf.copy_(host, non_blocking=True)),
                       ("d2h", lambda: host.copy_(device_buf, non_blocking=True))):
        copy()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            copy()
        torch.cuda.synchronize(dev)
        out[name] = repeats * n * 4 / (time.perf_counter() - t0)
    return out


def step_time(num_params: float, world_size: int, gpu_name: str = "A10", *, cpu_offload: bool = False,
              cpu_adam_seconds_per_param: float = 3e-9, tokens_per_rank: int = 2048, mfu: float = 0.4,
              trainable_params: float | None = None, activation_checkpointing: bool = True,
              link_efficiency: float = 0.8) -> dict:
    """Modelled seconds of one training step on one rank, by part.

    compute: FLOPs at `mfu` of the GPU's dense bf16 peak: 2P per token forward, 4P backward (2P when only
        adapters train: no weight gradients for frozen weights), +2P recompute with activation checkpointing.
    optimizer: on the GPU, AdamW reads and writes ~28 bytes per trainable parameter of the shard at memory
        bandwidth; with offload it runs on the CPU at `cpu_adam_seconds_per_param` (`time_adamw_step`).
    transfer (offload only): `transfer_bytes_per_step` over the host link at `link_efficiency` of its peak,
        counted in full; `total_overlapped` assumes the copies hide behind compute as far as they can.
    The collectives (all-gather, reduce-scatter) are the same with and without offload and are left out.
    """
    g = gpu(gpu_name)
    trainable = num_params if trainable_params is None else trainable_params
    lora = trainable < num_params
    flops_per_token = (2 + (2 if lora else 4) + (2 if activation_checkpointing else 0)) * num_params
    compute = flops_per_token * tokens_per_rank / (g.bf16_flops * mfu)
    shard = trainable / world_size
    if cpu_offload:
        moved = transfer_bytes_per_step(int(num_params), world_size)
        transfer = (moved["h2d"] + moved["d2h"]) / (g.host_bytes_per_s * link_efficiency)
        optimizer = shard * cpu_adam_seconds_per_param
    else:
        transfer, optimizer = 0.0, ADAMW_BYTES_PER_PARAM * shard / g.memory_bytes_per_s
    return {"compute": compute, "transfer": transfer, "optimizer": optimizer,
            "total": compute + transfer + optimizer,
            "total_overlapped": compute + max(0.0, transfer - compute) + optimizer}


# --- which option fits (lesson 03's dashboard draws it) -------------------------------------------

OPTIONS = ("nothing", "offload", "more GPUs", "LoRA")


def plan(gpu_mem_gib: float, num_params: float, world_size: int, gpu_name: str = "A10", *,
         cpu_adam_seconds_per_param: float = 3e-9, lora_rank: int = 64, seq_len: int = 2048,
         max_world_size: int = 1024) -> dict:
    """For each of OPTIONS: per-rank GPU bytes (formula, bf16, activation checkpointing), whether it fits in
    `usable_gib(gpu_mem_gib)` (the card less the lessons' reserve), and the modelled step time (`step_time`, per
    rank, same per-rank batch).

    'nothing': full fine-tune, FSDP2 FULL_SHARD on `world_size` GPUs. 'offload': the same with
    CPUOffloadPolicy. 'more GPUs': the smallest power-of-two world size (<= max_world_size) at which the
    full fine-tune fits without offload (None if none does). 'LoRA': rank-`lora_rank` adapters on all linear
    layers, `world_size` GPUs.
    """
    if gpu_mem_gib <= 0 or num_params <= 0 or world_size < 1:
        raise ValueError("gpu_mem_gib, num_params and world_size must be positive.")
    from ..memory.formula import spec_of

    budget = usable_gib(gpu_mem_gib) * GIB
    spec = llama_like(num_params)
    params = spec_of(spec).total_params()
    kw = dict(cpu_adam_seconds_per_param=cpu_adam_seconds_per_param, tokens_per_rank=seq_len)
    rows = {}
    full = ledger(spec, world_size, seq_len=seq_len)
    rows["nothing"] = dict(world_size=world_size, gpu_bytes=full["gpu_total"],
                           step=step_time(params, world_size, gpu_name, **kw))
    off = ledger(spec, world_size, cpu_offload=True, seq_len=seq_len)
    rows["offload"] = dict(world_size=world_size, gpu_bytes=off["gpu_total"], cpu_bytes=off["cpu_total"],
                           step=step_time(params, world_size, gpu_name, cpu_offload=True, **kw))
    n = world_size
    while n < max_world_size and ledger(spec, n, seq_len=seq_len)["gpu_total"] > budget:
        n *= 2
    more = ledger(spec, n, seq_len=seq_len)
    rows["more GPUs"] = dict(world_size=n if more["gpu_total"] <= budget else None, gpu_bytes=more["gpu_total"],
                             step=step_time(params, n, gpu_name, **kw))
    lora = ledger(spec, world_size, lora_rank=lora_rank, seq_len=seq_len)
    rows["LoRA"] = dict(world_size=world_size, gpu_bytes=lora["gpu_total"],
                        step=step_time(params, world_size, gpu_name, trainable_params=lora["trainable_params"],
                                       **kw))
    for row in rows.values():
        row["fits"] = row["gpu_bytes"] <= budget
    return rows



# --- a real offload run (GPU only) -----------------------------------------------------------------

def offload_attempt_on_rank(cfg=None) -> str:
    """Try FSDP2 + CPUOffloadPolicy for one forward/backward on this rank: 'ok', or the error torch raises
    (on a CPU rank: apply_fsdp's policy pins host memory, and pinning needs an accelerator)."""
    from ..ranks import device, mesh
    from ..models import random_batch
    from ..sharding import apply_fsdp, build_tiny, loss_of

    try:
        model = apply_fsdp(build_tiny(cfg, device=device()), mesh(), cpu_offload=True)
        loss_of(model, random_batch(model.cfg, 2, device=device())).backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the error itself is what the lesson shows
        return f"{type(e).__name__}: {e}"


def _seconds_per_step(model, opt, cfg, steps: int, dev, scaler=None) -> float:
    """Median seconds of `steps` training steps (batches of 8) on GPU `dev`, after one untimed warm-up step;
    each step timed from a synchronised device to a synchronised device; fp16 steps through `scaler`."""
    import torch

    from ..models import random_batch
    from ..sharding import train_step

    times = []
    for step in range(steps + 1):
        batch = random_batch(cfg, 8, seed=step, device=dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        train_step(model, opt, batch, scaler=scaler)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def offload_run(cfg=None, steps: int = 5, cpu_offload: bool = True, seed: int = 0, precision: str = "auto") -> dict:
    """On a rank with a GPU: train the tiny transformer under FSDP2 with/without CPUOffloadPolicy.

    precision "auto" is bf16 on GPUs with native bf16, else fp16 with a GradScaler (a T4's emulated bf16 would
    time the emulation, not the offload). Returns seconds per step (median after one warm-up step), peak GPU
    bytes, where the sharded parameters and the optimizer state live, and the precision. Raises ValueError on
    a CPU rank (no GPU memory to offload from, and no GPU step to time).
    """
    import torch

    from .precision import loss_scaler
    from ..ranks import device, mesh
    from ..settings import resolve_precision
    from ..sharding import apply_fsdp, build_tiny

    dev = device()
    if dev.type != "cuda":
        raise ValueError("offload_run needs a GPU rank: CPUOffloadPolicy moves state from the GPU to the host.")
    precision = resolve_precision(precision, dev)
    model = build_tiny(cfg, seed=seed, device=dev)
    cfg = model.cfg
    apply_fsdp(model, mesh(), precision=precision, cpu_offload=cpu_offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.cuda.reset_peak_memory_stats(dev)
    seconds = _seconds_per_step(model, opt, cfg, steps, dev, scaler=loss_scaler(precision, dev))
    p = next(iter(model.parameters()))
    state = opt.state[p]
    return {"cpu_offload": cpu_offload, "seconds_per_step": seconds, "precision": precision,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev), "param_device": str(p.to_local().device),
            "optimizer_state_device": str(state["exp_avg"].to_local().device
                                          if hasattr(state["exp_avg"], "to_local") else state["exp_avg"].device)}


def fsdp1_offload_run(cfg=None, steps: int = 5, seed: int = 0, precision: str = "auto") -> dict:
    """On a GPU rank: the posts' FSDP1 setup, `FSDP(model, cpu_offload=CPUOffload(offload_params=True))`,
    wrapped per block; compute in `precision` ("auto" as in `offload_run`; fp16 through ShardedGradScaler,
    since FSDP1's flat shards are plain tensors). Returns seconds per step and where the flat parameters live."""
    import torch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    from .precision import loss_scaler
    from ..ranks import device
    from ..settings import resolve_precision, torch_dtype
    from ..sharding import apply_fsdp1, build_tiny

    dev = device()
    if dev.type != "cuda":
        raise ValueError("fsdp1_offload_run needs a GPU rank: FSDP1 refuses CPU ranks and offloads from a GPU.")
    precision = resolve_precision(precision, dev)
    mixed = (None if precision == "fp32" else
             MixedPrecision(param_dtype=torch_dtype(precision), reduce_dtype=torch.float32))
    # With offload_params=True FSDP1 keeps the sharded parameters on the CPU, so the model starts there.
    model = apply_fsdp1(build_tiny(cfg, seed=seed, device="cpu"), dev, cpu_offload=CPUOffload(offload_params=True),
                        mixed_precision=mixed)
    cfg = model.module.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # train_step's loss_of calls the FSDP1 wrapper's forward, as the posts' code does
    seconds = _seconds_per_step(model, opt, cfg, steps, dev, scaler=loss_scaler(precision, dev, sharded=True))
    return {"seconds_per_step": seconds, "param_device": str(next(model.parameters()).device),
            "precision": precision}
