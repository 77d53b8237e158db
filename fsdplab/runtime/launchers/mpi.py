"""The ranks under one `mpiexec` (Open MPI or MPICH), on `hosts` or on this machine.

`hosts` get world_size // len(hosts) ranks each, in host order; without hosts all run here. A rank's place
comes from the MPI launcher's variables (OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_RANK, or PMI_RANK /
MPI_LOCALRANKID), its node from the order of the hosts (the one with the lowest MPI rank first); never from
ipyparallel's engine id, which follows the order the engines connected in. stop() ends mpiexec with SIGTERM:
it takes down every rank on every host. A killed kernel's watcher kills mpiexec: Open MPI's daemons then end
their ranks at once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess

from .remote import RemoteLauncher, check_placement, engine_settings, hosts_plan

_IPP_VARS = ("IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


@dataclasses.dataclass(frozen=True)
class Mpi(RemoteLauncher):
    """One mpiexec starts the ranks on `hosts` (None: this machine): Cluster(4, launcher=Mpi(hosts=["a", "b"]))."""

    kind = "mpi"
    hosts: list | None = None
    mpi_args: list | None = None
    address: str | None = None

    def prepare(self, world_size: int, backend: str) -> tuple:
        return hosts_plan(self.kind, world_size, backend, self.hosts, self.mpi_args, "mpi_args",
                          flavor=mpi_flavor, address=self.address)

    def configure(self, ipp, plan, env: dict, path) -> None:
        launcher = ipp.config.MPIEngineSetLauncher
        launcher.engine_args, passed = engine_settings(ipp, env)
        launcher.engine_cmd = self.engine_cmd()
        launcher.environment = passed
        launcher.mpi_args = mpi_args(plan, passed)

    def start_problem(self, plan, ipp, jobs: list, waited_s: float, timed_out: bool) -> str | None:
        return mpiexec_ended(ipp)   # e.g. a host mpiexec cannot reach

    def places(self, plan, group) -> list:
        places = group.client[group.engine_ids].apply_async(placement).get(timeout=120)
        # Node index: hosts in the order of their lowest MPI rank (mpiexec fills each host in turn).
        lowest = {}
        for p in places:
            lowest[p["host"]] = min(lowest.get(p["host"], p["procid"]), p["procid"])
        order = sorted(lowest, key=lowest.get)
        for p in places:
            p["nodeid"] = order.index(p["host"])
        return check_placement(plan, places)

    def stop(self, plan, ipp, jobs: list, wait_s: float = 10.0) -> list:
        import psutil

        from .base import engine_pids

        left = []
        for pid in engine_pids(ipp):
            try:
                proc = psutil.Process(pid)
                proc.terminate()  # mpiexec passes SIGTERM on to every rank on every host, then exits
                proc.wait(wait_s)
            except psutil.TimeoutExpired:
                left.append(f"mpiexec (pid {pid}) did not end within {wait_s:g} s of SIGTERM")
            except psutil.Error:
                pass
        return left


def mpi_flavor() -> str:
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


def mpi_args(plan, env: dict) -> list:
    """mpiexec's options: the hosts and slots, the environment for ranks on other hosts, the user's last."""
    args = []
    hosts = ",".join(f"{h}:{plan.per_node}" for h in plan.hosts)
    if plan.flavor == "mpich":  # Hydra passes the whole environment on
        args += ["-ppn", str(plan.per_node), "-hosts", ",".join(plan.hosts)] if plan.hosts else []
    elif plan.flavor == "openmpi":
        args += ["--allow-run-as-root"] if os.geteuid() == 0 else []  # containers often run as root
        args += ["--host", hosts] if plan.hosts else ["--oversubscribe"]  # more ranks than cores is allowed here
        # Open MPI passes only what -x names to ranks on other hosts (the engines find the controller by these).
        for name in (*_IPP_VARS, *env):
            args += ["-x", name]
    elif plan.hosts:
        args += ["--host", hosts]
    return args + list(plan.args)


def mpiexec_ended(ipp) -> str | None:
    """Why the ranks will never connect, when mpiexec has already exited (None while it runs)."""
    import psutil
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher

    for engine_set in list(ipp.engines.values()):
        process = getattr(engine_set, "process", None)
        if not isinstance(engine_set, MPIEngineSetLauncher) or process is None:
            continue
        try:
            running = process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            running = False
        if not running:
            tail = "".join(engine_set.get_output().splitlines(True)[-20:]).strip()
            return (f"mpiexec exited before the ranks connected; its last words:\n{tail}\nCheck hosts= (mpiexec "
                    "reaches other hosts over ssh without a password) and mpi_args=.")
    return None


def placement() -> dict:
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
