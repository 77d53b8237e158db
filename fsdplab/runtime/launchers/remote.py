"""Ranks on other machines, whatever started them (Slurm, mpiexec, ssh): their order, how they become one
process group, and the handle through which the kernel watches each one.

`RemoteLauncher` is what Slurm, Mpi and Ssh share. Each finds where its engines landed (`places`:
node index, index on the node, task id, host, pid); `join_group` numbers the ranks by node, then by
index on the node, opens the group's store on rank 0's routable address, and has every rank join. A
rank's process is on another machine, so the kernel holds a `RemoteRank`: gone when the controller
drops its engine or its answering port refuses connections.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from .. import introspect
from .base import Launcher


@dataclasses.dataclass(frozen=True)
class RemoteLauncher(Launcher):
    """A launcher whose ranks may run on other machines (the kernel and the controller stay here). Its plan
    has at least `nodes`, `per_node` and `address` (where the ranks reach this machine)."""

    def threads(self, plan, world_size: int, backend: str) -> int:
        import os

        # hosts like this one
        return max(1, (os.cpu_count() or 1) // plan.per_node) if backend == "gloo" else 4

    def ipp_args(self, plan) -> dict:
        return dict(engines=self.kind, controller_ip=plan.address, controller_location=plan.address)

    def engine_cmd(self) -> list:
        """The command that starts a rank on a node: a new interpreter there, never this machine's
        `processes.python_command` (`fsdplab run` points that at its fork server, whose forks run here: through
        srun on another node they would still fork on this one)."""
        return [sys.executable, "-m", "fsdplab.runtime.engine"]

    def places(self, plan, group) -> list:
        """Each engine's place, in the order of `group.engine_ids` (see the module's docstring)."""
        raise NotImplementedError

    def join_group(self, plan, group) -> tuple:
        return (*join_group(plan, group, self.places(plan, group)), {})

    def describe(self, plan, jobs: list) -> str:
        how = "Slurm job " + ", ".join(jobs) if jobs else f"launcher={self.kind!r}"
        return f", {plan.nodes} node(s) x {plan.per_node} ({how})"


def rank_order(places: list) -> list:
    """Indices of `places` in rank order: by node, then index on the node (then task id), never by
    engine id (ipyparallel numbers engines in the order they connect)."""
    def key(i):
        p = places[i]
        return (p["nodeid"] if p["nodeid"] is not None else 0, p["localid"] if p["localid"] is not None else 0,
                p["procid"] if p["procid"] is not None else i)

    return sorted(range(len(places)), key=key)


def join_group(plan, group, places: list) -> tuple[list, list, dict]:
    """Make the group's engines one process group: ranks by (node, index on the node) from `places`
    (each engine's place as its launcher found it: Slurm's task variables, MPI's rank variables, the
    host order), rank 0's routable address as MASTER_ADDR (the store listens there), and each rank
    answering the kernel on TCP (no shared scratch folder). Returns engine ids in rank order, what
    each rank's setup returned, and rank -> RemoteRank."""
    import secrets

    from .. import on_rank as dist

    opts, client = plan, group.client
    order = rank_order(places)
    engine_ids = [group.engine_ids[i] for i in order]
    places = [places[i] for i in order]
    first = client[engine_ids[0]]
    master = first.apply_async(dist.routable_address, opts.address).get(timeout=60)
    port = first.apply_async(dist.open_store, world_size=group.world_size,
                             timeout_s=group.collective_timeout, host=master).get(timeout=120)
    token = secrets.token_hex(16)
    pending = [client[eid].apply_async(
        dist.setup, rank=rank, world_size=group.world_size, master_port=port, backend=group.backend,
        collective_timeout_s=group.collective_timeout, num_threads=group.threads, stack_file=None,
        sys_path=list(sys.path), master_addr=master, local_rank=place["localid"] or 0,
        local_world_size=opts.per_node, node_rank=place["nodeid"] or 0, nodes=opts.nodes, ask_token=token)
        for rank, (eid, place) in enumerate(zip(engine_ids, places))]
    info = [ar.get(timeout=120) for ar in pending]
    procs = {i["rank"]: RemoteRank(i["pid"], i["host"], eid, i["address"], i["ask_port"], token)
             for i, eid in zip(info, engine_ids)}
    return engine_ids, info, procs


class RemoteRank:
    """A rank on another machine: no process handle here, so it counts as gone when the controller drops
    its engine (missed heartbeats) or when its answering port refuses connections (the process exited
    and its node is up), whichever comes first."""

    _PROBE_S = 0.25

    def __init__(self, pid: int, host: str, engine_id: int, address: str, ask_port: int, token: str):
        self.pid, self.host, self.engine_id = pid, host, engine_id
        self.ask_target = (address, ask_port, token)
        self._probed, self._gone = 0.0, False

    def alive(self, client) -> bool:
        if self._gone:
            return False
        if client is not None and self.engine_id not in client.ids:
            self._gone = True
        elif time.monotonic() - self._probed > self._PROBE_S:
            self._probed = time.monotonic()
            self._gone = introspect.reachable(*self.ask_target[:2]) is False
        return not self._gone

    def send_signal(self, sig) -> None:
        """Deliver `sig` (SIGINT: an interrupted kernel) through the rank's answering thread."""
        if int(sig) != 2:
            raise ValueError("only SIGINT reaches a rank on another node")
        introspect.ask({0: self.ask_target}, wait_s=1.0, request=f"signal-{int(sig)}")

    def __repr__(self):
        return f"RemoteRank(pid={self.pid}, host={self.host!r})"


# --- what Mpi and Ssh share: hosts given by name, no scheduler ----------------------------------------------

@dataclasses.dataclass(frozen=True)
class HostsPlan:
    """Ranks started by mpiexec or ssh: `per_node` on each of `hosts` (none: this machine, under mpiexec)."""

    hosts: tuple
    nodes: int
    per_node: int
    address: str  # where the ranks reach this machine (the controller)
    args: tuple  # mpi_args or ssh_args
    remote_python: str
    flavor: str  # "openmpi", "mpich" or "" (an mpiexec this package does not know)
    gpus_per_node: int = 0


def hosts_plan(kind: str, world_size: int, backend: str, hosts, args, args_name: str, remote_python=None,
               flavor=None, address=None) -> tuple:
    """(HostsPlan, backend) for Mpi and Ssh, every option checked; `flavor()` names the MPI, once the rest passed."""
    from ..hosts import this_address
    from ..processes import choose_backend, requested_backend

    choose_backend(world_size, "gloo")  # checks world_size
    backend = requested_backend(backend)
    hosts = check_hosts(kind, hosts, world_size)
    if args is not None and (isinstance(args, str) or not all(isinstance(a, str) for a in args)):
        raise ValueError(f"{args_name} is a list of strings, one per command-line word (e.g. ['-p', '2222']), "
                         f"got {args!r}.")
    flavor = flavor() if flavor is not None else ""
    remote_python = remote_python or sys.executable
    if not isinstance(remote_python, str):
        raise ValueError(f"remote_python is the path of Python on the hosts, got {remote_python!r}.")
    # The hosts' GPUs are not known here: there nccl only when asked for (one GPU per rank on each host).
    backend = choose_backend(world_size, backend) if not hosts else ("gloo" if backend == "auto" else backend)
    address = address or (this_address() if hosts else "127.0.0.1")
    nodes = max(1, len(hosts))
    return HostsPlan(hosts, nodes, world_size // nodes, address, tuple(args or ()), remote_python, flavor,
                     gpus_per_node=world_size // nodes if backend == "nccl" else 0), backend


def check_hosts(kind: str, hosts, world_size: int) -> tuple:
    if hosts is None and kind == "ssh":
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


# An engine whose controller stopped answering leaves after this many 1-second checks (ipyparallel's
# default, 50, would keep the ranks of a killed kernel alive for close to a minute).
HEARTBEAT_MISSES = 10


def engine_settings(ipp, env: dict) -> tuple:
    """(engine_args, environment) for engines started elsewhere: the cluster's own engine arguments plus the
    heartbeat limit, its environment plus PYTHONPATH."""
    import os

    args = list(ipp.config.LocalEngineSetLauncher.engine_args) + [f"--IPEngine.max_heartbeat_misses={HEARTBEAT_MISSES}"]
    passed = {**env, **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}
    return args, passed


def check_placement(plan, places: list) -> list:
    counts = [sum(p["nodeid"] == n for p in places) for n in range(plan.nodes)]
    if counts != [plan.per_node] * plan.nodes or any(p["localid"] is None for p in places):
        raise RuntimeError(f"the ranks did not land {plan.per_node} per host on {plan.nodes} host(s) (ranks per "
                           f"host: {counts}; hosts {sorted({p['host'] for p in places})}). Check mpi_args= for "
                           "options that change where mpiexec puts ranks.")
    return places
