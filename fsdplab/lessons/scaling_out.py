"""Lesson 07 (scaling out) only: tensor parallelism inside a "node" + FSDP across nodes on a 2-D mesh, counted,
and the losses the same model reaches in one process, to check that TP + FSDP trains the same model.
"""

from __future__ import annotations

import torch

from ..comms import CommCounter, make_mesh, toy_step


def count_tp_fsdp_step(cfg=None, mesh_shape=(2, 2), batch_size: int = 2, seed: int = 0) -> dict:
    """On a rank: tensor parallelism inside a "node" + FSDP across nodes, on a 2-D mesh ("dp", "tp").

    Each block's MLP is split Megatron-style by `sharding.apply_tp` (one all-reduce in forward and one in
    backward over "tp"; attention stays replicated); then `sharding.apply_fsdp` shards every block and the
    root over "dp". Counts one step after a warm-up; also returns the losses, so they can be compared with
    the same model trained in one process (`reference_losses`)."""
    from ..models import TinyConfig, blocks_of
    from ..sharding import apply_fsdp, apply_tp, build_tiny

    cfg = cfg or TinyConfig()
    mesh2d = make_mesh(mesh_shape, ("dp", "tp"))
    model = apply_tp(build_tiny(cfg, seed=seed), mesh2d["tp"])
    # None is fully_shard's default: blocks reshard after forward, the root (needed first in backward) does not
    apply_fsdp(model, mesh2d["dp"], reshard_after_forward=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # one batch per data-parallel group: the two TP ranks of a node must see the same tokens
    dp_rank = mesh2d.get_local_rank("dp")

    def step(counter=None):
        return toy_step(model, optimizer, cfg, batch_size, seed + dp_rank, counter)

    first_loss = step()
    with CommCounter(mesh=mesh2d) as counter:
        second_loss = step(counter)
    mlp = blocks_of(model)[0].mlp[0].weight
    return {"events": counter.events, "losses": [first_loss, second_loss],
            "mlp_weight_placements": [str(p) for p in mlp.placements], "mlp_weight_local_shape": tuple(mlp.to_local().shape),
            "mlp_weight_shape": tuple(mlp.shape)}


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
