"""This machine's addresses and network interfaces: where other nodes reach it, which interface traffic to a
peer leaves by, and that interface's byte counters. Ranks use it to join a group across nodes; lesson 07
reads the counters to measure bytes on the wire."""

from __future__ import annotations


def route_address(peer: str) -> str:
    """The local address this process would use to reach `peer` (an IP address or a hostname), as the
    routing table picks it. Nothing is sent: connecting a UDP socket only chooses the route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((peer, 9))
        return sock.getsockname()[0]


def host_address() -> str:
    """What this machine's host name resolves to: the address gloo advertises to its peers. "127.0.0.1" when
    the name does not resolve (gloo could not advertise it either)."""
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ("lo" for 127.0.0.1, "eth1" for a node's address)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise ValueError(f"no interface of this machine holds {address}: pass an address of this host "
                     "(`ip -brief address` lists them).")


def boundary_interface(peer: str | None = None) -> str:
    """The interface a rank's traffic to the other nodes leaves by: GLOO_SOCKET_IFNAME when it is set (gloo
    then uses only that one), else the interface holding the address routed to `peer` (default: MASTER_ADDR,
    rank 0's address; 127.0.0.1 when unset, i.e. one machine)."""
    import os

    pinned = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if pinned:
        return pinned
    return interface_of(route_address(peer or os.environ.get("MASTER_ADDR") or "127.0.0.1"))


def interface_bytes(name: str) -> dict:
    """{"tx", "rx"}: bytes sent and received so far through interface `name`, headers included.

    Read from /proc/net/dev (through psutil), which follows the reading process's network namespace.
    /sys/class/net/NAME/statistics holds the same counters but follows the namespace sysfs was mounted
    in: a process moved into a node's namespace (`nsenter --net`, a Slurm daemon started that way) sees
    the host's interfaces there."""
    import psutil

    counters = psutil.net_io_counters(pernic=True)
    if name not in counters:
        raise ValueError(f"no interface {name!r} here; this process sees {sorted(counters)}.")
    return {"tx": counters[name].bytes_sent, "rx": counters[name].bytes_recv}


def gloo_interface_for_nodes() -> str | None:
    """Under torchrun: the interface gloo must be pinned to (GLOO_SOCKET_IFNAME), or None when it needs none.

    gloo advertises to its peers whatever this machine's hostname resolves to. Debian and Ubuntu map the
    hostname to 127.0.1.1 in /etc/hosts: fine on one machine, but when the job spans machines the other
    nodes then fail with "Gloo connectFullMesh failed ... remote=[127.0.x.x]" while their peers wait to the
    timeout. So when the job spans machines (WORLD_SIZE > LOCAL_WORLD_SIZE), GLOO_SOCKET_IFNAME is unset and
    the hostname resolves to a loopback address, the answer is the interface that reaches MASTER_ADDR."""
    import ipaddress
    import os

    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    if os.environ.get("GLOO_SOCKET_IFNAME") or not local or world <= local:
        return None
    if not ipaddress.ip_address(host_address()).is_loopback:
        return None
    address = route_address(os.environ.get("MASTER_ADDR") or "127.0.0.1")
    return None if ipaddress.ip_address(address).is_loopback else interface_of(address)


def this_address() -> str:
    """This machine's address as the nodes see it: what its host name resolves to, unless that is a
    loopback address (Debian maps the host name to 127.0.1.1); then the first address of an interface."""
    import socket

    import psutil

    resolved = host_address()
    if not resolved.startswith("127."):
        return resolved
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise ValueError("this machine has no network address other than loopback: the nodes cannot reach it. "
                     "Pass address= (where the nodes reach this machine).")
