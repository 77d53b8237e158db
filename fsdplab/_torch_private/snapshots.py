"""The tracker's snapshots as numbers: the six categories of a snapshot, its raw categories, the split of the live
bytes under CPU offload, the memory over a step, and the replay of a step recorded as events (what
fsdplab.memory.block_repeat builds from a traced one) into the same peaks the tracker computes while it traces."""

from __future__ import annotations

from . import CATEGORIES, OFFLOADED, STREAM_OF, TRACKER_TO_CATEGORY


def category_totals(snapshot: dict, skip=()) -> dict:
    """The six categories' bytes in a tracker snapshot (raw keys mapped by TRACKER_TO_CATEGORY), less `skip`."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for key, value in snapshot.items():
        name = getattr(key, "value", key)
        if name == "Total" or name in skip:
            continue
        totals[TRACKER_TO_CATEGORY.get(name, "other")] += value
    return totals


def raw_categories(snapshot: dict) -> dict:
    """A tracker snapshot by the raw categories' names ("Total" among them), in whole bytes."""
    return {getattr(k, "value", k): int(v) for k, v in snapshot.items()}


def split_categories(snap: dict, key_category: dict, offloaded: set, category_max: dict, offload_category_max: dict):
    """The live bytes of `snap` by category (cats), by category of what stays on the device under offload
    (kept), and the offloaded bytes (off); raises each category's maximum to them."""
    cats, kept, off = {}, {}, 0
    for k, v in snap.items():
        c = key_category.get(k)
        if c is None or not v:
            continue
        cats[c] = cats.get(c, 0) + v
        if k in offloaded:
            off += v
        else:
            kept[c] = kept.get(c, 0) + v
    for found, maxima in ((cats, category_max), (kept, offload_category_max)):
        for c, v in found.items():
            if v > maxima.get(c, 0):
                maxima[c] = v
    return cats, kept, off


def memory_over_step(rows: list, offload: bool = False, points: int = 600) -> dict:
    """The bytes per category at each change of `rows` ((phase, categories, kept on the device under offload),
    the tracker's timeline): at most `points`, evenly picked, the peak always among them, with the phase of each:
    {"phase": [...], "<category>": [...]}."""
    if not rows:
        return {}
    totals = [sum((kept if offload else cats).values()) for _, cats, kept in rows]
    top = max(range(len(rows)), key=totals.__getitem__)
    # Every phase keeps its first and last event: a short optimizer step (few, large allocations) shows too.
    edges = {i for i in range(len(rows)) if i in (0, len(rows) - 1) or rows[i][0] != rows[i - 1][0]
             or rows[i][0] != rows[i + 1][0]}
    keep = sorted(set(range(0, len(rows), max(1, len(rows) // points))) | {top} | edges)
    out = {"phase": [rows[i][0] for i in keep]}
    for c in CATEGORIES:
        out[c] = [int((rows[i][2] if offload else rows[i][1]).get(c, 0)) for i in keep]
    return out


def replay_step(tracker, preloaded, events, offload: bool = False):
    """What the tracker's `_update_peak_stats` and allocation log would have given for a step recorded as `events`
    (fsdplab.memory.block_repeat makes such a step from a traced one): (peak, six categories at the peak, raw
    categories at the peak, each category's peak, the moment of the peak, the memory over the step, the
    allocation log or None under offload, {mark name or "end": raw categories then})."""
    if len(tracker.start) != 1:
        raise ValueError("a recorded step replays on one device")
    [start] = tracker.start.values()
    snap = dict.fromkeys(start, 0)
    log = []
    for serial, size, kind in preloaded:
        snap[kind] += size
        snap["Total"] += size
        log.append(("+", serial, size, STREAM_OF.get(kind.value, 0), kind.value))
    preloaded_count = len(log)
    key_category, offloaded = tracker.key_category, tracker.offloaded_keys
    peak, peak_snap, peak_at = snap["Total"], dict(snap), {}
    offload_peak, offload_snap, offload_at = 0, {}, {}
    category_max, offload_category_max, rows, marks = {}, {}, [], {}
    for e in events:
        op = e[0]
        if op == "+" or op == "-":
            size = e[2] if op == "+" else -e[2]
            snap[e[3]] += size
            snap["Total"] += size
            if e[2]:
                log.append(("+", e[1], e[2], STREAM_OF.get(e[3].value, 0), e[3].value) if op == "+" else ("-", e[1]))
        elif op == "s":
            snap[e[4]] += e[3] - e[2]
            snap["Total"] += e[3] - e[2]
            if e[2]:
                log.append(("-", e[1]))
            if e[3]:
                log.append(("+", e[1], e[3], STREAM_OF.get(e[4].value, 0), e[4].value))
        elif op == "r":
            snap[e[3]] -= e[2]
            snap[e[4]] += e[2]
        elif op == "m":
            marks[e[1]] = raw_categories(snap)
        else:                                       # "c": as _update_peak_stats
            moment = e[1]
            if peak < snap["Total"]:
                peak, peak_snap, peak_at = snap["Total"], dict(snap), moment
            cats, kept, off = split_categories(snap, key_category, offloaded, category_max, offload_category_max)
            if snap["Total"] - off > offload_peak:
                offload_peak, offload_snap, offload_at = snap["Total"] - off, dict(snap), moment
            rows.append((moment["phase"], cats, kept))
    marks["end"] = raw_categories(snap)
    if offload:
        numbers = (int(offload_peak), category_totals(offload_snap, skip=OFFLOADED), raw_categories(offload_snap),
                   offload_at)
    else:
        numbers = (int(peak_snap["Total"]), category_totals(peak_snap), raw_categories(peak_snap), peak_at)
    found = offload_category_max if offload else category_max
    timeline = memory_over_step(rows, offload)
    return (*numbers[:3], {c: int(found.get(c, 0)) for c in CATEGORIES}, numbers[3], timeline,
            None if offload else (log, preloaded_count), marks)
