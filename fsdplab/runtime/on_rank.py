"""The rank's side of the runtime: joining the group, and running what the kernel sends.

`open_store()` and `setup()` run once per rank when the group starts; `call`, `run_source` and `push` carry
each kernel call and send an exception back as a plain `Failure`. What lesson code itself uses on a rank
(rank(), device(), mesh(), ...) is in fsdplab.ranks, which reads the `STATE` filled here. Nothing here
touches CUDA or the process group at import time, so importing fsdplab in the notebook kernel is safe.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import threading

# Filled by setup() on a rank; empty in the notebook kernel. fsdplab.ranks reads it.
STATE: dict = {}
# In a process forked by `fsdplab run`'s fork server: the pid of the stand-in process that its launcher started
# and watches (fsdplab.runner.forkserver sets it). None elsewhere: the process was launched as itself.
launched_by: int | None = None


def routable_address(toward: str) -> str:
    """Where the other nodes reach this rank: host_address(), unless that is a loopback address; then the
    address on the route to `toward` (the controller)."""
    from .hosts import host_address, route_address

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
            STATE["store"] = dist.TCPStore(host, port, world_size, True, wait_for_workers=False,
                                            timeout=timeout, master_listen_fd=sock.detach(), use_libuv=use_libuv)
            break
        except (RuntimeError, TypeError, ValueError):
            if not use_libuv:
                raise
    return port


# Which torch backend serves each device type in the group a cluster's backend names. NCCL only moves CUDA
# tensors: a group made with init_process_group("nccl") refuses every collective on a CPU tensor ("No backend
# type associated with device type cpu"), and lessons and planted faults run collectives on CPU tensors on any
# backend. So an nccl cluster's group serves CPU tensors with gloo too; fsdplab.backend() still says 'nccl'.
DEVICE_BACKENDS = {"nccl": {"cpu": "gloo", "cuda": "nccl"}, "gloo": {"cpu": "gloo"}}


def group_backend(backend: str, device_backends: dict | None = None) -> str:
    """What init_process_group gets for a cluster's `backend`: 'gloo', or 'cpu:gloo,cuda:nccl' for nccl."""
    served = (device_backends or DEVICE_BACKENDS)[backend]
    if list(served) == ["cpu"]:
        return served["cpu"]   # one backend for the CPU: its plain name, as torch reports it back
    return ",".join(f"{device}:{name}" for device, name in served.items())


def rank_device(backend: str, local_rank: int):
    """The torch.device this rank computes on, made current: its GPU under nccl, else the CPU.

    The GPU is local_rank modulo the GPUs this process sees: all of the node's GPUs on one machine (rank r on
    cuda:r), or only its own where the launcher binds one GPU per task (Slurm's --gpus-per-task or --gpu-bind,
    a CUDA_VISIBLE_DEVICES per rank), where each rank then computes on cuda:0."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible < 1:
        raise RuntimeError(f"backend 'nccl', but local rank {local_rank} sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give each rank a GPU, or use "
                           "backend='gloo'.")
    device = torch.device("cuda", local_rank % visible)
    torch.cuda.set_device(device)
    return device


def init_group(backend: str, *, rank: int, world_size: int, timeout, store=None, device=None,
               device_backends: dict | None = None) -> None:
    """init_process_group for a cluster's `backend` (see DEVICE_BACKENDS), with `store` when given (else
    MASTER_ADDR/MASTER_PORT). A GPU `device` is passed as device_id: NCCL then binds its communicator to it at
    once, instead of guessing the device (with a warning) at each barrier."""
    import torch.distributed as dist

    extra = {"store": store} if store is not None else {}
    if device is not None and device.type != "cpu":
        extra["device_id"] = device
    dist.init_process_group(group_backend(backend, device_backends), rank=rank, world_size=world_size,
                            timeout=timeout, **extra)


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
    from .hosts import interface_of, route_address

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
    device = rank_device(backend, local_rank)
    device_name, device_type = str(device), device.type
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = STATE.pop("store", None)
    if store is None and rank != 0:
        store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    init_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store, device=device)
    STATE.update(
        rank=rank, world_size=world_size, backend=backend, device=device_name,
        mesh=init_device_mesh(device_type, (world_size,)), stack_out=stack_out,
        main_thread=threading.main_thread().ident, local_rank=local_rank, local_world_size=local_world_size,
        node_rank=node_rank, nodes=nodes, node_mesh=None,
    )
    from . import introspect

    ask_port = address = None
    if ask_token is not None:
        address = routable_address(master_addr)
        ask_port = introspect.start_answering((address, ask_token), STATE)
    elif ask_file is not None:
        introspect.start_answering(ask_file, STATE)
    import socket

    return {"rank": rank, "pid": os.getpid(), "launched_by": launched_by or os.getpid(), "device": device_name,
            "main_thread": STATE["main_thread"], "host": socket.gethostname(), "address": address,
            "ask_port": ask_port}


def teardown() -> None:
    """Leave the process group cleanly (used by Cluster.stop on a healthy group)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    STATE.clear()


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
    STATE["now"] = (what, __import__("time").time())


def call(fn, args: tuple, kwargs: dict, origins: dict | None = None):
    """Run one kernel call on this rank; an exception (even SystemExit) comes back as a Failure.

    `origins`: the filenames the kernel compiled the shipped code under (fsdplab.runtime.shipped_code), put back
    before the call so that tracebacks and hang stacks name the notebook's cells."""
    from . import shipped_code
    from .host_copy import to_host

    _running(getattr(fn, "__qualname__", repr(fn)))
    try:
        shipped_code.restore(origins, fn, args, kwargs)
        return to_host(fn(*args, **kwargs))   # GPU tensors come back to the kernel on the CPU
    except BaseException as exc:  # noqa: BLE001 - the rank must live on and report it
        return Failure.of(exc)
    finally:
        STATE["now"] = None


def push(values: dict, origins: dict | None = None) -> None:
    """Set variables in this rank's namespace (what %%ranks cells see), their code named as in the kernel."""
    from IPython import get_ipython

    from . import shipped_code

    shipped_code.restore(origins, values)
    get_ipython().user_ns.update(values)


def pull(name: str):
    """The value of variable `name` in this rank's namespace (what %%ranks cells set), its tensors on the CPU."""
    from IPython import get_ipython

    from .host_copy import to_host

    namespace = get_ipython().user_ns
    try:
        if name not in namespace:
            raise NameError(f"name {name!r} is not defined on this rank: set it in a %%ranks cell or with "
                            "cluster.push(...) first.")
        return to_host(namespace[name])
    except BaseException as exc:  # noqa: BLE001 - the rank must live on and report it
        return Failure.of(exc)


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
        STATE["now"] = None
