"""Run a rank's code as if it were rank 0 of an nccl group on GPUs, on a CPU-only torch build.

`fake_cuda(world_size)` is a context manager that sets up, in this one process:

- a process group of `world_size` ranks whose only backend handles CUDA tensors (torch's FakeProcessGroup
  registered for the "cuda" device only), so a collective on a CPU tensor raises as under nccl ("No backend
  type associated with device type cpu");
- fake tensors (`FakeTensorMode`): tensors made for "cuda" have device cuda:0 but no storage, and an op that
  mixes them with CPU tensors raises `FakeTensorDeviceMismatchError`, as a real GPU run raises
  "Expected all tensors to be on the same device";
- the few `torch.cuda` functions FSDP2, DeviceMesh and the lab call on a GPU rank (current_device, set_device,
  device_count, Stream, Event, current_stream, stream, synchronize, memory statistics), stubbed;
- the rank state `fsdplab.device()` / `fsdplab.mesh()` / `fsdplab.backend()` read: cuda:0, a cuda mesh on the
  fake group, "nccl".

What it cannot catch: anything about values (fake tensors hold none: `.item()` answers 1, `torch.equal`
answers True once the devices agree, so every check of a number passes), backward and the optimizer's step
(the autograd engine wants a real CUDA accelerator: backward is a no-op, gradients stay None), CUDA kernels
and their numerics, NCCL's asynchrony (a collective here returns at once and never hangs), what ranks other
than 0 do, and memory (the estimator measures that). It only finds code that puts two devices into one op, or
a CPU tensor into a collective of the cuda-only group.

Private torch APIs used (kept here, next to the estimator's): torch.testing._internal's FakeStore and
FakeProcessGroup, FakeTensorMode, ProcessGroup._device_types / unbox, _resolve_process_group, and c10's
FakeGuardImpl (a C++ header), registered as the CUDA device guard by `load_cuda_guard`.
"""

from __future__ import annotations

import contextlib
import types

BACKEND = "fake_cuda"


_GUARD_SOURCE = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


class NoCompiler(RuntimeError):
    """No C++ compiler to build the fake CUDA device guard with."""


def load_cuda_guard() -> None:
    """Register c10's FakeGuardImpl as the CUDA device guard of this process (for good: c10 has no way to
    take it back, so use fake_cuda in a process of its own).

    A CPU build has no CUDA guard, and every Python binding that guards the device (Tensor.copy_, indexing,
    contiguous, autograd's record of an op) then fails with "PyTorch is not linked with support for cuda
    devices", or aborts the process. The guard is 3 lines of C++ built once per torch version with the
    system's compiler (about 2 s) and kept in the user's cache."""
    import ctypes
    import hashlib
    import os
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import torch

    if torch.cuda.is_available() or _GUARD_LOADED:
        return
    root = Path(torch.__file__).parent
    key = hashlib.sha256((_GUARD_SOURCE + torch.__version__ + str(root)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fsdplab"
    library = cache / f"fake_cuda_guard-{key}.so"
    if not library.exists():
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise NoCompiler("fake_cuda needs a C++ compiler (c++ or g++, or $CXX) to build its CUDA device "
                             "guard; install one (apt-get install g++).")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "guard.cpp"
            source.write_text(_GUARD_SOURCE)
            built = Path(tmp) / library.name
            subprocess.run([compiler, "-shared", "-fPIC", "-std=c++17", f"-I{root / 'include'}", str(source),
                            f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}", "-o", str(built)],
                           check=True, capture_output=True)
            os.replace(built, library)  # atomic: a parallel build never loads half a file
    ctypes.CDLL(str(library))
    globals()["_GUARD_LOADED"] = True


_GUARD_LOADED = False


def _group_devices() -> list:
    """The devices the lab's nccl group has backends for: the runtime's `group_backend("nccl")` when it has one
    ("cpu:gloo,cuda:nccl": both), else torch's own capability of "nccl" (cuda only)."""
    import torch.distributed as dist

    from ..runtime import on_rank

    choose = getattr(on_rank, "group_backend", None)
    name = choose("nccl") if choose is not None else "nccl"
    if ":" in name:
        return [part.split(":")[0] for part in name.split(",")]
    return list(dist.Backend.backend_capability[name])


def _register_backend(devices: list) -> str:
    import torch.distributed as dist

    name = BACKEND + "_" + "_".join(sorted(devices))
    if name in dist.Backend.backend_list:
        return name
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common_opts, backend_opts):
        return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)

    # devices=["cuda"]: the group gets no CPU backend, as init_process_group("nccl") makes none.
    dist.Backend.register_backend(name, create, extended_api=True, devices=devices)
    return name


class _Stream:
    """A stand-in for torch.cuda.Stream: FSDP2 makes several and orders them with events."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device, self.priority = device, priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return (event or _Event()).record(self)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


_DEFAULT_STREAM = _Stream()


def _cuda_stubs(world_size: int) -> dict:
    current = {"device": 0}

    def set_device(device) -> None:
        import torch

        current["device"] = torch.device("cuda", device).index if isinstance(device, int) else \
            (torch.device(device).index or 0)

    def zero(*args, **kwargs) -> int:
        return 0

    def nothing(*args, **kwargs) -> None:
        return None

    return {
        "current_device": lambda: current["device"], "set_device": set_device,
        "device_count": lambda: world_size, "is_initialized": lambda: True, "init": nothing,
        "_lazy_init": nothing, "Stream": _Stream, "Event": _Event,
        "current_stream": lambda device=None: _DEFAULT_STREAM, "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: stream if stream is not None else contextlib.nullcontext(),
        "synchronize": nothing, "empty_cache": nothing, "reset_peak_memory_stats": nothing,
        "memory_allocated": zero, "memory_reserved": zero, "max_memory_allocated": zero,
        "max_memory_reserved": zero, "memory_stats": lambda *a, **k: {},
        "mem_get_info": lambda *a, **k: (80 << 30, 80 << 30),
        "get_device_name": lambda *a, **k: "fake cuda (CPU build)",
        "get_device_capability": lambda *a, **k: (9, 0), "is_bf16_supported": lambda *a, **k: True,
    }


@contextlib.contextmanager
def _patched(module, values: dict):
    missing = object()
    saved = {name: getattr(module, name, missing) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


def _module_apply():
    """nn.Module._apply for modules holding fake tensors: torch swaps a fake parameter for the converted one
    (`swap_tensors`), which FakeTensorMode's memo of weak references refuses ("Cannot swap t1 because it has
    weakref associated with it"), so `build_tiny().to(device)` fails inside the mode. Here a module's own fake
    parameters and buffers are replaced by new ones instead, as torch does for a meta module's `to_empty`."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor

    plain = nn.Module._apply

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        if not any(isinstance(t, FakeTensor) for t in (*self._parameters.values(), *self._buffers.values())):
            return plain(self, fn, recurse=False)
        for key, param in self._parameters.items():
            if param is not None:
                with torch.no_grad():
                    moved = fn(param)
                self._parameters[key] = nn.Parameter(moved, requires_grad=param.requires_grad)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    return _apply


def _fake_data_property():
    """`tensor.data = moved` on a fake tensor that also moves its device (torch keeps the old `fake_device`):
    FSDP2's fully_shard moves a module's CPU parameters to the mesh's device this way."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    plain = torch._C.TensorBase.data

    def set_data(self, value):
        plain.__set__(self, value)
        if isinstance(value, FakeTensor):
            self.fake_device = value.fake_device

    return property(plain.__get__, set_data)


def _collective_guard():
    """A dispatch mode over FakeTensorMode that refuses a tensor in a collective of a group without a backend
    for its device: FakeTensorMode answers c10d ops itself, before the group's backends are looked up."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from . import resolve_process_group

    process_group_type = torch._C._distributed_c10d.ProcessGroup

    def group_of(args):
        for arg in args:
            if isinstance(arg, process_group_type):
                return arg
            if isinstance(arg, torch.ScriptObject):  # how c10d ops carry their group
                try:
                    return process_group_type.unbox(arg)
                except Exception:  # another script object (a ReduceOp): look further
                    continue
            if isinstance(arg, str):
                group = resolve_process_group(arg)
                if group is not None:
                    return group
        return None

    class CollectiveGuard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                flat, _ = tree_flatten((args, kwargs))
                group = group_of(flat)
                if group is not None:
                    allowed = {d.type for d in group._device_types}
                    for t in flat:
                        if isinstance(t, torch.Tensor) and t.device.type not in allowed:
                            raise RuntimeError(
                                f"No backend type associated with device type {t.device.type} ({func}: a "
                                f"{t.device.type} tensor in a collective of a group with backends for "
                                f"{sorted(allowed)} only, as under nccl; move it to fsdplab.device())")
            return func(*args, **kwargs)

    return CollectiveGuard()


def _values_guard():
    """Answers what fake tensors cannot (a Python number, torch.equal) so that the code runs on past it:
    1 / True for `.item()`, True for torch.equal after FakeTensorMode's device check. No value is checked."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class Values(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default:
                t = args[0]
                return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            if func is aten.equal.default:
                a, b = args
                if a.device != b.device:  # what a real torch.equal raises across devices
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                                       f"two devices, {a.device} and {b.device}! (torch.equal)")
                return a.shape == b.shape
            if func in (aten.allclose.default, aten.is_nonzero.default):
                if func is aten.allclose.default and args[0].device != args[1].device:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least "
                                       f"two devices, {args[0].device} and {args[1].device}! (allclose)")
                return True
            return func(*args, **kwargs)

    return Values()


def _no_backward(*args, **kwargs) -> None:
    """Backward is skipped (see the module's doc): gradients stay None and the optimizer steps nothing."""


@contextlib.contextmanager
def fake_cuda(world_size: int = 2, *, rank: int = 0):
    """Be rank `rank` of `world_size` nccl ranks with one GPU each, on fake tensors (see the module's doc).

    Yields a namespace with `mesh` (the 1-D cuda DeviceMesh), `device` (cuda:0) and `mode` (the
    FakeTensorMode). Tensors made inside are fake: build models on meta and `to_empty(device="cuda")`, or make
    them inside. Refuses to start when a process group already exists in this process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..runtime.on_rank import STATE
    from . import fake_tensor_mode

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; run fake_cuda in a fresh process.")
    load_cuda_guard()
    backend = _register_backend(_group_devices())
    saved_state = dict(STATE)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(torch.cuda, _cuda_stubs(world_size)))
        stack.enter_context(_patched(torch.nn.Module, {"_apply": _module_apply()}))
        from torch._subclasses.fake_tensor import FakeTensor

        stack.enter_context(_patched(FakeTensor, {"data": _fake_data_property()}))
        torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=FakeStore())
        stack.callback(dist.destroy_process_group)
        mesh = init_device_mesh("cuda", (world_size,))
        STATE.clear()
        STATE.update(rank=rank, world_size=world_size, backend="nccl", device=f"cuda:{rank}", mesh=mesh,
                     local_rank=rank, local_world_size=world_size, node_rank=0, nodes=1, node_mesh=None,
                     stack_out=None, main_thread=None)

        def restore_state():
            STATE.clear()
            STATE.update(saved_state)

        stack.callback(restore_state)
        # The backward engine wants a CUDA accelerator for its streams, which no stub can give it.
        stack.enter_context(_patched(torch.Tensor, {"backward": _no_backward}))
        stack.enter_context(_patched(torch.autograd, {"backward": _no_backward}))
        mode = stack.enter_context(fake_tensor_mode())
        stack.enter_context(_collective_guard())
        stack.enter_context(_values_guard())
        yield types.SimpleNamespace(mesh=mesh, device=torch.device("cuda", rank), mode=mode)
