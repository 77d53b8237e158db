"""How much memory one rank needs, as a `MemoryReport` (fsdplab.memory.report, with `CATEGORIES`
and `CATEGORY_LABELS`): exact on fake tensors (live ranks: fsdplab.memory.live, the same step).

- `estimate(setting)`: the exact per-rank figure of a real training step at full scale, without GPUs: a fake
  process group of any world size, fake tensors, FSDP2 and two optimizer steps under torch's FSDP memory
  tracker (fsdplab/_torch_private/tracker.py). Qwen-7B on 8 ranks takes 2-5 s on 2 CPU
  cores after the imports, and about 400 MB of RAM.
- `measure(...)` / `measure_setting(setting)` (fsdplab.memory.live): what live ranks really hold, per category.
- The analytic model is `fsdplab.memory.formula(setting)`; it returns the same report.
- Within one `fsdplab run`, `estimate` reads back, or waits for, what the run already estimated (the run's
  cache, fsdplab.memory.cache) and adds what it works out itself.

Every answer has the same six categories: parameters, gradients, optimizer_state, activations,
communication_buffers, other.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

from . import cache, ddp
from .. import custom as custom_model
from ..custom import custom_of
from .allocator import allocator_view
from .checks import explained
from .._torch_private import CATEGORIES
from .report import CATEGORY_LABELS, MemoryReport
from ..settings import EXACT_STRATEGIES, FSDP1_STRATEGIES, GIB, MIB, TrainSetting, as_setting, check_choice

__all__ = ["CATEGORIES", "CATEGORY_LABELS", "MemoryReport", "estimate", "estimate_group", "memory_snapshot"]


# --- training steps under the tracker (shared by estimate and measure) ------------------------------------

class _ParameterWithoutGradient(Exception):
    """A trainable parameter got no gradient, so a real first step would have given it no optimizer state."""


def _run_steps(model, optimizer, batch, steps, loss_fn=None, progress=None, offload=False,
               state_only_first=False, label_allocations=False, repeat_to=None, accumulate=1, no_sync=False):
    """`steps` training steps under a tracker. Step 1 only creates the optimizer state; each later step's
    peak is recorded and the lowest is kept (identical on fake tensors; on CPU ranks gloo's worker thread
    sometimes frees a collective's buffer a moment late, which only ever adds). Returns
    (peak, by_category, raw, category_peaks, live categories after backward, after the optimizer step,
    the moment of the peak {phase, module, op}, the memory over the reported step by category, what the CUDA
    caching allocator would reserve for it).

    state_only_first (FSDP2 models; the estimator): step 1 does not run the model. It leaves behind what a
    real step 1 leaves for the next: FSDP2 settled as after its first forward (tracker.settle_fsdp) and the
    optimizer state, from a step on zero gradients. On fake tensors an op costs the same whatever its size,
    and forward and backward are nearly all of a step's ops: this saves a quarter of a 7B estimate. Raises
    _ParameterWithoutGradient if a later backward leaves a trainable parameter without a gradient (a real
    step 1 would have given it no state): the caller then starts again without the shortcut.

    repeat_to (an FSDP2 model of identical blocks, the estimator): every number is that of the same model with
    `repeat_to` blocks, its middle block's events repeated (fsdplab.memory.block_repeat). accumulate, no_sync:
    micro-batches per step and whether only the last reduces its gradients (sharding.train_step)."""
    from .._torch_private.tracker import make_tracker
    from .offload_view import gpu_side_log
    from ..sharding import train_step

    if steps < 2:
        raise ValueError("steps must be at least 2: the first step creates the optimizer state.")
    tracker = make_tracker(model, optimizer)
    tracker.label_allocations = label_allocations
    if repeat_to is not None:
        from ..models import blocks_of

        tracker.record_blocks = blocks_of(model)
    elif offload:
        tracker.record_blocks = []       # the step as events: what stays on the GPU is made from them
    if isinstance(batch, dict):
        tracker_inputs = tuple(batch.values())
    else:
        tracker_inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    if hasattr(tracker, "track_inputs"):
        tracker.track_inputs(tracker_inputs)
    snaps, records, skipped = {}, [], []
    trained = [p for group in optimizer.param_groups for p in group["params"]]

    def after_backward():
        snaps["backward"] = tracker.current()
        tracker.mark("after backward")
        if skipped and any(p.grad is None for p in trained):
            raise _ParameterWithoutGradient()

    with tracker, warnings.catch_warnings():
        # ModTracker warns that "the module hierarchy tracking maybe be messed up" whenever a module is entered
        # while open: transformers calls apply_rotary_pos_emb as one module object ("Func") in every block.
        # The tracker's moments ignore modules outside the model (tracker._moment); the warning says nothing.
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        for step in range(steps):
            if step > 0:
                tracker.reset_peak()
            if step == 0 and state_only_first and tracker.settle_fsdp(model):
                _optimizer_state_step(model, optimizer, batch, trained)
                skipped.append(step)
            else:
                # torch's trackers refuse a module run twice in one step unless their per-module stats are reset
                train_step(model, optimizer, batch, loss_fn=loss_fn, after_backward=after_backward,
                           accumulate=accumulate, no_sync=no_sync, between_micro_batches=tracker.reset_mod_stats)
            # zero_grad has run: parameters and optimizer state are what they were right after the step
            snaps["step"] = tracker.current()
            if step > 0 and repeat_to is not None:
                *numbers, marks = _repeated(tracker, model, repeat_to, offload)
                snaps.update(backward=marks["after backward"], step=marks["end"])
                records.append(tuple(numbers))
            elif step > 0:
                records.append((*tracker.peak(offload=offload), tracker.category_peaks(offload=offload),
                                tracker.offload_peak_at if offload else tracker.peak_at,
                                tracker.memory_over_step(offload),
                                # a copy: the log of the step alone (the tracker goes on to log the batch's free)
                                gpu_side_log(tracker.preloaded, list(tracker.events)) if offload else
                                (list(tracker.alloc_log), tracker.alloc_preloaded)))
            if progress:
                progress(f"step {step + 1}/{steps} done")
    peak, by_category, raw, _, moment, timeline, alloc_log = min(records, key=lambda r: r[0])
    category_peaks = {c: min(r[3][c] for r in records) for c in records[0][3]}
    return (peak, by_category, raw, category_peaks, snaps["backward"], snaps["step"], moment, timeline,
            alloc_log)


def _repeated(tracker, model, depth, offload):
    """The step just tracked, its middle block repeated until the model has `depth` blocks, replayed."""
    from . import block_repeat
    from .._torch_private.snapshots import replay_step
    from .offload_view import gpu_side_log

    record = {"events": tracker.events, "preloaded": tracker.preloaded, "block_of": tracker.block_of,
              "names": block_repeat.block_names(model, tracker.record_blocks)}
    preloaded, events, _ = block_repeat.deepen(record, depth)
    *numbers, log, marks = replay_step(tracker, preloaded, events, offload)
    return (*numbers, gpu_side_log(preloaded, events) if offload else log, marks)


def _reserved(alloc_log) -> dict:
    """What the CUDA caching allocator would reserve for the step tracked (fsdplab.memory.allocator), with and without
    expandable segments; {} without a log. Under cpu offload the log is the GPU's part (fsdplab.memory.offload_view)."""
    from . import allocator

    if not alloc_log or not alloc_log[0]:
        return {}
    plain = allocator.replay(*alloc_log)
    grown = allocator.replay(*alloc_log, expandable_segments=True)
    return {"reserved": plain["reserved"], "reserved_expandable": grown["reserved"],
            "allocated_peak": plain["allocated_peak"], "segments": plain["segments"]}


def _optimizer_state_step(model, optimizer, batch, trained) -> None:
    """Step 1 without the model: train_step with a constant loss, whose backward reaches no parameter, and
    zero gradients for the trained parameters after it. The optimizer step then creates the state a real
    step creates (zeros_like of each parameter, or a clone of its gradient: the same shapes and dtypes)."""
    import torch

    from ..sharding import train_step

    def zero_gradients():
        with torch.no_grad():
            for p in trained:
                p.grad = torch.zeros_like(p)

    train_step(model, optimizer, batch, loss_fn=lambda model, batch: torch.zeros((), requires_grad=True),
               after_backward=zero_gradients)


def _resident(after_backward: dict, after_step: dict) -> dict:
    pick = lambda snap, *names: int(sum(snap.get(k, 0) for k in names))  # noqa: E731
    return {"parameters": pick(after_step, "Sharded Param", "Parameter"),
            "gradients": pick(after_backward, "Sharded Grad", "Gradient"),
            "optimizer_state": pick(after_step, "OptState", "Optstate")}


# --- estimate: the exact figure on fake tensors ----------------------------------------------------------

def estimate(setting: TrainSetting | None = None, /, *, progress=True, subprocess_mode=None,
             **changes) -> MemoryReport:
    """Exact per-rank memory of two FSDP2 training steps of `setting` (a TrainSetting; keyword `changes`
    replace its fields, or build one), computed on fake tensors (no GPU, no real memory). The peak is the
    second step's (the first has no optimizer state).

    Parameters stay fp32 (the master copy) as FSDP2's MixedPrecisionPolicy keeps them, gradients are reduced
    in fp32. cpu_offload is modelled: FSDP2's CPUOffloadPolicy needs an accelerator, so the sharded
    parameters, gradients and optimizer state are taken off the device tally and the peak is the peak of what
    is left.

    A model of 12 or more identical blocks is traced with 8 of them, and a middle block's events are repeated for
    the others (fsdplab.memory.block_repeat: the same events as a trace of every block; FSDPLAB_TRACE_ALL_BLOCKS=1
    traces them all).

    A process can hold one process group: where one exists already (on a rank), the estimate runs in another
    process (fsdplab.memory.workers; `subprocess_mode=None` decides, True/False forces it). `progress` is True
    (print each stage), False, or, in another process, a function that receives each progress line (the
    dashboards).
    """
    setting = as_setting(setting, **changes)
    check_choice("strategy (exact estimates)", setting.strategy, EXACT_STRATEGIES)
    import torch.distributed as dist

    if subprocess_mode is None:
        subprocess_mode = dist.is_available() and dist.is_initialized()
    if subprocess_mode:
        from .workers import estimate_elsewhere

        return estimate_elsewhere(estimate_here, setting, progress)
    return estimate_here(setting, progress=progress)


def _progress_printer(enabled, label, stream=None):
    start = time.perf_counter()

    def say(message):
        if enabled:
            print(f"[estimate {label}] {message} ({time.perf_counter() - start:.1f} s)",
                  file=stream or sys.stdout, flush=True)
    return say


def estimate_here(setting: TrainSetting, progress=True, progress_stream=None) -> MemoryReport:
    """`estimate(setting)` in this process, whatever groups it holds (what a worker of fsdplab.memory.workers
    runs); progress lines go to `progress_stream` (default stdout)."""
    say = _progress_printer(progress, f"{setting.model_name} x{setting.world_size}", progress_stream)
    report = cache.cached_estimate(setting)
    if report is not None:
        say(f"reused the estimate made earlier in this run (it took {report.seconds:.1f} s)")
        return report
    if cache.estimate_under_way(setting):
        say("another process of this run is estimating this setting already: waiting for its report")
        report = cache.wait_for_estimate(setting, say=say)
        if report is not None:
            return report
    report = _compute_estimate(setting, say)
    cache.store(setting, report)
    return report


def memory_snapshot(setting: TrainSetting | None = None, path="estimate_snapshot.pickle", /, *, progress=True,
                    **changes) -> MemoryReport:
    """`estimate(setting)`, made afresh (not from the cache), that also writes the traced step as the caching
    allocator model replays it to `path`, in the format of `torch.cuda.memory._snapshot()`: open it in PyTorch's
    memory visualizer (pytorch.org/memory_viz, drag the file in) beside a snapshot of your own run. Each
    allocation is labelled with its kind, the phase and the module that made it."""
    setting = as_setting(setting, **changes)
    check_choice("strategy (exact estimates)", setting.strategy, EXACT_STRATEGIES)
    if setting.cpu_offload:
        raise ValueError("a memory snapshot needs the GPU's allocations: cpu_offload moves part of them to the host.")
    say = _progress_printer(progress, f"{setting.model_name} x{setting.world_size}")
    return _compute_estimate(setting, say, snapshot_path=path)


def _write_snapshot(alloc_log, path, say) -> None:
    import pickle

    from . import allocator
    from ..safe_files import atomic_write_bytes

    snapshot = allocator.replay(*alloc_log, snapshot=True)["snapshot"]
    atomic_write_bytes(Path(path), pickle.dumps(snapshot))
    say(f"memory snapshot written to {path} ({len(snapshot['device_traces'][0])} events, "
        f"{len(snapshot['segments'])} segments): open it at pytorch.org/memory_viz")


def _compute_estimate(setting: TrainSetting, say, snapshot_path=None) -> MemoryReport:
    from ..models import config_of

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    config = config_of(setting.model)
    # A custom model may set itself up in its first forward (a table made once, a lazy layer): its first step runs
    # as a real one does, where a transformers model's need not (see _run_steps).
    shortcut = custom_of(config) is None
    try:
        [(run, seconds, traced)] = _fake_steps(setting, config, say, state_only_first=shortcut,
                                               label_allocations=snapshot_path is not None)
    except _ParameterWithoutGradient:
        say("a trainable parameter gets no gradient: starting again with a full first step")
        [(run, seconds, traced)] = _fake_steps(setting, config, say, state_only_first=False,
                                               label_allocations=snapshot_path is not None)
    return _report(setting, run, seconds, say, snapshot_path, traced)


def estimate_group(settings: list, progress=False) -> list:
    """`estimate` of each of `settings`, which differ in seq_len and batch_size only (a sweep's points at one
    world size): the fake model is built and sharded once for them all, and the optimizer state it keeps is
    what every point's first step would create. Each report is stored in the run's cache, as `estimate`'s are;
    the numbers are those `estimate` gives each point alone (tests/unit/test_estimate_options.py)."""
    from ..models import config_of

    if not settings:
        return []
    base = settings[0].replace(seq_len=1, batch_size=1)
    if any(s.replace(seq_len=1, batch_size=1) != base for s in settings):
        raise ValueError("estimate_group takes settings that differ in seq_len and batch_size only.")
    reports = [cache.cached_estimate(s) for s in settings]
    todo = [s for s, r in zip(settings, reports) if r is None]
    if todo:
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        say = _progress_printer(progress, f"{todo[0].model_name} x{todo[0].world_size}")
        try:
            config = config_of(todo[0].model)
            # a custom model may make state in its first forward that a later point's tracker would not see
            runs = None if custom_of(config) is not None else \
                _fake_steps(todo[0], config, say, state_only_first=True, points=todo)
        except _ParameterWithoutGradient:   # rare (a frozen path): each point on its own, as estimate does
            runs = None
        made = iter([_report(s, run, seconds, say, traced=traced) for s, (run, seconds, traced) in zip(todo, runs)]
                    if runs else
                    [estimate(s, progress=progress, subprocess_mode=False) for s in todo])
        reports = [r if r is not None else next(made) for r in reports]
        for s, r in zip(settings, reports):
            if not any(n.startswith("reused") for n in r.notes):
                cache.store(s, r)
    return reports


def _report(setting: TrainSetting, run, seconds: float, say, snapshot_path=None, traced=None) -> MemoryReport:
    peak, by_category, raw, category_peaks, after_backward, after_step, moment, timeline, alloc_log = run
    reserved = _reserved(alloc_log)
    if setting.cpu_offload and reserved:
        from .offload_view import DESCRIPTION

        reserved["offload"] = DESCRIPTION
    if snapshot_path is not None:
        _write_snapshot(alloc_log, snapshot_path, say)
    notes = ["exact active peak (live tensors) of this program, on fake tensors; a GPU reserves more (the caching "
             "allocator's segments, modelled in 'on a GPU'), and nvidia-smi adds the CUDA context and NCCL buffers.",
             "eager PyTorch is traced: under torch.compile, fused kernels keep fewer temporaries (not modelled)."]
    if traced is not None:
        notes.append(f"{traced[0]} of the {traced[1]} blocks traced: the other {traced[1] - traced[0]} repeat a middle "
                     "block's allocations and frees, forward and backward, as FSDP2 runs identical blocks alike "
                     "(fsdplab.memory.block_repeat; FSDPLAB_TRACE_ALL_BLOCKS=1 traces every block).")
    if setting.attention_kind == "flash":
        notes.append("flash attention traced as SDPA's memory-efficient kernel: neither stores the score matrix, "
                     "and both keep the same output and log-sum-exp for backward.")

    if setting.cpu_offload:
        notes.append("cpu offload is modelled: sharded parameters, gradients and optimizer state are taken off "
                     "the device tally (FSDP2 CPUOffloadPolicy keeps them in host memory and steps the optimizer "
                     "there); the peak is that of what remains on the GPU.")
    if setting.precision != "fp32":
        base = {"fp32": "fp32", "nf4": "4-bit NF4 codes (blocks' matrices; the rest bf16)"}.get(
            setting.base_dtype, setting.base_dtype)
        stored = (f"{setting.adapter_dtype} LoRA adapters" + (" (the master copy)" if setting.adapter_dtype == "fp32"
                                                              else ", trained in place") +
                  f" and a frozen base stored as {base}"
                  if setting.lora_rank is not None else f"{base} sharded parameters"
                  + (" (the master copy)" if setting.base_dtype == "fp32" else ", trained in place"))
        notes.append(f"{setting.precision} compute under torch.autocast with {stored}; gradients in the parameters' "
                     "dtype, all-reduced through DDP's buckets." if setting.strategy == "ddp" else
                     f"{setting.precision} compute with {stored}; fp32 gradient reduction, as FSDP2's "
                     "MixedPrecisionPolicy does.")
    if setting.grad_accum > 1:
        notes.append(f"{setting.grad_accum} micro-batches per optimizer step" + (
            ", gradients reduced after the last only (no_sync): every unit's unsharded gradients stay from the "
            "first backward to the last (torch's FSDP tracker counts them as temporaries: 'other')."
            if setting.no_sync else ", each reducing its gradients."))
    if setting.lora_dropout:
        notes.append(f"LoRA dropout {setting.lora_dropout}: peft keeps each adapted Linear's dropped input for "
                     "lora_A's backward.")
    if setting.base_dtype == "nf4":
        notes.append("NF4 base: torchao's tensor; FSDP2 all-gathers its 4-bit codes and scales, and each forward "
                     "and backward dequantizes one matrix at a time in eager torchao code (its int64 indices are "
                     "the largest temporaries).")
    notes += _strategy_notes(setting)
    say(f"peak {peak / GIB:.2f} GiB" if peak > GIB / 4 else f"peak {peak / MIB:.2f} MiB")
    return MemoryReport(peak_bytes=int(peak), by_category=by_category, world_size=setting.world_size,
                        settings=setting.to_dict(), notes=notes, source="estimate",
                        resident=_resident(after_backward, after_step), detail=raw, category_peaks=category_peaks,
                        peak_moment=moment, timeline=timeline, gpu_view=allocator_view(reserved, setting),
                        seconds=round(seconds, 2))


def _strategy_notes(setting: TrainSetting) -> list:
    if setting.strategy == "ddp":
        return ["ddp is torch's DistributedDataParallel: every rank keeps the whole model, its gradients and "
                "optimizer state, and DDP's gradient buckets (a second gradient copy, in communication buffers). "
                "Its C++ Reducer cannot run on fake tensors: the model is traced unwrapped, as DDP runs it, and "
                "the buckets are added as DDP sizes them (fsdplab.memory.ddp)."
                + (f" {setting.precision} compute is torch.autocast, traced with the CPU's autocast op lists "
                   "(CUDA's keep a few more ops in fp32)." if setting.precision != "fp32" else "")]
    if setting.strategy in FSDP1_STRATEGIES:
        return [f"{setting.strategy}: FSDP1 (FullyShardedDataParallel, its default use_orig_params=False) traced on "
                "fake tensors: each unit's parameters in one flat parameter, its gradient a flat gradient (torch's "
                "tracker counts FSDP1's sharded gradients as temporaries: 'other'). On a GPU FSDP1 also frees some "
                "buffers only when another CUDA stream is done with them, which a trace does not see."]
    if setting.strategy == "replicate":
        return ["replicate is FSDP2's replicate(): every rank keeps the fp32 parameters, gradients and optimizer "
                "state, plus each unit's unsharded copy while it computes."]
    if setting.strategy == "hybrid_shard":
        return [f"hybrid_shard: parameters sharded over {setting.shards} ranks (one node), replicated over "
                f"{setting.world_size // setting.shards} such groups; FSDP2 pads each parameter's dim 0 to a multiple "
                f"of {setting.shards}."]
    return ["FSDP2 pads each parameter's dim 0 to a multiple of the world size: resident shards include it."]


def _fake_steps(setting: TrainSetting, config, say, state_only_first: bool, label_allocations: bool = False,
                points=None) -> list:
    """`_trace_steps` of `setting`'s model, or, for a deep stack of identical blocks, of a twin with a few of
    them whose middle block is repeated (fsdplab.memory.block_repeat). Returns one (run, seconds, (blocks traced,
    blocks) or None) per point."""
    from . import block_repeat

    twin = None if label_allocations else block_repeat.shallow_twin(setting, config)
    if twin is not None:
        depth = config.num_hidden_layers
        try:
            runs = _trace_steps(setting, twin, say, state_only_first, points=points, repeat_to=depth)
            return [(run, seconds, (twin.num_hidden_layers, depth)) for run, seconds in runs]
        except block_repeat.NotRepeatable as e:
            say(f"the blocks do not repeat exactly ({e}): tracing all {depth} of them")
    return [(run, seconds, None) for run, seconds in
            _trace_steps(setting, config, say, state_only_first, label_allocations, points)]


def _trace_steps(setting: TrainSetting, config, say, state_only_first: bool, label_allocations: bool = False,
                 points=None, repeat_to=None) -> list:
    """Build `setting`'s model on fake tensors in a fake process group, shard it, and `_run_steps` it for each
    of `points` (settings that differ from it in seq_len and batch_size only; default: itself): one build for
    them all. Returns one run per point, each with the seconds it took (the build counted in the first)."""
    import torch

    from .._torch_private import eager_attention_masks, fake_process_group, fake_tensor_mode, fsdp1_on_fake_tensors
    from .local_shards import step_local_shards
    from ..sharding import apply_data_parallel, build_model, data_parallel_mesh, make_optimizer

    t0 = time.perf_counter()
    with fake_process_group(setting.world_size), warnings.catch_warnings():
        mesh = data_parallel_mesh(setting)
        # peft and .to(dtype) fail inside FakeTensorMode: the model is built on the meta device, sharded there
        # (FSDP2's meta-device init, half the time of sharding fake tensors) and materialised as fake tensors
        # by to_empty, after which FSDP2 re-pads the shards, as it does for real runs built on meta.
        custom = custom_of(config)
        with explained(setting):         # the errors fsdplab.memory.checks says what to do about
            net = build_model(setting.replace(model=config), device="meta", dtype=setting.base_dtype)
        say("model built on the meta device" + (f" ({config.num_hidden_layers} of {repeat_to} blocks)"
                                                 if repeat_to else ""))
        units = custom_model.blocks(custom, net) if custom else None
        fsdp1 = setting.strategy in FSDP1_STRATEGIES
        if setting.strategy != "ddp" and not fsdp1:   # DDP's Reducer cannot run on fake tensors: memory.ddp
            apply_data_parallel(net, setting, mesh, units)
        with fake_tensor_mode(), eager_attention_masks(), fsdp1_on_fake_tensors():
            net.to_empty(device="cpu")
            if fsdp1:                  # FSDP1 flattens the parameters it wraps: real (here fake) tensors
                net = apply_data_parallel(net, setting, mesh, units)   # the same modules: to_empty keeps them
            if setting.base_dtype == "nf4":
                from ..nf4 import place_constants

                place_constants(net, "cpu")
                # torchao's NF4 all-gather hook compares data pointers, which fake tensors warn about (the
                # estimate never reads them; the warning is not the learner's)
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            opt = make_optimizer(net, setting.optimizer)
            step_local_shards(opt)
            say("sharded; running two training steps")
            runs = []
            for point in points or [setting]:
                if custom is not None:
                    batch = custom_model.batch(custom, point)
                else:
                    tokens = torch.randint(0, config.vocab_size, (point.batch_size, point.seq_len))
                    batch = {"input_ids": tokens, "labels": tokens}
                run = _run_steps(net, opt, batch, 2, loss_fn=_loss_fn(point, "cpu"), progress=say,
                                 offload=point.cpu_offload, state_only_first=state_only_first,
                                 label_allocations=label_allocations, repeat_to=repeat_to,
                                 accumulate=point.grad_accum, no_sync=point.no_sync)
                if point.strategy == "ddp":
                    run = ddp.with_buckets(run, ddp.bucket_sizes(net, repeat_to))
                runs.append((run, time.perf_counter() - t0))
                t0 = time.perf_counter()
            return runs


def _loss_fn(setting: TrainSetting, device_type: str):
    """The loss function of `setting`'s step (a custom model's own); DDP computes in 16 bits under autocast."""
    from ..sharding import loss_for

    custom = custom_of(setting.model)
    loss = custom.loss if custom is not None else loss_for(setting)
    if setting.strategy == "ddp":
        return ddp.autocast_loss(loss, setting.precision, device_type)
    return loss
