"""The step of a deep model of identical blocks, from a trace of a shallower twin: trace `TRACED` blocks, then
repeat a middle block's events as often as the real model has more blocks.

FSDP2 runs a stack of identical blocks one unit at a time: every block between the first few and the last few
allocates, relabels and frees the same bytes in the same order, forward and backward, and refers to the
tensors of its neighbours (the hidden state of the block before, the gradient of the block after) in the same
way. The tracker records the traced step as events (fsdplab/_torch_private/tracker.py, `record_blocks`); here
the events of block m are cut out, forward and backward, and inserted again for each extra block, each copy
with fresh tensors that refer to their own neighbours; outside the blocks (the optimizer step, zero_grad,
what was alive before the step), whatever belongs to block m is repeated in place. The peaks, the categories,
the memory over the step and the caching allocator's replay then come from the deeper step's events exactly
as the tracker computes them while it traces.

It is used only where it can be checked: the blocks are FSDP units, all alike (one layer type, every block or
no block checkpointed), the model has at least `MIN_DEPTH` of them, and in the traced step the middle block's
events match those of its neighbours once renumbered. Otherwise, or with FSDPLAB_TRACE_ALL_BLOCKS=1, every block
is traced. tests/unit/test_block_repeat.py compares the repeated step with a full trace, event by event.
"""

from __future__ import annotations

import copy
import os
import re
from collections import defaultdict

TRACED = 8          # blocks traced: the first few and the last few differ from the rest
MIN_DEPTH = 12      # repeat only where it saves something


def shallow_twin(setting, config):
    """`config` with `TRACED` blocks, or None where a repeated block would not be exact or would save nothing."""
    if os.environ.get("FSDPLAB_TRACE_ALL_BLOCKS", "") not in ("", "0"):
        return None
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < MIN_DEPTH or not setting.per_block:
        return None
    if setting.grad_accum > 1:          # every block runs once per micro-batch: its windows would repeat
        return None
    if setting.strategy.startswith("fsdp1_"):    # FSDP1's flat parameters: not held to the repeated trace yet
        return None
    if setting.activation_checkpointing not in (False, True, "selective", "reentrant"):   # every k-th: blocks differ
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return None
    twin = copy.deepcopy(config)
    twin.num_hidden_layers = TRACED
    if layer_types is not None:
        twin.layer_types = list(layer_types)[:TRACED]
    return twin


class NotRepeatable(Exception):
    """The traced step does not show the same events block after block: trace every block instead."""


def block_names(root, blocks) -> list:
    names = {id(m): name for name, m in root.named_modules()}
    return [names.get(id(b)) for b in blocks]


def _block_index(names: list):
    """A function from a module name (as the tracker's moments give it) to its block's index, or None."""
    if not names or None in names:
        raise NotRepeatable("the blocks are not modules of the traced model")
    prefix = names[0][:-1]
    if any(name != f"{prefix}{i}" for i, name in enumerate(names)):
        raise NotRepeatable(f"the blocks are not named {prefix}<i>")
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(?:\.|$)")

    def index(module: str):
        found = pattern.match(module)
        return int(found.group(1)) if found else None
    return index, prefix


class _Step:
    """The traced step's events cut into the blocks' windows: ("F", k) from the first look for peaks in block
    k's forward (the events of that op included) to block k+1's, ("B", k) the same in backward."""

    def __init__(self, record: dict):
        self.events, self.preloaded = record["events"], record["preloaded"]
        self.block_of_serial = record["block_of"]
        self.n = len(record["names"])
        self.index, self.prefix = _block_index(record["names"])
        self.windows = self._windows()
        self.window_at = [None] * len(self.events)
        for key, (a, b) in self.windows.items():
            for i in range(a, b):
                self.window_at[i] = key
        self.born = {}                                  # serial -> (window, position in it)
        for i, e in enumerate(self.events):
            if (e[0] == "+" or (e[0] == "s" and e[2] == 0 and e[3])) and e[1] not in self.born:
                if self.window_at[i] is not None:
                    self.born[e[1]] = (self.window_at[i], i - self.windows[self.window_at[i]][0])
        self.preload_slot, self.preload_at, count = {}, {}, defaultdict(int)
        for serial, _, _ in self.preloaded:
            block = self.block_of_serial.get(serial)
            if block is not None:
                self.preload_slot[serial] = (block, count[block])
                self.preload_at[(block, count[block])] = serial
                count[block] += 1
        self.born_at = {place: serial for serial, place in self.born.items()}

    def _windows(self) -> dict:
        first, last = {"forward": {}, "backward": {}}, {"forward": {}, "backward": {}}
        previous = -1
        for i, e in enumerate(self.events):
            if e[0] != "c":
                continue
            phase = e[1]["phase"]
            if phase in first:
                block = self.index(e[1]["module"])
                if block is not None:
                    first[phase].setdefault(block, previous + 1)
                    last[phase][block] = i + 1
            previous = i
        if any(len(first[p]) != self.n for p in first):
            raise NotRepeatable("not every block shows in both forward and backward")
        windows = {}
        for k in range(self.n):
            windows[("F", k)] = (first["forward"][k], first["forward"][k + 1] if k + 1 < self.n else
                                 last["forward"][k])
            windows[("B", k)] = (first["backward"][k], first["backward"][k - 1] if k > 0 else last["backward"][k])
        spans = sorted(windows.values())
        if any(a >= b for a, b in spans) or any(b > c for (_, b), (c, _) in zip(spans, spans[1:])):
            raise NotRepeatable("the blocks' windows overlap or are empty")
        return windows

    def block(self, serial):
        """The block a tensor belongs to: where it was born, or (alive before the step, or made by the
        optimizer) the block the tracker gave it; None for the rest of the model."""
        if serial in self.born:
            return self.born[serial][0][1]
        return self.block_of_serial.get(serial)

    def describe(self, key) -> list:
        """The window's events with each tensor named relative to the window: the same list for two blocks
        that behave alike."""
        k = key[1]
        a, b = self.windows[key]
        out = []
        for e in self.events[a:b]:
            if e[0] == "c":
                out.append(("c", e[1]["phase"], e[1]["op"], self._relative(e[1]["module"], k)))
            elif e[0] == "m":
                out.append(e)
            else:
                out.append((e[0], self._name(e[1], k)) + e[2:])
        return out

    def _relative(self, module: str, k: int) -> str:
        block = self.index(module)
        return module if block is None else f"{block - k:+d}" + module[len(f"{self.prefix}{block}"):]

    def _name(self, serial, k):
        if serial in self.born:
            (kind, b), position = self.born[serial]
            return ("W", kind, k - b, position)
        if serial in self.preload_slot:
            b, slot = self.preload_slot[serial]
            return ("P", k - b, slot)
        return ("abs", serial)

    def counterpart(self, serial, block: int):
        """The tensor that plays `serial`'s part in `block`."""
        found = None
        if serial in self.born:
            (kind, _), position = self.born[serial]
            found = self.born_at.get(((kind, block), position))
        elif serial in self.preload_slot:
            found = self.preload_at.get((block, self.preload_slot[serial][1]))
        if found is None:
            raise NotRepeatable(f"no counterpart of a tensor in block {block}")
        return found

    def middle(self) -> int:
        """The first block whose forward matches the next block's and whose backward matches the previous one's."""
        for m in range(2, self.n - 2):
            if self.describe(("F", m)) == self.describe(("F", m + 1)) and \
                    self.describe(("B", m)) == self.describe(("B", m - 1)):
                return m
        raise NotRepeatable("no middle block behaves like its neighbours")


def deepen(record: dict, depth: int):
    """The events of the traced step with its middle block repeated until the model has `depth` blocks:
    (preloaded, events), the same shapes as the record's, with fresh serials."""
    step = _Step(record)
    m, extra = step.middle(), depth - step.n
    if extra < 0:
        raise NotRepeatable("the traced model is deeper than the real one")

    def traced(J):                  # the traced block whose events block J of the deep model repeats
        return J if J < m else (m if J <= m + extra else J - extra)

    def placed(serial, b):          # where a tensor of traced block b that is not repeated sits in the deep model
        return (serial, b if b < m else b + extra)

    def seen_from_block(serial, t, J):
        """A tensor as the events of traced block t, replayed as block J, refer to it."""
        b = step.block(serial)
        if b is None:
            return (serial, None)
        if serial not in step.born and serial not in step.preload_slot:
            raise NotRepeatable("a block refers to a tensor the optimizer made")
        target = J - (t - b)
        source = traced(target)
        return (serial if source == b else step.counterpart(serial, source), target)

    def renamed(module, t, J):
        block = step.index(module)
        if block is None:
            return module
        return f"{step.prefix}{J - (t - block)}" + module[len(f"{step.prefix}{block}"):]

    out = []

    def window(key, J):
        a, b = step.windows[key]
        t = key[1]
        for e in step.events[a:b]:
            if e[0] == "c":
                out.append(("c", dict(e[1], module=renamed(e[1]["module"], t, J))))
            elif e[0] == "m":
                out.append(e)
            else:
                out.append((e[0], seen_from_block(e[1], t, J)) + e[2:])

    def outside(events):
        """Events outside the blocks' windows: a run of events of block m is repeated, once per copy, in the
        order the neighbouring blocks come (the optimizer's foreach ops go first to last, freeing a list goes
        last to first)."""
        owner = [None if e[0] in "cm" else step.block(e[1]) for e in events]
        i = 0
        while i < len(events):
            e = events[i]
            if owner[i] != m:
                out.append(e if e[0] in "cm" else
                           (e[0], placed(e[1], owner[i]) if owner[i] is not None else (e[1], None)) + e[2:])
                i += 1
                continue
            j = i
            while j < len(events) and owner[j] == m:
                j += 1
            before = next((o for o in reversed(owner[:i]) if o is not None), None)
            after = next((o for o in owner[j:] if o is not None), None)
            descending = (before is not None and before > m) or (after is not None and after < m)
            for J in (range(m + extra, m - 1, -1) if descending else range(m, m + extra + 1)):
                out.extend((x[0], (x[1], J)) + x[2:] for x in events[i:j])
            i = j

    position = 0
    for a, key in sorted((a, key) for key, (a, _) in step.windows.items()):
        outside(step.events[position:a])
        kind, t = key
        if t != m:
            window(key, t if t < m else t + extra)
        else:
            for J in (range(m, m + extra + 1) if kind == "F" else range(m + extra, m - 1, -1)):
                window(key, J)
        position = step.windows[key][1]
    outside(step.events[position:])

    preloaded, i = [], 0
    while i < len(step.preloaded):
        serial, size, kind = step.preloaded[i]
        if step.block_of_serial.get(serial) != m:
            b = step.block_of_serial.get(serial)
            preloaded.append(((placed(serial, b) if b is not None else (serial, None)), size, kind))
            i += 1
            continue
        j = i
        while j < len(step.preloaded) and step.block_of_serial.get(step.preloaded[j][0]) == m:
            j += 1
        for J in range(m, m + extra + 1):
            preloaded.extend(((s, J), size, kind) for s, size, kind in step.preloaded[i:j])
        i = j

    numbers = {}
    renumber = lambda key: numbers.setdefault(key, len(numbers))   # noqa: E731
    preloaded = [(renumber(s), size, kind) for s, size, kind in preloaded]
    events = [e if e[0] in "cm" else (e[0], renumber(e[1])) + e[2:] for e in out]
    return preloaded, events, m
