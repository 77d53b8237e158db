"""Lesson 15 (build it yourself: your own FSDP) only: the lesson's shard layout, the plumbing around the learner's
four hooks, the reference solutions (for the tests and the lesson's later cells) and the checkers of the three
exercises, which run the learner's code on the live ranks next to torch's own `fully_shard`.

The layout: a parameter is flattened, padded with zeros at its end to a multiple of the world size N, and cut
into N equal pieces; rank r keeps piece r. (FSDP2 cuts dim 0, padded to a multiple of N: the same bytes where N
divides dim 0, as in every block of the tiny model.) Freeing is FSDP2's own trick: the module's parameter keeps its
shape and its storage is resized to 0 bytes between uses; autograd keeps that tensor for backward, so it must be
filled again before the block's backward reads it (the wiring checks that it was, rather than read freed memory).
"""

from __future__ import annotations

import math
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..comms import CommCounter, peak_live_units, summarize
from ..models import TinyConfig, blocks_of, random_batch
from ..network import GB, Link, collective_time, get_link
from ..ranks import defined, device, mesh, rank, world_size
from ..sharding import build_tiny, loss_of
from .checkers import exercise, first_line, is_stub, run_on_ranks

# The checkers' model: every dim 0 a multiple of 1, 2 and 4 (no dim-0 padding in FSDP2 at the lab's world sizes),
# 3 blocks (one not freed after forward shows as 3 at once), SGD for `STEPS`. SHAPES: 15 and 7 need padding.
CHECK_SIZES = {"dim": 32, "num_layers": 3, "seq_len": 16}
BATCH_SIZE, STEPS, LR, MODEL_SEED, BATCH_SEED = 2, 3, 0.2, 0, 100
SHAPES = [(5, 3), (7,), (4, 4)]
TOLERANCE = 1e-5            # fp32, relative to the largest gradient: FSDP2 and the learner sum in another order


# --- section 1: the reference layout --------------------------------------------------------------------------

def shard(param: torch.Tensor) -> torch.Tensor:
    """Reference: this rank's piece of `param` flattened and zero-padded to a multiple of the world size."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = param.detach().reshape(-1)
    per_rank = math.ceil(flat.numel() / n)
    padded = torch.nn.functional.pad(flat, (0, per_rank * n - flat.numel()))
    return padded[r * per_rank:(r + 1) * per_rank].clone()


def gather(local: torch.Tensor, shape) -> torch.Tensor:
    """Reference: every rank's piece, in rank order, the padding cut off, in `shape`."""
    full = torch.empty(local.numel() * dist.get_world_size(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(full, local.contiguous())
    return full[:math.prod(shape)].view(shape)


# --- section 2: the plumbing ---------------------------------------------------------------------------------

@dataclass(eq=False)
class ShardedParam:
    """One parameter of a block: `full` is the module's own parameter (its storage 0 bytes while freed),
    `local` this rank's shard (an nn.Parameter: what the optimizer steps), `shape` the full shape."""
    full: torch.nn.Parameter
    local: torch.nn.Parameter
    shape: tuple
    block: int


# Which ShardedParams hold their gathered storage, and the most blocks gathered at once (the checker reads it).
LIVE = SimpleNamespace(params=set(), peak=0)


def blocks_alive() -> int:
    return len({p.block for p in LIVE.params})


def fill(p: ShardedParam, full: torch.Tensor) -> None:
    """Give `p.full` its storage back and copy the gathered `full` into it. Through `.data`: autograd saved this
    tensor in forward, and a copy it sees would count as an in-place change of it."""
    if tuple(full.shape) != tuple(p.shape):
        raise ValueError(f"gathered a tensor of shape {tuple(full.shape)} for a parameter of shape {p.shape}")
    storage = p.full.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(p.full.numel() * p.full.element_size())
    p.full.data.copy_(full)                 # .data: a detached view, outside autograd's version count
    LIVE.params.add(p)
    LIVE.peak = max(LIVE.peak, blocks_alive())


def free(p: ShardedParam) -> None:
    """Let go of `p.full`'s gathered storage (0 bytes); its shape stays, for the next `fill`."""
    p.full.untyped_storage().resize_(0)
    LIVE.params.discard(p)


# The learner's four functions (section 2): pre_forward(params), post_forward(params) and pre_backward(params)
# take a block's list of ShardedParams, post_backward(p) one ShardedParam.
Hooks = namedtuple("Hooks", "pre_forward post_forward pre_backward post_backward")


def apply_my_fsdp(model: torch.nn.Module, blocks: list, hooks: Hooks) -> list:
    """Shard each block and attach the four hooks where FSDP2 attaches its own; returns the ShardedParams."""
    every = []
    for index, block in enumerate(blocks):
        params = [ShardedParam(full, torch.nn.Parameter(shard(full)), tuple(full.shape), index)
                  for full in block.parameters()]
        for p in params:
            free(p)                     # from here on the block holds only its shards
        before_backward = _gathering(hooks.pre_backward, "pre_backward", params, index)

        def after(module, args, out, params=params, before_backward=before_backward):
            hooks.post_forward(params)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # the gradient of the block's output arrives just before the block's own backward runs
                out.register_hook(before_backward)

        block.register_forward_pre_hook(_gathering(hooks.pre_forward, "pre_forward", params, index))
        block.register_forward_hook(after)
        for p in params:
            p.full.register_post_accumulate_grad_hook(lambda full, p=p: hooks.post_backward(p))
        every += params
    return every


def _gathering(hook, name: str, params: list, index: int):
    """`hook(params)`, then a check: a block computing with a freed parameter would read freed memory."""
    def run(*_):
        hook(params)
        missing = sum(p.full.untyped_storage().nbytes() == 0 for p in params)
        if missing:
            raise RuntimeError(f"after {name}, {missing} of block {index}'s {len(params)} parameters were not "
                               "gathered (their storage is still freed)")
    return run


# --- section 2: the reference hooks ----------------------------------------------------------------------------

def ref_pre_forward(params):
    for p in params:
        fill(p, gather(p.local.detach(), p.shape))


def ref_post_forward(params):
    for p in params:
        free(p)


def ref_post_backward(p):
    n = dist.get_world_size()
    flat = p.full.grad.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, p.local.numel() * n - flat.numel()))
    grad = torch.empty_like(p.local)
    dist.reduce_scatter_tensor(grad, padded)
    p.local.grad = grad / n
    p.full.grad = None
    free(p)


REFERENCE = Hooks(ref_pre_forward, ref_post_forward, ref_pre_forward, ref_post_backward)   # gather again


# --- on a rank: the learner's FSDP next to fully_shard ------------------------------------------------------------

def _resolve(answer):
    """A name set in a %%ranks cell, looked up in this rank's namespace; anything else as it came."""
    if isinstance(answer, str):
        return defined(answer)
    if type(answer) in (tuple, list):               # not Hooks, a named tuple of functions
        return [_resolve(a) for a in answer]
    return answer


def torch_fsdp(model, blocks) -> None:
    """torch's own FSDP2, as the notebook's reference cell writes it: each block a unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh())
    fully_shard(model, mesh=mesh())


def train(cfg, steps: int = STEPS, hooks: Hooks | None = None, lr: float = LR, reference=torch_fsdp) -> dict:
    """On a rank: `steps` SGD steps of the tiny model, sharded by the learner's `hooks` or (None) by `reference`
    (model, blocks), fully_shard on each block and the root. Counted in the first: the blocks' collectives,
    blocks gathered at once, grads."""
    LIVE.params = set()             # not what an earlier run that raised half-way left behind
    model = build_tiny(cfg, seed=MODEL_SEED, device=device())
    blocks, rest = blocks_of(model), []
    if hooks is None:
        reference(model, blocks)
        params = [q for block in blocks for q in block.parameters()]
        trained = list(model.parameters())
    else:
        params = apply_my_fsdp(model, blocks, hooks)
        ids = {id(p.full) for p in params}
        rest = [q for q in model.parameters() if id(q) not in ids]      # replicated, as in DDP
        trained = [p.local for p in params] + rest
    # the lab's count for FSDP: per step each block's (padded) bytes gathered twice and reduce-scattered once
    full_bytes = (sum(p.local.numel() * world_size() * p.local.element_size() for p in params)
                  if hooks is not None else 0)

    def local_of(q, grad=False):            # a shard in the lesson's layout, or None
        t = (q.grad if grad else q) if hooks is None else (q.local.grad if grad else q.local)
        return None if t is None else shard(t.full_tensor()) if hooks is None else t.detach().clone()

    optimizer = torch.optim.SGD(trained, lr=lr)
    out = {"losses": [], "lab": {"all_gather": 2 * full_bytes, "reduce_scatter": full_bytes}}
    for step in range(steps):
        LIVE.peak = blocks_alive()
        with CommCounter(fsdp_labels=hooks is None) as counter:
            batch = random_batch(cfg, BATCH_SIZE, seed=BATCH_SEED + 10 * step + rank(), device=device())
            loss = loss_of(model, batch)
            forward_peak = LIVE.peak
            loss.backward()
            with counter.section("rest"):                # DDP's mean for the rest: not counted
                for q in rest:
                    dist.all_reduce(q.grad)
                    q.grad /= dist.get_world_size()
        if step == 0:
            out.update(records=[r for r in counter.records if r["phase"] != "rest" and r["unit"] != "root"],
                       forward_peak=peak_live_units(counter.events, "forward") if hooks is None else forward_peak,
                       grads=[local_of(q, grad=True) for q in params])
        optimizer.step()
        for q in trained:
            q.grad = None
        out["losses"].append(loss.item())
    out["params"] = [local_of(q) for q in params]
    for p in LIVE.params.copy():
        free(p)
    return out


def _gap(mine, ref) -> tuple:
    """(largest |mine - ref| relative to the largest |ref|, |mine| / |ref|) over lists of tensors."""
    if any(m is None for m in mine) or [m.shape for m in mine] != [r.shape for r in ref]:
        return math.inf, 0.0
    a, b = torch.cat([m.flatten() for m in mine]), torch.cat([r.flatten() for r in ref])
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)), float(a.norm() / b.norm().clamp_min(1e-30))


def compare_fsdp(answer, sizes: dict | None = None, steps: int = STEPS, reference=torch_fsdp) -> dict:
    """On a rank: the learner's hooks and `reference` (fully_shard), each for `steps` SGD steps from the same
    weights on the same batches. Plain data back: gradient and parameter gaps, collectives by kind, blocks
    gathered at once."""
    hooks = _resolve(answer)
    if not isinstance(hooks, Hooks):
        raise TypeError("expected lesson.Hooks(pre_forward, post_forward, pre_backward, post_backward)")
    if all(is_stub(fn) for fn in hooks):
        return {"stub": True}
    cfg = TinyConfig(**(sizes or CHECK_SIZES))
    ref, mine = train(cfg, steps, reference=reference), train(cfg, steps, hooks)
    grad_gap, ratio = _gap(mine["grads"], ref["grads"])
    param_gap, _ = _gap(mine["params"], ref["params"])
    kinds = [{k: row for (k,), row in summarize(side["records"], by=("kind",)).items()} for side in (mine, ref)]
    return dict(rank=rank(), world_size=world_size(), grad_gap=grad_gap, ratio=ratio, param_gap=param_gap,
                mine=kinds[0], ref=kinds[1], lab=mine["lab"], forward_peak=mine["forward_peak"],
                ref_forward_peak=ref["forward_peak"], blocks=cfg.num_layers,
                missing=sum(g is None for g in mine["grads"]), losses=mine["losses"], ref_losses=ref["losses"])


def _kinds_line(kinds: dict) -> str:
    return ", ".join(f"{v['count']} {k.replace('_', '-')}s ({v['tensor_bytes']:,} B)" for k, v in sorted(kinds.items()))


def fsdp_verdict(results: list) -> tuple:
    """(ok, one line) from every rank's `compare_fsdp`: gradients, steps, collectives, then the frees."""
    if results[0].get("stub"):
        return False, "no FSDP yet: the four hooks are still `...`."
    n, first = results[0]["world_size"], results[0]
    worst = {key: max(results, key=lambda r: r[key]) for key in ("missing", "grad_gap", "param_gap", "forward_peak")}
    r = worst["missing"]
    if r["missing"]:
        return False, (f"after backward {r['missing']} shard(s) on rank {r['rank']} hold no gradient: "
                       "post_backward must leave each shard's gradient in p.local.grad.")
    r = worst["grad_gap"]
    if not r["grad_gap"] <= TOLERANCE and n > 1 and abs(r["ratio"] - n) < 0.01 * n:
        return False, (f"rank {r['rank']}'s shard gradients are {r['ratio']:.2f}x fully_shard's: the "
                       f"reduce-scatter sums over the {n} ranks, and the loss is a mean over them.")
    if not r["grad_gap"] <= TOLERANCE:
        return False, (f"rank {r['rank']}'s shard gradients differ from fully_shard's by {r['grad_gap']:.1e} "
                       f"(relative, ratio of norms {r['ratio']:.2f}): does each rank keep the piece of the summed "
                       "gradient that its own shard covers?")
    r = worst["param_gap"]
    if not r["param_gap"] <= 10 * TOLERANCE:
        return False, (f"the first step's gradients match, but after {len(r['losses'])} SGD steps rank "
                       f"{r['rank']}'s shards differ from fully_shard's by {r['param_gap']:.1e}.")
    mine, ref, lab = first["mine"], first["ref"], first["lab"]
    sent, ref_sent = (sum(v["sent_bytes"] for v in side.values()) for side in (mine, ref))
    if {k: v["tensor_bytes"] for k, v in mine.items()} != lab:
        theirs = f"fully_shard's {_kinds_line(ref)}" if ref else "fully_shard launches none at 1 rank"
        return False, (f"right gradients, but your blocks launched {_kinds_line(mine)}, where FSDP moves "
                       f"{lab['all_gather']:,} B of all-gathers and {lab['reduce_scatter']:,} B of reduce-scatters "
                       f"({theirs}; {sent:,.0f} B sent against {ref_sent:,.0f} B at N={n}): each rank needs only "
                       "its own shard's gradient.")
    # at 1 rank fully_shard gathers nothing (its log shows 0 units); a block computing needs its own: 1
    r = worst["forward_peak"]
    if r["forward_peak"] > max(r["ref_forward_peak"], 1):
        return False, (f"right gradients and bytes, but {r['forward_peak']} of {r['blocks']} blocks were gathered "
                       f"at once in forward on rank {r['rank']} (fully_shard: {r['ref_forward_peak']}): a "
                       "block's full parameters must go once its forward ends.")
    where = (f"{sent:,.0f} B sent per rank and step, as fully_shard" if n > 1 else
             "1 rank: your collectives move nothing (fully_shard launches none), their sizes are the lab's count")
    return True, (f"shard gradients match fully_shard's on every rank (worst relative gap "
                  f"{worst['grad_gap']['grad_gap']:.1e}), the shards after {len(first['losses'])} SGD steps too "
                  f"({worst['param_gap']['param_gap']:.1e}); {_kinds_line(mine)}: {where}; at most "
                  f"{worst['forward_peak']['forward_peak']} block gathered at once in forward.")


@exercise("15-my-fsdp")
def _my_fsdp(answer, *, cluster, timeout: float = 120, **sizes):
    """The learner's hooks (a lesson.Hooks on the ranks, or its name there) next to fully_shard."""
    results, error = run_on_ranks(cluster, compare_fsdp, answer, sizes or None, timeout=timeout, quiet=True)
    return (False, error) if error else fsdp_verdict(results)


# --- section 1's checker ------------------------------------------------------------------------------------------

def try_shard_gather(answer) -> dict:
    """On a rank: the learner's shard and gather on `SHAPES` (the same values on every rank)."""
    my_shard, my_gather = _resolve(answer)
    n, out = world_size(), {"rank": rank(), "world_size": world_size(), "problems": []}

    def stop(problem) -> bool:          # every rank stops together, before a collective some would skip
        out["problems"] += [problem] if problem else []
        flag = torch.tensor([1.0 if problem else 0.0], device=device())
        dist.all_reduce(flag)
        return bool(flag.item())

    def differs(got, shape, full):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(shape):
            return ("gather-shape", shape, tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__)
        return None if torch.equal(got, full) else ("gather-values", shape)

    for shape in SHAPES:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 10 + shape[0])).to(device())
        local, per_rank = my_shard(full.clone()), math.ceil(full.numel() / n)
        if stop(("shard-type", shape, type(local).__name__) if not isinstance(local, torch.Tensor) else
                ("shard-size", shape, local.numel(), per_rank) if local.numel() != per_rank else
                ("shard-piece", shape) if not torch.equal(local.reshape(-1), shard(full)) else None):
            return out
        if stop(differs(my_gather(shard(full), shape), shape, full)):     # gather on the lesson's shards first
            return out
        if stop(differs(my_gather(local, shape), shape, full) and ("round-trip", shape)):
            return out
    return out


_SHARD_SAYS = {
    "shard-type": "shard returned {0} on rank {rank}, not a tensor.",
    "shard-size": ("rank {rank}'s shard of a {shape} parameter holds {0} elements; with {world_size} ranks each "
                   "must hold {1}, the same on every rank."),
    "shard-piece": ("rank {rank}'s shard of a {shape} parameter is not piece {rank} of the flattened, padded "
                    "parameter: check which piece each rank keeps."),
    "gather-shape": "gather returned {0} for a {shape} parameter on rank {rank}.",
    "gather-values": ("gather of the {world_size} shards of a {shape} parameter is not the parameter on rank "
                      "{rank}: are the pieces in rank order, the padding cut off?"),
    "round-trip": "gather(shard(x)) is not x for a {shape} parameter on rank {rank}.",
}


@exercise("15-shard-gather")
def _shard_gather(answer, *, cluster, timeout: float = 60):
    """The learner's shard and gather (a pair of functions, or their names on the ranks) on odd sizes."""
    results, error = run_on_ranks(cluster, try_shard_gather, answer, timeout=timeout, quiet=True)
    if error:
        return False, error
    said = [_SHARD_SAYS[kind].format(*more, shape=shape, **r) for r in results for kind, shape, *more in r["problems"]]
    if said:
        return False, said[0]
    n = results[0]["world_size"]
    return True, (f"on every rank gather(shard(x)) is x, bit for bit, for shapes {SHAPES}; each shard holds "
                  f"ceil(numel/{n}) elements" + (" (1 rank: each shard is the whole parameter)." if n == 1 else "."))


# --- section 3: when does a layer's all-gather hide behind its forward? ------------------------------------------

def gather_seconds(params: float, world_size: int, bytes_per_s: float) -> float:
    """The lab's all-gather time of one layer's bf16 parameters: `network.collective_time`, no latency."""
    return collective_time("all_gather", 2 * params, world_size, Link("given", bytes_per_s / GB, 0.0))


def forward_seconds(params: float, tokens: float, flops_per_s: float) -> float:
    """One layer's forward: 2 FLOPs per parameter and token (a multiply and an add)."""
    return 2 * params * tokens / flops_per_s


def compute_bound(params, tokens, world_size, bytes_per_s, flops_per_s) -> bool:
    """Reference: True when one layer's all-gather takes less time than its forward."""
    return gather_seconds(params, world_size, bytes_per_s) < forward_seconds(params, tokens, flops_per_s)


def break_even_tokens(world_size: int, link, flops_per_s: float, params: float = 1e8) -> float:
    """Tokens per rank at which the lab's all-gather time equals the forward time (`link`: a Link or preset)."""
    return gather_seconds(params, world_size, get_link(link).bytes_per_s) * flops_per_s / (2 * params)


# What a learner gets wrong, as the lab's model with one thing changed: the checker names the one that fits.
_MISTAKES = {
    "whole": ("your all-gather time has each rank receive the whole layer: a rank already holds its own shard.",
              lambda p, t, n, b, f: 2 * p / b < forward_seconds(p, t, f)),
    "bits": ("your function is off by a factor of 8 in the link's speed: bytes_per_s is in bytes per second.",
             lambda p, t, n, b, f: gather_seconds(p, n, b / 8) < forward_seconds(p, t, f)),
    "backward": ("your function compares with the backward's time; the question is the forward's.",
                 lambda p, t, n, b, f: gather_seconds(p, n, b) < 2 * forward_seconds(p, t, f)),
}


def bound_points() -> list:
    """(params, tokens, world_size, bytes_per_s, flops_per_s) around each break-even point: three of the lab's
    links, five world sizes, two FLOP/s, two layer sizes, tokens 0.3x to 12x the break-even (none on it)."""
    links = [get_link(name).bytes_per_s for name in ("NVLink H100", "InfiniBand 400", "Ethernet 25 GbE")]
    return [(params, round(max(break_even_tokens(n, Link("given", bw / GB, 0.0), flops, params), 1.0) * m) + 0.5,
             n, bw, flops) for bw in links for n in (1, 2, 3, 8, 64) for flops in (312e12, 989e12)
            for params in (5e7, 2e8) for m in (0.3, 0.6, 0.9, 1.2, 1.7, 2.5, 5, 12)]


@exercise("15-compute-bound")
def _compute_bound(answer, **_):
    """The learner's compute_bound at points around the break-even, against the lab's model."""
    if not callable(answer):
        return False, "expected a function compute_bound(params, tokens, world_size, bytes_per_s, flops_per_s)."
    points = bound_points()
    try:
        said = [answer(*point) for point in points]
    except Exception as err:            # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised: {first_line(err)}"
    odd = next((s for s in said if not (isinstance(s, bool) or type(s).__name__ == "bool_")), False)
    if odd is not False:
        return False, f"your function returned {type(odd).__name__}, not True or False."
    lab = [compute_bound(*point) for point in points]
    wrong = [i for i, (s, v) in enumerate(zip(said, lab)) if bool(s) != v]
    if not wrong:
        return True, f"agrees with the lab's model at all {len(points)} points (5 world sizes, 3 links, 2 FLOP/s)."
    for message, variant in _MISTAKES.values():
        if all(bool(s) == variant(*point) for s, point in zip(said, points)):
            return False, message
    p, t, n, b, f = points[wrong[0]]
    return False, (f"wrong at {len(wrong)} of {len(points)} points, e.g. {p:.0e} params, {t:,.1f} tokens, N={n}, "
                   f"{b / GB:g} GB/s, {f:.3g} FLOP/s: you said {bool(said[wrong[0]])}.")
