"""Count every collective a rank launches, and price it with a latency-bandwidth cost model.

Counting: `CommCounter` is a `TorchDispatchMode`. Every collective in torch, whether FSDP2's all-gather and
reduce-scatter, DDP's C++ reducer all-reduce, a plain `dist.all_reduce`, or DTensor's functional
collectives for tensor parallelism, goes through the dispatcher as a `c10d::*` or `_c10d_functional::*` op
with its tensors and its process group, so one mode sees them all, in launch order, with exact sizes.
(Wrapping the Python functions misses DDP, whose reducer calls the process group from C++, and breaks
when FSDP changes which `dist.*` function it calls; `CommDebugMode` counts calls but not bytes.) For FSDP2
the counter also labels each collective with the unit (module FQN) it belongs to, and logs when each unit
is resharded, so the number of unsharded units alive at any moment can be read off the log.

What is counted, per collective:
  * `tensor_bytes`: the size of the full tensor involved: the all-gather output, the reduce-scatter
    input, the all-reduce buffer. This is what the collective is "about" and does not depend on N.
  * `sent_bytes`: what one rank sends under a bandwidth-optimal (ring) algorithm: (N-1)/N x tensor_bytes
    for all-gather and reduce-scatter, 2 (N-1)/N x tensor_bytes for all-reduce. The ZeRO paper's "2P per
    step for DDP, 3P for ZeRO-3" is this number with (N-1)/N rounded to 1. It is a model, not a wire
    capture: gloo, for one, runs a reduce-scatter as a full all-reduce (the profiler names it
    "gloo:all_reduce"), so on CPU ranks the wire carries more than this.

Cost model: `collective_time(kind, nbytes, world_size, link)` is the ring model,
(N-1)/N x bytes / bandwidth + (N-1) x latency, twice that for all-reduce. Bandwidths in `PRESETS` are
per rank, per direction, from vendor specifications:
  * NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s total = 300 GB/s per direction per GPU
    (through NVSwitch in HGX/DGX A100). NVIDIA H100 datasheet: fourth-generation NVLink, 900 GB/s total
    = 450 GB/s per direction (SXM5). A10 servers have no NVLink: their GPUs talk over PCIe.
  * PCI-SIG: PCIe 4.0 runs 16 GT/s per lane, x16 = 31.5 GB/s per direction after 128b/130b encoding;
    PCIe 5.0 doubles it (63 GB/s).
  * NVIDIA ConnectX adapters: EDR/HDR100 100 Gb/s, HDR 200 Gb/s, NDR 400 Gb/s = 12.5 / 25 / 50 GB/s
    (bits / 8).
  * IEEE 802.3 Ethernet: 10 / 25 / 100 Gb/s line rates = 1.25 / 3.125 / 12.5 GB/s. "10-25 GB/s" for
    ordinary Ethernet confuses bits with bytes.
Latencies are round order-of-magnitude per-hop figures (a few microseconds for NVLink and InfiniBand
with NCCL, tens for TCP over Ethernet), not vendor numbers: at the sizes FSDP moves (megabytes per
unit) bandwidth dominates and the conclusions do not depend on them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from ._torch_private import (fsdp_param_group, fsdp_unit_name, graph_task_id, resolve_process_group,
                             torch_dispatch_mode)

GB = 1e9  # network bandwidths are quoted in decimal gigabytes

# --- what each collective op is, and where its tensors are ----------------------------------------------

# op name -> (kind, index of the argument holding the full tensor(s), "times group size" for the full size)
_C10D = {
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

RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


def ring_sent_bytes(kind: str, tensor_bytes: float, group_size: int) -> float:
    """Bytes one rank sends for a collective on a full tensor of `tensor_bytes`, ring algorithm."""
    if group_size <= 1:
        return 0.0
    if kind in RING_FACTOR:
        return RING_FACTOR[kind] * (group_size - 1) / group_size * tensor_bytes
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        return float(tensor_bytes)  # pipelined chain: every rank but one forwards the whole tensor once
    return 0.0


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
            table = _C10D if namespace == "c10d" else _FUNCTIONAL
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

    from .dist import device, mesh

    if shape is None:
        return mesh()
    return init_device_mesh(device().type, tuple(shape), mesh_dim_names=tuple(names) if names else None)


def _toy_step(model, optimizer, cfg, batch_size, seed, counter=None, device="cpu") -> float:
    """One `sharding.train_step` on a toy-task batch; with a counter the optimizer step is its "step" section."""
    from .models import random_batch
    from .sharding import train_step

    batch = random_batch(cfg, batch_size, seed=seed, device=device)
    return train_step(model, optimizer, batch, counter=counter).item()


def count_train_step(strategy: str = "full_shard", cfg=None, batch_size: int = 2, seed: int = 0,
                     mesh=None, explicit_prefetch: int = 0, warmup_steps: int = 1) -> dict:
    """Build the tiny transformer, parallelize it with `strategy`, run `warmup_steps` steps, then count one.

    Runs on a rank (inside `cluster.run`). `explicit_prefetch=k` (FSDP only) sets
    `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` to the next k blocks.
    Returns plain data: the event log, the parameter count of the blocks and of the rest (the root unit),
    and the bytes of one fp32 copy of all parameters."""
    from .dist import this_rank
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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()

    def step(counter=None):
        return _toy_step(model, optimizer, cfg, batch_size, seed + rank, counter)

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


# --- cost model -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    """A link as one rank sees it: bandwidth per direction (GB/s, decimal) and per-hop latency (s)."""
    name: str
    bandwidth_gbps: float
    latency_s: float = 5e-6

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * GB


# Sources in the module docstring. Keys are what a notebook dropdown shows.
PRESETS = {
    "NVLink A100 (300 GB/s)": Link("NVLink A100 (300 GB/s)", 300.0, 3e-6),
    "NVLink H100 (450 GB/s)": Link("NVLink H100 (450 GB/s)", 450.0, 3e-6),
    "PCIe 4.0 x16 (31.5 GB/s)": Link("PCIe 4.0 x16 (31.5 GB/s)", 31.5, 5e-6),
    "PCIe 5.0 x16 (63 GB/s)": Link("PCIe 5.0 x16 (63 GB/s)", 63.0, 5e-6),
    "InfiniBand 100 Gb/s (12.5 GB/s)": Link("InfiniBand 100 Gb/s (12.5 GB/s)", 12.5, 5e-6),
    "InfiniBand 200 Gb/s (25 GB/s)": Link("InfiniBand 200 Gb/s (25 GB/s)", 25.0, 5e-6),
    "InfiniBand 400 Gb/s (50 GB/s)": Link("InfiniBand 400 Gb/s (50 GB/s)", 50.0, 5e-6),
    "Ethernet 10 GbE (1.25 GB/s)": Link("Ethernet 10 GbE (1.25 GB/s)", 1.25, 30e-6),
    "Ethernet 25 GbE (3.125 GB/s)": Link("Ethernet 25 GbE (3.125 GB/s)", 3.125, 30e-6),
    "Ethernet 100 GbE (12.5 GB/s)": Link("Ethernet 100 GbE (12.5 GB/s)", 12.5, 20e-6),
}
# The posts' figures, for comparison (claim 19): "NVSwitch 300 GB/s", "ordinary Ethernet 10-25 GB/s".
POST_CLAIMS_GBPS = {"NVSwitch": 300.0, "Ethernet low": 10.0, "Ethernet high": 25.0}


def get_link(link) -> Link:
    """A Link from a Link, a PRESETS key, or a unique fragment of one ("H100", "25 GbE", "400 Gb/s")."""
    if isinstance(link, Link):
        return link
    if link in PRESETS:
        return PRESETS[link]
    matches = [k for k in PRESETS if str(link).lower() in k.lower()]
    if len(matches) != 1:
        raise ValueError(f"unknown link {link!r}: use a Link(...) or one of {list(PRESETS)} "
                         "(a unique part of a name works too).")
    return PRESETS[matches[0]]


def collective_time(kind: str, nbytes: float, world_size: int, link) -> float:
    """Seconds for one ring collective on a full tensor of `nbytes` over `world_size` ranks on `link`:
    (N-1)/N x bytes / bandwidth + (N-1) x latency; all-reduce (= reduce-scatter + all-gather) twice that."""
    if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"kind must be 'all_gather', 'reduce_scatter' or 'all_reduce', got {kind!r}.")
    if world_size < 1:
        raise ValueError("world_size must be >= 1.")
    link = get_link(link)
    if world_size == 1:
        return 0.0
    n = world_size
    one = (n - 1) / n * nbytes / link.bytes_per_s + (n - 1) * link.latency_s
    return 2 * one if kind == "all_reduce" else one


def step_sent_bytes(strategy: str, param_bytes: float, world_size: int) -> float:
    """Ring bytes one rank sends per step for the whole model (gradients in the parameters' dtype):
    DDP 2(N-1)/N P (all-reduce); SHARD_GRAD_OP 2(N-1)/N P (all-gather once + reduce-scatter);
    FULL_SHARD 3(N-1)/N P (all-gather in forward and again in backward + reduce-scatter)."""
    factor = {"ddp": 2, "no_shard": 2, "shard_grad_op": 2, "full_shard": 3}
    if strategy not in factor:
        raise ValueError(f"strategy must be one of {list(factor)}, got {strategy!r}.")
    n = world_size
    return factor[strategy] * (n - 1) / n * param_bytes if n > 1 else 0.0


def step_comm_time(strategy: str, param_bytes: float, world_size: int, link, num_units: int = 1) -> float:
    """Seconds of communication per step (nothing overlapped), the model split into `num_units` equal units."""
    link = get_link(link)
    unit = param_bytes / num_units
    if strategy in ("ddp", "no_shard"):
        return num_units * collective_time("all_reduce", unit, world_size, link)
    gathers = 2 if strategy == "full_shard" else 1
    if strategy not in ("full_shard", "shard_grad_op"):
        raise ValueError(f"strategy must be ddp, shard_grad_op or full_shard, got {strategy!r}.")
    return num_units * (gathers * collective_time("all_gather", unit, world_size, link)
                        + collective_time("reduce_scatter", unit, world_size, link))


def hsdp_comm_time(param_bytes: float, num_nodes: int, gpus_per_node: int, intra, inter,
                   num_units: int = 1) -> dict:
    """Seconds per step for FULL_SHARD over every GPU (its rings cross the slow link, which sets the pace)
    vs HSDP (all-gather / reduce-scatter inside each node on `intra`, then an all-reduce of each rank's
    1/gpus_per_node gradient shard across nodes on `inter`). No overlap."""
    intra, inter = get_link(intra), get_link(inter)
    world = num_nodes * gpus_per_node
    unit = param_bytes / num_units
    slowest = inter if num_nodes > 1 else intra
    flat = num_units * 3 * collective_time("all_gather", unit, world, slowest)
    inside = num_units * 3 * collective_time("all_gather", unit, gpus_per_node, intra)
    across = num_units * collective_time("all_reduce", unit / gpus_per_node, num_nodes, inter)
    return {"full_shard": flat, "hsdp": inside + across, "hsdp_intra": inside, "hsdp_inter": across}


def count_tp_fsdp_step(cfg=None, mesh_shape=(2, 2), batch_size: int = 2, seed: int = 0) -> dict:
    """On a rank: tensor parallelism inside a "node" + FSDP across nodes, on a 2-D mesh ("dp", "tp").

    Each block's MLP is split Megatron-style by `sharding.apply_tp` (one all-reduce in forward and one in
    backward over "tp"; attention stays replicated); then `sharding.apply_fsdp` shards every block and the
    root over "dp". Counts one step after a warm-up; also returns the losses, so they can be compared with
    the same model trained in one process (`reference_losses`)."""
    from .models import TinyConfig, blocks_of
    from .sharding import apply_fsdp, apply_tp, build_tiny

    cfg = cfg or TinyConfig()
    mesh2d = make_mesh(mesh_shape, ("dp", "tp"))
    model = apply_tp(build_tiny(cfg, seed=seed), mesh2d["tp"])
    # None is fully_shard's default: blocks reshard after forward, the root (needed first in backward) does not
    apply_fsdp(model, mesh2d["dp"], reshard_after_forward=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # one batch per data-parallel group: the two TP ranks of a node must see the same tokens
    dp_rank = mesh2d.get_local_rank("dp")

    def step(counter=None):
        return _toy_step(model, optimizer, cfg, batch_size, seed + dp_rank, counter)

    first_loss = step()
    with CommCounter(mesh=mesh2d) as counter:
        second_loss = step(counter)
    mlp = blocks_of(model)[0].mlp[0].weight
    return {"events": counter.events, "losses": [first_loss, second_loss],
            "mlp_weight_placements": [str(p) for p in mlp.placements], "mlp_weight_local_shape": tuple(mlp.to_local().shape),
            "mlp_weight_shape": tuple(mlp.shape)}


def reference_losses(cfg=None, world_size_dp: int = 2, batch_size: int = 2, seed: int = 0, steps: int = 2) -> list:
    """The losses `count_tp_fsdp_step` should see, computed in one process: the same model, each step on
    the concatenation of the dp groups' batches (what data parallelism averages over), plain SGD.
    Returns, per step, each dp group's loss."""
    from .models import TinyConfig, random_batch
    from .sharding import build_tiny, loss_of, train_step

    cfg = cfg or TinyConfig()
    model = build_tiny(cfg, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [random_batch(cfg, batch_size, seed=seed + r) for r in range(world_size_dp)]
    per_group = []

    def mean_over_groups(model, batches):  # keeps each group's loss for the comparison
        per_group[:] = [loss_of(model, batch) for batch in batches]
        return sum(per_group) / len(batches)

    losses = []
    for _ in range(steps):
        train_step(model, optimizer, batches, loss_fn=mean_over_groups)
        losses.append([x.item() for x in per_group])
    return losses


def fsdp1_step_records(backward_prefetch: str | None = "BACKWARD_PRE", forward_prefetch: bool = False,
                       limit_all_gathers: bool = True, cfg=None, batch_size: int = 2, seed: int = 0) -> dict:
    """GPU only (FSDP1 refuses CPU): the posts' FSDP1 settings on the tiny transformer, one counted step.

    `backward_prefetch`: "BACKWARD_PRE", "BACKWARD_POST" or None. Returns the event log (collectives in
    launch order; FSDP1 units are not labelled) and the peak GPU memory of the step in bytes."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    from .dist import this_rank
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
        return _toy_step(model, optimizer, cfg, batch_size, seed + rank, counter, device=device)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with CommCounter(fsdp_labels=False) as counter:
        step(counter)
    torch.cuda.synchronize()
    return {"events": counter.events, "peak_bytes": torch.cuda.max_memory_allocated(),
            "settings": {"backward_prefetch": backward_prefetch, "forward_prefetch": forward_prefetch,
                         "limit_all_gathers": limit_all_gathers}}
