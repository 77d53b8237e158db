"""torch's DistributedDataParallel in the estimator: the program as DDP runs it on a rank, plus DDP's buckets.

DDP's C++ Reducer cannot run on fake tensors (it reads tensor data), so the estimator runs the model unwrapped,
as DDP runs it on each rank, mixed precision as `torch.autocast` (DDP has no policy of its own), and adds what the
Reducer holds: its gradient buckets, flat buffers as large as the trainable parameters (gradient_as_bucket_view
is False by default, so they are a second copy of the gradients), alive from construction on. On live ranks the
same buckets are read from DDP itself (`bucket_bytes`); tests/unit/test_memory.py holds the two to each other.
"""

from __future__ import annotations

from ..settings import torch_dtype

BUCKET_CAP_BYTES = 25 * 1024 * 1024      # DistributedDataParallel's bucket_cap_mb default
CATEGORY = "communication_buffers"


def _trained(model, depth=None) -> list:
    """(bytes, dtype) of each trained parameter of `model`, in order; with `depth`, of the same model with its
    middle block repeated until it has `depth` blocks (the blocks are identical: block_repeat's twin)."""
    from ..models import blocks_of

    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [(p.numel() * p.element_size(), p.dtype) for p in params]
    if depth is None:
        return sizes
    blocks = blocks_of(model)
    middle = {id(p) for p in blocks[len(blocks) // 2].parameters()}
    at = [i for i, p in enumerate(params) if id(p) in middle]
    block = sizes[at[0]:at[-1] + 1]
    return sizes[:at[-1] + 1] + block * (depth - len(blocks)) + sizes[at[-1] + 1:]


def bucket_sizes(model, depth=None) -> list:
    """The bytes of each gradient bucket torch's DDP keeps for `model` (with `depth` blocks, see _trained) from
    its second step on, when it has rebuilt them in the order gradients became ready: the first capped at 1 MiB,
    the others at 25 MiB, one set per dtype; a bucket closes once it reaches its cap. The order is taken as the
    parameters' reverse order, as backward runs a stack of blocks; inside a block the real order can differ, which
    moves a boundary by a parameter or two (the same total: the peak does not change)."""
    from .._torch_private import ddp_first_bucket_bytes

    sizes, open_ = [], {}
    for nbytes, dtype in reversed(_trained(model, depth)):
        size, count = open_.get(dtype, (0, 0))
        size += nbytes
        cap = ddp_first_bucket_bytes() if count == 0 else BUCKET_CAP_BYTES
        if size >= cap:
            sizes.append(size)
            open_[dtype] = (0, count + 1)
        else:
            open_[dtype] = (size, count)
    return sizes + [size for size, _ in open_.values() if size]


def autocast_loss(loss_fn, precision: str, device_type: str):
    """`loss_fn(model, batch)` (None: sharding.loss_of) with its forward under torch.autocast in `precision`:
    how a DDP program computes in 16 bits while it keeps fp32 weights. fp32: the loss as it is."""
    from ..sharding import loss_of

    loss_fn = loss_fn or loss_of
    if precision == "fp32":
        return loss_fn

    def under_autocast(model, batch):
        import torch

        with torch.autocast(device_type, dtype=torch_dtype(precision)):
            return loss_fn(model, batch)
    return under_autocast


def with_buckets(run: tuple, sizes: list) -> tuple:
    """A traced step (exact._run_steps' tuple) of the unwrapped model with DDP's buckets added: alive through
    the whole step, in communication_buffers, and in the allocator's log as allocated before the step began."""
    peak, by_category, raw, category_peaks, after_backward, after_step, moment, timeline, alloc_log = run
    total = sum(sizes)
    by_category = {**by_category, CATEGORY: by_category.get(CATEGORY, 0) + total}
    category_peaks = {**category_peaks, CATEGORY: category_peaks.get(CATEGORY, 0) + total}
    raw = {**raw, "DDP buckets": total}
    if timeline:
        timeline = {**timeline, CATEGORY: [v + total for v in timeline[CATEGORY]]}
    if alloc_log and alloc_log[0]:
        log, preloaded = alloc_log
        buckets = [("+", f"ddp-bucket-{i}", size, 0, "DDP bucket") for i, size in enumerate(sizes)]
        alloc_log = (buckets + list(log), preloaded + len(buckets))
    return (peak + total, by_category, raw, category_peaks, after_backward, after_step, moment, timeline,
            alloc_log)


def bucket_bytes(model) -> list:
    """The bucket sizes a live DistributedDataParallel `model` reports (its logging data), or [] for any other
    model."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") if data.get("has_rebuilt_buckets") else data.get("bucket_sizes")
    return [int(x) for x in str(sizes or "").replace(" ", "").split(",") if x]


def relabel_measured(by_category: dict, category_peaks: dict, after_step: dict, sizes: list) -> tuple:
    """A live DDP step as the tracker saw it, with the buckets in communication_buffers. The Reducer allocates
    its buckets in C++: those it rebuilt during a tracked step the tracker counted as activations (and they
    are still there after the step); those made before tracking began it never saw, so they are added."""
    total = sum(sizes)
    if not total:
        return by_category, category_peaks, 0
    seen = after_step.get("Activation", 0) >= total
    by_category, category_peaks = dict(by_category), dict(category_peaks)
    for table in (by_category, category_peaks):
        if seen:
            table["activations"] -= total
        table[CATEGORY] = table.get(CATEGORY, 0) + total
    return by_category, category_peaks, 0 if seen else total
