"""A rank's record of its collectives reads both of torch's flight recorders, and its memory numbers are its GPU's.

torch keeps the generic recorder (gloo, CPU tensors) and ProcessGroupNCCL's own (NCCL collectives), which a CPU
build does not have: here it is monkeypatched in, with the entries an nccl rank stuck in an all_reduce has.
"""

import json
import pickle

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from fsdplab.runtime import introspect


def _entry(op: str, seq: int, created: int, state: str) -> dict:
    return {"profiling_name": f"nccl:{op}" if op != "barrier" else "gloo:barrier", "collective_seq_id": seq,
            "process_group": ["0", "default_pg"], "input_sizes": [[4]], "input_dtypes": ["Float"],
            "state": state, "retired": state == "completed", "time_created_ns": created}


_CPU_DUMP = {"version": "2.7", "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}},
             "entries": [_entry("barrier", 1, 100, "completed")]}
_NCCL_DUMP = {"version": "2.7", "nccl_version": "2.27.3", "pg_config": {"0": {"desc": "default_pg", "ranks": "[0, 1]"}},
              "entries": [_entry("broadcast", 1, 50, "completed"), _entry("all_reduce", 2, 200, "scheduled")]}


@pytest.fixture
def two_recorders(monkeypatch):
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *a: json.dumps(_CPU_DUMP), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: json.dumps(_NCCL_DUMP), raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace", lambda *a: pickle.dumps(_CPU_DUMP), raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda *a: pickle.dumps(_NCCL_DUMP), raising=False)
    monkeypatch.setattr(introspect, "_RANK_STATE", {"world_size": 2, "now": ("step", 0.0)})


def test_an_nccl_rank_names_the_collective_it_waits_in(two_recorders):
    collectives = introspect._recent_collectives()
    assert [(e["op"], e["seq"], e["done"]) for e in collectives] == \
        [("broadcast", 1, True), ("barrier", 1, True), ("all_reduce", 2, False)]   # in the order they were made
    state = {"collectives": collectives, "running": "step", "frames": [("/x/torch/distributed/c10d.py", 1, "f", "")]}
    assert introspect.explain(0, state).startswith("rank 0 waits in all_reduce #2 (group of 2, 4 float32)")


def test_the_dump_for_the_analyzer_holds_both_recorders(two_recorders):
    import base64

    dump = pickle.loads(base64.b64decode(introspect.flight_recorder_dump()["fr_dump"]))
    assert [e["profiling_name"] for e in dump["entries"]] == ["nccl:broadcast", "gloo:barrier", "nccl:all_reduce"]
    assert dump["nccl_version"] == "2.27.3" and dump["pg_config"]["0"]["desc"] == "default_pg"


def test_a_recorder_that_fails_leaves_the_other(two_recorders, monkeypatch):
    def fails(*a):
        raise RuntimeError("no NCCL group yet")
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", fails)
    assert [e["op"] for e in introspect._recent_collectives()] == ["barrier"]


def test_memory_is_read_on_the_ranks_own_gpu(monkeypatch):
    # The answering thread's current device is GPU 0 on every rank: the rank's device must be named.
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: asked.append(device) or 7)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: asked.append(device) or 9)
    monkeypatch.setattr(introspect, "_RANK_STATE", {"device": "cuda:1"})
    memory = introspect._memory()
    assert (memory["cuda_allocated"], memory["cuda_reserved"]) == (7, 9)
    assert asked == ["cuda:1", "cuda:1"]
    monkeypatch.setattr(introspect, "_RANK_STATE", {"device": "cpu"})   # a gloo rank that made CUDA tensors
    asked.clear()
    introspect._memory()
    assert asked == [None, None]


def _all_reduce_once():
    import torch.distributed as dist

    dist.all_reduce(torch.ones(3))


def test_dumps_of_a_gloo_pair_read_back(cluster, tmp_path):
    cluster.run(_all_reduce_once, quiet=True)
    written = cluster.flight_recorder_dumps(tmp_path)
    assert sorted(written) == [0, 1]
    for path in written.values():
        dump = pickle.loads(path.read_bytes())
        assert any("all_reduce" in e["profiling_name"] for e in dump["entries"])
