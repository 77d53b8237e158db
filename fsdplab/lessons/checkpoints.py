"""Lesson 05 (checkpoints) only: where the lesson writes its files, what a rank really reads when DCP
reshards a checkpoint, a hung rank's stack in a few lines, and the lesson's exercise checkers.

`ReadCounter` runs on the ranks (inside `%%ranks` / `cluster.run`), passed to `checkpoint.load_sharded`.
`run_until_save` and `resume_after_save` run the learner's save and load on the ranks for `05-save-resume`.
`print_reads` and `print_bit_exact` print section 6's tables, `plot_resume` draws section 8's figure.
"""

from __future__ import annotations

import math
import shutil
import tempfile

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType

from .checkers import close, exercise
from .. import owned_folders
from ..settings import MIB


def lesson_folder(checkpoint_dir: str = "") -> tuple:
    """(folder, keep): an empty folder of the lab's for the checkpoints (`owned_folders.lesson_folder`)."""
    return owned_folders.lesson_folder(checkpoint_dir, "05_checkpoints", what="checkpoint_dir")


class ReadCounter(FileSystemReader):
    """DCP's FileSystemReader, counting what one rank's load costs.

    For every piece of the new shard DCP asks for, FileSystemReader opens the saved chunk that holds it,
    deserializes that chunk WHOLE (`torch.load` of its byte range), then narrows it to the overlap. So, for
    tensors: `kept_bytes` are the bytes of the rank's new shard, `loaded_bytes` the bytes of the whole
    saved chunks deserialized for them, `chunks` how many chunk reads that took. `object_bytes` counts
    pickled non-tensor values (the optimizer's param_groups, the step), read and kept whole; `file_bytes`
    is everything read from the files (tensor chunks with their torch.save framing, and the objects).
    Counts add up over every load this reader serves."""

    def __init__(self, path=".") -> None:
        super().__init__(path)
        self.kept_bytes = self.loaded_bytes = self.object_bytes = self.file_bytes = self.chunks = 0

    def read_data(self, plan, planner):
        for req in plan.items:
            self.file_bytes += self.storage_data[req.storage_index].length
            if req.type == LoadItemType.BYTE_IO:
                self.object_bytes += self.storage_data[req.storage_index].length
                continue
            self.chunks += 1
            meta = planner.metadata.state_dict_metadata[req.storage_index.fqn]
            item = meta.properties.dtype.itemsize
            chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(req.storage_index.offset))
            self.kept_bytes += math.prod(req.lengths) * item
            self.loaded_bytes += math.prod(chunk.sizes) * item
        return super().read_data(plan, planner)

    def counts(self) -> dict:
        return {"kept_bytes": self.kept_bytes, "loaded_bytes": self.loaded_bytes, "chunks": self.chunks,
                "object_bytes": self.object_bytes, "file_bytes": self.file_bytes}


def stack_ends(stack: str, outer: int = 4, inner: int = 2) -> str:
    """A stack's first `outer` and last `inner` lines, indented, with paths cut after site-packages/."""
    lines = [line.split("site-packages/")[-1] for line in stack.splitlines()]
    if len(lines) > outer + inner:
        lines = lines[:outer] + ["..."] + (lines[-inner:] if inner else [])
    return "\n".join("  " + line for line in lines)


def read_ratio(counts) -> float:
    """Tensor bytes of saved chunks deserialized per byte kept: 1.0 when every chunk a rank loads lies inside
    its new shard; more when a chunk reaches outside it (straddles an edge, or is bigger than the shard)
    and is loaded whole for part of its rows."""
    return counts["loaded_bytes"] / counts["kept_bytes"]


def n_ranks(n: int) -> str:
    """'1 rank' or 'n ranks'."""
    return f"{n} rank{'s' if n != 1 else ''}"


def print_reads(read_counts: list, total_ratio: float, shard_file_bytes: int) -> None:
    """Section 6's table of what each loading rank read (`ReadCounter.counts()` per rank), then the total."""
    print(f"{'loading rank':>12} {'tensor bytes kept':>18} {'chunks read':>12} {'bytes loaded':>13} "
          f"{'loaded/kept':>12} {'read from files':>16}")
    for r, c in enumerate(read_counts):
        print(f"{r:>12} {c['kept_bytes']:>18,} {c['chunks']:>12} {c['loaded_bytes']:>13,} "
              f"{read_ratio(c):>11.2f}x {c['file_bytes']:>16,}")
    print(f"all ranks: loaded {total_ratio:.2f}x the tensor bytes they kept; the rest was deserialized and dropped. "
          f"The checkpoint's shard files hold {shard_file_bytes:,} bytes in all.\n")


def _kind(name: str) -> str:
    """A state entry's kind: 'model parameter' or the AdamW state's name (exp_avg, exp_avg_sq, step)."""
    return "model parameter" if name.startswith("model.") else "AdamW " + name.rsplit(".", 1)[-1]


def print_bit_exact(rows: list, world: int) -> None:
    """Section 6's table of bit-exact tensors per kind (`rows` from `checkpoint.equal_state`), then the total."""
    print(f"{'kind':20} {'tensors':>8} {'elements':>10} {'bit-exact':>10}")
    for kind in sorted({_kind(r[0]) for r in rows}):
        same = [r for r in rows if _kind(r[0]) == kind]
        print(f"{kind:20} {len(same):>8} {sum(torch.Size(r[1]).numel() for r in same):>10,} "
              f"{sum(r[-1] for r in same):>10}")
    print(f"... {sum(r[-1] for r in rows)}/{len(rows)} tensors bit-exact "
          f"(model and optimizer) after loading at world size {world}")


def plot_resume(before, after, resumed, resharded, single, full_file_bytes: int, shards_saved: dict,
                shards_resharded: dict, read_counts: list, *, world_size: int, reshard_world_size: int,
                steps: int):
    """Section 8's figure: the losses around the checkpoint, the bytes each rank wrote, and what each
    loading rank kept and loaded; returns it."""
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(17, 4.4))
    before_x, after_x = range(steps), range(steps, 2 * steps)
    ax.plot(before_x, before, "k-o", ms=3, label=f"trained on {n_ranks(world_size)}")
    ax.plot(after_x, after, "k-", lw=3, alpha=0.35, label="uninterrupted")
    ax.plot(after_x, resumed, "C0o", ms=7, mfc="none", label=f"resumed on {n_ranks(world_size)}")
    ax.plot(after_x, resharded, "C1x", ms=7, label=f"resumed on {n_ranks(reshard_world_size)}")
    ax.plot(after_x, single, "C2+", ms=9, label="resumed in 1 process")
    ax.axvline(steps - 0.5, color="grey", ls="--")
    ax.text(steps - 0.4, max(before), " checkpoint", va="top")
    ax.set(title="Loss before and after resuming from a DCP checkpoint", xlabel="optimizer step",
           ylabel="loss (cross-entropy, nats)")
    ax.legend(fontsize=8, loc="lower left")
    bars = ([("full\nfile\nrank 0", full_file_bytes, "C3")]
            + [(f"DCP\nrank {r}\nof {world_size}", b, "C0") for r, b in shards_saved.items()]
            + [(f"DCP\nrank {r}\nof {reshard_world_size}", b, "C1") for r, b in shards_resharded.items()])
    bx.bar(range(len(bars)), [b / MIB for _, b, _ in bars], color=[c for _, _, c in bars])
    bx.set_xticks(range(len(bars)), [n for n, _, _ in bars], fontsize=7)
    bx.set(title="Checkpoint bytes written per rank\n(full file: weights only; DCP: weights + AdamW state)",
           ylabel="MiB written by the rank")
    x = range(len(read_counts))
    cx.bar([i - 0.2 for i in x], [c["kept_bytes"] / MIB for c in read_counts], 0.4, color="C1",
           label="kept: its new shard")
    cx.bar([i + 0.2 for i in x], [c["loaded_bytes"] / MIB for c in read_counts], 0.4, color="C1", alpha=0.4,
           label="loaded: the saved chunks it overlaps, whole")
    cx.set_xticks(list(x), [f"rank {r}\n(of {reshard_world_size})" for r in x], fontsize=7)
    cx.set(title=f"Loading the checkpoint of {n_ranks(world_size)} on {n_ranks(reshard_world_size)}\n"
                 "(tensor bytes per loading rank)",
           ylabel="MiB", ylim=(0, 1.35 * max(c["loaded_bytes"] for c in read_counts) / MIB))
    cx.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


@exercise("05-reshard-reads")
def _reshard_reads(answer, *, measured, saved_ranks, loading_ranks):
    """The answer: the largest `loaded / kept` ratio of one loading rank, as measured by ReadCounter."""
    # 2%: the paper answer (whole rows, no step counters) lies about 1% from the measured ratio; 8/3 or
    # 3.25 against 2.96 are a wrong count of overlapped chunks
    return close(answer, measured, rel=0.02, unit="x",
                 hint=f"a rank loads, whole, every chunk saved by the {saved_ranks} saving rank(s) that its new "
                      f"rows overlap. Split one tensor's rows into {saved_ranks} saved chunks and {loading_ranks} "
                      f"new shards: which new shard overlaps the most saved rows, relative to its own size?")


# --- the save and the resume, written by the learner ------------------------------------------------------

def _local_state(model, optimizer) -> dict:
    """This rank's part of the model's and the optimizer's state, by name ('model.<fqn>',
    'optim.<fqn>.<exp_avg|...>'), as CPU copies."""
    def local(value):
        value = value.to_local() if hasattr(value, "to_local") else value
        return torch.as_tensor(value).detach().cpu().clone()

    names = {p: name for name, p in model.named_parameters()}
    out = {f"model.{name}": local(v) for name, v in model.state_dict().items()}
    for i, (p, per_param) in enumerate(optimizer.state.items()):
        for key, value in per_param.items():
            out[f"optim.{names.get(p, f'<parameter {i}>')}.{key}"] = local(value)
    return out


def _call_on_every_rank(fn, *args) -> dict:
    """Call the learner's `fn(*args)`; every rank learns which ranks raised: rank -> first line of the error."""
    import torch.distributed as dist

    try:
        fn(*args)
        error = None
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        lines = str(err).strip().splitlines()
        error = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    if not (dist.is_available() and dist.is_initialized()):
        return {0: error} if error else {}
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)    # every rank agrees: none goes on alone into a collective
    return {r: e for r, e in enumerate(errors) if e}


def run_until_save(save, folder: str, steps: int = 3, seed: int = 0) -> dict:
    """On a rank: train the lesson's model `steps` steps, call the learner's `save(model, optimizer, folder)`,
    then train `steps` more: the uninterrupted run. Returns this rank's state at the save, the files in
    `folder` after it, the later losses, and the ranks whose save raised."""
    from .. import checkpoint as ck
    from ..models import TinyConfig
    from ..ranks import this_world_size

    cfg, batch = TinyConfig(), 2 * this_world_size()
    model, opt = ck.sharded_tiny(cfg, seed=seed)
    ck.train_steps(model, opt, cfg, steps, global_batch=batch)
    saved = _local_state(model, opt)
    errors = _call_on_every_rank(save, model, opt, folder)
    if errors:
        return {"errors": errors}
    files = ck.checkpoint_files(folder)      # every rank has returned from its save (the call above)
    losses = ck.train_steps(model, opt, cfg, steps, start_step=steps, global_batch=batch)
    return {"errors": {}, "saved": saved, "files": files, "losses": losses}


def resume_after_save(load, folder: str, steps: int = 3, seed: int = 1) -> dict:
    """On a rank: a new model (other initial weights) and a new optimizer, the learner's
    `load(model, optimizer, folder)`, then `steps` more steps. Returns this rank's state before and after the
    load, the losses, and the ranks whose load raised."""
    from .. import checkpoint as ck
    from ..models import TinyConfig
    from ..ranks import this_world_size

    cfg, batch = TinyConfig(), 2 * this_world_size()
    model, opt = ck.sharded_tiny(cfg, seed=seed)
    fresh = _local_state(model, opt)
    errors = _call_on_every_rank(load, model, opt, folder)
    if errors:
        return {"errors": errors}
    loaded = _local_state(model, opt)
    losses = ck.train_steps(model, opt, cfg, steps, start_step=steps, global_batch=batch)
    return {"errors": {}, "fresh": fresh, "loaded": loaded, "losses": losses}


def _ranks(ranks, world: int) -> str:
    """'every rank', 'rank 1' or 'ranks 1, 2'."""
    ranks = sorted(ranks)
    if len(ranks) == world:
        return "every rank" if world > 1 else "the one rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _its(ranks) -> str:
    """The possessive for `_ranks(ranks, ...)`."""
    return "its" if len(ranks) == 1 else "their"


def _same(a, b) -> bool:
    """Tensor `a` and `b` (None: missing) equal bit for bit, shape and dtype included."""
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _first_gap(expected: list, got: list, first_step: int, rel: float) -> tuple:
    """(step, difference) of the first loss in `got` off `expected` by more than `rel` (relative), else
    (None, the largest difference)."""
    gaps = [abs(a - b) for a, b in zip(expected, got)]
    for i, (a, gap) in enumerate(zip(expected, gaps)):
        if gap > rel * max(abs(a), 1.0):
            return first_step + i, gap
    return None, max(gaps, default=0.0)


def resume_verdict(before: list, after: list, steps: int, rel: float = 1e-6) -> tuple:
    """(ok, message) from the ranks' results of `run_until_save` (`before`) and `resume_after_save` (`after`):
    the state each rank loaded against the one it saved, then the losses against the uninterrupted run's."""
    world = len(before)
    if not any(r["files"] for r in before):
        return False, ("your save wrote nothing into the folder it was given: every rank must write its part "
                       "of the model and of the optimizer there.")
    step, gap = _first_gap(before[0]["losses"], after[0]["losses"], steps, rel)
    losses = (f"step {step}'s loss differs by {gap:.1e} from the uninterrupted run's" if step is not None
              else "the losses match all the same")
    wrong_model, wrong_optim = {}, {}
    for r, (b, a) in enumerate(zip(before, after)):
        saved, loaded = b["saved"], a["loaded"]
        if bad := [k for k in saved if k.startswith("model.") and not _same(saved[k], loaded.get(k))]:
            wrong_model[r] = bad
        if bad := [k for k in saved if k.startswith("optim.") and not _same(saved[k], loaded.get(k))]:
            wrong_optim[r] = bad
    if wrong_model:
        untouched = [r for r, bad in wrong_model.items()
                     if all(_same(after[r]["fresh"][k], after[r]["loaded"].get(k)) for k in bad)]
        if len(untouched) == world:
            return False, (f"nothing was loaded: the new model still holds its own initial weights on "
                           f"{_ranks(range(world), world)}. Your load must fill the model and the optimizer "
                           "from the folder.")
        if untouched:
            return False, (f"{_ranks(untouched, world)} loaded nothing: {_its(untouched)} rows of the model still "
                           "hold the new model's initial weights. Every rank must load its own part.")
        rank0 = before[0]["saved"]
        copied = [r for r, bad in wrong_model.items()
                  if r > 0 and all(_same(rank0[k], after[r]["loaded"].get(k)) for k in bad)]
        if copied:
            return False, (f"{_ranks(copied, world)} got rank 0's rows of the model back, not {_its(copied)} own: "
                           "your save wrote only rank 0's shard. Every rank must write its own part.")
        r, bad = next(iter(wrong_model.items()))
        total = sum(k.startswith("model.") for k in before[r]["saved"])
        return False, (f"rank {r}'s model differs from the one it saved in {len(bad)} of {total} tensors "
                       f"({bad[0][len('model.'):]} first), and {losses}.")
    if wrong_optim:
        empty = [r for r in wrong_optim if not any(k.startswith("optim.") for k in after[r]["loaded"])]
        state = ("the optimizer has no state" if len(empty) == world else
                 f"the optimizer's state differs from the saved one on {_ranks(wrong_optim, world)}")
        return False, (f"the model came back but the optimizer's state was not restored ({state}: AdamW starts "
                       f"its moments over), and {losses}.")
    if step is not None:
        return False, (f"model and optimizer match the saved ones on every rank, yet {losses}: after your load "
                       "the optimizer must still update the parameters the model computes with.")
    return True, (f"resumed on {_ranks(range(world), world)}: model and optimizer bit-identical to the saved "
                  f"ones, and the next {len(before[0]['losses'])} losses match the uninterrupted run's (largest "
                  f"difference {gap:.1e}).")


def _hung(what: str, err, timeout: float, world: int) -> str:
    """One line for a RankHang in the learner's save or load: who waited inside it, who never came."""
    inside = [r for r in err.ranks if "fn(*args)" in err.stacks.get(r, "")]   # the line of _call_on_every_rank
    done = [r for r in err.ranks if r not in inside]
    if inside and done:
        where = (f"{_ranks(inside, world)} waited inside it, in a collective that {_ranks(done, world)} never "
                 f"joined (every rank must take part in the {what})")
    elif inside:
        where = ("no rank returned from it" if len(inside) == world
                 else f"{_ranks(inside, world)} never returned from it")
    else:
        where = f"{_ranks(err.ranks, world)} got stuck after it"
    return (f"your {what} did not finish within {timeout:g} s: {where}. The group is stuck: run the cells from "
            "the end of section 2 on again (they restart it).")


@exercise("05-save-resume")
def _save_resume(answer, *, cluster, within=None, steps: int = 3, timeout: float = 60):
    """The learner's (save, load) pair on the live ranks: train, save, go on (the uninterrupted run); a new
    model and optimizer, load, go on (the resumed run); states and losses compared. The files go to a new
    folder inside `within` (a folder every rank can reach; None: the temporary folder), removed at the end."""
    from ..runtime.errors import RankHang

    if callable(answer):
        return False, "expected your two functions as a pair, (my_save, my_load), not one function."
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2 and all(map(callable, answer))):
        parts = answer if isinstance(answer, (tuple, list)) else [answer]
        got = ", ".join(type(a).__name__ for a in parts)
        return False, (f"expected (my_save, my_load), two functions of (model, optimizer, folder), got ({got}).")
    save, load = answer
    world, what = cluster.world_size, "save"
    folder = tempfile.mkdtemp(prefix="05-save-resume-", dir=within)
    try:
        before = cluster.run(run_until_save, save, folder, steps, timeout=timeout)
        if before[0]["errors"]:
            first = min(before[0]["errors"])
            return False, f"your save raised on {_ranks(before[0]['errors'], world)}: {before[0]['errors'][first]}"
        what = "load"
        after = cluster.run(resume_after_save, load, folder, steps, timeout=timeout)
        if after[0]["errors"]:
            first = min(after[0]["errors"])
            return False, f"your load raised on {_ranks(after[0]['errors'], world)}: {after[0]['errors'][first]}"
    except RankHang as err:
        return False, _hung(what, err, timeout, world)
    except Exception as err:  # noqa: BLE001 - training after the learner's call failed: say where
        lines = str(err).strip().splitlines()
        return False, f"training after your {what} failed on the ranks: {lines[0] if lines else type(err).__name__}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return resume_verdict(before, after, steps)
