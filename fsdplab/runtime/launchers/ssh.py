"""The ranks started by `ssh`, one per rank, on `hosts` ([user@]name[:port]); ranks by host order, then index
on the host. stop() kills each host's ranks over ssh. Ranks of a killed kernel leave by themselves about
`HEARTBEAT_MISSES` seconds after the controller is gone (a rank stuck in Python code for good does not).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import shutil
import subprocess
import tempfile

from .remote import RemoteLauncher, check_placement, engine_settings, hosts_plan


@dataclasses.dataclass(frozen=True)
class Ssh(RemoteLauncher):
    """ssh starts each rank on its host: Cluster(4, launcher=Ssh(hosts=["node1", "node2"], ssh_args=["-i", KEY]))."""

    kind = "ssh"
    hosts: list | None = None
    ssh_args: list | None = None
    remote_python: str | None = None
    address: str | None = None

    def prepare(self, world_size: int, backend: str) -> tuple:
        return hosts_plan(self.kind, world_size, backend, self.hosts, self.ssh_args, "ssh_args",
                          remote_python=self.remote_python, address=self.address)

    def configure(self, ipp, plan, env: dict, path) -> None:
        launcher = ipp.config.SSHEngineSetLauncher
        launcher.engine_args, passed = engine_settings(ipp, env)
        launcher.engine_cmd = [plan.remote_python, "-m", "fsdplab.runtime.engine"]
        launcher.remote_python = plan.remote_python
        launcher.ssh_args = list(plan.args)
        launcher.scp_args = ["-P" if a == "-p" else a for a in plan.args]  # scp spells the port -P
        # A folder of its own on each host for the connection file (never the local profile folder: on a
        # shared filesystem scp would copy the file onto itself); the ranks remove it once connected.
        remote_dir = os.path.join(tempfile.gettempdir(), f"fsdplab-remote-{secrets.token_hex(6)}")
        launcher.engines = {host: {"n": plan.per_node, "remote_profile_dir": remote_dir,
                                   "environment": {**passed, "FSDPLAB_NODE": str(i)}}
                            for i, host in enumerate(plan.hosts)}

    def refused(self, error: Exception) -> str | None:
        if isinstance(error, subprocess.CalledProcessError):
            words = shlex.join(error.cmd) if isinstance(error.cmd, list) else str(error.cmd)
            error = f"`{words[:200]}` failed with exit code {error.returncode}"
        return (f"starting the ranks over ssh failed ({error}; ssh's own message is printed above): check that "
                "`ssh HOST` works here without a password for every host (ssh_args= passes options such as "
                "['-i', KEY, '-p', PORT]) and that remote_python= has fsdplab installed there.")

    def places(self, plan, group) -> list:
        places = group.client[group.engine_ids].apply_async(placement).get(timeout=120)
        # Index on the host: the position of the engine's launcher ("host/i") among that host's launchers.
        started = {}
        for engine_set in group.ipp.engines.values():
            for key, launcher in getattr(engine_set, "launchers", {}).items():
                host, _, i = key.rpartition("/")
                started[(plan.hosts.index(host), launcher.pid)] = int(i)
        for p in places:
            p["localid"] = started.get((p["nodeid"], p["pid"]))
        return check_placement(plan, places)

    def stop(self, plan, ipp, jobs: list, wait_s: float = 10.0) -> list:
        """One ssh per host: SIGKILL its ranks, remove the connection folder, and list any rank still there."""
        if ipp is None:
            return []
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
            running[host] = subprocess.Popen(["ssh", *plan.args, *ssh_target(host), "sh", "-c", shlex.quote(script)],
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
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


def placement() -> dict:
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


def ssh_target(host: str) -> list:
    """ssh's words for a host as ipyparallel spells it: [user@]name[:port]."""
    user, _, rest = host.rpartition("@")
    name, _, port = rest.partition(":")
    return (["-p", port] if port else []) + [f"{user}@{name}" if user else name]
