"""The group an nccl cluster starts, and the GPU each rank takes, checked on a CPU machine.

NCCL itself is not in a CPU build of torch, but the way a group refuses a tensor is torch's, not NCCL's: a group
whose only backend serves cuda refuses a CPU tensor with the same "No backend type associated with device type
cpu" whether that backend is nccl or gloo. So gloo stands in for NCCL on the cuda side, and torch.cuda's device
queries are monkeypatched.
"""

import datetime
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fsdplab.runtime import on_rank

# Run in a fresh interpreter: a process group is process-wide, and the test process must not keep one.
_GROUPS_SCRIPT = textwrap.dedent("""
    import datetime, json
    import torch
    import torch.distributed as dist
    from fsdplab.runtime import on_rank

    def all_reduce_cpu():
        try:
            x = torch.ones(2)
            dist.all_reduce(x)
            dist.barrier()
            return {"ok": x.tolist()}
        except RuntimeError as e:
            return {"error": str(e)}

    out = {}
    # A group whose only backend serves cuda, as init_process_group("nccl") makes.
    dist.init_process_group("cuda:gloo", rank=0, world_size=1, store=dist.HashStore())
    out["cuda_only"] = all_reduce_cpu()
    dist.destroy_process_group()
    # What the runtime starts for 'nccl', with gloo in NCCL's place on the cuda side.
    stand_in = {"nccl": {device: "gloo" if name == "nccl" else name
                         for device, name in on_rank.DEVICE_BACKENDS["nccl"].items()}}
    on_rank.init_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30),
                       store=dist.HashStore(), device=torch.device("cpu"), device_backends=stand_in)
    out["nccl_group"] = {"backend": str(dist.get_backend()), **all_reduce_cpu()}
    # A DTensor in a rank's result goes to the kernel as its local part (a plain tensor, no mesh with it).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from fsdplab.runtime.host_copy import to_host

    sent = to_host({"w": distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])})
    out["dtensor"] = {"type": type(sent["w"]).__name__, "values": sent["w"].tolist()}
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def groups():
    done = subprocess.run([sys.executable, "-c", _GROUPS_SCRIPT], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the group script failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def test_a_group_served_only_on_cuda_refuses_cpu_tensors(groups):
    # What lesson 00 met on the H200: the stand-in reproduces NCCL's refusal.
    assert "No backend type associated with device type cpu" in groups["cuda_only"]["error"]


def test_the_group_started_for_nccl_serves_cpu_tensors(groups):
    assert groups["nccl_group"].get("error") is None, groups["nccl_group"]
    assert groups["nccl_group"]["ok"] == [1.0, 1.0]
    assert groups["nccl_group"]["backend"] == "cpu:gloo,cuda:gloo"   # the cuda side is there too


def test_a_dtensor_is_sent_as_its_local_part(groups):
    assert groups["dtensor"] == {"type": "Tensor", "values": [0.0, 1.0, 2.0, 3.0]}


def test_the_backend_strings():
    assert on_rank.group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert on_rank.group_backend("gloo") == "gloo"


class _FakeCuda:
    def __init__(self, monkeypatch, count: int):
        self.current = []
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.current.append)


@pytest.mark.parametrize("count, local_rank, expected", [(1, 3, 0), (4, 3, 3), (2, 3, 1), (8, 0, 0)])
def test_a_rank_takes_local_rank_modulo_the_gpus_it_sees(monkeypatch, count, local_rank, expected):
    # One GPU per task (count 1): every rank computes on cuda:0, where set_device(local_rank) failed.
    cuda = _FakeCuda(monkeypatch, count)
    device = on_rank.rank_device("nccl", local_rank)
    assert device == torch.device("cuda", expected)
    assert cuda.current == [torch.device("cuda", expected)]


def test_a_gloo_rank_computes_on_the_cpu_and_leaves_cuda_alone(monkeypatch):
    cuda = _FakeCuda(monkeypatch, 4)
    assert on_rank.rank_device("gloo", 3) == torch.device("cpu")
    assert cuda.current == []


def test_an_nccl_rank_without_a_gpu_says_so(monkeypatch):
    _FakeCuda(monkeypatch, 0)
    with pytest.raises(RuntimeError, match="sees no GPU.*backend='gloo'"):
        on_rank.rank_device("nccl", 1)


def test_init_names_the_gpu_to_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    timeout = datetime.timedelta(seconds=5)
    on_rank.init_group("nccl", rank=1, world_size=2, timeout=timeout, device=torch.device("cuda", 1))
    on_rank.init_group("gloo", rank=1, world_size=2, timeout=timeout, store="a store", device=torch.device("cpu"))
    (nccl_args, nccl_kw), (gloo_args, gloo_kw) = calls
    assert nccl_args == ("cpu:gloo,cuda:nccl",) and nccl_kw["device_id"] == torch.device("cuda", 1)
    assert "store" not in nccl_kw   # MASTER_ADDR/MASTER_PORT then
    assert gloo_args == ("gloo",) and "device_id" not in gloo_kw and gloo_kw["store"] == "a store"
