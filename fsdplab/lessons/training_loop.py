"""Lesson 09 (the first-day FSDP2 training loop) only: what the lesson's cells need beyond torch itself.

- `LiveBytes`: the peak of tensor bytes a rank holds over a block of code (every storage a plain tensor op
  allocates, counted until it is freed): exact on CPU ranks, no allocator involved;
- `init_weights`: a seeded initialisation that gives a sharded model the very weights one process gets;
- `weight_health` / `looks_uninitialized`: what `to_empty` without an init leaves behind;
- `shard_agreement`: how much of each rank's shard equals a single-process reference;
- `global_batch`, `split_batch`: the global batches of every step, split per rank and micro-batch;
- `grad_gap`: how far this rank's gradient rows are from a single-process reference's;
- `param_bytes`: parameter bytes of a model at its real size on the meta device (full, and one rank's shard
  with FSDP's padding): the 7B numbers of sections 1 and 3;
- `synced_loop`, `compare_accumulation`: the lab's accumulation loop, and the learner's measured next to it
  on a rank (section 3's code exercise);
- `plot_one_process`, `plot_memory`: the lesson's two figures (sections 6 and 7, `training_loop_figures`);
- the exercise checkers.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .checkers import close, exercise
from .training_loop_figures import plot_memory, plot_one_process  # noqa: F401 (the notebook draws with them)


# --- memory: live tensor bytes --------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live: ...`: `live.peak` is the largest number of tensor bytes allocated inside the
    block and alive at once; `live.now` what is still alive at the end. Storages made before the block
    do not count (start it before the model exists to count the model). Tensor subclasses (DTensor) are
    seen through the plain tensors they hold. A storage resized in place (FSDP2 frees its all-gather buffers
    with `untyped_storage().resize_(0)` and grows them again for the next all-gather) counts at its new size.

    A collective's buffers (gloo's copy of a reduce-scatter's input, a tensor the program handed to the
    collective and let go of) can outlive it: the backend's thread drops the last reference when it gets to it,
    at once on an idle machine, a while later on a busy one, so `live.now` right after a collective depends on
    the load. `mark = live.mark()` records what is alive; `live.held(mark)`, read later (after the next
    collectives), is the bytes of that mark less the storages whose last reference went on another thread than
    the block's: what the program itself held at the mark, whatever the load.
    """

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._alive: dict = {}      # id of a storage -> [bytes counted for it, its serial number]
        self._serial = 0            # ids are reused once a storage is gone: serials are not
        self._elsewhere: set = set()     # serials of storages freed on another thread than the block's
        self._thread = threading.get_ident()
        self._lock = threading.RLock()   # a storage's last reference may go on a backend's thread

    def mark(self) -> dict:
        """What is alive now: serial -> bytes."""
        with self._lock:
            return {serial: size for size, serial in self._alive.values()}

    def held(self, mark: dict) -> int:
        """The bytes of `mark` the program held, without what a backend's thread freed after it."""
        with self._lock:
            return sum(size for serial, size in mark.items() if serial not in self._elsewhere)

    def __enter__(self):
        self._thread = threading.get_ident()
        original = self._original_resize = torch.UntypedStorage.resize_
        live = self

        def resize(storage, size):
            key = id(storage)
            if key in live._alive:
                live._count(key, size - live._alive[key][0])
            result = original(storage, size)
            return result

        torch.UntypedStorage.resize_ = resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def _count(self, key, delta):
        with self._lock:
            self._alive[key][0] += delta
            self.now += delta
            self.peak = max(self.peak, self.now)

    def _freed(self, key):
        with self._lock:
            size, serial = self._alive.pop(key, (0, None))
            self.now -= size
            if threading.get_ident() != self._thread:
                self._elsewhere.add(serial)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not _plain(t):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._alive or storage.nbytes() == 0:
                continue
            with self._lock:
                self._serial += 1
                self._alive[key] = [0, self._serial]
                self._count(key, storage.nbytes())
            weakref.finalize(storage, self._freed, key)
        return out


def _plain(t) -> bool:
    """A tensor with a storage of its own: not a subclass (DTensor holds plain tensors), not on meta."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta" and t.layout == torch.strided


# --- initialisation ----------------------------------------------------------------------------------------

def _full_init(name: str, shape, seed: int, index: int) -> torch.Tensor:
    """The full tensor of parameter `name`: norms 1, biases 0, every other weight N(0, 0.02) from a
    generator seeded by (seed, index), so that it does not depend on which rank asks or on anything drawn
    before."""
    if "norm" in name and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=generator) * 0.02


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Initialise every parameter of `model`, sharded (FSDP2 DTensors) or not, to the same values: each full
    tensor is drawn on the rank from its own seeded generator and the rank keeps its own rows. One full
    tensor at a time, so the extra memory is the largest tensor, not the model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, (name, param) in enumerate(model.named_parameters()):
        full = _full_init(name, param.shape, seed, index).to(param.dtype)
        if isinstance(param, DTensor):
            mine = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(full)
    return model


@torch.no_grad()
def weight_health(model: nn.Module) -> dict:
    """What this rank holds: elements, NaN/inf count, the largest finite |value|, the fraction of exact zeros."""
    from torch.distributed.tensor import DTensor

    count = bad = zeros = 0
    largest = 0.0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:
            continue
        count += local.numel()
        bad += int((~torch.isfinite(local)).sum())
        zeros += int((local == 0).sum())
        finite = local[torch.isfinite(local)]
        if finite.numel():
            largest = max(largest, float(finite.abs().max()))
    return {"elements": count, "not_finite": bad, "max_abs": largest, "zero_fraction": zeros / max(count, 1)}


def looks_uninitialized(health: dict, limit: float = 1e3) -> bool:
    """True for weights no initialiser makes: NaN/inf, values above `limit` (an init draws |w| < 10), or
    mostly exact zeros (fresh pages from the system: only biases start at 0, a few percent of a model)."""
    return health["not_finite"] > 0 or health["max_abs"] > limit or health["zero_fraction"] > 0.5


@torch.no_grad()
def shard_agreement(model: nn.Module, reference: nn.Module) -> dict:
    """For each parameter of the sharded `model`: the fraction of this rank's elements equal to the same rows
    of `reference` (a plain model with the full weights, the same on every rank). No collective: the rank
    cuts its rows out of the reference itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref = dict(reference.named_parameters())
    out = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local()
            expected = distribute_tensor(ref[name].detach().to(local.device), param.device_mesh, param.placements,
                                         src_data_rank=None).to_local()
        else:   # a root parameter FSDP2 left unsharded after a forward: the full tensor, on the rank's device
            local, expected = param, ref[name].detach().to(param.device)
        out[name] = 1.0 if local.numel() == 0 else float((local == expected).float().mean())
    return out


@torch.no_grad()
def grad_gap(model: nn.Module, reference: nn.Module) -> float:
    """||g - g_ref|| / ||g_ref|| over this rank's rows of every gradient (sharded `model` against a plain
    `reference` holding the full gradients): 0 when the rank holds exactly the single-process gradients."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ref = dict(reference.named_parameters())
    diff = norm = 0.0
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            local = grad.to_local()
            expected = distribute_tensor(ref[name].grad.to(local.device), grad.device_mesh, grad.placements,
                                         src_data_rank=None).to_local()
        else:
            local, expected = grad, ref[name].grad.to(grad.device)
        diff += float((local.double() - expected.double()).pow(2).sum())
        norm += float(expected.double().pow(2).sum())
    return math.sqrt(diff / norm) if norm else 0.0


# --- data ----------------------------------------------------------------------------------------------------

def global_batch(cfg, step: int, size: int, seed: int = 0):
    """(tokens, targets) of optimizer step `step`: `size` sequences, the same on every rank and in one process."""
    from ..models import random_batch

    return random_batch(cfg, batch_size=size, seed=seed * 10_007 + step)


def split_batch(batch, rank: int, world_size: int, k: int, device=None) -> list:
    """This rank's `k` micro-batches of a global batch, on `device` (None: this rank's): rank r takes rows r, r + N,
    r + 2N, ... (a strided split, as DistributedSampler without shuffling), then cuts them into k equal
    micro-batches."""
    from ..models import default_device

    tokens, targets = (t.to(default_device(device)) for t in batch)
    mine = slice(rank, None, world_size)
    tokens, targets = tokens[mine], targets[mine]
    if len(tokens) % k:
        raise ValueError(f"{len(tokens)} sequences per rank do not split into {k} micro-batches: make the global "
                         f"batch a multiple of world_size x micro_batches = {world_size * k}.")
    return list(zip(tokens.chunk(k), targets.chunk(k)))


def gap_tolerance(device_type: str) -> float:
    """The largest relative gap between two fp32 computations of the same gradients (or logits) that still
    counts as equal, by where the ranks compute ('cpu' or 'cuda'). On CPU ranks the gaps measured are about
    1e-7 (the same kernels, sums in another order): 1e-5. On GPUs the ranks' fp32 kernels (cuBLAS's split
    reductions, atomics in attention's backward) round differently from the CPU reference and from run to run:
    1e-4, still far below what a bug leaves (a missing /k, a shard clipped by its own norm: 1e-1 and more)."""
    return 1e-5 if torch.device(device_type).type == "cpu" else 1e-4


def next_token_loss(model, tokens, targets) -> torch.Tensor:
    """Mean next-token loss over the micro-batch: the lab's one loss (`fsdplab.sharding.loss_of`)."""
    from ..sharding import loss_of

    return loss_of(model, (tokens, targets))


def overlap(a: list, b: list) -> float:
    """Fraction of a's samples that b also draws."""
    return len(set(a) & set(b)) / max(len(set(a)), 1)


# --- sizes at full scale, on the meta device ---------------------------------------------------------------

def tiny_model() -> nn.Module:
    """The lesson's tiny twin (fsdplab.models.TinyTransformer at its defaults), on the CPU."""
    from ..models import TinyConfig, TinyTransformer

    return TinyTransformer(TinyConfig())


def param_bytes_of(model: nn.Module, world_size: int, dtype_bytes: int = 4) -> dict:
    """Parameter bytes of `model` (real or meta tensors): the full model, and one rank's FSDP2 shard (each
    tensor's rows split in `world_size`, padded to equal chunks as FSDP2 pads them)."""
    full = shard = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        full += p.numel() * dtype_bytes
        shard += math.ceil(rows / world_size) * (p.numel() // rows) * dtype_bytes
    return {"params": sum(p.numel() for p in model.parameters()), "full": full, "shard": shard}


def param_bytes(model_name: str, world_size: int, dtype_bytes: int = 4) -> dict:
    """`param_bytes_of` for a registered model at its real size, built on the meta device (nothing allocated)."""
    from ..models import causal_lm, hf_config

    return param_bytes_of(causal_lm(hf_config(model_name), device="meta"), world_size, dtype_bytes)


# --- exercises ---------------------------------------------------------------------------------------------

@exercise("09-summed-loss")
def _summed_loss(answer, *, measured):
    return close(answer, measured, rel=0.02,
                 hint="each micro-batch's mean loss is one k-th of the big batch's; summing k of them "
                      "without dividing by k adds up k gradients of full size.")


@exercise("09-no-sync-gib")
def _no_sync_gib(answer, *, measured):
    return close(answer, measured, rel=0.05, unit=" GiB",
                 hint="between micro-batches each rank keeps every parameter's gradient UNSHARDED "
                      "(full shape, fp32) instead of its 1/N shard: full bytes minus shard bytes.")


# --- the accumulation loop, written by the learner -----------------------------------------------------------

def sharded_tiny(seed: int = 0) -> nn.Module:
    """On a rank: the lesson's tiny twin built on the meta device, one FSDP2 unit per block and the root,
    initialised by `init_weights`."""
    from torch.distributed.fsdp import fully_shard

    from ..models import TinyConfig, TinyTransformer
    from ..ranks import device, mesh

    with torch.device("meta"):
        model = TinyTransformer(TinyConfig())
    for block in model.layers:
        fully_shard(block, mesh=mesh())
    fully_shard(model, mesh=mesh())
    model.to_empty(device=device())
    return init_weights(model, seed=seed)


def synced_loop(model, parts) -> None:
    """The lab's accumulation loop: each micro-batch's loss divided by their number, the gradients synced
    (reduce-scattered) in the last micro-batch's backward only."""
    k = len(parts)
    for i, (tokens, targets) in enumerate(parts):
        model.set_requires_gradient_sync(i == k - 1)
        (next_token_loss(model, tokens, targets) / k).backward()


def _watched(loop, model, parts) -> dict:
    """On a rank: run `loop(model, parts)` inside a CommCounter. At each forward and at the end it notes whether
    the sharded gradients changed since the last note: the micro-batches whose backward synced, on any number of
    ranks (one rank has no reduce-scatter to count)."""
    from ..comms import CommCounter

    params = list(model.parameters())       # the shards: a sync adds to their .grad, nothing else does

    def grads_now():
        return tuple(None if p.grad is None else float(p.grad.to_local().detach().double().abs().sum())
                     for p in params)

    notes = []
    handle = model.register_forward_pre_hook(lambda *_: notes.append(grads_now()))
    try:
        with CommCounter(fsdp_labels=False) as counter:
            loop(model, parts)
    finally:
        handle.remove()
    notes.append(grads_now())
    return {"forwards": len(notes) - 1, "synced_after": [i for i in range(1, len(notes)) if notes[i] != notes[i - 1]],
            "reduce_scatters": sum(r["kind"] == "reduce_scatter" for r in counter.records),
            "reduce_scatter_sent": counter.total("sent_bytes", kind="reduce_scatter"),
            "sent": counter.total("sent_bytes"), "kinds": [r["kind"] for r in counter.records],
            "grads": [None if p.grad is None else p.grad.to_local().detach().double() for p in params]}


def compare_accumulation(loop, micro_batches: int = 4, seed: int = 0) -> dict:
    """On a rank: the learner's `loop(model, parts)` and `synced_loop`, each on a fresh sharded tiny twin with
    this rank's `micro_batches` micro-batches of one global batch (at least 2). Returns what each synced and
    sent, and how far the learner's gradient shards are from the lab's: as they are, and divided by k."""
    from ..models import TinyConfig
    from ..ranks import device, this_rank, world_size

    k = max(2, int(micro_batches))
    n, r = world_size(), this_rank()
    parts = split_batch(global_batch(TinyConfig(), 0, n * k, seed=seed), r, n, k, device())
    mine = _watched(loop, sharded_tiny(seed), parts)
    ref = _watched(synced_loop, sharded_tiny(seed), parts)
    grads, expected_grads = mine.pop("grads"), ref.pop("grads")
    diff = scaled = norm = mine_norm = 0.0
    for got, expected in zip(grads, expected_grads):
        got = torch.zeros_like(expected) if got is None else got
        diff += float((got - expected).pow(2).sum())
        scaled += float((got / k - expected).pow(2).sum())
        norm += float(expected.pow(2).sum())
        mine_norm += float(got.pow(2).sum())
    norm = norm or 1.0
    return {"rank": r, "world_size": n, "device": device().type, "micro_batches": k, "mine": mine, "ref": ref,
            "params": len(grads), "missing": sum(g is None for g in grads), "gap": math.sqrt(diff / norm),
            "scaled_gap": math.sqrt(scaled / norm), "ratio": math.sqrt(mine_norm / norm)}


def _which(synced: list, k: int) -> str:
    """'each of the 4 micro-batches', 'micro-batches 1, 2 and 3 of 4', 'no micro-batch of 4'."""
    if not synced:
        return f"no micro-batch of {k}"
    if synced == list(range(1, k + 1)):
        return f"each of the {k} micro-batches"
    if len(synced) == 1:
        return f"micro-batch {synced[0]} of {k}"
    return f"micro-batches {', '.join(map(str, synced[:-1]))} and {synced[-1]} of {k}"


def _sent(side: dict) -> str:
    """'5 reduce-scatters, 469,760 B': what one loop reduce-scattered on a rank (ring model)."""
    return f"{side['reduce_scatters']} reduce-scatters, {side['reduce_scatter_sent']:,.0f} B"


@exercise("09-sync-once")
def _sync_once(answer, *, cluster, micro_batches: int = 4):
    """The learner's accumulation loop next to `synced_loop` on the live ranks: gradients, then the syncs and
    the reduce-scatters."""
    if not callable(answer):
        return False, ("expected a function accumulate(model, parts) that runs forward and backward on each of "
                       "this rank's micro-batches.")
    try:
        results = cluster.run(compare_accumulation, answer, micro_batches)
    except Exception as e:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your loop raised on the ranks: {str(e).strip().splitlines()[0]}"
    k, one_rank = results[0]["micro_batches"], results[0]["world_size"] == 1
    tolerance = gap_tolerance(results[0]["device"])
    short = next((x for x in results if x["mine"]["forwards"] != k), None)
    if short:
        return False, (f"your loop ran {short['mine']['forwards']} forward passes on rank {short['rank']} for its "
                       f"{k} micro-batches: run each micro-batch through the model once, then backward.")
    bare = next((x for x in results if x["missing"]), None)
    if bare:
        return False, (f"after your loop rank {bare['rank']} holds no gradient in {bare['missing']} of its "
                       f"{bare['params']} parameter shards: {_which(bare['mine']['synced_after'], k)} synced, so "
                       "nothing reached them. A sync happens in a backward: the last micro-batch's must sync.")
    worst = max(results, key=lambda x: x["gap"])
    synced = worst["mine"]["synced_after"]
    if worst["gap"] > tolerance:
        if worst["scaled_gap"] <= tolerance:
            return False, (f"rank {worst['rank']}'s gradient is {worst['ratio']:.2f}x the reference loop's: the "
                           f"accumulated gradient must be the mean over the {k} micro-batches, not their sum.")
        if k not in synced:
            return False, (f"rank {worst['rank']}'s gradient differs by {worst['gap']:.1e} (relative) from the "
                           f"reference loop's: your loop synced after {_which(synced, k)}, not after the last. A "
                           "micro-batch that does not sync keeps its gradient until one after it syncs: the last "
                           "micro-batch must sync.")
        return False, (f"rank {worst['rank']}'s gradient differs by {worst['gap']:.1e} (relative) from the reference "
                       f"loop's, which divides each micro-batch's loss by {k}: compute the lesson's loss on each "
                       "micro-batch once, and change only when the gradients sync.")
    mine, ref = results[0]["mine"], results[0]["ref"]
    off = next((x for x in results if x["mine"]["synced_after"] != x["ref"]["synced_after"]), None)
    if off:
        mine, ref = off["mine"], off["ref"]
        if one_rank:
            return False, (f"gradients match, but your loop synced after {_which(mine['synced_after'], k)}, the "
                           f"reference loop once, after the last (1 rank: no reduce-scatter to count, the syncs "
                           "were read off the gradient shards). Keep the gradients unsharded until the last "
                           "micro-batch.")
        return False, (f"gradients match, but rank {off['rank']} synced after {_which(mine['synced_after'], k)}: "
                       f"{_sent(mine)}, where the reference loop synced once, after the last: {_sent(ref)}. Keep "
                       "the gradients unsharded until the last micro-batch.")
    extra = next((x for x in results if x["mine"]["sent"] != x["ref"]["sent"]), None)
    if extra:
        mine, ref = extra["mine"], extra["ref"]
        return False, (f"gradients match and only the last micro-batch synced, but rank {extra['rank']} sent "
                       f"{mine['sent']:,.0f} B in {len(mine['kinds'])} collectives where the reference loop sent "
                       f"{ref['sent']:,.0f} B in {len(ref['kinds'])}: let FSDP2's sync do the reducing.")
    if one_rank:
        return True, (f"gradients match the reference loop's (relative gap {worst['gap']:.1e}) and your loop synced "
                      f"once, after micro-batch {k} of {k}, as the reference loop did (1 rank: no reduce-scatter "
                      "to count, the sync was read off the gradient shards).")
    return True, (f"gradients match the reference loop's on every rank (worst relative gap {worst['gap']:.1e}) and "
                  f"rank 0 synced once, after micro-batch {k} of {k}: {_sent(mine)}, as the reference loop.")
