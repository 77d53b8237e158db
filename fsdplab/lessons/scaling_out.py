"""Lesson 07 (scaling out) only: how the lesson's ranks are split into "nodes", tensor parallelism inside a node
+ FSDP across nodes on a 2-D mesh, counted, the losses the same model reaches in one process (to check that
TP + FSDP trains the same model), the bytes that really cross the boundary between real nodes (interface
counters) against the lab's count and the cost model, the verdicts of claim 19 computed from the lesson's
numbers, and its exercise on the bytes HSDP sends between nodes (its code exercise is in `hsdp`).
"""

from __future__ import annotations

import torch

from ..comms import CommCounter, make_mesh, summarize, toy_step
from .checkers import close, exercise


def node_layout(world_size: int, ranks_per_node: int) -> dict:
    """How `world_size` ranks are split into "nodes" for the lesson: {"num_nodes", "ranks_per_node", "note"}.

    The lesson needs at least 2 nodes. When `ranks_per_node` does not give that (world_size 2 with 2 ranks per
    node, or a world size it does not divide), it takes the largest ranks per node below it that does, e.g.
    2 ranks -> 2 nodes x 1 rank, and says so in `note`. With 1 rank there is no second node: num_nodes is 1
    and `note` says which cells are skipped."""
    if world_size < 1 or ranks_per_node < 1:
        raise ValueError(f"world_size ({world_size}) and ranks_per_node ({ranks_per_node}) must be >= 1.")
    if world_size == 1:
        return {"num_nodes": 1, "ranks_per_node": 1,
                "note": "skipped with 1 rank: the measured cells need at least 2 nodes (run with world_size 2 or "
                        "more); the cost model runs without ranks"}
    if world_size % ranks_per_node == 0 and world_size // ranks_per_node >= 2:
        return {"num_nodes": world_size // ranks_per_node, "ranks_per_node": ranks_per_node, "note": ""}
    fit = max(d for d in range(1, min(ranks_per_node, world_size // 2) + 1) if world_size % d == 0)
    return {"num_nodes": world_size // fit, "ranks_per_node": fit,
            "note": f"{world_size} ranks do not make 2 or more nodes of {ranks_per_node}: using "
                    f"{world_size // fit} nodes x {fit} rank(s)"}


def describe_placement(placement: str, mesh_dim: str) -> str:
    """A DTensor placement string ("S(0)", "_S(0, 2)", "R") in words, for the mesh dimension it is on."""
    import re

    if placement in ("R", "Replicate()"):
        return f"{mesh_dim}: replicated"
    strided = re.fullmatch(r"_S\((\d+), (\d+)\)", placement) or re.fullmatch(
        r"_StridedShard\(dim=(\d+), sf=(\d+)\)", placement)
    if strided:
        dim, factor = strided.groups()
        return (f"{mesh_dim}: strided shard of dim {dim} (_StridedShard, split factor {factor}: dim {dim} was already "
                f"split by another mesh dim, so this shard is {factor} strided pieces, one inside each of those)")
    plain = re.fullmatch(r"S\((\d+)\)", placement) or re.fullmatch(r"Shard\(dim=(\d+)\)", placement)
    if plain:
        return f"{mesh_dim}: shard of dim {plain.group(1)}"
    return f"{mesh_dim}: {placement}"


def row_ranges(rows) -> str:
    """Sorted row indices as ranges: [0, 1, 2, 5, 6] -> "0-2, 5-6"."""
    rows = sorted(rows)
    if not rows:
        return "none"
    spans, start, prev = [], rows[0], rows[0]
    for r in rows[1:] + [None]:
        if r is None or r != prev + 1:
            spans.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = r
        prev = r
    return ", ".join(spans)


def held_rows(local, full) -> list:
    """Which rows of `full` (the unsharded weight) the local shard `local` holds, found by comparing rows."""
    if local.numel() == 0:
        return []
    full = full.to(local.device)    # the shard is on the rank's GPU, the copy taken before sharding on the CPU
    same = (local.unsqueeze(1) == full.unsqueeze(0)).all(-1)     # local row x global row
    return same.float().argmax(dim=1).tolist()


def tp_then_fsdp(model, mesh2d):
    """Lesson 07's TP + FSDP (its cell shows the same code): each block's MLP split Megatron-style over "tp"
    (`sharding.apply_tp`), then every block and the root sharded over "dp" (fully_shard's defaults)."""
    from ..sharding import apply_fsdp, apply_tp

    apply_tp(model, mesh2d["tp"])
    return apply_fsdp(model, mesh2d["dp"], reshard_after_forward=None)


def count_tp_fsdp_step(cfg=None, mesh_shape=(2, 2), batch_size: int = 2, seed: int = 0,
                       parallelize=tp_then_fsdp) -> dict:
    """On a rank: tensor parallelism inside a "node" + FSDP across nodes, on a 2-D mesh ("dp", "tp").

    `parallelize(model, mesh2d)` splits and shards the tiny transformer (lesson 07's cell: each block's MLP
    Megatron-style over "tp", one all-reduce in forward and one in backward, attention replicated; then
    fully_shard of every block and the root over "dp"). Counts one step after a warm-up; also returns the
    losses, so they can be compared with the same model trained in one process (`reference_losses`), and
    which rows of the first MLP weight this rank holds."""
    from ..models import TinyConfig, blocks_of
    from ..sharding import build_tiny

    cfg = cfg or TinyConfig()
    mesh2d = make_mesh(mesh_shape, ("dp", "tp"))
    model = build_tiny(cfg, seed=seed)
    # the first MLP weight before sharding: which of its rows each rank holds is found by comparing rows
    # (no full_tensor(): gathering a _StridedShard takes torch's slow path, which warns)
    initial = blocks_of(model)[0].mlp[0].weight.detach().clone()
    model = parallelize(model, mesh2d)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # one batch per data-parallel group: the two TP ranks of a node must see the same tokens
    dp_rank = mesh2d.get_local_rank("dp")

    def step(counter=None):
        return toy_step(model, optimizer, cfg, batch_size, seed + dp_rank, counter)

    rows = held_rows(blocks_of(model)[0].mlp[0].weight.to_local().detach(), initial)
    first_loss = step()
    with CommCounter(mesh=mesh2d) as counter:
        second_loss = step(counter)
    mlp = blocks_of(model)[0].mlp[0].weight
    return {"events": counter.events, "losses": [first_loss, second_loss],
            "mlp_weight_placements": [str(p) for p in mlp.placements],
            "mlp_weight_local_shape": tuple(mlp.to_local().shape),
            "mlp_weight_shape": tuple(mlp.shape), "mlp_weight_mesh_dims": list(mlp.device_mesh.mesh_dim_names),
            "mlp_weight_rows": rows}


def tp_fsdp_report(tp: list, reference: list, ranks_per_node: int) -> str:
    """The TP + FSDP run as text: the first MLP weight's placements, each rank's rows and losses next to
    the single-process ones (`reference_losses`), and rank 0's collectives by phase, kind and mesh dim."""
    w = tp[0]
    lines = [f"first MLP weight {w['mlp_weight_shape']}, local shard {w['mlp_weight_local_shape']} on each "
             "rank; placements:"]
    for placement, mesh_dim in zip(w["mlp_weight_placements"], w["mlp_weight_mesh_dims"]):
        lines.append(f"  {placement:10s} {describe_placement(placement, mesh_dim)}")
    if ranks_per_node == 1:
        lines.append("  (1 rank per node: the tp dim has size 1, so TP splits nothing here; run with 4 ranks "
                     "to see it)")
    for r, out in enumerate(tp):
        lines.append(f"rank {r} (dp {r // ranks_per_node}, tp {r % ranks_per_node}): holds rows "
                     f"{row_ranges(out['mlp_weight_rows'])}; losses {out['losses']}  single process: "
                     f"{[step[r // ranks_per_node] for step in reference]}")
    events = [e for e in w["events"] if e["event"] == "collective"]
    for (phase, kind, mesh_dim), row in summarize(events, by=("phase", "kind", "dim")).items():
        lines.append(f"  {phase:9s} {kind:15s} over {mesh_dim}: x{row['count']:<2d} rank 0 sends "
                     f"{row['sent_bytes']:>9,.0f} B")
    return "\n".join(lines)


def reference_losses(cfg=None, world_size_dp: int = 2, batch_size: int = 2, seed: int = 0, steps: int = 2) -> list:
    """The losses `count_tp_fsdp_step` should see, computed in one process: the same model, each step on
    the concatenation of the dp groups' batches (what data parallelism averages over), plain SGD.
    Returns, per step, each dp group's loss."""
    from ..models import TinyConfig, random_batch
    from ..sharding import build_tiny, loss_of, train_step

    cfg = cfg or TinyConfig()
    model = build_tiny(cfg, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [random_batch(cfg, batch_size, seed=seed + r) for r in range(world_size_dp)]
    per_group = []

    def mean_over_groups(model, batches):  # keeps each group's loss for the comparison
        per_group[:] = [loss_of(model, batch) for batch in batches]
        return sum(per_group) / len(batches)

    losses = []
    for _ in range(steps):
        train_step(model, optimizer, batches, loss_fn=mean_over_groups)
        losses.append([x.item() for x in per_group])
    return losses


# --- across real nodes: the bytes the network interface carried vs the count vs the cost model ----------------

NODE_LAUNCHERS = ("none", "local", "slurm")

NO_NODES_HELP = (
    "To run this section across real nodes, start JupyterLab on a Slurm login node and set nodes_launcher "
    "to slurm: the section then starts fsdplab.Cluster(world_size, "
    "launcher=fsdplab.Slurm(nodes=2)), one or more ranks on each of two nodes, with slurm_conf naming the "
    "cluster's slurm.conf if SLURM_CONF is not already set. nodes_launcher local runs the same code on this "
    "machine, where the loopback interface carries every byte, inside a node or not.")


def real_nodes_cluster(launcher: str, nodes: int = 2, ranks_per_node: int = 1, slurm_conf: str = "") -> tuple:
    """(world_size, Cluster keywords) for the lesson's cross-node section; ("none") -> (0, None).

    "slurm": `nodes` nodes through Slurm, `ranks_per_node` ranks on each; "local": the same ranks on this
    machine (every "node" shares the loopback interface)."""
    if launcher not in NODE_LAUNCHERS:
        raise ValueError(f"nodes_launcher must be one of {NODE_LAUNCHERS}, got {launcher!r}.")
    if nodes < 2 or ranks_per_node < 1:
        raise ValueError(f"the section needs nodes >= 2 and ranks_per_node >= 1, got {nodes} and {ranks_per_node}.")
    if launcher == "none":
        return 0, None
    if launcher == "local":
        return nodes * ranks_per_node, {}
    from ..runtime.launchers import Slurm

    return nodes * ranks_per_node, {"launcher": Slurm(nodes=nodes, slurm_conf=slurm_conf or None)}


def wire_step(cfg=None, batch_size: int = 2, mesh=None, steps: int = 2, seed: int = 0) -> dict:
    """On a rank: build the tiny transformer, parallelize it (`mesh`: None = FULL_SHARD over all ranks, or
    (shape, names) for HSDP), take one warm-up step, then `steps` steps counted two ways at once: the lab's
    `CommCounter` and the byte counters of the interface traffic to other nodes leaves by.

    The counters are read after a barrier on every rank, so every rank's collectives of the counted steps
    fall between its two readings. Returns plain data: the counter's events, the interface, this rank's
    address on it (ranks with the same address share a node and its counters) and the tx / rx deltas."""
    import os

    import torch.distributed as dist

    from ..ranks import this_rank
    from ..runtime import hosts
    from ..models import TinyConfig, count_params
    from ..sharding import build_tiny, parallelize

    cfg = cfg or TinyConfig()
    if isinstance(mesh, tuple):
        mesh = make_mesh(*mesh)
    model = build_tiny(cfg, seed=seed)
    param_bytes = 4 * count_params(model)
    model = parallelize(model, "full_shard", mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()
    toy_step(model, optimizer, cfg, batch_size, seed + rank)
    interface = hosts.boundary_interface()
    dist.barrier()
    before = hosts.interface_bytes(interface)
    with CommCounter(mesh=mesh) as counter:
        for step in range(steps):
            toy_step(model, optimizer, cfg, batch_size, seed + rank + step, counter)
    dist.barrier()
    after = hosts.interface_bytes(interface)
    address = hosts.route_address(os.environ.get("MASTER_ADDR") or "127.0.0.1")
    return {"events": counter.events, "param_bytes": param_bytes, "steps": steps, "interface": interface,
            "address": address, "tx": after["tx"] - before["tx"], "rx": after["rx"] - before["rx"],
            # the lab's nccl group reports itself as "cpu:gloo,cuda:nccl": name it by its GPU backend
            "backend": "nccl" if "nccl" in dist.get_backend() else dist.get_backend()}


def boundary_bytes(outs: list, strategy: str, num_nodes: int, ranks_per_node: int) -> dict:
    """From every rank's `wire_step`: bytes per step across the node boundary, three ways.

    wire: what the nodes' interfaces sent (one reading per node: ranks with the same address share its
    counters), headers, acknowledgements and all; counted: the lab's count of the same steps, split by the
    ring model on the real groups (`comms.cross_node_bytes`); model: `network.cross_node_step_bytes`;
    as_run: the count with each collective priced as the backend runs it (gloo runs a reduce-scatter as a
    full all-reduce and keeps the slice it needs), so wire / as_run is what headers, acknowledgements and
    the cluster's own messages add."""
    from .. import network
    from ..comms import cross_node_bytes

    steps = outs[0]["steps"]
    per_node = {}
    for out in outs:
        per_node.setdefault(out["address"], out)
    records = [e for o in outs for e in o["events"] if e["event"] == "collective"]
    as_run = records
    if outs[0]["backend"] == "gloo":
        as_run = [dict(r, sent_bytes=network.ring_sent_bytes("all_reduce", r["tensor_bytes"], r["group_size"]))
                  if r["kind"] == "reduce_scatter" else r for r in records]
    return {"strategy": strategy, "interface": outs[0]["interface"], "backend": outs[0]["backend"],
            "nodes_seen": len(per_node),
            "wire": sum(o["tx"] for o in per_node.values()) / steps,
            "wire_rx": sum(o["rx"] for o in per_node.values()) / steps,
            "counted": cross_node_bytes(records, ranks_per_node)["inter"] / steps,
            "as_run": cross_node_bytes(as_run, ranks_per_node)["inter"] / steps,
            "model": network.cross_node_step_bytes(strategy, outs[0]["param_bytes"], num_nodes, ranks_per_node),
            "param_bytes": outs[0]["param_bytes"]}


def measure_boundary(cluster, num_nodes: int, ranks_per_node: int, cfg=None, batch_size: int = 2,
                     steps: int = 2) -> list:
    """FULL_SHARD over every rank and HSDP (shard inside a node, replicate across nodes) on a started
    cluster whose ranks are numbered node by node: one `boundary_bytes` row each."""
    if cluster.world_size != num_nodes * ranks_per_node:
        raise ValueError(f"the cluster has {cluster.world_size} ranks, not {num_nodes} nodes x {ranks_per_node}.")
    meshes = {"full_shard": None, "hsdp": ((num_nodes, ranks_per_node), ("replicate", "shard"))}
    return [boundary_bytes(cluster.run(wire_step, cfg=cfg, batch_size=batch_size, mesh=mesh, steps=steps,
                                       quiet=True), strategy, num_nodes, ranks_per_node)
            for strategy, mesh in meshes.items()]


def boundary_table(rows: list) -> str:
    """The rows as text: bytes per step across the node boundary, and the ratios wire / counted and
    wire / as run."""
    lines = [f"{'bytes/step':10s} {'interface':>9s} {'wire tx':>11s} {'wire rx':>11s} {'counted':>11s} "
             f"{'cost model':>11s} {'as run':>11s} {'wire/counted':>12s} {'wire/as run':>11s}"]
    for r in rows:
        lines.append(f"{r['strategy'].upper():10s} {r['interface']:>9s} {r['wire']:>11,.0f} {r['wire_rx']:>11,.0f} "
                     f"{r['counted']:>11,.0f} {r['model']:>11,.0f} {r['as_run']:>11,.0f} "
                     f"{r['wire'] / r['counted']:>12.3f} {r['wire'] / r['as_run']:>11.3f}")
    return "\n".join(lines)


def boundary_report(rows: list) -> str:
    """What the `measure_boundary` rows say: the wire against the count and the backend's way, per strategy,
    and how many times fewer bytes HSDP sent across the boundary than FULL_SHARD, three ways."""
    by = {r["strategy"]: r for r in rows}
    lines = []
    if rows[0]["nodes_seen"] < 2:
        lines.append(f"all ranks share one machine: {rows[0]['interface']} carried every byte between them, "
                     "inside a node or not, and the cluster's own messages; the wire column is an upper bound here")
    for r in rows:
        lines.append(f"{r['strategy'].upper():10s} the interface carried {r['wire'] / r['counted']:.3f}x the "
                     f"counted bytes; {r['wire'] / r['as_run']:.3f}x the bytes as {r['backend']} runs the "
                     "collectives")
    wire_cut = by["full_shard"]["wire"] / by["hsdp"]["wire"]
    count_cut = by["full_shard"]["counted"] / by["hsdp"]["counted"]
    lines.append(f"HSDP sent {wire_cut:.2f}x fewer bytes across the node boundary than FULL_SHARD on the wire; "
                 f"the count says {count_cut:.2f}x, the cost model "
                 f"{by['full_shard']['model'] / by['hsdp']['model']:.2f}x")
    return "\n".join(lines)


def draw_boundary(rows: list, title: str):
    """Bars per strategy: bytes per step across the node boundary from the interface, the count, the model."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    kinds = [("wire", "interface counters (tx)", "tab:red"), ("as_run", "count, as the backend runs it", "tab:orange"),
             ("counted", "CommCounter, ring model split", "tab:blue"), ("model", "cost model", "tab:gray")]
    width = 0.8 / len(kinds)
    for i, (key, label, color) in enumerate(kinds):
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r[key] / 1e6 for r in rows], width, label=label, color=color)
    ax.set_xticks(range(len(rows)), [r["strategy"].upper() for r in rows])
    ax.set_ylabel("MB per step across nodes")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_scaling_cost(bytes_by, node_counts: list, curves: dict, *, num_nodes: int, ranks_per_node: int,
                      gpus_per_node: int, model_name: str):
    """Section 2's figure: the counted bytes inside / between nodes (left; `bytes_by` None: not measured) and
    the cost model's tokens/s against nodes (right; `curves[link]` = {"hsdp": [...], "full_shard": [...]})."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1, 2]})
    if bytes_by:
        names = list(bytes_by)
        intra = [bytes_by[n]["intra"] / 1e6 for n in names]
        ax1.bar(names, intra, label="inside nodes", color="tab:green")
        ax1.bar(names, [bytes_by[n]["inter"] / 1e6 for n in names], bottom=intra,
                label="between nodes", color="tab:red")
        ax1.set_ylabel("MB per step, all ranks")
        ax1.legend(fontsize=8)
        ax1.set_title(f"Collectives counted on {num_nodes} nodes x {ranks_per_node} CPU rank(s);\n"
                      "inside/between split by the ring model", fontsize=9)
    else:
        ax1.text(0.5, 0.5, "no measurement with 1 rank:\nthe split needs 2 nodes", ha="center", va="center")
        ax1.set_axis_off()
    for (inter, tput), color in zip(curves.items(), ["tab:red", "tab:orange", "tab:blue", "tab:purple"]):
        ax2.plot(node_counts, [t / 1e3 for t in tput["hsdp"]], "-o", ms=3, color=color, label=f"HSDP, {inter}")
        ax2.plot(node_counts, [t / 1e3 for t in tput["full_shard"]], ":", color=color)
    ax2.set_xlabel(f"nodes ({gpus_per_node} GPUs each, NVLink A100 inside)")
    ax2.set_ylabel("k tokens / s")
    ax2.set_title(f"Cost model: {model_name}, fixed global batch; dotted = FULL_SHARD over all GPUs", fontsize=10)
    handles, labels = ax2.get_legend_handles_labels()
    handles += [Line2D([], [], color="grey", ls="-", marker="o", ms=3), Line2D([], [], color="grey", ls=":")]
    labels += ["solid: HSDP (any link's colour)", "dotted: FULL_SHARD over all GPUs (same colour: same link)"]
    ax2.legend(handles, labels, fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    return fig


# --- claim 19's verdicts, as functions of the lesson's numbers ---------------------------------------------------

def process_group_backends() -> list:
    """The process-group backends this torch knows (torch.distributed.Backend.backend_list), without the
    placeholder 'undefined' and the test-only 'fake'."""
    import torch.distributed as dist

    return [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]


def ucx_verdict(backends: list, ucc_built: bool) -> str:
    """'Use a UCX+NCCL joint backend', tested as a claim, not as a name: torch's `ucc` backend is UCC, the
    collective library of the UCX project (Unified Communication Framework), which can run NCCL underneath
    (its NCCL transport layer). `backends`: the names torch knows; `ucc_built`: torch.distributed.is_ucc_available()."""
    listed = ", ".join(backends)
    if "ucc" not in backends:
        return (f"WRONG: this torch knows no UCX-based backend ({listed}); NCCL drives InfiniBand itself, and a "
                "per-device mix is written 'cpu:gloo,cuda:nccl'")
    built = "this torch has it built in" if ucc_built else "this torch was built without it, a build option"
    return (f"PARTLY: no backend has that name, but 'ucc', UCX's collective library, can run NCCL underneath; "
            f"{built}; it is optional, since NCCL drives InfiniBand itself (backends torch knows: {listed})")


def ethernet_verdict(claimed_gbps: tuple, line_rate_gbps: tuple) -> str:
    """'Ordinary Ethernet 10-25 GB/s', against the line rates of 10 and 25 GbE in GB/s."""
    factors = [c / r for c, r in zip(claimed_gbps, line_rate_gbps)]
    span = (f"10/25 GbE carry {line_rate_gbps[0]:g}-{line_rate_gbps[1]:g} GB/s, the posts say "
            f"{claimed_gbps[0]:g}-{claimed_gbps[1]:g} GB/s ({min(factors):.0f}x too high: bits read as bytes)")
    return f"{'RIGHT' if max(factors) < 1.25 else 'WRONG'}: {span}"


# --- exercise -----------------------------------------------------------------------------------------------

@exercise("07-hsdp-inter")
def _hsdp_inter(answer, *, measured):
    """The learner's HSDP bytes between nodes per step (whole job, in units of P, the model's bytes) against
    the lesson's count."""
    return close(answer, measured, rel=0.02, unit=" x P",
                 hint="only the all-reduce over the mesh's first dimension ('replicate') crosses nodes. With a mesh "
                      "(replicas, shards) each rank all-reduces its 1/shards of the gradient with the other ranks of "
                      "its replicate group; a ring all-reduce over n ranks sends 2(n-1)/n of that tensor from each "
                      "rank to the next in the ring. Add up only the hops between ranks on different nodes.")
