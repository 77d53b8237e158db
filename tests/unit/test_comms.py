"""fsdplab.comms: the collective counter (on 2 real gloo ranks) and the cost model (pure arithmetic)."""

import pytest

from fsdplab import comms, network
from fsdplab.lessons import scaling_out
from fsdplab.models import TinyConfig

CFG = TinyConfig(dim=32, num_layers=3, seq_len=16)


# --- cost model ------------------------------------------------------------------------------------

def test_presets_are_vendor_figures():
    gbps = {name: link.bandwidth_gbps for name, link in network.PRESETS.items()}
    assert network.get_link("A100").bandwidth_gbps == 300 and network.get_link("H100").bandwidth_gbps == 450
    assert network.get_link("10 GbE").bandwidth_gbps == 1.25 and network.get_link("25 GbE").bandwidth_gbps == 3.125
    assert [network.get_link(f"{g} Gb/s").bandwidth_gbps for g in (100, 200, 400)] == [12.5, 25, 50]
    assert network.get_link("PCIe 4").bandwidth_gbps == 31.5 and len(gbps) == 10


def test_get_link_rejects_unknown_and_ambiguous_names():
    with pytest.raises(ValueError, match="unknown link"):
        network.get_link("carrier pigeon")
    with pytest.raises(ValueError):
        network.get_link("NVLink")  # two presets match


def test_ring_formula():
    link = network.Link("test", 10.0, latency_s=1e-6)
    t = network.collective_time("all_gather", 8e9, 4, link)
    assert t == pytest.approx(3 / 4 * 8e9 / 10e9 + 3e-6)
    assert network.collective_time("all_reduce", 8e9, 4, link) == pytest.approx(2 * t)
    assert network.collective_time("reduce_scatter", 8e9, 1, link) == 0.0
    with pytest.raises(ValueError):
        network.collective_time("all_to_all", 1, 2, link)


def test_step_bytes_ratios():
    p = 1e9
    assert network.step_sent_bytes("full_shard", p, 8) / network.step_sent_bytes("ddp", p, 8) == pytest.approx(1.5)
    assert network.step_sent_bytes("shard_grad_op", p, 8) == network.step_sent_bytes("ddp", p, 8)
    assert network.ring_sent_bytes("all_reduce", 100, 2) == 100 and network.ring_sent_bytes("all_gather", 100, 4) == 75


def test_hsdp_beats_flat_on_a_slow_network():
    t = network.hsdp_comm_time(14e9, 2, 8, "A100", "25 GbE", num_units=32)
    assert t["hsdp"] < t["full_shard"] / 5
    assert t["hsdp"] == pytest.approx(t["hsdp_intra"] + t["hsdp_inter"])


def test_cross_node_bytes_ring_hops():
    # one all-gather over 4 ranks on 2 nodes: 4 hops, 2 of them cross; each rank logs it once
    recs = [{"ranks": (0, 1, 2, 3), "sent_bytes": 75.0} for _ in range(4)]
    assert comms.cross_node_bytes(recs, 2) == {"intra": 150.0, "inter": 150.0}
    recs = [{"ranks": (0, 1), "sent_bytes": 50.0} for _ in range(2)]
    assert comms.cross_node_bytes(recs, 2) == {"intra": 100.0, "inter": 0.0}


def test_live_units_ignores_noop_reshards():
    log = [{"event": "collective", "kind": "all_gather", "unit": "a", "phase": "forward"},
           {"event": "reshard", "unit": "b", "phase": "forward"},
           {"event": "collective", "kind": "all_gather", "unit": "b", "phase": "forward"},
           {"event": "reshard", "unit": "a", "phase": "forward"}]
    assert [live for _, live in comms.live_units(log)] == [["a"], ["a"], ["a", "b"], ["b"]]
    assert comms.peak_live_units(log, "forward") == 2


# --- counting on real ranks (the session `cluster` from conftest.py) --------------------------------

def _collectives(out):
    return [e for e in out["events"] if e["event"] == "collective"]


@pytest.fixture(scope="module")
def steps(cluster):
    return {s: cluster.run(comms.count_train_step, s, cfg=CFG, quiet=True)[0]
            for s in ("ddp", "shard_grad_op", "full_shard")}


def test_bytes_per_step_match_zero_paper(steps):
    p = steps["ddp"]["param_bytes"]
    sent = {s: sum(r["sent_bytes"] for r in _collectives(out)) for s, out in steps.items()}
    assert sent["full_shard"] == network.step_sent_bytes("full_shard", p, 2) == 1.5 * p
    assert sent["shard_grad_op"] == p
    ddp_ar = [r for r in _collectives(steps["ddp"]) if r["kind"] == "all_reduce"]
    assert sum(r["tensor_bytes"] for r in ddp_ar) == p          # DDP's C++ reducer all-reduces every gradient
    assert all(r["phase"] == "backward" for r in ddp_ar)


def test_fsdp_order_and_implicit_backward_prefetch(steps):
    recs = _collectives(steps["full_shard"])
    fwd = [r["unit"] for r in recs if r["phase"] == "forward"]
    assert fwd == ["root", "layers.0", "layers.1", "layers.2"]
    bwd = [(r["kind"], r["unit"]) for r in recs if r["phase"] == "backward"]
    # block 1's all-gather is launched before block 2's reduce-scatter: FSDP2 prefetches in backward
    assert bwd.index(("all_gather", "layers.1")) < bwd.index(("reduce_scatter", "layers.2"))
    assert [u for k, u in bwd if k == "reduce_scatter"] == ["layers.2", "layers.1", "layers.0", "root"]
    assert {r["group_size"] for r in recs} == {2}


def test_live_units_per_strategy(steps, cluster):
    assert comms.peak_live_units(steps["full_shard"]["events"], "forward") == 1
    assert comms.peak_live_units(steps["full_shard"]["events"], "backward") == 2
    assert comms.peak_live_units(steps["shard_grad_op"]["events"], "forward") == CFG.num_layers
    deep = cluster.run(comms.count_train_step, "full_shard", cfg=CFG, explicit_prefetch=2, quiet=True)[0]
    assert comms.peak_live_units(deep["events"], "forward") == 3

    def order(out):
        return [e.get("label") if e["event"] == "marker" else (e["kind"], e["unit"])
                for e in out["events"] if e["event"] != "reshard"]

    # without explicit prefetch block 1 is gathered after block 0's forward starts; with depth 2, before it
    default, ahead = order(steps["full_shard"]), order(deep)
    assert default.index(("all_gather", "layers.1")) > default.index("fwd layers.0")
    assert ahead.index(("all_gather", "layers.2")) < ahead.index("fwd layers.0")
    # FSDP2's backward prefetch: block 1's all-gather is launched before block 2's backward starts
    assert default.index(("all_gather", "layers.1")) < default.index("bwd layers.2")


def _plain_calls():
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor.debug import CommDebugMode

    x = torch.ones(10)
    with comms.CommCounter() as counter, CommDebugMode() as debug:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(20), x)
        dist.reduce_scatter_tensor(torch.empty(5), x)
        dist.broadcast(x, src=0)
        funcol.all_reduce(torch.ones(8), "sum", dist.group.WORLD).wait()
    return [(r["kind"], r["tensor_bytes"], r["sent_bytes"]) for r in counter.records], debug.get_total_counts()


def test_plain_and_functional_calls_counted(cluster):
    records, debug_total = cluster.run(_plain_calls, quiet=True)[0]
    assert records == [("all_reduce", 40, 40.0), ("all_gather", 80, 40.0), ("reduce_scatter", 40, 20.0),
                       ("broadcast", 40, 40.0), ("all_reduce", 32, 32.0)]
    assert debug_total == len(records)  # torch's own CommDebugMode sees the same number of collectives


def _point_to_point():
    import torch
    import torch.distributed as dist

    from fsdplab import comms

    rank, last = dist.get_rank(), dist.get_world_size() - 1
    with comms.CommCounter() as counter:
        if rank == 0:
            dist.send(torch.ones(6), dst=last)
            dist.isend(torch.ones(3, dtype=torch.float64), dst=last).wait()
        elif rank == last:
            dist.recv(torch.empty(6), src=0)
            dist.irecv(torch.empty(3, dtype=torch.float64), src=0).wait()
    return [(r["kind"], r["tensor_bytes"], r["sent_bytes"]) for r in counter.records]


def test_point_to_point_sends_and_receives_counted(cluster):
    """A pipeline's stages talk by send and recv: the sender sends its tensor, the receiver nothing."""
    counts = cluster.run(_point_to_point, quiet=True)
    assert counts[0] == [("send", 24, 24.0), ("send", 24, 24.0)], counts
    assert counts[-1] == [("recv", 24, 0.0), ("recv", 24, 0.0)], counts
    assert all(c == [] for c in counts[1:-1])


def test_backward_prefetch_off_and_empty_list(steps, cluster):
    def order(out):
        return [(e.get("label") if e["event"] == "marker" else (e["kind"], e["unit"]))
                for e in out["events"] if e["event"] != "reshard"]

    empty = cluster.run(comms.count_train_step, "full_shard", cfg=CFG, backward_prefetch="empty list", quiet=True)[0]
    off = cluster.run(comms.count_train_step, "full_shard", cfg=CFG, backward_prefetch="off", quiet=True)[0]
    assert order(empty) == order(steps["full_shard"])              # [] restores the implicit default
    assert comms.peak_live_units(off["events"], "backward") == 1   # each unit listing itself: no prefetch
    bwd = [(r["kind"], r["unit"]) for r in _collectives(off) if r["phase"] == "backward"]
    assert bwd.index(("all_gather", "layers.1")) > bwd.index(("reduce_scatter", "layers.2"))   # gathered late
    with pytest.raises(ValueError, match="mode"):
        comms.set_backward_prefetch(None, "sometimes")


def test_bytes_checker(steps):
    from fsdplab.exercises import check

    p = steps["ddp"]["param_bytes"]
    # N=2 counted on the ranks; a group of one rank sends nothing (lesson 02 counts that too)
    measured = {1: 0.0, 2: sum(r["sent_bytes"] for r in _collectives(steps["full_shard"]))}
    assert check("02-bytes", lambda P, N: 3 * P * (N - 1) / N, measured=measured, param_bytes=p).ok
    # what a learner writes instead: right at N=2 only, DDP's bytes, the posts' 0.6 x DDP, a number, a string
    for wrong in (lambda P, N: 3 * P / N, lambda P, N: 1.5 * P, lambda P, N: 2 * P * (N - 1) / N,
                  lambda P, N: 0.6 * 2 * P * (N - 1) / N, lambda P: 3 * P, 1.5 * p, "3*P*(N-1)/N", None, True):
        verdict = check("02-bytes", wrong, measured=measured, param_bytes=p)
        assert not verdict.ok, wrong
    assert "at N=1" in check("02-bytes", lambda P, N: 3 * P / N, measured=measured, param_bytes=p).message


def test_bytes_checker_past_the_measured_group_sizes():
    from fsdplab.exercises import check

    p = 1_000_000
    measured = {1: 0.0, 2: 1.5 * p}        # what 2 ranks count: 3 x (2-1)/2 x P
    assert check("02-bytes", lambda P, N: 3 * P * (N - 1) / N, measured=measured, param_bytes=p).ok
    # all equal 3(N-1)/N x P at N = 1 and 2 only; at N = 4 they give twice the bytes or more
    for wrong in (lambda P, N: 1.5 * P * (N - 1), lambda P, N: 0.75 * P * N * (N - 1),
                  lambda P, N: 3 * P * (N - 1) / 2):
        verdict = check("02-bytes", wrong, measured=measured, param_bytes=p)
        assert not verdict.ok and "at N=4" in verdict.message, verdict.message
    # a measurement at N = 4 replaces the model there
    four = {**measured, 4: 2.25 * p}
    assert "N = 1, 2, 4, and the ring model at N = 8" in check(
        "02-bytes", lambda P, N: 3 * P * (N - 1) / N, measured=four, param_bytes=p).message


def test_live_blocks_checker():
    from fsdplab.exercises import check

    assert check("02-live-blocks", 4, measured=4, prefetch=3, num_layers=4).ok
    for wrong in (3, 5, 2, True, "4", 4.5, float("nan")):    # prefetch alone, prefetch + 2, the backward count
        assert not check("02-live-blocks", wrong, measured=4, prefetch=3, num_layers=4).ok, wrong


def test_bad_prefetch_depth():
    with pytest.raises(ValueError, match="depth"):
        comms.set_explicit_prefetch(None, 0)


def test_tensor_parallel_all_reduces_counted_on_tp_dim(cluster):
    # one "node" of 2 ranks: TP over both, FSDP over a data-parallel dim of size 1
    outs = cluster.run(scaling_out.count_tp_fsdp_step, cfg=CFG, mesh_shape=(1, 2), quiet=True)
    reference = scaling_out.reference_losses(CFG, world_size_dp=1)
    for out in outs:
        assert out["losses"] == pytest.approx([step[0] for step in reference], abs=1e-4)
        assert out["mlp_weight_local_shape"] == (2 * CFG.dim, CFG.dim)   # 4*dim rows split over 2 TP ranks
    tp = [r for r in _collectives(outs[0]) if r["dim"] == "tp"]
    # RowwiseParallel all-reduces each block's MLP output in forward, ColwiseParallel its input grad in backward
    assert [r["phase"] for r in tp].count("forward") == CFG.num_layers
    assert [r["phase"] for r in tp].count("backward") == CFG.num_layers
    assert all(r["kind"] == "all_reduce" and r["tensor_bytes"] == 2 * CFG.seq_len * CFG.dim * 4 for r in tp)


def _hand_step(average=True, reduce="reduce_scatter"):
    def step(shard, batch):
        import torch
        import torch.distributed as dist

        from fsdplab.lessons.prefetch import toy_loss

        n = dist.get_world_size()
        full = torch.empty(shard.shape[0] * n, *shard.shape[1:])
        dist.all_gather_into_tensor(full, shard)
        full.requires_grad_(True)
        toy_loss(full, batch).backward()
        grad = full.grad / n if average else full.grad
        if reduce == "all_reduce":
            dist.all_reduce(grad)
            return grad.chunk(n)[dist.get_rank()]
        out = torch.empty_like(shard)
        dist.reduce_scatter_tensor(out, grad)
        return out
    return step


def test_sharded_step_checker(cluster):
    from fsdplab.exercises import check

    right = check("02-sharded-step", _hand_step(), cluster=cluster)
    assert right.ok and "all_gather + reduce_scatter" in right.message
    unaveraged = check("02-sharded-step", _hand_step(average=False), cluster=cluster)
    assert not unaveraged.ok and "divide" in unaveraged.message
    all_reduce = check("02-sharded-step", _hand_step(reduce="all_reduce"), cluster=cluster)
    assert not all_reduce.ok and "sent" in all_reduce.message               # right gradients, too many bytes
    assert not check("02-sharded-step", lambda shard, batch: None, cluster=cluster).ok
    assert not check("02-sharded-step", 3, cluster=cluster).ok
