"""A live multi-rank process group behind a notebook.

Ranks are ipyparallel engines: separate processes started fresh (never a fork of the kernel), each of
which joins one torch.distributed group (nccl with one GPU per rank, or gloo on CPU) and keeps its state
from call to call. The kernel only sends work and waits, so a rank that raises, hangs or dies is reported
here as `RankError`, `RankHang` or `RankDied`, and the kernel lives on; `restart()` gives a fresh group.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref

_POLL_S = 0.01


class RankError(RuntimeError):
    """One or more ranks raised. `.errors` maps rank -> (exception name, message, traceback text)."""

    def __init__(self, errors: dict):
        self.errors = dict(sorted(errors.items()))
        parts = [f"{len(self.errors)} rank(s) raised: " + ", ".join(
            f"rank {r}: {name}: {msg}" for r, (name, msg, _) in self.errors.items())]
        for r, (_, _, tb) in self.errors.items():
            parts.append(f"\n--- rank {r} traceback ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


class RankHang(TimeoutError):
    """A call outlived its timeout. `.ranks`: ranks that did not finish; `.stacks`: rank -> Python stack."""

    def __init__(self, ranks: list, stacks: dict, timeout: float):
        self.ranks, self.stacks, self.timeout = list(ranks), dict(stacks), timeout
        parts = [f"rank(s) {self.ranks} did not finish within {timeout:g} s (a collective that only some "
                 "ranks entered, or work that needs a longer timeout=). The group is stuck: call "
                 "cluster.restart() to get a fresh one."]
        for r in self.ranks:
            parts.append(f"\n--- rank {r} is stuck here (most recent call last) ---\n"
                         + self.stacks.get(r, "(no stack captured)").rstrip())
        super().__init__("\n".join(parts))


class RankDied(RuntimeError):
    """A rank process exited. `.exits` maps rank -> exit code (negative: killed by that signal)."""

    def __init__(self, exits: dict):
        self.exits = dict(sorted(exits.items()))
        described = []
        for r, code in self.exits.items():
            if code is None:
                described.append(f"rank {r} (exit status unknown)")
            elif code < 0:
                described.append(f"rank {r} (killed by signal {signal.Signals(-code).name})")
            else:
                described.append(f"rank {r} (exit code {code})")
        super().__init__("rank process died: " + ", ".join(described)
                         + ". The other ranks may be stuck in a collective: call cluster.restart().")


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """GPUs visible to torch, asked without creating a CUDA context in the kernel."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """nccl when there is one GPU per rank, else gloo; raises ValueError with the fix for bad input."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}.")
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}.")
    if backend == "gloo":
        return "gloo"
    gpus = gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
                         f"are visible. Use world_size<={gpus}" if gpus else
                         "backend='nccl' needs GPUs and none are visible. Use backend='gloo' (CPU ranks).")
    return "nccl" if gpus >= world_size else "gloo"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MACHINERY = re.compile(r"(ipykernel|IPython|ipyparallel|tornado|traitlets|asyncio|zmq)[/\\]|<frozen runpy>")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _stack_of_thread(dump: str, thread_id: int) -> str:
    """The block of a faulthandler dump that belongs to one thread, oldest call first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    wanted = f"0x{thread_id:016x}"
    for block in blocks:
        head, _, body = block.partition("\n")
        if wanted in head:
            # faulthandler lists the newest call first; drop the engine's own event-loop frames.
            lines = [ln.strip() for ln in body.splitlines()
                     if ln.strip().startswith("File") and not _MACHINERY.search(ln)]
            return "\n".join(reversed(lines))
    return dump.strip()


def _stop_ipp(ipp_cluster, reaper):
    """Stop an ipyparallel cluster, then its watcher; safe to call twice, never raises.

    The watcher goes last: if this process is killed half-way (a kernel shut down with a short grace
    period), the watcher is still there to finish the job."""
    try:
        ipp_cluster.stop_cluster_sync()
    except Exception:
        pass
    try:
        if reaper is not None and reaper.poll() is None:
            reaper.kill()
            reaper.wait(5)
    except Exception:
        pass


class Cluster:
    """`world_size` ranks in one process group, kept alive across notebook cells.

    >>> with Cluster(2) as cluster:
    ...     cluster.run(lambda: fsdplab.rank())
    [0, 1]
    """

    _latest = None  # weak reference to the most recently started cluster (what %%ranks uses by default)

    @classmethod
    def latest(cls) -> "Cluster | None":
        """The most recently started cluster that is still running, if any."""
        cluster = cls._latest() if cls._latest is not None else None
        return cluster if cluster is not None and cluster._client is not None else None

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 120.0,
                 collective_timeout: float = 300.0, quiet: bool = False):
        self.backend = choose_backend(world_size, backend)
        if timeout <= 0 or collective_timeout <= 0:
            raise ValueError("timeout and collective_timeout are seconds and must be > 0.")
        self.world_size, self.timeout, self.collective_timeout = world_size, timeout, collective_timeout
        self.quiet = quiet
        self._ipp = self._client = self._reaper = self._finalizer = None
        self._engine_ids: list = []      # engine id of each rank, in rank order
        self._procs: dict = {}           # rank -> psutil.Process
        self._info: list = []
        self._broken: str | None = None
        self._workdir = None             # scratch folder (stack dumps, pid file), made by start()

    # --- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Start the ranks and their process group; returns self."""
        if self._client is not None:
            return self
        import ipyparallel as ipp

        t0 = time.perf_counter()
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix="fsdplab-")
        threads = max(1, (os.cpu_count() or 1) // self.world_size) if self.backend == "gloo" else 4
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
        self._ipp = ipp.Cluster(n=self.world_size, log_level=logging.ERROR, cluster_id=f"fsdplab-{os.getpid()}-{id(self)}",
                                profile_dir=os.path.join(self._workdir, "profile"), shutdown_atexit=True,
                                # The controller registers an engine only after a heartbeat; the default
                                # 3 s period alone made start-up take 7 s instead of 2.
                                controller_args=["--HeartMonitor.period=500"])
        self._ipp.config.LocalEngineSetLauncher.environment = env
        self._ipp.config.LocalControllerLauncher.environment = env
        self._ipp.start_cluster_sync()
        self._client = self._ipp.connect_client_sync()
        try:
            self._client.wait_for_engines(self.world_size, timeout=120, interactive=False)
        except TimeoutError:
            _stop_ipp(self._ipp, None)
            self._client = None
            raise RuntimeError(f"{self.world_size} rank process(es) did not start within 120 s; see "
                               f"the engine logs in {self._workdir}/profile/log, or try a smaller world_size.")
        self._client[:].use_cloudpickle()
        self._start_reaper()
        self._finalizer = weakref.finalize(self, _stop_ipp, self._ipp, self._reaper)
        self._join_group(threads)
        Cluster._latest = weakref.ref(self)
        if not self.quiet:
            print(f"fsdplab: {self.world_size} rank(s) ready on {self.backend} "
                  f"({'one GPU per rank' if self.backend == 'nccl' else f'CPU, {threads} thread(s) each'}) "
                  f"in {time.perf_counter() - t0:.1f} s")
        return self

    def _join_group(self, threads: int):
        import psutil

        from . import dist

        port = free_port()
        self._engine_ids = sorted(self._client.ids)[-self.world_size:]
        pending = []
        for rank, eid in enumerate(self._engine_ids):
            stack_file = os.path.join(self._workdir, f"stack-rank{rank}.txt")
            pending.append(self._client[eid].apply_async(
                dist.setup, rank=rank, world_size=self.world_size, master_port=port, backend=self.backend,
                collective_timeout_s=self.collective_timeout, num_threads=threads, stack_file=stack_file,
                sys_path=list(sys.path)))
        self._info = [ar.get(timeout=120) for ar in pending]
        # The launcher's own psutil.Process object is the one that reaps the engine, and psutil caches
        # the exit code on that object: use it, so RankDied can report the code.
        launched = {launcher.pid: launcher.process for engine_set in self._ipp.engines.values()
                    for launcher in getattr(engine_set, "launchers", {}).values()}
        self._procs = {i["rank"]: launched.get(i["pid"]) or psutil.Process(i["pid"]) for i in self._info}
        self._write_pidfile()
        # Names a %%ranks cell can use without importing anything.
        self._client[self._engine_ids].execute(
            "import torch, torch.distributed as dist, fsdplab\n"
            "from fsdplab import rank, world_size, device, mesh, print0", block=True)
        self._broken = None

    def _write_pidfile(self):
        pids = [p.pid for p in self._procs.values()]
        controller = getattr(self._ipp.controller, "process", None)
        if controller is not None:
            pids.append(controller.pid)
        with open(os.path.join(self._workdir, "pids"), "w") as f:
            f.write("\n".join(map(str, pids)))

    def _start_reaper(self):
        # ipyparallel starts its processes in their own sessions, so nothing kills them if the kernel is
        # killed; a tiny watcher process does.
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "fsdplab._reaper", str(os.getpid()), os.path.join(self._workdir, "pids")],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop every rank process and the controller, and remove the cluster's scratch folder."""
        self._shutdown()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _shutdown(self) -> None:
        if self._client is None:
            return
        if self._broken is None:
            try:
                from . import dist

                self.run(dist.teardown, timeout=10, quiet=True)
            except Exception:
                self._broken = "a failed teardown"
        # The group has been left (or is stuck, and stuck ranks ignore polite signals): nothing on the
        # ranks is worth saving, and ipyparallel's graceful engine shutdown alone takes seconds.
        for proc in self._procs.values():
            try:
                proc.kill()
            except Exception:
                pass
        try:
            self._client.close()
        except Exception:
            pass
        if self._finalizer is not None:
            self._finalizer()
        self._client = self._ipp = self._reaper = None
        self._procs, self._engine_ids = {}, []

    def restart(self) -> "Cluster":
        """Kill the ranks (even stuck ones) and start a fresh group with the same settings."""
        self._shutdown()
        return self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def __repr__(self):
        state = "stopped" if self._client is None else ("broken: " + self._broken if self._broken else "running")
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # --- work ---------------------------------------------------------------------------------
    @property
    def pids(self) -> list:
        """Process id of each rank, in rank order."""
        return [self._procs[r].pid for r in sorted(self._procs)]

    def run(self, fn, *args, timeout: float | None = None, ranks=None, quiet: bool = False, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on every rank (or `ranks`); return the values in rank order."""
        if not callable(fn):
            raise ValueError(f"run() takes a function to call on each rank, got {type(fn).__name__}. "
                             "For source text use cluster.execute(...).")
        selected = self._ranks(ranks)
        results = {r: self._client[self._engine_ids[r]].apply_async(fn, *args, **kwargs) for r in selected}
        return self._wait(results, timeout, quiet)

    def execute(self, source: str, timeout: float | None = None, ranks=None, quiet: bool = False) -> None:
        """Run Python source in each rank's namespace (what a %%ranks cell does)."""
        if not isinstance(source, str):
            raise ValueError("execute() takes Python source text; for a function use cluster.run(fn).")
        selected = self._ranks(ranks)
        results = {r: self._client[self._engine_ids[r]].execute(source, block=False, silent=False)
                   for r in selected}
        self._wait(results, timeout, quiet)

    def pull(self, name: str, ranks=None, timeout: float | None = None) -> list:
        """The value of variable `name` in each rank's namespace, in rank order."""
        selected = self._ranks(ranks)
        results = {r: self._client[self._engine_ids[r]].pull(name, block=False) for r in selected}
        return self._wait(results, timeout, quiet=True)

    def push(self, ranks=None, timeout: float | None = None, **values) -> None:
        """Set variables in each rank's namespace."""
        selected = self._ranks(ranks)
        results = {r: self._client[self._engine_ids[r]].push(values, block=False) for r in selected}
        self._wait(results, timeout, quiet=True)

    def _ranks(self, ranks) -> list:
        if self._client is None:
            raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
        if self._broken:
            raise RuntimeError(f"the cluster is unusable after {self._broken}: call cluster.restart().")
        if ranks is None:
            return list(range(self.world_size))
        ranks = [ranks] if isinstance(ranks, int) else sorted(set(ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: this cluster has ranks 0..{self.world_size - 1}.")
        return ranks

    def _wait(self, results: dict, timeout, quiet: bool) -> list:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        echo = _Echo(enabled=not (quiet or self.quiet))
        try:
            while True:
                echo.update(results)
                done = all(ar.ready() for ar in results.values())
                # Checked even when every call is done: the call of a rank that died completes too,
                # with ipyparallel's EngineError.
                dead = {r: p for r, p in self._procs.items() if not _alive(p)}
                if dead:
                    self._broken = "a rank died"
                    raise RankDied({r: self._exit_code(p) for r, p in dead.items()})
                if done:
                    break
                if time.monotonic() > deadline:
                    stuck = [r for r, ar in results.items() if not ar.ready()]
                    self._broken = "a hang"
                    raise RankHang(stuck, self._stacks(stuck), timeout)
                time.sleep(_POLL_S)
        finally:
            echo.update(results, final=True)
        errors = {}
        for r, ar in results.items():
            try:
                ar.get(0)
            except Exception as e:  # RemoteError from the rank, or a local ipyparallel error
                errors[r] = (getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e)),
                             _strip_ansi(getattr(e, "traceback", None) or repr(e)))
        if errors:
            raise RankError(errors)
        return [results[r].get(0) for r in sorted(results)]

    def _stacks(self, stuck: list) -> dict:
        offsets = {}
        for r in stuck:
            path = os.path.join(self._workdir, f"stack-rank{r}.txt")
            offsets[r] = os.path.getsize(path) if os.path.exists(path) else 0
            try:
                self._procs[r].send_signal(signal.SIGUSR1)
            except Exception:
                pass
        time.sleep(0.5)
        stacks = {}
        for r in stuck:
            with open(os.path.join(self._workdir, f"stack-rank{r}.txt")) as f:
                f.seek(offsets[r])
                stacks[r] = _stack_of_thread(f.read(), self._info[r]["main_thread"])
        return stacks

    def _exit_code(self, proc):
        # ipyparallel's launcher thread reaps the engine and psutil caches the code on that Process
        # object; waiting here as well would race it for the code.
        # Copies: ipyparallel drops a dead engine from these tables while we look.
        for engine_set in list(self._ipp.engines.values()):
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                if launcher.pid == proc.pid and getattr(launcher, "_wait_thread", None) is not None:
                    launcher._wait_thread.join(timeout=5)
        code = getattr(proc, "_exitcode", None)
        if not isinstance(code, int):
            try:
                code = proc.wait(timeout=1)
            except Exception:
                code = None
        return None if code is None else int(code)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Echo:
    """Prints each rank's new output, whole lines at a time, labelled `[rank N]`, while a call runs."""

    def __init__(self, enabled: bool):
        self.enabled, self.seen, self.partial = enabled, {}, {}

    def update(self, results: dict, final: bool = False):
        if not self.enabled:
            return
        for r, ar in sorted(results.items()):
            for stream_name in ("stdout", "stderr"):
                text = _stream_text(ar, stream_name)
                key = (r, stream_name)
                new = text[self.seen.get(key, 0):]
                self.seen[key] = len(text)
                buf = self.partial.get(key, "") + new
                lines = buf.split("\n")
                # Hold back an unfinished last line until it ends, or until the call does.
                self.partial[key] = "" if final else lines.pop()
                if final and lines and not lines[-1]:
                    lines.pop()
                out = sys.stderr if stream_name == "stderr" else sys.stdout
                for line in lines:
                    print(f"[rank {r}] {line}", file=out, flush=True)


def _stream_text(ar, name: str) -> str:
    try:
        value = getattr(ar, name)
    except Exception:
        return ""
    if isinstance(value, list):
        return value[0] if value else ""
    return value or ""
