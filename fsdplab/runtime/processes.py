"""The processes behind a cluster: how one is started, what the machine can start, and killing everything
that was started.

Nothing here knows about ranks: a cluster hands over pids, psutil handles and its scratch folder.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import time

# Memory one CPU rank needs before it does any work (Python, torch, gloo, ipyparallel), measured on
# torch 2.13: about 0.3 GiB. Used to refuse a world size the machine cannot start.
_RANK_BYTES = 350 * 2**20


# How rank processes on this machine are started: a JSON list, the command that runs `python -m MODULE` with
# MODULE appended. `fsdplab run` sets it to its fork server's client (fsdplab.runner.forkserver); unset, a
# fresh interpreter.
PYTHON_COMMAND_ENV = "FSDPLAB_PYTHON_COMMAND"


def python_command(module: str) -> list:
    """The command that runs `python -m module` for a rank or the controller (see PYTHON_COMMAND_ENV)."""
    prefix = os.environ.get(PYTHON_COMMAND_ENV)
    return json.loads(prefix) + [module] if prefix else [sys.executable, "-m", module]


def die_with_parent() -> None:
    """In a new process: get SIGKILL when the process that started it exits (Linux; elsewhere nothing). Safe as a
    Popen preexec_fn: it imports nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The device files a GPU driver makes on Linux: NVIDIA's (nvidiactl, nvidia0, ...), Jetson's (nvhost-*, nvmap),
# WSL's (dxg) and ROCm's (kfd). torch.cuda finds no GPU without one of them.
_GPU_DEVICE_PREFIXES = ("nvidia", "nvhost", "nvmap", "dxg", "kfd")


def gpu_device_nodes() -> list | None:
    """The GPU driver's device files in /dev on Linux; None elsewhere (nothing known: torch is asked)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return sorted(name for name in os.listdir("/dev") if name.startswith(_GPU_DEVICE_PREFIXES))
    except OSError:
        return None


def gpu_count() -> int:
    """GPUs visible to torch, asked without creating a CUDA context in the kernel."""
    if gpu_device_nodes() == []:
        return 0   # importing torch to learn this takes about a second of a cluster's start
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# What backend="auto" means in this process: auto (nccl when there is one GPU per rank, else gloo), gloo or nccl.
# It lets a whole run choose without editing code: `fsdplab run --backend gloo` sets it, so lessons run on CPU
# ranks on a GPU machine, and the CPU test suite sets it to gloo so that it runs the same on a machine with GPUs.
BACKEND_ENV = "FSDPLAB_BACKEND"


def requested_backend(backend: str = "auto") -> str:
    """`backend`, or for "auto" what FSDPLAB_BACKEND asks for ("auto" when unset); ValueError with the fix for a
    bad name in either."""
    check_backend(backend)
    if backend != "auto":
        return backend
    wanted = os.environ.get(BACKEND_ENV, "").strip() or "auto"
    if wanted not in ("auto", "nccl", "gloo"):
        raise ValueError(f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r} is not a backend: set it to auto, gloo or "
                         f"nccl (or unset it), or pass backend='gloo' or 'nccl' to fsdplab.Cluster.")
    return wanted


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """nccl when there is one GPU per rank, else gloo (backend="auto" follows FSDPLAB_BACKEND when it is set);
    raises ValueError with the fix for bad input."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}.")
    backend = requested_backend(backend)
    if backend == "gloo":
        return "gloo"
    gpus = gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
                         f"are visible. Use world_size<={gpus}" if gpus else
                         "backend='nccl' needs GPUs and none are visible. Use backend='gloo' (CPU ranks).")
    return "nccl" if gpus >= world_size else "gloo"


def check_backend(backend) -> None:
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}.")


def max_world_size() -> int:
    """The most ranks this machine can start: memory available now over what one idle rank needs."""
    import psutil

    return max(1, psutil.virtual_memory().available // _RANK_BYTES)


def check_capacity(world_size: int) -> None:
    """ValueError, before anything starts, for more ranks than the machine has memory for."""
    most = max_world_size()
    if world_size > most:
        raise ValueError(
            f"world_size={world_size} is more ranks than this machine can start: each rank process needs "
            f"about {_RANK_BYTES / 2**30:.2f} GiB before it does any work and "
            f"{most * _RANK_BYTES / 2**30:.1f} GiB is available. Use world_size<={most}.")


def check_timeout(timeout, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{name} is in seconds and must be > 0, got {timeout!r}. "
                         f"Leave it out for the cluster's default, or give e.g. {name}=60.")


def check_output(output) -> str:
    if output not in ("lines", "tabs"):
        raise ValueError(f"output is 'lines' (labelled lines, the default) or 'tabs' (one tab per rank in "
                         f"JupyterLab), got {output!r}.")
    return output


def checked_env(env) -> dict:
    """A copy of `env`, the variables every rank process starts with, once each is a string name and value."""
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        raise ValueError(f"env maps variable names to string values, got {env!r}.")
    return dict(env or {})


def process_tree(pids) -> list:
    """psutil.Process objects for `pids` and all their descendants (collected before anything is killed)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc] + proc.children(recursive=True)
        except psutil.Error:
            pass
    return procs


def kill_all(procs, wait_s: float = 5.0) -> list:
    """SIGKILL each process and wait until it is gone; returns the ones still alive."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    # Our own children are reaped here; a killed process whose parent died too is a zombie until init
    # reaps it (seconds, on some machines), but it is dead: it runs nothing and holds no socket.
    deadline = time.monotonic() + wait_s
    left = list(procs)
    while left:
        psutil.wait_procs(left, timeout=0.01)
        left = [p for p in left if alive(p)]
        if time.monotonic() > deadline:
            break
    return left


def cleanup(ipp_cluster, pids, reaper, workdir, stop_launcher=None):
    """End a cluster's ranks through its launcher (`stop_launcher()`: cancel a Slurm job, end
    mpiexec or the ssh ranks), kill its processes and its watcher, and remove its scratch folder;
    safe to call twice, never raises (the garbage collector and interpreter exit call it too). The
    launcher's stop is handed in because the launchers import this module: it imports none."""
    if stop_launcher is not None:
        try:
            stop_launcher()
        except Exception:  # noqa: BLE001
            pass
    try:
        kill_all(process_tree(pids), wait_s=3)
    except Exception:  # noqa: BLE001
        pass
    try:
        ipp_cluster.stop_cluster_sync()
    except Exception:  # noqa: BLE001
        pass
    # The watcher goes last: if this process is killed half-way, it is still there to finish the job.
    try:
        if reaper is not None and reaper.poll() is None:
            reaper.kill()
            reaper.wait(5)
    except Exception:  # noqa: BLE001
        pass
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001
        return [str(proc)]

