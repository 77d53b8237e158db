"""The private-API shims follow each torch release the lab supports (2.10, 2.11, 2.13): here the releases'
differences are simulated on the installed torch; CI runs this file again under torch 2.11 itself."""

import pytest
import torch

from fsdplab import _torch_private
from fsdplab._torch_private import tracker


def _measure_fsdp_step(steps: int = 2):
    """A small FSDP2 model on real CPU tensors in a fake process group of 2 ranks, tracked for `steps` steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with _torch_private.fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        # Shapes no other test uses: DTensor caches its sharding propagation by op and shapes, and a cached op
        # runs none of it (the first measurement here must see it run).
        model = torch.nn.Sequential(torch.nn.Linear(88, 88), torch.nn.ReLU(), torch.nn.Linear(88, 12))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        tracked = tracker.make_tracker(model, optimizer)
        with tracked:
            for _ in range(steps):
                tracked.reset_peak()
                model(torch.randn(4, 88)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        return tracked.peak()


def _as_torch_2_11(monkeypatch):
    """torch 2.10 and 2.11's trackers: no `_fake_mode_on_entry`, and every op tracked, whatever fake mode it
    runs under (a class property standing for it makes the installed base class track every op)."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.setattr(_torch_private, "torch_version", lambda: (2, 11), raising=False)
    monkeypatch.setattr(MemTracker, "_fake_mode_on_entry",
                        property(lambda self: active_fake_mode(), lambda self, value: None), raising=False)


def _adam_state_is_two_shards(peak) -> None:
    """AdamW keeps two moments per parameter shard (and a 4-byte step count each): never more."""
    _, _, raw = peak
    assert 2 * raw["Sharded Param"] <= raw["OptState"] < 3 * raw["Sharded Param"], raw


def test_the_trackers_of_torch_2_11_count_the_same_bytes_as_2_13(monkeypatch):
    # torch 2.10 and 2.11's FSDPMemTracker also tracked DTensor's sharding propagation, which runs on fake
    # tensors of a mode of its own: there an optimizer step over DTensors counted 4x the optimizer state
    # (76,080 B against 18,736 B in a model of 64-wide layers). The shim leaves those ops untracked, as torch 2.13 does.
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker

    _as_torch_2_11(monkeypatch)
    tracked_fake, untracked = [], []
    track = MemTracker._track
    monkeypatch.setattr(MemTracker, "_track", lambda self, reftype, t: (
        tracked_fake.append(t) if active_fake_mode() is not None else None, track(self, reftype, t))[1])
    untracked_op = getattr(tracker._PeakTracker, "_untracked", None)
    monkeypatch.setattr(tracker._PeakTracker, "_untracked",
                        lambda self, *a: (untracked.append(a[0]), untracked_op(self, *a))[1], raising=False)
    as_2_11 = _measure_fsdp_step()
    assert not tracked_fake, f"{len(tracked_fake)} tensors of DTensor's sharding propagation were tracked"
    assert untracked, "no op ran under DTensor's own fake mode: the simulation tests nothing"
    _adam_state_is_two_shards(as_2_11)
    monkeypatch.undo()
    native = _measure_fsdp_step()
    _adam_state_is_two_shards(native)
    assert as_2_11 == native


def test_a_torch_2_13_tracker_without_its_entry_fake_mode_fails_loudly(monkeypatch):
    # Should a later torch rename `_fake_mode_on_entry`, the shim must not guess whether ops are filtered.
    from torch.distributed._tools.mem_tracker import MemTracker

    enter = MemTracker.__enter__

    def enter_without_it(self):
        result = enter(self)
        vars(self).pop("_fake_mode_on_entry", None)
        return result

    monkeypatch.setattr(MemTracker, "__enter__", enter_without_it)
    monkeypatch.setattr(_torch_private, "torch_version", lambda: (2, 13))
    with pytest.raises(_torch_private.PrivateAPIError, match=r"(?s)_fake_mode_on_entry.*torch 2\.10, 2\.11 and 2\.13"):
        _torch_private.check_private_apis()


def test_the_fsdp2_state_of_torch_2_11_passes_the_check(monkeypatch):
    # torch 2.11's FSDPState holds one unit in the instance attribute `_fsdp_param_group`; 2.13 holds a list,
    # `_fsdp_param_groups`, behind a property of the old name. The check looked for the class attribute and
    # failed on 2.10 and 2.11, where tracker.settle_fsdp works (it reads units through `fsdp_param_groups`).
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    init = FSDPState.__init__

    def init_as_2_11(self, *args, **kwargs):
        init(self, *args, **kwargs)
        groups = vars(self).pop("_fsdp_param_groups", None)
        self._fsdp_param_group = groups[0] if groups else None

    if isinstance(vars(FSDPState).get("_fsdp_param_group"), property):
        monkeypatch.delattr(FSDPState, "_fsdp_param_group")
    monkeypatch.setattr(FSDPState, "__init__", init_as_2_11)
    assert "_fsdp_param_group" in vars(FSDPState()) and not hasattr(FSDPState, "_fsdp_param_group")
    _torch_private.check_private_apis()


def test_fsdp_param_groups_reads_either_layout():
    from types import SimpleNamespace

    def module(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    assert _torch_private.fsdp_param_groups(module(_fsdp_param_groups=("a", "b"))) == ["a", "b"]   # 2.13
    assert _torch_private.fsdp_param_groups(module(_fsdp_param_group="a")) == ["a"]                # 2.10-2.11
    assert _torch_private.fsdp_param_groups(module(_fsdp_param_group=None)) == []
    with pytest.raises(_torch_private.PrivateAPIError, match="_fsdp_param_group"):
        _torch_private.fsdp_param_groups(module())


def test_below_the_floor_the_error_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(_torch_private, "torch_version", lambda: (2, 9))
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(_torch_private.PrivateAPIError) as raised:
        _torch_private.graph_task_id()
    message = raised.value.args[0]
    assert "\n" not in message and "_current_graph_task_id" in message
    assert "older than 2.10, the oldest release fsdplab supports" in message and "pip install 'torch>=2.10'" in message
    with pytest.raises(_torch_private.PrivateAPIError, match="older than 2.10"):
        _torch_private.check_private_apis()


def test_the_floor_in_pyproject_is_the_oldest_release_tested():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', pyproject)
    assert floor and (int(floor.group(1)), int(floor.group(2))) == _torch_private.OLDEST_TORCH
    assert _torch_private.TESTED_TORCH[0] == "%d.%d" % _torch_private.OLDEST_TORCH


def test_replicate_on_torch_2_10_gets_a_named_mesh_of_the_same_group(monkeypatch):
    # torch 2.10's replicate (DDP on FSDP2) asserts that the mesh has dimension names, even a 1-D one; 2.11
    # does not. The lab's 1-D data-parallel mesh has none: the shim passes the same group, named.
    from torch.distributed._composable import replicate_with_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    seen = []

    def replicate_as_2_10(module, mesh=None, **kwargs):
        if mesh.mesh_dim_names is None:
            raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
        seen.append(mesh)
        return module

    monkeypatch.setattr(replicate_with_fsdp, "replicate", replicate_as_2_10)
    monkeypatch.setattr(_torch_private, "torch_version", lambda: (2, 10), raising=False)
    with _torch_private.fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        replicate = _torch_private.replicate_fn()
        block = torch.nn.Linear(4, 4)
        assert replicate(block, mesh=mesh) is block and replicate(block, mesh=mesh) is block
        assert seen[0].mesh_dim_names == ("replicate",) and seen[0] is seen[1]     # one named mesh per mesh
        assert seen[0].get_group() is mesh.get_group() and seen[0].mesh.tolist() == mesh.mesh.tolist()
