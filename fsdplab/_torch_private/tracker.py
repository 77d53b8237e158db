"""The memory tracker behind `memory.estimate` and `memory.measure`: torch's MemTracker / FSDPMemTracker (private
`torch.distributed._tools`) with the peaks fsdplab reports: the global peak and its moment, each category's own
maximum, the peak of what stays on the device under CPU offload, the memory over the step, and the allocation log
that `fsdplab.memory.allocator` replays. Its shortcuts on fake tensors change no byte it reports."""

from __future__ import annotations

from . import (CATEGORIES, OFFLOADED, TRACKER_TO_CATEGORY, _missing, fake_device_query, fsdp_param_groups,
               tracker_skips_other_fake_modes)
from .snapshots import category_totals, memory_over_step, raw_categories, split_categories


def _storage_tensors(tensor) -> list:
    """The tensors that hold `tensor`'s storage: itself, or for a wrapper subclass (torchao's NF4 tensor) the
    inner tensors `__tensor_flatten__` names, whose storages the tracker counts."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _storage_tensors(getattr(tensor, name))]


def _all_fake(args, fake_type) -> bool:
    """Every tensor in `args` (tensors and lists of them) is a FakeTensor without a value: FakeTensorMode
    keeps the value of small tensors made from Python numbers (an optimizer's step counts), in `constant`."""
    import torch

    for arg in args:
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, torch.Tensor) and (type(t) is not fake_type or t.constant is not None):
                return False
    return True


class _NoHandle:
    def remove(self) -> None:
        pass


_NO_HANDLE = _NoHandle()


class _PeakTracker:
    """Mixed in before torch's MemTracker / FSDPMemTracker: keeps the global peak, each category's own
    maximum, and the peak of what stays on the device when sharded parameters, gradients and optimizer
    state are offloaded to the host."""

    # `_snap_changes` counts the changes to the live bytes (an allocation, a free, a resize, a relabel), and
    # `_snap_seen` is its value at the last look for peaks: the peaks are a function of the live bytes, so
    # an op that changed none (a view, a scalar read) cannot move them and `_update_peak_stats` skips it.
    _snap_changes, _snap_seen = 0, -1

    def _init_peaks(self, key_category: dict, offloaded_keys: set):
        self.key_category, self.offloaded_keys = key_category, offloaded_keys
        self.offload_peak, self.offload_peak_snap = 0, {}
        self.category_max, self.offload_category_max = {}, {}
        self._device_query = fake_device_query()
        # Where the step is at each change of the live bytes: (phase, module, op), and the bytes per category
        # then (the memory-over-step figure); the moment of the peak (and of the peak left on the device).
        self._op, self.timeline, self.peak_at, self.offload_peak_at = None, [], {}, {}

    # Label each allocation of the log with its phase and module (a memory snapshot's frames): off by default,
    # it costs a tenth of an estimate.
    label_allocations = False

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # torch's MemTracker (a model that is not FSDP2, such as DDP's) registers a gradient hook on every
        # parameter, which raises on a frozen one (a LoRA base) and on a view (FSDP1's use_orig_params): mark
        # those as hooked already.
        handles = getattr(self, "_param_to_grad_hook_handles", None)
        if install_grad_hooks and handles is not None:
            for p in module.parameters():
                if (not p.requires_grad or not p.is_leaf) and handles.get(p) is None:
                    handles[p] = (_NO_HANDLE, _NO_HANDLE)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _phase(self) -> str:
        if getattr(self, "_in_opt", False):
            return "optimizer step"
        if getattr(self._mod_tracker, "is_bw", False):
            return "backward"
        return "forward" if len(getattr(self._mod_tracker, "parents", ())) > 1 else "between (zero_grad, hooks)"

    def _moment(self) -> dict:
        # The module is the one entered last of those still open. In backward, ModTracker keeps a module open
        # until its input gradients exist, which for some never happens before the end of backward (inputs
        # that need no gradient): the deepest open module was often one of a block done long before.
        # Only modules of the model count: transformers calls some functions as modules of their own
        # (its hub kernels' "Func", once per block), which ModTracker names by their class alone.
        parents = [p for p in getattr(self._mod_tracker, "parents", ()) if p != "Global"]
        entered = self._entered
        parents = [p for p in parents if p in entered] or parents
        module = max(parents, key=lambda p: (entered.get(p, -1), p.count("."), len(p))) if parents else ""
        return {"phase": self._phase(), "module": module.partition(".")[2] or module, "op": str(self._op or "")}

    _entered: dict = {}

    def __enter__(self):
        if self._depth == 0:    # ops under another fake mode than this one are DTensor's sharding propagation
            self._entry_fake_mode = self._device_query.active_fake_mode()
        result = super().__enter__()
        if self._depth == 1:
            self._base_skips_other_fake_modes = tracker_skips_other_fake_modes(self)
            self._note_module_entries()
        return result

    def __exit__(self, *args):
        if self._depth == 1:
            tracker = self._mod_tracker
            tracker._user_pre_fw_hook, tracker._user_pre_bw_hook = self._hooks_before
        return super().__exit__(*args)

    def _note_module_entries(self) -> None:
        """Number each module's entry (its forward, its backward) in order, for `_moment`: ModTracker's user
        hooks, chained to any the base class registered."""
        import itertools

        tracker, count = self._mod_tracker, itertools.count()
        self._entered = {}
        try:
            self._hooks_before = (tracker._user_pre_fw_hook, tracker._user_pre_bw_hook)
        except AttributeError as e:
            raise _missing("ModTracker._user_pre_fw_hook / _user_pre_bw_hook", e) from None

        root = getattr(self, "_root_mod", None)

        def noting(previous):
            def hook(module, *args):
                name = tracker.get_known_fqn(module) if module is not None else None
                if name is not None and ("." in name or module is root):
                    self._entered[name] = next(count)
                if previous is not None:
                    previous(module, *args)
            return hook
        tracker._user_pre_fw_hook, tracker._user_pre_bw_hook = map(noting, self._hooks_before)

    # The allocation and free sequence from the last reset_peak (fsdplab.memory.allocator replays it): None until then.
    alloc_log, alloc_preloaded, _serials = None, 0, None

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
        self._snap_changes += 1
        if self.events is not None:
            self._record(u_type.name, winfo, old_mem_consumed, old_reftype)
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
        from . import STREAM_OF

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
        if self.record_blocks is not None:
            self._start_events(alive)

    # --- the step as events (fsdplab.memory.block_repeat): what changed, and each look for peaks --------------------
    # Set `record_blocks` to the model's blocks before reset_peak. From then on `events` holds, in order,
    # ("+", serial, bytes, kind) and ("-", ...) for an allocation and a free, ("r", serial, bytes, old kind,
    # kind) for a relabel, ("s", serial, old bytes, bytes, kind) for a resize, ("c", moment) where the tracker
    # looked for peaks, ("m", name) for `mark(name)`. `preloaded` is what was alive at the start (serial, bytes,
    # kind), `block_of` the block index of each serial that belongs to one block (its parameters' shards,
    # gradients and optimizer state, and what a foreach op made from them), `start` the live bytes by kind.
    record_blocks, events = None, None

    def _start_events(self, alive) -> None:
        from torch.distributed.tensor import DTensor

        from . import local_shard

        self.events, self.block_of = [], {}
        self.preloaded = [(self._serial(w), w.mem_consumed, w.reftype) for w in alive]
        self.start = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}

        def note(tensor, block):        # no op may run here: the tracker would look for peaks
            if tensor is not None:
                local = local_shard(tensor) if isinstance(tensor, DTensor) else tensor
                for part in _storage_tensors(local):
                    winfo = self._WINFO.get(part.untyped_storage(), (None,))[0]
                    if winfo is not None:
                        self.block_of[self._serial(winfo)] = block

        for block, module in enumerate(self.record_blocks):
            for p in module.parameters():
                note(p, block)
                note(p.grad, block)
        optimizer = getattr(self, "_optm", None) or getattr(self, "optimizer_of_blocks", None)
        for key, state in (optimizer.state.items() if optimizer is not None else ()):
            winfo = self._WINFO.get(key.untyped_storage(), (None,))[0]
            block = self.block_of.get(self._serial(winfo)) if winfo is not None else None
            if block is not None:
                for value in state.values():
                    note(value if hasattr(value, "untyped_storage") else None, block)

    def _record(self, kind, winfo, old_mem_consumed, old_reftype) -> None:
        serial, size = self._serial(winfo), winfo.mem_consumed
        if kind == "ADD":
            self.events.append(("+", serial, size, winfo.reftype))
        elif kind == "DEL":
            self.events.append(("-", serial, size, winfo.reftype))
        elif kind == "REF":
            self.events.append(("r", serial, size, old_reftype, winfo.reftype))
        else:
            self.events.append(("s", serial, old_mem_consumed, size, winfo.reftype))

    def _record_foreach_outputs(self, args, out) -> None:
        """A foreach op's i-th output belongs to the block of its first argument's i-th tensor."""
        for source, made in zip(args[0], out):
            if made is None or source is None:
                continue
            parent = self._WINFO.get(source.untyped_storage(), (None,))[0]
            winfo = self._WINFO.get(made.untyped_storage(), (None,))[0]
            if parent is not None and winfo is not None:
                block = self.block_of.get(self._serial(parent))
                if block is not None:
                    self.block_of[self._serial(winfo)] = block

    def mark(self, name: str) -> None:
        if self.events is not None:
            self.events.append(("m", name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Three in five ops of a step on fake tensors are `.device` queries, which neither allocate nor free.
        # The base class passes each on to FakeTensorMode, tracks no output and looks for new peaks. Where
        # FakeTensorMode is next, answer as it does (its first check) and look for peaks only where the
        # base class would find something new: bytes moved since the last op, outside DTensor's sharding
        # propagation.
        query = self._device_query
        if func is query.op and type(args[0]) is query.fake_tensor and query.fake_mode_is_next():
            self._catch_up_peaks()
            return query.answer(args)
        self._op = func
        # An optimizer step is a dozen in-place foreach ops over every trained tensor (and FSDP2 copies its
        # shards in with one per unit). On fake tensors they change no shape, allocate nothing and return
        # nothing, yet FakeTensorMode runs each through its Python reference kernel, tensor by tensor: a
        # tenth of a LoRA estimate. Where FakeTensorMode is next and every tensor is fake, skip the kernel.
        if self.skip_inplace_foreach and self._inplace_foreach(func) and query.fake_mode_is_next() \
                and _all_fake(args, query.fake_tensor):
            self._catch_up_peaks()
            self.skipped_kernels += 1
            return None
        if not self._base_skips_other_fake_modes and query.active_fake_mode() is not self._entry_fake_mode:
            return self._untracked(func, types, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.events is not None and isinstance(out, (list, tuple)) and args and isinstance(args[0], (list, tuple)) \
                and func.__name__.startswith("_foreach_"):
            self._record_foreach_outputs(args, out)
        return out

    def _catch_up_peaks(self):
        """For an op answered here, not passed to the base class: look for peaks where the base class would
        find something new (bytes moved since the last op, outside DTensor's sharding propagation)."""
        if self._snap_seen != self._snap_changes and \
                self._device_query.active_fake_mode() is self._entry_fake_mode:
            self._update_peak_stats(None)

    # torch 2.13's trackers leave untracked an op run under a fake mode other than the one active on entry
    # (DTensor's sharding propagation); 2.10 and 2.11's tracked it, counting the propagation's fake tensors
    # (on real tensors, 4x a small model's optimizer state). There fsdplab skips them as 2.13 does.
    _base_skips_other_fake_modes, _entry_fake_mode = True, None

    def _untracked(self, func, types, args, kwargs):
        """What torch 2.13's MemTracker.__torch_dispatch__ does for an op it does not track."""
        import torch
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented           # DTensor desugars into local ops first, as in the base class
        if func is torch.ops._c10d_functional.wait_tensor.default and self._device_query.active_fake_mode():
            return args[0]                  # the base class's override of wait_tensor's meta kernel
        return func(*args, **(kwargs or {}))

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
        if self.events is not None:
            self.events.append(("c", moment := self._moment()))
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)
                self.peak_at = moment = self._moment()
            cats, kept, off = split_categories(snap, self.key_category, self.offloaded_keys,
                                     self.category_max, self.offload_category_max)
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
                groups = fsdp_param_groups(module) if isinstance(module, FSDPModule) else []
                if groups:
                    module.unshard()
                    for fsdp_param in (p for group in groups for p in group.fsdp_params):
                        self._update_and_maybe_create_winfos(fsdp_param.unsharded_param,
                                                             _FSDPRefType.UNSHARDED_PARAM)
                    module.reshard()
        except AttributeError as e:
            raise _missing("FSDP2 internals (FSDPModule._get_fsdp_state, FSDPState._lazy_init, "
                           "FSDPParamGroup.fsdp_params, FSDPParam.unsharded_param) or "
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
        """The tracked region's bytes per category at each change (snapshots.memory_over_step)."""
        return memory_over_step(self.timeline, offload, points)

    def current(self) -> dict:
        """Raw tracker categories live right now (bytes, summed over devices)."""
        out: dict = {}
        for snap in self.get_tracker_snapshot("current").values():
            for k, v in raw_categories(snap).items():
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
            return int(self.offload_peak), category_totals(snap, skip=OFFLOADED), raw_categories(snap)
        snaps = self.get_tracker_snapshot("peak")
        if not snaps:
            return 0, dict.fromkeys(CATEGORIES, 0), {}
        snap = max(snaps.values(), key=lambda s: s["Total"])
        return int(snap["Total"]), category_totals(snap), raw_categories(snap)


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
        tracker.optimizer_of_blocks = optimizer     # FSDPMemTracker keeps its own (_optm): record_blocks needs it
    # Snapshot keys are str-Enum members (hashed by name, not value): map the members themselves.
    tracker._init_peaks({t: TRACKER_TO_CATEGORY.get(t.value, "other") for t in (*_FSDPRefType, *_MemRefType)},
                        {t for t in _FSDPRefType if t.value in OFFLOADED})
    return tracker
