"""CPU offload on a GPU, measured with lesson 03's own functions: host<->device bandwidth (the figure the
lesson prints), FSDP2's CPUOffloadPolicy against no offload, the posts' FSDP1 CPUOffload; then the ~1.0B
Qwen2 built and trained by fsdplab.sharding, with and without offload (the posts: "about 1.3x slower")."""

import statistics
import time

import torch

import fsdplab
from fsdplab.lessons import offload
from fsdplab.models import TinyConfig
from fsdplab.settings import GIB, TrainSetting
from fsdplab.sharding import build_sharded, make_optimizer, train_step

from .memory_cases import one_b_config

BIG = TinyConfig(vocab_size=4096, dim=1024, num_layers=8, num_heads=16, seq_len=512)   # lesson 03's model
STEPS = 5


def test_host_bandwidth(record):
    bandwidth = offload.measure_host_bandwidth()
    for direction in ("h2d", "d2h"):
        record(f"{direction}_pinned_gb_s", round(bandwidth[direction] / 1e9, 2))
    assert bandwidth["h2d"] > 1e9 and bandwidth["d2h"] > 1e9, bandwidth


def test_fsdp2_cpu_offload(gpu_cluster, record):
    runs = {off: gpu_cluster.run(offload.offload_run, BIG, STEPS, off, timeout=300)[0] for off in (False, True)}
    for off, run in runs.items():
        record(f"offload={off}", {"ms_per_step": round(run["seconds_per_step"] * 1e3, 2),
                                  "peak_gpu_gib": round(run["peak_gpu_bytes"] / GIB, 3)})
    record("slowdown", round(runs[True]["seconds_per_step"] / runs[False]["seconds_per_step"], 2))
    assert runs[True]["param_device"] == runs[True]["optimizer_state_device"] == "cpu", runs[True]
    assert runs[False]["param_device"].startswith("cuda"), runs[False]
    assert runs[True]["peak_gpu_bytes"] < runs[False]["peak_gpu_bytes"]        # lesson 03's check


def test_fsdp1_cpu_offload(gpu_cluster, record):
    [run] = gpu_cluster.run(offload.fsdp1_offload_run, BIG, STEPS, timeout=300)
    record("ms_per_step", round(run["seconds_per_step"] * 1e3, 2))
    assert run["param_device"] == "cpu", run                  # CPUOffload(offload_params=True)


def _timed_steps(setting, steps):
    """On the rank: the package's sharded model and optimizer for `setting`, `steps` train_steps timed (the
    median after the first, which also creates the optimizer state)."""
    model = build_sharded(setting, seed=0)
    optimizer = make_optimizer(model, setting.optimizer)
    tokens = torch.randint(0, setting.model.vocab_size, (setting.batch_size, setting.seq_len), device=fsdplab.device())
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(model, optimizer, {"input_ids": tokens, "labels": tokens})
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"seconds_per_step": statistics.median(times[1:]), "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            "param_device": next(model.parameters()).to_local().device.type}


def test_one_b_cpu_offload_slowdown(gpu_cluster, record):
    setting = TrainSetting(model=one_b_config(), world_size=1, precision="bf16", activation_checkpointing=True,
                           seq_len=2048, batch_size=1)
    runs = {off: gpu_cluster.run(_timed_steps, setting.replace(cpu_offload=off), 3, timeout=300)[0]
            for off in (False, True)}
    for off, run in runs.items():
        record(f"offload={off}", {"s_per_step": round(run["seconds_per_step"], 3),
                                  "peak_gpu_gib": round(run["peak_gpu_bytes"] / GIB, 3)})
    record("slowdown", round(runs[True]["seconds_per_step"] / runs[False]["seconds_per_step"], 2))
    assert runs[True]["param_device"] == "cpu" and runs[False]["param_device"] == "cuda", runs
    assert runs[True]["peak_gpu_bytes"] < runs[False]["peak_gpu_bytes"]
