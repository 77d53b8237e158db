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
# In a process forked by `fsdplab run`'s fork server: the pid of the stand-in process that its launcher started
# and watches (fsdplab.forkserver sets it). None elsewhere: the process was launched as itself.
launched_by: int | None = None


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


def local_rank() -> int:
    """This rank's index on its node (its GPU under nccl)."""
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


def routable_address(toward: str) -> str:
    """Where the other nodes reach this rank: host_address(), unless that is a loopback address; then the
    address on the route to `toward` (the controller)."""
    from .network import host_address, route_address

    resolved = host_address()
    return resolved if not resolved.startswith("127.") else route_address(toward)


def open_store(*, world_size: int, timeout_s: float, host: str = "127.0.0.1") -> int:
    """On rank 0, before setup(): the group's TCPStore on a socket bound to `host`; returns its port.

    The socket is bound here, to `host` (loopback when every rank is on this machine, else rank 0's
    routable address) with a port the OS picks, and handed to the store: nothing listens on another
    interface and no chosen port can be taken by someone else in between."""
    import socket

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    for use_libuv in (True, False):  # some torch versions take a listening socket only without libuv
        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        try:
            _STATE["store"] = dist.TCPStore(host, port, world_size, True, wait_for_workers=False,
                                            timeout=timeout, master_listen_fd=sock.detach(), use_libuv=use_libuv)
            break
        except (RuntimeError, TypeError, ValueError):
            if not use_libuv:
                raise
    return port


def setup(*, rank: int, world_size: int, master_port: int, backend: str, collective_timeout_s: float,
          num_threads: int, stack_file: str | None, sys_path: list | None = None, ask_file: str | None = None,
          master_addr: str = "127.0.0.1", local_rank: int | None = None, local_world_size: int | None = None,
          node_rank: int = 0, nodes: int = 1, ask_token: str | None = None) -> dict:
    """Join the process group as `rank`. Runs once on each rank, all ranks at the same time.

    On one machine (the defaults) every address is loopback and LOCAL_RANK is the rank. Across nodes
    the launcher gives rank 0's routable address as `master_addr`, the rank's place on its node, and an
    `ask_token`: the answering thread then listens on TCP (no shared filesystem for the ask pipe)."""
    import sys

    # Functions from the kernel's own modules (next to the notebook, a test folder) are pickled by
    # reference: the ranks must be able to import what the kernel can.
    sys.path[:0] = [p for p in (sys_path or []) if p not in sys.path]
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(node_rank), NODE_RANK=str(node_rank),
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), OMP_NUM_THREADS=str(num_threads),
    )
    # gloo listens for its peers on the interface its host name resolves to: a public one on one
    # machine (loopback is the one to use), a loopback one on many Debian nodes (127.0.1.1; the peers
    # then fail with "connectFullMesh failed"). Name the interface on the route to rank 0.
    from .network import interface_of, route_address

    on_route = route_address(master_addr) if not master_addr.startswith("127.") else "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(on_route))
    if backend == "nccl":  # its bootstrap sockets too
        os.environ.setdefault("NCCL_SOCKET_IFNAME", os.environ["GLOO_SOCKET_IFNAME"])
    # A rank stuck inside a collective sits in C++ code where no Python signal handler can run;
    # faulthandler dumps the Python stacks from C, which is how RankHang tells where a rank is stuck.
    # (Not across machines: there the kernel has no file to read, and asks the answering thread.)
    stack_out = open(stack_file, "a", buffering=1) if stack_file else None
    if stack_out is not None:
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_name, device_type = f"cuda:{local_rank}", "cuda"
    else:
        device_name, device_type = "cpu", "cpu"
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = _STATE.pop("store", None)
    if store is None and rank != 0:
        store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    if store is not None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    _STATE.update(
        rank=rank, world_size=world_size, backend=backend, device=device_name,
        mesh=init_device_mesh(device_type, (world_size,)), stack_out=stack_out,
        main_thread=threading.main_thread().ident, local_rank=local_rank, local_world_size=local_world_size,
        node_rank=node_rank, nodes=nodes, node_mesh=None,
    )
    from . import hang

    ask_port = address = None
    if ask_token is not None:
        address = routable_address(master_addr)
        ask_port = hang.start_answering((address, ask_token), _STATE)
    elif ask_file is not None:
        hang.start_answering(ask_file, _STATE)
    import socket

    return {"rank": rank, "pid": os.getpid(), "launched_by": launched_by or os.getpid(), "device": device_name,
            "main_thread": _STATE["main_thread"], "host": socket.gethostname(), "address": address,
            "ask_port": ask_port}


def teardown() -> None:
    """Leave the process group cleanly (used by Cluster.stop on a healthy group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()


# --- calls from the kernel ------------------------------------------------------------------------
# Cluster.run and Cluster.execute send these instead of the user's code itself: an exception comes back
# as a Failure (a plain value), with the user's frames only, instead of ipyparallel's formatted text.

class Failure:
    """An exception raised on a rank: name, message and frames (filename, line number, function, source)."""

    def __init__(self, ename: str, evalue: str, frames: list):
        self.ename, self.evalue, self.frames = ename, evalue, frames

    @classmethod
    def of(cls, exc: BaseException, skip: int = 1) -> "Failure":
        import traceback

        # skip: the frames of the fsdplab function that caught it.
        frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
        frames = frames[skip:]
        if isinstance(exc, SyntaxError) and exc.filename:
            frames.append((exc.filename, exc.lineno or 0, "<module>", (exc.text or "").strip()))
            return cls(type(exc).__name__, exc.msg or str(exc), frames)
        return cls(type(exc).__name__, str(exc), frames)

    def __repr__(self):
        return f"Failure({self.ename}: {self.evalue})"


def _running(what: str):
    _STATE["now"] = (what, __import__("time").time())


def call(fn, args: tuple, kwargs: dict, origins: dict | None = None):
    """Run one kernel call on this rank; an exception (even SystemExit) comes back as a Failure.

    `origins`: the filenames the kernel compiled the shipped code under (fsdplab.shipped_code), put back
    before the call so that tracebacks and hang stacks name the notebook's cells."""
    from . import shipped_code

    _running(getattr(fn, "__qualname__", repr(fn)))
    try:
        shipped_code.restore(origins, fn, args, kwargs)
        return fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the rank must live on and report it
        return Failure.of(exc)
    finally:
        _STATE["now"] = None


def push(values: dict, origins: dict | None = None) -> None:
    """Set variables in this rank's namespace (what %%ranks cells see), their code named as in the kernel."""
    from IPython import get_ipython

    from . import shipped_code

    shipped_code.restore(origins, values)
    get_ipython().user_ns.update(values)


def _blank_head(text: str) -> int:
    lines = text.splitlines()
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


def _keep_line_numbers(source: str, transformed: str) -> str:
    """IPython drops a cell's leading blank lines: put them back, so that line numbers in tracebacks and hang
    stacks point at the lines of `source` (which is what the traceback shows)."""
    return "\n" * max(0, _blank_head(source) - _blank_head(transformed)) + transformed


def run_source(source: str, filename: str):
    """Run a %%ranks cell (IPython syntax allowed) in this rank's namespace, under `filename`."""
    import linecache

    from IPython import get_ipython

    shell = get_ipython()
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _running(filename)
    try:
        code = compile(_keep_line_numbers(source, shell.transform_cell(source)), filename, "exec")
        exec(code, shell.user_ns)
    except BaseException as exc:  # noqa: BLE001
        return Failure.of(exc)
    finally:
        _STATE["now"] = None
