"""Lesson 07 (scaling out) only: how the lesson's ranks are split into "nodes", tensor parallelism inside a node
+ FSDP across nodes on a 2-D mesh, counted, the losses the same model reaches in one process (to check that
TP + FSDP trains the same model), the verdicts of claim 19 computed from the lesson's numbers, and its exercise.
"""

from __future__ import annotations

import torch

from ..comms import CommCounter, make_mesh, toy_step
from ..exercises import close, exercise


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


# --- claim 19's verdicts, as functions of the lesson's numbers ---------------------------------------------------

def process_group_backends() -> list:
    """The process-group backends this torch knows (torch.distributed.Backend.backend_list), without the
    placeholder 'undefined' and the test-only 'fake'."""
    import torch.distributed as dist

    return [b for b in dist.Backend.backend_list if b not in ("undefined", "fake")]


def ucx_verdict(backends: list) -> str:
    """'Use a UCX+NCCL joint backend', from the installed torch's list of backends."""
    listed = ", ".join(backends)
    if any("ucx" in b.lower() for b in backends):
        return f"RIGHT: torch.distributed has a UCX backend ({listed})"
    return (f"WRONG: torch.distributed has no UCX backend ({listed}); NCCL drives InfiniBand itself, and a "
            "per-device mix is written 'cpu:gloo,cuda:nccl'")


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
                 hint="only the all-reduce over 'replicate' crosses nodes. Each rank all-reduces its 1/ranks_per_node "
                      "gradient shard with one rank per node; a ring all-reduce over n ranks sends 2(n-1)/n of the "
                      "tensor per rank. Multiply by the number of ranks.")
