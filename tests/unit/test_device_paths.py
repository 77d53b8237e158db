"""Rank code on a GPU rank, checked on a CPU machine: tensors a GPU rank holds stand in as fake "cuda" tensors
(FakeTensorMode: an op that mixes them with CPU tensors raises FakeTensorDeviceMismatchError, as CUDA does) or,
where a whole model runs (fake CUDA tensors cannot run a module's forward on a CPU build of torch), as "meta"
tensors, which refuse CPU tensors just the same. The rank's device comes from the runtime's STATE, as on a rank."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdplab.runtime import on_rank


@pytest.fixture
def rank_on(monkeypatch):
    """rank_on("meta"): this process is a rank computing on that device (fsdplab.device() says so). Values of
    meta tensors read as 0.0: they have none, and the functions here only report them."""
    item, as_float = torch.Tensor.item, torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "item", lambda self: 0.0 if self.is_meta else item(self))
    monkeypatch.setattr(torch.Tensor, "__float__", lambda self: 0.0 if self.is_meta else as_float(self))

    def on(device):
        monkeypatch.setitem(on_rank.STATE, "device", device)
    return on


def meta_tiny():
    from fsdplab.models import TinyConfig, TinyTransformer

    with torch.device("meta"):
        return TinyTransformer(TinyConfig(num_layers=1))


def test_the_loss_takes_the_targets_to_the_logits_device():
    from fsdplab.step import _token_loss

    with FakeTensorMode():
        logits = torch.empty(2, 8, 16, device="cuda")       # FSDP2 moved the inputs, so the logits are on cuda
        targets = torch.zeros(2, 8, dtype=torch.long)         # ... the targets stayed where the batch was made
        loss = _token_loss(logits, targets)
    assert loss.device.type == "cuda" and loss.shape == ()


def test_default_device_is_the_ranks_and_the_cpu_elsewhere(rank_on):
    from fsdplab.models import TinyConfig, default_device, random_batch

    assert default_device() == torch.device("cpu")            # the notebook kernel: no rank state
    cpu_tokens, cpu_targets = random_batch(TinyConfig(), 2, seed=3)
    rank_on("cuda:0")
    assert default_device() == torch.device("cuda", 0) and default_device("cpu") == torch.device("cpu")
    rank_on("meta")
    tokens, targets = random_batch(TinyConfig(), 2, seed=3)
    assert tokens.device.type == targets.device.type == "meta"
    assert tokens.shape == cpu_tokens.shape and targets.shape == cpu_targets.shape


def test_toy_step_and_train_steps_put_the_batch_on_the_ranks_device(rank_on):
    from fsdplab.checkpoint import train_steps
    from fsdplab.comms import toy_step
    from fsdplab.models import TinyConfig

    rank_on("meta")
    model = meta_tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert toy_step(model, optimizer, model.cfg, 2, seed=0) == 0.0
    assert train_steps(model, optimizer, TinyConfig(num_layers=1), steps=2, global_batch=2) == [0.0, 0.0]


def test_held_rows_compares_on_the_shards_device():
    from fsdplab.lessons.scaling_out import held_rows

    full = torch.arange(12.0).reshape(6, 2)
    assert held_rows(full[[4, 1]], full) == [4, 1]
    with FakeTensorMode() as mode:
        local = torch.empty(3, 2, device="cuda")               # the rank's shard
        fake_full = mode.from_tensor(full)                     # the copy taken on the CPU before sharding
        with pytest.raises(Exception) as info:                 # a fake tensor has no values to list ...
            held_rows(local, fake_full)
    assert "device" not in str(info.value).lower(), info.value  # ... but the comparison ran on one device


def test_shard_agreement_and_grad_gap_move_the_reference_to_an_unsharded_parameter(rank_on):
    """After a forward FSDP2's root keeps its parameters unsharded: plain tensors on the rank's device, to be
    compared with a CPU reference."""
    from fsdplab.lessons.training_loop import grad_gap, shard_agreement

    rank_on("meta")
    model, reference = torch.nn.Linear(4, 3, device="meta"), torch.nn.Linear(4, 3)
    model.weight.grad, model.bias.grad = torch.zeros(3, 4, device="meta"), torch.zeros(3, device="meta")
    reference.weight.grad, reference.bias.grad = torch.ones(3, 4), torch.ones(3)
    assert set(shard_agreement(model, reference)) == {"weight", "bias"}
    assert grad_gap(model, reference) == 0.0                   # meta values read as 0 (the fixture)


def test_equal_state_compares_a_gpu_ranks_tensors_with_cpu_ones_on_the_cpu(monkeypatch):
    """torch.equal on a GPU machine refuses a CUDA and a CPU tensor; fake tensors have no values to compare, so
    a stand-in checks the devices it is given and compares nothing."""
    from fsdplab.checkpoint import equal_state

    seen = []

    def equal(x, y):
        seen.append((x.device.type, y.device.type))
        if x.device != y.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, got {x.device} and {y.device}")
        return True

    assert equal_state({"w": torch.ones(2)}, {"w": torch.ones(2)})[0][-1]
    assert not equal_state({"w": torch.ones(2)}, {"w": torch.zeros(2)})[0][-1]
    monkeypatch.setattr(torch, "equal", equal)
    with FakeTensorMode():
        from_rank, from_file = {"w": torch.empty(2, 3, device="cuda")}, {"w": torch.empty(2, 3)}
        rows = equal_state(from_rank, from_file)
    assert rows == [("w", (2, 3), "float32", True)] and seen == [("cpu", "cpu")]


def test_compare_sharded_step_puts_weights_and_batch_on_the_ranks_device(monkeypatch):
    """Lesson 02's checker: the learner's step gets tensors on the device fully_shard's gradient is on."""
    import fsdplab.ranks as ranks
    from fsdplab.lessons import prefetch

    monkeypatch.setattr(ranks, "device", lambda: torch.device("meta"))
    monkeypatch.setattr(ranks, "world_size", lambda: 1)
    got = []

    def step(shard, batch):
        got.append((shard.device.type, batch.device.type))
        raise RuntimeError("stop here: the rest needs a process group")

    with pytest.raises(RuntimeError, match="stop here"):
        prefetch.compare_sharded_step(step)
    assert got == [("meta", "meta")]


def test_gpu_tolerances_are_chosen_by_device():
    from fsdplab.lessons.activation_checkpointing import same_gradients_bound
    from fsdplab.lessons.training_loop import gap_tolerance

    assert same_gradients_bound("cpu", 2.0) == 0.0              # CPU runs are bit-equal: the check stays exact
    assert 0.0 < same_gradients_bound("cuda", 2.0) <= 1e-5 * 2.0
    assert gap_tolerance("cpu") == 1e-5 and 1e-5 < gap_tolerance("cuda") <= 1e-4


def test_full_copy_device_draws_a_random_init_on_the_gpu_when_it_fits(monkeypatch):
    from fsdplab.sharding import full_copy_device

    model = torch.nn.Linear(1000, 1000, device="meta")          # about 4 MB of fp32
    free = {"bytes": 10**9}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 2 * 10**9))
    assert full_copy_device(model, "cuda:0") == torch.device("cuda", 0)
    assert full_copy_device(model, "cuda:0", model_path="/a/checkpoint") == torch.device("cpu")
    assert full_copy_device(model, "cpu") == torch.device("cpu")
    free["bytes"] = 4 * 10**6                                   # less than the model's bytes: the CPU, as before
    assert full_copy_device(model, "cuda:0") == torch.device("cpu")


def test_build_sharded_builds_rank_0s_full_copy_where_full_copy_device_says(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdplab import sharding
    from fsdplab.settings import TrainSetting

    where = torch.device("cpu")
    asked, built = [], []
    monkeypatch.setattr(sharding, "full_copy_device", lambda model, device, model_path=None: asked.append(
        (torch.device(device), model_path)) or where)
    build_model = sharding.build_model
    monkeypatch.setattr(sharding, "build_model",
                        lambda setting, **kw: built.append(kw["device"]) or build_model(setting, **kw))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = sharding.build_sharded(TrainSetting(model="tiny"), init_device_mesh("cpu", (1,)), device="cpu", seed=5)
        full = build_model(TrainSetting(model="tiny"), device="cpu", seed=5).state_dict()
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()
    assert asked == [(torch.device("cpu"), None)] and built[1] is where
    assert all(torch.equal(state[k], full[k]) for k in full)    # the CPU path's numbers, as before


def test_split_batch_and_ddp_default_to_the_ranks_device(rank_on, monkeypatch):
    from fsdplab.lessons.training_loop import split_batch
    from fsdplab.sharding import apply_ddp

    rank_on("meta")
    tokens = torch.arange(32).reshape(8, 4)
    assert all(x.is_meta and y.is_meta for x, y in split_batch((tokens, tokens), 0, 2, 2))
    # DDP leaves a module where it is (fully_shard moves it): apply_ddp moves it to the rank's device first
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda module, **kwargs: module)
    assert apply_ddp(torch.nn.Linear(2, 2)).weight.is_meta
