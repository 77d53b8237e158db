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
- Lesson 05 reads FSDP1's default state-dict type from its source (`_init_utils._init_state_dict_state`);
  lesson 14 prints DDP's cap on its first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`).

None of these are public APIs. `check_private_apis()` (tests/unit/test_layout.py, tests/unit/test_torch_private.py;
CI runs them under torch 2.13 and 2.11) fails loudly, naming what changed, when a torch upgrade moves one;
each shim raises `PrivateAPIError` with the torch version and what to do, never silently doing less.
Where torch 2.10, 2.11 and 2.13 differ, the shims follow each (feature detection, checked against the version).
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

# The stream a traced tensor's tracker category was allocated on, under FSDP2 on a GPU: the all-gather output
# on the all-gather stream, the reduce-scatter buffers on the reduce-scatter stream, all else on the default one
# (the allocation log the tracker writes carries it; fsdplab.memory.allocator replays that log).
STREAM_OF = {"All Gather": 1, "Reduce Scatter": 2}

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers", "other")
# What CPU offload moves off the GPU (FSDP2 CPUOffloadPolicy: sharded params and grads live on the
# host and the optimizer steps there).
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


class PrivateAPIError(RuntimeError):
    """A private torch API the lab uses is gone or changed in the installed torch."""


# The torch releases fsdplab is tested on (each shim below follows what changed between them), and the oldest it
# supports: pyproject's floor. Older releases lack what the lab's lessons use (see `torch_too_old`).
TESTED_TORCH = ("2.10", "2.11", "2.13")
OLDEST_TORCH = (2, 10)
_ADVICE = ("fsdplab is tested with torch 2.10, 2.11 and 2.13 and supports torch >= 2.10 (older releases are "
           "not supported): install one of those (pip install torch==2.13.0), or report the change so the shim "
           "in fsdplab/_torch_private/ can follow it.")


def torch_version() -> tuple:
    """(major, minor) of the installed torch: '2.11.0+cu130' -> (2, 11)."""
    import torch

    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def advice() -> str:
    """What to do about a changed private API: on a torch below the floor, upgrade; else the tested range."""
    import torch

    if torch_version() >= OLDEST_TORCH:
        return _ADVICE
    return (f"torch {torch.__version__} is older than 2.10, the oldest release fsdplab supports (tested with 2.10, "
            "2.11 and 2.13; older ones are not): pip install 'torch>=2.10'.")


def _problem(what: str, error) -> str:
    return f"{what} ({error})"


def _missing(what: str, error) -> PrivateAPIError:
    import torch

    return PrivateAPIError(f"torch {torch.__version__} changed a private API fsdplab uses: "
                           f"{_problem(what, error)}. {advice()}")


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
                 torch_dispatch_mode, replicate_fn, ddp_first_bucket_bytes, fsdp1_flat_param_module):
        try:
            shim()
        except PrivateAPIError as e:
            problems.append(e.args[0].split(" uses: ", 1)[1].removesuffix(" " + advice()))
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: F401
    except ImportError as e:
        problems.append(f"torch.distributed.distributed_c10d._resolve_process_group: {e}")
    problems += _estimator_private_api_problems()
    problems += _tracker_entry_problems()
    if problems:
        import torch

        raise PrivateAPIError(f"torch {torch.__version__} changed private APIs fsdplab uses:\n  "
                              + "\n  ".join(problems) + "\n" + advice())


def _estimator_private_api_problems() -> list:
    """What the estimator's shortcuts use (fake_device_query, local_shard, tracker._PeakTracker.settle_fsdp)."""
    problems = []
    try:
        fake_device_query()
    except PrivateAPIError as e:
        problems.append(e.args[0].split(" uses: ", 1)[1].removesuffix(" " + advice()))
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
        from torch.distributed.tensor import DTensor

        for cls, attr in ((DTensor, "_local_tensor"), (FSDPModule, "_get_fsdp_state"), (FSDPState, "_lazy_init"),
                          (FSDPParam, "unsharded_param"),
                          (MemTracker, "_update_and_maybe_create_winfos")):
            if not hasattr(cls, attr):
                problems.append(f"{cls.__name__}.{attr} is gone")
        if not {"_fsdp_param_groups", "_fsdp_param_group"} & set(vars(FSDPState())):
            problems.append("FSDPState has neither _fsdp_param_groups (torch 2.13) nor _fsdp_param_group (2.10-2.11)")
    except ImportError as e:
        problems.append(f"FSDP2 / DTensor internals: {e}")
    return problems


def fsdp_param_groups(module) -> list:
    """The FSDP2 units (FSDPParamGroup) of one `fully_shard`-ed module: a list in torch 2.13
    (`_fsdp_param_groups`, a module may hold several), one or None before (`_fsdp_param_group`)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if "_fsdp_param_group" not in vars(state):
        raise _missing("FSDPState._fsdp_param_groups / _fsdp_param_group", "neither is set")
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _tracker_entry_problems() -> list:
    """Enter torch's MemTracker once, as fsdplab's tracker does, and check what it reads there."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        with MemTracker() as tracker:
            tracker_skips_other_fake_modes(tracker)
            for attr in ("_depth", "_mod_tracker"):
                if not hasattr(tracker, attr):
                    return [f"MemTracker.{attr} is gone"]
            for attr in ("_user_pre_fw_hook", "_user_pre_bw_hook", "parents", "is_bw", "get_known_fqn"):
                if not hasattr(tracker._mod_tracker, attr):
                    return [f"ModTracker.{attr} is gone"]
    except PrivateAPIError as e:
        return [e.args[0].split(" uses: ", 1)[1].removesuffix(" " + advice())]
    except ImportError as e:
        return [f"torch.distributed._tools.mem_tracker.MemTracker: {e}"]
    return []


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


def ddp_first_bucket_bytes() -> int:
    """DistributedDataParallel's cap on its first gradient bucket, whatever `bucket_cap_mb` says (lesson 14
    prints it: it decides how many all-reduces torch's DDP launches at its first step)."""
    import torch.distributed as dist

    value = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    if not isinstance(value, int):
        raise _missing("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", "gone or not an int")
    return value


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

def checkpoint_wrapper_fn(reentrant: bool = False):
    """(apply_activation_checkpointing, a wrapper factory for non-reentrant checkpointing, or with `reentrant`
    the older reentrant one), torch's own."""
    import functools

    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    except ImportError as e:
        raise _missing("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", e) from None
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    return apply_activation_checkpointing, functools.partial(checkpoint_wrapper, checkpoint_impl=impl)


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
    if torch_version() >= (2, 11):
        return replicate
    import functools

    from torch.distributed.device_mesh import DeviceMesh

    named: dict = {}

    # torch 2.10's replicate refuses a mesh without dimension names ("Please init the 2D mesh for HSDP with
    # mesh_dim_names specified", even for 1-D); its own default mesh is named ("replicate",). The same ranks'
    # group, named so (from_group makes no new process group).
    @functools.wraps(replicate)
    def replicate_on_named_mesh(module, *args, mesh=None, **kwargs):
        if mesh is not None and mesh.ndim == 1 and mesh.mesh_dim_names is None:
            key = id(mesh)
            if key not in named or named[key][0] is not mesh:
                named[key] = (mesh, DeviceMesh.from_group(mesh.get_group(), mesh.device_type,
                                                         mesh_dim_names=("replicate",)))
            mesh = named[key][1]
        return replicate(module, *args, mesh=mesh, **kwargs)

    return replicate_on_named_mesh


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

def tracker_skips_other_fake_modes(tracker) -> bool:
    """Whether torch's MemTracker / FSDPMemTracker, once entered (`tracker`), leaves untracked the ops run under
    a fake mode other than the one active on its entry: DTensor's sharding propagation, whose fake tensors are
    no memory of the step. torch 2.13 does (it keeps that mode in `_fake_mode_on_entry`); 2.10 and 2.11 track
    every op, and fsdplab's tracker then skips those ops itself (tracker._PeakTracker._untracked)."""
    skips = "_fake_mode_on_entry" in vars(tracker)
    if not skips and torch_version() >= (2, 13):
        raise _missing("MemTracker._fake_mode_on_entry", "not set on entering the tracker, as torch 2.13 does")
    return skips


class _DeviceQuery(NamedTuple):
    op: object                  # torch.ops.prim.device.default
    fake_tensor: type           # FakeTensor
    answer: Callable            # FakeTensorMode's own answer: answer(args) -> torch.device
    fake_mode_is_next: Callable  # () -> True if the next mode down the dispatch stack is a FakeTensorMode
    active_fake_mode: Callable  # torch._guards.active_fake_mode, as the trackers use it


def fake_device_query() -> _DeviceQuery:
    """What the memory tracker needs to answer `.device` queries on fake tensors itself, as FakeTensorMode
    would (see `tracker._PeakTracker.__torch_dispatch__`)."""
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
def fsdp1_on_fake_tensors():
    """Let FSDP1 run on fake tensors: it asserts that an unsharded flat parameter is allocated by its storage's
    data pointer, which a fake tensor's storage never has (0); its size tells the same on both."""
    module = fsdp1_flat_param_module()
    real = module._data_ptr_allocated
    module._data_ptr_allocated = lambda tensor: tensor.untyped_storage().nbytes() > 0
    try:
        yield
    finally:
        module._data_ptr_allocated = real


def fsdp1_flat_param_module():
    """torch.distributed.fsdp._flat_param, with the check FSDP1's flat parameters make of their storage."""
    try:
        import torch.distributed.fsdp._flat_param as module
    except ImportError as e:
        raise _missing("torch.distributed.fsdp._flat_param", e) from None
    if not callable(getattr(module, "_data_ptr_allocated", None)):
        raise _missing("torch.distributed.fsdp._flat_param._data_ptr_allocated", "gone")
    return module


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
