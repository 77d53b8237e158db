"""A model of PyTorch's CUDA caching allocator: replay a step's allocations and frees, get *reserved* memory.

The exact estimate is the allocator's *active* peak (the bytes of live tensors). What `torch.cuda.max_memory_reserved`
reports, and most published figures, is higher: the allocator rounds every request, carves them out of segments it
obtained from cudaMalloc, and keeps freed blocks cached for reuse instead of returning them. This module follows
the rules of c10/cuda/CUDACachingAllocator.cpp (the constants are those of c10/core/AllocatorConfig.h):

- every request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large pool, whose
  segments are 20 MiB for requests under 10 MiB, and the request rounded up to 2 MiB above;
- a request takes the smallest cached block of its pool and stream that fits (best fit), split when the rest is
  at least 512 bytes (small pool) or more than 1 MiB (large pool); only when none fits is a new segment reserved;
- a freed block merges with free neighbours of its segment and stays cached: reserved memory never shrinks
  (no `empty_cache`, and no out-of-memory retry, which would free cached segments first);
- blocks belong to the stream that allocated them. FSDP2 allocates its all-gather and reduce-scatter buffers on
  streams of their own, so a traced tensor's category decides its stream here (see `fsdplab._torch_private.STREAM_OF`);
- `expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): one segment per pool and stream
  that grows at its end, in 2 MiB pages (small pool) or 20 MiB pages (large pool), and blocks split at 512 bytes.

Not modelled: `max_split_size_mb`, `roundup_power2_divisions`, the garbage-collection threshold, CUDA graphs.
"""

from __future__ import annotations

import bisect
import itertools
import math


MIN_BLOCK = 512                    # kMinBlockSize
SMALL_SIZE = 1 << 20               # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20             # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 << 20            # kLargeBuffer: segment for requests between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20         # kMinLargeAlloc
ROUND_LARGE = 2 << 20              # kRoundLarge



def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * math.ceil(size / MIN_BLOCK)


def segment_size(size: int) -> int:
    """cudaMalloc's size for a (rounded) request that no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next", "pool")

    def __init__(self, segment, offset, size, pool):
        self.segment, self.offset, self.size, self.pool = segment, offset, size, pool
        self.free, self.prev, self.next = True, None, None

    def key(self):
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """Replays malloc / free. `reserved` and `allocated` (bytes, rounded as the allocator rounds), and their peaks."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.segments = 0
        self.record = False      # keep a trace for PyTorch's memory visualizer (`snapshot`)
        self.trace = []
        self._segment_info = {}  # segment -> [address, mapped size, stream, small?, first block]
        self._next_address = 0x7F0000000000
        self._free = {}          # (stream, small?) -> sorted [(size, segment, offset)]
        self._by_key = {}        # (size, segment, offset) -> free block
        self._live = {}          # caller's key -> allocated block
        self._tail = {}          # expandable: (stream, small?) -> (segment, mapped bytes, last block)
        self._ids = itertools.count()

    # -- the free lists
    def _add_free(self, block):
        block.free = True
        bisect.insort(self._free.setdefault(block.pool, []), block.key())
        self._by_key[block.key()] = block

    def _drop_free(self, block):
        free = self._free[block.pool]
        del free[bisect.bisect_left(free, block.key())]
        del self._by_key[block.key()]

    def _event(self, action, block_or_address, size, stream, label=None):
        address = (block_or_address if isinstance(block_or_address, int)
                   else self._segment_info[block_or_address.segment][0] + block_or_address.offset)
        frames = [{"filename": label, "line": 0, "name": label}] if label else []
        self.trace.append({"action": action, "addr": address, "size": size, "stream": stream, "frames": frames,
                           "time_us": len(self.trace)})

    def _segment(self, pool, size):
        """A new segment (its id), placed at the next free address."""
        segment = next(self._ids)
        span = (1 << 40) if self.expandable else size
        self._segment_info[segment] = [self._next_address, size, pool[0], pool[1], None]
        self._next_address += span
        self.segments += 1
        return segment

    def malloc(self, key, nbytes: int, stream: int = 0, label=None) -> int:
        """Allocate `nbytes` for `key` (any hashable id); returns the rounded size. `label` names it in a trace."""
        if key in self._live:
            raise ValueError(f"{key!r} is allocated already: free it first.")
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE)
        free = self._free.get(pool, [])
        at = bisect.bisect_left(free, (size, -1, -1))
        if at < len(free):
            block = self._by_key[free[at]]
            self._drop_free(block)
        else:
            block = self._new_block(pool, size)
        rest = block.size - size
        if rest >= MIN_BLOCK if (pool[1] or self.expandable) else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._add_free(tail)
            if self.expandable and tail.next is None:
                segment, mapped, _ = self._tail[pool]
                self._tail[pool] = (segment, mapped, tail)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if self.record:
            self._event("alloc", block, block.size, stream, label)
        return block.size

    def _new_block(self, pool, size):
        if not self.expandable:
            total = segment_size(size)
            self.reserved += total
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = _Block(self._segment(pool, total), 0, total, pool)
            self._segment_info[block.segment][4] = block
            if self.record:
                self._event("segment_alloc", self._segment_info[block.segment][0], total, pool[0])
            return block
        # One growing segment per pool: extend it (the free block at its end, if any, grows into the new pages).
        page = SMALL_BUFFER if pool[1] else LARGE_BUFFER
        segment, mapped, last = self._tail.get(pool, (None, 0, None))
        if segment is None:
            segment = self._segment(pool, 0)
        have = last.size if last is not None and last.free else 0
        grow = page * math.ceil((size - have) / page)
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._segment_info[segment][1] += grow
        if self.record:
            self._event("segment_map", self._segment_info[segment][0] + mapped, grow, pool[0])
        if have:
            self._drop_free(last)
            last.size += grow
            block = last
        else:
            block = _Block(segment, mapped, grow, pool)
            block.prev = last
            if last is not None:
                last.next = block
            else:
                self._segment_info[segment][4] = block
        self._tail[pool] = (segment, mapped + grow, block)
        return block

    def free(self, key) -> None:
        block = self._live.pop(key)
        self.allocated -= block.size
        if self.record:
            for action in ("free_requested", "free_completed"):
                self._event(action, block, block.size, block.pool[0])
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._drop_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        if self.expandable and block.next is None:
            segment, mapped, _ = self._tail[block.pool]
            if segment == block.segment:
                self._tail[block.pool] = (segment, mapped, block)
        self._add_free(block)


    def snapshot(self, labels: dict | None = None) -> dict:
        """The allocator's state in the format of `torch.cuda.memory._snapshot()`: every segment with its blocks,
        and the trace of the recorded events. PyTorch's memory visualizer (pytorch.org/memory_viz) opens it,
        pickled; `torch.cuda._memory_viz` reads it too."""
        labels = labels or {}
        names = {id(block): key for key, block in self._live.items()}
        segments = []
        for segment, (address, total, stream, small, first) in self._segment_info.items():
            blocks, block, active = [], first, 0
            while block is not None:
                label = labels.get(names.get(id(block)))
                blocks.append({"address": address + block.offset, "size": block.size, "requested_size": block.size,
                               "state": "inactive" if block.free else "active_allocated",
                               "frames": [{"filename": label, "line": 0, "name": label}] if label else []})
                active += 0 if block.free else block.size
                block = block.next
            segments.append({"device": 0, "address": address, "total_size": total, "allocated_size": active,
                             "active_size": active, "requested_size": active, "stream": stream,
                             "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
                             "is_expandable": self.expandable, "frames": [], "blocks": blocks})
        return {"segments": segments, "device_traces": [self.trace],
                "allocator_settings": {"expandable_segments": self.expandable, "model": "fsdplab.memory.allocator"}}


def replay(events, preloaded: int = 0, expandable_segments: bool = False, snapshot: bool = False) -> dict:
    """Replay one training step's events, [("+", key, bytes, stream) | ("-", key)], through the model, twice:
    the first `preloaded` events allocate what was alive when the step began; the second pass (the next step)
    finds the blocks the first one cached, as every step after the first does. A free of a key this pass did
    not allocate frees the previous pass's (what the step before left alive); one of a key never allocated is
    ignored. An event's fifth item, if any, labels it in the trace. Returns {"reserved": bytes, "allocated_peak":
    bytes, "segments": count}, and with `snapshot` the memory visualizer's snapshot of the second pass."""
    alloc = CachingAllocator(expandable_segments)
    labels = {}
    for n, todo in ((1, events), (2, events[preloaded:])):
        alloc.record = snapshot and n == 2
        for event in todo:
            if event[0] == "+":
                label = event[4] if len(event) > 4 else None
                alloc.malloc((n, event[1]), event[2], event[3] if len(event) > 3 else 0, label)
                labels[(n, event[1])] = label
            elif (n, event[1]) in alloc._live:
                alloc.free((n, event[1]))
            elif (n - 1, event[1]) in alloc._live:
                alloc.free((n - 1, event[1]))
    result = {"reserved": alloc.reserved, "allocated_peak": alloc.peak_allocated, "segments": alloc.segments}
    if snapshot:
        result["snapshot"] = alloc.snapshot(labels)
    return result


# What nvidia-smi shows beyond the allocator's reserved memory (fsdplab.memory.gpu_measured has the run):
# - the CUDA context with torch's kernels loaded, cuBLAS's workspace and the rest of what torch holds outside the
#   caching allocator: 877,461,504 B (0.82 GiB) measured on an H200 at world size 1 (torch 2.11.0+cu130, CUDA
#   13.0, 2026-12-04: mem_get_info's total - free less memory_reserved, the same on every FSDP2 setting). Other
#   GPUs, drivers and CUDA releases differ by a few hundred MiB.
# - NCCL's communicator. At world size 1 FSDP2 issues no collective and none is made (the figure above);
#   replicate() makes one: 488 MiB more outside the allocator, measured on the same H200 at world
#   size 1. At world size 2 and more it holds buffers per channel and peer (NCCL_BUFFSIZE = 4 MiB for the Simple
#   protocol, plus LL and LL128): NCCL_BYTES is an assumption there, never measured (NVLS buffers on NVSwitch
#   systems can take more).
# The two figures of that run (fsdplab.memory.gpu_measured keeps them with the rest of its rows).
OUTSIDE_ALLOCATOR_FSDP_WS1 = 877461504
OUTSIDE_ALLOCATOR_AFTER_NCCL_WS1 = 1389166592
CUDA_CONTEXT_BYTES = OUTSIDE_ALLOCATOR_FSDP_WS1
NCCL_ONE_RANK_BYTES = OUTSIDE_ALLOCATOR_AFTER_NCCL_WS1 - OUTSIDE_ALLOCATOR_FSDP_WS1
NCCL_BYTES = 512 << 20
CUDA_CONTEXT_SOURCE = "measured on an H200 at world size 1"


def nccl_share(setting=None) -> tuple[int, str]:
    """(bytes NCCL holds on a GPU for `setting`, where the figure comes from)."""
    if setting is not None and setting.world_size == 1:
        if setting.strategy in ("ddp", "replicate"):     # DDP's all-reduce makes a communicator too
            return NCCL_ONE_RANK_BYTES, "measured on an H200 at world size 1 (replicate)"
        return 0, "none: FSDP2 issues no collective at world size 1 (measured on an H200)"
    return NCCL_BYTES, "assumed, not measured: NCCL's buffers at world size 2 and more depend on GPUs and links"


def allocator_view(replayed: dict, setting=None) -> dict:
    """A report's `gpu_view`: reserved memory with and without expandable segments (replayed), and what
    nvidia-smi would show on top: the CUDA context as measured, NCCL's share (measured at world size 1,
    assumed above it), each with its source."""
    if not replayed:
        return {}
    nccl, nccl_source = nccl_share(setting)
    view = {"reserved": replayed["reserved"], "reserved_expandable_segments": replayed["reserved_expandable"],
            "cuda_context": CUDA_CONTEXT_BYTES, "cuda_context_source": CUDA_CONTEXT_SOURCE,
            "nccl": nccl, "nccl_source": nccl_source,
            "nvidia_smi": replayed["reserved"] + CUDA_CONTEXT_BYTES + nccl,
            "segments": replayed["segments"], "allocated_peak_rounded": replayed["allocated_peak"]}
    if replayed.get("offload"):
        view["offload"] = replayed["offload"]
    return view
