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
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_name, device_type = f"cuda:{local_rank}", "cuda"
    else:
        device_name, device_type = "cpu", "cpu"
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = STATE.pop("store", None)
    if store is None and rank != 0:
        store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    if store is not None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
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

    _running(getattr(fn, "__qualname__", repr(fn)))
    try:
        shipped_code.restore(origins, fn, args, kwargs)
        return fn(*args, **kwargs)
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
