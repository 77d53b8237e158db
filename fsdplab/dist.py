"""Helpers that run on the ranks: who am I, on which device, in which mesh.

`setup()` is called once per rank by `fsdplab.Cluster` when the group starts. The other functions are
what lesson code uses inside `cluster.run(...)` or a `%%ranks` cell. None of them touch CUDA or the
process group at import time, so importing fsdplab in the notebook kernel is always safe.
"""

from __future__ import annotations

import builtins
import datetime
import faulthandler
import os
import signal
import threading

# Filled by setup() on a rank; empty in the notebook kernel.
_STATE: dict = {}


def _require_rank(what: str):
    if not _STATE:
        raise RuntimeError(
            f"fsdplab.{what}() only works on a rank: call it inside cluster.run(fn) or a %%ranks cell, "
            "after fsdplab.Cluster(...).start()."
        )
    return _STATE


def rank() -> int:
    """This process's global rank."""
    return _require_rank("rank")["rank"]


def world_size() -> int:
    """Number of ranks in the group."""
    return _require_rank("world_size")["world_size"]


def device():
    """`torch.device` this rank computes on: cuda:LOCAL_RANK under nccl, cpu under gloo."""
    import torch

    return torch.device(_require_rank("device")["device"])


def mesh():
    """The 1-D `DeviceMesh` over all ranks, built when the group started."""
    return _require_rank("mesh")["mesh"]


def backend() -> str:
    """'nccl' or 'gloo'."""
    return _require_rank("backend")["backend"]


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


def setup(*, rank: int, world_size: int, master_port: int, backend: str, collective_timeout_s: float,
          num_threads: int, stack_file: str, sys_path: list | None = None) -> dict:
    """Join the process group as `rank`. Runs once on each rank, all ranks at the same time."""
    import sys

    # Functions from the kernel's own modules (next to the notebook, a test folder) are pickled by
    # reference: the ranks must be able to import what the kernel can.
    sys.path[:0] = [p for p in (sys_path or []) if p not in sys.path]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), OMP_NUM_THREADS=str(num_threads),
    )
    # A rank stuck inside a collective sits in C++ code where no Python signal handler can run;
    # faulthandler dumps the Python stacks from C, which is how RankHang tells where a rank is stuck.
    stack_out = open(stack_file, "a", buffering=1)
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_name, device_type = f"cuda:{rank}", "cuda"
    else:
        device_name, device_type = "cpu", "cpu"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    _STATE.update(
        rank=rank, world_size=world_size, backend=backend, device=device_name,
        mesh=init_device_mesh(device_type, (world_size,)), stack_out=stack_out,
        main_thread=threading.main_thread().ident,
    )
    return {"rank": rank, "pid": os.getpid(), "device": device_name, "main_thread": _STATE["main_thread"]}


def teardown() -> None:
    """Leave the process group cleanly (used by Cluster.stop on a healthy group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()
