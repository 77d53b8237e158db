"""Lesson 15's exercises, checked on the live ranks: shard and gather, the learner's own FSDP next to
`fully_shard`, and the compute-bound derivation, each tried with the reference and with the wrong answers a
learner writes (each must hear what is wrong in one line, without the call that fixes it)."""

import math

import pytest

from fsdplab.exercises import check
from fsdplab.lessons import build_fsdp as lesson


def _not_yet(verdict, *words, banned=()):
    """Not ok, one line, says `words`, and gives no code away."""
    assert not verdict.ok, verdict
    assert "\n" not in verdict.message and "Traceback" not in verdict.message, verdict
    assert all(word in verdict.message for word in words), verdict
    assert not any(word in verdict.message for word in banned), verdict


# --- section 1 -------------------------------------------------------------------------------------------------

def _shard(mistake=None):
    def shard(param):
        import math

        import torch
        import torch.distributed as dist

        n, r = dist.get_world_size(), dist.get_rank()
        flat = param.detach().reshape(-1)
        if mistake == "no padding":
            return flat.tensor_split(n)[r].clone()
        if mistake == "stub":
            return None
        per = math.ceil(flat.numel() / n)
        padded = torch.nn.functional.pad(flat, (0, per * n - flat.numel()))
        piece = (n - 1 - r) if mistake == "reversed" else r
        return padded[piece * per:(piece + 1) * per].clone()
    return shard


def _gather(mistake=None):
    def gather(local, shape):
        import math

        import torch
        import torch.distributed as dist

        n = dist.get_world_size()
        pieces = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(pieces, local.contiguous())
        if mistake == "reversed":
            pieces = pieces[::-1]
        full = torch.cat(pieces)
        if mistake == "no cut":
            return full.view(-1)
        return full[:math.prod(shape)].view(shape)
    return gather


def test_reference_shard_and_gather(cluster):
    verdict = check("15-shard-gather", (lesson.shard, lesson.gather), cluster=cluster)
    assert verdict.ok and "bit for bit" in verdict.message, verdict
    assert check("15-shard-gather", (_shard(), _gather()), cluster=cluster).ok     # all_gather works too


def test_wrong_shards_and_gathers(cluster):
    banned = ("pad(", "all_gather_into_tensor", "ceil(")
    _not_yet(check("15-shard-gather", (_shard("stub"), _gather()), cluster=cluster), "returned NoneType")
    _not_yet(check("15-shard-gather", (_shard("no padding"), _gather()), cluster=cluster),
             "rank 1's shard of a (5, 3) parameter holds 7 elements", "each must hold 8", banned=banned)
    _not_yet(check("15-shard-gather", (_shard("reversed"), _gather()), cluster=cluster),
             "is not piece 0", banned=banned)
    _not_yet(check("15-shard-gather", (lesson.shard, _gather("reversed")), cluster=cluster),
             "rank order", banned=banned)
    _not_yet(check("15-shard-gather", (lesson.shard, _gather("no cut")), cluster=cluster),
             "gather returned (16,) for a (5, 3) parameter", banned=banned)


def test_a_function_that_raises_or_a_name_not_set(cluster):
    def raises(param):
        raise ValueError("no shard today\nsecond line")

    verdict = check("15-shard-gather", (raises, lesson.gather), cluster=cluster)
    _not_yet(verdict, "your code raised on 2 rank(s): ValueError: no shard today")
    assert "second line" not in verdict.message
    _not_yet(check("15-shard-gather", ("no_such_shard", "gather"), cluster=cluster), "is not defined on this rank")
    cluster.push(shard=lesson.shard, gather=lesson.gather)          # what a %%ranks cell leaves there
    assert check("15-shard-gather", ("shard", "gather"), cluster=cluster).ok


# --- section 2 -------------------------------------------------------------------------------------------------

def _hooks(mistake=None):
    """The four hooks, written as a learner would, with one `mistake` planted."""
    def pre_forward(params):
        from fsdplab.lessons.build_fsdp import fill, gather

        for p in params:
            fill(p, gather(p.local.detach(), p.shape))

    def post_forward(params):
        from fsdplab.lessons.build_fsdp import free

        if mistake != "no free":
            for p in params:
                free(p)

    def pre_backward(params):
        if mistake == "gather once":
            return
        pre_forward(params)

    def post_backward(p):
        import torch
        import torch.distributed as dist

        from fsdplab.lessons.build_fsdp import free, shard

        n = dist.get_world_size()
        if mistake == "stub":
            return None
        if mistake == "all-reduce":
            grad = p.full.grad.clone()
            dist.all_reduce(grad)
            p.local.grad = shard(grad / n)
        else:
            flat = p.full.grad.reshape(-1)
            padded = torch.nn.functional.pad(flat, (0, p.local.numel() * n - flat.numel()))
            grad = torch.empty_like(p.local)
            dist.reduce_scatter_tensor(grad, padded)
            p.local.grad = grad if mistake == "no mean" else grad / n
        p.full.grad = None
        free(p)

    return lesson.Hooks(pre_forward, post_forward, pre_backward, post_backward)


def test_reference_fsdp_matches_fully_shard(cluster):
    verdict = check("15-my-fsdp", lesson.REFERENCE, cluster=cluster)
    assert verdict.ok, verdict
    assert "match fully_shard's on every rank" in verdict.message and "at most 1 block" in verdict.message, verdict
    assert check("15-my-fsdp", _hooks(), cluster=cluster).ok
    cluster.push(hooks=lesson.REFERENCE)                    # as the notebook's %%ranks cell leaves it
    assert check("15-my-fsdp", "hooks", cluster=cluster).ok


def test_results_are_measured(cluster):
    """The bytes the checker compares are fully_shard's own, counted in the same call: 2 all-gathers and one
    reduce-scatter of every block's parameters, 3 (N-1)/N x P sent."""
    results = cluster.run(lesson.compare_fsdp, lesson.REFERENCE)
    n = results[0]["world_size"]
    ref = results[0]["ref"]
    block_bytes = ref["reduce_scatter"]["tensor_bytes"]
    assert ref["all_gather"]["tensor_bytes"] == 2 * block_bytes
    sent = sum(v["sent_bytes"] for v in ref.values())
    assert math.isclose(sent, 3 * (n - 1) / n * block_bytes)
    assert results[0]["ref_forward_peak"] == 1 and results[0]["forward_peak"] == 1
    assert results[0]["losses"] == pytest.approx(results[0]["ref_losses"], rel=1e-5)


def test_wrong_fsdps_hear_what_is_wrong(cluster):
    banned = ("reduce_scatter", "all_reduce", "free(", "fill(", "/ n")
    _not_yet(check("15-my-fsdp", _hooks("no mean"), cluster=cluster), "2.00x fully_shard's", banned=banned)
    _not_yet(check("15-my-fsdp", _hooks("all-reduce"), cluster=cluster),
             "right gradients, but your blocks launched", "all-reduces", "fully_shard's 6 all-gathers",
             banned=banned)
    _not_yet(check("15-my-fsdp", _hooks("no free"), cluster=cluster),
             "3 of 3 blocks were gathered at once in forward", banned=banned)
    _not_yet(check("15-my-fsdp", _hooks("gather once"), cluster=cluster),
             "after pre_backward", "parameters were not gathered", banned=banned)
    _not_yet(check("15-my-fsdp", _hooks("stub"), cluster=cluster), "hold no gradient", banned=banned)
    assert check("15-my-fsdp", lesson.REFERENCE, cluster=cluster).ok     # the ranks are fine after all that


def test_the_notebooks_stubs_say_not_yet(cluster):
    def stub(*args):
        ...

    _not_yet(check("15-my-fsdp", lesson.Hooks(stub, stub, stub, stub), cluster=cluster), "no FSDP yet")
    ref = lesson.REFERENCE                     # one hook written, three still `...`: run, and told what is wrong
    _not_yet(check("15-my-fsdp", lesson.Hooks(ref.pre_forward, stub, stub, stub), cluster=cluster),
             "hold no gradient")
    _not_yet(check("15-shard-gather", (stub, stub), cluster=cluster), "returned NoneType")
    _not_yet(check("15-my-fsdp", "no_hooks_here", cluster=cluster), "is not defined on this rank")
    _not_yet(check("15-compute-bound", stub), "returned NoneType")


# --- section 3 -------------------------------------------------------------------------------------------------

def _bound(mistake=None):
    def compute_bound(params, tokens, world_size, bytes_per_s, flops_per_s):
        n = world_size
        share = 1.0 if mistake == "whole" else (n - 1) / n
        bandwidth = bytes_per_s / 8 if mistake == "bits" else bytes_per_s
        gather_s = share * 2 * params / bandwidth
        compute_s = 2 * params * tokens / flops_per_s
        if mistake == "backward":
            compute_s *= 2
        return gather_s < compute_s
    return compute_bound


def test_compute_bound_against_the_labs_model():
    assert check("15-compute-bound", lesson.compute_bound).ok
    assert check("15-compute-bound", _bound()).ok
    _not_yet(check("15-compute-bound", _bound("whole")), "receive the whole layer")
    _not_yet(check("15-compute-bound", _bound("bits")), "factor of 8")
    _not_yet(check("15-compute-bound", _bound("backward")), "backward")
    _not_yet(check("15-compute-bound", lambda *a: 1), "returned int")
    _not_yet(check("15-compute-bound", lambda p, t, n, b, f: t > 1000), "wrong at")


def test_break_even_is_the_labs_model():
    """Break-even tokens per rank: where the lab's all-gather time (network.collective_time) meets the forward."""
    for n in (1, 2, 8):
        tokens = lesson.break_even_tokens(n, "NVLink H100", 989e12)
        bw = lesson.Link("x", 450.0, 0.0).bytes_per_s
        assert math.isclose(lesson.gather_seconds(1e8, n, bw), lesson.forward_seconds(1e8, tokens, 989e12),
                            rel_tol=1e-9, abs_tol=1e-15)


# --- at 1 rank ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank():
    import fsdplab

    with fsdplab.Cluster(1) as single:
        yield single


def test_at_one_rank_what_can_still_be_told(one_rank):
    """One shard is the whole parameter and fully_shard launches no collective: the reference passes, an
    all-reduce is still another kind of collective, a block never freed still shows, a missing /N cannot."""
    assert check("15-shard-gather", (lesson.shard, lesson.gather), cluster=one_rank).ok
    right = check("15-my-fsdp", lesson.REFERENCE, cluster=one_rank)
    assert right.ok and "1 rank: your collectives move nothing" in right.message, right
    _not_yet(check("15-my-fsdp", _hooks("all-reduce"), cluster=one_rank), "fully_shard launches none at 1 rank")
    _not_yet(check("15-my-fsdp", _hooks("no free"), cluster=one_rank), "3 of 3 blocks were gathered at once")
    assert check("15-my-fsdp", _hooks("no mean"), cluster=one_rank).ok        # N = 1: nothing to divide
