"""Who am I, on which device, in which mesh: what lesson code calls on a rank.

Use these inside `cluster.run(fn)` or a `%%ranks` cell (where `rank`, `world_size`, `device`, `mesh`, `print0`,
`local_rank`, `node_rank` and `node_mesh` are already imported), or in a script started by torchrun (or any
launcher) after `dist.init_process_group(...)`: a lesson's rank code then runs as written. In the notebook the
group is joined by fsdplab.runtime.on_rank, whose `STATE` these read; in a script they read the default process
group and the launcher's environment (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK). In the notebook kernel itself
they say where to call them.
"""

from __future__ import annotations

import atexit
import builtins
import weakref

from .runtime.on_rank import STATE, rank_device


_SCRIPT: dict = {}   # the state a script's default group gives, built once per group
atexit.register(_SCRIPT.clear)    # before the interpreter's finalization (_script_state says why)


def _script_state() -> dict:
    """The same keys as on_rank's STATE, read from the default process group a script started (torchrun:
    `dist.init_process_group`) and the launcher's environment; {} without a group. Built once per group, and
    emptied when the group goes (`destroy_process_group`: the state holds it weakly) or at the latest when the
    script exits (atexit: the subgroups and meshes made for it, which keep it alive, go then). Held until the
    interpreter's finalization instead, a gloo group torn down there aborted a rank now and then as it exited
    ("terminate called without an active exception", a 2-rank torchrun script under load: 3 of 80 runs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _SCRIPT.clear()
        return _SCRIPT
    group = dist.group.WORLD
    if "group" not in _SCRIPT or _SCRIPT["group"]() is not group:
        import os

        rank, world = dist.get_rank(), dist.get_world_size()
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        device = rank_device(backend, local_rank)
        _SCRIPT.clear()
        _SCRIPT.update(group=weakref.ref(group, _group_gone), rank=rank, world_size=world, backend=backend,
                       device=str(device), mesh=None, local_rank=local_rank, local_world_size=local_world,
                       node_rank=int(os.environ.get("GROUP_RANK", rank // max(local_world, 1))),
                       nodes=max(world // max(local_world, 1), 1), node_mesh=None)
    return _SCRIPT


def _group_gone(ref) -> None:
    """The script's default group was destroyed: its state goes with it (unless a later group's replaced it)."""
    if _SCRIPT.get("group") is ref:
        _SCRIPT.clear()


def _require_rank(what: str):
    if "rank" in STATE:          # joined by the notebook's cluster (STATE may hold other keys before that)
        return STATE
    state = _script_state()
    if not state:
        raise RuntimeError(
            f"fsdplab.{what}() only works on a rank: call it inside cluster.run(fn) or a %%ranks cell, "
            "after fsdplab.Cluster(...).start(), or in a script after dist.init_process_group(...) (torchrun)."
        )
    return state


def rank() -> int:
    """This process's global rank."""
    return _require_rank("rank")["rank"]


def world_size() -> int:
    """Number of ranks in the group."""
    return _require_rank("world_size")["world_size"]


def device():
    """`torch.device` this rank computes on: its GPU under nccl (cuda:LOCAL_RANK; cuda:0 where each rank sees
    only its own GPU), cpu under gloo."""
    import torch

    return torch.device(_require_rank("device")["device"])


def mesh():
    """The 1-D `DeviceMesh` over all ranks, built when the group started (in a script: at the first call, which
    every rank makes)."""
    state = _require_rank("mesh")
    if state.get("mesh") is None:
        from torch.distributed.device_mesh import init_device_mesh

        state["mesh"] = init_device_mesh(device().type, (state["world_size"],))
    return state["mesh"]


def backend() -> str:
    """'nccl' or 'gloo': the cluster's backend. (An nccl cluster's group also serves CPU tensors, with gloo:
    torch.distributed.get_backend() says 'cpu:gloo,cuda:nccl'.)"""
    return _require_rank("backend")["backend"]


def local_rank() -> int:
    """This rank's index on its node (under nccl its GPU is this modulo the GPUs it sees)."""
    return _require_rank("local_rank")["local_rank"]


def node_rank() -> int:
    """Index of this rank's node (0 on a one-machine cluster)."""
    return _require_rank("node_rank")["node_rank"]


def node_mesh():
    """The 2-D `DeviceMesh` (node x local), dims named ("node", "local"): HSDP replicates over "node" and
    shards over "local". Every rank must call it (it creates process groups); built once, then cached."""
    state = _require_rank("node_mesh")
    if state.get("node_mesh") is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if state["backend"] == "nccl" else "cpu"
        state["node_mesh"] = init_device_mesh(device_type, (state["nodes"], state["local_world_size"]),
                                              mesh_dim_names=("node", "local"))
    return state["node_mesh"]


def first_ranks(size: int | None = None):
    """(process group of ranks 0..size-1, its 1-D mesh or None, member?): one started cluster serves every group
    size. Every rank must call it with the same sizes in the same order (creating a group is collective); built
    once per size, then cached with the group (a restart starts afresh). None or the world size: all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    state = _require_rank("first_ranks")
    world = state["world_size"]
    size = size or world
    if not 1 <= size <= world:
        raise ValueError(f"group_size must be between 1 and the {world} ranks, got {size}.")
    if size == world:
        return dist.group.WORLD, mesh(), True
    groups = state.setdefault("groups", {})
    if size not in groups:
        groups[size] = dist.new_group(list(range(size)))
    member = state["rank"] < size
    return groups[size], DeviceMesh.from_group(groups[size], device().type) if member else None, member


def this_rank() -> int:
    """This process's rank in the default process group, or 0 outside one (a notebook kernel, one process)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def this_world_size() -> int:
    """Ranks in the default process group, or 1 outside one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def defined(name: str):
    """The object named `name` in this rank's namespace: what a %%ranks cell defined there (a notebook rank), or
    the top level of a script (torchrun). A checker run by `cluster.run` reads the learner's code so."""
    import sys

    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = lambda: None   # noqa: E731 - a script without IPython installed
    shell = get_ipython()
    namespace = shell.user_ns if shell is not None else sys.modules["__main__"].__dict__
    if name not in namespace:
        raise NameError(f"{name!r} is not defined on this rank: run the %%ranks cell that defines it first")
    return namespace[name]


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only (every rank may call it)."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)
