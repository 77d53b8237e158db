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
  warm where memory allows, so restart() only has to join a group;
- fsdplab.waiting waits on calls and raises the faults (fsdplab.faults); fsdplab.processes knows the
  machine's capacity and kills what was started; fsdplab.slurm runs the ranks on the nodes of a Slurm
  cluster instead (launcher="slurm"), fsdplab.launchers under mpiexec or over ssh ("mpi", "ssh"): the
  kernel and the controller stay here, ranks by node and index on the node, rank 0's routable address
  as MASTER_ADDR, faults told over the network.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from . import forkserver, hang, launchers, shipped_code, slurm
from .faults import RankDied, RankError, RankHang, _running_text, _status_table
from .processes import (_alive, _check_output, _check_timeout, _cleanup, _cmdline, _kill_all, _process_tree,
                        _checked_env, check_capacity, choose_backend, free_port, gpu_count, max_world_size)
from .remote import RemoteRank
from .waiting import Waiting

__all__ = ["Cluster", "RankError", "RankHang", "RankDied", "free_port", "gpu_count", "choose_backend",
           "max_world_size", "check_capacity"]

LAUNCHERS = launchers.LAUNCHERS


class Cluster(Waiting):
    """`world_size` ranks in one process group, kept alive across notebook cells.

    >>> with Cluster(2) as cluster:
    ...     cluster.run(lambda: fsdplab.rank())
    [0, 1]

    launcher=fsdplab.Local() (the default; or "local"): the ranks are processes on this machine. launcher=
    fsdplab.Slurm(nodes=2, ...): one Slurm job runs them on `nodes` nodes, world_size // nodes per node, while the
    kernel and the controller stay here (a login node). Slurm's options: `nodes`, `gpus_per_node` (default: one per rank
    under nccl), `partition`, `time_limit` (sbatch --time, e.g. "1:00:00"), `sbatch_args` (more sbatch
    options, e.g. ["--account=proj"]; CPU ranks run as many threads as its --cpus-per-task, else 1), `slurm_conf` (default $SLURM_CONF), `address` (where the nodes
    reach this machine; default what its host name resolves to). `start_timeout`: seconds the ranks
    may take to connect (a Slurm job still pending then is cancelled, with Slurm's reason).

    launcher=fsdplab.Mpi(...): one mpiexec starts the ranks on `hosts` (world_size // len(hosts) each; None: this
    machine), `mpi_args` appended to its command line. launcher=fsdplab.Ssh(...): ssh starts them on `hosts`
    ([user@]name[:port]), with `ssh_args` (e.g. ["-i", KEY]) and `remote_python` (default: this
    Python's path). Both keep kernel and controller here (fsdplab.launchers). `env`: variables each rank starts with.
    """

    _latest = None  # weak reference to the most recently started cluster (what %%ranks uses by default)

    @classmethod
    def latest(cls) -> "Cluster | None":
        """The most recently started cluster that is still running, if any."""
        cluster = cls._latest() if cls._latest is not None else None
        return cluster if cluster is not None and cluster._client is not None else None

    def __init__(self, world_size: int = 2, backend: str = "auto", timeout: float = 120.0,
                 collective_timeout: float = 300.0, quiet: bool = False, record_collectives: bool = True,
                 spares: bool = True, output: str = "lines", launcher="local", nodes: int | None = None,
                 gpus_per_node: int | None = None, partition: str | None = None, time_limit: str | None = None,
                 sbatch_args: list | None = None, slurm_conf: str | None = None, address: str | None = None,
                 start_timeout: float = 120.0, hosts: list | None = None, mpi_args: list | None = None,
                 ssh_args: list | None = None, remote_python: str | None = None, env: dict | None = None):
        self.launcher, given = launchers.resolve(launcher, dict(  # a launcher object, or a name + flat options
            nodes=nodes, gpus_per_node=gpus_per_node, partition=partition, time_limit=time_limit,
            sbatch_args=sbatch_args, slurm_conf=slurm_conf, address=address, hosts=hosts, mpi_args=mpi_args,
            ssh_args=ssh_args, remote_python=remote_python))
        self._remote, self.backend = launchers.options(self.launcher, world_size, backend, given)
        spares = spares if self._remote is None else False  # elsewhere spares would hold nodes idle
        self.output = _check_output(output)
        for name, value in (("record_collectives", record_collectives), ("spares", spares)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} is True or False, got {value!r}.")
        # record_collectives: torch's flight recorder on the ranks, so RankHang can say which collective
        # each rank is in. spares: a second set of rank processes, started and idle (torch imported) once
        # the group is up, so restart() after a fault takes the time of joining a group, not of starting.
        self.record_collectives, self.spares = record_collectives, spares
        self.env = _checked_env(env)   # set in every rank process before torch starts (NCCL_DEBUG=INFO, say)
        _check_timeout(timeout)
        _check_timeout(collective_timeout, "collective_timeout")
        _check_timeout(start_timeout, "start_timeout")
        if self.backend == "gloo" and (self._remote is None or getattr(self._remote, "hosts", None) == ()):
            check_capacity(world_size)
        self.world_size, self.timeout, self.collective_timeout = world_size, timeout, collective_timeout
        self.start_timeout = start_timeout
        self.quiet = quiet
        self._ipp = self._client = self._reaper = self._finalizer = None
        self._engine_ids: list = []      # engine id of each rank, in rank order
        self._procs: dict = {}           # rank -> psutil.Process (RemoteRank for a rank on another node)
        self._launched_by: dict = {}     # rank pid -> the launcher's process, where they differ (forkserver)
        self._jobs: list = []            # Slurm job ids, for the finalizer and the watcher (updated in place)
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
            self._finalizer = weakref.finalize(self, _cleanup, None, self._known_pids, self._reaper, self._workdir,
                                               self._jobs, self._remote_env())
            try:
                self._start_processes()
                self._join_group()
            except BaseException:
                self._shutdown()
                raise
            Cluster._latest = weakref.ref(self)
            self._start_spares(only_if_wanted=True)
            if not self.quiet:
                how = "Slurm job " + ", ".join(self._jobs) if self._jobs else f"launcher={self.launcher!r}"
                where = f", {self._remote.nodes} node(s) x {self._remote.per_node} ({how})" if self._remote else ""
                print(f"fsdplab: {self.world_size} rank(s) ready on {self.backend} "
                      f"({'one GPU per rank' if self.backend == 'nccl' else f'CPU, {self._threads} thread(s) each'}"
                      f"{where}) in {time.perf_counter() - t0:.1f} s")
            return self

    @property
    def _threads(self) -> int:
        if self.launcher == "slurm":  # a Slurm task gets one CPU unless sbatch_args ask for more
            return self._remote.cpus_per_task if self.backend == "gloo" else 4
        per_machine = self._remote.per_node if self._remote is not None else self.world_size  # hosts like this one
        return max(1, (os.cpu_count() or 1) // per_machine) if self.backend == "gloo" else 4

    def _remote_env(self) -> dict | None:
        return self._remote.env if self._remote is not None else None

    def _engine_env(self) -> dict:
        # torch's flight recorder keeps the last collectives of each rank for the hang explainer.
        record = hang.FR_ENV if self.record_collectives else {"TORCH_FR_BUFFER_SIZE": "0"}
        return {"OMP_NUM_THREADS": str(self._threads), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                **record, **self.env}

    def _start_processes(self) -> None:
        import ipyparallel as ipp

        env = self._engine_env()
        # The controller registers an engine only after a heartbeat; the default 3 s period alone made
        # start-up take 7 s instead of 2. Schedulers as threads: one controller process.
        controller_args = ["--HeartMonitor.period=500", "--IPController.use_threads=True"]
        if self._remote is not None:
            # Listen where the nodes reach this machine (launchers.where); drop an engine after 3 s of missed
            # heartbeats (how a rank on another node that died is noticed when its node cannot say).
            controller_args.append("--HeartMonitor.max_heartmonitor_misses=6")
        self._ipp = ipp.Cluster(
            n=self.world_size, log_level=logging.ERROR, cluster_id=f"fsdplab-{os.getpid()}-{id(self)}",
            profile_dir=os.path.join(self._workdir, "profile"), shutdown_atexit=False,
            controller_args=controller_args, **launchers.where(self._remote))
        engines = self._ipp.config.LocalEngineSetLauncher
        engines.environment = self._ipp.config.LocalControllerLauncher.environment = env
        # No nanny process per engine: the kernel watches and signals the ranks itself.
        engines.engine_args = ["--IPEngine.enable_nanny=False"]
        engines.engine_cmd = [sys.executable, "-m", "fsdplab._engine"]
        if self._remote is None:   # on this machine, forks of `fsdplab run`'s fork server where there is one
            engines.engine_cmd = forkserver.command("fsdplab._engine")
            self._ipp.config.LocalControllerLauncher.controller_cmd = forkserver.command("ipyparallel.controller")
        launchers.configure(self._ipp, self._remote, env, self._path)  # Slurm, mpiexec or ssh: from these
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self._ipp, self._known_pids, self._reaper,
                                           self._workdir, self._jobs, self._remote_env())
        self._ipp.start_controller_sync()
        self._write_pidfile()
        try:
            self._ipp.start_engines_sync(self.world_size)
        except Exception as error:  # sbatch refused the job, or ssh failed: say what to check
            message = launchers.refused(self.launcher, error)
            if message is None:
                raise
            raise RuntimeError(message) from None
        self._jobs[:] = slurm.job_ids(self._ipp)
        self._write_pidfile()
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
        if self._ipp is None or self._remote is not None or getattr(self, "_spare_set", None) is not None:
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
        """Replace the ranks, keeping the controller: by the spares started at the fault, or (Slurm) by a new
        job once the old one has left the queue; False if not possible."""
        new_job = bool(self._jobs)  # only a Slurm cluster has jobs
        if self._ipp is None or self._client is None or not (new_job or getattr(self, "_spare_set", None)):
            return False
        controller = self._controller_pid()
        if controller is None or not _alive(__import__("psutil").Process(controller)):
            return False
        if new_job:
            if slurm.cancel(self._jobs, self._remote.env):
                return False
            self._ipp.engines.pop(self._rank_set, None)
            self._spare_set = self._ipp.start_engines_sync(self.world_size)
            self._jobs[:] = slurm.job_ids(self._ipp)
            self._write_pidfile()
        else:
            if _kill_all(_process_tree(p.pid for p in self._procs.values())):
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
        t0 = time.monotonic()
        deadline, next_look = t0 + self.start_timeout, t0 + 1.0
        while True:
            new = sorted(set(self._client.ids) - old_ids)
            if len(new) >= self.world_size:
                return new[:self.world_size]
            now = time.monotonic()
            if self._jobs and (now > next_look or now > deadline):  # a Slurm job that failed or still waits
                next_look = now + 1.0
                problem = slurm.start_problem(self._jobs[0], self._remote.env, now - t0, now > deadline)
                if problem:
                    left = slurm.cancel(self._jobs, self._remote.env)
                    raise RuntimeError(problem + (f" (squeue still lists {left})" if left else ""))
            elif self.launcher == "mpi" and (ended := launchers.mpiexec_ended(self._ipp)):
                raise RuntimeError(ended)  # e.g. a host mpiexec cannot reach
            elif now > deadline:
                raise RuntimeError(f"{self.world_size} rank process(es) did not start within {self.start_timeout:g} "
                                   f"s; see the engine logs in {self._workdir}/profile/log, or try a smaller "
                                   "world_size.")
            time.sleep(0.02)

    def _join_group(self):
        import psutil

        from . import dist

        self._client[self._engine_ids].use_cloudpickle()
        if self._remote is not None:
            join = slurm.join_group if self.launcher == "slurm" else launchers.join_group
            self._engine_ids, self._info, self._procs = join(self)
            return self._joined()
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
        # A rank forked by a fork server: the launcher watches its stand-in, which exits with the rank's code.
        self._launched_by = {i["pid"]: launched[i["launched_by"]] for i in self._info
                             if i.get("launched_by") != i["pid"] and i.get("launched_by") in launched}
        self._joined()

    def _joined(self):
        self._write_pidfile()
        # Names a %%ranks cell can use without importing anything.
        self._client[self._engine_ids].execute(
            "import torch, torch.distributed as dist, fsdplab\n"
            "from fsdplab import rank, world_size, device, mesh, print0\n"
            "from fsdplab.dist import local_rank, node_rank, node_mesh", block=True)
        self._broken = None

    def _path(self, name: str) -> str:
        return os.path.join(self._workdir, name)

    def _controller_pid(self):
        controller = getattr(self._ipp, "controller", None) if self._ipp is not None else None
        process = getattr(controller, "process", None)
        return process.pid if process is not None else None

    def _all_pids(self) -> list:
        """Processes on this machine (a rank on another node is not one: its Slurm job is)."""
        pids = [p.pid for p in self._procs.values() if not isinstance(p, RemoteRank)]
        pids += launchers.local_pids(self._ipp)  # never the pid of a rank an ssh launcher started elsewhere
        controller = self._controller_pid()
        return sorted(set(pids + ([controller] if controller else [])))

    def _write_pidfile(self):
        self._known_pids[:] = self._all_pids()
        tmp = self._path("pids.tmp")
        with open(tmp, "w") as f:
            f.write("\n".join(map(str, self._known_pids)))
        os.replace(tmp, self._path("pids"))
        if self._jobs:  # the watcher cancels these if the kernel dies
            with open(tmp, "w") as f:
                json.dump({"jobs": self._jobs, "slurm_conf": self._remote.env.get("SLURM_CONF")}, f)
            os.replace(tmp, self._path("slurm_jobs"))

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
        survivors, left = [], []
        if self._jobs:  # first: the ranks' job; its steps stop while the controller is still there
            left = slurm.cancel(self._jobs, self._remote.env)
            self._jobs[:] = left
        remote_left = launchers.stop_remote(self)  # mpiexec or ssh: the ranks on every host
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
        if survivors or left or remote_left:
            raise RuntimeError("these processes of the cluster did not die: " + ", ".join(
                [f"pid {p.pid} ({' '.join(_cmdline(p))[:80]})" for p in survivors]
                + [f"Slurm job {j} (squeue still lists it)" for j in left] + remote_left))

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
        where = f", launcher={self.launcher!r}, nodes={self._remote.nodes}" if self._remote is not None else ""
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}{where}, {state})"

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
            origins = shipped_code.origins(fn, args, kwargs)  # the cells the ranks' tracebacks name
            results = {r: self._client[self._engine_ids[r]].apply_async(dist.call, fn, args, kwargs, origins)
                       for r in selected}
            return self._wait(results, timeout, quiet)

    def execute(self, source: str, timeout: float | None = None, ranks=None, quiet: bool = False,
                filename: str | None = None, output: str | None = None) -> None:
        """Run Python source in each rank's namespace (what a %%ranks cell does).

        `filename` names the source in tracebacks (the %%ranks magic passes the notebook cell's); `output`
        ('lines' or 'tabs') shows this call's output that way instead of as the cluster's `output` says."""
        __tracebackhide__ = True  # noqa: F841
        from . import dist

        if not isinstance(source, str):
            raise ValueError("execute() takes Python source text; for a function use cluster.run(fn).")
        _check_timeout(timeout)
        _check_output(output or self.output)
        with self._lock:
            selected = self._ranks(ranks)
            name = filename or self._source_name()
            results = {r: self._client[self._engine_ids[r]].apply_async(dist.run_source, source, name)
                       for r in selected}
            self._wait(results, timeout, quiet, output)

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
        from . import dist

        _check_timeout(timeout)
        with self._lock:
            selected = self._ranks(ranks)
            origins = shipped_code.origins(values)
            results = {r: self._client[self._engine_ids[r]].apply_async(dist.push, values, origins) for r in selected}
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
                rows.append({"rank": r, "pid": self._procs[r].pid,
                             "host": getattr(self._procs[r], "host", None) or socket.gethostname(),
                             "device": self._info[r]["device"], "rss_bytes": state.get("rss"),
                             "cuda_allocated_bytes": state.get("cuda_allocated"),
                             "cuda_reserved_bytes": state.get("cuda_reserved"),
                             "running": _running_text(r, state, self._rank_alive(self._procs[r]))})
        if not quiet:
            print(_status_table(rows))
        return rows
