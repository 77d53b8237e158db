"""fsdplab.lessons.scaling_out (lesson 07): the node layout at any world size, placements in words, the verdicts
of claim 19 and the exercise's checker, right and wrong answers against a count on live ranks."""

import pytest

import fsdplab
from fsdplab import comms
from fsdplab.exercises import check, keys
from fsdplab.lessons import scaling_out as S
from fsdplab.models import TinyConfig

CFG = TinyConfig(dim=32, num_layers=2)


@pytest.mark.parametrize("world_size, ranks_per_node, nodes, per_node, noted", [
    (4, 2, 2, 2, False), (8, 2, 4, 2, False), (6, 2, 3, 2, False),
    (2, 2, 2, 1, True), (3, 2, 3, 1, True), (6, 4, 2, 3, True), (1, 2, 1, 1, True)])
def test_node_layout_adapts_to_any_world_size(world_size, ranks_per_node, nodes, per_node, noted):
    layout = S.node_layout(world_size, ranks_per_node)
    assert (layout["num_nodes"], layout["ranks_per_node"]) == (nodes, per_node)
    assert bool(layout["note"]) == noted
    assert layout["num_nodes"] * layout["ranks_per_node"] == world_size


def test_node_layout_rejects_nonsense():
    with pytest.raises(ValueError, match=">= 1"):
        S.node_layout(0, 2)


def test_placements_and_rows_in_words():
    assert "strided shard of dim 0" in S.describe_placement("_S(0, 2)", "dp")
    assert "split factor 2" in S.describe_placement("_S(0, 2)", "dp")
    assert S.describe_placement("S(1)", "tp") == "tp: shard of dim 1"
    assert S.describe_placement("R", "dp") == "dp: replicated"
    assert S.row_ranges([5, 0, 1, 2, 6, 9]) == "0-2, 5-6, 9" and S.row_ranges([]) == "none"


def test_claim19_verdicts_are_computed():
    backends = S.process_group_backends()
    assert "gloo" in backends and "undefined" not in backends and "fake" not in backends
    assert S.ucx_verdict([b for b in backends if b != "ucc"], False).startswith("WRONG")
    with_ucc = S.ucx_verdict(sorted(set(backends) | {"ucc"}), False)
    assert with_ucc.startswith("PARTLY") and "built without it" in with_ucc
    assert "(" not in with_ucc.split("(backends")[0]          # no nested parentheses before the list
    assert "has it built in" in S.ucx_verdict(sorted(set(backends) | {"ucc"}), True)
    wrong = S.ethernet_verdict((10, 25), (1.25, 3.125))
    assert wrong.startswith("WRONG") and "8x too high" in wrong
    assert S.ethernet_verdict((1.25, 3.125), (1.25, 3.125)).startswith("RIGHT")


def test_tp_fsdp_rows_tile_the_weight_on_two_nodes(cluster):
    # 2 ranks as 2 nodes x 1 rank: what lesson 07 runs at world size 2
    outs = cluster.run(S.count_tp_fsdp_step, cfg=CFG, mesh_shape=(2, 1), quiet=True)
    reference = S.reference_losses(CFG, world_size_dp=2)
    for r, out in enumerate(outs):
        assert out["losses"] == pytest.approx([step[r] for step in reference], abs=1e-4)
    rows = sorted(row for out in outs for row in out["mlp_weight_rows"])
    assert rows == list(range(outs[0]["mlp_weight_shape"][0]))


def test_hsdp_inter_checker_right_and_wrong(cluster):
    assert "07-hsdp-inter" in keys()
    hsdp = cluster.run(comms.count_train_step, "full_shard", cfg=CFG, batch_size=2,
                       mesh=((2, 1), ("replicate", "shard")), quiet=True)
    records = [e for o in hsdp for e in o["events"] if e["event"] == "collective"]
    measured = comms.cross_node_bytes(records, 1)["inter"] / hsdp[0]["param_bytes"]
    nodes = 2
    assert check("07-hsdp-inter", 2 * (nodes - 1), measured=measured)          # 2(n-1) x P over the whole job
    wrong = check("07-hsdp-inter", 4.5, measured=measured)                     # FULL_SHARD's figure on 2 x 2
    assert not wrong and "Hint" in wrong.message
    assert not check("07-hsdp-inter", ..., measured=measured)
    # FULL_SHARD's, one node's share, bytes instead of units of P, a bool, text
    for answer in (4.5, (nodes - 1), 2 * (nodes - 1) * hsdp[0]["param_bytes"], True, "2", float("nan")):
        assert not check("07-hsdp-inter", answer, measured=measured), answer


def test_real_nodes_cluster_options():
    assert S.real_nodes_cluster("none") == (0, None)
    assert S.real_nodes_cluster("local", 2, 2) == (4, {})
    assert S.real_nodes_cluster("slurm", 2, 1, "/etc/slurm/slurm.conf") == (
        2, {"launcher": fsdplab.Slurm(nodes=2, slurm_conf="/etc/slurm/slurm.conf")})
    assert S.real_nodes_cluster("slurm", 2, 2) == (4, {"launcher": fsdplab.Slurm(nodes=2)})
    with pytest.raises(ValueError, match="nodes_launcher must be one of"):
        S.real_nodes_cluster("pbs")
    with pytest.raises(ValueError, match="nodes >= 2"):
        S.real_nodes_cluster("slurm", 1)


def test_boundary_bytes_on_loopback(cluster):
    # 2 local ranks as 2 "nodes" x 1: both share lo, which carries every byte between them (and the engines'
    # own traffic), so the interface's count is a lower-bounded superset of what crossed, not equal to it
    rows = S.measure_boundary(cluster, 2, 1, cfg=CFG, batch_size=2, steps=2)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"full_shard", "hsdp"}
    for r in rows:
        assert r["interface"] == "lo" and r["nodes_seen"] == 1
        assert r["counted"] == pytest.approx(r["model"])          # the count split by the ring model = the formula
        assert r["wire"] >= r["as_run"] >= r["counted"] > 0     # lo carried at least what gloo sent
        assert r["wire_rx"] == r["wire"]                         # loopback: every byte sent is received here
    assert by["hsdp"]["counted"] < by["full_shard"]["counted"]
    assert by["full_shard"]["as_run"] > by["full_shard"]["counted"]      # gloo: reduce-scatter runs as all-reduce
    table = S.boundary_table(rows)
    assert "FULL_SHARD" in table and "HSDP" in table
    fig = S.draw_boundary(rows, "loopback")
    assert len(fig.axes[0].patches) == 8
