"""fsdplab.Cluster on GPUs: backend "auto" picks nccl when every rank has a GPU, and a collective is right."""

import time

import pytest
import torch
import torch.distributed as dist

import fsdplab


def _all_reduce():
    """On each rank: sum rank + 1 over the group, on the rank's GPU."""
    x = torch.full((1024,), float(fsdplab.rank() + 1), device=fsdplab.device())
    dist.all_reduce(x)
    return {"backend": dist.get_backend(), "device": str(x.device), "sum": x[0].item()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_auto_backend_is_nccl_and_all_reduce_sums(world_size, record):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks on nccl need {world_size} GPUs; {torch.cuda.device_count()} visible")
    t0 = time.perf_counter()
    with fsdplab.Cluster(world_size) as cluster:
        record("start_s", round(time.perf_counter() - t0, 2))
        out = cluster.run(_all_reduce, timeout=60)
    assert cluster.backend == "nccl"
    total = world_size * (world_size + 1) / 2
    assert out == [{"backend": "nccl", "device": f"cuda:{r}", "sum": total} for r in range(world_size)]
