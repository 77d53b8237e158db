"""Lesson 07's code exercise, "07-hsdp": the learner's HSDP, a 2-D mesh and fully_shard on it, run on the live
ranks (2 ranks: 2 nodes x 1). The right answer passes; the wrong ones a learner writes each hear what is wrong."""

import pytest

import fsdplab
from fsdplab.exercises import check


def _hsdp(mesh="nodes, ranks", units="blocks, root", give_back=True):
    """A learner's my_hsdp. `mesh`: "nodes, ranks" (right), "ranks, nodes" (dims swapped), "ranks per node: 1",
    "all ranks" (1-D, FULL_SHARD) or "shard" (the 2-D mesh's shard dim alone); `units`: "blocks, root" or
    "root"."""
    def my_hsdp(model, ranks_per_node):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        n, device = fsdplab.world_size(), fsdplab.device().type
        names = ("replicate", "shard")
        if mesh == "all ranks":
            on = init_device_mesh(device, (n,))
        elif mesh == "ranks per node: 1":           # every rank its own replica, whatever the node
            on = init_device_mesh(device, (n, 1), mesh_dim_names=names)
        elif mesh == "ranks, nodes":
            on = init_device_mesh(device, (ranks_per_node, n // ranks_per_node), mesh_dim_names=names)
        else:
            on = init_device_mesh(device, (n // ranks_per_node, ranks_per_node), mesh_dim_names=names)
        if mesh == "shard":
            on = on["shard"]
        if units == "blocks, root":
            for block in model.layers:
                fully_shard(block, mesh=on)
        fully_shard(model, mesh=on)
        return model if give_back else None
    return my_hsdp


def _not_yet(verdict, *words):
    """Not ok, says `words` in one line, and gives no code away."""
    assert not verdict.ok and all(word in verdict.message for word in words), verdict
    assert "\n" not in verdict.message and "Traceback" not in verdict.message, verdict
    assert "init_device_mesh(" not in verdict.message and "fully_shard(" not in verdict.message, verdict


def test_hsdp_checker(cluster):
    right = check("07-hsdp", _hsdp(), cluster=cluster, ranks_per_node=1)
    assert right.ok and "(Replicate(), Shard(dim=0))" in right.message and "all-reduces over [0, 1]" in right.message
    _not_yet(check("07-hsdp", _hsdp("all ranks", "root"), cluster=cluster, ranks_per_node=1),   # the cell as given
             "1-D mesh of both ranks: plain FULL_SHARD", "one unit for the whole model", "between nodes")
    _not_yet(check("07-hsdp", _hsdp("all ranks"), cluster=cluster, ranks_per_node=1),          # blocks, 1-D mesh
             "plain FULL_SHARD over every rank (here 3 units)", "between nodes")
    _not_yet(check("07-hsdp", _hsdp("ranks, nodes"), cluster=cluster, ranks_per_node=1),
             "1 x 2 mesh shards over ranks [0, 1]", "cross the node boundary", "wrong way round")
    _not_yet(check("07-hsdp", _hsdp("shard"), cluster=cluster, ranks_per_node=1),
             "one node each ([0] and [1])", "averaged only its own ranks' gradients")
    _not_yet(check("07-hsdp", _hsdp(units="root"), cluster=cluster, ranks_per_node=1), "only the root is an FSDP unit")
    _not_yet(check("07-hsdp", _hsdp(give_back=False), cluster=cluster, ranks_per_node=1), "returns None")


def test_hsdp_checker_refuses_what_cannot_run(cluster):
    _not_yet(check("07-hsdp", 3, cluster=cluster), "expected a function")

    def raises(model, ranks_per_node):
        raise ValueError("no mesh yet\nsecond line")

    raised = check("07-hsdp", raises, cluster=cluster, ranks_per_node=1)
    _not_yet(raised, "raised on the ranks: ValueError: no mesh yet")
    assert "second line" not in raised.message
    assert check("07-hsdp", _hsdp(), cluster=cluster, ranks_per_node=1).ok        # the ranks are fine after it
    _not_yet(check("07-hsdp", _hsdp(), cluster=None), "1 rank", "cannot be measured")
    _not_yet(check("07-hsdp", _hsdp(), cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")   # never started


@pytest.fixture(scope="module")
def four():
    """Four ranks, the lesson's default: 2 nodes x 2."""
    with fsdplab.Cluster(4, quiet=True) as c:
        yield c


def test_hsdp_checker_on_two_nodes_of_two(four):
    """At 2 x 2 both orders of the dims make one mesh: the checker's second layout, 4 nodes x 1, tells them apart."""
    _not_yet(check("07-hsdp", _hsdp("ranks, nodes"), cluster=four, ranks_per_node=2),
             "right at 2 nodes x 2 ranks", "4 nodes x 1 rank", "wrong way round (at 2 x 2 both orders")
    _not_yet(check("07-hsdp", _hsdp("ranks per node: 1"), cluster=four, ranks_per_node=2),
             "4 x 1 mesh shards over ranks [0]", "where a node has 2")
