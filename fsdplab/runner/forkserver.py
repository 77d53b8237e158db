"""A fork server for rank processes: torch and ipyparallel imported once, each rank a fork of that process.

Every rank process (and the cluster's controller) otherwise starts a fresh Python that imports ipyparallel
and torch: about 3.5 s of CPU each, on every start and restart; each lesson's kernel imports torch,
matplotlib and ipykernel too. `fsdplab run` starts one server for the whole run (`start`) and points the
`python3` kernel spec at it (`kernel_spec`); the kernels, and clusters on this machine, then launch
`fork_client.py`, which asks the server for a fork that runs the module as `python -m` would, with the
client's environment, working folder and standard streams. The client stays the process its launcher
(ipyparallel, jupyter_client) watches: it passes signals on and exits as the fork did.

A fork dies with the server (PR_SET_PDEATHSIG), and so does what a fork forks in turn (ipyparallel's heart monitor);
the server kills a fork whose client is gone (a killed
launcher, a killed kernel's watcher). The server dies with the process that started it. Without a server
(`FSDPLAB_FORKSERVER` unset or not answering), ranks start as before.

    python -c "import sys; from fsdplab.runner.forkserver import serve; serve(sys.argv[1])" SOCKET   (what `start` runs)
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.spawn import spawn_main
from pathlib import Path

from ..runtime import collector
from ..runtime.processes import die_with_parent
from .fork_client import MULTIPROCESSING   # the client's stand-in for a spawned multiprocessing worker

ENV = "FSDPLAB_FORKSERVER"
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"   # what ipykernel sets when MPLBACKEND is unset
CLIENT = str(Path(__file__).resolve().parent / "fork_client.py")


def short_temp_dir() -> str:
    """A folder for Unix sockets (the server's, a run's kernels') and the folders that hold them: a socket's path
    has at most 107 bytes, and a deep TMPDIR (a test's, a CI workspace's) is longer."""
    folder = tempfile.gettempdir()
    return folder if len(folder) < 50 or not os.path.isdir("/tmp") else "/tmp"


def available() -> bool:
    """Whether fork servers work here: Linux with os.pidfd_open (the server waits on its forks with pidfds)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


def command(module: str) -> list:
    """The command that runs `python -m module` through the run's fork server, or directly without one."""
    if os.environ.get(ENV) and available():
        return [sys.executable, "-I", CLIENT, module]
    return [sys.executable, "-m", module]


def point_clusters_at(path: str | None) -> None:
    """Set (or, for None, unset) FSDPLAB_FORKSERVER and the command clusters start their ranks with
    (fsdplab.runtime.processes.python_command), for this process and the kernels it starts."""
    from ..runtime.processes import PYTHON_COMMAND_ENV

    if path is None:
        os.environ.pop(ENV, None)
        os.environ.pop(PYTHON_COMMAND_ENV, None)
    else:
        os.environ[ENV] = path
        os.environ[PYTHON_COMMAND_ENV] = json.dumps([sys.executable, "-I", CLIENT])


def running() -> str | None:
    """The socket of the server this process forks from already (FSDPLAB_FORKSERVER, where it exists), or None."""
    path = os.environ.get(ENV)
    return path if path and available() and os.path.exists(path) else None


def start(folder: str, wait_s: float = 60.0) -> subprocess.Popen | None:
    """Start a server listening in `folder`, set FSDPLAB_FORKSERVER for this process and its children, and
    return the server's process (None where fork servers do not work, see `available`, or it did not start)."""
    if not available():
        return None
    path = os.path.join(folder, "forkserver.sock")
    process = subprocess.Popen([sys.executable, "-c",
                                "import sys; from fsdplab.runner.forkserver import serve; serve(sys.argv[1])", path],
                               stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
                               env={"MPLBACKEND": INLINE_BACKEND, **os.environ, "OPENBLAS_NUM_THREADS": "1",
                                    "PYTHONUNBUFFERED": "1",
                                    # its imports write there (torch._dynamo's makes torchinductor_<user>): the
                                    # server's folder goes with it; each fork reads its client's TMPDIR
                                    "TMPDIR": folder, "TEMP": folder, "TMP": folder,
                                    # debugpy's import warns about frozen modules unless told not to check them,
                                    # as papermill and ipykernel's kernel specs tell it
                                    "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):   # it listens before it imports: clients wait for their fork
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            return None
        time.sleep(0.01)
    point_clusters_at(path)
    return process


def kernel_spec(folder: str) -> str:
    """Write a `python3` kernel spec whose kernel is a fork of the server into `folder`/kernels; returns
    `folder`, for JUPYTER_PATH (searched before the installed specs)."""
    spec = Path(folder) / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        # ipywidgets' comm targets: the server imported it before any kernel existed (see `_warm`)
        "argv": command("ipykernel_launcher") + ["-f", "{connection_file}", "--ext=ipywidgets"],
        "display_name": "Python 3 (ipykernel)", "language": "python", "metadata": {"debugger": True}}))
    return str(folder)


def stop(process: subprocess.Popen | None) -> None:
    """End the server and every process forked from it; unset FSDPLAB_FORKSERVER."""
    point_clusters_at(None)
    if process is None or process.poll() is not None:
        return
    process.kill()   # its forks get SIGKILL from the kernel as it dies (PR_SET_PDEATHSIG)
    process.wait()


def _warm() -> None:
    """What every rank imports (the engine, the controller, torch's distributed and FSDP, torch._dynamo, which
    the first `fully_shard` call imports, fsdplab and its estimator) and what every lesson's kernel does
    (ipykernel and its debugger, matplotlib with the backend ipykernel picks: `start` sets MPLBACKEND as the
    kernel will); on a CPU build of torch also transformers' Qwen2 and peft (`_warm_models`)."""
    import ipykernel.debugger  # noqa: F401  (debugpy: each kernel imports it as it starts)
    import ipykernel.kernelapp  # noqa: F401
    import ipyparallel.controller.app  # noqa: F401
    import ipyparallel.engine.app  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401

    import fsdplab.comms  # noqa: F401
    import fsdplab.memory  # noqa: F401
    import fsdplab.runtime.on_rank  # noqa: F401
    import fsdplab.sharding  # noqa: F401

    if not torch.backends.cuda.is_built():
        _warm_models()


def _warm_models() -> None:
    """transformers' Qwen2 and peft, which most lessons build on, where torch has no CUDA. Both import torchao,
    whose import asks `torch.cuda.is_available()`: on a CUDA build that sets up CUDA in this process, and no fork
    of it could then use a GPU (PyTorch's "poison fork"). transformers also imports ipywidgets (through
    tqdm.auto), which registers its comm targets only when it is imported into a kernel: the kernel spec
    (`kernel_spec`) loads it as an extension, which registers them."""
    import peft  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401


MAX_FDS = 64   # a multiprocessing worker's: its pipes, the resource tracker's, and those of the queues it was given


def _receive(conn: socket.socket) -> tuple:
    """One request: (module, args, env, cwd, and for a multiprocessing worker the numbers its descriptors had in
    the client, "fds") and the client's descriptors: its three standard streams, then those of "fds"."""
    conn.settimeout(10)
    header, fds, _, _ = socket.recv_fds(conn, 8, MAX_FDS)
    if len(header) < 8 or len(fds) < 3:
        for fd in fds:
            os.close(fd)
        raise OSError("incomplete request")
    size, data = int.from_bytes(header, "big"), b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise OSError("incomplete request")
        data += chunk
    request = json.loads(data)
    conn.settimeout(None)
    if len(fds) != 3 + len(request.get("fds", [])):
        for fd in fds:
            os.close(fd)
        raise OSError("descriptors missing from the request")
    return request, fds


def _same_numbers(fds: list, numbers: list) -> None:
    """In the fork: each of `fds` moved to the number it had in the client, as a spawned process inherits it. The
    fork holds no other descriptor there (it closed the server's own); one it does hold is an error, not closed."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in fds]   # out of the way of every target
    for fd in fds:
        os.close(fd)
    for fd, number in zip(high, numbers):
        try:
            os.fstat(number)
        except OSError:
            os.dup2(fd, number)   # inheritable, as the client had it
            os.close(fd)
            continue
        raise OSError(f"descriptor {number} is taken in the fork")


def _spawned_worker(request: dict) -> None:
    """In the fork: what multiprocessing's spawned interpreter runs, `spawn_main`, with the client's pipes."""
    tracker, pipe = (int(a) for a in request["args"][:2])
    sys.argv = ["-c", "--multiprocessing-fork"]   # as the spawned interpreter's (spawn_main checks it)
    spawn_main(tracker_fd=tracker, pipe_handle=pipe)   # raises SystemExit with the worker's exit code


def _run_child(request: dict, fds: list, server: int) -> None:
    """In the fork: become `python -m module args` with the client's streams, environment and folder."""
    import runpy
    import warnings

    code = 1
    try:
        os.setsid()   # as ipyparallel starts its processes: a session of their own
        die_with_parent()
        # What this process forks in turn (the controller forks ipyparallel's heart monitor with
        # multiprocessing) dies with it too: without this a grandchild outlives a killed run, re-parented to init.
        os.register_at_fork(after_in_child=die_with_parent)
        if os.getppid() != server:   # the server died before the line above
            os._exit(1)
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
            os.close(fd)
        _same_numbers(fds[3:], request.get("fds", []))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from ..runtime import on_rank as dist

        # The client's pid, for this process only (on_rank.setup reports it): what this process starts the
        # ordinary way was not launched by the client.
        stand_in = os.environ.pop("FSDPLAB_LAUNCHED_BY", None)
        dist.launched_by = int(stand_in) if stand_in else None
        tempfile.tempdir = None             # read TMPDIR again: each lesson has its own
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        options = [o for o in os.environ.get("PYTHONWARNINGS", "").split(",") if o]
        if options:   # what Python does with PYTHONWARNINGS at start-up
            warnings.resetwarnings()
            warnings._processoptions(options)
        if request["module"] == MULTIPROCESSING:
            _spawned_worker(request)
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as Python itself would: sys.excepthook (torch.distributed's puts
        sys.excepthook(*sys.exc_info())   # "[rankN]: " before each line), exit code 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()   # as the interpreter does at exit; os._exit leaves the server's state alone
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill(pid: int) -> None:
    """SIGKILL a fork and whatever it started in its session."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def serve(path: str) -> None:
    """Listen at `path`, import what ranks need, then fork one process per request until killed."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.chmod(path + ".tmp", 0o600)
    listener.listen(64)
    os.replace(path + ".tmp", path)   # clients that come during the imports wait for their fork
    # What the imports make lives as long as every fork: set aside for good (gc.freeze, as Python's documentation
    # advises before forking), a fork's full collections neither scan it nor write to its pages (which would copy
    # them, page by page, into each rank's memory).
    with collector.set_aside():
        _warm()
    server = os.getpid()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    clients, pidfds = {}, {}   # pid -> client connection, pid -> pidfd
    while True:
        for key, _ in selector.select():
            kind, pid = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    for other in clients.values():
                        other.close()
                    for fd in pidfds.values():
                        os.close(fd)
                    selector.close()
                    _run_child(request, fds, server)
                for fd in fds:
                    os.close(fd)
                pidfds[pid] = os.pidfd_open(pid)
                selector.register(pidfds[pid], selectors.EVENT_READ, ("exit", pid))
                try:
                    conn.sendall(f"{pid}\n".encode())
                except OSError:   # the client is gone already
                    conn.close()
                    _kill(pid)
                    continue
                clients[pid] = conn
                selector.register(conn, selectors.EVENT_READ, ("client", pid))
            elif kind == "client":   # a client sends nothing after its request: it is gone, so its fork goes too
                if clients.get(pid) is not key.fileobj:   # the fork's exit, earlier in this batch, closed it
                    continue
                try:
                    gone = not key.fileobj.recv(1)
                except OSError:
                    gone = True
                if gone:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    clients.pop(pid, None)
                    _kill(pid)
            else:   # the fork exited: tell its client the wait status
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fileobj)
                os.close(pidfds.pop(pid))
                conn = clients.pop(pid, None)
                if conn is not None:
                    selector.unregister(conn)
                    try:
                        conn.sendall(f"{status}\n".encode())
                    except OSError:
                        pass
                    conn.close()

