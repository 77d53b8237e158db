"""Mixed-precision pitfalls under FSDP, each one measured on real tensors or real ranks.

- fp16 has a tiny range (max 65504, smallest subnormal 6e-8): an activation above 65504 is inf (norm
  kernels themselves accumulate in fp32, a hand-written norm that squares in fp16 does not), small
  gradients underflow, and AdamW's eps=1e-8 is 0 in fp16. bf16 has fp32's range with fewer mantissa bits.
- The optimizer keeps fp32 state only if the parameters it was built on are fp32: a model loaded in fp16
  gets fp16 AdamW state.
- `MixedPrecisionPolicy` / FSDP1 `MixedPrecision` cast every parameter, norm weights included, to
  `param_dtype`; `reduce_dtype` only sets the dtype of the gradient reduction (FSDP1 exempts `_BatchNorm`
  only). Norm modules compute their statistics in fp32 inside the kernel (or, in HF models, by an explicit
  upcast), which is what keeps them stable, not `reduce_dtype`.
- With sharded gradients each rank checks only its own shard for inf/nan: a loss scaler must agree across
  ranks (all-reduce the found-inf flag), or ranks skip different steps.

Functions that take no rank run anywhere; the `*_on_rank` ones run inside `cluster.run(...)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ranks import this_rank
from ..settings import PRECISIONS, torch_dtype


def _group(group_size):
    """(group of ranks 0..group_size-1, its mesh or None, member?) for the `*_on_rank` functions (dist.first_ranks)."""
    from ..ranks import first_ranks

    return first_ranks(group_size)


def loss_scaler(precision: str, device, *, sharded: bool = False, init_scale: float = 2.0 ** 16):
    """The loss scaler a training loop in `precision` needs on `device`: None for fp32 and bf16 (bf16 has
    fp32's range); for fp16 a `torch.amp.GradScaler`, or with sharded=True FSDP1's `ShardedGradScaler`.

    Under FSDP2 the plain GradScaler already agrees across ranks: its inf check on DTensor gradients
    all-reduces the found-inf flag over the mesh (`fsdp2_scaler_on_rank` shows it). FSDP1's flat shards are
    plain tensors, so each rank would see only its own inf: sharded=True all-reduces the flag itself."""
    from ..settings import check_choice

    check_choice("precision", precision, PRECISIONS)
    if precision != "fp16":
        return None
    device_type = torch.device(device).type
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, init_scale=init_scale)
    return torch.amp.GradScaler(device_type, init_scale=init_scale)


# --- ranges ----------------------------------------------------------------------------------------

def dtype_table() -> list:
    """max, smallest normal, smallest subnormal and machine epsilon of fp32 / bf16 / fp16 (torch.finfo)."""
    rows = []
    for name in PRECISIONS:
        dt = torch_dtype(name)
        fi = torch.finfo(dt)
        rows.append({"dtype": name, "max": fi.max, "smallest_normal": fi.tiny,
                     "smallest_subnormal": fi.smallest_normal * fi.eps, "eps": fi.eps,
                     "adam_eps_1e-8": torch.tensor(1e-8, dtype=dt).item()})
    return rows


NORM_MODULES = ("LayerNorm", "RMSNorm", "naive RMSNorm")


class NaiveRMSNorm(nn.Module):
    """An RMSNorm that squares in its input's dtype: x * rsqrt(mean(x*x) + eps). torch's and HF's norms do
    not do this (they accumulate in fp32); a hand-written norm without an fp32 upcast does."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _norm_module(name: str, dim: int) -> nn.Module:
    if name == "LayerNorm":
        return nn.LayerNorm(dim)
    if name == "RMSNorm":
        return nn.RMSNorm(dim, eps=1e-6)
    if name == "naive RMSNorm":
        return NaiveRMSNorm(dim)
    raise ValueError(f"norm must be one of {NORM_MODULES}, got {name!r}.")


def norm_errors(scales, dtypes=("fp16", "bf16"), norms=NORM_MODULES, dim: int = 4096, rows: int = 4,
                seed: int = 0) -> dict:
    """Run real norm modules on activations x ~ N(0, scale^2) (`rows` x `dim`) in each dtype.

    Returns {"errors": {(norm, dtype): [relative L2 error of the output vs the same module in float64, nan
    where the output is not finite]}, "input_inf": {dtype: [fraction of x that is inf once cast to dtype]}},
    one entry per scale. The module is called as a model calls it: weights and input in the dtype."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    errors = {(n, d): [] for n in norms for d in dtypes}
    input_inf = {d: [] for d in dtypes}
    for scale in scales:
        x64 = base * scale
        for d in dtypes:
            input_inf[d].append(float((~torch.isfinite(x64.to(torch_dtype(d)))).double().mean()))
        for n in norms:
            module = _norm_module(n, dim).double()
            with torch.no_grad():
                exact = module(x64)
                for d in dtypes:
                    got = module.to(torch_dtype(d))(x64.to(torch_dtype(d))).double()
                    module.double()
                    err = (got - exact).norm() / exact.norm()
                    errors[(n, d)].append(float(err) if torch.isfinite(got).all() else float("nan"))
    return {"errors": errors, "input_inf": input_inf, "scales": list(scales)}


def tiny_gradients(cfg=None, seed: int = 0) -> torch.Tensor:
    """All non-zero gradient elements of one fp32 forward/backward of the tiny transformer (a flat tensor)."""
    from ..models import TinyConfig, TinyTransformer, random_batch
    from ..sharding import loss_of

    torch.manual_seed(seed)
    cfg = cfg or TinyConfig()
    model = TinyTransformer(cfg)
    loss_of(model, random_batch(cfg, 4, seed=seed)).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return grads[grads != 0]


def underflow_fraction(grads: torch.Tensor, dtype_name: str, loss_scale: float = 1.0, shrink: float = 1.0) -> float:
    """Fraction of non-zero fp32 gradients (times `shrink`) that are exactly 0 once cast to `dtype_name`
    after multiplying by `loss_scale` (what a loss scaler does before backward)."""
    g = grads.double() * shrink * loss_scale
    cast = g.to(torch_dtype(dtype_name))
    return float((cast == 0).double().mean())


def adam_state_dtypes(grad_value: float = 1e-4, lr: float = 1e-3) -> dict:
    """AdamW on a small Linear wrapped in fp32 vs loaded in fp16, one step with all gradients = `grad_value`.

    Returns each case's state dtype, v (exp_avg_sq) after the step, eps as stored in that dtype, and how many
    parameters are no longer finite. In fp16, v = 0.001 * g^2 underflows to 0 and eps=1e-8 rounds to 0, so
    the update m / (sqrt(v) + eps) divides by zero.
    """
    out = {}
    for name in ("fp32", "fp16"):
        dt = torch_dtype(name)
        torch.manual_seed(0)
        layer = nn.Linear(64, 64).to(dt)
        opt = torch.optim.AdamW(layer.parameters(), lr=lr, eps=1e-8)
        for p in layer.parameters():
            p.grad = torch.full_like(p, grad_value)
        opt.step()
        state = opt.state[layer.weight]
        out[name] = {"state_dtype": str(state["exp_avg"].dtype).replace("torch.", ""),
                     "exp_avg": float(state["exp_avg"].flatten()[0]),
                     "exp_avg_sq": float(state["exp_avg_sq"].flatten()[0]),
                     "eps_in_dtype": torch.tensor(1e-8, dtype=dt).item(),
                     "nonfinite_params": int(sum((~torch.isfinite(p)).sum() for p in layer.parameters())),
                     "num_params": sum(p.numel() for p in layer.parameters())}
    return out


# --- norm layers under mixed precision -------------------------------------------------------------

def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)) or \
        type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def probe_dtypes(model: nn.Module, records: list, select=is_norm, print_rank: int | None = None) -> list:
    """Hooks on every module `select(module)` accepts that append (name, weight dtype, input dtype, output dtype)
    to `records` while forward runs, so what is read is what the kernel received: the weight (or the module's
    first own parameter) and the input are read in a pre-hook, after an FSDP2 unit's own pre-forward gathered
    and cast them; the output stays "-" when the module raises. print_rank: also print each record on that rank
    (-1: every rank). Returns the hook handles."""
    def dtype(t):
        return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "-"

    handles = []
    for name, module in model.named_modules():
        if not select(module):
            continue
        open_rows = []

        def pre_hook(mod, args, name=name, open_rows=open_rows):
            weight = getattr(mod, "weight", None)
            weight = weight if weight is not None else next(mod.parameters(recurse=False), None)
            row = {"module": name, "weight": dtype(weight), "input": dtype(args[0] if args else None), "output": "-"}
            records.append(row)
            open_rows.append(row)

        def hook(mod, args, output, name=name, open_rows=open_rows):
            row = open_rows.pop()
            row["output"] = dtype(output[0] if isinstance(output, tuple) else output)
            if print_rank is not None and (print_rank < 0 or this_rank() == print_rank):
                print(f"inside forward: {name:<14} weight {row['weight']:<9} input {row['input']:<9} "
                      f"output {row['output']}", flush=True)

        handles += [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(hook)]
    return handles


def probe_norms(model: nn.Module, records: list, print_rank: int | None = None) -> list:
    """`probe_dtypes` on every norm module."""
    return probe_dtypes(model, records, is_norm, print_rank)


def shard_norms_fp32(model: nn.Module, mesh, output_dtype: torch.dtype) -> list:
    """Make every norm of `model` its own FSDP2 unit with an fp32 policy: inputs cast up to fp32, the output
    cast to `output_dtype`, the dtype the next matmul runs in (it refuses fp32). Call it before sharding the
    blocks that hold the norms; returns the norms."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=output_dtype,
                                cast_forward_inputs=True)
    norms = [m for m in model.modules() if is_norm(m)]
    for module in norms:
        fully_shard(module, mesh=mesh, mp_policy=fp32)
    return norms


def norm_dtypes_on_rank(precision: str = "bf16", reduce_precision: str = "fp32", keep_norms_fp32: bool = False,
                        cfg=None, verbose: bool = True, group_size=None) -> list | None:
    """FSDP2 with MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=reduce_precision) on the tiny
    transformer; one forward; the dtypes every norm layer saw, read from inside forward.

    keep_norms_fp32: shard each norm as its own FSDP2 unit with an fp32 policy first (inputs cast up to fp32,
    outputs back to `precision`): the way to actually run norms in fp32 under FSDP2. group_size: run on ranks
    0..group_size-1 (the others return None).
    """
    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp, build_tiny

    _, group_mesh, member = _group(group_size)
    if not member:
        return None
    cfg = cfg or TinyConfig()
    model = build_tiny(cfg, device=device())
    if keep_norms_fp32:
        shard_norms_fp32(model, group_mesh, torch_dtype(precision))
    apply_fsdp(model, group_mesh, precision=precision, reduce_precision=reduce_precision)
    records = []
    probe_norms(model, records, print_rank=-1 if verbose else None)
    tokens, _ = random_batch(cfg, 2, seed=rank(), device=device())
    with torch.no_grad():
        model(tokens)
    return records


def fsdp1_mixed_precision_on_rank(cfg=None, group_size=None) -> dict | None:
    """The posts' FSDP1 call `FSDP(model, mixed_precision=torch.float16)`, and the correct one.

    FSDP1 refuses a CPU rank unless `device_id=cpu` is passed explicitly; with it, construction and a forward
    run (enough for this check; FSDP1 on CPU is not a supported training setup). Returns the error the posts'
    argument raises and the norm dtypes seen inside forward with `MixedPrecision(param_dtype=fp16,
    reduce_dtype=fp32)`. group_size: run on ranks 0..group_size-1 (the others return None).
    """
    import warnings

    from torch.distributed.fsdp import MixedPrecision

    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp1, build_tiny

    group, _, member = _group(group_size)
    if not member:
        return None
    warnings.filterwarnings("ignore", module="torch.distributed.fsdp")
    cfg = cfg or TinyConfig()
    out = {}
    try:
        apply_fsdp1(build_tiny(cfg, device=device()), device(), per_block=False, mixed_precision=torch.float16,
                    process_group=group)
        out["posts_call"] = "no error"
    except Exception as e:  # noqa: BLE001 - showing whatever the posts' call raises is the point
        out["posts_call"] = f"{type(e).__name__}: {e}"
    policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model = apply_fsdp1(build_tiny(cfg, device=device()), device(), per_block=False, mixed_precision=policy,
                        process_group=group)
    records = []
    probe_norms(model, records)
    tokens, _ = random_batch(cfg, 2, seed=rank(), device=device())
    with torch.no_grad():
        model(tokens)
    out["norms"] = records
    return out


# --- gradient reduction precision ------------------------------------------------------------------

def reduce_error_on_rank(reduce_precision: str = "fp16", loss_scale: float = 1.0, cfg=None, seed: int = 0,
                         batch_size: int = 4, group_size=None) -> dict | None:
    """Gradients of one step under FSDP2 with fp32 compute and `reduce_precision` reduce-scatter, against a
    float64 reference (each rank's fp32 local gradient, summed in float64 and averaged).

    The loss is multiplied by `loss_scale` (as a loss scaler does) and the gradients divided back, so the
    only difference from the reference is the reduction dtype. Each rank compares its own gradient shard
    with the same rows of the reference (FSDP2 shards dim 0 like torch.chunk) and one all-reduce sums the
    tallies. Returns the relative L2 error, the fraction of non-zero reference elements that arrive as
    exactly 0 and the count of non-finite elements; equal on all ranks of the group (ranks 0..group_size-1;
    the others return None).
    """
    import torch.distributed as dist

    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp, build_tiny, loss_of

    group, group_mesh, member = _group(group_size)
    if not member:
        return None
    cfg = cfg or TinyConfig()
    dev, n, r = device(), dist.get_world_size(group), rank()   # ranks 0..n-1: the global rank is the group's
    batch = random_batch(cfg, batch_size, seed=seed + r, device=dev)
    reference = build_tiny(cfg, seed=seed, device=dev)
    # Gradients only, no optimizer step: backward is called here, not through train_step.
    (loss_of(reference, batch) * loss_scale).backward()
    grads = [p.grad for p in reference.parameters()]
    flat = torch.cat([g.double().flatten() for g in grads]) / loss_scale
    dist.all_reduce(flat, group=group)          # one float64 sum of every rank's gradient
    flat /= n
    ref_full = [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)]

    model = apply_fsdp(build_tiny(cfg, seed=seed, device=dev), group_mesh, precision="fp32",
                       reduce_precision=reduce_precision)
    (loss_of(model, batch) * loss_scale).backward()
    tally = torch.zeros(5, dtype=torch.float64, device=dev)   # err^2, ref^2, flushed, non-zero ref, non-finite
    for p, full in zip(model.parameters(), ref_full):
        got = p.grad.to_local().double() / loss_scale
        chunks = torch.chunk(full, n, dim=0)
        ref = chunks[r] if r < len(chunks) else full[:0]
        assert got.shape == ref.shape, (got.shape, ref.shape)
        finite = torch.isfinite(got)
        tally += torch.stack([(got[finite] - ref[finite]).pow(2).sum(), ref[finite].pow(2).sum(),
                              ((got == 0) & (ref != 0)).sum().double(), (ref != 0).sum().double(),
                              (~finite).sum().double()])
    dist.all_reduce(tally, group=group)
    err2, ref2, flushed, nonzero, nonfinite = tally.tolist()
    return {"reduce": reduce_precision, "world_size": n, "loss_scale": loss_scale,
            "rel_error": math.sqrt(err2 / ref2), "flushed_to_zero": flushed / nonzero, "nonfinite": int(nonfinite)}


# --- loss scaling across ranks ---------------------------------------------------------------------

def scaler_agreement_on_rank(scaler: str = "per-rank", steps: int = 4, inf_step: int = 1, inf_rank: int = 1,
                             cfg=None, seed: int = 0, group_size=None) -> dict | None:
    """FSDP1 (each rank owns one flat gradient shard) + a loss scaler; at `inf_step` rank `inf_rank` finds an
    inf in its own gradient shard (as an fp16 overflow would put there).

    scaler="per-rank": torch.amp.GradScaler, which checks only this rank's shard; "agree":
    ShardedGradScaler, which all-reduces the found-inf flag so every rank skips the same steps.
    Returns, per step, this rank's scale and whether its shard changed, plus a checksum of its shard.
    FSDP1 on a CPU rank needs `device_id=cpu` (not a supported training setup; enough for these steps).
    group_size: run on ranks 0..group_size-1 (the others return None).
    """
    import warnings

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp1, build_tiny, train_step

    if scaler not in ("per-rank", "agree"):
        raise ValueError(f"scaler must be 'per-rank' or 'agree', got {scaler!r}.")
    group, _, member = _group(group_size)
    if not member:
        return None
    warnings.filterwarnings("ignore", module="torch.distributed.fsdp")
    cfg = cfg or TinyConfig()
    dev = device()
    model = apply_fsdp1(build_tiny(cfg, seed=seed, device=dev), dev, per_block=False, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp_scaler = (torch.amp.GradScaler(dev.type, init_scale=2.0 ** 16) if scaler == "per-rank"
                  else ShardedGradScaler(dev.type, init_scale=2.0 ** 16, process_group=group))
    flat = next(model.parameters())

    def plant_inf():
        # Between backward and the scaler's step: the inf an fp16 overflow would leave in this rank's shard.
        with torch.no_grad():
            flat.grad.view(-1)[0] = float("inf")

    scales, changed, checksums = [], [], []
    for step in range(steps):
        batch = random_batch(cfg, 4, seed=seed + 1000 * step + rank(), device=dev)
        before = flat.detach().clone()
        train_step(model, opt, batch, scaler=amp_scaler,
                   after_backward=plant_inf if step == inf_step and rank() == inf_rank else None)
        scales.append(float(amp_scaler.get_scale()))
        changed.append(not torch.equal(before, flat.detach()))
        checksums.append(float(flat.detach().double().sum()))
    return {"scaler": scaler, "rank": rank(), "scales": scales, "stepped": changed, "checksums": checksums}


def fsdp2_scaler_on_rank(inf_rank: int = 1, cfg=None, seed: int = 0, group_size=None) -> dict | None:
    """The same injected inf under FSDP2 with a plain torch.amp.GradScaler: the gradients are DTensors, and
    DTensor's handler for the scaler's inf check all-reduces the found-inf flag over the mesh (torch 2.x
    `found_inf_reduce_handler`), so the ranks agree without a special scaler. Returns this rank's scale and
    whether its shards changed (ranks 0..group_size-1; the others return None)."""
    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp, build_tiny, train_step

    _, group_mesh, member = _group(group_size)
    if not member:
        return None
    cfg = cfg or TinyConfig()
    dev = device()
    model = apply_fsdp(build_tiny(cfg, seed=seed, device=dev), group_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 16)

    def plant_inf():
        with torch.no_grad():
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")

    before = [p.to_local().clone() for p in model.parameters()]
    batch = random_batch(cfg, 4, seed=seed + rank(), device=dev)
    train_step(model, opt, batch, scaler=scaler, after_backward=plant_inf if rank() == inf_rank else None)
    stepped = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    return {"rank": rank(), "scale": float(scaler.get_scale()), "stepped": stepped}


# --- training curves -------------------------------------------------------------------------------

CURVE_MODES = ("fp32", "bf16", "fp16", "fp16+scaler", "fp16 model")


def train_curve_on_rank(mode: str = "bf16", steps: int = 40, cfg=None, lr: float = 3e-3, seed: int = 0,
                        batch_size: int = 4, group_size=None) -> list | None:
    """Loss per step of the tiny transformer under FSDP2 in one precision mode:

    fp32; bf16 (MixedPrecisionPolicy bf16 params, fp32 reduce, fp32 master + AdamW state); fp16 (the posts'
    fp16 params and fp16 reduce, no loss scaling); fp16+scaler (same, with torch.amp.GradScaler, which
    agrees across ranks on FSDP2's DTensor gradients); fp16 model (the model converted to fp16 before
    wrapping, as when loaded with torch_dtype=float16: fp16 master weights and fp16 AdamW state).
    NaN losses are returned as float('nan'). group_size: ranks 0..group_size-1 train (the others return None).
    """
    from ..ranks import device, rank
    from ..models import TinyConfig, random_batch
    from ..sharding import apply_fsdp, build_tiny, train_step

    if mode not in CURVE_MODES:
        raise ValueError(f"mode must be one of {CURVE_MODES}, got {mode!r}.")
    _, mesh, member = _group(group_size)
    if not member:
        return None
    cfg = cfg or TinyConfig()
    dev = device()
    model = build_tiny(cfg, seed=seed, device=dev)
    if mode == "fp16 model":
        model = model.half()
        apply_fsdp(model, mesh)
    elif mode == "fp32":
        apply_fsdp(model, mesh)
    elif mode == "bf16":
        apply_fsdp(model, mesh, precision="bf16", reduce_precision="fp32")
    else:
        apply_fsdp(model, mesh, precision="fp16", reduce_precision="fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 16) if mode == "fp16+scaler" else None
    losses = []
    for step in range(steps):
        batch = random_batch(cfg, batch_size, seed=seed + 1000 * step + rank(), device=dev)
        value = train_step(model, opt, batch, scaler=scaler).item()
        losses.append(value if math.isfinite(value) else float("nan"))
    return losses
