"""What a rank sends to the kernel holds its tensors on the CPU (fsdplab.runtime.host_copy).

Fake tensors on device "cuda" stand in for a GPU rank's tensors on a CPU build: moving one to the CPU gives a fake
tensor on "cpu", so a result that was not moved is seen as still on cuda.
"""

import collections
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdplab.runtime import host_copy, on_rank


@pytest.fixture
def on_gpu():
    """cuda_tensor(*shape): a fake tensor on cuda:0."""
    mode = FakeTensorMode()

    def cuda_tensor(*shape):
        with mode:
            return torch.ones(*shape, device="cuda")
    return cuda_tensor


@dataclasses.dataclass
class Measured:
    loss: object
    steps: int


@dataclasses.dataclass(frozen=True)
class Frozen:
    grads: dict


Pair = collections.namedtuple("Pair", "a b")


def _devices(value) -> list:
    found = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            found.append(v.device.type)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                walk(getattr(v, f.name))
    walk(value)
    return found


def test_nested_gpu_tensors_come_back_on_the_cpu(on_gpu):
    value = {"logits": on_gpu(2, 3), "per_step": [on_gpu(1), (on_gpu(1), 0.5)], "run": Measured(on_gpu(1), 3),
             "frozen": Frozen({"w": on_gpu(4)}), "pair": Pair(on_gpu(1), "x"),
             "ordered": collections.OrderedDict(w=on_gpu(2))}
    assert set(_devices(value)) == {"cuda"}
    moved = host_copy.to_host(value)
    assert _devices(moved) == ["cpu"] * 7
    assert moved["logits"].shape == (2, 3) and moved["run"].steps == 3 and moved["per_step"][1][1] == 0.5
    assert type(moved["pair"]) is Pair and type(moved["ordered"]) is collections.OrderedDict
    assert type(moved["run"]) is Measured and type(moved["frozen"]) is Frozen
    assert set(_devices(value)) == {"cuda"}   # the rank's own objects are left as they were


def test_cpu_and_meta_values_are_sent_as_they_are():
    cpu, meta = torch.ones(3), torch.empty(2, device="meta")
    value = {"cpu": [cpu], "meta": meta, "n": 1, "run": Measured(cpu, 1)}
    assert host_copy.to_host(value) is value
    assert host_copy.to_host(meta) is meta


def test_a_container_that_holds_itself(on_gpu):
    loop = [on_gpu(1)]
    loop.append(loop)
    moved = host_copy.to_host(loop)
    assert moved[0].device.type == "cpu"


def test_call_sends_gpu_results_on_the_cpu(on_gpu):
    # What cluster.run gets back from a rank.
    out = on_rank.call(lambda: {"x": on_gpu(2)}, (), {})
    assert out["x"].device.type == "cpu"


def test_pull_sends_gpu_values_on_the_cpu(on_gpu, monkeypatch):
    namespace = {"sharded_logits": on_gpu(2, 2)}
    monkeypatch.setattr("IPython.get_ipython", lambda: type("Shell", (), {"user_ns": namespace})())
    assert on_rank.pull("sharded_logits").device.type == "cpu"
    missing = on_rank.pull("nope")
    assert isinstance(missing, on_rank.Failure) and missing.ename == "NameError" and "'nope'" in missing.evalue


def test_pull_from_ranks_reads_their_namespace(cluster):
    import fsdplab

    cluster.execute("import torch\npulled_value = {'rank': rank(), 't': torch.ones(2) * rank()}", quiet=True)
    pulled = cluster.pull("pulled_value")
    assert [p["rank"] for p in pulled] == [0, 1] and torch.equal(pulled[1]["t"], torch.ones(2))
    with pytest.raises(fsdplab.RankError, match="'never_set' is not defined"):
        cluster.pull("never_set")
