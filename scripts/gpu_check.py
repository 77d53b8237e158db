"""One run that checks fsdplab on a GPU machine, and falls back cleanly (printed SKIP reasons) without one.

    python scripts/gpu_check.py --out runs/gpu_check            (or: bash scripts/gpu_check.sh [OUT])

Sections, run in this order, each in its own Python process with its own time budget, so that a crash,
a hang or a CUDA error in one does not stop the others:

    env       torch, CUDA, GPU name and memory, the notebook packages and the python3 kernel
    cluster   fsdplab.Cluster(1) (backend auto: nccl with a GPU) and an all-reduce on it
    fsdp1     the posts' FSDP1 code for real (world size 1 over nccl in this process): FULL_SHARD,
              SHARD_GRAD_OP, BackwardPrefetch PRE/POST, CPUOffload(offload_params=True),
              MixedPrecision bf16/fp16, FULL_STATE_DICT save; one training step each
    memory    fsdplab.memory.estimate(...) against torch.cuda.max_memory_allocated for the tiny Qwen2 and
              a 1.0B Qwen2: full fine-tune and LoRA, with and without activation checkpointing
    offload   host<->device bandwidth (pinned and pageable) and an FSDP2 CPUOffloadPolicy step against
              no offload on the 1.0B model
    lessons   every lesson notebook through `python -m fsdplab.cli run` (papermill)

Each section prints PASS, FAIL or SKIP with a reason; results go to OUT/gpu_check.json (rewritten after
every section) and the whole output to OUT/gpu_check.log. The exit code is 1 if any section FAILED
(SKIP is fine), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("env", "cluster", "fsdp1", "memory", "offload", "lessons")
# Seconds each section may take at most (the lessons get whatever the total budget leaves).
SECTION_BUDGET_S = {"env": 40, "cluster": 60, "fsdp1": 75, "memory": 150, "offload": 120, "lessons": 10_000}
GIB, MIB = 2 ** 30, 2 ** 20
NOTEBOOK_MODULES = ("papermill", "nbclient", "nbformat", "jupyter_client", "ipykernel", "IPython", "ipyparallel",
                    "cloudpickle", "zmq", "tornado", "ipywidgets", "matplotlib")
PACKAGES = ("torch", "transformers", "peft", "accelerate", "numpy", "matplotlib", "papermill", "nbclient",
            "nbformat", "jupyter_client", "ipykernel", "ipython", "ipyparallel", "cloudpickle", "pyzmq",
            "tornado", "ipywidgets", "psutil")
# Lessons whose code assumes at least two ranks (a per-rank comparison, a ring factor (N-1)/N, a rank
# that dies while another waits): they keep their own world_size, on CPU ranks (gloo) when there are
# fewer GPUs than ranks. Every other lesson runs at --lesson-world-size (1: one rank on the one GPU,
# so that the lesson's GPU-only cells run).
LESSON_KEEPS_WORLD_SIZE = {
    "00": "expects a hang and a crash while other ranks wait",
    "02": "divides by the ring factor (N-1)/N",
    "04": "compares two ranks' gradient scalers",
    "05": "kills one rank while the other waits",
    "06": "compares two ranks' measured peaks",
    "07": "two ranks per node over two nodes",
}
# Memory comparison: a ~1.0B Qwen2 (check: 1,003,653,120 parameters) next to the tiny Qwen2.
ONE_B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
             intermediate_size=6144, vocab_size=32000, max_position_embeddings=4096)
MEMORY_SHAPES = {"tiny": dict(seq_len=256, batch_size=2), "1b": dict(seq_len=2048, batch_size=1)}
MEMORY_TOLERANCE = 0.05          # |measured / estimate - 1| for the 1.0B cases
LORA_RANK, LORA_ALPHA = 64, 128  # the posts' LoRA rank


# --- small helpers ------------------------------------------------------------------------------------------

def say(*parts) -> None:
    print(*parts, flush=True)


_RESULT_PATH = None   # set in a section's process: where its result goes
_CHILDREN: set = set()  # process groups this process started and has not reaped yet
_START = time.monotonic()  # when this process started: a section's budget counts from here


def kill_group(pid: int, sig=signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def on_sigterm(signum, frame):
    """Take the process groups this process started down with it (they run in sessions of their own)."""
    for pid in list(_CHILDREN):
        kill_group(pid, signal.SIGTERM)
    time.sleep(2)
    for pid in list(_CHILDREN):
        kill_group(pid)
    os._exit(128 + signum)


def save_partial(details: dict, note: str) -> None:
    """Write what a section has measured so far: if it is killed at its budget, this much survives."""
    if _RESULT_PATH:
        Path(_RESULT_PATH).write_text(json.dumps({"status": "FAIL", "reason": note, "details": details,
                                                  "partial": True}, default=str))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(backend: str):
    """A one-rank process group in this process (FSDP1 and FSDP2 need one even at world size 1)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def no_gpu_reason(what: str) -> str:
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" and torch.version.cuda:
        return f"{what}; GPUs hidden (--cpu)"
    build = f"torch {torch.__version__} is a CPU build" if not torch.version.cuda else "no CUDA device is visible"
    return f"{what}; {build}"


def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def release_cuda() -> None:
    import torch

    gc.collect()
    if cuda_ok():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- env ------------------------------------------------------------------------------------------------------

def section_env(args, budget):
    import importlib.metadata as md
    import importlib.util
    import platform

    import torch

    info = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "gpus": []}
    try:
        import psutil

        info["host_memory_gib"] = round(psutil.virtual_memory().total / GIB, 1)
    except ImportError:
        pass
    if cuda_ok():
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as e:  # a torch built without NCCL
            info["nccl"] = f"unknown ({type(e).__name__})"
        info["cudnn"] = torch.backends.cudnn.version()
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info["gpus"].append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                                 "memory_gib": round(total / GIB, 2), "free_gib": round(free / GIB, 2),
                                 "multiprocessors": props.multi_processor_count})
    if shutil.which("nvidia-smi"):
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["nvidia_smi"] = f"failed: {e}"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    info["missing_modules"] = [m for m in NOTEBOOK_MODULES if importlib.util.find_spec(m) is None]
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        info["python3_kernel"] = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except Exception as e:  # no jupyter_client, or no kernel spec named python3
        info["python3_kernel"] = None
        info["python3_kernel_error"] = f"{type(e).__name__}: {e}"

    say(f"python {info['python']} ({sys.executable}), {info['cpus']} CPUs, "
        f"{info.get('host_memory_gib', '?')} GiB host memory")
    say(f"torch {info['torch']}, built for CUDA {info['torch_cuda']}, cuda available: {info['cuda_available']}"
        + (f", NCCL {info['nccl']}, cuDNN {info['cudnn']}" if info["gpus"] else ""))
    for g in info["gpus"]:
        say(f"GPU {g['index']}: {g['name']} (sm {g['capability']}, {g['multiprocessors']} SMs), "
            f"{g['memory_gib']:.1f} GiB, {g['free_gib']:.1f} GiB free")
    if "nvidia_smi" in info:
        say(f"nvidia-smi: {info['nvidia_smi']}")
    say("packages: " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in versions.items()))
    say(f"python3 kernel: {info['python3_kernel'] or 'MISSING (' + info.get('python3_kernel_error', '') + ')'}")

    if info["gpus"]:
        g = info["gpus"][0]
        reason = (f"torch {info['torch']}, CUDA {info['torch_cuda']}, {len(info['gpus'])} x {g['name']} "
                  f"{g['memory_gib']:.0f} GiB")
    else:
        reason = no_gpu_reason(f"torch {info['torch']}, no GPU: the GPU sections will SKIP")
    if info["missing_modules"]:
        reason += f"; missing for the lessons: {', '.join(info['missing_modules'])}"
    return "PASS", reason, info


# --- cluster --------------------------------------------------------------------------------------------------

def all_reduce_on_rank():
    """Runs on each rank: sum rank+1 over the group on the rank's device."""
    import torch
    import torch.distributed as dist

    import fsdplab

    x = torch.full((1024,), float(fsdplab.rank() + 1), device=fsdplab.device())
    dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    n = fsdplab.world_size()
    return {"rank": fsdplab.rank(), "device": str(x.device), "backend": dist.get_backend(),
            "value": x[0].item(), "expected": n * (n + 1) / 2}


def section_cluster(args, budget):
    import fsdplab

    t0 = time.perf_counter()
    with fsdplab.Cluster(1) as cluster:
        start_s = time.perf_counter() - t0
        out = cluster.run(all_reduce_on_rank, timeout=max(10.0, budget / 2))
        backend = cluster.backend
    r = out[0]
    details = {"backend": backend, "start_s": round(start_s, 2), "rank0": r}
    say(f"Cluster(1): backend {backend}, started in {start_s:.1f} s; rank 0 on {r['device']} "
        f"({r['backend']}): all_reduce -> {r['value']} (expected {r['expected']})")
    if r["value"] != r["expected"]:
        return "FAIL", f"all_reduce gave {r['value']}, expected {r['expected']}", details
    if cuda_ok() and backend != "nccl":
        return "FAIL", f"backend auto chose {backend} although a GPU is visible (expected nccl)", details
    where = "nccl on " + r["device"] if backend == "nccl" else "gloo on CPU (no GPU)"
    return "PASS", f"Cluster(1) on {where}: all_reduce correct, start {start_s:.1f} s", details


# --- fsdp1 ----------------------------------------------------------------------------------------------------

def fsdp1_cases():
    """(name, FSDP keyword arguments, how the step runs) for each of the posts' FSDP1 settings."""
    import torch
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    return [
        ("FULL_SHARD", dict(sharding_strategy=ShardingStrategy.FULL_SHARD), {}),
        ("SHARD_GRAD_OP", dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), {}),
        ("BACKWARD_PRE + forward_prefetch, limit_all_gathers",
         dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True, limit_all_gathers=True), {}),
        ("BACKWARD_POST", dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST), {}),
        ("CPUOffload(offload_params=True)", dict(cpu_offload=CPUOffload(offload_params=True)), {"offload": True}),
        ("MixedPrecision(param_dtype=bfloat16)",
         dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                             buffer_dtype=torch.bfloat16)), {"dtype": torch.bfloat16}),
        ("MixedPrecision(param_dtype=float16) + ShardedGradScaler",
         dict(mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                             buffer_dtype=torch.float16)), {"dtype": torch.float16, "scaler": True}),
        ("size_based_auto_wrap_policy via functools.partial", {}, {"size_wrap": True}),
    ]


def fsdp1_step(name, fsdp_kwargs, how, cfg, device):
    """Wrap the tiny transformer with FSDP1 per block, run one training step, check what the setting says."""
    import functools

    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    from fsdplab.models import Block, TinyTransformer, random_batch
    from fsdplab.parallel import backward_and_step

    torch.manual_seed(0)
    model = TinyTransformer(cfg)          # on the CPU: FSDP1 moves it to device_id (or keeps it there, offloaded)
    policy = (functools.partial(size_based_auto_wrap_policy, min_num_params=20_000) if how.get("size_wrap")
              else ModuleWrapPolicy({Block}))
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, **fsdp_kwargs)
    units = sum(isinstance(m, FSDP) for m in model.modules())
    seen = {}

    def record_dtypes(module, inputs):       # returns None: a pre-hook's return value would replace the inputs
        seen.setdefault("dtype", (str(module.weight.dtype), str(inputs[0].dtype)))

    hook = model.module.layers[0].mlp[0].register_forward_pre_hook(record_dtypes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = None
    if how.get("scaler"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(init_scale=2.0 ** 10)   # low: an overflow would skip the one step
    before = [p.detach().clone() for p in model.parameters()]
    tokens, targets = random_batch(cfg, 4, seed=1, device=device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
    backward_and_step(loss, opt, scaler)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    hook.remove()
    changed = any(not torch.equal(a, b.to(a.device)) for a, b in zip(before, model.parameters()))
    param_devices = sorted({p.device.type for p in model.parameters()})
    # At world size 1 FSDP1 turns every strategy into NO_SHARD (it warns): the API runs, nothing is sharded.
    row = {"case": name, "loss": loss.item(), "params_changed": changed, "fsdp_units": units,
           "effective_strategy": getattr(getattr(model, "sharding_strategy", None), "name", None),
           "param_devices": param_devices, "layer0_weight_and_input_dtype": seen.get("dtype"),
           "peak_mib": round(torch.cuda.max_memory_allocated() / MIB, 2) if on_gpu else None,
           "step_s": round(seconds, 4), "grad_scale": scaler.get_scale() if scaler is not None else None}
    problems = []
    if not math.isfinite(row["loss"]):
        problems.append(f"loss {row['loss']}")
    if not changed:
        problems.append("no parameter changed after the step")
    if units < 2:
        problems.append(f"only {units} FSDP unit(s): the wrap policy wrapped nothing")
    if how.get("offload") and param_devices != ["cpu"]:
        problems.append(f"offloaded parameters live on {param_devices}, expected cpu")
    if "dtype" in how:
        want = str(how["dtype"])
        if seen.get("dtype") != (want, want):
            problems.append(f"first block's Linear saw (weight, input) dtypes {seen.get('dtype')}, expected {want}")
    return model, row, problems


def fsdp1_full_state_dict(model, cfg, save_dir, device):
    """The posts' save: every rank calls state_dict() under FULL_STATE_DICT with offload_to_cpu and
    rank0_only; rank 0 saves. Checked by loading into a plain model and comparing outputs."""
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdplab.models import TinyTransformer, random_batch

    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    path = Path(save_dir) / "fsdp1_full_state_dict.pt"
    torch.save(state, path)
    plain = TinyTransformer(cfg)
    plain.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    tokens, _ = random_batch(cfg, 2, seed=5)
    with torch.no_grad():
        expected = plain(tokens)
        got = model(tokens.to(device)).float().cpu()
    devices = sorted({v.device.type for v in state.values()})
    row = {"case": "FULL_STATE_DICT save (offload_to_cpu, rank0_only)", "keys": len(state),
           "devices": devices, "file_mib": round(path.stat().st_size / MIB, 3),
           "max_abs_diff": (expected - got).abs().max().item()}
    problems = []
    if set(state) != set(plain.state_dict()):
        problems.append("keys differ from the unwrapped model's")
    if devices != ["cpu"]:
        problems.append(f"state dict tensors on {devices}, expected cpu (offload_to_cpu=True)")
    if row["max_abs_diff"] > 1e-4:
        problems.append(f"reloaded plain model differs from the FSDP model by {row['max_abs_diff']:.2e}")
    return row, problems


def section_fsdp1(args, budget):
    """On a GPU: the real check. Without one FSDP1 cannot train, so the section is a SKIP; the same code
    still runs with device_id=cpu forced (FSDP1 does not support that for training; it is a smoke test of
    this script), and a failure there is a FAIL."""
    import torch

    from fsdplab.models import TinyConfig

    gpu = cuda_ok()
    if gpu:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    cfg = TinyConfig(vocab_size=256, dim=128, num_layers=4, num_heads=4, seq_len=64)
    rows, failed = [], []
    with process_group("nccl" if gpu else "gloo"), tempfile.TemporaryDirectory() as tmp:
        last_full_shard = None
        for name, fsdp_kwargs, how in fsdp1_cases():
            if how.get("offload") and not gpu:
                rows.append({"case": name, "problems": [], "skipped": "CPUOffload needs an accelerator"})
                say(f"  SKIP {name}: needs an accelerator to offload from")
                continue
            try:
                model, row, problems = fsdp1_step(name, fsdp_kwargs, how, cfg, device)
                if name == "FULL_SHARD":
                    last_full_shard = model
                else:
                    del model
            except Exception as e:
                row, problems = {"case": name}, [f"{type(e).__name__}: {e}"]
                traceback.print_exc()
            row["problems"] = problems
            rows.append(row)
            peak = f", peak {row['peak_mib']:.1f} MiB" if row.get("peak_mib") is not None else ""
            say(f"  {'FAIL' if problems else 'PASS'} {name}: " + ("; ".join(problems) if problems else
                f"loss {row['loss']:.3f}, params changed, {row['fsdp_units']} FSDP units "
                f"({row['effective_strategy']}), parameters on "
                f"{'/'.join(row['param_devices'])}, layer-0 (weight, input) dtypes "
                f"{row['layer0_weight_and_input_dtype']}{peak}"))
            if problems:
                failed.append(name)
        name = "FULL_STATE_DICT save"
        try:
            if last_full_shard is None:
                raise RuntimeError("the FULL_SHARD case failed, nothing to save")
            row, problems = fsdp1_full_state_dict(last_full_shard, cfg, tmp, device)
        except Exception as e:
            row, problems = {"case": name}, [f"{type(e).__name__}: {e}"]
            traceback.print_exc()
        row["problems"] = problems
        rows.append(row)
        say(f"  {'FAIL' if problems else 'PASS'} {row['case']}: " + ("; ".join(problems) if problems else
            f"{row['keys']} tensors on cpu, {row['file_mib']:.2f} MiB file, reloaded into a plain model: "
            f"max |diff| {row['max_abs_diff']:.1e}"))
        if problems:
            failed.append(name)
    details = {"cases": rows, "device": str(device)}
    ran = sum(1 for r in rows if not r.get("skipped"))
    if failed:
        where = "" if gpu else " (CPU smoke test, device_id=cpu forced)"
        return "FAIL", f"{len(failed)}/{ran} FSDP1 case(s) failed{where}: {', '.join(failed)}", details
    if not gpu:
        details["smoke_test"] = "device_id=cpu forced"
        return "SKIP", no_gpu_reason("FSDP1 (FullyShardedDataParallel) needs a GPU: it refuses CPU devices "
                                     "('FSDP needs a non-CPU accelerator device')") + \
            f"; smoke test with device_id=cpu forced: {ran} case(s) ran one step", details
    return "PASS", f"all {ran} FSDP1 cases ran one step on {torch.cuda.get_device_name(0)}", details


# --- memory ---------------------------------------------------------------------------------------------------

def memory_config(name):
    from transformers import Qwen2Config

    from fsdplab.models import hf_config

    if name == "tiny":
        return hf_config("tiny")
    if name == "1b":
        return Qwen2Config(**ONE_B, tie_word_embeddings=False, rms_norm_eps=1e-6, use_cache=False)
    raise ValueError(f"unknown memory model {name!r}: use tiny or 1b.")


MEMORY_VARIANTS = {"full": (False, False), "full+ac": (False, True), "lora": (True, False), "lora+ac": (True, True)}


def memory_cases(models, variants=tuple(MEMORY_VARIANTS)):
    """(model, lora, activation checkpointing) for each model and variant."""
    return [(m, *MEMORY_VARIANTS[v]) for m in models for v in variants]


def case_label(model, lora, ac):
    return f"{model} {'LoRA r=' + str(LORA_RANK) if lora else 'full'}{' +AC' if ac else ''}"


def init_local_(model) -> None:
    """Random values in every local shard (the values do not change the memory, NaNs aside)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02)


def build_recipe_model(config, *, lora, ac, device, cpu_offload=False, precision="bf16"):
    """The estimator's recipe on real memory: meta build (LoRA, checkpointing), FSDP2 per block and root,
    to_empty on the device (the host for CPU offload), random values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdplab.recipes import lora as recipe

    mesh = init_device_mesh(device.type, (1,))
    model = recipe.build_model(config, lora_rank=LORA_RANK if lora else None, lora_alpha=LORA_ALPHA if lora else None,
                               target_modules="all-linear", activation_checkpointing=ac, device="meta")
    recipe.shard_model(model, mesh, precision=precision, reshard_after_forward=True, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    init_local_(model)
    fix = getattr(recipe, "_fix_nonpersistent_buffers", None)
    if fix is not None:
        fix(model, device)
    return model


def recipe_optimizer(model):
    """The estimator's optimizer (fsdplab.memory.make_optimizer: AdamW, foreach) when it exists."""
    from fsdplab import memory

    if hasattr(memory, "make_optimizer"):
        return memory.make_optimizer(model, "adamw")
    from fsdplab.recipes.lora import make_optimizer

    return make_optimizer(model)


def real_peak(config, shape, *, lora, ac, device):
    """Two training steps of the recipe; peak allocated bytes of step 2 over what was allocated before the
    model existed (the estimator's peak has no CUDA context, cuBLAS workspace or leftovers)."""
    import torch

    on_gpu = device.type == "cuda"
    release_cuda()
    base = torch.cuda.memory_allocated() if on_gpu else 0
    model = build_recipe_model(config, lora=lora, ac=ac, device=device)
    opt = recipe_optimizer(model)
    tokens = torch.randint(0, config.vocab_size, (shape["batch_size"], shape["seq_len"]), device=device)
    batch = {"input_ids": tokens, "labels": tokens}
    losses = []
    for step in range(2):
        if step == 1 and on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = None
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model, opt, batch, tokens
    release_cuda()
    return peak, losses, trainable, base


def warm_up_cuda(device) -> None:
    """Matrix products in bf16 and fp32 once, so cuBLAS's workspace exists before any baseline is taken."""
    import torch

    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    torch.cuda.synchronize()


def section_memory(args, budget):
    import torch

    from fsdplab import memory

    gpu = cuda_ok()
    # The 1.0B cases first: they are the ones held to 5%, and the ones to keep if time runs short.
    models = args.memory_models or (["1b", "tiny"] if gpu else ["tiny"])
    deadline = _START + budget - 5
    from fsdplab.models import causal_lm, count_params

    counts = {}
    for m in models:
        counts[m] = count_params(causal_lm(memory_config(m), device="meta"))
        say(f"{m}: {counts[m]:,} parameters" + (f" ({counts[m] / 1e9:.3f}B)" if counts[m] > 1e8 else ""))
    rows = []
    # 1) Estimates first: they run a fake process group in this process, which a real one would block.
    for m, lora, ac in memory_cases(models, args.memory_variants):
        shape = MEMORY_SHAPES[m]
        row = {"model": m, "params": counts[m], "lora": lora, "activation_checkpointing": ac, **shape,
               "label": case_label(m, lora, ac), "estimate_bytes": None, "measured_bytes": None, "ratio": None}
        rows.append(row)
        if time.monotonic() > deadline:
            row["error"] = "time budget spent before the estimate"
            continue
        t0 = time.perf_counter()
        try:
            report = memory.estimate(memory_config(m), 1, lora_rank=LORA_RANK if lora else None,
                                     lora_alpha=LORA_ALPHA if lora else None, lora_targets="all-linear",
                                     seq_len=shape["seq_len"], batch_size=shape["batch_size"], precision="bf16",
                                     activation_checkpointing=ac, reshard_after_forward=True, cpu_offload=False,
                                     progress=False)
            row["estimate_bytes"] = int(report.peak_bytes)
            row["estimate_by_category"] = {k: int(v) for k, v in report.by_category.items()}
            row["estimate_s"] = round(time.perf_counter() - t0, 2)
            say(f"  estimate {row['label']}: {gib(row['estimate_bytes'])} GiB ({row['estimate_s']:.1f} s)")
        except Exception as e:
            row["error"] = f"estimate: {type(e).__name__}: {e}"
            traceback.print_exc()
        save_partial({"cases": rows}, f"stopped after the estimate of {row['label']}")
    # 2) The same recipe for real: on the GPU; on CPU (gloo) only the tiny model, to run the code path.
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    with process_group("nccl" if gpu else "gloo"):
        if gpu:
            warm_up_cuda(device)
        for row in rows:
            if row.get("error") or (not gpu and row["model"] != "tiny"):
                continue
            if time.monotonic() > deadline:
                row["error"] = "time budget spent before the real run"
                continue
            t0 = time.perf_counter()
            try:
                peak, losses, trainable, base = real_peak(memory_config(row["model"]), MEMORY_SHAPES[row["model"]],
                                                    lora=row["lora"], ac=row["activation_checkpointing"],
                                                    device=device)
                row.update(measured_bytes=peak, losses=losses, trainable_params=trainable, base_bytes=base,
                           real_s=round(time.perf_counter() - t0, 2))
                if peak is not None and row["estimate_bytes"]:
                    row["ratio"] = peak / row["estimate_bytes"]
                if not all(math.isfinite(v) for v in losses):
                    row["error"] = f"non-finite loss {losses}"
            except Exception as e:
                row["error"] = f"real run: {type(e).__name__}: {e}"
                traceback.print_exc()
            save_partial({"cases": rows}, f"stopped after the real run of {row['label']}")
    # 3) The table.
    say(f"\n{'case':<22}{'params':>15}{'trainable':>15}{'seq x batch':>12}{'estimate GiB':>14}"
        f"{'measured GiB':>14}{'ratio':>8}  verdict")
    misses, errors = [], []
    for row in rows:
        if row.get("error"):
            verdict = "ERROR " + row["error"]
            errors.append(row["label"])
        elif row["ratio"] is None:
            verdict = "estimate only (no GPU)" if not gpu else "no ratio"
        elif abs(row["ratio"] - 1) <= MEMORY_TOLERANCE:
            verdict = "within 5%"
        elif row["model"] == "tiny":
            verdict = "MISS, not counted: a few-MiB model, where allocator rounding weighs"
        else:
            verdict = "MISS"
            misses.append(row["label"])
        row["verdict"] = verdict
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        say(f"{row['label']:<22}{row['params']:>15,}{row.get('trainable_params', 0):>15,}"
            f"{str(row['seq_len']) + ' x ' + str(row['batch_size']):>12}{gib(row['estimate_bytes']):>14}"
            f"{gib(row['measured_bytes']):>14}{ratio:>8}  {verdict}")
    details = {"cases": rows, "tolerance": MEMORY_TOLERANCE, "lora_rank": LORA_RANK, "precision": "bf16",
               "world_size": 1, "one_b_config": ONE_B}
    if errors:
        return "FAIL", f"{len(errors)} case(s) did not run: {', '.join(errors)}", details
    if misses:
        return "FAIL", f"estimate off by more than 5% for {', '.join(misses)}", details
    if not gpu:
        details["real_skipped"] = no_gpu_reason("torch.cuda.max_memory_allocated needs a GPU")
        return "PASS", (f"{len(rows)} estimates ran ({', '.join(models)}); the real-GPU column is skipped: "
                        + details["real_skipped"] + " (the recipe's code path ran on CPU for tiny)"), details
    worst = max(abs(r["ratio"] - 1) for r in rows if r["ratio"] is not None)
    return "PASS", f"{len(rows)} cases, every 1.0B case within 5% (worst |ratio - 1| overall {worst:.1%})", details


# --- offload --------------------------------------------------------------------------------------------------

def copy_bandwidth(nbytes: int, reps: int = 5) -> dict:
    """GB/s (1e9 bytes) of host->device and device->host copies, pinned and pageable, timed with CUDA events."""
    import torch

    device_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        host.fill_(1)
        for direction in ("h2d", "d2h"):
            src, dst = (host, device_buf) if direction == "h2d" else (device_buf, host)
            dst.copy_(src, non_blocking=(kind == "pinned"))       # warm-up
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src, non_blocking=(kind == "pinned"))
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            out[f"{direction}_{kind}_gb_s"] = round(reps * nbytes / seconds / 1e9, 2)
        del host
    return out


def offload_steps(config, *, cpu_offload, steps, device, seq_len, batch_size, deadline=math.inf):
    """FSDP2 full fine-tune (bf16 compute) with or without CPUOffloadPolicy; seconds of each step (fewer
    steps than asked if the next one would end past `deadline`, but at least two)."""
    import torch

    release_cuda()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_recipe_model(config, lora=False, ac=True, device=device, cpu_offload=cpu_offload)
    opt = recipe_optimizer(model)
    build_s = time.perf_counter() - t0
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device)
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if len(times) >= 2 and time.monotonic() + 1.5 * times[-1] > deadline:
            break
    param_device = sorted({(p.to_local() if hasattr(p, "to_local") else p).device.type for p in model.parameters()})
    state_devices = sorted({v.device.type for s in opt.state.values() for v in s.values()
                            if hasattr(v, "device") and v.dim() > 0})
    result = {"cpu_offload": cpu_offload, "step_s": [round(t, 3) for t in times], "losses": losses,
              "build_s": round(build_s, 2), "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
              "param_devices": param_device, "optimizer_state_devices": state_devices}
    del model, opt
    release_cuda()
    return result


def section_offload(args, budget):
    start = _START
    if not cuda_ok():
        return "SKIP", no_gpu_reason("host<->device bandwidth and FSDP2's CPUOffloadPolicy need a GPU (offload "
                                     "moves the shards between GPU memory and the host)"), {}
    import torch

    from fsdplab.models import count_params

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    details = {}
    bw = copy_bandwidth(args.copy_mib * MIB)
    details["bandwidth"] = {"bytes": args.copy_mib * MIB, **bw}
    say(f"copies of {args.copy_mib} MiB (GB/s = 1e9 B/s): host->device pinned {bw['h2d_pinned_gb_s']}, "
        f"pageable {bw['h2d_pageable_gb_s']}; device->host pinned {bw['d2h_pinned_gb_s']}, "
        f"pageable {bw['d2h_pageable_gb_s']}")
    problems = [f"{k} = {v}" for k, v in bw.items() if not v > 0]
    try:    # lesson 03's own measurement, for comparison
        from fsdplab.offload import measure_host_bandwidth

        lesson = measure_host_bandwidth(args.copy_mib)
        details["lesson03_measure_host_bandwidth_gb_s"] = {k: round(v / 1e9, 2) for k, v in lesson.items()}
        say(f"  fsdplab.offload.measure_host_bandwidth (pinned, wall clock): "
            + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in lesson.items()))
    except Exception as e:
        details["lesson03_measure_host_bandwidth_error"] = f"{type(e).__name__}: {e}"
    save_partial(details, "stopped after the bandwidth measurement")

    # The 1.0B model if the budget allows (CPU AdamW over 1B parameters takes seconds a step); else fewer layers.
    layers = ONE_B["num_hidden_layers"]
    left = budget - (time.monotonic() - start)
    if left < 100:
        layers = max(2, int(layers * max(0.1, (left - 20) / 100)))
    from transformers import Qwen2Config

    config = Qwen2Config(**{**ONE_B, "num_hidden_layers": layers}, tie_word_embeddings=False, rms_norm_eps=1e-6,
                         use_cache=False)
    from fsdplab.models import causal_lm

    params = count_params(causal_lm(config, device="meta"))
    details["model"] = {"layers": layers, "params": params, "seq_len": 2048, "batch_size": 1,
                        "recipe": "full fine-tune, bf16 compute, activation checkpointing, AdamW"}
    runs = {}
    with process_group("nccl"):
        for off in (False, True):
            try:
                runs[off] = offload_steps(config, cpu_offload=off, steps=args.offload_steps, device=device,
                                          seq_len=2048, batch_size=1, deadline=start + budget - 10)
                r = runs[off]
                say(f"  CPUOffloadPolicy={off}: steps {r['step_s']} s, peak GPU {r['peak_gpu_gib']:.2f} GiB, "
                    f"parameters on {r['param_devices']}, AdamW state on {r['optimizer_state_devices']}, "
                    f"build {r['build_s']:.1f} s")
                if not all(math.isfinite(v) for v in r["losses"]):
                    problems.append(f"offload={off}: non-finite loss {r['losses']}")
            except Exception as e:
                problems.append(f"offload={off}: {type(e).__name__}: {e}")
                traceback.print_exc()
            details["runs"] = {str(k): v for k, v in runs.items()}
            save_partial(details, f"stopped after the run with CPUOffloadPolicy={off}")
    details["runs"] = {str(k): v for k, v in runs.items()}
    if len(runs) == 2:
        # The first step also allocates the optimizer state: time the later ones.
        timed = {off: runs[off]["step_s"][1:] or runs[off]["step_s"] for off in runs}
        per_step = {off: sorted(t)[len(t) // 2] for off, t in timed.items()}
        details["seconds_per_step"] = {str(k): v for k, v in per_step.items()}
        details["slowdown"] = per_step[True] / per_step[False]
        say(f"  {params / 1e9:.2f}B params: {per_step[False]:.3f} s/step without offload, {per_step[True]:.3f} s "
            f"with CPUOffloadPolicy: {details['slowdown']:.1f}x (the posts: about 1.3x)")
        if runs[True]["param_devices"] != ["cpu"]:
            problems.append(f"offloaded parameters on {runs[True]['param_devices']}, expected cpu")
        if runs[True]["peak_gpu_gib"] >= runs[False]["peak_gpu_gib"]:
            problems.append("offload did not lower the peak GPU memory")
    if problems:
        return "FAIL", "; ".join(problems), details
    reason = (f"pinned h2d {bw['h2d_pinned_gb_s']} GB/s (pageable {bw['h2d_pageable_gb_s']}); "
              f"CPUOffloadPolicy {details['slowdown']:.1f}x slower per step on {params / 1e9:.2f}B params")
    return "PASS", reason, details


# --- lessons --------------------------------------------------------------------------------------------------

def lesson_plan(args):
    """(path, world size or None for the lesson's own, why) for each lesson asked for."""
    from fsdplab.cli import lesson_paths

    if args.lessons == "none":
        return []
    names = [] if args.lessons == "all" else [n for n in args.lessons.split(",") if n]
    plan = []
    for path in lesson_paths(names):
        keep = None if args.every_lesson_at_world_size else LESSON_KEEPS_WORLD_SIZE.get(path.stem[:2])
        if args.lesson_world_size == "default" or keep:
            why = f"its own world_size ({keep})" if keep else "its own world_size"
            plan.append((path, None, why))
        else:
            plan.append((path, int(args.lesson_world_size), f"world_size={args.lesson_world_size}"))
    return plan


def run_lesson(path, world_size, out_dir, params, timeout, log_dir):
    """One `python -m fsdplab.cli run` in its own process session (killed whole on timeout)."""
    cmd = [sys.executable, "-m", "fsdplab.cli", "run", str(Path(path).resolve()), "--out", str(out_dir),
           "--no-progress"]
    if world_size is not None:
        cmd += ["--world-size", str(world_size)]
    for name, value in params:
        cmd += ["-p", name, value]
    log_path = Path(log_dir) / f"{path.stem}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        _CHILDREN.add(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else "FAILED"
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            rc, status = None, "TIMEOUT"
        finally:
            _CHILDREN.discard(proc.pid)
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    detail = ""
    for line in text.splitlines():          # the cli's summary row: "stem  status  seconds  detail"
        fields = line[len(path.stem):].split(None, 2) if line.startswith(path.stem + " ") else []
        if len(fields) >= 2 and fields[0] in ("ok", "FAILED"):
            detail = fields[2] if len(fields) > 2 else ""
    if status == "TIMEOUT":
        detail = f"killed after {timeout:.0f} s"
    elif status == "FAILED" and not detail:
        detail = (text.strip().splitlines() or ["(no output)"])[-1][:300]
    return {"lesson": path.stem, "status": status, "seconds": round(seconds, 1), "detail": detail, "rc": rc,
            "world_size": world_size}


def section_lessons(args, budget):
    if args.lessons == "none":
        return "SKIP", "not asked for (--lessons none)", {}
    import importlib.util

    needed = ("papermill", "ipykernel", "ipyparallel", "cloudpickle")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        return "FAIL", (f"cannot execute notebooks: {', '.join(missing)} not importable (install the wheels in "
                        ".whl/ first, see scripts/gpu_check.sh)"), {}
    out_dir = Path(args.notebooks_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = lesson_plan(args)
    deadline = _START + budget - 10
    rows, lock = [], threading.Lock()
    say(f"{len(plan)} lesson(s), {args.lesson_jobs} at a time, each at most {args.lesson_timeout} s:")
    for path, ws, why in plan:
        say(f"  {path.stem}: {why}")

    def work(item):
        path, ws, why = item
        left = deadline - time.monotonic()
        if left < 20:
            row = {"lesson": path.stem, "status": "SKIPPED", "seconds": 0.0, "world_size": ws,
                   "detail": "time budget spent"}
        else:
            row = run_lesson(path, ws, out_dir, args.lesson_param, min(args.lesson_timeout, left), out_dir)
            if row["status"] == "TIMEOUT" and left < args.lesson_timeout:
                # Stopped by the total budget, not by its own limit: unfinished, not failed.
                row.update(status="CUT", detail=f"stopped at the total budget after {row['seconds']:.0f} s")
        with lock:
            rows.append(row)
            say(f"  [{path.stem}] {row['status']} in {row['seconds']:.0f} s {row['detail']}")
        return row

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, args.lesson_jobs)) as pool:
        list(pool.map(work, plan))
    rows.sort(key=lambda r: r["lesson"])
    width = max([6] + [len(r["lesson"]) for r in rows])
    table = [f"{'lesson':<{width}}  {'ranks':>5}  status   seconds  detail"]
    for r in rows:
        ranks = "own" if r["world_size"] is None else str(r["world_size"])
        table.append(f"{r['lesson']:<{width}}  {ranks:>5}  {r['status']:<7}  {r['seconds']:7.1f}  {r['detail']}")
    (out_dir / "summary.txt").write_text("\n".join(table) + "\n")
    say("\n" + "\n".join(table))
    details = {"lessons": rows, "out": str(out_dir)}
    bad = [r["lesson"] for r in rows if r["status"] in ("FAILED", "TIMEOUT")]
    skipped = [r["lesson"] for r in rows if r["status"] in ("SKIPPED", "CUT")]
    if bad:
        return "FAIL", f"{len(bad)}/{len(rows)} lesson(s) failed: {', '.join(bad)}", details
    if not rows:
        return "SKIP", "no lessons matched", details
    reason = f"{len(rows) - len(skipped)} lesson(s) ran clean"
    if skipped:
        reason += f"; not run or not finished within the total budget: {', '.join(skipped)}"
    return "PASS", reason, details


SECTION_FUNCS = {"env": section_env, "cluster": section_cluster, "fsdp1": section_fsdp1, "memory": section_memory,
                 "offload": section_offload, "lessons": section_lessons}


# --- orchestration --------------------------------------------------------------------------------------------

def run_child(args) -> int:
    """Run one section in this process and write its result as JSON."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)   # transformers' deprecation notes
    global _RESULT_PATH
    _RESULT_PATH = args.result
    t0 = time.perf_counter()
    try:
        status, reason, details = SECTION_FUNCS[args.child](args, args.child_budget)
    except Exception as e:
        traceback.print_exc()
        status, reason, details = "FAIL", f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()}
    result = {"status": status, "reason": reason, "seconds": round(time.perf_counter() - t0, 2), "details": details}
    Path(args.result).write_text(json.dumps(result, default=str))
    return 0


class Tee:
    """Lines to stdout and to the log file."""

    def __init__(self, path):
        self.log = open(path, "a", buffering=1)

    def __call__(self, line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()
        self.log.write(line)


def run_section_process(name, args, timeout, tee) -> dict:
    fd, result_path = tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, "--out", str(Path(args.out).resolve()),
           "--notebooks-dir", str(args.notebooks_dir), "--child", name, "--result", result_path,
           "--child-budget", str(int(timeout))]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    _CHILDREN.add(proc.pid)
    tail = []

    def pump():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-30]
            tee(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid, signal.SIGTERM)      # lets the section take its own children down
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
    kill_group(proc.pid)                          # anything the section left behind in its group
    _CHILDREN.discard(proc.pid)
    reader.join(timeout=5)
    seconds = round(time.perf_counter() - t0, 2)
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        result = None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result_path)
    if result is not None and (timed_out or result.get("partial")):
        why = (f"exceeded its budget of {timeout:.0f} s and was killed" if timed_out
               else f"its process exited with code {proc.returncode}")
        result = {"status": "FAIL", "reason": f"{why}; partial results kept ({result['reason']})",
                  "details": result.get("details", {})}
    if result is None:
        last = "".join(tail[-5:]).strip().replace("\n", " | ")[-400:]
        why = (f"exceeded its budget of {timeout:.0f} s and was killed" if timed_out
               else f"its process exited with code {proc.returncode} before reporting")
        result = {"status": "FAIL", "reason": f"{why}; last output: {last}", "details": {}}
    result["seconds"] = seconds
    result["budget_s"] = round(timeout)
    return result


def pack_outputs(out: Path, folder: Path, started: float, tee) -> None:
    """Executed notebooks, lesson logs and the figures the lessons wrote, as one archive (few files back)."""
    figures = [p for p in (ROOT / "docs" / "figures").glob("*.png") if p.stat().st_mtime >= started]
    if not folder.exists() and not figures:
        return
    archive = out / "notebooks.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        if folder.exists():
            tar.add(folder, arcname="notebooks")
        for fig in figures:
            tar.add(fig, arcname=f"figures/{fig.name}")
    shutil.rmtree(folder, ignore_errors=True)
    tee(f"packed the executed notebooks, lesson logs and {len(figures)} figure(s) into {archive} "
        f"({archive.stat().st_size / MIB:.1f} MiB)\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="output folder "
                   "(default: $OUT, else runs/gpu_check)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450)")
    p.add_argument("--cpu", action="store_true", help="hide the GPUs: check the CPU fallback")
    p.add_argument("--lessons", default="all", help="'all', 'none' or comma-separated lessons (paths or names "
                   "such as 00 or notebooks/00_start_here.ipynb)")
    p.add_argument("--lesson-world-size", default="1", help="world_size for lessons that take one (default 1: "
                   "one rank on the one GPU); 'default' keeps every lesson's own")
    p.add_argument("--every-lesson-at-world-size", action="store_true", help="apply --lesson-world-size to "
                   f"the lessons that assume two or more ranks too ({','.join(LESSON_KEEPS_WORLD_SIZE)}), to "
                   "see how far each gets")
    p.add_argument("--lesson-jobs", type=int, default=1, help="lessons executed at the same time (default 1)")
    p.add_argument("--lesson-reserve", type=float, default=180, help="seconds kept for the lessons, which run "
                   "last, whatever the other sections take (default 180)")
    p.add_argument("--lesson-timeout", type=float, default=240, help="seconds per lesson at most (default 240)")
    p.add_argument("-p", "--lesson-param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                   help="papermill parameter for lessons that declare it")
    p.add_argument("--memory-models", default=None, help="comma-separated of tiny,1b (default: both with a GPU, "
                   "tiny without)")
    p.add_argument("--memory-variants", default=",".join(MEMORY_VARIANTS),
                   help=f"comma-separated of {','.join(MEMORY_VARIANTS)} (default: all)")
    p.add_argument("--copy-mib", type=int, default=256, help="size of each bandwidth copy (MiB)")
    p.add_argument("--offload-steps", type=int, default=3, help="training steps per offload setting")
    p.add_argument("--pack", action="store_true", help="archive the executed notebooks as notebooks.tar.gz")
    p.add_argument("--notebooks-dir", help=argparse.SUPPRESS)   # set by the parent: OUT/notebooks, or a temp
    p.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--child-budget", type=float, default=60, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}: choose from {','.join(SECTIONS)}")
    args.section_list = [s for s in SECTIONS if s in sections]
    if args.memory_models is not None:
        args.memory_models = [m for m in args.memory_models.split(",") if m]
        bad = sorted(set(args.memory_models) - set(MEMORY_SHAPES))
        if bad:
            p.error(f"unknown memory model(s) {bad}: choose from {','.join(MEMORY_SHAPES)}")
    args.memory_variants = [v for v in args.memory_variants.split(",") if v]
    bad = sorted(set(args.memory_variants) - set(MEMORY_VARIANTS))
    if bad or not args.memory_variants:
        p.error(f"--memory-variants takes a comma-separated subset of {','.join(MEMORY_VARIANTS)}")
    if args.lesson_world_size != "default" and not args.lesson_world_size.isdigit():
        p.error("--lesson-world-size takes a whole number or 'default'")
    return args


def exit_code(results: dict) -> int:
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.child:
        return run_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("gpu_check.log", "gpu_check.json", "notebooks.tar.gz"):
        with contextlib.suppress(OSError):
            (out / stale).unlink()
    tee = Tee(out / "gpu_check.log")
    # With --pack the executed notebooks wait outside OUT until they are archived: OUT holds a few files
    # at any moment, even if the run is cut short.
    args.notebooks_dir = (tempfile.mkdtemp(prefix="gpu_check_notebooks_") if args.pack
                          else str((out / "notebooks").resolve()))
    started_wall, start = time.time(), time.monotonic()
    deadline = start + args.budget
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": args.argv, "budget_s": args.budget,
              "sections": {}}
    json_path = out / "gpu_check.json"
    for name in args.section_list:
        left = deadline - time.monotonic()
        if name != "lessons" and "lessons" in args.section_list and args.lessons != "none":
            left -= args.lesson_reserve          # the lessons come last: keep their share
        timeout = min(SECTION_BUDGET_S[name], left)
        tee(f"\n=== {name} (budget {max(0, timeout):.0f} s) ===\n")
        if timeout < 10:
            result = {"status": "SKIP", "reason": f"the total budget of {args.budget:.0f} s is spent", "details": {},
                      "seconds": 0.0, "budget_s": round(max(0, timeout))}
        else:
            result = run_section_process(name, args, timeout, tee)
        report["sections"][name] = result
        tee(f"[{name}] {result['status']}: {result['reason']} ({result['seconds']:.1f} s)\n")
        report["total_s"] = round(time.monotonic() - start, 1)
        json_path.write_text(json.dumps(report, indent=1, default=str))
    if args.pack:
        pack_outputs(out, Path(args.notebooks_dir), started_wall, tee)
    code = exit_code(report["sections"])
    report.update(total_s=round(time.monotonic() - start, 1), exit_code=code,
                  failed=[n for n, r in report["sections"].items() if r["status"] == "FAIL"])
    json_path.write_text(json.dumps(report, indent=1, default=str))
    tee("\n=== summary ===\n")
    for name, r in report["sections"].items():
        tee(f"{name:<8} {r['status']:<4} {r['seconds']:6.1f} s  {r['reason']}\n")
    tee(f"total {report['total_s']:.0f} s of {args.budget:.0f}; results in {json_path}; exit code {code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
