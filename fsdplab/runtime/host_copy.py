"""What a rank sends back to the kernel holds its tensors on the CPU.

A rank computes on its GPU under nccl; a tensor returned from `cluster.run` or read with `cluster.pull` would
be unpickled in the kernel on that same GPU. The kernel would then open a CUDA context on every rank's GPU
(memory the ranks counted on, and impossible where GPUs run in EXCLUSIVE_PROCESS mode), and comparing it with
a CPU tensor (`torch.equal(cpu, cuda)`) raises. So the rank copies them to the CPU before they are sent.

`to_host` walks lists, tuples (named ones too), dicts and dataclass instances, and leaves everything else as
it is: CPU and meta tensors, modules, other objects. A DTensor becomes its local part (the whole value for a
replicated one, this rank's shard for a sharded one, as `.to_local()` gives): making the full tensor is a
collective that ranks not sending one would never enter. A value with nothing to copy comes back as the same
object, so a CPU rank pays only for the walk.
"""

from __future__ import annotations

import dataclasses
import sys

# Tensors on these devices stay as they are: they already live in host memory (cpu), or have no data to copy
# (meta, which the estimator's lessons return as shapes).
_HOST_DEVICES = ("cpu", "meta")


def to_host(value):
    """`value` with every tensor in it on the CPU (see the module's docstring); the same object when none moved."""
    if "torch" not in sys.modules:   # nothing imported torch: there is no tensor to move
        return value
    return _walk(value, {})


def tensor_to_host(tensor):
    """One tensor on the CPU: a DTensor's local part, a GPU tensor copied; a CPU or meta tensor as it is."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor = tensor.to_local()
    if tensor.device.type in _HOST_DEVICES:
        return tensor
    return tensor.cpu()


def _dtensor_type():
    if "torch.distributed.tensor" not in sys.modules:   # no DTensor was ever made in this process
        return None
    return getattr(sys.modules["torch.distributed.tensor"], "DTensor", None)


def _walk(value, seen: dict):
    import torch

    if isinstance(value, torch.Tensor):
        return tensor_to_host(value)
    if not isinstance(value, (list, tuple, dict)) and not _is_dataclass_instance(value):
        return value
    key = id(value)
    if key in seen:   # shared, or a container that holds itself: walked once
        return seen[key]
    seen[key] = value
    seen[key] = result = _walk_container(value, seen)
    return result


def _walk_container(value, seen: dict):
    if isinstance(value, dict):
        items = {k: _walk(v, seen) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        if type(value) is dict:
            return items
        copy = _shallow_copy(value)
        copy.update(items)
        return copy
    if isinstance(value, (list, tuple)):
        items = [_walk(v, seen) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        if type(value) in (list, tuple):
            return type(value)(items)
        if isinstance(value, tuple) and hasattr(value, "_fields"):   # a namedtuple
            return type(value)(*items)
        try:
            return type(value)(items)
        except TypeError:   # a subclass that is not built from its items: sent as it is
            return value
    fields = [f for f in dataclasses.fields(value) if f.init]
    changed = {f.name: _walk(getattr(value, f.name), seen) for f in fields if hasattr(value, f.name)}
    if all(new is getattr(value, name) for name, new in changed.items()):
        return value
    try:
        return dataclasses.replace(value, **changed)
    except (TypeError, ValueError):   # a __post_init__ that refuses its own fields again: sent as it is
        return value


def _is_dataclass_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _shallow_copy(value):
    import copy

    return copy.copy(value)
