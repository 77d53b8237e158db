"""Lesson 14 (build it yourself, part 1) only: reference solutions (a ring all-reduce, a bucketed DDP, ZeRO-1), a
log of what each rank sends (`Wire`: point-to-point sends too, which CommCounter does not count), the checkers
that run the learner's code, named in the ranks' namespace, next to torch's implementation in the same call, and
section 2's figure (`plot_overlap`)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._torch_private import ddp_first_bucket_bytes, torch_dispatch_mode  # noqa: F401 (the notebook reads the first)
from ..models import TinyConfig, random_batch
from ..network import mean_sent_bytes, ring_sent_bytes
from ..ranks import defined, device
from ..sharding import build_tiny, loss_of
from .checkers import exercise, first_line, is_stub, run_on_ranks

DATA_SEED, MODEL_SEED = 100, 0     # the checkers' seeds: rank r's tensor or batch (DATA_SEED + r...), the weights
LR, STEPS = 1e-2, 3                # AdamW steps the checkers compare; lr large enough that a wrong update shows
TOLERANCE = 1e-5                   # relative, fp32: a ring sums in another order than gloo's all-reduce
PARAM_TOLERANCE = 1e-3             # after AdamW steps: rounding in a near-zero gradient moves its update by up to lr


class Wire(torch_dispatch_mode()):
    """Log every c10d op launched inside the block, in order: `events` holds ("send", bytes), ("all_reduce", bytes),
    ("broadcast", bytes), ...; `mark(...)` adds events of your own to the same list."""

    def __init__(self):
        super().__init__()
        self.events: list = []
        self.mark = lambda *event: self.events.append(event)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", "") == "c10d":
            name = func.overloadpacket.__name__.rstrip("_").replace("allreduce", "all_reduce")
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            self.events.append((name, sum(t.numel() * t.element_size() for t in tensors)))
        return out


def _resolve(answer):
    """On a rank: `answer`, or the object of that name in the rank's namespace (IPython's, or a script's)."""
    return defined(answer) if isinstance(answer, str) else answer


def _learners(answer, stub_of, stub: str, run) -> dict:
    """On a rank: `run(the learner's object)`, or this rank's error, or `stub` while `stub_of(object)` is `...`."""
    try:
        obj = _resolve(answer)
        return {"rank": dist.get_rank(), "stub": stub} if is_stub(stub_of(obj)) else run(obj)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return {"error": first_line(err), "rank": dist.get_rank()}


def _sq(tensors) -> float:                   # the squared L2 norm of a list of tensors
    return sum(float(t.double().pow(2).sum()) for t in tensors)


def _gap(mine, ref) -> float:                # relative L2 distance of two lists of tensors
    return math.sqrt(_sq(a - b for a, b in zip(mine, ref)) / max(_sq(ref), 1e-300))


def _run_check(cluster, what: str, fn, *args):
    """(rows, None), or (None, why the check could not run or what stopped it); restarts a broken cluster. The
    learner's errors come back as rows (a row with "error"), or a "stub" row for code not yet written."""
    rows, why = run_on_ranks(cluster, fn, *args, timeout=120, what=f"your {what}",
                             hang_hint=": does every send have its matching receive on the peer?")
    if why:
        return None, why
    error = next((x for x in rows if "error" in x), None)
    if error:
        return None, f"your {what} raised on rank {error['rank']}: {error['error']}"
    return (None, rows[0]["stub"]) if "stub" in rows[0] else (rows, None)


def _verdict(checks, ok_message: str) -> tuple:
    """(False, the message of the first check that failed) or (True, `ok_message`); checks: (failed, message)."""
    return next(((False, message) for failed, message in checks if failed), (True, ok_message))


def reference_ring(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place: N-1 reduce-scatter steps, then N-1 all-gather steps, one chunk each."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(n))
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            shift = step if phase == "reduce-scatter" else step - 1
            send, recv = chunks[(r - shift) % n], chunks[(r - shift - 1) % n]
            buffer = torch.empty_like(recv)
            for request in (dist.isend(send, (r + 1) % n), dist.irecv(buffer, (r - 1) % n)):
                request.wait()
            recv.add_(buffer) if phase == "reduce-scatter" else recv.copy_(buffer)
    return tensor


def measure_ring(fn) -> dict:
    """On a rank: `fn` and `reference_ring` on this rank's tensor, next to `dist.all_reduce`: bytes, wrong chunks."""
    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(1024 * n, generator=torch.Generator().manual_seed(DATA_SEED + r)).to(device())
    expected, mine, ref, wire = x.clone(), x.clone(), x.clone(), Wire()
    dist.all_reduce(expected)
    with wire:
        failed = _learners(fn, lambda f: f, "no ring yet: the function's body is still `...`.", lambda f: f(mine))
    if isinstance(failed, dict) and ("error" in failed or "stub" in failed):
        return failed
    with Wire() as ref_wire:
        reference_ring(ref)
    scale = max(float(expected.abs().max()), 1e-30)
    sends, ref_sends = ([e[1] for e in w.events if e[0] == "send"] for w in (wire, ref_wire))
    return {"rank": r, "n": n, "bytes": x.numel() * x.element_size(), "sent": sum(sends),
            "largest": max(sends, default=0), "ref_sent": sum(ref_sends), "ref_largest": max(ref_sends, default=0),
            "collectives": sorted({e[0] for e in wire.events if e[0] not in ("send", "recv")}),
            "bad_chunks": [i for i, (a, b) in enumerate(zip(mine.tensor_split(n), expected.tensor_split(n)))
                           if float((a - b).abs().max()) > TOLERANCE * scale],
            "mean": bool(torch.allclose(mine, expected / n, rtol=TOLERANCE, atol=1e-6))}


@exercise("14-ring-fraction")
def _ring_fraction(answer, *, cluster):
    """`answer(N)` against the reference ring's measured fraction at the cluster's N, the ring model at 1..8."""
    if not callable(answer):
        return False, "expected a function of N, like `lambda N: ...`, that returns a fraction."
    rows, why = _run_check(cluster, "ring", measure_ring, reference_ring)
    if why:
        return False, why
    live = rows[0]
    wanted = {n: ring_sent_bytes("all_reduce", 1.0, n) for n in range(1, 9)}
    wanted[live["n"]] = live["ref_sent"] / live["bytes"]
    for n, value in sorted(wanted.items()):
        try:
            got = float(answer(n))
        except Exception as err:  # noqa: BLE001
            return False, f"your function raised at N={n}: {first_line(err)}"
        if not abs(got - value) <= 1e-9 + 1e-6 * abs(value):
            return False, (f"at N={n} your function gives {got:g}, the fraction "
                           f"{'measured on these ranks' if n == live['n'] else 'of the lab ring model'} is {value:g}.")
    return True, (f"matches the reference ring's measured {live['ref_sent']:,} B sent for a {live['bytes']:,} B "
                  f"tensor at N={live['n']} and the ring model at N = 1..8.")


@exercise("14-ring")
def _ring(answer, *, cluster):
    """The learner's ring (a function, or its name on the ranks) against dist.all_reduce and the reference ring."""
    if not (callable(answer) or isinstance(answer, str)):
        return False, "expected your function ring_all_reduce (or its name as a string)."
    rows, why = _run_check(cluster, "ring", measure_ring, answer)
    if why:
        return False, why
    n, first = rows[0]["n"], rows[0]
    used = sorted({c for m in rows for c in m["collectives"]})
    bad = next((m for m in rows if m["bad_chunks"]), first)
    off = next((m for m in rows if m["largest"] > m["ref_largest"] or m["sent"] != m["ref_sent"]), None)
    shown = off or first
    return _verdict([
        (used, f"your ring launched collectives ({', '.join(used)}): build it from point-to-point sends only."),
        (n > 1 and all(m["mean"] for m in rows),
         f"every rank holds the sum divided by {n}: an all-reduce here sums, it does not average."),
        (bad["bad_chunks"], f"wrong sum on rank {bad['rank']} in " + ("every chunk" if len(bad["bad_chunks"]) == n else
         f"chunk(s) {bad['bad_chunks']} of {n} (the others are right)") + ": does every chunk pass through both "
         "phases, with every step?"),
        (off, f"the right sum on every rank, but rank {shown['rank']} sent {shown['sent']:,} B of a "
         f"{shown['bytes']:,} B tensor, {shown['largest']:,} B in one message, where the reference ring sends "
         f"{shown['ref_sent']:,} B, at most {shown['ref_largest']:,} B at a time: pass one chunk at a time around "
         "the ring.")],
        "at 1 rank the all-reduce is the identity: your ring left the tensor as it was and sent nothing. Run with 2 "
        "or more ranks to check the ring itself." if n == 1 else f"the sum of dist.all_reduce on all {n} ranks, every "
        f"chunk, and {first['sent']:,} B sent per rank of a {first['bytes']:,} B tensor, as the reference ring.")


class ReferenceDDP(nn.Module):
    """DDP from scratch: rank 0's parameters at start; each ready gradient joins a bucket, and a bucket of at least
    `bucket_bytes` is all-reduced asynchronously during backward; `finish()` launches the rest, waits, averages."""

    def __init__(self, module: nn.Module, bucket_bytes: int):
        super().__init__()
        self.module, self.bucket_bytes, self.sync = module, bucket_bytes, True
        self.bucket, self.launched = [], []
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
            p.register_post_accumulate_grad_hook(self._ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _ready(self, param):
        self.bucket += [param] if self.sync else []
        if self.bucket and sum(p.grad.numel() * p.grad.element_size() for p in self.bucket) >= self.bucket_bytes:
            self._launch()

    def _launch(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        self.launched.append((self.bucket, flat, dist.all_reduce(flat, async_op=True)))
        self.bucket = []

    def finish(self):
        self._launch() if self.bucket else None
        for params, flat, handle in self.launched:
            handle.wait()
            flat /= dist.get_world_size()
            for p, g in zip(params, flat.split([p.grad.numel() for p in params])):
                p.grad.copy_(g.view_as(p.grad))
        self.launched = []

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


def torch_ddp(module: nn.Module, bucket_bytes: int):
    """torch's DistributedDataParallel, with a `finish()` that does nothing (DDP waits at the end of backward)."""
    ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_bytes / 2**20)
    ddp.finish = lambda: None
    return ddp


def expected_buckets(sizes: list, bucket_bytes: int) -> int:
    """All-reduces for gradients of `sizes` bytes in ready order: each bucket of >= `bucket_bytes`, and the rest."""
    count, held = 0, 0
    for size in sizes:
        held += size
        if held >= bucket_bytes:
            count, held = count + 1, 0
    return count + (held > 0)


def traced_backward(ddp, model: nn.Module, batch, wire: Wire, finish: bool = True) -> list:
    """Backward of `ddp`'s loss, a "ready" event in `wire` as each gradient is computed (a tensor hook, before the
    wrapper's post-accumulate hook), then `ddp.finish()`. Returns the gradients' sizes in that order."""
    sizes = []                                # a hook that returns None leaves the gradient as it is
    hooks = [p.register_hook(lambda grad, p=p: sizes.append(p.numel() * p.element_size()) or wire.mark("ready"))
             for p in model.parameters()]
    loss_of(ddp, batch).backward()
    ddp.finish() if finish else None
    for hook in hooks:
        hook.remove()
    return sizes


def overlap(events: list) -> dict:
    """When one traced backward launched its all-reduces: gradients computed by the first, launches before the last."""
    ready = [i for i, e in enumerate(events) if e[0] == "ready"]
    launches = [i for i, e in enumerate(events) if e[0] == "all_reduce"]
    return {"gradients": len(ready), "launches": len(launches),
            "before_last_ready": sum(i < (ready or [-1])[-1] for i in launches),
            "ready_at_first": sum(r < launches[0] for r in ready) if launches else None}


def plot_overlap(events: list, sizes: list, bucket_bytes: int):
    """Section 2's figure: gradient bytes ready during one traced backward, and where each bucket launched."""
    import matplotlib.pyplot as plt

    ready_bytes, launched_at, total = [], [], 0
    for e in events:
        if e[0] == "ready":
            total += sizes[len(ready_bytes)]
            ready_bytes.append(total / 1024)
        elif e[0] == "all_reduce":
            launched_at.append((len(ready_bytes), total / 1024))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(range(1, len(ready_bytes) + 1), ready_bytes, "C0o-", ms=3, drawstyle="steps-post",
            label="gradient bytes ready")
    if launched_at:   # none where no gradient was ready, or all-reduces were left to after backward
        ax.plot(*zip(*launched_at), "C3v", ms=9, label="bucket all-reduce launched")
    ax.axvline(len(ready_bytes), color="0.5", ls=":", label="last gradient ready (backward ends)")
    ax.set(title=f"Reference DDP, rank 0: buckets of {bucket_bytes / 1024:g} KiB launched during backward",
           xlabel="gradients ready so far (count)", ylabel="gradient bytes ready (KiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


WIRE_KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def wire_sent(records: list) -> dict:
    """Section 4's counts from `CommCounter.records`: per kind of WIRE_KINDS, how many collectives and the bytes
    a rank sends for them, averaged over the ranks (`fsdplab.network.mean_sent_bytes`: the ring model, and a
    broadcast along a pipelined chain at (N-1)/N of its tensor, since the last rank of the chain forwards
    nothing)."""
    return {kind: {"count": sum(r["kind"] == kind for r in records),
                   "sent": sum(mean_sent_bytes(kind, r["tensor_bytes"], r["group_size"])
                               for r in records if r["kind"] == kind)}
            for kind in WIRE_KINDS}


def wire_table(sent: dict, param_bytes: int, world_size: int) -> str:
    """Section 4's table: per way and kind, the collectives rank 0 launched in one step and the bytes a rank sends
    for them (`wire_sent`), and the whole step's bytes in units of P."""
    head = "".join(f"{kind.replace('_', '-'):>22}" for kind in WIRE_KINDS)
    lines = [f"P = {param_bytes:,} B of fp32 parameters, {world_size} rank(s). Per kind: the collectives of one "
             "step, and the bytes a rank sends",
             "for them (ring model; a broadcast at the chain's average, (N-1)/N of its tensor per rank)",
             f"{'one step':26}{head}{'total / P':>11}"]
    for name in sorted(sent, key=lambda n: n.startswith("FSDP")):    # FSDP last, as the cell lists it
        row = sent[name]
        cells = "".join(f"{row[k]['count']:>5} {'op, ' if row[k]['count'] == 1 else 'ops,'} {row[k]['sent']:>9,.0f} B"
                        for k in WIRE_KINDS)
        total = sum(row[k]["sent"] for k in WIRE_KINDS)
        lines.append(f"{name:26}{cells}{total / param_bytes:>11.2f}")
    return "\n".join(lines)


def ddp_config(dim: int = 32, num_layers: int = 2):
    """The tiny transformer of sections 2-4 (the checkers use the defaults)."""
    return TinyConfig(dim=dim, num_layers=num_layers, num_heads=2, seq_len=16)


def _batch(cfg, step: int):
    return random_batch(cfg, batch_size=2, seed=DATA_SEED + 10 * dist.get_rank() + step, device=device())


def _ddp_run(make, cfg) -> dict:
    """`make(model)` through a traced step, STEPS AdamW steps, then a micro-batch in no_sync() and a synced one."""
    model = build_tiny(cfg, seed=MODEL_SEED + dist.get_rank(), device=device())   # each rank its own weights
    ddp = make(model)
    grads = lambda: [p.grad.detach().clone() for p in model.parameters()]    # noqa: E731
    out = {"start": [p.detach().clone() for p in model.parameters()]}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with Wire() as first:
        out["sizes"] = traced_backward(ddp, model, _batch(cfg, 0), first)
    out["grads"] = grads()
    for step in range(STEPS):
        if step:
            traced_backward(ddp, model, _batch(cfg, step), Wire())         # a Wire not entered: marks only
        opt.step()
        for p in model.parameters():
            p.grad = None
    out["params"] = [p.detach().clone() for p in model.parameters()]
    with Wire() as quiet, ddp.no_sync():
        traced_backward(ddp, model, _batch(cfg, 10), quiet, finish=False)
    traced_backward(ddp, model, _batch(cfg, 11), Wire())
    return {**out, "events": first.events, "accumulated": grads(), "no_sync_reduces": overlap(quiet.events)["launches"]}


def compare_ddp(answer, bucket_bytes: int) -> dict:
    """On a rank: the learner's DDP class and torch's DistributedDataParallel on the same model and batches."""
    cfg, r = ddp_config(), dist.get_rank()
    mine = _learners(answer, lambda c: getattr(c, "finish", None), "no DDP yet: finish() is still `...`.",
                     lambda cls: _ddp_run(lambda m: cls(m, bucket_bytes), cfg))
    if "rank" in mine:
        return mine
    ref = _ddp_run(lambda m: torch_ddp(m, bucket_bytes), cfg)
    gaps = {f"{key}_gap": _gap(mine[key], ref[key]) for key in ("start", "grads", "params", "accumulated")}
    gaps["grad_ratio"] = math.sqrt(_sq(mine["grads"]) / _sq(ref["grads"]))
    return {**gaps, "rank": r, "n": dist.get_world_size(), "overlap": overlap(mine["events"]),
            "expected": expected_buckets(mine["sizes"], bucket_bytes),
            "torch_launches": overlap(ref["events"])["launches"], "no_sync_reduces": mine["no_sync_reduces"]}


@exercise("14-ddp")
def _ddp(answer, *, cluster, bucket_bytes: int = 16384):
    """The learner's DDP against torch's: start, gradients, buckets and overlap, parameters, then no_sync."""
    rows, why = _run_check(cluster, "DDP", compare_ddp, answer, bucket_bytes)
    if why:
        return False, why
    n, first, o = rows[0]["n"], rows[0], rows[0]["overlap"]
    start, grad, param, acc = (max(rows, key=lambda x: x[f"{k}_gap"])                # the worst rank of each
                               for k in ("start", "grads", "params", "accumulated"))
    chatty = next((x for x in rows if x["no_sync_reduces"]), first)
    return _verdict([
        (start["start_gap"] > TOLERANCE, f"rank {start['rank']}'s parameters differ from rank 0's right after "
         "wrapping (each rank built its model from its own seed): every rank must start from rank 0's weights."),
        (grad["grads_gap"] > TOLERANCE and n > 1 and abs(grad["grad_ratio"] - n) < 0.01 * n,
         f"rank {grad['rank']}'s gradients are {grad['grad_ratio']:.2f}x torch DDP's: DDP averages over the {n} "
         "ranks."),
        (grad["grads_gap"] > TOLERANCE, f"rank {grad['rank']}'s gradients differ from torch DDP's by "
         f"{grad['grads_gap']:.1e} (relative) after one backward and finish()."),
        (o["launches"] != first["expected"], f"the right gradients, but {o['launches']} all-reduces for "
         f"{o['gradients']} gradients; buckets of at least {bucket_bytes:,} B, filled in the order the gradients are "
         f"ready, make {first['expected']}."),
        (first["expected"] > 1 and o["before_last_ready"] == 0, f"the right gradients and {o['launches']} buckets, "
         "but every all-reduce was launched after the last gradient was ready: no communication overlapped "
         "backward. Launch a bucket from the gradient hook as soon as it is full."),
        (param["params_gap"] > PARAM_TOLERANCE, f"rank {param['rank']}'s parameters differ from torch DDP's by "
         f"{param['params_gap']:.1e} (relative) after {STEPS} AdamW steps."),
        (chatty["no_sync_reduces"], f"inside no_sync() your DDP still launched {chatty['no_sync_reduces']} "
         f"all-reduce(s) on rank {chatty['rank']}: a no_sync backward keeps its gradients local."),
        (acc["accumulated_gap"] > TOLERANCE, f"after a no_sync() backward and a synced one, rank {acc['rank']}'s "
         f"gradients differ from torch DDP's by {acc['accumulated_gap']:.1e} (relative): the no_sync micro-batch's "
         "gradient must stay in .grad until the synced backward reduces it with the next one's.")],
        f"gradients, {STEPS}-step parameters and no_sync accumulation match torch DDP on every rank; "
        f"{o['launches']} bucket all-reduces (the rule's {first['expected']}), the first launched by the time "
        f"gradient {o['ready_at_first']} of {o['gradients']} was ready; torch DDP launched {first['torch_launches']} "
        "at its first step." + (" (1 rank: a sum is the mean and every rank starts as rank 0.)" if n == 1 else ""))


class ReferenceZeRO1:
    """ZeRO-1: a rank keeps optimizer state for its own parameters (greedy by size); `step()` averages the
    gradients, steps this rank's parameters, then sends each parameter from its owner to every rank."""

    def __init__(self, params, optimizer_class, **kwargs):
        self.params = list(params)
        self.owner, load = [0] * len(self.params), [0] * dist.get_world_size()
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):   # largest first
            self.owner[i] = load.index(min(load))                    # to the rank that holds the least
            load[self.owner[i]] += self.params[i].numel()
        mine = [p for p, owner in zip(self.params, self.owner) if owner == dist.get_rank()]
        self.inner = optimizer_class(mine, **kwargs) if mine else None

    def step(self):
        for p in self.params:                   # the mean gradient: there is no DDP around this model
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        if self.inner is not None:
            self.inner.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)


def state_bytes(optimizer) -> int:
    """Bytes of the tensors in an optimizer's state (AdamW: two moments and a step per parameter)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def inner_optimizers(obj) -> list:
    """The torch optimizers an object holds in its attributes."""
    return [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, torch.optim.Optimizer)]


def train_steps(make_opt, cfg, wrap=None, steps: int = STEPS) -> tuple:
    """`steps` steps of the tiny model (`wrap`ped when given): (optimizer, parameters after, how many never changed)."""
    model = build_tiny(cfg, seed=MODEL_SEED, device=device())
    start = [p.detach().clone() for p in model.parameters()]
    runner, opt = wrap(model) if wrap else model, make_opt(list(model.parameters()))
    for step in range(steps):
        loss_of(runner, _batch(cfg, step)).backward()
        getattr(runner, "finish", lambda: None)()
        opt.step()
        for p in model.parameters():
            p.grad = None
    params = [p.detach().clone() for p in model.parameters()]
    return opt, params, sum(bool(torch.equal(a, b)) for a, b in zip(start, params))


def compare_zero1(answer) -> dict:
    """On a rank: the learner's ZeRO-1, torch's ZeroRedundancyOptimizer and AdamW (under DDP): parameters, state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer     # here: importing it scripts optimizers, noisily

    cfg, r = ddp_config(), dist.get_rank()
    mine = _learners(answer, lambda c: getattr(c, "step", None), "no ZeRO-1 yet: step() is still `...`.",
                     lambda cls: train_steps(lambda ps: cls(ps, torch.optim.AdamW, lr=LR), cfg))
    if isinstance(mine, dict):
        return mine
    (_, params, unchanged), held = mine, sum(state_bytes(o) for o in inner_optimizers(mine[0]))
    ddp = lambda m: torch_ddp(m, 2**20)        # noqa: E731 - torch's own gradient averaging
    zero, zero_params, zero_unchanged = train_steps(
        lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=LR), cfg, ddp)
    plain = state_bytes(train_steps(lambda ps: torch.optim.AdamW(ps, lr=LR), cfg, ddp)[0])
    return {"rank": r, "gap": _gap(params, zero_params), "unchanged": unchanged, "ref_unchanged": zero_unchanged,
            "bytes": held, "zero_bytes": state_bytes(zero.optim), "plain_bytes": plain, "params": len(params)}


@exercise("14-zero1")
def _zero1(answer, *, cluster):
    """The learner's ZeRO-1 against ZeroRedundancyOptimizer and AdamW: parameters after STEPS steps, state bytes."""
    rows, why = _run_check(cluster, "optimizer", compare_zero1, answer)
    if why:
        return False, why
    worst, plain, per_rank = max(rows, key=lambda x: x["gap"]), rows[0]["plain_bytes"], [x["bytes"] for x in rows]
    return _verdict([
        (worst["gap"] > PARAM_TOLERANCE and worst["unchanged"] > worst["ref_unchanged"], f"on rank {worst['rank']} "
         f"{worst['unchanged']} of {worst['params']} parameters never changed: after its step, each owner must send "
         "its parameters to the other ranks."),
        (worst["gap"] > PARAM_TOLERANCE, f"rank {worst['rank']}'s parameters differ from ZeroRedundancyOptimizer's "
         f"by {worst['gap']:.1e} (relative) after {STEPS} steps: does each owner step with the gradient averaged "
         "over all ranks?"),
        (sum(per_rank) != plain, f"the right parameters, but the optimizers in your object's attributes hold "
         f"{per_rank} B of state per rank, {sum(per_rank) / plain:.2f}x plain AdamW's {plain:,} B in all: each "
         "parameter's state belongs on one rank, in this rank's inner optimizer.")],
        f"parameters match ZeroRedundancyOptimizer's after {STEPS} steps on every rank, and the state {per_rank} B "
        f"per rank adds up to plain AdamW's {plain:,} B (torch's ZeRO: {[x['zero_bytes'] for x in rows]} B)."
        + (" (1 rank: it owns every parameter; run with 2 or more ranks to check the partition.)" if len(rows) == 1
           else ""))
