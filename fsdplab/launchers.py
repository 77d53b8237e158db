"""Where the ranks run: on this machine, in a Slurm job, under mpiexec, or over ssh.

`Cluster(launcher=...)` hands its options here. "local" and "slurm" are described in fsdplab.cluster and
fsdplab.slurm; this module adds the two launchers that need no scheduler, both on ipyparallel's own
engine launchers, with the kernel and the controller staying on this machine:

- launcher="mpi": one `mpiexec` (Open MPI or MPICH) starts every rank, on `hosts` (world_size //
  len(hosts) on each, in host order) or on this machine when hosts is None. A rank's place comes from
  the MPI launcher's variables (OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_RANK, or PMI_RANK /
  MPI_LOCALRANKID), its node from the order of the hosts (the one with the lowest MPI rank first);
  never from ipyparallel's engine id, which follows the order the engines connected in.
- launcher="ssh": one `ssh` per rank starts it on its host; ranks by host order, then index on the host.

Both find their ranks as fsdplab.slurm does (placement, then one process group with rank 0's routable
address as MASTER_ADDR, hang stacks and deaths over each rank's answering port, no shared filesystem).
stop() ends mpiexec with SIGTERM (it takes down every rank on every host) or kills each host's ranks
over ssh. A killed kernel's watcher (fsdplab._reaper) kills the controller and mpiexec: Open MPI's
daemons then end their ranks at once; ranks started over ssh leave by themselves about
`_HEARTBEAT_MISSES` seconds after the controller is gone (a rank stuck in Python code for good does not).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile

from . import remote, slurm
from .processes import _check_backend, choose_backend

LAUNCHERS = ("local", "slurm", "mpi", "ssh")
# Which launcher takes each option (anything else given raises a ValueError with the fix).
_OPTION_OF = {"nodes": ("slurm",), "gpus_per_node": ("slurm",), "partition": ("slurm",), "time_limit": ("slurm",),
              "sbatch_args": ("slurm",), "slurm_conf": ("slurm",), "address": ("slurm", "mpi", "ssh"),
              "hosts": ("mpi", "ssh"), "mpi_args": ("mpi",), "ssh_args": ("ssh",), "remote_python": ("ssh",)}
# An engine whose controller stopped answering leaves after this many 1-second checks (ipyparallel's
# default, 50, would keep the ranks of a killed kernel alive for close to a minute).
_HEARTBEAT_MISSES = 10
_IPP_VARS = ("IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """Ranks started by mpiexec or ssh: `per_node` on each of `hosts` (none: this machine, under mpiexec)."""

    launcher: str
    hosts: tuple
    nodes: int
    per_node: int
    address: str  # where the ranks reach this machine (the controller)
    args: tuple  # mpi_args or ssh_args
    remote_python: str
    flavor: str  # "openmpi", "mpich" or "" (an mpiexec this module does not know)
    env: dict = dataclasses.field(default_factory=dict)  # no scheduler tools to call
    gpus_per_node: int = 0


# --- the launchers as objects: each holds its own options ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Local:
    """The ranks are processes on this machine (the default)."""

    kind = "local"


@dataclasses.dataclass(frozen=True)
class Slurm:
    """The ranks run in one Slurm job of `nodes` nodes: Cluster(8, launcher=Slurm(nodes=2, partition="gpu"))."""

    kind = "slurm"
    nodes: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time_limit: str | None = None
    sbatch_args: list | None = None
    slurm_conf: str | None = None
    address: str | None = None


@dataclasses.dataclass(frozen=True)
class Mpi:
    """One mpiexec starts the ranks on `hosts` (None: this machine): Cluster(4, launcher=Mpi(hosts=["a", "b"]))."""

    kind = "mpi"
    hosts: list | None = None
    mpi_args: list | None = None
    address: str | None = None


@dataclasses.dataclass(frozen=True)
class Ssh:
    """ssh starts each rank on its host: Cluster(4, launcher=Ssh(hosts=["node1", "node2"], ssh_args=["-i", KEY]))."""

    kind = "ssh"
    hosts: list | None = None
    ssh_args: list | None = None
    remote_python: str | None = None
    address: str | None = None


LAUNCHER_CLASSES = {cls.kind: cls for cls in (Local, Slurm, Mpi, Ssh)}


def resolve(launcher, flat: dict) -> tuple:
    """(kind, every option by name) from a launcher object, or from a kind's name plus Cluster's flat options
    (the older form: it still works, with a note naming the object to write instead)."""
    given = {name: value for name, value in flat.items() if value is not None}
    if isinstance(launcher, tuple(LAUNCHER_CLASSES.values())):
        if given:
            raise ValueError(f"{', '.join(given)} given to Cluster and a launcher object: put them in the object, "
                             f"e.g. launcher=fsdplab.{type(launcher).__name__}({next(iter(given))}=...).")
        return launcher.kind, {**dict.fromkeys(flat), **dataclasses.asdict(launcher)}
    if isinstance(launcher, str) and launcher in LAUNCHER_CLASSES and launcher != "local" and given:
        cls = LAUNCHER_CLASSES[launcher]
        fits = ", ".join(f"{k}={v!r}" for k, v in given.items() if k in {f.name for f in dataclasses.fields(cls)})
        import warnings

        warnings.warn(f"launcher={launcher!r} with options on Cluster still works, but the options now belong to "
                      f"the launcher: write launcher=fsdplab.{cls.__name__}({fits}).", FutureWarning, stacklevel=3)
    return launcher, {**dict.fromkeys(flat), **given}


def options(launcher: str, world_size: int, backend: str, given: dict):
    """(options for the launcher, None for "local"; the backend) after checking every option."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher is fsdplab.Local(), Slurm(...), Mpi(...) or Ssh(...) (or one of "
                         f"{', '.join(map(repr, LAUNCHERS))}), got {launcher!r}: Local runs the ranks on this "
                         "machine, Slurm in a Slurm job, Mpi under mpiexec, Ssh over ssh.")
    wrong = [k for k, v in given.items() if v is not None and launcher not in _OPTION_OF[k]]
    if wrong:
        owners = sorted({o for k in wrong for o in _OPTION_OF[k]}, key=LAUNCHERS.index)
        where = "ranks on this machine" if launcher == "local" else "not " + " or ".join(owners)
        raise ValueError(f"{', '.join(wrong)} only apply to launcher={' or '.join(map(repr, owners))} (this is "
                         f"launcher={launcher!r}, {where}): add launcher={owners[0]!r} or leave them out.")
    if launcher == "local":
        return None, choose_backend(world_size, backend)
    choose_backend(world_size, "gloo")  # checks world_size
    _check_backend(backend)
    if launcher == "slurm":
        slurm_given = {k: given[k] for k in _OPTION_OF if "slurm" in _OPTION_OF[k]}
        return slurm.options(world_size, backend, **{**slurm_given, "nodes": given["nodes"] or 1})
    hosts = _hosts(launcher, given["hosts"], world_size)
    args = given["mpi_args"] if launcher == "mpi" else given["ssh_args"]
    name = "mpi_args" if launcher == "mpi" else "ssh_args"
    if args is not None and (isinstance(args, str) or not all(isinstance(a, str) for a in args)):
        raise ValueError(f"{name} is a list of strings, one per command-line word (e.g. ['-p', '2222']), "
                         f"got {args!r}.")
    flavor = _mpi_flavor() if launcher == "mpi" else ""
    remote_python = given["remote_python"] or sys.executable
    if not isinstance(remote_python, str):
        raise ValueError(f"remote_python is the path of Python on the hosts, got {remote_python!r}.")
    # The hosts' GPUs are not known here: there nccl only when asked for (one GPU per rank on each host).
    backend = choose_backend(world_size, backend) if not hosts else ("gloo" if backend == "auto" else backend)
    address = given["address"] or (slurm.this_address() if hosts else "127.0.0.1")
    nodes = max(1, len(hosts))
    return RemoteOptions(launcher, hosts, nodes, world_size // nodes, address, tuple(args or ()),
                         remote_python, flavor, gpus_per_node=world_size // nodes if backend == "nccl" else 0), backend


def _hosts(launcher: str, hosts, world_size: int) -> tuple:
    if hosts is None and launcher == "ssh":
        raise ValueError("launcher='ssh' needs hosts=[...], the machines to start ranks on (names or "
                         "addresses ssh reaches without a password, e.g. hosts=['node1', 'node2']).")
    if hosts is None:
        return ()
    if isinstance(hosts, str) or not hosts or not all(isinstance(h, str) and h and not set(h) & set(" ,\t\n")
                                                      for h in hosts):
        raise ValueError(f"hosts is a list of host names such as ['node1', 'node2'] (user@host and host:port "
                         f"work with launcher='ssh'), got {hosts!r}.")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"hosts lists a host twice ({list(hosts)}): name each host once; world_size sets how "
                         "many ranks each one runs.")
    if world_size % len(hosts):
        raise ValueError(f"world_size={world_size} does not split evenly over {len(hosts)} hosts: every host runs "
                         f"the same number of ranks. Use a world_size that is a multiple of {len(hosts)}.")
    return tuple(hosts)


def _mpi_flavor() -> str:
    if shutil.which("mpiexec") is None:
        raise ValueError("launcher='mpi' needs mpiexec, which is not found. Install an MPI (Debian/Ubuntu: "
                         "apt-get install openmpi-bin; on a cluster often `module load openmpi`), or use "
                         "launcher='ssh'.")
    if importlib.util.find_spec("mpi4py") is None:
        raise ValueError("launcher='mpi' needs mpi4py (each rank imports it to learn its MPI rank): "
                         "pip install mpi4py, on this machine and on every host.")
    try:
        text = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text) else ("mpich" if "HYDRA" in text.upper() else "")


# --- starting -------------------------------------------------------------------------------------
def where(opts) -> dict:
    """ipp.Cluster arguments: which engine launcher, and where the controller listens."""
    if opts is None:
        return {}
    engines = "slurm" if isinstance(opts, slurm.SlurmOptions) else opts.launcher
    return dict(engines=engines, controller_ip=opts.address, controller_location=opts.address)


def configure(ipp_cluster, opts, env: dict, path) -> None:
    """Configure the engine launcher of `opts` (after the cluster set engine_cmd and engine_args)."""
    config = ipp_cluster.config
    if opts is None:
        return
    if isinstance(opts, slurm.SlurmOptions):
        slurm.configure(ipp_cluster, opts, env)
        config.SlurmEngineSetLauncher.batch_file_name = path("slurm_engines.sbatch")
        config.SlurmEngineSetLauncher.engine_args = list(config.LocalEngineSetLauncher.engine_args)
        config.SlurmEngineSetLauncher.engine_cmd = list(config.LocalEngineSetLauncher.engine_cmd)
        return
    launcher = config.MPIEngineSetLauncher if opts.launcher == "mpi" else config.SSHEngineSetLauncher
    # The engine_args and engine_cmd the cluster set on the local launcher, for this one.
    launcher.engine_args = list(config.LocalEngineSetLauncher.engine_args) + [
        f"--IPEngine.max_heartbeat_misses={_HEARTBEAT_MISSES}"]
    passed = {**env, **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}
    if opts.launcher == "mpi":
        launcher.engine_cmd = list(config.LocalEngineSetLauncher.engine_cmd)
        launcher.environment = passed
        launcher.mpi_args = mpi_args(opts, passed)
        return
    launcher.engine_cmd = [opts.remote_python, "-m", "fsdplab._engine"]
    launcher.remote_python = opts.remote_python
    launcher.ssh_args = list(opts.args)
    launcher.scp_args = ["-P" if a == "-p" else a for a in opts.args]  # scp spells the port -P
    # A folder of its own on each host for the connection file (never the local profile folder: on a
    # shared filesystem scp would copy the file onto itself); the ranks remove it once connected.
    remote_dir = os.path.join(tempfile.gettempdir(), f"fsdplab-remote-{secrets.token_hex(6)}")
    launcher.engines = {host: {"n": opts.per_node, "remote_profile_dir": remote_dir,
                               "environment": {**passed, "FSDPLAB_NODE": str(i)}}
                        for i, host in enumerate(opts.hosts)}


def mpi_args(opts: RemoteOptions, env: dict) -> list:
    """mpiexec's options: the hosts and slots, the environment for ranks on other hosts, the user's last."""
    args = []
    hosts = ",".join(f"{h}:{opts.per_node}" for h in opts.hosts)
    if opts.flavor == "mpich":  # Hydra passes the whole environment on
        args += ["-ppn", str(opts.per_node), "-hosts", ",".join(opts.hosts)] if opts.hosts else []
    elif opts.flavor == "openmpi":
        args += ["--allow-run-as-root"] if os.geteuid() == 0 else []  # containers often run as root
        args += ["--host", hosts] if opts.hosts else ["--oversubscribe"]  # more ranks than cores is allowed here
        # Open MPI passes only what -x names to ranks on other hosts (the engines find the controller by these).
        for name in (*_IPP_VARS, *env):
            args += ["-x", name]
    elif opts.hosts:
        args += ["--host", hosts]
    return args + list(opts.args)


def refused(launcher: str, error: Exception) -> str | None:
    """The error for a launcher command that failed while starting the ranks (None: not one of those)."""
    if launcher == "slurm" and isinstance(error, subprocess.CalledProcessError):
        return (f"sbatch refused the job (exit code {error.returncode}; its message is printed above): check "
                "nodes=, partition=, time_limit= and sbatch_args=.")
    if launcher != "ssh":
        return None
    if isinstance(error, subprocess.CalledProcessError):
        words = shlex.join(error.cmd) if isinstance(error.cmd, list) else str(error.cmd)
        error = f"`{words[:200]}` failed with exit code {error.returncode}"
    return (f"starting the ranks over ssh failed ({error}; ssh's own message is printed above): check that "
            "`ssh HOST` works here without a password for every host (ssh_args= passes options such as "
            "['-i', KEY, '-p', PORT]) and that remote_python= has fsdplab installed there.")


def mpiexec_ended(ipp_cluster) -> str | None:
    """Why the ranks will never connect, when mpiexec has already exited (None while it runs)."""
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher

    for engine_set in list(ipp_cluster.engines.values()):
        process = getattr(engine_set, "process", None)
        if isinstance(engine_set, MPIEngineSetLauncher) and process is not None and not _running(process):
            tail = "".join(engine_set.get_output().splitlines(True)[-20:]).strip()
            return (f"mpiexec exited before the ranks connected; its last words:\n{tail}\nCheck hosts= (mpiexec "
                    "reaches other hosts over ssh without a password) and mpi_args=.")
    return None


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- placement ------------------------------------------------------------------------------------
def mpi_placement() -> dict:
    """On a rank: its MPI rank and index on its host (Open MPI, MPICH or PMIx variables) and its host."""
    import socket

    def first(*names):
        for name in names:
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return None

    return {"procid": first("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
            "localid": first("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), "nodeid": None,
            "host": socket.gethostname(), "pid": os.getpid()}


def ssh_placement() -> dict:
    """On a rank: the index of its host in `hosts` (set per host by the launcher), its host and pid."""
    import socket

    # Every engine has read the connection file by now: remove it, so that no key stays on the host even
    # if the kernel is killed (and stop() has nothing left to remove).
    folder = os.environ.get("IPP_PROFILE_DIR", "")
    if os.path.basename(folder).startswith("fsdplab-remote-"):
        shutil.rmtree(folder, ignore_errors=True)
    node = os.environ.get("FSDPLAB_NODE", "")
    return {"procid": None, "localid": None, "nodeid": int(node) if node.isdigit() else None,
            "host": socket.gethostname(), "pid": os.getpid()}


def places_of(cluster) -> list:
    """Each engine's place, in the cluster's engine order, with node and local index filled in."""
    opts, ipp = cluster._remote, cluster._ipp
    places = cluster._client[cluster._engine_ids].apply_async(
        mpi_placement if opts.launcher == "mpi" else ssh_placement).get(timeout=120)
    if opts.launcher == "mpi":
        # Node index: hosts in the order of their lowest MPI rank (mpiexec fills each host in turn).
        lowest = {}
        for p in places:
            lowest[p["host"]] = min(lowest.get(p["host"], p["procid"]), p["procid"])
        order = sorted(lowest, key=lowest.get)
        for p in places:
            p["nodeid"] = order.index(p["host"])
    else:
        # Index on the host: the position of the engine's launcher ("host/i") among that host's launchers.
        started = {}
        for engine_set in ipp.engines.values():
            for key, launcher in getattr(engine_set, "launchers", {}).items():
                host, _, i = key.rpartition("/")
                started[(opts.hosts.index(host), launcher.pid)] = int(i)
        for p in places:
            p["localid"] = started.get((p["nodeid"], p["pid"]))
    counts = [sum(p["nodeid"] == n for p in places) for n in range(opts.nodes)]
    if counts != [opts.per_node] * opts.nodes or any(p["localid"] is None for p in places):
        raise RuntimeError(f"the ranks did not land {opts.per_node} per host on {opts.nodes} host(s) (ranks per "
                           f"host: {counts}; hosts {sorted({p['host'] for p in places})}). Check mpi_args= for "
                           "options that change where mpiexec puts ranks.")
    return places


def join_group(cluster):
    """The process group of an mpi or ssh cluster: `remote.join_group` with these launchers' placements."""
    return remote.join_group(cluster, places_of(cluster))


# --- stopping -------------------------------------------------------------------------------------
def local_pids(ipp_cluster) -> list:
    """Processes the engine launchers started on this machine: each local engine, mpiexec (never the remote
    pid an ssh launcher holds)."""
    from ipyparallel.cluster.launcher import LocalProcessLauncher, SSHLauncher

    pids = []
    for engine_set in list(ipp_cluster.engines.values()) if ipp_cluster is not None else []:
        if isinstance(engine_set, LocalProcessLauncher) and not isinstance(engine_set, SSHLauncher):
            pids += [engine_set.pid] if engine_set.pid > 0 else []
        pids += [launcher.pid for launcher in list(getattr(engine_set, "launchers", {}).values())
                 if not isinstance(launcher, SSHLauncher) and launcher.pid > 0]
    return pids


def stop_remote(cluster, wait_s: float = 10.0) -> list:
    """End the ranks of an mpi or ssh cluster on every host; returns what could not be ended, as text."""
    opts, ipp = cluster._remote, cluster._ipp
    if not isinstance(opts, RemoteOptions) or ipp is None:
        return []
    if opts.launcher == "mpi":
        return _stop_mpiexec(ipp, wait_s)
    return _stop_over_ssh(ipp, opts, wait_s)


def _stop_mpiexec(ipp, wait_s: float) -> list:
    import psutil

    left = []
    for pid in local_pids(ipp):
        try:
            proc = psutil.Process(pid)
            proc.terminate()  # mpiexec passes SIGTERM on to every rank on every host, then exits
            proc.wait(wait_s)
        except psutil.TimeoutExpired:
            left.append(f"mpiexec (pid {pid}) did not end within {wait_s:g} s of SIGTERM")
        except psutil.Error:
            pass
    return left


def _stop_over_ssh(ipp, opts: RemoteOptions, wait_s: float) -> list:
    """One ssh per host: SIGKILL its ranks, remove the connection folder, and list any rank still there."""
    per_host, folders = {}, {}
    # Out of ipyparallel's hands: its own stop signals each rank and fetches its log over ssh, ~20 s a rank.
    sets = [ipp.engines.pop(name) for name in list(ipp.engines)]
    for engine_set in sets:
        for key, launcher in getattr(engine_set, "launchers", {}).items():
            if getattr(launcher, "_stop_waiting", None) is not None:
                launcher._stop_waiting.set()
            host = key.rpartition("/")[0]
            folders[host] = launcher.remote_profile_dir
            if isinstance(launcher.pid, int) and launcher.pid > 1:  # -1: never started (`kill -9 -1` kills all)
                per_host.setdefault(host, []).append(launcher.pid)
    running = {}
    for host in folders:
        pids = per_host.get(host, [])
        ids = " ".join(map(str, pids)) or "none"
        kill = f"kill -9 {ids} 2>/dev/null; sleep 0.2; " if pids else ""
        script = (f"{kill}rm -rf {shlex.quote(folders[host])}; for p in {ids}; do [ $p = none ] && continue; "
                  "s=$(ps -o stat= -p $p); case \"$s\" in ''|Z*) ;; *) echo $p;; esac; done")
        running[host] = subprocess.Popen(["ssh", *opts.args, *_ssh_target(host), "sh", "-c", shlex.quote(script)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    left = []
    for host, proc in running.items():
        try:
            out, err = proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = "", "ssh did not answer"
        if per_host.get(host) and (proc.returncode != 0 or out.split()):  # else nothing ran there
            why = err.strip()[:80] or "still running"
            left.append(f"ranks {out.split() or per_host.get(host, [])} on {host} ({why})")
    return left


def _ssh_target(host: str) -> list:
    """ssh's words for a host as ipyparallel spells it: [user@]name[:port]."""
    user, _, rest = host.rpartition("@")
    name, _, port = rest.partition(":")
    return (["-p", port] if port else []) + [f"{user}@{name}" if user else name]
