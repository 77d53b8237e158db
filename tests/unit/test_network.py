"""fsdplab.network and fsdplab.runtime.hosts: the ratio lesson 07 quotes instead of "one to two orders of magnitude",
the bytes that cross node boundaries in the cost model, and this machine's interfaces and their byte counters."""

import socket
import threading

import pytest

from fsdplab import network
from fsdplab.runtime import hosts


def test_speed_ratio_comes_from_the_presets():
    assert network.speed_ratio("A100", "400 Gb/s") == pytest.approx(300 / 50)
    assert network.speed_ratio("A100", "25 GbE") == pytest.approx(300 / 3.125)
    assert network.speed_ratio(network.Link("x", 10.0), network.Link("y", 2.5)) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="unknown link"):
        network.speed_ratio("A100", "carrier pigeon")


def test_cross_node_step_bytes():
    P = 1000.0
    # 2 nodes x 2: FULL_SHARD's 4-rank rings cross twice, each hop 3 x 3/4 P; HSDP all-reduces 2 halves across
    assert network.cross_node_step_bytes("full_shard", P, 2, 2) == pytest.approx(2 * 3 * 3 / 4 * P)
    assert network.cross_node_step_bytes("hsdp", P, 2, 2) == pytest.approx(2 * P)
    assert network.cross_node_step_bytes("hsdp", P, 3, 4) == pytest.approx(4 * P)
    assert network.cross_node_step_bytes("full_shard", P, 1, 8) == 0.0
    with pytest.raises(ValueError, match="strategy"):
        network.cross_node_step_bytes("ddp", P, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        network.cross_node_step_bytes("hsdp", P, 0, 2)


def test_loopback_route_and_counters():
    assert hosts.route_address("127.0.0.1") == "127.0.0.1"
    lo = hosts.interface_of("127.0.0.1")
    assert hosts.boundary_interface("127.0.0.1") == lo
    with pytest.raises(ValueError, match="no interface"):
        hosts.interface_of("192.0.2.123")          # TEST-NET-1: never a local address
    with pytest.raises(ValueError, match="no interface"):
        hosts.interface_bytes("no-such-if0")
    payload = b"x" * 2_000_000
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                received.append(len(chunk))

    reader = threading.Thread(target=drain)
    reader.start()
    before = hosts.interface_bytes(lo)
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(payload)
    reader.join(timeout=30)
    after = hosts.interface_bytes(lo)
    server.close()
    assert sum(received) == len(payload)
    assert after["tx"] - before["tx"] >= len(payload)     # headers and other loopback traffic only add


def test_gloo_socket_ifname_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9,eth8")
    assert hosts.boundary_interface() == "eth9"


def test_gloo_is_pinned_only_when_a_job_spans_machines_and_the_hostname_is_loopback(monkeypatch):
    import psutil

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")   # Debian's /etc/hosts
    own = [(name, a.address) for name, addresses in psutil.net_if_addrs().items() for a in addresses
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    monkeypatch.setenv("MASTER_ADDR", own[0][1] if own else "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert hosts.gloo_interface_for_nodes() is None              # one machine: loopback is fine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    if own:
        assert hosts.gloo_interface_for_nodes() == own[0][0]     # two machines: the interface to rank 0
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert hosts.gloo_interface_for_nodes() is None              # rank 0 on loopback: nothing to pin
    monkeypatch.setenv("MASTER_ADDR", own[0][1] if own else "127.0.0.1")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "192.0.2.7")
    assert hosts.gloo_interface_for_nodes() is None              # a routable hostname: gloo is right already
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert hosts.gloo_interface_for_nodes() is None              # the user chose
