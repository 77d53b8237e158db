"""Ranks on other machines, whatever started them (Slurm, mpiexec, ssh): their order, how they become one
process group, and the handle through which the kernel watches each one.

Each launcher module finds where its engines landed (`places`: node index, index on the node, task id,
host, pid); `join_group` numbers the ranks by node, then by index on the node, opens the group's store on
rank 0's routable address, and has every rank join. A rank's process is on another machine, so the kernel
holds a `RemoteRank`: gone when the controller drops its engine or its answering port refuses connections.
"""

from __future__ import annotations

import sys
import time

from . import hang


def rank_order(places: list) -> list:
    """Indices of `places` in rank order: by node, then index on the node (then task id), never by
    engine id (ipyparallel numbers engines in the order they connect)."""
    def key(i):
        p = places[i]
        return (p["nodeid"] if p["nodeid"] is not None else 0, p["localid"] if p["localid"] is not None else 0,
                p["procid"] if p["procid"] is not None else i)

    return sorted(range(len(places)), key=key)


def join_group(cluster, places: list) -> tuple[list, list, dict]:
    """Make `cluster`'s engines one process group: ranks by (node, index on the node) from `places` (each
    engine's place as its launcher found it: Slurm's task variables, MPI's rank variables, the host order), rank 0's routable address
    as MASTER_ADDR (the store listens there), and each rank answering the kernel on TCP (no shared scratch
    folder). Returns engine ids in rank order, what each rank's setup returned, and rank -> RemoteRank."""
    import secrets

    from . import dist

    opts, client = cluster._remote, cluster._client
    order = rank_order(places)
    engine_ids = [cluster._engine_ids[i] for i in order]
    places = [places[i] for i in order]
    first = client[engine_ids[0]]
    master = first.apply_async(dist.routable_address, opts.address).get(timeout=60)
    port = first.apply_async(dist.open_store, world_size=cluster.world_size,
                             timeout_s=cluster.collective_timeout, host=master).get(timeout=120)
    token = secrets.token_hex(16)
    pending = [client[eid].apply_async(
        dist.setup, rank=rank, world_size=cluster.world_size, master_port=port, backend=cluster.backend,
        collective_timeout_s=cluster.collective_timeout, num_threads=cluster._threads, stack_file=None,
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
            self._gone = hang.reachable(*self.ask_target[:2]) is False
        return not self._gone

    def send_signal(self, sig) -> None:
        """Deliver `sig` (SIGINT: an interrupted kernel) through the rank's answering thread."""
        if int(sig) != 2:
            raise ValueError("only SIGINT reaches a rank on another node")
        hang.ask({0: self.ask_target}, wait_s=1.0, request=f"signal-{int(sig)}")

    def __repr__(self):
        return f"RemoteRank(pid={self.pid}, host={self.host!r})"
