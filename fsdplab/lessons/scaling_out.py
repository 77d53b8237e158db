"""Lesson 07 (scaling out) only: how the lesson's ranks are split into "nodes", tensor parallelism inside a node
+ FSDP across nodes on a 2-D mesh, counted, the losses the same model reaches in one process (to check that
TP + FSDP trains the same model), the bytes that really cross the boundary between real nodes (interface
counters) against the lab's count and the cost model, the verdicts of claim 19 computed from the lesson's
numbers, and its exercises: the bytes HSDP sends between nodes, and the learner's own HSDP run on the live ranks
next to the lab's.
"""

from __future__ import annotations

import torch

from ..comms import CommCounter, make_mesh, toy_step
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


def count_tp_fsdp_step(cfg=None, mesh_shape=(2, 2), batch_size: int = 2, seed: int = 0) -> dict:
    """On a rank: tensor parallelism inside a "node" + FSDP across nodes, on a 2-D mesh ("dp", "tp").

    Each block's MLP is split Megatron-style by `sharding.apply_tp` (one all-reduce in forward and one in
    backward over "tp"; attention stays replicated); then `sharding.apply_fsdp` shards every block and the
    root over "dp". Counts one step after a warm-up; also returns the losses, so they can be compared with
    the same model trained in one process (`reference_losses`), and which rows of the first MLP weight this
    rank holds."""
    from ..models import TinyConfig, blocks_of
    from ..sharding import apply_fsdp, apply_tp, build_tiny

    cfg = cfg or TinyConfig()
    mesh2d = make_mesh(mesh_shape, ("dp", "tp"))
    model = build_tiny(cfg, seed=seed)
    # the first MLP weight before sharding: which of its rows each rank holds is found by comparing rows
    # (no full_tensor(): gathering a _StridedShard takes torch's slow path, which warns)
    initial = blocks_of(model)[0].mlp[0].weight.detach().clone()
    apply_tp(model, mesh2d["tp"])
    # None is fully_shard's default: blocks reshard after forward, the root (needed first in backward) does not
    apply_fsdp(model, mesh2d["dp"], reshard_after_forward=None)
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
            "mlp_weight_placements": [str(p) for p in mlp.placements], "mlp_weight_local_shape": tuple(mlp.to_local().shape),
            "mlp_weight_shape": tuple(mlp.shape), "mlp_weight_mesh_dims": list(mlp.device_mesh.mesh_dim_names),
            "mlp_weight_rows": rows}


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
    built = "built into this torch" if ucc_built else "not built into this torch (a build option)"
    return (f"PARTLY: no backend has that name, but 'ucc' (UCX's collective library, {built}) can run NCCL "
            f"underneath; it is optional, since NCCL drives InfiniBand itself (backends: {listed})")


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


# --- the HSDP exercise: the learner's mesh and wrapping, run on the live ranks -------------------------------

def _first_line(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _units(model) -> list:
    """The FSDP units of `model`, by module path ("root" for the model itself), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [name or "root" for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _counted_step(model, cfg, batch_size: int, seed: int) -> dict:
    """On a rank: one warm-up training step of `model` (SGD), then one counted by a CommCounter. Returns the two
    losses, the counted collectives and the whole gradient of each parameter in the counted step."""
    from torch.distributed.tensor import DTensor

    from ..models import random_batch
    from ..ranks import this_rank
    from ..sharding import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()
    first = toy_step(model, optimizer, cfg, batch_size, seed + rank)
    grads = {}

    def keep():
        grads.update((name, p.grad) for name, p in model.named_parameters())

    batch = random_batch(cfg, batch_size, seed=seed + rank)
    with CommCounter() as counter:
        second = train_step(model, optimizer, batch, counter=counter, after_backward=keep).item()
    records = [{key: r[key] for key in ("kind", "ranks", "sent_bytes", "unit", "phase")} for r in counter.records]
    whole = {name: g.full_tensor() if isinstance(g, DTensor) else g for name, g in grads.items()}
    return {"losses": [first, second], "records": records, "grads": whole}


def compare_hsdp(hsdp_fn, layouts=(1,), cfg=None, batch_size: int = 2, seed: int = 0) -> list:
    """On a rank: for each ranks-per-node in `layouts`, the learner's `hsdp_fn(model, ranks_per_node)` on a
    fresh tiny transformer next to the lab's HSDP of it (`sharding.apply_fsdp` on the 2-D mesh (nodes,
    ranks_per_node), dims ("replicate", "shard")), one counted step each. Returns, per layout, the units and
    placements each made, the collectives each ran, the losses and each parameter's relative gradient error;
    it stops at the first layout where the learner's code raises."""
    from torch.distributed.tensor import DTensor

    from ..models import TinyConfig
    from ..ranks import device, this_rank, world_size
    from ..sharding import apply_fsdp, build_tiny

    cfg = cfg or TinyConfig(dim=32, num_layers=2)
    n, rank, out = world_size(), this_rank(), []
    for ranks_per_node in layouts:
        nodes = n // ranks_per_node
        lab = build_tiny(cfg, seed=seed, device=device())
        apply_fsdp(lab, make_mesh((nodes, ranks_per_node), ("replicate", "shard")))
        weight = lab.head.weight
        result = {"rank": rank, "world_size": n, "nodes": nodes, "ranks_per_node": ranks_per_node,
                  "blocks": [f"layers.{i}" for i in range(cfg.num_layers)], "lab_units": _units(lab),
                  "lab_placements": str(tuple(weight.placements)), "lab_mesh": weight.device_mesh.mesh.tolist()}
        out.append(result)
        lab_step = _counted_step(lab, cfg, batch_size, seed)
        result.update(lab_records=lab_step["records"], lab_losses=lab_step["losses"])
        model = build_tiny(cfg, seed=seed, device=device())
        try:
            returned = hsdp_fn(model, ranks_per_node)
        except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
            result["error"], returned = _first_line(err), model
        result["units"] = _units(model)
        result["returned"] = "model" if returned is model else "None" if returned is None else type(returned).__name__
        params = dict(model.named_parameters())
        result["plain"] = [name for name, p in params.items() if not isinstance(p, DTensor)]
        # each distinct (placements, mesh) the learner's parameters sit on, with the first parameter on it
        seen = {}
        for name, p in params.items():
            if isinstance(p, DTensor):
                seen.setdefault((str(tuple(p.placements)), str(p.device_mesh.mesh.tolist())),
                                (name, str(tuple(p.placements)), p.device_mesh.mesh.tolist()))
        result["layouts"] = list(seen.values())
        if "error" in result:
            return out
        try:
            step = _counted_step(model, cfg, batch_size, seed)
        except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
            result["run_error"] = _first_line(err)
            return out
        result.update(records=step["records"], losses=step["losses"], grad_errors={})
        for name, expected in lab_step["grads"].items():
            got = step["grads"].get(name)
            result["grad_errors"][name] = (float("inf") if got is None or expected is None else
                                           float((got - expected).norm() / expected.norm()))
    return out


def _groups(results: list, kind: str, lab: bool = False) -> list:
    """The rank groups a collective `kind` ran over, on any rank, sorted."""
    key = "lab_records" if lab else "records"
    return sorted({tuple(r["ranks"]) for x in results for r in x.get(key, []) if r["kind"] == kind})


def _groups_text(groups: list) -> str:
    """[(0, 1), (2, 3)] -> '[0, 1] and [2, 3]'."""
    names = [str(list(g)) for g in groups]
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "no ranks"


def _crosses(ranks, ranks_per_node: int) -> bool:
    """Whether a group of ranks spans more than one node (node = rank // ranks_per_node)."""
    return len({r // ranks_per_node for r in ranks}) > 1


def _between_nodes(results: list, ranks_per_node: int, lab: bool = False) -> float:
    """Bytes the counted step sent across the node boundary, whole job (ring model on the real groups)."""
    from ..comms import cross_node_bytes

    key = "lab_records" if lab else "records"
    return cross_node_bytes([r for x in results for r in x.get(key, [])], ranks_per_node)["inter"]


def _bytes_text(results: list, ranks_per_node: int) -> str:
    """'9,000 B per step between nodes (whole job), where the lab's HSDP sends 3,000 B'."""
    mine, lab = _between_nodes(results, ranks_per_node), _between_nodes(results, ranks_per_node, lab=True)
    if mine == lab:
        return f"{mine:,.0f} B per step between nodes (whole job), as many as the lab's HSDP sends here"
    return f"{mine:,.0f} B per step between nodes (whole job), where the lab's HSDP sends {lab:,.0f} B"


def _mesh_verdict(results: list, lesson=None) -> str | None:
    """What is wrong with the mesh and placements the learner's parameters sit on, or None when they are HSDP's.
    `lesson`: None at the lesson's own layout, else its (nodes, ranks per node) (the checker's message names
    the layout tried then)."""
    out = results[0]
    rpn, nodes, n = out["ranks_per_node"], out["nodes"], out["world_size"]
    if len(out["layouts"]) > 1:
        spots = "; ".join(f"{name} is {placements} over {mesh}" for name, placements, mesh in out["layouts"][:2])
        return f"your parameters sit on {len(out['layouts'])} different meshes ({spots}): put every unit on one mesh."
    _, placements, mesh = out["layouts"][0]
    if mesh == out["lab_mesh"] and placements == out["lab_placements"]:
        return None
    ring = _bytes_text(results, rpn)
    if mesh and not isinstance(mesh[0], list):               # a 1-D mesh
        if sorted(mesh) == list(range(n)):
            return (f"your parameters are {placements} on a 1-D mesh of {'both' if n == 2 else f'all {n}'} ranks: "
                    f"plain FULL_SHARD, whose all-gathers and reduce-scatters run over ranks {mesh}, across the "
                    f"nodes: {ring}. Make the mesh 2-D: replicate across nodes, shard inside a node.")
        if not _crosses(mesh, rpn):
            meshes = sorted({tuple(x["layouts"][0][2]) for x in results if x["layouts"]})
            grads = [v for x in results for v in x.get("grad_errors", {}).values()]
            gap = f": they differ by up to {max(grads):.1e} (relative)" if grads else ""
            return (f"your parameters are {placements} on 1-D meshes of one node each ({_groups_text(meshes)}): "
                    "nothing is replicated across nodes, so no collective crossed the node boundary and each node "
                    f"averaged only its own ranks' gradients, where the lab's HSDP averages every rank's{gap}. "
                    "Shard every unit on the whole 2-D mesh.")
        return (f"your parameters are {placements} on a 1-D mesh of ranks {mesh}, across nodes: {ring}. Make the "
                "mesh 2-D: replicate across nodes, shard inside a node.")
    shape = (len(mesh), len(mesh[0]))
    where = (f"with {nodes} nodes x {rpn} rank(s) (node 0 is ranks {out['lab_mesh'][0]}), " if lesson is None else "")
    where += (f"your {shape[0]} x {shape[1]} mesh shards over ranks {mesh[0]} and replicates over ranks "
              f"{[row[0] for row in mesh]}")
    if mesh == out["lab_mesh"]:
        return f"{where}, as HSDP does, but your parameters are {placements}, not {out['lab_placements']}."
    if _crosses(mesh[0], rpn):
        hint = "The mesh's first dim"
        if shape == (rpn, nodes):
            same = f" (at {lesson[0]} x {lesson[1]} both orders make the same mesh)" if lesson and len(set(lesson)) == 1 else ""
            hint = f"Its dims are the wrong way round{same}: the first"
        return (f"{where}: its all-gathers and reduce-scatters cross the node boundary, {ring}. {hint} counts the "
                "nodes (replicate), the second the ranks of one node (shard).")
    return (f"{where}: it shards over {len(mesh[0])} rank(s) where a node has {rpn}, so a node's ranks keep copies "
            f"of the same shard and all-reduce them across nodes: {ring}. Shard over the ranks of a node, replicate "
            "across nodes.")


def _layout_verdict(results: list, lesson, rel: float) -> str | None:
    """What is wrong with the learner's HSDP at one layout (every rank's `compare_hsdp` entry), or None."""
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    blocks, units, rpn = out["blocks"], out["units"], out["ranks_per_node"]
    missing = [b for b in blocks if b not in units]
    if "error" in out:
        if "root" in units and missing:
            return ("the root was wrapped before the blocks: its unit already held the blocks' parameters, and "
                    f"your function then raised {out['error']}")
        return f"your function raised on the ranks: {out['error']}"
    if not units:
        return "nothing was sharded: every parameter is still a plain tensor, whole on every rank."
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name in out["plain"]))
    if "root" not in units and owners:
        listed = " and ".join(filter(None, [", ".join(owners[:-1]), owners[-1]]))
        return f"the root was not wrapped: the parameters of {listed} are plain tensors, whole on every rank."
    if out["plain"]:
        return f"{', '.join(out['plain'])} stayed plain tensors, whole on every rank."
    wrong_mesh = _mesh_verdict(results, lesson)
    if wrong_mesh:
        return wrong_mesh
    if missing:
        what = ("only the root is an FSDP unit" if units == ["root"] else
                f"{len(missing)} of {len(blocks)} blocks ({', '.join(missing)}) are not FSDP units")
        gathered = [r["unit"] for r in out.get("records", []) if r["kind"] == "all_gather" and r["phase"] == "forward"]
        lab = [r["unit"] for r in out["lab_records"] if r["kind"] == "all_gather" and r["phase"] == "forward"]
        if lab:
            return (f"{what}: forward all-gathered {len(gathered)} unit(s) ({', '.join(gathered) or 'none'}) where "
                    f"the lab's HSDP gathers {len(lab)} ({', '.join(lab)}), one block at a time. Make each block a "
                    "unit of its own, then the root.")
        return (f"{what}: your units are {', '.join(units)}, the lab's HSDP's {', '.join(out['lab_units'])}. Make "
                "each block a unit of its own, then the root.")
    if "run_error" in out:
        return f"the sharded model raised in its training step: {out['run_error']}"
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        groups, lab_groups = _groups(results, kind), _groups(results, kind, lab=True)
        if groups != lab_groups:
            return (f"your step's {kind.replace('_', '-')}s ran over ranks {_groups_text(groups)}, the lab's HSDP's "
                    f"over {_groups_text(lab_groups)}: {_bytes_text(results, rpn)}.")
    if _between_nodes(results, rpn) != _between_nodes(results, rpn, lab=True):
        return (f"the collectives ran in the right groups, but {_bytes_text(results, rpn)}: they carried tensors of "
                "another size. Keep the model's fp32 parameters and gradients, as the lab's HSDP does.")
    worst = max(results, key=lambda x: max(abs(a - b) for a, b in zip(x["losses"], x["lab_losses"])))
    off = max(abs(a - b) for a, b in zip(worst["losses"], worst["lab_losses"]))
    if off > rel * max(1.0, *map(abs, worst["lab_losses"])):
        return (f"rank {worst['rank']}'s losses are {', '.join(f'{x:.6f}' for x in worst['losses'])}, the lab's HSDP "
                f"{', '.join(f'{x:.6f}' for x in worst['lab_losses'])}: leave the model's values and precision as "
                "they are.")
    name, error = max(((k, v) for x in results for k, v in x["grad_errors"].items()), key=lambda item: item[1])
    if error > rel:
        return (f"{name}'s gradient differs from the lab's HSDP's by {error:.1e} (relative): keep the parameters "
                "in fp32 and let FSDP average the gradients over every rank.")
    if out["returned"] != "model":
        return (f"your function shards the model but returns {out['returned']}: return the model it was given, "
                "which the training code goes on to use.")
    return None


@exercise("07-hsdp")
def _hsdp(answer, *, cluster, ranks_per_node: int = 2, cfg=None, rel: float = 1e-4):
    """The learner's `my_hsdp(model, ranks_per_node)` on every rank, on the tiny transformer of `cfg` (None: a
    smaller one), at the lesson's node layout and at one rank per node, next to the lab's HSDP in the same
    call: placements, units, the groups each collective ran in, the bytes that crossed the node boundary, then
    losses and gradients."""
    if not callable(answer):
        return False, f"expected a function my_hsdp(model, ranks_per_node) that shards the model, got {answer!r}."
    if cluster is None or cluster.world_size == 1:
        return False, ("with 1 rank there is one node: nothing is sharded or replicated, so which collectives "
                       "cross the node boundary, and their bytes, cannot be measured. Run the lesson with "
                       "world_size 2 or more (4 makes 2 nodes x 2).")
    if not cluster.running:
        return False, "the ranks are stopped (the lesson stops them at its end): run cluster.start(), then this cell."
    if cluster.broken:
        return False, f"the ranks cannot run it ({cluster.broken.splitlines()[0]}): run cluster.restart(), then this cell."
    rpn = node_layout(cluster.world_size, ranks_per_node)["ranks_per_node"]
    layouts = [rpn] + ([1] if rpn > 1 else [])
    try:
        results = cluster.run(compare_hsdp, answer, layouts, cfg)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    per_layout = [[x[i] for x in results if i < len(x)] for i in range(len(results[0]))]
    for i, at in enumerate(per_layout):
        lesson = (per_layout[0][0]["nodes"], rpn) if i else None
        wrong = _layout_verdict(at, lesson, rel)
        if wrong:
            if i:
                wrong = (f"right at {lesson[0]} nodes x {rpn} ranks, but the checker also calls my_hsdp(model, 1), "
                         f"{at[0]['nodes']} nodes x 1 rank: {wrong}")
            return False, wrong
    first = per_layout[0]
    out = first[0]
    worst = max(v for layout in per_layout for x in layout for v in x["grad_errors"].values())
    groups = ", ".join(f"{kind.replace('_', '-')}s over {_groups_text(_groups(first, kind))}"
                       for kind in ("all_gather", "reduce_scatter", "all_reduce") if _groups(first, kind))
    if not _groups(first, "all_gather"):
        groups += " (1 rank per node: nothing to gather or scatter inside a node)"
    also = f"; right at {per_layout[1][0]['nodes']} nodes x 1 rank too" if len(per_layout) > 1 else ""
    return True, (f"at {out['nodes']} nodes x {rpn} rank(s) your parameters are {out['lab_placements']} on the mesh "
                  f"{out['lab_mesh']}, as the lab's HSDP: {groups}; {_between_nodes(first, rpn):,.0f} B per step "
                  f"crossed the node boundary, as the lab's; losses and gradients match (worst relative error "
                  f"{worst:.1e}){also}.")
