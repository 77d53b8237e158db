"""Every private torch API fsdplab relies on, in one place, each behind a thin shim.

- The exact memory estimator runs a real training step of a full-size model in one process with nothing
  behind the tensors: a fake process group of any world size (`FakeStore` + the "fake" backend), fake
  tensors (`FakeTensorMode`) and FSDP2's memory tracker (`FSDPMemTracker`), which sorts every live tensor
  into parameters, gradients, optimizer state, activations and communication buffers. Its shortcuts, none
  of which changes a byte it reports, read FakeTensorMode's dispatch table and the dispatch-mode stack
  (`.device` queries answered in the tracker), a DTensor's local tensor (the optimizer steps local shards)
  and FSDP2's lazy init and units (its state after a first forward, set up without running one).
- The byte counter is a `TorchDispatchMode`, labels FSDP2's collectives with their unit (`FSDPParamGroup`),
  tells forward from backward (the autograd engine's graph task id) and names process groups
  (`_resolve_process_group`); the timeline aligns ranks on the profiler's trace start (kineto results).
- Activation checkpointing uses torch's `checkpoint_wrapper` (torch.distributed.algorithms._checkpoint).
- Lesson 05 reads FSDP1's default state-dict type from its source (`_init_utils._init_state_dict_state`).

None of these are public APIs. `check_private_apis()` (run by tests/test_memory.py) fails loudly, naming
what changed, when a torch upgrade moves one; each shim raises `PrivateAPIError` with the torch version
and what to do, never silently doing less.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, NamedTuple

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


class PrivateAPIError(RuntimeError):
    """A private torch API the lab uses is gone or changed in the installed torch."""


_ADVICE = ("fsdplab is tested with torch 2.13.0 and supports torch >= 2.6: install a version in that range "
           "(pip install torch==2.13.0), or report the change so the shim in fsdplab/_torch_private.py can "
           "follow it.")


def _problem(what: str, error) -> str:
    return f"{what} ({error})"


def _missing(what: str, error) -> PrivateAPIError:
    import torch

    return PrivateAPIError(f"torch {torch.__version__} changed a private API fsdplab uses: "
                           f"{_problem(what, error)}. {_ADVICE}")


def check_private_apis() -> None:
    """Raise PrivateAPIError naming every private API that is missing or changed in this torch."""
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
        for cls, attrs in ((MemTracker, ("_update_peak_stats", "_update_snap", "_curr_mem_snap",
                                         "get_tracker_snapshot")),
                           (FSDPMemTracker, ("track_inputs", "reset_mod_stats"))):
            for attr in attrs + ("_peak_mem", "_peak_mem_snap"):
                if not hasattr(cls, attr) and attr not in MemTracker().__dict__:
                    problems.append(f"{cls.__name__}.{attr} is gone")
    except ImportError as e:
        problems.append(f"torch.distributed._tools mem trackers: {e}")
    for shim in (fsdp_param_group, checkpoint_wrapper_fn, graph_task_id, fsdp1_default_state_dict_type,
                 torch_dispatch_mode, replicate_fn):
        try:
            shim()
        except PrivateAPIError as e:
            problems.append(e.args[0].split(" uses: ", 1)[1].removesuffix(" " + _ADVICE))
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: F401
    except ImportError as e:
        problems.append(f"torch.distributed.distributed_c10d._resolve_process_group: {e}")
    problems += _estimator_private_api_problems()
    if problems:
        import torch

        raise PrivateAPIError(f"torch {torch.__version__} changed private APIs fsdplab uses:\n  "
                              + "\n  ".join(problems) + "\n" + _ADVICE)


def _estimator_private_api_problems() -> list:
    """What the estimator's shortcuts use (fake_device_query, local_shard, _PeakTracker.settle_fsdp)."""
    problems = []
    try:
        fake_device_query()
    except PrivateAPIError as e:
        problems.append(e.args[0].split(" uses: ", 1)[1].removesuffix(" " + _ADVICE))
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
        from torch.distributed.tensor import DTensor

        for cls, attr in ((DTensor, "_local_tensor"), (FSDPModule, "_get_fsdp_state"), (FSDPState, "_lazy_init"),
                          (FSDPState, "_fsdp_param_group"), (FSDPParam, "unsharded_param"),
                          (MemTracker, "_update_and_maybe_create_winfos")):
            if not hasattr(cls, attr):
                problems.append(f"{cls.__name__}.{attr} is gone")
    except ImportError as e:
        problems.append(f"FSDP2 / DTensor internals: {e}")
    return problems


# --- the byte counter: FSDP2 units, forward vs backward, group names -----------------------------------------

def fsdp_param_group():
    """FSDP2's per-unit class, whose `unshard` / `post_backward` / `reshard` launch and end a unit's
    collectives: the byte counter wraps them to label each collective with its unit."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as e:
        raise _missing("torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup", e) from None
    # (each unit's `_module_fqn` is set per instance: `fsdp_unit_name` checks it where it is read)
    gone = [name for name in ("unshard", "post_backward", "reshard", "is_unsharded")
            if not hasattr(FSDPParamGroup, name)]
    if gone:
        raise _missing("FSDPParamGroup", f"no {gone}")
    return FSDPParamGroup


def fsdp_unit_name(group) -> str:
    """The module path of an FSDP2 unit (an FSDPParamGroup instance); "root" for the root module."""
    if not hasattr(group, "_module_fqn"):
        raise _missing("FSDPParamGroup._module_fqn", "not set on the unit")
    return group._module_fqn or "root"


def torch_dispatch_mode():
    """torch's TorchDispatchMode base class: the byte counter is one (as torch's own CommDebugMode is)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as e:
        raise _missing("torch.utils._python_dispatch.TorchDispatchMode", e) from None
    return TorchDispatchMode


def profiler_trace_start_ns(prof) -> int:
    """When a torch.profiler trace started (ns): the timeline aligns every rank's events on it."""
    try:
        return prof.profiler.kineto_results.trace_start_ns()
    except AttributeError as e:
        raise _missing("torch.profiler.profile().profiler.kineto_results.trace_start_ns", e) from None


def graph_task_id() -> int:
    """The autograd engine's current graph task: -1 outside backward (how the counter tells the phases apart)."""
    import torch

    fn = getattr(torch._C, "_current_graph_task_id", None)
    if fn is None:
        raise _missing("torch._C._current_graph_task_id", "not found")
    return fn()


def resolve_process_group(name: str):
    """The ProcessGroup registered under `name` (functional collectives pass groups by name); None if unknown."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError as e:
        raise _missing("torch.distributed.distributed_c10d._resolve_process_group", e) from None
    try:
        return _resolve_process_group(name)
    except Exception:  # not a group name: the caller tries the next argument
        return None


# --- activation checkpointing ------------------------------------------------------------------------------

def checkpoint_wrapper_fn():
    """(apply_activation_checkpointing, a wrapper factory for non-reentrant checkpointing), torch's own."""
    import functools

    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    except ImportError as e:
        raise _missing("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", e) from None
    return apply_activation_checkpointing, functools.partial(checkpoint_wrapper,
                                                             checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def selective_checkpoint_context():
    """torchtitan's per-op selective checkpointing policy, as a `context_fn` for torch.utils.checkpoint: a
    checkpointed block keeps the outputs of its attention kernels, reduce-scatters and maxima, and of every
    other matmul (`aten.mm`; `addmm`, a Linear with a bias, is recomputed as in torchtitan), and recomputes
    the rest in backward. The CPU attention kernels are added to torchtitan's list, so that the estimator's
    fake CPU run keeps what a GPU run keeps. (Public API since torch 2.4, but a policy names private ops.)"""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    save = {ops.mm.default, ops.max.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(ops, name):
            save.add(getattr(ops, name).default)
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == ops.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == ops.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def replicate_fn():
    """torch's `replicate` built on FSDP2 (torch.distributed._composable.replicate_with_fsdp, torch 2.9+):
    DDP's layout (every rank keeps every parameter, gradients all-reduced) on FSDP2's machinery, so it runs
    on fake tensors where DistributedDataParallel's C++ Reducer does not."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as e:
        raise _missing("torch.distributed._composable.replicate_with_fsdp.replicate", e) from None
    return replicate


# --- FSDP1 defaults --------------------------------------------------------------------------------------------

def fsdp1_default_state_dict_type() -> str:
    """The state-dict type FSDP1 uses when nobody sets one, read from the installed torch's source."""
    import inspect

    try:
        from torch.distributed.fsdp import _init_utils

        source = inspect.getsource(_init_utils._init_state_dict_state)
    except (ImportError, AttributeError, OSError) as e:
        raise _missing("torch.distributed.fsdp._init_utils._init_state_dict_state", e) from None
    found = re.search(r"_state_dict_type\s*=\s*StateDictType\.(\w+)", source)
    if not found:
        raise _missing("_init_state_dict_state", "no default StateDictType assignment in its source")
    return found.group(1)


# --- the memory estimator ------------------------------------------------------------------------------------

class _DeviceQuery(NamedTuple):
    op: object                  # torch.ops.prim.device.default
    fake_tensor: type           # FakeTensor
    answer: Callable            # FakeTensorMode's own answer: answer(args) -> torch.device
    fake_mode_is_next: Callable  # () -> True if the next mode down the dispatch stack is a FakeTensorMode
    active_fake_mode: Callable  # torch._guards.active_fake_mode, as the trackers use it


def fake_device_query() -> _DeviceQuery:
    """What the memory tracker needs to answer `.device` queries on fake tensors itself, as FakeTensorMode
    would (see `_PeakTracker.__torch_dispatch__`)."""
    import torch

    try:
        from torch._guards import active_fake_mode
        from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor, FakeTensorMode

        depth, mode_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
    except (ImportError, AttributeError) as e:
        raise _missing("FakeTensorMode's _DISPATCH_META_HANDLERS, torch._guards.active_fake_mode or "
                       "torch._C's dispatch-mode stack", e) from None
    op = torch.ops.prim.device.default
    if op not in _DISPATCH_META_HANDLERS:
        raise _missing("torch._subclasses.fake_tensor._DISPATCH_META_HANDLERS", "no prim.device entry")

    def fake_mode_is_next() -> bool:
        n = depth()
        return n > 0 and isinstance(mode_at(n - 1), FakeTensorMode)

    return _DeviceQuery(op, FakeTensor, _DISPATCH_META_HANDLERS[op], fake_mode_is_next, active_fake_mode)


def local_shard(dtensor):
    """The local tensor a DTensor wraps, the object itself. (`to_local()` on a Parameter(DTensor) returns a
    new view at every call: an optimizer stepping the shards keys its state by the shard, which must not
    change from step to step.)"""
    try:
        return dtensor._local_tensor
    except AttributeError as e:
        raise _missing("DTensor._local_tensor", e) from None


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




def _all_fake(args, fake_type) -> bool:
    """Every tensor in `args` (tensors and lists of them) is a FakeTensor without a value: FakeTensorMode
    keeps the value of small tensors made from Python numbers (an optimizer's step counts), in `constant`."""
    import torch

    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor) and (type(t) is not fake_type or t.constant is not None):
                return False
    return True


class _PeakTracker:
    """Mixed in before torch's MemTracker / FSDPMemTracker: keeps the global peak, each category's own
    maximum, and the peak of what stays on the device when sharded parameters, gradients and optimizer
    state are offloaded to the host."""

    # `_snap_changes` counts the changes to the live bytes (an allocation, a free, a resize, a relabel), and
    # `_snap_seen` is its value at the last look for peaks: the peaks are a function of the live bytes, so
    # an op that changed none (a view, a scalar read) cannot move them and `_update_peak_stats` skips it.
    _snap_changes, _snap_seen = 0, -1

    def _init_peaks(self, key_category: dict, offloaded_keys: set):
        self._key_category, self._offloaded_keys = key_category, offloaded_keys
        self.offload_peak, self.offload_peak_snap = 0, {}
        self.category_max, self.offload_category_max = {}, {}
        self._device_query = fake_device_query()
        # Where the step is at each change of the live bytes: (phase, module, op), and the bytes per category
        # then (the memory-over-step figure); the moment of the peak (and of the peak left on the device).
        self._op, self.timeline, self.peak_at, self.offload_peak_at = None, [], {}, {}

    # Label each allocation of the log with its phase and module (a memory snapshot's frames): off by default,
    # it costs a tenth of an estimate.
    label_allocations = False

    def _phase(self) -> str:
        if getattr(self, "_in_opt", False):
            return "optimizer step"
        if getattr(self._mod_tracker, "is_bw", False):
            return "backward"
        return "forward" if len(getattr(self._mod_tracker, "parents", ())) > 1 else "between (zero_grad, hooks)"

    def _moment(self) -> dict:
        parents = [p for p in getattr(self._mod_tracker, "parents", ()) if p != "Global"]
        module = max(parents, key=lambda p: (p.count("."), len(p))) if parents else ""
        return {"phase": self._phase(), "module": module.partition(".")[2] or module, "op": str(self._op or "")}

    # The allocation and free sequence from the last reset_peak (fsdplab.allocator replays it): None until then.
    alloc_log, alloc_preloaded, _serials = None, 0, None

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
        self._snap_changes += 1
        log = self.alloc_log
        if log is None:
            return
        kind = u_type.name                      # ADD, DEL, SIZE (a resize_), REF (a new label: no allocation)
        if kind == "ADD" and winfo.mem_consumed:
            log.append(self._malloc_event(winfo))
        elif kind == "DEL" and winfo.mem_consumed:
            log.append(("-", self._serial(winfo)))
        elif kind == "SIZE":
            if old_mem_consumed:
                log.append(("-", self._serial(winfo)))
            if winfo.mem_consumed:
                log.append(self._malloc_event(winfo))

    def _serial(self, winfo) -> int:
        serial = getattr(winfo, "fsdplab_serial", None)
        if serial is None:
            serial = winfo.fsdplab_serial = next(self._serials)
        return serial

    def _malloc_event(self, winfo, where: bool = True) -> tuple:
        from .allocator import STREAM_OF

        kind = getattr(winfo.reftype, "value", "")
        label = kind
        if where and self.label_allocations:
            moment = self._moment()
            label = f"{kind}, {moment['phase']}" + (f", {moment['module']}" if moment["module"] else "")
        return ("+", self._serial(winfo), winfo.mem_consumed, STREAM_OF.get(kind, 0), label)

    def start_alloc_log(self) -> None:
        """Log allocations and frees from now on, beginning with what is alive now (in the tracker's order)."""
        import itertools

        self._serials = self._serials or itertools.count()
        alive = [w for w, _ in self._WINFO.values() if w.mem_consumed]
        self.alloc_log = [self._malloc_event(w, where=False) for w in alive]
        self.alloc_preloaded = len(self.alloc_log)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Three in five ops of a step on fake tensors are `.device` queries, which neither allocate nor free.
        # The base class passes each on to FakeTensorMode, tracks no output and looks for new peaks. Where
        # FakeTensorMode is next, answer as it does (its first check) and look for peaks only where the
        # base class would find something new: bytes moved since the last op, outside DTensor's sharding
        # propagation.
        query = self._device_query
        if func is query.op and type(args[0]) is query.fake_tensor and query.fake_mode_is_next():
            if self._snap_seen != self._snap_changes and query.active_fake_mode() is self._fake_mode_on_entry:
                self._update_peak_stats(None)
            return query.answer(args)
        self._op = func
        # An optimizer step is a dozen in-place foreach ops over every trained tensor (and FSDP2 copies its
        # shards in with one per unit). On fake tensors they change no shape, allocate nothing and return
        # nothing, yet FakeTensorMode runs each through its Python reference kernel, tensor by tensor: a
        # tenth of a LoRA estimate. Where FakeTensorMode is next and every tensor is fake, skip the kernel.
        if self.skip_inplace_foreach and self._inplace_foreach(func) and query.fake_mode_is_next() \
                and _all_fake(args, query.fake_tensor):
            if self._snap_seen != self._snap_changes and query.active_fake_mode() is self._fake_mode_on_entry:
                self._update_peak_stats(None)
            self.skipped_kernels += 1
            return None
        return super().__torch_dispatch__(func, types, args, kwargs)

    skip_inplace_foreach, skipped_kernels = True, 0
    _inplace_foreach_ops: dict = {}

    def _inplace_foreach(self, func) -> bool:
        known = self._inplace_foreach_ops.get(func)
        if known is None:
            schema = getattr(func, "_schema", None)
            name = getattr(schema, "name", "")
            known = self._inplace_foreach_ops[func] = (
                name.startswith("aten::_foreach_") and name.endswith("_") and not schema.returns
                and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))
        return known

    def _update_peak_stats(self, peak_state):
        # The base class also refreshes a per-module peak for every live module on every op, which costs a
        # sixth of an estimate's time; fsdplab reports only the global peaks, kept here.
        if self._snap_seen == self._snap_changes:
            return
        self._snap_seen = self._snap_changes
        moment = None
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)
                self.peak_at = moment = self._moment()
            cats, kept, off = {}, {}, 0
            for k, v in snap.items():
                c = self._key_category.get(k)
                if c is None or not v:
                    continue
                cats[c] = cats.get(c, 0) + v
                if k in self._offloaded_keys:
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
                self.offload_peak_at = moment = moment or self._moment()
            self.timeline.append((moment["phase"] if moment else self._phase(), cats, kept))

    def settle_fsdp(self, model) -> bool:
        """Leave the FSDP2 `model` as its first forward leaves it for every later step, without running it:
        FSDP2's lazy init (the root, the communication state, unevenly sharded parameters re-padded into new
        tensors) and each unit's unsharded-parameter buffers, allocated by a first all-gather, labelled
        "Unsharded Param" as the tracker's pre-forward hook labels them, and freed by a reshard (later steps
        re-allocate the same storages in place). False, doing nothing, for a model that is not FSDP2."""
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
        from torch.distributed.fsdp import FSDPModule

        if not (isinstance(model, FSDPModule) and isinstance(self, FSDPMemTracker)):
            return False
        try:

            model._get_fsdp_state()._lazy_init()
            for module in model.modules():
                if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group):
                    module.unshard()
                    for fsdp_param in group.fsdp_params:
                        self._update_and_maybe_create_winfos(fsdp_param.unsharded_param,
                                                             _FSDPRefType.UNSHARDED_PARAM)
                    module.reshard()
        except AttributeError as e:
            raise _missing("FSDP2 internals (FSDPModule._get_fsdp_state, FSDPState._lazy_init / "
                           "_fsdp_param_group, FSDPParamGroup.fsdp_params, FSDPParam.unsharded_param) or "
                           "MemTracker._update_and_maybe_create_winfos", e) from None
        return True

    def reset_peak(self):
        """Forget the peak so far: the next one is measured from what is live now."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        self.offload_peak, self.offload_peak_snap = 0, {}
        self.category_max, self.offload_category_max = {}, {}
        self.timeline, self.peak_at, self.offload_peak_at = [], {}, {}
        self._snap_seen = -1
        self.reset_mod_stats()
        self.start_alloc_log()

    def memory_over_step(self, offload: bool = False, points: int = 600) -> dict:
        """The tracked region's bytes per category at each change (at most `points`, evenly picked, the peak
        always among them), with the phase of each: {"phase": [...], "<category>": [...]}."""
        rows = self.timeline
        if not rows:
            return {}
        totals = [sum((kept if offload else cats).values()) for _, cats, kept in rows]
        top = max(range(len(rows)), key=totals.__getitem__)
        # Every phase keeps its first and last event: a short optimizer step (few, large allocations) shows too.
        edges = {i for i in range(len(rows)) if i in (0, len(rows) - 1) or rows[i][0] != rows[i - 1][0]
                 or rows[i][0] != rows[i + 1][0]}
        keep = sorted(set(range(0, len(rows), max(1, len(rows) // points))) | {top} | edges)
        out = {"phase": [rows[i][0] for i in keep]}
        for c in CATEGORIES:
            out[c] = [int((rows[i][2] if offload else rows[i][1]).get(c, 0)) for i in keep]
        return out

    def current(self) -> dict:
        """Raw tracker categories live right now (bytes, summed over devices)."""
        out: dict = {}
        for snap in self.get_tracker_snapshot("current").values():
            for k, v in _raw(snap).items():
                out[k] = out.get(k, 0) + v
        return out

    def category_peaks(self, offload: bool = False) -> dict:
        """Each of the six categories' own maximum over the tracked region (they need not coincide; unlike
        the split at the peak, these do not depend on which of two near-equal moments wins)."""
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


def make_tracker(model, optimizer=None):
    """A memory tracker for `model` with the peaks of `_PeakTracker`. FSDP models get FSDPMemTracker; any
    other model (DDP, a plain module) the generic MemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.fsdp import FSDPModule

    base = FSDPMemTracker if isinstance(model, FSDPModule) else MemTracker
    tracker = type(f"Peak{base.__name__}", (_PeakTracker, base), {})(
        *((model, optimizer) if base is FSDPMemTracker else ()))
    if base is MemTracker:
        tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    # Snapshot keys are str-Enum members (hashed by name, not value): map the members themselves.
    tracker._init_peaks({t: TRACKER_TO_CATEGORY.get(t.value, "other") for t in (*_FSDPRefType, *_MemRefType)},
                        {t for t in _FSDPRefType if t.value in OFFLOADED})
    return tracker
