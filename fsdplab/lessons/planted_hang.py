"""Lesson 10's code exercise (section 5): a training step with a planted hang, which the learner fixes, checked on
the lesson's ranks against the lab's own step."""

from __future__ import annotations

from .checkers import exercise
from .. import RankDied, RankError, RankHang
from ..runtime.tracebacks import rank_list


# --- the planted hang, fixed by the learner (section 5) --------------------------------------------------------

HANG_STEPS = 3          # optimizer steps the checker runs, one call each
MASKED_STEP = 1         # the step (from 0) whose batch on the last rank has every target masked: step 2 of 3
IGNORE_INDEX = -100     # a masked target: the loss leaves it out (prompt tokens, padding)

_RUN: dict = {}         # on a rank: the learner's model, optimizer and notes between the checker's calls


def hang_batch(step: int, seed: int = 0):
    """On a rank: (tokens, targets) of optimizer step `step` (from 0), this rank's own. At `MASKED_STEP` the last
    rank's targets are all `IGNORE_INDEX` (an SFT batch whose answers truncation cut off): the lab's loss, a mean
    over the targets not masked, is a mean over no token there, nan."""
    import torch

    from ..models import TinyConfig, random_batch
    from ..ranks import device, rank, world_size

    tokens, targets = random_batch(TinyConfig(), batch_size=4, seed=seed * 10_007 + 97 * step + rank(),
                                   device=device())
    if step == MASKED_STEP and rank() == world_size() - 1:
        targets = torch.full_like(targets, IGNORE_INDEX)
    return tokens, targets


def reference_step(model, opt, tokens, targets) -> bool:
    """The lab's step: skipped on every rank when the loss is not finite on any rank (as torch.amp.GradScaler
    skips a step whose gradients overflowed on any rank), else the lab's `train_step` on that loss; True when
    it updated the model."""
    import torch
    import torch.distributed as dist

    from ..sharding import loss_of, train_step

    loss = loss_of(model, (tokens, targets))
    bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=loss.device)
    dist.all_reduce(bad)                # every rank learns whether any rank's loss is nan or inf
    if bad.item():
        return False
    train_step(model, opt, (tokens, targets), loss_fn=lambda *_: loss)     # backward, step, zero_grad
    return True


def _sharded_tiny(seed: int):
    """On a rank: the lesson's tiny transformer, one FSDP2 unit per block and the root, and its AdamW."""
    import torch

    from ..models import TinyConfig
    from ..ranks import device, mesh
    from ..sharding import apply_fsdp, build_tiny

    model = apply_fsdp(build_tiny(TinyConfig(), seed=seed, device=device()), mesh(), reshard_after_forward=None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _shards(model):
    """This rank's parameter shards as one float64 CPU vector; resharded first (a step that skipped backward
    leaves the root's parameters unsharded after its forward)."""
    import torch

    model.reshard()
    return torch.cat([getattr(p, "to_local", lambda: p)().detach().flatten().double().cpu()
                      for p in model.parameters()])


def _noted_step(run: dict, step_fn, step: int, seed: int) -> None:
    """On a rank: one call of `step_fn`, noting whether it changed this rank's shards and left a nan in them."""
    before = _shards(run["model"])
    step_fn(run["model"], run["opt"], *hang_batch(step, seed))
    after = _shards(run["model"])
    run["notes"].append({"changed": not bool((before == after).all()), "nan": bool(after.isnan().any())})


def _result(run: dict) -> dict:
    """On a rank: what a run leaves to compare: this rank's notes (per step: changed, nan), final shards and
    device type."""
    from ..ranks import device, rank

    return {"rank": rank(), "notes": run["notes"], "params": _shards(run["model"]), "device": device().type}


def reference_run(steps: int = HANG_STEPS, seed: int = 0) -> dict:
    """On a rank: `reference_step` for `steps` steps on a fresh sharded tiny model; its `_result`."""
    model, opt = _sharded_tiny(seed)
    run = {"model": model, "opt": opt, "notes": []}
    for step in range(steps):
        _noted_step(run, reference_step, step, seed)
    return _result(run)


def begin_run(seed: int = 0) -> None:
    """On a rank: a fresh sharded tiny model and optimizer for the learner's steps."""
    model, opt = _sharded_tiny(seed)
    _RUN.clear()
    _RUN.update(model=model, opt=opt, notes=[], seed=seed)


def run_step(step_fn, step: int) -> None:
    """On a rank: the learner's `step_fn(model, opt, tokens, targets)` on step `step`'s batch."""
    _noted_step(_RUN, step_fn, step, _RUN["seed"])


def end_run() -> dict:
    """On a rank: what `reference_run` returns, for the learner's run; frees its model."""
    result = _result(_RUN)
    _RUN.clear()
    return result


def _hang_line(err, step: int, steps: int) -> str:
    """A RankHang in the learner's step in one line: what the lab said each rank was doing, then what that reads
    as: ranks idle while others wait in a collective left the step early; ranks still computing, none waiting,
    were only slow (a busy machine: a longer timeout)."""
    said = "; ".join(err.summary.splitlines())
    idle = [r for r, line in err.states.items() if line.endswith("now idle")]
    waiting = [r for r, line in err.states.items() if " waits in " in line]
    if not waiting:
        return (f"your step did not finish step {step + 1} of {steps} within {err.timeout:g} s, and no rank waits "
                f"in a collective ({said}): it was only slow. On a busy machine give it longer (a larger timeout).")
    reads = ""
    if idle:
        them = "it" if len(idle) == 1 else "them"
        reads = (f" {rank_list(idle).capitalize()} returned from step {step + 1} while {rank_list(waiting)} "
                 f"{'waits' if len(waiting) == 1 else 'wait'} in a collective for {them}.")
    return f"your step hangs at step {step + 1} of {steps} (RankHang after {err.timeout:g} s): {said}.{reads}"


def _step_list(notes: list, key: str) -> list:
    """The ranks whose note at one step says `key`."""
    return [r for r, note in enumerate(notes) if note[key]]


def hang_verdict(mine: list, ref: list) -> tuple:
    """(ok, message): the learner's completed run (`end_run` of every rank) against `reference_run`'s."""
    world, steps = len(ref), len(ref[0]["notes"])
    masked = f"rank {world - 1}'s loss at step {MASKED_STEP + 1} is nan: its batch has every target masked"
    for step in range(steps):
        nan = _step_list([m["notes"][step] for m in mine], "nan")
        if nan:
            return False, (f"your step completes on every rank, but after step {step + 1} {rank_list(nan)} "
                           f"{'holds' if len(nan) == 1 else 'hold'} nan in the parameters ({masked}). The lab's "
                           "step skips a step on every rank when any rank's loss is not finite.")
    for step in range(steps):
        got = _step_list([m["notes"][step] for m in mine], "changed")
        want = _step_list([r["notes"][step] for r in ref], "changed")
        if got != want:
            did = ("updated no rank's parameters" if not got else
                   f"updated {'every rank' if len(got) == world else rank_list(got)}'s parameters")
            should = ("the lab's step skips it on every rank" if not want else "the lab's step updates every rank's"
                      if len(want) == world else f"the lab's step updates {rank_list(want)}'s")
            why = f" ({masked})" if step == MASKED_STEP else ""
            return False, f"your step completes on every rank, but at step {step + 1} it {did}: {should}{why}."
    tolerance = 1e-5 if ref[0]["device"] == "cpu" else 1e-4
    gaps = [float((m["params"] - r["params"]).norm() / r["params"].norm().clamp_min(1e-30)) for m, r in zip(mine, ref)]
    worst = max(range(world), key=lambda r: gaps[r])
    if gaps[worst] > tolerance:
        return False, (f"your step completes on every rank and skips the steps the lab's step skips, but after "
                       f"{steps} steps rank {worst}'s parameters differ from the lab's by {gaps[worst]:.1e} "
                       "(relative): keep the step you were given (the lab's loss_of, one optimizer step) and change "
                       "only which steps are skipped.")
    skipped = [s + 1 for s in range(steps) if not any(r["notes"][s]["changed"] for r in ref)]
    return True, (f"your step completes on every rank: {steps} steps, step {', '.join(map(str, skipped))} skipped on "
                  f"every rank ({masked}), the others taken, and the parameters equal to the lab's step's "
                  f"(largest relative gap {gaps[worst]:.1e}).")


@exercise("10-planted-hang")
def _planted_hang(answer, *, cluster, timeout: float, steps: int = HANG_STEPS, seed: int = 0):
    """The learner's training step on the lesson's ranks: `steps` optimizer steps of a fresh sharded tiny model,
    one call each with `timeout` (the lesson's hang_timeout), after `reference_step`'s run (with the cluster's
    own timeout: it also warms the ranks up). A hang, an error or a dead rank is said in one line, and the
    group restarted when it broke: the cluster works for the cells after the check."""
    if not callable(answer):
        return False, ("expected your function train_step(model, opt, tokens, targets), one optimizer step on "
                       "this rank's batch.")
    if cluster.world_size < 2:
        return False, ("1 rank: no other rank to wait for, nothing can hang. Run the lesson with 2 or more ranks "
                       "(--world-size 2) to check your step.")
    if not cluster.running:
        return False, "the lesson's cluster is stopped: start it again (cluster.start()) and check again."
    if cluster.broken:
        cluster.restart(quiet=True)
    ref = cluster.run(reference_run, steps, seed, quiet=True)
    step = 0
    try:
        cluster.run(begin_run, seed, quiet=True)
        for step in range(steps):
            cluster.run(run_step, answer, step, timeout=timeout)
        mine = cluster.run(end_run, quiet=True)
    except RankHang as err:
        return False, _hang_line(err, step, steps) + _restart_note(cluster)
    except RankError as err:
        name, message, _ = err.errors[min(err.errors)]
        said = (message.strip().splitlines() or [""])[0]
        waiting = f"; meanwhile {'; '.join(err.waiting.values())}" if err.waiting else ""
        return False, (f"your step raised at step {step + 1} on {rank_list(err.errors)}: {name}: {said}{waiting}."
                       + _restart_note(cluster))
    except RankDied as err:
        return False, (f"a rank died in your step at step {step + 1}: {str(err).splitlines()[0].split(': ', 1)[-1]}"
                       + _restart_note(cluster))
    finally:
        if cluster.broken:          # after the verdict's note: the cells after the check get working ranks
            cluster.restart(quiet=True)
    return hang_verdict(mine, ref)


def _restart_note(cluster) -> str:
    """What the checker's `finally` is about to do, said in the verdict: restart a group the fault broke."""
    return " The lab restarted the ranks." if cluster.broken else ""
