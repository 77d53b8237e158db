"""A live multi-rank process group behind a notebook.

Ranks are ipyparallel engines: separate processes started fresh (never a fork of the kernel), each of
which joins one torch.distributed group (nccl with one GPU per rank, or gloo on CPU) and keeps its state
from call to call. The kernel only sends work and waits, so a rank that raises, hangs or dies is reported
here as `RankError`, `RankHang` or `RankDied`, and the kernel lives on; `restart()` gives a fresh group.

How the pieces fit:
- every call runs on the ranks through fsdplab.dist.call / run_source, which send an exception back as
  a plain record; fsdplab.tracebacks names its frames in the notebook's terms (`Cell In[N], line L`);
- each rank answers "what are you doing?" from a thread (fsdplab.hang: torch's flight recorder and the
  main thread's frames), which RankHang, an early RankError and status() use;
- fsdplab.rank_output batches and collapses what the ranks print;
- a watcher process (fsdplab._reaper) starts before anything else and cleans up if the kernel dies;
- one controller process (schedulers as threads), no nanny processes, and a spare set of ranks kept
  warm where memory allows, so restart() only has to join a group.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from . import hang
from .tracebacks import describe_failures, failure_text, format_frames, group_same, rank_list

_POLL_S = 0.01
# Memory one CPU rank needs before it does any work (Python, torch, gloo, ipyparallel), measured on
# torch 2.13: about 0.3 GiB. Used to refuse a world size the machine cannot start.
_RANK_BYTES = 350 * 2**20
# How long ranks that still run may take after another rank failed before the kernel looks at them:
# a rank blocked in a collective with the failed one would otherwise wait for the collective timeout.
_FAILED_PEER_CHECK_S = 0.3
_INTERRUPT_GRACE_S = 2.0


class RankError(RuntimeError):
    """One or more ranks raised.

    `.errors` maps rank -> (exception name, message, traceback text); `.failures` rank -> the raw record
    (frames included); `.waiting` rank -> what a rank still running was doing (a collective it waits in
    for a failed rank, which leaves the group stuck)."""

    def __init__(self, errors: dict, failures: dict | None = None, waiting: dict | None = None):
        self.errors = dict(sorted(errors.items()))
        self.failures = dict(sorted((failures or {}).items()))
        self.waiting = dict(sorted((waiting or {}).items()))
        if self.failures:
            summary, blocks = describe_failures(self.failures)
        else:
            summary = [f"rank {r}: {name}: {msg}" for r, (name, msg, _) in self.errors.items()]
            blocks = [f"--- rank {r} ---\n{tb.rstrip()}" for r, (_, _, tb) in self.errors.items()]
        parts = list(summary)
        if self.waiting:
            parts.append("Meanwhile, " + "; ".join(self.waiting.values())
                         + ". They wait for the failed rank(s) forever: call cluster.restart().")
        super().__init__("\n".join(parts) + "\n\n" + "\n\n".join(blocks))


class RankHang(TimeoutError):
    """A call outlived its timeout. `.ranks`: ranks that did not finish; `.stacks`: rank -> Python stack;
    `.states`: rank -> one line on what it is doing (the collective it waits in, or finished last);
    `.collectives`: rank -> that collective as a dict (op, seq, group_size, sizes, dtypes, done);
    `.summary`: one line per group of ranks in the same state."""

    def __init__(self, ranks: list, stacks: dict, timeout: float, states: dict | None = None,
                 where: dict | None = None, collectives: dict | None = None):
        self.ranks, self.stacks, self.timeout = list(ranks), dict(stacks), timeout
        self.states = dict(sorted((states or {}).items()))
        self.collectives = dict(sorted((collectives or {}).items()))
        parts = [f"{rank_list(self.ranks)} did not finish within {timeout:g} s (a collective that only some "
                 "ranks entered, or work that needs a longer timeout=). The group is stuck: call "
                 "cluster.restart() to get a fresh one."]
        # Ranks in the same state share one line: `ranks 1-7 finished all_gather #2 (...), now idle`.
        same = group_same({r: line.split(" ", 2)[2] for r, line in self.states.items() if line.count(" ") >= 2})
        same.sort(key=lambda group: not set(group[0]) & set(self.ranks))  # the stuck ranks first
        # `.summary`: those lines alone, what a lesson prints when the stacks are not the point.
        self.summary = "\n".join(f"{rank_list(ranks)} {rest}" for ranks, rest in same)
        parts += [f"  {rank_list(ranks)} {rest}" for ranks, rest in same]
        for r in self.ranks:
            shown = (where or {}).get(r) or self.stacks.get(r, "(no stack captured)")
            parts.append(f"\n--- rank {r} is stuck here (most recent call last) ---\n" + shown.rstrip())
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
    import socket

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


def _check_timeout(timeout, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{name} is in seconds and must be > 0, got {timeout!r}. "
                         f"Leave it out for the cluster's default, or give e.g. {name}=60.")


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


def _process_tree(pids) -> list:
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


def _kill_all(procs, wait_s: float = 5.0) -> list:
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
    alive = list(procs)
    while alive:
        psutil.wait_procs(alive, timeout=0.01)
        alive = [p for p in alive if _alive(p)]
        if time.monotonic() > deadline:
            break
    return alive


def _cleanup(ipp_cluster, pids, reaper, workdir):
    """Kill a cluster's processes, its watcher, and remove its scratch folder; safe to call twice, never
    raises (the garbage collector and interpreter exit call it too)."""
    try:
        _kill_all(_process_tree(pids), wait_s=3)
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
                 collective_timeout: float = 300.0, quiet: bool = False, record_collectives: bool = True,
                 spares: bool = True, output: str = "lines"):
        self.backend = choose_backend(world_size, backend)
        if output not in ("lines", "tabs"):
            raise ValueError(f"output is 'lines' (labelled lines, the default) or 'tabs' (one tab per rank in "
                             f"JupyterLab), got {output!r}.")
        self.output = output
        for name, value in (("record_collectives", record_collectives), ("spares", spares)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} is True or False, got {value!r}.")
        # record_collectives: torch's flight recorder on the ranks, so RankHang can say which collective
        # each rank is in. spares: a second set of rank processes, started and idle (torch imported) once
        # the group is up, so restart() after a fault takes the time of joining a group, not of starting.
        self.record_collectives, self.spares = record_collectives, spares
        _check_timeout(timeout)
        _check_timeout(collective_timeout, "collective_timeout")
        if self.backend == "gloo":
            check_capacity(world_size)
        self.world_size, self.timeout, self.collective_timeout = world_size, timeout, collective_timeout
        self.quiet = quiet
        self._ipp = self._client = self._reaper = self._finalizer = None
        self._engine_ids: list = []      # engine id of each rank, in rank order
        self._procs: dict = {}           # rank -> psutil.Process
        self._info: list = []
        self._broken: str | None = None
        self._workdir = None             # scratch folder (keys, stack dumps, ask pipes), made by start()
        # ipyparallel's client is not thread-safe: two threads sharing it get each other's results.
        self._lock = threading.RLock()
        self._known_pids: list = []      # every process started, for the finalizer (updated in place)

    # --- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Start the ranks and their process group; returns self."""
        with self._lock:
            if self._client is not None:
                return self
            t0 = time.perf_counter()
            self._workdir = tempfile.mkdtemp(prefix="fsdplab-")
            # The watcher first: a kernel killed at any moment of start-up leaves nothing behind.
            self._start_reaper()
            self._finalizer = weakref.finalize(self, _cleanup, None, self._known_pids, self._reaper, self._workdir)
            try:
                self._start_processes()
                self._join_group()
            except BaseException:
                self._shutdown()
                raise
            Cluster._latest = weakref.ref(self)
            self._start_spares(only_if_wanted=True)
            if not self.quiet:
                print(f"fsdplab: {self.world_size} rank(s) ready on {self.backend} "
                      f"({'one GPU per rank' if self.backend == 'nccl' else f'CPU, {self._threads} thread(s) each'})"
                      f" in {time.perf_counter() - t0:.1f} s")
            return self

    @property
    def _threads(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.world_size) if self.backend == "gloo" else 4

    def _engine_env(self) -> dict:
        # torch's flight recorder keeps the last collectives of each rank for the hang explainer.
        record = hang.FR_ENV if self.record_collectives else {"TORCH_FR_BUFFER_SIZE": "0"}
        return {"OMP_NUM_THREADS": str(self._threads), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                **record}

    def _start_processes(self) -> None:
        import ipyparallel as ipp

        env = self._engine_env()
        self._ipp = ipp.Cluster(
            n=self.world_size, log_level=logging.ERROR, cluster_id=f"fsdplab-{os.getpid()}-{id(self)}",
            profile_dir=os.path.join(self._workdir, "profile"), shutdown_atexit=False,
            # The controller registers an engine only after a heartbeat; the default 3 s period alone
            # made start-up take 7 s instead of 2. Schedulers as threads: one controller process.
            controller_args=["--HeartMonitor.period=500", "--IPController.use_threads=True"])
        self._ipp.config.LocalEngineSetLauncher.environment = env
        self._ipp.config.LocalControllerLauncher.environment = env
        # No nanny process per engine: the kernel watches and signals the ranks itself.
        self._ipp.config.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]
        self._ipp.config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m", "fsdplab._engine"]
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self._ipp, self._known_pids, self._reaper,
                                           self._workdir)
        self._ipp.start_controller_sync()
        self._write_pidfile()
        self._ipp.start_engines_sync(self.world_size)
        self._client = self._ipp.connect_client_sync()
        self._engine_ids = self._wait_for_new_engines(set())
        self._seen_ids = set(self._engine_ids)
        self._rank_set = list(self._ipp.engines)[-1]
        self._spare_set = None

    def _mark_broken(self, reason: str) -> None:
        """The group is unusable: say why, and start replacement ranks now (if none wait), so restart() is quick."""
        self._broken = reason
        self._start_spares(only_if_wanted=False)

    def _start_spares(self, only_if_wanted: bool) -> None:
        if self._ipp is None or getattr(self, "_spare_set", None) is not None:
            return
        # Idle spares cost memory: keep them only where twice the ranks fit (at a fault, where one more
        # set does: the old ranks are about to go).
        if only_if_wanted and not (self.spares and max_world_size() >= 2 * self.world_size):
            return
        if max_world_size() < self.world_size:
            return
        try:
            self._spare_set = self._ipp.start_engines_sync(self.world_size)
            self._write_pidfile()
        except Exception:  # noqa: BLE001 - restart() then starts from scratch
            self._spare_set = None

    def _restart_on_spares(self) -> bool:
        """Replace the ranks by the spares started at the fault, keeping the controller; False if not possible."""
        if self._ipp is None or self._client is None or getattr(self, "_spare_set", None) is None:
            return False
        controller = self._controller_pid()
        if controller is None or not _alive(__import__("psutil").Process(controller)):
            return False
        old = _process_tree(p.pid for p in self._procs.values())
        if _kill_all(old):
            return False
        self._ipp.engines.pop(self._rank_set, None)
        self._rank_set, self._spare_set = self._spare_set, None
        self._procs = {}
        self._engine_ids = self._wait_for_new_engines(self._seen_ids)
        self._seen_ids |= set(self._engine_ids)
        self._join_group()
        self._start_spares(only_if_wanted=True)
        return True

    def _wait_for_new_engines(self, old_ids: set) -> list:
        deadline = time.monotonic() + 120
        while True:
            new = sorted(set(self._client.ids) - old_ids)
            if len(new) >= self.world_size:
                return new[:self.world_size]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.world_size} rank process(es) did not start within 120 s; see "
                                   f"the engine logs in {self._workdir}/profile/log, or try a smaller world_size.")
            time.sleep(0.02)

    def _join_group(self):
        import psutil

        from . import dist

        self._client[self._engine_ids].use_cloudpickle()
        # Rank 0 binds the group's store to a loopback port the OS picks, so no port can be taken.
        port = self._client[self._engine_ids[0]].apply_async(
            dist.open_store, world_size=self.world_size, timeout_s=self.collective_timeout).get(timeout=120)
        pending = []
        for rank, eid in enumerate(self._engine_ids):
            pending.append(self._client[eid].apply_async(
                dist.setup, rank=rank, world_size=self.world_size, master_port=port, backend=self.backend,
                collective_timeout_s=self.collective_timeout, num_threads=self._threads,
                stack_file=self._path(f"stack-rank{rank}.txt"), sys_path=list(sys.path),
                ask_file=self._path(f"ask-rank{rank}")))
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

    def _path(self, name: str) -> str:
        return os.path.join(self._workdir, name)

    def _controller_pid(self):
        controller = getattr(self._ipp, "controller", None) if self._ipp is not None else None
        process = getattr(controller, "process", None)
        return process.pid if process is not None else None

    def _all_pids(self) -> list:
        pids = [p.pid for p in self._procs.values()]
        if self._ipp is not None:
            for engine_set in list(self._ipp.engines.values()):
                pids += [launcher.pid for launcher in list(getattr(engine_set, "launchers", {}).values())]
        controller = self._controller_pid()
        return sorted(set(pids + ([controller] if controller else [])))

    def _write_pidfile(self):
        self._known_pids[:] = self._all_pids()
        tmp = self._path("pids.tmp")
        with open(tmp, "w") as f:
            f.write("\n".join(map(str, self._known_pids)))
        os.replace(tmp, self._path("pids"))

    def _start_reaper(self):
        # ipyparallel starts its processes in their own sessions, so nothing kills them if the kernel is
        # killed; a tiny watcher process does, and removes the scratch folder (it holds the keys).
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "fsdplab._reaper", str(os.getpid()), self._workdir],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop every process the cluster started and remove its scratch folder; returns when all are gone.

        Raises RuntimeError naming any process that refused to die."""
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        survivors = []
        if self._ipp is not None or self._procs:
            # Nothing on the ranks is worth saving (a stuck rank ignores polite signals anyway), and
            # ipyparallel's graceful engine shutdown alone takes seconds.
            procs = _process_tree(self._all_pids())
            try:
                if self._client is not None:
                    self._client.close()
            except Exception:  # noqa: BLE001
                pass
            survivors = _kill_all(procs)
        if self._finalizer is not None:
            self._finalizer()  # ipyparallel's bookkeeping, the watcher, the scratch folder
        self._client = self._ipp = self._reaper = self._finalizer = None
        self._procs, self._engine_ids, self._workdir = {}, [], None
        if survivors:
            raise RuntimeError("these processes of the cluster did not die: " + ", ".join(
                f"pid {p.pid} ({' '.join(_cmdline(p))[:80]})" for p in survivors))

    def restart(self) -> "Cluster":
        """Kill the ranks (even stuck ones) and start a fresh group with the same settings."""
        with self._lock:
            t0 = time.perf_counter()
            try:
                if self._restart_on_spares():
                    if not self.quiet:
                        print(f"fsdplab: {self.world_size} fresh rank(s) ready in {time.perf_counter() - t0:.1f} s")
                    return self
            except Exception:  # noqa: BLE001 - fall back to a full start
                pass
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
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's frames, not these
        from . import dist

        if not callable(fn):
            raise ValueError(f"run() takes a function to call on each rank, got {type(fn).__name__}. "
                             "For source text use cluster.execute(...).")
        _check_timeout(timeout)
        with self._lock:
            selected = self._ranks(ranks)
            results = {r: self._client[self._engine_ids[r]].apply_async(dist.call, fn, args, kwargs)
                       for r in selected}
            return self._wait(results, timeout, quiet)

    def execute(self, source: str, timeout: float | None = None, ranks=None, quiet: bool = False,
                filename: str | None = None) -> None:
        """Run Python source in each rank's namespace (what a %%ranks cell does).

        `filename` names the source in tracebacks (the %%ranks magic passes the notebook cell's)."""
        __tracebackhide__ = True  # noqa: F841
        from . import dist

        if not isinstance(source, str):
            raise ValueError("execute() takes Python source text; for a function use cluster.run(fn).")
        _check_timeout(timeout)
        with self._lock:
            selected = self._ranks(ranks)
            name = filename or self._source_name()
            results = {r: self._client[self._engine_ids[r]].apply_async(dist.run_source, source, name)
                       for r in selected}
            self._wait(results, timeout, quiet)

    def _source_name(self) -> str:
        """`<ranks source N from Cell In[M]>`: unique per call (the ranks cache it for tracebacks)."""
        from .tracebacks import cell_of, current_cell_filename

        self._sources = getattr(self, "_sources", 0) + 1
        calling = current_cell_filename()
        cell = cell_of(calling) if calling else None
        return f"<ranks source {self._sources}" + (f" from Cell In[{cell}]" if cell is not None else "") + ">"

    def pull(self, name: str, ranks=None, timeout: float | None = None) -> list:
        """The value of variable `name` in each rank's namespace, in rank order."""
        __tracebackhide__ = True  # noqa: F841
        _check_timeout(timeout)
        with self._lock:
            selected = self._ranks(ranks)
            results = {r: self._client[self._engine_ids[r]].pull(name, block=False) for r in selected}
            return self._wait(results, timeout, quiet=True)

    def push(self, ranks=None, timeout: float | None = None, **values) -> None:
        """Set variables in each rank's namespace."""
        __tracebackhide__ = True  # noqa: F841
        _check_timeout(timeout)
        with self._lock:
            selected = self._ranks(ranks)
            results = {r: self._client[self._engine_ids[r]].push(values, block=False) for r in selected}
            self._wait(results, timeout, quiet=True)

    def status(self, quiet: bool = False) -> list:
        """Per rank: pid, host, device, memory in use and what it runs right now; printed as a table."""
        import socket

        with self._lock:
            if self._client is None:
                raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
            states = self._ask(list(range(self.world_size)))
            rows = []
            for r in range(self.world_size):
                state = states.get(r) or {}
                rows.append({"rank": r, "pid": self._procs[r].pid, "host": socket.gethostname(),
                             "device": self._info[r]["device"], "rss_bytes": state.get("rss"),
                             "cuda_allocated_bytes": state.get("cuda_allocated"),
                             "cuda_reserved_bytes": state.get("cuda_reserved"),
                             "running": _running_text(r, state, _alive(self._procs[r]))})
        if not quiet:
            print(_status_table(rows))
        return rows

    def _ranks(self, ranks) -> list:
        if self._client is None:
            raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
        if self._broken:
            raise RuntimeError(f"the cluster is unusable after {self._broken}: call cluster.restart().")
        # A rank that died while the group was idle: say so now, not as an ipyparallel lookup error.
        dead = {r: p for r, p in self._procs.items() if not _alive(p)}
        if dead:
            self._mark_broken("a rank died")
            raise RankDied({r: self._exit_code(p) for r, p in dead.items()})
        if ranks is None:
            return list(range(self.world_size))
        ranks = [ranks] if isinstance(ranks, int) else sorted(set(ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: this cluster has ranks 0..{self.world_size - 1}.")
        return ranks

    def _wait(self, results: dict, timeout, quiet: bool) -> list:
        __tracebackhide__ = True  # noqa: F841
        from .rank_output import Echo

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        echo = Echo(enabled=not (quiet or self.quiet), view=self.output, world_size=self.world_size)
        failed_since = next_peer_check = None
        self._peer_look = {}
        try:
            while True:
                echo.update(results)
                done = all(ar.ready() for ar in results.values())
                # Checked even when every call is done: the call of a rank that died completes too,
                # with ipyparallel's EngineError.
                dead = {r: p for r, p in self._procs.items() if not _alive(p)}
                if dead:
                    self._mark_broken("a rank died")
                    raise RankDied({r: self._exit_code(p) for r, p in dead.items()})
                if done:
                    break
                now = time.monotonic()
                if now > deadline:
                    self._raise_hang([r for r, ar in results.items() if not ar.ready()], timeout)
                if failed_since is None and _failures(results):
                    failed_since = now
                    next_peer_check = now + _FAILED_PEER_CHECK_S
                if next_peer_check is not None and now >= next_peer_check:
                    self._check_peers_of_failure(results)
                    next_peer_check = now + 0.5
                time.sleep(_POLL_S)
        except KeyboardInterrupt:
            self._interrupt(results)
        finally:
            echo.update(results, final=True)
        failures, errors = {}, {}
        for r, ar in results.items():
            try:
                value = ar.get(0)
            except Exception as e:  # a local ipyparallel error (a RemoteError of the plumbing itself)
                errors[r] = (getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e)),
                             _strip_ansi(getattr(e, "traceback", None) or repr(e)))
                continue
            if _is_failure(value):
                failures[r] = value
                errors[r] = (value.ename, value.evalue, failure_text(value))
        if errors:
            raise RankError(errors, failures) from None
        return [results[r].get(0) for r in sorted(results)]

    def _check_peers_of_failure(self, results: dict) -> None:
        """A rank failed while others still run: if they wait in a collective (for it), raise now.

        A rank counts as waiting when it sits in the same collective at two looks half a second apart
        (a rank merely passing through a collective of a subgroup without the failed rank moves on)."""
        __tracebackhide__ = True  # noqa: F841
        pending = [r for r, ar in results.items() if not ar.ready()]
        states = self._ask(pending)
        now = {r: (hang.latest(s) or {}).get("seq") for r, s in states.items() if hang.in_collective(s)}
        before, self._peer_look = getattr(self, "_peer_look", {}), now
        blocked = {r: hang.explain(r, states[r]) for r, seq in now.items() if r in before and before[r] == seq}
        if not blocked:
            return
        self._peer_look = {}
        failures = {r: v for r, v in _failures(results).items()}
        errors = {r: (f.ename, f.evalue, failure_text(f)) for r, f in failures.items()}
        self._mark_broken("a rank raised while the others waited for it in a collective")
        raise RankError(errors, failures, waiting=blocked) from None

    def _raise_hang(self, stuck: list, timeout: float):
        __tracebackhide__ = True  # noqa: F841
        everyone = list(range(self.world_size))
        states = self._ask(everyone)
        lines = {r: hang.explain(r, states.get(r)) for r in everyone}
        stacks, where = {}, {}
        for r in stuck:
            frames = [tuple(f) for f in (states.get(r) or {}).get("frames") or []]
            if frames:
                stacks[r] = format_frames(frames, indent="", collapse=False)
                where[r] = format_frames(frames, indent="")
        missing = [r for r in stuck if r not in stacks]
        if missing:
            stacks.update(self._stacks(missing))
        self._mark_broken("a hang")
        collectives = {r: hang.latest(states.get(r)) for r in everyone}
        raise RankHang(stuck, stacks, timeout, lines, where, collectives) from None

    def _ask(self, ranks: list) -> dict:
        alive = [r for r in ranks if r in self._procs and _alive(self._procs[r])]
        return hang.ask({r: self._path(f"ask-rank{r}") for r in alive}, wait_s=1.0)

    def _interrupt(self, results: dict):
        """The kernel was interrupted: interrupt the ranks still running, then raise KeyboardInterrupt."""
        __tracebackhide__ = True  # noqa: F841
        pending = [r for r, ar in results.items() if not ar.ready()]
        for r in pending:
            try:
                self._procs[r].send_signal(signal.SIGINT)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + _INTERRUPT_GRACE_S
        while time.monotonic() < deadline and not all(results[r].ready() for r in pending):
            time.sleep(_POLL_S)
        stuck = [r for r in pending if not results[r].ready()]
        if stuck:
            self._mark_broken("an interrupt inside a collective")
            states = self._ask(stuck)
            detail = "; ".join(hang.explain(r, states.get(r)) for r in stuck)
            raise KeyboardInterrupt(f"interrupted; {rank_list(stuck)} did not stop ({detail}): "
                                    "call cluster.restart().") from None
        raise KeyboardInterrupt(f"interrupted {rank_list(pending)}; the group is still usable."
                                if pending else "interrupted") from None

    def _stacks(self, stuck: list) -> dict:
        offsets = {}
        for r in stuck:
            path = self._path(f"stack-rank{r}.txt")
            offsets[r] = os.path.getsize(path) if os.path.exists(path) else 0
            try:
                self._procs[r].send_signal(signal.SIGUSR1)
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.5)
        stacks = {}
        for r in stuck:
            try:
                with open(self._path(f"stack-rank{r}.txt")) as f:
                    f.seek(offsets[r])
                    stacks[r] = _stack_of_thread(f.read(), self._info[r]["main_thread"])
            except OSError:
                stacks[r] = "(no stack captured)"
        return stacks

    def _exit_code(self, proc):
        # ipyparallel's launcher thread reaps the engine and psutil caches the code on that Process
        # object; waiting here as well would race it for the code.
        # Copies: ipyparallel drops a dead engine from these tables while we look.
        for engine_set in list(self._ipp.engines.values()) if self._ipp is not None else []:
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                if launcher.pid == proc.pid and getattr(launcher, "_wait_thread", None) is not None:
                    launcher._wait_thread.join(timeout=5)
        code = getattr(proc, "_exitcode", None)
        if not isinstance(code, int):
            try:
                code = proc.wait(timeout=1)
            except Exception:  # noqa: BLE001
                code = None
        return None if code is None else int(code)


def _is_failure(value) -> bool:
    from .dist import Failure

    return isinstance(value, Failure)


def _failures(results: dict) -> dict:
    out = {}
    for r, ar in results.items():
        if ar.ready():
            try:
                value = ar.get(0)
            except Exception:  # noqa: BLE001 - reported when the call ends
                continue
            if _is_failure(value):
                out[r] = value
    return out


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001
        return [str(proc)]


def _running_text(rank: int, state: dict, alive: bool) -> str:
    if not alive:
        return "dead"
    if not state:
        return "busy (did not answer)"
    return hang.explain(rank, state).split(" ", 2)[2]


def _status_table(rows: list) -> str:
    def gib(n):
        return "-" if n is None else f"{n / 2**30:.2f}"

    lines = [f"{'rank':>4} {'pid':>7} {'host':<14} {'device':<7} {'RSS GiB':>7} {'CUDA alloc/res GiB':>18}  now"]
    for row in rows:
        cuda = ("-" if row["cuda_allocated_bytes"] is None else
                f"{gib(row['cuda_allocated_bytes'])}/{gib(row['cuda_reserved_bytes'])}")
        lines.append(f"{row['rank']:>4} {row['pid']:>7} {row['host'][:14]:<14} {row['device']:<7} "
                     f"{gib(row['rss_bytes']):>7} {cuda:>18}  {row['running']}")
    return "\n".join(lines)

