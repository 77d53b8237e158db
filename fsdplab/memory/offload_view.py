"""What stays on the GPU under FSDP2's CPUOffloadPolicy, as an allocation log `fsdplab.memory.allocator` replays: the
estimate's GPU view (reserved memory, nvidia-smi) of an offloaded step.

The traced step runs without offload (CPUOffloadPolicy needs an accelerator), so its log holds the offloaded
tensors too. Under the policy, on a GPU:

- sharded parameters, sharded gradients and optimizer state live in (pinned) host memory: never on the GPU;
- a unit's unsharded parameters in flight, activations, the logits and loss, and the all-gather and
  reduce-scatter buffers are on the GPU, as without offload;
- a reduce-scatter's output becomes the sharded gradient (the tracker relabels it): FSDP2 copies it to the
  host and the GPU block is freed, here at the relabel;
- after backward the optimizer steps the host's parameters: nothing of the step or of zero_grad is on the GPU.

Not modelled: the host-to-device copy of each unit's shards before its all-gather (a transient of one unit's
shards; at world size 1, where FSDP2 skips the all-gather, the copy is the unsharded parameter itself).
"""

from __future__ import annotations

from .._torch_private import OFFLOADED, STREAM_OF

DESCRIPTION = ("the GPU's part of the step: unsharded parameters of the units in flight, activations, logits, "
               "all-gather and reduce-scatter buffers; sharded parameters, gradients (copied off as each "
               "reduce-scatter ends) and optimizer state, and the optimizer step, on the host")


def _kind(kind) -> str:
    return getattr(kind, "value", kind)


def gpu_side_log(preloaded, events) -> tuple[list, int]:
    """(allocation log, count preloaded) of what stays on the GPU, from a tracked step's `preloaded`
    [(serial, bytes, kind)] and `events` (fsdplab/_torch_private/tracker.py: "+", "-", "s", "r", "c", "m")."""
    log, on_gpu = [], set()

    def malloc(serial, size, kind):
        if size and _kind(kind) not in OFFLOADED:
            log.append(("+", serial, size, STREAM_OF.get(_kind(kind), 0), _kind(kind)))
            on_gpu.add(serial)

    def free(serial):
        if serial in on_gpu:
            log.append(("-", serial))
            on_gpu.discard(serial)

    for serial, size, kind in preloaded:
        malloc(serial, size, kind)
    count = len(log)
    on_host = False                         # the optimizer step and zero_grad, after backward
    for e in events:
        op = e[0]
        if op == "m":
            on_host = on_host or e[1] == "after backward"
        elif op == "+":
            if not on_host:
                malloc(e[1], e[2], e[3])
        elif op == "-":
            free(e[1])
        elif op == "s":                     # a resize: FSDP2's unsharded parameters are freed and re-made so
            free(e[1])
            if not on_host:
                malloc(e[1], e[3], e[4])
        elif op == "r" and _kind(e[4]) in OFFLOADED:
            free(e[1])
    return log, count
