"""Lesson 09's own code: the live-bytes counter, the init and its health check, the batch split, the sizes at
full scale, and the exercise checkers tried with the wrong answers a learner would give. The lesson itself runs
in tests/lessons/test_notebooks.py (its checks cell judges every measurement made on live ranks)."""

import math

import pytest
import torch
from torch import nn

from fsdplab.exercises import check
from fsdplab.lessons import training_loop as tl
from fsdplab.models import TinyConfig, TinyTransformer
from fsdplab.settings import GIB


def test_live_bytes_counts_what_is_allocated_freed_and_resized_in_place():
    with tl.LiveBytes() as live:
        a = torch.empty(1000, dtype=torch.float32)           # 4,000 B
        b = torch.empty(500, dtype=torch.float64)            # 4,000 B
        assert live.now == 8000
        del a
        assert live.now == 4000
        b.untyped_storage().resize_(0)                       # how FSDP2 frees an all-gather buffer
        assert live.now == 0
        b.untyped_storage().resize_(800)
        assert live.now == 800
    assert live.peak == 8000
    before = torch.empty(10)
    with tl.LiveBytes() as later:
        before.untyped_storage().resize_(0)                  # made outside: not counted either way
        torch.empty(4)
    assert later.now == 0 and later.peak == 16
    assert torch.UntypedStorage.resize_ is not None and "LiveBytes" not in repr(torch.UntypedStorage.resize_)


def test_held_at_a_mark_leaves_out_what_another_thread_let_go_of_later():
    import threading

    with tl.LiveBytes() as live:
        kept = torch.empty(100)                              # 400 B the program holds
        lent = [torch.empty(50)]                             # 200 B a backend's thread holds last
        mark = live.mark()
        worker = threading.Thread(target=lambda box: box.pop(), args=(lent,))
        worker.start()
        worker.join()                                        # its thread dropped the last reference
        assert live.now == 400
        dropped_here = torch.empty(25)                       # 100 B freed on the block's own thread
        second = live.mark()
        del dropped_here
    assert live.held(mark) == 400 and live.held(second) == 500 and kept.numel() == 100


def test_init_weights_draws_the_same_full_tensors_whatever_came_before():
    one = tl.init_weights(TinyTransformer(TinyConfig()), seed=3)
    torch.randn(1000)                                        # the global generator moved: no effect
    two = tl.init_weights(TinyTransformer(TinyConfig()), seed=3)
    other = tl.init_weights(TinyTransformer(TinyConfig()), seed=4)
    assert set(tl.shard_agreement(one, two).values()) == {1.0}
    agreement = tl.shard_agreement(one, other)
    assert agreement["layers.0.norm1.weight"] == 1.0 and agreement["head.weight"] == 0.0
    std = one.head.weight.std().item()
    assert 0.015 < std < 0.025, std


def test_the_health_check_flags_leftover_bytes_and_passes_an_init():
    model = tl.init_weights(TinyTransformer(TinyConfig()))
    assert not tl.looks_uninitialized(tl.weight_health(model))
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    assert tl.looks_uninitialized(tl.weight_health(model))
    zeros = TinyTransformer(TinyConfig())
    with torch.no_grad():
        for p in zeros.parameters():
            p.zero_()                                        # fresh pages from the system are zeros
    assert tl.looks_uninitialized(tl.weight_health(zeros))
    huge = tl.init_weights(TinyTransformer(TinyConfig()))
    with torch.no_grad():
        huge.head.weight[1, 1] = 2e38
    assert tl.looks_uninitialized(tl.weight_health(huge))


def test_split_batch_strides_over_ranks_and_refuses_a_ragged_split():
    tokens = torch.arange(16).reshape(8, 2)
    parts = tl.split_batch((tokens, tokens), rank=1, world_size=2, k=2)
    assert [p[0][:, 0].tolist() for p in parts] == [[2, 6], [10, 14]]
    everyone = sorted(int(x) for r in range(4) for t, _ in tl.split_batch((tokens, tokens), r, 4, 1) for x in t[:, 0])
    assert everyone == tokens[:, 0].tolist()
    with pytest.raises(ValueError, match="multiple of world_size x micro_batches = 6"):
        tl.split_batch((tokens, tokens), 0, 2, 3)


def test_grad_gap_is_zero_for_the_same_gradients_and_relative_otherwise():
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    a(x).sum().backward()
    b(x).sum().backward()
    assert tl.grad_gap(a, b) == 0.0
    for p in a.parameters():
        p.grad.mul_(1.5)
    assert math.isclose(tl.grad_gap(a, b), 0.5, rel_tol=1e-6)


def test_param_bytes_pad_each_tensor_to_equal_row_chunks():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3, bias=False))   # rows 5, 5, 3
    sizes = tl.param_bytes_of(model, world_size=2)
    assert sizes["params"] == 20 + 5 + 15
    assert sizes["full"] == 4 * 40
    assert sizes["shard"] == 4 * (3 * 4 + 3 + 2 * 5)         # ceil(5/2)=3 rows of 4, 3 of the bias, 2 rows of 5
    tiny = tl.param_bytes_of(tl.tiny_model(), 1)
    assert tiny["full"] == tiny["shard"] == 4 * sum(p.numel() for p in tl.tiny_model().parameters())


def test_overlap_counts_shared_samples():
    assert tl.overlap([1, 2, 3, 4], [3, 4, 5]) == 0.5 and tl.overlap([], [1]) == 0.0


@pytest.mark.parametrize("k", [2, 4, 8])
def test_summed_loss_checker_wants_the_factor_k(k):
    measured = float(k)                                      # the lesson measures the ratio of gradient norms
    assert check("09-summed-loss", k, measured=measured)
    for wrong in (1, 1 / k, math.sqrt(k), 2 * k, "4", True, float("nan")):
        assert not check("09-summed-loss", wrong, measured=measured), wrong


def test_no_sync_checker_wants_full_minus_shard_gradients_in_fp32():
    big = {"params": 7_721_324_544}
    world = 8
    right = 4 * big["params"] * (1 - 1 / world) / GIB        # about 25.2 GiB
    measured = right * 1.001                                 # the lab's count: padded rows, a hair more
    assert check("09-no-sync-gib", right, measured=measured)
    full, shard = 4 * big["params"] / GIB, 4 * big["params"] / world / GIB
    for wrong in (full, shard, right / 2, 2 * big["params"] / GIB, right * GIB, None):
        assert not check("09-no-sync-gib", wrong, measured=measured), wrong
