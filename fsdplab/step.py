"""One training step, the one every training loop in the lab runs: the loss (a transformers model's own, next-token
cross-entropy, or torchtune's chunked one), forward and backward over micro-batches with or without gradient sync,
the optimizer step."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .settings import TrainSetting


def loss_of(model: nn.Module, batch, chunks: int = 1) -> torch.Tensor:
    """The lab's one loss: a dict batch is a transformers model's keywords (it computes its own loss from
    `labels`); a (tokens, targets) pair is next-token cross-entropy on logits taken to fp32.

    chunks > 1 (a dict batch with labels): torchtune's chunked cross-entropy. The output head runs on `chunks`
    pieces of the sequence, and each piece is taken to fp32 and through the cross-entropy on its own, so only
    one piece's fp32 copy exists at a time; the mean over the tokens equals transformers' loss."""
    if isinstance(batch, dict):
        if chunks == 1:
            return model(**batch).loss
        return _chunked_loss(model, batch, chunks)
    tokens, targets = batch
    # Call the wrapper's forward (not model.module): DDP only synchronises gradients it saw a forward for.
    logits = model(tokens)
    return _token_loss(logits, targets)


def _token_loss(logits, targets, reduction="mean") -> torch.Tensor:
    # FSDP2's root hook moves the model's inputs to its device, never the targets: a batch made on the CPU
    # meets GPU logits here (a no-op where they already share a device).
    targets = targets.to(logits.device)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                       reduction=reduction)


def _chunked_loss(model: nn.Module, batch: dict, chunks: int) -> torch.Tensor:
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}.")
    inputs = dict(batch)
    labels = inputs.pop("labels")
    head = model.get_output_embeddings()
    plain = head.forward
    # The head (in its FSDP unit: its hooks still gather the weight) returns the sequence's pieces, as
    # torchtune's decoder with num_output_chunks does; transformers passes them through as `logits`.
    head.forward = lambda hidden: [plain(piece) for piece in hidden.chunk(chunks, dim=1)]
    try:
        pieces = model(**inputs).logits
    finally:
        del head.forward
    # transformers' causal shift: position i predicts label i + 1; the last position has none.
    targets = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].chunk(chunks, dim=1)
    total = sum(_token_loss(piece, target, "sum") for piece, target in zip(pieces, targets))
    return total / (labels[:, 1:] != -100).sum().clamp(min=1)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool):
    """Forward and backward with the gradients reduced across ranks (`sync`) or kept on this rank to accumulate."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if sync:
        yield
    elif isinstance(model, (DistributedDataParallel, FullyShardedDataParallel)):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:                                   # one process, or the estimator's unwrapped DDP: nothing to skip
        yield


def loss_for(setting: TrainSetting):
    """The loss function (model, batch) a setting's training step uses."""
    if setting.loss_chunks == 1:
        return None
    return lambda model, batch: loss_of(model, batch, setting.loss_chunks)


def train_step(model: nn.Module, optimizer, batch, *, loss_fn=None, scaler=None, counter=None,
               after_backward=None, accumulate: int = 1, no_sync: bool = False,
               between_micro_batches=None) -> torch.Tensor:
    """loss, backward, (unscale/skip through `scaler`, a GradScaler, for fp16), step, zero_grad.

    loss_fn(model, batch) replaces `loss_of`; `after_backward()` runs between backward and the optimizer step
    (memory snapshots, gradient checks); with a `comms.CommCounter` the optimizer's collectives are counted
    in its "step" section. `accumulate` micro-batches (the same `batch` each time) go through forward and
    backward before the step, each loss divided by their number; with `no_sync` the gradients are reduced only
    after the last (FSDP2's set_requires_gradient_sync, DDP's no_sync); `between_micro_batches()` runs before
    each after the first (a memory tracker's per-module reset). Returns the last loss, detached (a fake tensor
    under the estimator: no `.item()` here).
    """
    for i in range(accumulate):
        if i and between_micro_batches is not None:
            between_micro_batches()
        with _gradient_sync(model, not no_sync or i == accumulate - 1):
            loss = (loss_fn or loss_of)(model, batch)
            if accumulate > 1:
                loss = loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
    if after_backward is not None:
        after_backward()
    with counter.section("step") if counter is not None else contextlib.nullcontext():
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()
