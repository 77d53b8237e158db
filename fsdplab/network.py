"""A latency-bandwidth cost model of the links GPUs talk over, and the ring algorithm's bytes per rank. (This
machine's own interfaces, which one traffic to another node leaves by and its byte counters, are in
fsdplab.runtime.hosts.)

Cost model: `collective_time(kind, nbytes, world_size, link)` is the ring model,
(N-1)/N x bytes / bandwidth + (N-1) x latency, twice that for all-reduce. Bandwidths in `PRESETS` are
per rank, per direction, from vendor specifications:
  * NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s total = 300 GB/s per direction per GPU
    (through NVSwitch in HGX/DGX A100). NVIDIA H100 datasheet: fourth-generation NVLink, 900 GB/s total
    = 450 GB/s per direction (SXM5). A10 servers have no NVLink: their GPUs talk over PCIe.
  * PCI-SIG: PCIe 4.0 runs 16 GT/s per lane, x16 = 31.5 GB/s per direction after 128b/130b encoding;
    PCIe 5.0 doubles it (63 GB/s).
  * NVIDIA ConnectX adapters: EDR/HDR100 100 Gb/s, HDR 200 Gb/s, NDR 400 Gb/s = 12.5 / 25 / 50 GB/s
    (bits / 8).
  * IEEE 802.3 Ethernet: 10 / 25 / 100 Gb/s line rates = 1.25 / 3.125 / 12.5 GB/s. "10-25 GB/s" for
    ordinary Ethernet confuses bits with bytes.
Latencies are round order-of-magnitude per-hop figures (a few microseconds for NVLink and InfiniBand
with NCCL, tens for TCP over Ethernet), not vendor numbers: at the sizes FSDP moves (megabytes per
unit) bandwidth dominates and the conclusions do not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # network bandwidths are quoted in decimal gigabytes

RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


def ring_sent_bytes(kind: str, tensor_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective on a full tensor of `tensor_bytes`, ring algorithm."""
    if group_size <= 1:
        return 0.0
    if kind in RING_FACTOR:
        return RING_FACTOR[kind] * (group_size - 1) / group_size * tensor_bytes
    if kind in ("broadcast", "reduce", "gather", "scatter", "send"):
        return float(tensor_bytes)  # a send; a pipelined chain, where every rank but one forwards the tensor once
    return 0.0


def mean_sent_bytes(kind: str, tensor_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective on a full tensor of `tensor_bytes`, averaged over the group's ranks.
    The ring collectives send the same from every rank: `ring_sent_bytes`. A broadcast (or a reduce) along a
    pipelined chain sends the tensor once from every rank but the last, (N-1)/N x tensor_bytes per rank on
    average, where `ring_sent_bytes` charges each rank the whole tensor."""
    if kind in ("broadcast", "reduce") and group_size > 1:
        return (group_size - 1) / group_size * tensor_bytes
    return ring_sent_bytes(kind, tensor_bytes, group_size)


# --- links and collectives -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """A link as one rank sees it: bandwidth per direction (GB/s, decimal) and per-hop latency (s)."""
    name: str
    bandwidth_gbps: float
    latency_s: float = 5e-6

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * GB


# Sources in the module docstring. Keys are what a notebook dropdown shows.
PRESETS = {
    "NVLink A100 (300 GB/s)": Link("NVLink A100 (300 GB/s)", 300.0, 3e-6),
    "NVLink H100 (450 GB/s)": Link("NVLink H100 (450 GB/s)", 450.0, 3e-6),
    "PCIe 4.0 x16 (31.5 GB/s)": Link("PCIe 4.0 x16 (31.5 GB/s)", 31.5, 5e-6),
    "PCIe 5.0 x16 (63 GB/s)": Link("PCIe 5.0 x16 (63 GB/s)", 63.0, 5e-6),
    "InfiniBand 100 Gb/s (12.5 GB/s)": Link("InfiniBand 100 Gb/s (12.5 GB/s)", 12.5, 5e-6),
    "InfiniBand 200 Gb/s (25 GB/s)": Link("InfiniBand 200 Gb/s (25 GB/s)", 25.0, 5e-6),
    "InfiniBand 400 Gb/s (50 GB/s)": Link("InfiniBand 400 Gb/s (50 GB/s)", 50.0, 5e-6),
    "Ethernet 10 GbE (1.25 GB/s)": Link("Ethernet 10 GbE (1.25 GB/s)", 1.25, 30e-6),
    "Ethernet 25 GbE (3.125 GB/s)": Link("Ethernet 25 GbE (3.125 GB/s)", 3.125, 30e-6),
    "Ethernet 100 GbE (12.5 GB/s)": Link("Ethernet 100 GbE (12.5 GB/s)", 12.5, 20e-6),
}
# The posts' figures, for comparison (claim 19): "NVSwitch 300 GB/s", "ordinary Ethernet 10-25 GB/s".
POST_CLAIMS_GBPS = {"NVSwitch": 300.0, "Ethernet low": 10.0, "Ethernet high": 25.0}


def get_link(link) -> Link:
    """A Link from a Link, a PRESETS key, or a unique fragment of one ("H100", "25 GbE", "400 Gb/s")."""
    if isinstance(link, Link):
        return link
    if link in PRESETS:
        return PRESETS[link]
    matches = [k for k in PRESETS if str(link).lower() in k.lower()]
    if len(matches) != 1:
        raise ValueError(f"unknown link {link!r}: use a Link(...) or one of {list(PRESETS)} "
                         "(a unique part of a name works too).")
    return PRESETS[matches[0]]


def speed_ratio(fast, slow) -> float:
    """How many times the bandwidth of link `fast` is that of link `slow` (Links or PRESETS names)."""
    return get_link(fast).bandwidth_gbps / get_link(slow).bandwidth_gbps


def collective_time(kind: str, nbytes: float, world_size: int, link) -> float:
    """Seconds for one ring collective on a full tensor of `nbytes` over `world_size` ranks on `link`:
    (N-1)/N x bytes / bandwidth + (N-1) x latency; all-reduce (= reduce-scatter + all-gather) twice that."""
    if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"kind must be 'all_gather', 'reduce_scatter' or 'all_reduce', got {kind!r}.")
    if world_size < 1:
        raise ValueError("world_size must be >= 1.")
    link = get_link(link)
    if world_size == 1:
        return 0.0
    n = world_size
    one = (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s
    return 2 * one if kind == "all_reduce" else one


def step_sent_bytes(strategy: str, param_bytes: float, world_size: int) -> float:
    """Ring bytes one rank sends per step for the whole model (gradients in the parameters' dtype):
    DDP 2(N-1)/N P (all-reduce); SHARD_GRAD_OP 2(N-1)/N P (all-gather once + reduce-scatter);
    FULL_SHARD 3(N-1)/N P (all-gather in forward and again in backward + reduce-scatter)."""
    factor = {"ddp": 2, "no_shard": 2, "shard_grad_op": 2, "full_shard": 3}
    if strategy not in factor:
        raise ValueError(f"strategy must be one of {list(factor)}, got {strategy!r}.")
    n = world_size
    return factor[strategy] * (n - 1) / n * param_bytes if n > 1 else 0.0


def step_comm_time(strategy: str, param_bytes: float, world_size: int, link, num_units: int = 1) -> float:
    """Seconds of communication per step (nothing overlapped), the model split into `num_units` equal units."""
    link = get_link(link)
    unit = param_bytes / num_units
    if strategy in ("ddp", "no_shard"):
        return num_units * collective_time("all_reduce", unit, world_size, link)
    gathers = 2 if strategy == "full_shard" else 1
    if strategy not in ("full_shard", "shard_grad_op"):
        raise ValueError(f"strategy must be ddp, shard_grad_op or full_shard, got {strategy!r}.")
    return num_units * (gathers * collective_time("all_gather", unit, world_size, link)
                        + collective_time("reduce_scatter", unit, world_size, link))


def cross_node_step_bytes(strategy: str, param_bytes: float, num_nodes: int, ranks_per_node: int) -> float:
    """Bytes that cross node boundaries per step, whole job, ring model, ranks numbered node by node.

    "full_shard": each collective is a ring over all N = num_nodes x ranks_per_node ranks; num_nodes of its N
    hops join two nodes and each hop carries one rank's 3(N-1)/N x P: num_nodes x 3(N-1)/N x P.
    "hsdp": only the all-reduce of each rank's 1/ranks_per_node gradient shard leaves a node, in
    ranks_per_node rings over num_nodes ranks whose every hop crosses: 2(num_nodes-1) x P."""
    if num_nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and ranks_per_node ({ranks_per_node}) must be >= 1.")
    if num_nodes == 1:
        return 0.0
    if strategy == "full_shard":
        return num_nodes * step_sent_bytes("full_shard", param_bytes, num_nodes * ranks_per_node)
    if strategy == "hsdp":
        return ranks_per_node * num_nodes * ring_sent_bytes("all_reduce", param_bytes / ranks_per_node, num_nodes)
    raise ValueError(f"strategy must be 'full_shard' or 'hsdp', got {strategy!r}.")


def hsdp_comm_time(param_bytes: float, num_nodes: int, gpus_per_node: int, intra, inter,
                   num_units: int = 1) -> dict:
    """Seconds per step for FULL_SHARD over every GPU (its rings cross the slow link, which sets the pace)
    vs HSDP (all-gather / reduce-scatter inside each node on `intra`, then an all-reduce of each rank's
    1/gpus_per_node gradient shard across nodes on `inter`). No overlap."""
    intra, inter = get_link(intra), get_link(inter)
    world = num_nodes * gpus_per_node
    unit = param_bytes / num_units
    slowest = inter if num_nodes > 1 else intra
    flat = num_units * 3 * collective_time("all_gather", unit, world, slowest)
    inside = num_units * 3 * collective_time("all_gather", unit, gpus_per_node, intra)
    across = num_units * collective_time("all_reduce", unit / gpus_per_node, num_nodes, inter)
    return {"full_shard": flat, "hsdp": inside + across, "hsdp_intra": inside, "hsdp_inter": across}
