"""Who am I, on which device, in which mesh: what lesson code calls on a rank.

Use these inside `cluster.run(fn)` or a `%%ranks` cell (where `rank`, `world_size`, `device`, `mesh`, `print0`,
`local_rank`, `node_rank` and `node_mesh` are already imported). The group itself is joined by
fsdplab.runtime.on_rank, whose `STATE` these read; in the notebook kernel they say where to call them.
"""

from __future__ import annotations

import builtins

from .runtime.on_rank import STATE


def _require_rank(what: str):
    if not STATE:
        raise RuntimeError(
            f"fsdplab.{what}() only works on a rank: call it inside cluster.run(fn) or a %%ranks cell, "
            "after fsdplab.Cluster(...).start()."
        )
    return STATE


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
    """The 1-D `DeviceMesh` over all ranks, built when the group started."""
    return _require_rank("mesh")["mesh"]


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
        return dist.group.WORLD, state["mesh"], True
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


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only (every rank may call it)."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)
