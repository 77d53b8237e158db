"""fsdplab.Cluster on GPUs: backend "auto" picks nccl when every rank has a GPU, and a collective is right."""

import time

import pytest
import torch
import torch.distributed as dist

import fsdplab


def _all_reduce():
    """On each rank: sum rank + 1 over the group, on the rank's GPU and on the CPU (which gloo serves in an nccl
    cluster's group; lessons and planted faults run collectives on CPU tensors)."""
    x = torch.full((1024,), float(fsdplab.rank() + 1), device=fsdplab.device())
    dist.all_reduce(x)
    on_cpu = torch.full((4,), float(fsdplab.rank() + 1))
    dist.all_reduce(on_cpu)
    return {"backend": fsdplab.backend(), "group": dist.get_backend(), "device": str(x.device), "sum": x[0].item(),
            "cpu_sum": on_cpu[0].item()}


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
    assert out == [{"backend": "nccl", "group": "cpu:gloo,cuda:nccl", "device": f"cuda:{r}", "sum": total,
                    "cpu_sum": total} for r in range(world_size)]


def _tensors():
    """A result and a namespace variable that hold GPU tensors."""
    x = torch.arange(4.0, device=fsdplab.device())
    import IPython

    IPython.get_ipython().user_ns["pulled"] = {"x": x}
    return [x, {"y": x * 2}]


def test_results_come_back_on_the_cpu(gpu_cluster):
    # The kernel must get CPU tensors: a CUDA one opens a context on the rank's GPU in the kernel (impossible in
    # EXCLUSIVE_PROCESS mode) and does not compare with CPU tensors.
    opened_before = torch.cuda.is_initialized()   # by an earlier test in this process, if any
    (result,) = gpu_cluster.run(_tensors, timeout=60)
    (pulled,) = gpu_cluster.pull("pulled")
    assert [result[0].device.type, result[1]["y"].device.type, pulled["x"].device.type] == ["cpu"] * 3
    assert torch.equal(result[1]["y"], torch.arange(4.0) * 2)
    assert torch.cuda.is_initialized() == opened_before, "unpickling the results opened a CUDA context here"
