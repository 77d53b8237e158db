"""Every private torch API fsdplab relies on, in one place.

The exact memory estimator runs a real training step of a full-size model in one process with nothing
behind the tensors: a fake process group of any world size (`FakeStore` + the "fake" backend), fake
tensors (`FakeTensorMode`) and FSDP2's memory tracker (`FSDPMemTracker`), which sorts every live
tensor into parameters, gradients, optimizer state, activations and communication buffers. None of these
are public APIs; `check_private_apis()` (run by tests/test_memory.py) fails loudly, naming what changed,
when a torch upgrade moves them.
"""

from __future__ import annotations

import contextlib

# The tracker's own category names, mapped to the six categories fsdplab reports.
TRACKER_TO_CATEGORY = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Inputs": "activations",
    "All Gather": "communication_buffers",
    "Reduce Scatter": "communication_buffers",
    "Temp": "other",
    "Buffer": "other",
    # MemTracker (non-FSDP models such as DDP) uses these names.
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers", "other")
# What CPU offload moves off the GPU (FSDP2 CPUOffloadPolicy: sharded params and grads live on the
# host and the optimizer steps there).
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


def check_private_apis() -> None:
    """Raise RuntimeError naming the private API that is missing or changed in this torch."""
    problems = []
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as e:
        problems.append(f"torch.testing._internal.distributed.fake_pg.FakeStore: {e}")
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    except ImportError as e:
        problems.append(f"torch._subclasses.fake_tensor.FakeTensorMode: {e}")
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

        names = {t.value for t in _FSDPRefType} | {t.value for t in _MemRefType}
        missing = sorted(set(TRACKER_TO_CATEGORY) - names)
        if missing:
            problems.append(f"tracker categories renamed: {missing} not in {sorted(names)}")
        for cls, attrs in ((MemTracker, ("_update_peak_stats", "_curr_mem_snap", "get_tracker_snapshot")),
                           (FSDPMemTracker, ("track_inputs", "reset_mod_stats"))):
            for attr in attrs + ("_peak_mem", "_peak_mem_snap"):
                if not hasattr(cls, attr) and attr not in MemTracker().__dict__:
                    problems.append(f"{cls.__name__}.{attr} is gone")
    except ImportError as e:
        problems.append(f"torch.distributed._tools mem trackers: {e}")
    if problems:
        raise RuntimeError("torch changed a private API fsdplab's memory estimator uses:\n  "
                           + "\n  ".join(problems))


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks in this one process, as rank 0; collectives do nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; run the estimate in a subprocess.")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_tensor_mode():
    """Tensors with shapes and dtypes but no storage. Non-fake inputs are allowed so that meta parameters
    can be `to_empty`-ed into fake CPU tensors inside the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def eager_attention_masks():
    """Make transformers build the same attention masks on fake tensors as on real ones.

    transformers treats fake tensors as tracing: it cannot check whether position_ids describe packed
    sequences, so it materialises a full causal mask and skips SDPA's is_causal and GQA fast paths. A
    real run of one unpacked sequence per row takes those fast paths; patching the packed-sequence
    detector to "none" (true for the estimator's batches) makes the fake run take them too."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _category_totals(snapshot: dict, skip=()) -> dict:
    totals = dict.fromkeys(CATEGORIES, 0)
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total" or name in skip:
            continue
        totals[TRACKER_TO_CATEGORY.get(name, "other")] += value
    return totals


def _raw(snapshot: dict) -> dict:
    return {getattr(k, "value", k): int(v) for k, v in snapshot.items()}


def make_tracker(model, optimizer=None):
    """A memory tracker for `model` that also follows the peak of what stays on the device when sharded
    parameters, gradients and optimizer state are offloaded to the host (`offload_peak`).

    FSDP models get FSDPMemTracker; any other model (DDP, a plain module) the generic MemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType

    base = FSDPMemTracker if isinstance(model, FSDPModule) else MemTracker
    # Snapshot keys are str-Enum members (hashed by name, not value): map the members themselves.
    key_category = {t: TRACKER_TO_CATEGORY.get(t.value, "other") for t in (*_FSDPRefType, *_MemRefType)}
    offloaded_keys = {t for t in _FSDPRefType if t.value in OFFLOADED}

    class Tracker(base):
        def __init__(self):
            if base is FSDPMemTracker:
                super().__init__(model, optimizer)
            else:
                super().__init__()
                self.track_external(*(x for x in (model, optimizer) if x is not None))
            self.offload_peak, self.offload_peak_snap = 0, {}
            self.category_max, self.offload_category_max = {}, {}

        def _update_peak_stats(self, peak_state):
            # The base class also refreshes a per-module peak for every live module on every op, which
            # costs a sixth of an estimate's time; fsdplab reports only the global peaks, kept here.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                cats, kept, off = {}, {}, 0
                for k, v in snap.items():
                    c = key_category.get(k)
                    if c is None or not v:
                        continue
                    cats[c] = cats.get(c, 0) + v
                    if k in offloaded_keys:
                        off += v
                    else:
                        kept[c] = kept.get(c, 0) + v
                for found, maxima in ((cats, self.category_max), (kept, self.offload_category_max)):
                    for c, v in found.items():
                        if v > maxima.get(c, 0):
                            maxima[c] = v
                on_device = snap["Total"] - off
                if on_device > self.offload_peak:
                    self.offload_peak, self.offload_peak_snap = on_device, dict(snap)

        def reset_peak(self):
            """Forget the peak so far: the next one is measured from what is live now."""
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
            self.offload_peak, self.offload_peak_snap = 0, {}
            self.category_max, self.offload_category_max = {}, {}
            self.reset_mod_stats()

        def current(self) -> dict:
            """Raw tracker categories live right now (bytes, summed over devices)."""
            out: dict = {}
            for snap in self.get_tracker_snapshot("current").values():
                for k, v in _raw(snap).items():
                    out[k] = out.get(k, 0) + v
            return out

        def category_peaks(self, offload: bool = False) -> dict:
            """Each of the six categories' own maximum over the tracked region (they need not coincide;
            unlike the split at the peak, these do not depend on which of two near-equal moments wins)."""
            found = self.offload_category_max if offload else self.category_max
            return {c: int(found.get(c, 0)) for c in CATEGORIES}

        def peak(self, offload: bool = False) -> tuple[int, dict, dict]:
            """(peak bytes, six categories at the peak, raw tracker categories at the peak)."""
            if offload:
                snap = self.offload_peak_snap
                return int(self.offload_peak), _category_totals(snap, skip=OFFLOADED), _raw(snap)
            snaps = self.get_tracker_snapshot("peak")
            if not snaps:
                return 0, dict.fromkeys(CATEGORIES, 0), {}
            snap = max(snaps.values(), key=lambda s: s["Total"])
            return int(snap["Total"]), _category_totals(snap), _raw(snap)

    return Tracker()
