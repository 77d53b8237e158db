"""Lesson 10 (hangs, desyncs and stragglers) only: planting a fault and recording what each tool says.

- `plant(cluster, source, timeout)`: run a planted fault on the ranks, catch what the lab raises, time it, write
  every rank's flight recorder dump, and leave a working group behind (restarting it when needed);
- `analyze(folder)`: torch's flight recorder analyzer (`torchfrtrace`) on those dumps, its printed verdict;
  `repair_group_names`: the fix its gloo dumps need in torch 2.13 (see the function);
- `default_timeouts()`: how long torch waits in a collective by default, the wait a learner sees without the lab;
- `straggler_score`, `compute_seconds`: a rank's own work per step out of `fsdplab.timeline` traces;
- `print_witnesses`, `print_straggler`, `plot_straggler`: what sections 3 and 4 print and draw;
- `reference_step`, `hang_batch` and the rank side of section 5's code exercise (a training step that hangs);
- the exercise checkers.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import re
import statistics
import time
from pathlib import Path

from .checkers import close, exercise
from ..owned_folders import fresh_owned
from .. import RankDied, RankError, RankHang
from ..timeline import draw_timeline, fit_labels


def default_timeouts() -> dict:
    """Seconds a collective waits by default before torch gives up: gloo (and the default for any backend) and
    NCCL, read from the installed torch (NCCL: None where torch was built without it)."""
    from torch.distributed import constants

    nccl = constants.default_pg_nccl_timeout      # None in a torch built without NCCL (the CPU wheels)
    return {"gloo": constants.default_pg_timeout.total_seconds(), "nccl": nccl.total_seconds() if nccl else None}


def plant(cluster, source: str, *, timeout: float, dump_dir=None) -> dict:
    """Run `source` on every rank (a planted fault) and record what happened: "outcome" (RankHang, RankError,
    RankDied or "no error"), "seconds" until the lab said so, "ranks" it names, "message" (its first lines),
    "states" (RankHang: what each rank was doing), "dumps" (rank -> flight recorder file in `dump_dir`, written
    before any restart), "restart_s". The group is restarted when the fault left it unusable."""
    # Refused before the fault is planted: only a folder the lab made is emptied.
    if dump_dir is not None:
        dump_dir = fresh_owned(dump_dir, what="dump_dir")
    t0 = time.perf_counter()
    record = {"outcome": "no error", "ranks": [], "message": "", "states": {}, "dumps": {}, "restart_s": None}
    try:
        cluster.execute(source, timeout=timeout, quiet=True)
    except RankHang as err:
        record.update(outcome="RankHang", ranks=err.ranks, message=err.summary, states=dict(err.states))
    except RankError as err:
        lines = [f"rank {r}: {name}: {message}" for r, (name, message, _) in err.errors.items()]
        lines += [str(state) for state in err.waiting.values()]     # "rank 0 waits in all_reduce #1 ..."
        record.update(outcome="RankError", ranks=sorted(err.errors), message="\n".join(lines),
                      states=dict(err.waiting))
    except RankDied as err:
        record.update(outcome="RankDied", ranks=sorted(err.exits), message=str(err).splitlines()[0])
    record["seconds"] = time.perf_counter() - t0
    if dump_dir is not None:
        record["dumps"] = {r: str(p) for r, p in cluster.flight_recorder_dumps(dump_dir).items()}
    if cluster.broken:
        t1 = time.perf_counter()
        cluster.restart(quiet=True)     # the caller reports the restart with the fault (restart_s)
        record["restart_s"] = time.perf_counter() - t1
    return record


def repair_group_names(folder, into) -> Path:
    """Copy the dumps in `folder` to `into`, with the default group named in `pg_config` as the entries name it.

    torch 2.13's gloo dumps name the default group "" in `pg_config` but "0" in every entry, and the analyzer
    looks entries up by that name: on the raw files it stops with KeyError ('0', 0). Only that entry is renamed;
    NCCL dumps already agree, and for them this copies the files unchanged."""
    into = fresh_owned(into, what="the repaired dumps' folder")
    for path in sorted(Path(folder).glob("rank_*")):
        dump = pickle.loads(path.read_bytes())
        config = dump.get("pg_config", {})
        default = [tuple(e["process_group"]) for e in dump.get("entries", []) if tuple(e["process_group"])[0] == "0"]
        if "" in config and "0" not in config and default:
            config["0"] = {**config.pop(""), "name": "0", "desc": default[0][1]}
        (into / path.name).write_bytes(pickle.dumps(dump))
    return into


def analyze(folder) -> str:
    """What torch's flight recorder analyzer reports for the dumps in `folder` (files rank_<r>), run in this
    process (its report goes to the "Flight Recorder" logger, caught here); if it fails, the exception it raised,
    as one line that starts with "analyzer failed"."""
    import logging

    out = io.StringIO()
    catch = logging.StreamHandler(out)
    log = logging.getLogger("Flight Recorder")
    kept, log.handlers = log.handlers, [catch]
    collecting = gc.isenabled()   # the analyzer turns Python's garbage collector off for good (a command's habit)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            from torch.distributed.flight_recorder import fr_trace   # says "tabulate is not installed" once

            fr_trace.main([str(folder), "-p", "rank_"])
    except SystemExit:
        pass
    except Exception as err:  # noqa: BLE001 - what it raised is what the lesson shows
        return f"analyzer failed: {type(err).__name__}: {err}"
    finally:
        log.handlers = kept
        if collecting:            # this kernel's collector stays on
            gc.enable()
    lines = [line for line in out.getvalue().splitlines() if line.strip() and "tabulate is not installed" not in line]
    return "\n".join(lines)


def report_lines(text: str) -> list:
    """The analyzer's report without the Python frames below the user's code (the lab's engine, asyncio)."""
    keep, frames = [], False
    for line in text.splitlines():
        if line.startswith("collective stack trace"):
            frames = True
            keep.append(line)
            continue
        if frames and (" at " in line) and ("<ranks source" not in line):
            continue
        keep.append(line)
    return keep


def analyzer_verdict(text: str) -> str:
    """The analyzer's finding in one line: the error message or the "not all ranks joining" line it printed."""
    for line in text.splitlines():
        if line.startswith(("error msg:", "Not all ranks joining", "analyzer failed")):
            return line.replace("error msg: ", "")
    for line in text.splitlines():
        if line.startswith("missing ranks"):
            return line
    return "no problem found" if text else "(no output)"


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+), TensorShape=\[([^\]]*)\], TensorDtypes=(\w+)")


def detail_summary(message: str) -> str:
    """DETAIL's mismatch message cut to what differs: each rank's collective type, shapes and dtypes."""
    found = {}
    for rank, seq, op, shape, dtype in _FINGERPRINT.findall(message):
        found.setdefault(int(rank), f"rank {rank}: {op} #{seq} shape [{shape}] {dtype}")
    if found:
        return "mismatch: " + "; ".join(found[r] for r in sorted(found))
    return message.splitlines()[0] if message else ""


# --- stragglers --------------------------------------------------------------------------------------------

def compute_seconds(trace: dict) -> float:
    """Seconds a rank spent computing in one traced step (its compute row: forward, backward, optimizer)."""
    spans = sorted((e["start_us"], e["end_us"]) for e in trace["events"] if e["row"] == "compute")
    total, end = 0.0, float("-inf")
    for s, e in spans:                      # nested ranges (a block inside the root) count once
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e6


def step_seconds(trace: dict) -> float:
    """Seconds from the first to the last event of a rank's traced step, its collectives included."""
    events = trace["events"]
    return (max(e["end_us"] for e in events) - min(e["start_us"] for e in events)) / 1e6


def straggler_score(values: list) -> float:
    """Slowest over median: 1.0 when every rank does the same work in the same time."""
    return max(values) / statistics.median(values)


# --- what the lesson prints and draws ----------------------------------------------------------------------

def print_witnesses(names, lab: dict, analyzer: dict, detail: dict, missing_dumps: dict) -> None:
    """Section 3's table: per fault, what the lab, torch's analyzer and DETAIL said, and how soon."""
    for name in names:
        if name not in lab:
            print("skipped: 1 rank (the faults need 2 or more)")
            break
        d = detail[name]
        print(f"--- {name}")
        print(f"    the lab    {lab[name]['outcome']} after {lab[name]['seconds']:.1f} s: "
              + lab[name]["message"].splitlines()[0])
        print("    analyzer   " + (analyzer_verdict(analyzer[name]) if name in analyzer
                                    else f"nothing: no dump from rank(s) {missing_dumps[name]}"))
        print(f"    DETAIL     {d['outcome']} after {d['seconds']:.2f} s: {detail_summary(d['message'])}")


def print_straggler(compute: dict, step_s: dict, *, slow_rank: int, slowest: int, score: float,
                    score_even: float, expected: float, grew: list, delay: float, spread: float) -> None:
    """Section 4's table: each rank's compute and step time without and with the straggler, then what they show."""
    world_size = len(compute["even"])
    print(f"{'rank':>4} {'compute, even':>14} {'compute, straggler':>19} {'step, even':>11} {'step, straggler':>16}")
    for r in range(world_size):
        mark = "  <- straggler" if r == slow_rank and world_size > 1 else ""
        print(f"{r:>4} {compute['even'][r] * 1e3:>11.1f} ms {compute['straggler'][r] * 1e3:>16.1f} ms "
              f"{step_s['even'][r] * 1e3:>8.1f} ms {step_s['straggler'][r] * 1e3:>13.1f} ms" + mark)
    print(f"straggler score (slowest compute / median): {score:.2f}, the slowest compute rank {slowest}'s, with "
          f"rank {slow_rank} slowed (the planted work alone would give {expected:.2f}); {score_even:.2f} without")
    grew_ms = f"{min(grew) * 1e3:+.0f}" + (f" to {max(grew) * 1e3:+.0f}" if len(grew) > 1 else "")
    print(f"the fast ranks' steps grew by {grew_ms} ms for the {delay * 1e3:.0f} ms one other rank added (how much "
          f"depends on the machine's load): each of their steps waits in collectives for that work"
          if world_size > 1 else "1 rank: nobody waits for anybody")
    print(f"with the straggler the ranks' steps take {min(step_s['straggler']) * 1e3:.1f}-"
          f"{max(step_s['straggler']) * 1e3:.1f} ms: {spread:.1%} apart, against "
          f"{max(compute['straggler']) / min(compute['straggler']):.1f}x in compute")


def plot_straggler(traced: list, *, slow_rank: int, delay: float, step_s: dict | None = None):
    """Section 4's figure: one traced step per rank, without and with the straggler; returns it. With `step_s`
    (per kind, each rank's untraced median step), each title also gives the untraced steps' range."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 1.2 * 2 * len(traced) + 2.5))
    slowed = f"rank {slow_rank} does {delay * 1e3:.0f} ms more in layer 0's forward"
    for ax, kind, title in ((axes[0], "even", "every rank does the same work"), (axes[1], "straggler", slowed)):
        # every bar gets its name here; fit_labels keeps the names that fit inside their bars
        draw_timeline([t[kind] for t in traced], ax=ax, title=f"One step, {title}", label_min_frac=0.0)
        end = ax.dataLim.x1                   # each panel its own step, from its start to its end: times on both
        ax.set_xlim(0, end * 1.02)
        untraced = ""
        if step_s is not None:
            low, high = min(step_s[kind]) * 1e3, max(step_s[kind]) * 1e3
            untraced = f" (untraced: {low:.0f} ms)" if round(low) == round(high) else \
                f" (untraced: {low:.0f}-{high:.0f} ms)"
        ax.set_title(f"One traced step of {end:.0f} ms{untraced}, {title}")
    fig.tight_layout()
    for ax in axes:
        fit_labels(ax)
    return fig


# --- exercise ----------------------------------------------------------------------------------------------

@exercise("10-step-time")
def _step_time(answer, *, measured, predicted=None):
    """A fast rank's step time with the straggler, against the measured one or, when given, `predicted`
    (the even step plus the straggler's extra work: the reasoning asked for, which timing noise on shared CPU
    ranks can put more than 10% from the measurement)."""
    hint = ("every collective waits for the slowest rank: each step of every rank takes about the "
            "straggler's extra time on top of the step without it.")
    # 10%: refuses 1.5x the even step and guesses well short, which 25% took
    ok, message = close(answer, measured, rel=0.1, unit=" s", hint=hint)
    if not ok and predicted is not None and close(answer, predicted, rel=0.1)[0]:
        off_ms = (measured - predicted) * 1e3
        how = (f"{off_ms:.0f} ms more: they waited longer than the work added (a busy machine)" if off_ms > 0 else
               f"{-off_ms:.0f} ms less: their steps grew by less than the work added (ranks that share CPU "
               "cores get more of them while the slow rank sleeps)")
        return True, (f"{float(answer):g} s is within 10% of the even step plus the extra work ({predicted:.3g} s); "
                      f"the fast ranks measured {measured:.3g} s, {how}.")
    return ok, message
