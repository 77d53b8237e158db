"""Two "machines" on one host, for the multi-node tests: network namespaces joined by a veth pair.

`two_nodes()` builds node-a and node-b: each a network namespace with its own address on one private
subnet, its own hostname and its own hosts file (so that each node's name resolves to its routable
address, as on a real cluster: gloo advertises what the hostname resolves to). `Nodes.cmd(node, argv)`
prefixes a command line so it runs inside a node. Teardown kills whatever still runs in either node and
deletes the namespaces.

Names and the subnet derive from the pid, so two test sessions on one machine do not collide.

Commands enter a node with nsenter plus a private mount and UTS namespace, not `ip netns exec`: the
latter remounts /sys, and slurmd then fails to start ("Unable to initialize cgroup plugin").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

NODES = ("node-a", "node-b")
_REQUIRE = "FSDPLAB_REQUIRE_MULTINODE"


def skip_or_fail(reason: str):
    """Skip a test whose capability is missing; fail instead when the run requires multi-node tests (CI)."""
    if os.environ.get(_REQUIRE) == "1":
        pytest.fail(f"{reason} ({_REQUIRE}=1: the multi-node tests must run here)")
    pytest.skip(reason)


def missing_capability() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@dataclasses.dataclass
class Nodes:
    """The two nodes of one `two_nodes()` use."""

    namespaces: dict[str, str]  # node name -> namespace name
    addresses: dict[str, str]  # node name -> routable address
    hosts_files: dict[str, Path]
    scratch: Path  # a folder this use owns; removed at teardown

    def cmd(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run inside `node`: its network, its hostname, its hosts file (a private mount)."""
        script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return [
            "nsenter", f"--net=/run/netns/{self.namespaces[node]}",
            "unshare", "-m", "-u", "sh", "-c", script, "sh", str(self.hosts_files[node]), node, *argv,
        ]

    node_cmd = cmd

    def pids(self, node: str) -> list[int]:
        """The processes that run in `node`'s network namespace now."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """SIGTERM, then SIGKILL, everything left in both nodes; returns the pids still alive (should be [])."""
        for sig, wait in ((signal.SIGTERM, timeout / 2), (signal.SIGKILL, timeout / 2)):
            for node in NODES:
                for pid in self.pids(node):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(self.pids(n) for n in NODES):
                time.sleep(0.1)
        return [pid for node in NODES for pid in self.pids(node)]


def _names() -> tuple[dict[str, str], dict[str, str]]:
    """Namespace names and addresses unique to this process (a /24 per pid, in 10.77.0.0/16)."""
    pid = os.getpid()
    octet = pid % 250 + 1
    namespaces = {node: f"fl{pid}{node[-1]}" for node in NODES}
    addresses = {node: f"10.77.{octet}.{i}" for i, node in enumerate(NODES, start=1)}
    return namespaces, addresses


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes():
    """Build node-a and node-b (skip, or fail under FSDPLAB_REQUIRE_MULTINODE=1, when this host cannot)."""
    reason = missing_capability()
    if reason:
        skip_or_fail(reason)
    namespaces, addresses = _names()
    scratch = Path(tempfile.mkdtemp(prefix="fsdplab-nodes-"))
    hosts_text = "127.0.0.1 localhost\n" + "".join(f"{addresses[n]} {n}\n" for n in NODES)
    hosts_files = {}
    for node in NODES:
        hosts_files[node] = scratch / f"hosts-{node}"
        hosts_files[node].write_text(hosts_text)
    nodes = Nodes(namespaces, addresses, hosts_files, scratch)
    try:
        try:
            for node in NODES:
                # A namespace of this name is a leftover of a killed run with the same pid: ours to reuse.
                subprocess.run(["ip", "netns", "del", namespaces[node]], capture_output=True)
                _ip("netns", "add", namespaces[node])
            a, b = (namespaces[n] for n in NODES)
            _ip("link", "add", "eth1", "netns", a, "type", "veth", "peer", "name", "eth1", "netns", b)
            for node in NODES:
                ns = namespaces[node]
                _ip("-n", ns, "addr", "add", f"{addresses[node]}/24", "dev", "eth1")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", "eth1", "up")
        except (subprocess.CalledProcessError, OSError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            skip_or_fail(f"cannot build network namespaces here: {detail.strip()}")
        yield nodes
    finally:
        for node in NODES:
            if Path(f"/run/netns/{namespaces[node]}").exists():
                nodes.kill_all()
                break
        for node in NODES:
            subprocess.run(["ip", "netns", "del", namespaces[node]], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":  # a quick self-check: python tests/support/netns.py
    with two_nodes() as n:
        for node in NODES:
            out = subprocess.run(n.cmd(node, ["sh", "-c", "hostname; getent hosts node-a node-b"]),
                                 capture_output=True, text=True, check=True).stdout
            print(node, out.split())
