"""A live multi-rank process group behind a notebook.

Ranks are ipyparallel engines: separate processes started fresh (never a fork of the kernel), each of
which joins one torch.distributed group (nccl with one GPU per rank, or gloo on CPU) and keeps its state
from call to call. The kernel only sends work and waits, so a rank that raises, hangs or dies is reported
here as `RankError`, `RankHang` or `RankDied`, and the kernel lives on; `restart()` gives a fresh group.

The runtime's files (fsdplab/runtime/):
- cluster: this file, the life cycle (start, restart, stop) and the calls (run, execute, pull, push, status);
- group: the started ranks as the kernel sees them (their registration, handles, liveness, exit codes, what each
  is doing);
- call: waiting on a call and turning every failure into one of the errors (errors: their text);
- on_rank: the rank's side, joining the group and running each call, an exception sent back as a plain
  record; tracebacks names its frames in the notebook's terms (`Cell In[N], line L`), shipped_code keeps
  the cells' names on code shipped to the ranks;
- introspect: each rank answers "what are you doing?" from a thread (torch's flight recorder and the main
  thread's frames), which RankHang, an early RankError and status() use;
- output: batches and collapses what the ranks print (lines or tabs); magics: %%ranks and %ranks_status;
- processes: the machine's capacity, and killing what was started; reaper: a watcher process that starts
  before anything else and cleans up if the kernel dies; engine: the rank process's entry point;
- hosts: this machine's addresses and interfaces;
- launchers/: where the ranks run (Local, Slurm, Mpi, Ssh), each holding its options, start, placement and stop.

One controller process (schedulers as threads), no nanny processes, and a spare set of ranks kept warm where
memory allows, so restart() only has to join a group. Rank processes on this machine are started with
`processes.python_command`, which `fsdplab run` points at its fork server.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from . import call, introspect, launchers, shipped_code
from .errors import status_table
from .group import Group
from .launchers.base import engine_pids
from .launchers.remote import RemoteRank
from .processes import (alive, check_capacity, check_output, check_timeout, checked_env, cleanup, cmdline, kill_all,
                        max_world_size, process_tree, python_command)

__all__ = ["Cluster"]

CONNECT_TIMEOUT_S = 120   # the kernel's wait for the controller's first answer


class Cluster:
    """`world_size` ranks in one process group, kept alive across notebook cells.

    >>> with Cluster(2) as cluster:
    ...     cluster.run(lambda: fsdplab.rank())
    [0, 1]

    launcher: where the ranks run. fsdplab.Local() (the default; or "local"): processes on this machine.
    fsdplab.Slurm(nodes=2, ...): one Slurm job on `nodes` nodes, world_size // nodes per node. fsdplab.Mpi(hosts=...):
    one mpiexec. fsdplab.Ssh(hosts=...): ssh. Elsewhere than Local, the kernel and the controller stay here (a
    login node); each launcher's docstring lists its options. The older form, launcher="slurm" with the options
    given to Cluster (nodes=2, partition=...), still works, with a note naming the object to write.

    `timeout`: seconds a call may take (default for run/execute/pull/push); `collective_timeout`: torch's own;
    `start_timeout`: seconds the ranks may take to connect (a Slurm job still pending then is cancelled, with
    Slurm's reason). `output`: "lines" (labelled lines) or "tabs" (a tab per rank in JupyterLab). `env`:
    variables each rank starts with (NCCL_DEBUG=INFO, say). `record_collectives`: torch's flight recorder on
    the ranks, so RankHang can say which collective each rank is in. `spares`: a second set of rank processes,
    started and idle once the group is up, so restart() after a fault takes the time of joining a group.
    """

    _latest = None  # weak reference to the most recently started cluster (what %%ranks uses by default)

    @classmethod
    def latest(cls) -> "Cluster | None":
        """The most recently started cluster that is still running, if any."""
        cluster = cls._latest() if cls._latest is not None else None
        return cluster if cluster is not None and cluster.running else None

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 120.0,
                 collective_timeout: float = 300.0, quiet: bool = False, record_collectives: bool = True,
                 spares: bool = True, output: str = "lines", launcher="local", *, start_timeout: float = 120.0,
                 env: dict | None = None, **flat_options):
        unknown = sorted(set(flat_options) - set(launchers.FLAT_OPTIONS))
        if unknown:
            raise TypeError(f"Cluster() got unexpected keyword argument(s) {', '.join(unknown)}.")
        self.launcher = launchers.resolve(launcher, {**dict.fromkeys(launchers.FLAT_OPTIONS), **flat_options})
        self._plan, self.backend = self.launcher.prepare(world_size, backend)
        self.output = check_output(output)
        for name, value in (("record_collectives", record_collectives), ("spares", spares)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} is True or False, got {value!r}.")
        self.record_collectives, self.spares = record_collectives, spares and self.launcher.spares
        self.env = checked_env(env)
        check_timeout(timeout)
        check_timeout(collective_timeout, "collective_timeout")
        check_timeout(start_timeout, "start_timeout")
        if self.backend == "gloo" and (self._plan is None or getattr(self._plan, "hosts", None) == ()):  # all here
            check_capacity(world_size)
        self.world_size, self.timeout, self.collective_timeout = world_size, timeout, collective_timeout
        self.start_timeout = start_timeout
        self.quiet = quiet
        self.threads = self.launcher.threads(self._plan, world_size, self.backend)
        self._group: Group | None = None
        self._reaper = self._finalizer = None
        self._jobs: list = []            # scheduler jobs, for the finalizer and the watcher (updated in place)
        self._known_pids: list = []      # every process started, for the finalizer (updated in place)
        self._spare_set = self._rank_set = None
        self._seen_ids: set = set()
        self._sources = 0
        # ipyparallel's client is not thread-safe: two threads sharing it get each other's results.
        self._lock = threading.RLock()

    @property
    def running(self) -> bool:
        """Whether the ranks are started (they may still be broken: see `broken`)."""
        return self._group is not None and self._group.client is not None

    @property
    def broken(self) -> str | None:
        """Why the group is unusable (after a hang, a death, a rank that raised while others waited), or None.
        When it is set, `restart()` gives a fresh group."""
        return self._group.broken if self._group is not None else None

    # --- life cycle ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Start the ranks and their process group; returns self."""
        return self._start(self.quiet)

    def _start(self, quiet: bool) -> "Cluster":
        with self._lock:
            if self.running:
                return self
            t0 = time.perf_counter()
            group = self._group = Group(self.world_size, self.backend, self.collective_timeout, self.threads,
                                        tempfile.mkdtemp(prefix="fsdplab-"))
            group.on_broken = self._on_broken
            # The watcher first: a kernel killed at any moment of start-up leaves nothing behind.
            self._start_reaper()
            stop = functools.partial(self.launcher.stop, self._plan, None, self._jobs)
            self._finalizer = weakref.finalize(self, cleanup, None, self._known_pids, self._reaper, group.workdir,
                                               stop)
            try:
                self._start_processes()
                self._join_group()
            except BaseException:
                self._shutdown()
                raise
            Cluster._latest = weakref.ref(self)
            self._start_spares(only_if_wanted=True)
            if not quiet:
                print(f"fsdplab: {self.world_size} rank(s) ready on {self.backend} "
                      f"({'one GPU per rank' if self.backend == 'nccl' else f'CPU, {self.threads} thread(s) each'}"
                      f"{self.launcher.describe(self._plan, self._jobs)}) in {time.perf_counter() - t0:.1f} s")
            return self

    def _engine_env(self) -> dict:
        # torch's flight recorder keeps the last collectives of each rank for the hang explainer.
        record = introspect.FR_ENV if self.record_collectives else {"TORCH_FR_BUFFER_SIZE": "0"}
        return {"OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                **record, **self.env}

    def _start_processes(self) -> None:
        import ipyparallel as ipp

        group, env = self._group, self._engine_env()
        # The controller registers an engine at the beat after the engine's first answer, one to two periods
        # after its heart starts: the default 3 s period alone made start-up take 7 s instead of 2, and at 0.5 s
        # that wait was still 0.5-1 s of each start. The misses keep the grace of a silent engine at 5 s.
        # Schedulers as threads: one controller process.
        controller_args = ["--HeartMonitor.period=100", "--HeartMonitor.max_heartmonitor_misses=50",
                           "--IPController.use_threads=True"]
        if self._plan is not None:
            # Drop an engine after 3 s of missed heartbeats (how a rank on another node that died is noticed
            # when its node cannot say); the engines there count the controller's beats in 1 s checks.
            controller_args = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=6",
                               "--IPController.use_threads=True"]
        group.ipp = ipp.Cluster(
            n=self.world_size, log_level=logging.ERROR, cluster_id=f"fsdplab-{os.getpid()}-{id(self)}",
            profile_dir=group.path("profile"), shutdown_atexit=False,
            controller_args=controller_args, **self.launcher.ipp_args(self._plan))
        config = group.ipp.config
        config.LocalEngineSetLauncher.environment = config.LocalControllerLauncher.environment = env
        # No nanny process per engine: the kernel watches and signals the ranks itself. An engine waits for the
        # controller's answer to its registration as long as the kernel waits for the ranks: at ipyparallel's
        # 5 s a loaded machine's engines gave up and quit, and the start failed only at start_timeout.
        config.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False",
                                                     f"--IPEngine.timeout={self.start_timeout:g}"]
        # ipyparallel waits 0.1 s between engines by default, to keep their ids in launch order; nothing here
        # needs that (each rank's process is known from its setup's answer).
        config.LocalEngineSetLauncher.delay = 0
        # On this machine: forks of `fsdplab run`'s fork server where there is one (processes.python_command).
        config.LocalEngineSetLauncher.engine_cmd = python_command("fsdplab.runtime.engine")
        config.LocalControllerLauncher.controller_cmd = python_command("ipyparallel.controller")
        self.launcher.configure(group.ipp, self._plan, env, group.path)   # Slurm, mpiexec or ssh: from these
        self._finalizer.detach()
        # The launcher's own end (a job cancelled, mpiexec or ssh ending its ranks) runs even when
        # the cluster is only garbage-collected: the partial holds the launcher, not the cluster.
        stop = functools.partial(self.launcher.stop, self._plan, group.ipp, self._jobs)
        self._finalizer = weakref.finalize(self, cleanup, group.ipp, self._known_pids, self._reaper, group.workdir,
                                           stop)
        group.ipp.start_controller_sync()
        self._write_pidfile()
        try:
            group.ipp.start_engines_sync(self.world_size)
        except Exception as error:  # sbatch refused the job, or ssh failed: say what to check
            message = self.launcher.refused(error)
            if message is None:
                raise
            raise RuntimeError(message) from None
        self._jobs[:] = self.launcher.jobs(group.ipp)
        self._write_pidfile()
        # ipyparallel's Client waits 10 s for the controller's answer: a loaded machine (the controller still
        # importing) has taken longer. The wait ends as soon as the answer comes.
        group.client = group.ipp.connect_client_sync(timeout=CONNECT_TIMEOUT_S)
        group.engine_ids = group.wait_for_new_engines(set(), self.start_timeout, self._start_problem)
        self._seen_ids = set(group.engine_ids)
        self._rank_set = list(group.ipp.engines)[-1]
        self._spare_set = None

    def _on_broken(self, reason: str) -> None:
        """The group is unusable: start replacement ranks now (if none wait), so restart() is quick."""
        self._start_spares(only_if_wanted=False)

    def _start_spares(self, only_if_wanted: bool) -> None:
        group = self._group
        if group is None or group.ipp is None or not self.launcher.spares or self._spare_set is not None:
            return
        # Idle spares cost memory: keep them only where twice the ranks fit (at a fault, where one more
        # set does: the old ranks are about to go).
        if only_if_wanted and not (self.spares and max_world_size() >= 2 * self.world_size):
            return
        if max_world_size() < self.world_size:
            return
        try:
            self._spare_set = group.ipp.start_engines_sync(self.world_size)
            self._write_pidfile()
        except Exception:  # noqa: BLE001 - restart() then starts from scratch
            self._spare_set = None

    def _restart_on_spares(self) -> bool:
        """Replace the ranks, keeping the controller: by the spares started at the fault, or (a scheduler's job)
        by a new job once the old one has left the queue; False if not possible."""
        import psutil

        group = self._group
        new_job = bool(self._jobs)
        if group is None or group.ipp is None or group.client is None or not (new_job or self._spare_set):
            return False
        controller = self._controller_pid()
        if controller is None or not alive(psutil.Process(controller)):
            return False
        if new_job:
            if self.launcher.stop(self._plan, group.ipp, self._jobs):
                return False
            group.ipp.engines.pop(self._rank_set, None)
            self._spare_set = group.ipp.start_engines_sync(self.world_size)
            self._jobs[:] = self.launcher.jobs(group.ipp)
            self._write_pidfile()
        else:
            if kill_all(process_tree(p.pid for p in group.procs.values())):
                return False
            group.ipp.engines.pop(self._rank_set, None)
        self._rank_set, self._spare_set = self._spare_set, None
        group.procs = {}
        group.engine_ids = group.wait_for_new_engines(self._seen_ids, self.start_timeout, self._start_problem)
        self._seen_ids |= set(group.engine_ids)
        self._join_group()
        self._start_spares(only_if_wanted=True)
        return True

    def _start_problem(self, elapsed: float, late: bool) -> str | None:
        return self.launcher.start_problem(self._plan, self._group.ipp, self._jobs, elapsed, late)

    def _join_group(self):
        group = self._group
        group.client[group.engine_ids].use_cloudpickle()
        shipped_code.classes_by_cloudpickle()                  # classes too, here and on every rank
        group.client[group.engine_ids].apply_sync(shipped_code.classes_by_cloudpickle)
        group.engine_ids, group.info, group.procs, group.launched_by = self.launcher.join_group(self._plan, group)
        self._write_pidfile()
        # Names a %%ranks cell can use without importing anything.
        group.client[group.engine_ids].execute(
            "import torch, torch.distributed as dist, fsdplab\n"
            "from fsdplab.ranks import rank, world_size, device, mesh, print0, local_rank, node_rank, node_mesh",
            block=True)
        group.broken = None

    def _controller_pid(self):
        group = self._group
        controller = getattr(group.ipp, "controller", None) if group is not None and group.ipp is not None else None
        process = getattr(controller, "process", None)
        return process.pid if process is not None else None

    def _all_pids(self) -> list:
        """Processes on this machine (a rank on another node is not one: its job or its launcher is)."""
        group = self._group
        pids = [p.pid for p in group.procs.values() if not isinstance(p, RemoteRank)]
        pids += engine_pids(group.ipp)  # never the pid of a rank an ssh launcher started elsewhere
        controller = self._controller_pid()
        return sorted(set(pids + ([controller] if controller else [])))

    def _write_pidfile(self):
        self._known_pids[:] = self._all_pids()
        tmp = self._group.path("pids.tmp")
        with open(tmp, "w") as f:
            f.write("\n".join(map(str, self._known_pids)))
        os.replace(tmp, self._group.path("pids"))
        if self._jobs:  # the watcher cancels these if the kernel dies
            with open(tmp, "w") as f:
                json.dump({"jobs": self._jobs, "slurm_conf": self.launcher.tool_env(self._plan).get("SLURM_CONF")}, f)
            os.replace(tmp, self._group.path("slurm_jobs"))

    def _start_reaper(self):
        # ipyparallel starts its processes in their own sessions, so nothing kills them if the kernel is
        # killed; a tiny watcher process does, and removes the scratch folder (it holds the keys).
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "fsdplab.runtime.reaper", str(os.getpid()), self._group.workdir],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop every process the cluster started and remove its scratch folder; returns when all are gone.

        Raises RuntimeError naming any process that refused to die."""
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        group, survivors = self._group, []
        # First the launcher's own end: a job's steps stop while the controller is still there; mpiexec or ssh
        # end the ranks on every host.
        left = self.launcher.stop(self._plan, group.ipp if group is not None else None, self._jobs)
        if group is not None and (group.ipp is not None or group.procs):
            # Nothing on the ranks is worth saving (a stuck rank ignores polite signals anyway), and
            # ipyparallel's graceful engine shutdown alone takes seconds.
            procs = process_tree(self._all_pids())
            try:
                if group.client is not None:
                    group.client.close()
            except Exception:  # noqa: BLE001
                pass
            survivors = kill_all(procs)
        if self._finalizer is not None:
            self._finalizer()  # ipyparallel's bookkeeping, the watcher, the scratch folder
        self._group = self._reaper = self._finalizer = None
        self._spare_set = self._rank_set = None
        if survivors or left:
            raise RuntimeError("these processes of the cluster did not die: " + ", ".join(
                [f"pid {p.pid} ({' '.join(cmdline(p))[:80]})" for p in survivors] + left))

    def restart(self, quiet: bool = False) -> "Cluster":
        """Kill the ranks (even stuck ones) and start a fresh group with the same settings. quiet: without the
        "ready" line, for a caller that reports the restart itself."""
        quiet = quiet or self.quiet
        with self._lock:
            t0 = time.perf_counter()
            try:
                if self._restart_on_spares():
                    if not quiet:
                        print(f"fsdplab: {self.world_size} fresh rank(s) ready in {time.perf_counter() - t0:.1f} s")
                    return self
            except Exception:  # noqa: BLE001 - fall back to a full start
                pass
            self._shutdown()
            return self._start(quiet)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def __repr__(self):
        state = "stopped" if not self.running else ("broken: " + self.broken if self.broken else "running")
        where = (f", launcher={self.launcher.kind!r}, nodes={self._plan.nodes}" if self._plan is not None else "")
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}{where}, {state})"

    # --- work ---------------------------------------------------------------------------------
    @property
    def pids(self) -> list:
        """Process id of each rank, in rank order."""
        procs = self._group.procs if self._group is not None else {}
        return [procs[r].pid for r in sorted(procs)]

    def _send(self, selected: list, fn, *args, **kwargs) -> dict:
        group = self._group
        return {r: group.client[group.engine_ids[r]].apply_async(fn, *args, **kwargs) for r in selected}

    def _wait(self, results: dict, timeout, quiet: bool, output: str | None = None) -> list:
        __tracebackhide__ = True  # noqa: F841
        from .output import Echo

        echo = Echo(enabled=not (quiet or self.quiet), view=output or self.output)
        return call.wait(self._group, results, self.timeout if timeout is None else timeout, echo)

    def run(self, fn, *args, timeout: float | None = None, ranks=None, quiet: bool = False, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on every rank (or `ranks`); return the values in rank order."""
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's frames, not these
        from . import on_rank

        if not callable(fn):
            raise ValueError(f"run() takes a function to call on each rank, got {type(fn).__name__}. "
                             "For source text use cluster.execute(...).")
        check_timeout(timeout)
        with self._lock:
            selected = call.select(self._group, ranks)
            origins = shipped_code.origins(fn, args, kwargs)  # the cells the ranks' tracebacks name
            return self._wait(self._send(selected, on_rank.call, fn, args, kwargs, origins), timeout, quiet)

    def execute(self, source: str, timeout: float | None = None, ranks=None, quiet: bool = False,
                filename: str | None = None, output: str | None = None) -> None:
        """Run Python source in each rank's namespace (what a %%ranks cell does).

        `filename` names the source in tracebacks (the %%ranks magic passes the notebook cell's); `output`
        ('lines' or 'tabs') shows this call's output that way instead of as the cluster's `output` says."""
        __tracebackhide__ = True  # noqa: F841
        from . import on_rank

        if not isinstance(source, str):
            raise ValueError("execute() takes Python source text; for a function use cluster.run(fn).")
        check_timeout(timeout)
        check_output(output or self.output)
        with self._lock:
            selected = call.select(self._group, ranks)
            name = filename or self._source_name()
            self._wait(self._send(selected, on_rank.run_source, source, name), timeout, quiet, output)

    def _source_name(self) -> str:
        """`<ranks source N from Cell In[M]>`: unique per call (the ranks cache it for tracebacks)."""
        from .tracebacks import cell_of, current_cell_filename

        self._sources += 1
        calling = current_cell_filename()
        cell = cell_of(calling) if calling else None
        return f"<ranks source {self._sources}" + (f" from Cell In[{cell}]" if cell is not None else "") + ">"

    def pull(self, name: str, ranks=None, timeout: float | None = None) -> list:
        """The value of variable `name` in each rank's namespace, in rank order (tensors on the CPU)."""
        __tracebackhide__ = True  # noqa: F841
        from . import on_rank

        check_timeout(timeout)
        with self._lock:
            selected = call.select(self._group, ranks)
            return self._wait(self._send(selected, on_rank.pull, name), timeout, quiet=True)

    def push(self, ranks=None, timeout: float | None = None, **values) -> None:
        """Set variables in each rank's namespace."""
        __tracebackhide__ = True  # noqa: F841
        from . import on_rank

        check_timeout(timeout)
        with self._lock:
            selected = call.select(self._group, ranks)
            origins = shipped_code.origins(values)
            self._wait(self._send(selected, on_rank.push, values, origins), timeout, quiet=True)

    def status(self, quiet: bool = False) -> list:
        """Per rank: pid, host, device, memory in use and what it runs right now; printed as a table."""
        with self._lock:
            if not self.running:
                raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
            rows = self._group.status_rows(self.world_size)
        if not quiet:
            print(status_table(rows))
        return rows

    def flight_recorder_dumps(self, folder, ranks=None, wait_s: float = 5.0) -> dict:
        """Write each rank's flight recorder dump, as torch's analyzer reads it, to `folder`/rank_<r>; works while
        ranks are stuck in a collective. Returns rank -> path for the ranks that answered. Analyze the folder with
        `torchfrtrace FOLDER -p rank_` (python -m torch.distributed.flight_recorder.fr_trace)."""
        if not self.running:
            raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
        return self._group.write_dumps(folder, list(range(self.world_size)) if ranks is None else ranks, wait_s)
