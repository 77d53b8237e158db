"""fsdplab.ranks in a script that torchrun starts: lesson rank code runs as written after init_process_group.

A lesson's `%%ranks` cell calls rank(), world_size(), device(), mesh() and print0(); pasted into a script they read
the default process group and torchrun's environment. Run for real: torchrun, 2 gloo ranks."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from fsdplab import ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from fsdplab.ranks import rank, world_size, device, mesh, print0, first_ranks, local_rank, node_rank
    from fsdplab import checkpoint as ck

    dist.init_process_group("gloo")
    # a lesson's cells, as written
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for block in model:
        fully_shard(block, mesh=mesh())
    fully_shard(model, mesh=mesh())
    local = model[0].weight.to_local()
    print0("printed by rank 0 only")
    group, small_mesh, member = first_ranks(1)
    tiny, _ = ck.sharded_tiny()
    shards = {type(p).__name__ for p in tiny.parameters()}
    t = torch.ones(1) * (rank() + 1)
    dist.all_reduce(t)
    sys.stdout.write("RESULT " + json.dumps({
        "rank": rank(), "world_size": world_size(), "device": str(device()), "mesh": mesh().size(),
        "local_rows": local.shape[0], "member_of_first_1": member, "small_mesh": small_mesh is not None,
        "local_rank": local_rank(), "node_rank": node_rank(), "tiny_params": sorted(shards),
        "all_reduce": t.item()}) + "\\n")
    dist.barrier()             # every rank done before any leaves: gloo can abort a rank whose peer left first
    dist.destroy_process_group()
""")


def test_lesson_rank_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "lesson.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # each rank's result as it wrote it; two ranks' writes into torchrun's one pipe may share a line
    decoder = json.JSONDecoder()
    results = sorted((decoder.raw_decode(proc.stdout, m.end())[0] for m in re.finditer("RESULT ", proc.stdout)),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], proc.stdout
    for r in results:
        assert r["world_size"] == 2 and r["device"] == "cpu" and r["mesh"] == 2
        assert r["local_rows"] == 4                        # an 8-row weight, sharded on dim 0 over 2 ranks
        assert r["local_rank"] == r["rank"] and r["node_rank"] == 0
        assert r["tiny_params"] == ["DTensor"]             # checkpoint.sharded_tiny shards over mesh()
        assert r["all_reduce"] == 3.0                      # 1 + 2
    assert [r["member_of_first_1"] for r in results] == [True, False]
    assert [r["small_mesh"] for r in results] == [True, False]
    assert proc.stdout.count("printed by rank 0 only") == 1


def test_without_a_group_the_error_says_where_to_call_it(monkeypatch):
    from fsdplab.runtime import on_rank

    # a process that ran a rank call in-process holds STATE["now"] without having joined a group
    monkeypatch.setitem(on_rank.STATE, "now", None)
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        ranks.rank()


# A script's rank state holds torch's default group weakly: destroy_process_group frees it as in a script without
# fsdplab, and what the state made for it (meshes, subgroups) is dropped before the interpreter's finalization.
# (Held to the end, a gloo group torn down in finalization aborted a torchrun rank as it exited, now and then.)
HOLDS_NO_GROUP = textwrap.dedent("""
    import atexit, sys, weakref
    import torch.distributed as dist
    world = []
    # registered before fsdplab is imported, so it runs after fsdplab's own exit handler
    atexit.register(lambda: print("at exit: group alive", world[0]() is not None, flush=True))
    from fsdplab import ranks
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    world.append(weakref.ref(dist.group.WORLD))
    ranks.rank()
    if sys.argv[1] == "mesh":
        ranks.mesh()
    dist.destroy_process_group()
    print("after destroy: state kept", bool(ranks._SCRIPT), flush=True)
""")


@pytest.mark.parametrize("calls", ["rank", "mesh"])
def test_a_scripts_rank_state_lets_its_group_go(calls):
    proc = subprocess.run([sys.executable, "-c", HOLDS_NO_GROUP, calls], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    if calls == "rank":
        assert lines == ["after destroy: state kept False", "at exit: group alive False"]
    else:                                   # a DeviceMesh keeps the group alive until the state lets it go at exit
        assert lines[-1] == "at exit: group alive False", lines
