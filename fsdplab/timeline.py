"""One training step, as every rank lived it: torch.profiler on each rank, one figure in the kernel.

On a rank, `trace_step(step_fn, modules)` runs the step under `torch.profiler` and returns plain data:
labelled compute intervals ("fwd layers.0", "bwd layers.0", "optimizer") on the compute row and the
collectives as the backend executed them on the communication row. `draw_timeline(traces)` draws them,
one row per rank and stream, on a shared clock.

What the rows mean, by backend:
  * gloo (CPU ranks): compute is the rank's main thread; gloo runs each collective on its own worker
    threads ("gloo:all_gather", "gloo:all_reduce" events), so an asynchronous all-gather really can run
    while the main thread computes. Both rows are measured: nothing here invents overlap. Note gloo runs a
    reduce-scatter as a full all-reduce, so it shows as "gloo:all_reduce".
  * nccl (GPUs): compute is the layer ranges on the GPU timeline, communication the NCCL kernels on
    their own streams: real GPU overlap. (This path is written for GPUs but was checked only on CPU ranks;
    FSDP runs all-gathers and reduce-scatters on different streams, so pairing NCCL kernels with the
    collectives that launched them by order can swap labels where the two overlap.)
Layer labels come from `record_function` ranges opened by hooks on the modules you name: forward from
the module's forward pre/post hooks, backward from gradient hooks on its output (start) and input (end).
Each collective is labelled by the FSDP unit whose range launched it ("FSDP::all_gather (layers.1)").

`simulate_step(...)` (pure Python, microseconds to run) is the same picture for a model you don't have:
per-layer compute, per-layer bytes, a link preset and a prefetch depth give the step time, the exposed
communication, and intervals that `draw_timeline` draws the same way.
"""

from __future__ import annotations

import contextlib
import os
import re

from ._torch_private import profiler_trace_start_ns
from .comms import C10D_OPS
from .network import collective_time, get_link
from .ranks import this_rank

_FSDP_LABEL = re.compile(r"^FSDP::(all_gather|post_backward_reduce)(?: \((.*)\))?$")
_COMM_NAME = re.compile(r"^(gloo|nccl|mpi|ucc):(\w+)|nccl(?:Dev)?Kernel_(\w+)", re.IGNORECASE)


# --- on a rank ----------------------------------------------------------------------------------------

def _label_hooks(modules: dict) -> list:
    """record_function ranges around each named module's forward and backward; returns hook handles."""
    import torch
    from torch.autograd.profiler import record_function

    handles = []
    for name, module in modules.items():
        state = {}

        def pre(mod, args, name=name, state=state):
            state["fwd"] = record_function(f"fwd {name}")
            state["fwd"].__enter__()
            # backward of this module ends when the gradient of its input is computed
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if x is not None:
                def end_bwd(grad, state=state):
                    if "bwd" in state:
                        state.pop("bwd").__exit__(None, None, None)
                handles.append(x.register_hook(end_bwd))

        def post(mod, args, out, name=name, state=state):
            state.pop("fwd").__exit__(None, None, None)
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                def start_bwd(grad, name=name, state=state):
                    state["bwd"] = record_function(f"bwd {name}")
                    state["bwd"].__enter__()
                handles.append(y.register_hook(start_bwd))

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto's C++ start/stop lines on every rank); Python errors still raise."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def trace_step(step_fn, modules: dict | None = None, warmup: int = 1) -> dict:
    """Run `step_fn()` `warmup` times untraced, then once under torch.profiler; return plain data.

    `modules`: {label: module} to mark on the compute row (e.g. {f"layers.{i}": block}). Call this on every
    rank (inside `cluster.run`); pass the list of results to `draw_timeline`."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step_fn()
    activities = [ProfilerActivity.CPU]
    on_gpu = torch.cuda.is_available() and dist.is_initialized() and "nccl" in dist.get_backend()  # cpu:gloo,cuda:nccl
    if on_gpu:
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    handles = _label_hooks(modules or {})
    try:
        with _quiet_stderr(), profile(activities=activities) as prof:
            step_fn()
            if on_gpu:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    start_ns = profiler_trace_start_ns(prof)
    return {"rank": this_rank(), "device": "cuda" if on_gpu else "cpu",
            "start_ns": int(start_ns), "events": _classify(prof.events(), on_gpu)}


def _classify(events, on_gpu: bool) -> list:
    """Keep what the figure needs: layer ranges and optimizer (compute), collectives (communication)."""
    main_thread = None
    raw = []
    for e in events:
        is_device = "cuda" in str(e.device_type).lower()
        start, end = e.time_range.start, e.time_range.end
        raw.append((e.name, e.thread, is_device, start, end))
        if e.name.startswith(("fwd ", "bwd ")) and not is_device:
            main_thread = e.thread
    fsdp = [(m.group(1), m.group(2), s, t) for n, th, dev, s, t in raw if not dev
            for m in [_FSDP_LABEL.match(n)] if m]
    launches = sorted((s, n) for n, th, dev, s, t in raw if not dev and n.startswith("c10d::"))
    # On GPUs the layer ranges also appear on the device timeline (user annotations); if this torch
    # build does not record them there, fall back to the host-side ranges (launch times, not GPU times).
    device_layers = on_gpu and any(dev and n.startswith(("fwd ", "bwd ")) for n, th, dev, s, t in raw)
    out = []
    comm = []
    for name, thread, is_device, start, end in raw:
        if name.startswith(("fwd ", "bwd ")) and (is_device == device_layers):
            out.append({"row": "compute", "label": name, "start_us": start, "end_us": end})
        elif name.startswith("Optimizer.step") and not is_device:
            out.append({"row": "compute", "label": "optimizer", "start_us": start, "end_us": end})
        else:
            m = _COMM_NAME.search(name)
            if m and (is_device if on_gpu else (thread != main_thread)):
                kind = (m.group(2) or m.group(3) or "").lower()
                comm.append({"row": "comm", "label": kind, "kind": kind, "start_us": start, "end_us": end})
    # Label each executed collective with the FSDP unit that launched it: the n-th collective executed is the
    # n-th c10d op launched (backends run a group's work in launch order).
    comm.sort(key=lambda c: c["start_us"])
    for c, (launched_at, op) in zip(comm, launches):
        # the innermost FSDP range around the launch point (a prefetch sits inside another unit's hook)
        around = [(s, u) for k, u, s, t in fsdp if s <= launched_at <= t]
        unit = (max(around)[1] or "root") if around else None
        c["launched_us"] = launched_at
        launched_kind = C10D_OPS.get(op.split("::", 1)[-1], (c["kind"],))[0]
        c["backend_op"], c["kind"], c["label"] = c["kind"], launched_kind, launched_kind
        if unit:
            c["unit"] = unit
            c["label"] = f"{c['kind']} {unit}"
    return out + comm


# --- overlap simulator --------------------------------------------------------------------------------

def simulate_step(num_layers: int = 8, layer_compute_s: float = 0.01, layer_bytes: float = 100e6,
                  world_size: int = 8, link="NVLink A100", prefetch: int = 1, backward_factor: float = 2.0,
                  strategy: str = "full_shard", forward_prefetch: int | None = None,
                  backward_prefetch: int | None = None) -> dict:
    """Event simulation of one FSDP step with a compute stream and one communication channel (FIFO).

    Forward: layer i computes once its all-gather is done. With `forward_prefetch=k` the all-gathers of the
    next k layers are launched when layer i starts (FSDP2's explicit prefetch; FSDP1's forward_prefetch for
    k=1); with 0 each all-gather is launched only when its layer is reached. Backward (reverse order,
    compute `backward_factor` x forward): the same with `backward_prefetch` for the backward all-gathers
    (FULL_SHARD only; k=1 is FSDP1's BACKWARD_PRE and FSDP2's default), and each layer's reduce-scatter is
    launched when its backward ends. `prefetch` sets both depths where they are not given. The step ends
    when the last reduce-scatter and the last compute are done. Returns step_s, compute_s, comm_s,
    exposed_comm_s, all_gather_s and layer_forward_s (one layer's), the depths, and the intervals."""
    forward_prefetch = prefetch if forward_prefetch is None else forward_prefetch
    backward_prefetch = prefetch if backward_prefetch is None else backward_prefetch
    if num_layers < 1 or world_size < 1 or min(prefetch, forward_prefetch, backward_prefetch) < 0:
        raise ValueError("num_layers and world_size must be >= 1 and every prefetch depth >= 0 (layers ahead).")
    if strategy not in ("full_shard", "shard_grad_op"):
        raise ValueError("strategy must be 'full_shard' or 'shard_grad_op'.")
    link = get_link(link)
    ag = collective_time("all_gather", layer_bytes, world_size, link)
    rs = collective_time("reduce_scatter", layer_bytes, world_size, link)
    intervals = []
    comm_free = 0.0

    def communicate(kind, label, launched_at, seconds):
        nonlocal comm_free
        start = max(comm_free, launched_at)
        comm_free = start + seconds
        intervals.append({"row": "comm", "label": f"{kind} {label}", "kind": kind, "start_s": start,
                          "end_s": comm_free})
        return comm_free

    def run_pass(order, seconds, phase, gather, prefetch):
        nonlocal now
        ready, launched = {}, set()
        for pos, layer in enumerate(order):
            if gather and layer not in launched:
                ready[layer] = communicate("all_gather", f"layers.{layer}", now, ag)
                launched.add(layer)
            start = max(now, ready.get(layer, now))
            if gather:
                for nxt in order[pos + 1:pos + 1 + prefetch]:
                    if nxt not in launched:
                        ready[nxt] = communicate("all_gather", f"layers.{nxt}", start, ag)
                        launched.add(nxt)
            now = start + seconds
            intervals.append({"row": "compute", "label": f"{phase} layers.{layer}", "start_s": start, "end_s": now})
            if phase == "bwd":
                communicate("reduce_scatter", f"layers.{layer}", now, rs)

    now = 0.0
    run_pass(list(range(num_layers)), layer_compute_s, "fwd", gather=True, prefetch=forward_prefetch)
    run_pass(list(range(num_layers))[::-1], layer_compute_s * backward_factor, "bwd",
             gather=(strategy == "full_shard"), prefetch=backward_prefetch)
    step = max(now, comm_free)
    compute = num_layers * layer_compute_s * (1 + backward_factor)
    comm = sum(i["end_s"] - i["start_s"] for i in intervals if i["row"] == "comm")
    return {"step_s": step, "compute_s": compute, "comm_s": comm, "exposed_comm_s": step - compute,
            "all_gather_s": ag, "reduce_scatter_s": rs, "layer_forward_s": layer_compute_s,
            "intervals": intervals, "link": link.name, "prefetch": max(forward_prefetch, backward_prefetch),
            "forward_prefetch": forward_prefetch, "backward_prefetch": backward_prefetch,
            "world_size": world_size}


# --- drawing ------------------------------------------------------------------------------------------

def _colour(label: str):
    import matplotlib.pyplot as plt

    m = re.search(r"layers\.(\d+)", label)
    cmap = plt.get_cmap("tab10")
    if m:
        return cmap(int(m.group(1)) % 10)
    return (0.55, 0.55, 0.55, 1.0)


def draw_timeline(traces, ax=None, title: str = "One training step per rank", unit: str = "ms",
                  label_min_frac: float = 0.04, fit: bool = False):
    """Draw `trace_step` results (a list, one per rank) or one `simulate_step` result.

    Rows: "rank r compute" and "rank r comm" (or "compute" / "communication" for a simulation). Bars are
    coloured by layer; forward bars solid, backward hatched, collectives outlined. Bars of at least
    `label_min_frac` of the step are named; fit=True names every bar, then keeps the names that fit inside their
    bars as the axis is now (`fit_labels`). Returns the Axes."""
    import matplotlib.pyplot as plt

    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    rows = []  # (row name, [(start_s, end_s, label, kind)])
    if isinstance(traces, dict) and "intervals" in traces:
        for row, name in (("compute", "compute"), ("comm", "communication")):
            rows.append((name, [(i["start_s"], i["end_s"], i["label"]) for i in traces["intervals"]
                                if i["row"] == row]))
    else:
        traces = list(traces)
        if not traces:
            raise ValueError("no traces: pass the list that cluster.run(trace_step ...) returned.")
        origin = min(t["start_ns"] / 1e3 + min((e["start_us"] for e in t["events"]), default=0) for t in traces)
        for t in traces:
            shift = t["start_ns"] / 1e3 - origin
            for row, name in (("compute", "compute"), ("comm", "comm")):
                rows.append((f"rank {t['rank']} {name}",
                             [((e["start_us"] + shift) / 1e6, (e["end_us"] + shift) / 1e6, e["label"])
                              for e in t["events"] if e["row"] == row]))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.2))
    span = max((b for _, bars in rows for _, b, _ in bars), default=1.0) or 1.0
    for y, (name, bars) in enumerate(rows[::-1]):
        for start, end, label in bars:
            width = max(end - start, span * 2e-4)
            comm = "comm" in name or "communication" in name
            ax.broken_barh([(start * scale, width * scale)], (y - 0.35, 0.7), facecolors=_colour(label),
                           edgecolor="black" if comm else "none", linewidth=0.6,
                           hatch="//" if label.startswith("bwd") or "reduce" in label else None,
                           alpha=0.6 if comm else 0.9)
            if fit or width / span >= label_min_frac:
                short = label.replace("all_gather", "AG").replace("reduce_scatter", "RS") \
                             .replace("all_reduce", "AR").replace("layers.", "L")
                ax.text((start + width / 2) * scale, y, short, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _ in rows[::-1]])
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, {label for _, bars in rows for _, _, label in bars})
    if fit:
        fit_labels(ax)
    return ax


def fit_labels(ax) -> None:
    """Keep a bar's name only where it fits inside the bar, on a white ground over the bar's hatching. For a
    timeline drawn with label_min_frac=0 (every name), once the figure's size and limits are final."""
    canvas = ax.figure.canvas
    if not hasattr(canvas, "get_renderer"):   # a closed figure (a dashboard's) keeps a bare canvas: measure with Agg
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(ax.figure)
    renderer = canvas.get_renderer()
    bars = [ax.transData.transform(c.get_paths()[0].get_extents().get_points()) for c in ax.collections
            if c.get_paths()]
    for text in list(ax.texts):
        box = text.get_window_extent(renderer)
        x, y = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2
        inside = [(x1 - x0) for (x0, y0), (x1, y1) in bars if x0 <= x <= x1 and y0 <= y <= y1]
        if not inside or box.width + 4 > min(inside):
            text.remove()
        else:
            text.set_bbox({"facecolor": "white", "edgecolor": "none", "pad": 0.8, "alpha": 0.85})


def _legend(ax, labels) -> None:
    """What the colours and the hatching mean: one swatch per layer drawn, the root unit, and the three looks."""
    from matplotlib.patches import Patch

    layers = sorted({int(m.group(1)) for label in labels if (m := re.search(r"layers\.(\d+)", label))})
    handles = [Patch(facecolor=_colour(f"layers.{i}"), label=f"layer {i}") for i in layers]
    if any(not re.search(r"layers\.\d+", label) for label in labels):
        handles.append(Patch(facecolor=_colour(""), label="root unit / other"))
    look = "#d9d9d9"   # the three looks on one neutral fill, so that each swatch shows its look, not a layer
    handles += [Patch(facecolor=look, edgecolor="none", label="solid: forward compute"),
                Patch(facecolor=look, edgecolor="black", hatch="//", label="hatched: backward, reduce-scatter"),
                Patch(facecolor=look, edgecolor="black", label="outlined: a collective")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
