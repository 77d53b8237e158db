"""Count every collective a rank launches: the bytes, the process group, the FSDP unit, the phase.

Counting: `CommCounter` is a `TorchDispatchMode`. Every collective in torch, whether FSDP2's all-gather and
reduce-scatter, DDP's C++ reducer all-reduce, a plain `dist.all_reduce`, DTensor's functional
collectives for tensor parallelism, or a pipeline's sends and receives, goes through the dispatcher as a
`c10d::*` or `_c10d_functional::*` op with its tensors and its process group, so one mode sees them all, in
launch order, with exact sizes.
(Wrapping the Python functions misses DDP, whose reducer calls the process group from C++, and breaks
when FSDP changes which `dist.*` function it calls; `CommDebugMode` counts calls but not bytes.) For FSDP2
the counter also labels each collective with the unit (module FQN) it belongs to, and logs when each unit
is resharded, so the number of unsharded units alive at any moment can be read off the log.

What is counted, per collective:
  * `tensor_bytes`: the size of the full tensor involved: the all-gather output, the reduce-scatter
    input, the all-reduce buffer. This is what the collective is "about" and does not depend on N.
  * `sent_bytes`: what one rank sends under a bandwidth-optimal (ring) algorithm: (N-1)/N x tensor_bytes
    for all-gather and reduce-scatter, 2 (N-1)/N x tensor_bytes for all-reduce. The ZeRO paper's "2P per
    step for DDP, 3P for ZeRO-3" is this number with (N-1)/N rounded to 1. A send sends its tensor, a receive
    nothing. It is a model, not a wire
    capture: gloo, for one, runs a reduce-scatter as a full all-reduce (the profiler names it
    "gloo:all_reduce"), so on CPU ranks the wire carries more than this.

The cost model that prices these bytes on real links is `fsdplab.network`.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ._torch_private import (fsdp_param_group, fsdp_unit_name, graph_task_id, resolve_process_group,
                             torch_dispatch_mode)
from .network import ring_sent_bytes

# --- what each collective op is, and where its tensors are ----------------------------------------------

# op name -> (kind, index of the argument holding the full tensor(s), "times group size" for the full size)
C10D_OPS = {
    "_allgather_base_": ("all_gather", 0, False),        # (output, input, pg, ...): output is full
    "allgather_": ("all_gather", 0, False),              # (output_lists, inputs, pg, ...)
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "allgather_coalesced_": ("all_gather", 0, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),   # (output, input, pg, ...): input is full
    "reduce_scatter_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "allreduce_": ("all_reduce", 0, False),
    "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False),
    "reduce_": ("reduce", 0, False),
    "alltoall_base_": ("all_to_all", 1, False),
    "alltoall_": ("all_to_all", 1, False),
    "gather_": ("gather", 1, False),
    "scatter_": ("scatter", 0, False),
    "barrier": ("barrier", None, False),
    "send": ("send", 0, False),                          # point to point (pipeline stages, dist.send/isend)
    "recv_": ("recv", 0, False),
    "recv_any_source_": ("recv", 0, False),
}
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", 0, True),   # (input shard, group_size, group_name)
    "all_gather_into_tensor_out": ("all_gather", 0, True),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
    "all_reduce": ("all_reduce", 0, False),
    "all_reduce_": ("all_reduce", 0, False),
    "all_reduce_coalesced": ("all_reduce", 0, False),
    "all_reduce_coalesced_": ("all_reduce", 0, False),
    "broadcast": ("broadcast", 0, False),
    "broadcast_": ("broadcast", 0, False),
    "all_to_all_single": ("all_to_all", 0, False),
}

def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _group_of(args, kwargs):
    """The ProcessGroup a collective runs on (c10d ops pass a boxed group, functional ops its name)."""
    import torch.distributed as dist

    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(value)
            except Exception:
                continue
        if isinstance(value, dist.ProcessGroup):
            return value
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, str) and (group := resolve_process_group(value)) is not None:
            return group
    return None


# --- the counter ------------------------------------------------------------------------------------------

_LOCAL = threading.local()  # the FSDP unit whose unshard / post_backward is running right now


class _Mode(torch_dispatch_mode()):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Let tensor subclasses (DTensor) desugar into plain ops first, as CommDebugMode does; the
        # collectives they launch come back through this mode as plain-tensor ops.
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            table = C10D_OPS if namespace == "c10d" else _FUNCTIONAL
            name = func.overloadpacket.__name__
            if name in table:
                self.counter._record(name, table[name], args, kwargs)
        return out


class CommCounter:
    """Context manager: log every collective this rank launches inside it (on any thread it runs on).

    >>> with CommCounter(mesh=mesh2d) as counter:      # mesh: name the process groups by mesh dim
    ...     loss = model(x).sum(); loss.backward()
    >>> counter.records[0]  # {'kind': 'all_gather', 'tensor_bytes': ..., 'sent_bytes': ..., 'dim': 'shard', ...}
    >>> counter.total("sent_bytes", kind="all_gather")

    `records` are plain dicts (safe to return from a rank). `events` also holds FSDP2 "reshard" marks and
    `marker()` entries, in order, for reading how many units are unsharded at once (`live_units`).
    """

    def __init__(self, mesh=None, fsdp_labels: bool = True):
        self.mesh, self.fsdp_labels = mesh, fsdp_labels
        self.events: list = []
        self._section = None
        self._mode = None
        self._patches = []
        self._group_dims = {}
        if mesh is not None:
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            for i, name in enumerate(names):
                self._group_dims[mesh.get_group(i).group_name] = name

    # -- life cycle
    def __enter__(self):
        if self.fsdp_labels:
            self._patch_fsdp()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        return False

    def reset(self):
        self.events.clear()

    @contextlib.contextmanager
    def section(self, name: str):
        """Label the collectives launched inside (e.g. "step" for the optimizer, "setup" for wrapping)."""
        previous, self._section = self._section, name
        try:
            yield
        finally:
            self._section = previous

    def marker(self, label: str, **extra):
        """Put a named mark in the event log (e.g. "compute layers.0 starts")."""
        self.events.append({"event": "marker", "label": label, "phase": self._phase(), **extra})

    # -- what was seen
    @property
    def records(self) -> list:
        return [e for e in self.events if e["event"] == "collective"]

    def total(self, field: str = "sent_bytes", **where) -> float:
        """Sum of `field` over the records matching every `key=value` in `where`."""
        return sum(r[field] for r in self.records if all(r.get(k) == v for k, v in where.items()))

    # -- internals
    def _phase(self) -> str:
        if self._section is not None:
            return self._section
        return "backward" if graph_task_id() != -1 else "forward"

    def _record(self, op: str, spec, args, kwargs):
        kind, where, times_group = spec
        group = _group_of(args, kwargs)
        group_size = group.size() if group is not None else 1
        if kind == "barrier" or where is None:
            tensor_bytes = 0
        else:
            tensor_bytes = _nbytes(args[where]) * (group_size if times_group else 1)
        try:
            import torch.distributed as dist

            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        except Exception:
            ranks = ()
        group_name = getattr(group, "group_name", "") if group is not None else ""
        dtypes = {str(t.dtype).replace("torch.", "") for t in _tensors(args[where])} if where is not None else set()
        self.events.append({
            "event": "collective", "index": len(self.records), "op": op, "kind": kind,
            "tensor_bytes": int(tensor_bytes), "sent_bytes": ring_sent_bytes(kind, tensor_bytes, group_size),
            "group_size": group_size, "ranks": ranks, "group": group_name,
            "dim": self._group_dims.get(group_name), "dtype": ",".join(sorted(dtypes)),
            "phase": self._phase(), "unit": getattr(_LOCAL, "unit", None),
        })

    def _patch_fsdp(self):
        """Label FSDP2 collectives with their unit: the all-gather is launched inside `unshard`, the
        reduce-scatter (and HSDP's all-reduce) inside `post_backward`; log `reshard` to count live units.
        A torch that moved or renamed these raises PrivateAPIError: unlabelled counts would break the lessons
        quietly. (Count without FSDP2 labels with `fsdp_labels=False`.)"""
        param_group = fsdp_param_group()
        counter = self

        def labelled(original, log_reshard=False):
            def wrapper(group, *args, **kwargs):
                unit = fsdp_unit_name(group)
                was_unsharded = getattr(group, "is_unsharded", None)
                previous, _LOCAL.unit = getattr(_LOCAL, "unit", None), unit
                try:
                    return original(group, *args, **kwargs)
                finally:
                    _LOCAL.unit = previous
                    # reshard() is a no-op for SHARD_GRAD_OP after forward: log only real state changes
                    if log_reshard and (was_unsharded is None or (was_unsharded and not group.is_unsharded)):
                        counter.events.append({"event": "reshard", "unit": unit, "phase": counter._phase()})
            return wrapper

        for name, log in (("unshard", False), ("post_backward", False), ("reshard", True)):
            original = getattr(param_group, name)  # the shim checked that all three exist
            self._patches.append((param_group, name, original))
            setattr(param_group, name, labelled(original, log))


def live_units(events: list) -> list:
    """Walk a CommCounter event log: after each event, which FSDP units are unsharded (all-gathered and
    not resharded yet). Returns [(event, sorted list of live units)]. Only real all-gathers open a unit and
    only a reshard of an open unit closes it, so no-op calls are ignored."""
    live, out = set(), []
    for event in events:
        unit = event.get("unit")
        if event["event"] == "collective" and event["kind"] == "all_gather" and unit:
            live.add(unit)
        elif event["event"] == "reshard" and unit in live:
            live.discard(unit)
        out.append((event, sorted(live)))
    return out


def peak_live_units(events: list, phase: str | None = None, exclude=("root",)) -> int:
    """The most units unsharded at once (optionally only during `phase`), not counting `exclude`."""
    peak, before = 0, []
    for event, live in live_units(events):
        if phase is None or event.get("phase") == phase:
            # the state entering the phase counts too (SHARD_GRAD_OP enters backward with every unit live)
            peak = max(peak, *(len([u for u in s if u not in exclude]) for s in (before, live)))
        before = live
    return peak


def summarize(records: list, by=("phase", "kind")) -> dict:
    """{(values of `by`...): {"count", "tensor_bytes", "sent_bytes"}} over collective records."""
    table: dict = {}
    for r in records:
        key = tuple(r.get(k) for k in by)
        row = table.setdefault(key, {"count": 0, "tensor_bytes": 0, "sent_bytes": 0.0})
        row["count"] += 1
        row["tensor_bytes"] += r["tensor_bytes"]
        row["sent_bytes"] += r["sent_bytes"]
    return table


def cross_node_bytes(records: list, ranks_per_node: int) -> dict:
    """Ring model on the real groups: bytes that stay inside a node vs bytes that leave one, per step.

    Each collective's ring visits its group's ranks in order; every hop carries the per-rank `sent_bytes`.
    A hop between ranks of different nodes (node = rank // ranks_per_node) crosses the network.
    Returns {"intra": bytes on hops inside nodes, "inter": bytes on hops between nodes}, summed over all
    hops of all rings (so over the whole job, counting each collective once per rank that logged it)."""
    if ranks_per_node < 1:
        raise ValueError("ranks_per_node must be >= 1 (GPUs per node).")
    intra = inter = 0.0
    for r in records:
        ranks = sorted(r["ranks"])
        if len(ranks) < 2:
            continue
        # every rank of the group logs the same collective: charge it 1/len(group) of the ring each
        hops = [(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))]
        for a, b in hops:
            share = r["sent_bytes"] / len(ranks)
            if a // ranks_per_node == b // ranks_per_node:
                intra += share
            else:
                inter += share
    return {"intra": intra, "inter": inter}


# --- on a rank: one training step per strategy, counted ---------------------------------------------------

def make_mesh(shape=None, names=None):
    """On a rank: the DeviceMesh of `shape` (e.g. (2, 2)) named `names` (e.g. ("replicate", "shard")) on
    this rank's device type; the 1-D mesh over all ranks when `shape` is None."""
    from torch.distributed.device_mesh import init_device_mesh

    from .ranks import device, mesh

    if shape is None:
        return mesh()
    return init_device_mesh(device().type, tuple(shape), mesh_dim_names=tuple(names) if names else None)


def toy_step(model, optimizer, cfg, batch_size, seed, counter=None, device=None) -> float:
    """One `sharding.train_step` on a toy-task batch (on `device`; None: this rank's); with a counter the
    optimizer step is its "step" section."""
    from .models import random_batch
    from .sharding import train_step

    batch = random_batch(cfg, batch_size, seed=seed, device=device)
    return train_step(model, optimizer, batch, counter=counter).item()


def count_train_step(strategy: str = "full_shard", cfg=None, batch_size: int = 2, seed: int = 0,
                     mesh=None, explicit_prefetch: int = 0, warmup_steps: int = 1,
                     backward_prefetch: str = "implicit") -> dict:
    """Build the tiny transformer, parallelize it with `strategy`, run `warmup_steps` steps, then count one.

    Runs on a rank (inside `cluster.run`). `explicit_prefetch=k` (FSDP only) sets
    `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` to the next k blocks.
    `backward_prefetch` (FSDP only, see `set_backward_prefetch`): "implicit" (nothing set), "empty list"
    (`set_modules_to_backward_prefetch([])` on every unit) or "off".
    Returns plain data: the event log, the parameter count of the blocks and of the rest (the root unit),
    and the bytes of one fp32 copy of all parameters."""
    from .ranks import this_rank
    from .models import TinyConfig, blocks_of
    from .sharding import build_tiny, parallelize

    cfg = cfg or TinyConfig()
    if isinstance(mesh, tuple):  # (shape, names): build it here, on the rank
        mesh = make_mesh(*mesh)
    model = build_tiny(cfg, seed=seed)
    blocks = blocks_of(model)
    block_params = sum(p.numel() for b in blocks for p in b.parameters())
    total_params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, strategy, mesh=mesh)
    if explicit_prefetch and strategy in ("full_shard", "shard_grad_op"):
        set_explicit_prefetch(model, explicit_prefetch)
    if backward_prefetch != "implicit" and strategy in ("full_shard", "shard_grad_op"):
        set_backward_prefetch(model, backward_prefetch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()

    def step(counter=None):
        return toy_step(model, optimizer, cfg, batch_size, seed + rank, counter)

    for _ in range(warmup_steps):
        step()
    with CommCounter(mesh=mesh) as counter:
        handles = add_compute_markers(counter, {f"layers.{i}": b for i, b in enumerate(blocks)})
        try:
            step(counter)
        finally:
            for handle in handles:
                handle.remove()
    return {"strategy": strategy, "events": counter.events, "block_params": block_params,
            "root_params": total_params - block_params, "params": total_params, "param_bytes": 4 * total_params,
            "num_layers": cfg.num_layers}


def add_compute_markers(counter: CommCounter, modules: dict) -> list:
    """Log "fwd NAME" when each module's forward starts and "bwd NAME" when its backward starts (the
    gradient of its output arrives), so the event log shows which collectives ran ahead of which layer.
    Hooks added after `fully_shard` run after FSDP's own, so a forward marker follows that unit's all-gather
    (and any prefetch it launched). Returns the hook handles; remove them when done."""
    import torch

    handles = []
    for name, module in modules.items():
        def pre(mod, args, name=name):
            counter.marker(f"fwd {name}")

        def post(mod, args, out, name=name):
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                handles.append(y.register_hook(lambda grad, name=name: counter.marker(f"bwd {name}")))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def set_explicit_prefetch(model, depth: int = 1) -> None:
    """FSDP2 explicit prefetch: each block asks for the next `depth` blocks' all-gathers in forward, and for
    the previous `depth` blocks' in backward (the FSDP1 BACKWARD_PRE / forward_prefetch analogue)."""
    from .models import blocks_of

    if depth < 1:
        raise ValueError("depth is how many blocks to prefetch ahead: use 1 or more (0 means: don't call this).")
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1:i + 1 + depth]
        behind = blocks[max(0, i - depth):i][::-1]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


BACKWARD_PREFETCH_MODES = ("implicit", "empty list", "off")


def set_backward_prefetch(model, mode: str = "off") -> None:
    """Set every FSDP2 unit's backward prefetch list (the model and each module `fully_shard` wrapped).

    FSDP2 has no off switch. Its `_pre_backward` (read in torch 2.13; earlier FSDP2 releases test the
    same) runs the implicit prefetch (the previous unit in post-forward order) only when the unit's list is
    empty, then prefetches what the list names. So "empty list" (`set_modules_to_backward_prefetch([])`)
    restores the implicit default; "off" lists each unit itself, which disables the implicit prefetch and
    prefetches nothing, since a unit is already unsharded when its own backward starts. Lesson 02 and
    tests/unit/test_comms.py check both on the event log."""
    from torch.distributed.fsdp import FSDPModule

    if mode not in BACKWARD_PREFETCH_MODES:
        raise ValueError(f"mode must be one of {BACKWARD_PREFETCH_MODES}, got {mode!r}.")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("no FSDP2 unit in this model: call fully_shard (sharding.parallelize) first.")
    if mode == "implicit":
        return
    for unit in units:
        unit.set_modules_to_backward_prefetch([] if mode == "empty list" else [unit])


def fsdp1_step_records(backward_prefetch: str | None = "BACKWARD_PRE", forward_prefetch: bool = False,
                       limit_all_gathers: bool = True, cfg=None, batch_size: int = 2, seed: int = 0) -> dict:
    """GPU only (FSDP1 refuses CPU): the posts' FSDP1 settings on the tiny transformer, one counted step.

    `backward_prefetch`: "BACKWARD_PRE", "BACKWARD_POST" or None. Returns the event log (collectives in
    launch order; FSDP1 units are not labelled) and the peak GPU memory of the step in bytes."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    from .ranks import this_rank
    from .models import TinyConfig
    from .sharding import apply_fsdp1, build_tiny

    if not torch.cuda.is_available():
        raise ValueError("FSDP1 (FullyShardedDataParallel) needs a GPU per rank; on CPU use FSDP2 (fully_shard).")
    if backward_prefetch not in (None, "BACKWARD_PRE", "BACKWARD_POST"):
        raise ValueError("backward_prefetch must be 'BACKWARD_PRE', 'BACKWARD_POST' or None.")
    cfg = cfg or TinyConfig()
    device = torch.device("cuda", torch.cuda.current_device())
    model = apply_fsdp1(
        build_tiny(cfg, seed=seed, device=device), device, sharding_strategy=ShardingStrategy.FULL_SHARD,
        backward_prefetch=getattr(BackwardPrefetch, backward_prefetch) if backward_prefetch else None,
        forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()

    def step(counter=None):
        return toy_step(model, optimizer, cfg, batch_size, seed + rank, counter, device=device)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with CommCounter(fsdp_labels=False) as counter:
        step(counter)
    torch.cuda.synchronize()
    return {"events": counter.events, "peak_bytes": torch.cuda.max_memory_allocated(),
            "settings": {"backward_prefetch": backward_prefetch, "forward_prefetch": forward_prefetch,
                         "limit_all_gathers": limit_all_gathers}}
