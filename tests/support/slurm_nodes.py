"""A real two-node Slurm cluster on one host, for the multi-node tests: munged, slurmctld, two slurmds.

`slurm_nodes(nodes)` takes the two nodes of `netns.two_nodes()` and runs the real daemons: munged on the
host (its own socket, so two test sessions do not share one), slurmctld and a slurmd on node-a, a slurmd
on node-b. The partition also lists a node-c that never comes up, so a job that asks for 3 nodes stays
pending (what a busy or too small cluster does). It yields the path of slurm.conf (export it as
SLURM_CONF). Teardown: cancel every job, wait for an empty queue, then the slurmds, slurmctld, munged
last (a job step whose munged is gone loops on "Munge encode failed" and its slurmd ignores SIGTERM).

Needs root and the Debian packages slurmd, slurmctld, slurm-client and munge; skips (or fails under
FSDPLAB_REQUIRE_MULTINODE=1) without them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path

from netns import NODES, Nodes, skip_or_fail

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")
START_TIMEOUT_S = 30.0


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _conf_text(nodes: Nodes, folder: Path, munge_socket: Path) -> str:
    a, b = (nodes.addresses[n] for n in NODES)
    phantom = a.rsplit(".", 1)[0] + ".3"  # node-c: in the partition, never up
    return f"""ClusterName=fsdplab
SlurmctldHost=node-a({a})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
KillWait=2
MinJobAge=2
NodeName=node-a NodeAddr={a} CPUs=1
NodeName=node-b NodeAddr={b} CPUs=1
NodeName=node-c NodeAddr={phantom} CPUs=1
PartitionName=debug Nodes=node-a,node-b,node-c Default=YES State=UP
"""


def _wait(predicate, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    detail = log.read_text()[-2000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} within {timeout:g} s\n{detail}")


def client(nodes: Nodes, argv: list[str], env: dict, timeout: float = 20) -> subprocess.CompletedProcess:
    """A Slurm client command, run on node-a (slurmctld is reachable from the nodes, not from the host)."""
    return subprocess.run(nodes.cmd("node-a", argv), capture_output=True, text=True, env=env, timeout=timeout)


def _idle_nodes(nodes: Nodes, env: dict) -> set[str]:
    out = client(nodes, ["sinfo", "-h", "-N", "-o", "%N %t"], env).stdout
    return {name for name, state in (line.split() for line in out.splitlines() if line.strip())
            if state in ("idle", "alloc", "mix")}


def queue(nodes: Nodes, env: dict) -> list[str]:
    """Job ids in the queue (pending, running or completing)."""
    out = client(nodes, ["squeue", "-h", "-o", "%i"], env)
    return out.stdout.split() if out.returncode == 0 else ["(squeue failed: " + out.stderr.strip() + ")"]


def _stop(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


@contextlib.contextmanager
def slurm_nodes(nodes: Nodes):
    """Run munged, slurmctld and one slurmd per node; yield the slurm.conf path once both nodes are idle."""
    missing = missing_tools()
    if missing:
        skip_or_fail("Slurm is not installed (missing " + ", ".join(missing) + "): apt-get install -y "
                     "--no-install-recommends slurmd slurmctld slurm-client munge")
    folder = nodes.scratch / "slurm"
    munge_dir = nodes.scratch / "munge"
    for d in (folder / "state", folder / "spool", munge_dir):
        d.mkdir(parents=True, exist_ok=True)
    munge = pwd.getpwnam("munge")
    os.chmod(nodes.scratch, 0o755)  # munged runs as its own user and must reach its socket folder
    os.chown(munge_dir, munge.pw_uid, munge.pw_gid)
    munge_socket = munge_dir / "munge.socket"
    conf = folder / "slurm.conf"
    conf.write_text(_conf_text(nodes, folder, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: dict[str, subprocess.Popen] = {}
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        procs["munged"] = subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={munge_socket}",
             f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log",
             f"--seed-file={munge_dir}/munged.seed"], **quiet)
        _wait(munge_socket.exists, 10, "munged did not open its socket", munge_dir / "munged.log")
        procs["slurmctld"] = subprocess.Popen(nodes.cmd("node-a", ["slurmctld", "-D", "-i"]), **quiet)
        for node in NODES:
            procs[node] = subprocess.Popen(nodes.cmd(node, ["slurmd", "-D"]), **quiet)
        _wait(lambda: _idle_nodes(nodes, env) >= set(NODES), START_TIMEOUT_S, "the slurmds did not register",
              folder / "slurmctld.log")
        yield conf
    finally:
        with contextlib.suppress(Exception):
            if "slurmctld" in procs and procs["slurmctld"].poll() is None:
                client(nodes, ["scancel", "--full", "--user", "root"], env)
                _wait(lambda: not queue(nodes, env), 20, "jobs still in the queue after scancel")
        for name in (*NODES, "slurmctld", "munged"):
            _stop(procs.get(name))
