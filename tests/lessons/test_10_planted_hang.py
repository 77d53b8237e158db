"""Lesson 10's code exercise, checked on the live ranks: the training step with a planted hang (the skip of a batch
whose loss is nan, taken by the one rank whose batch it is), tried with the fixes that pass and with the wrong ones
a learner writes. The hanging steps also show that the checker contains the hang: one line on which rank waits in
which collective, and a cluster that works again after it."""

import inspect
import time
import types

import fsdplab
from fsdplab.exercises import check

TIMEOUT = 3.0           # the lesson's hang_timeout


def _step(kind: str):
    """A training step: "planted" (the lesson's: the skip only the masked rank takes), "flag" and "sum" (fixed: the
    ranks agree through an all_reduce of a flag, or of the loss), "no guard", "guard the optimizer", "rank 0 logs"
    (a metric all_reduce behind `if rank == 0`), "always skip", "two steps" (agreed, but the optimizer steps twice),
    "raises" (on every rank), "raises on the masked rank"."""
    def train_step(model, opt, tokens, targets):
        import torch
        import torch.distributed as dist

        from fsdplab import rank
        from fsdplab.sharding import loss_of

        if kind == "raises" or (kind == "raises on the masked rank" and bool((targets == -100).all())):
            raise ValueError("no batch today\nsecond line")
        loss = loss_of(model, (tokens, targets))
        if kind == "always skip":
            return
        if kind == "rank 0 logs" and rank() == 0:
            dist.all_reduce(loss.detach().clone())
        if kind == "planted" and not torch.isfinite(loss):
            return
        if kind in ("flag", "two steps"):
            bad = torch.tensor(0.0 if torch.isfinite(loss) else 1.0)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                return
        if kind == "sum":
            total = loss.detach().clone()
            dist.all_reduce(total)
            if not torch.isfinite(total):
                opt.zero_grad()
                return
        loss.backward()
        if kind != "guard the optimizer" or torch.isfinite(loss):
            opt.step()
        if kind == "two steps":
            opt.step()
        opt.zero_grad()
    return train_step


def _not_yet(verdict, *words):
    """Not ok, in one line, and says `words`."""
    assert not verdict.ok, verdict
    assert "\n" not in verdict.message, verdict
    assert all(word in verdict.message for word in words), verdict


def test_the_planted_step_hangs_and_the_cluster_works_after(cluster):
    t0 = time.monotonic()
    verdict = check("10-planted-hang", _step("planted"), cluster=cluster, timeout=TIMEOUT)
    _not_yet(verdict, "hangs at step 2 of 3 (RankHang after 3 s)", "rank 0 waits in all_gather #",
             "rank 1 finished all_gather #", "now idle", "Rank 1 returned from step 2 while rank 0 waits in a "
             "collective for it.", "The lab restarted the ranks.")
    backward = 1 + next(i for i, line in enumerate(inspect.getsource(_step).splitlines()) if "loss.backward()" in line)
    line = inspect.getsourcelines(_step)[1] + backward - 1
    assert "float32) at " in verdict.message and f":{line};" in verdict.message, (line, verdict)  # its backward
    assert time.monotonic() - t0 < TIMEOUT + 60, "the hang was not contained"
    assert not cluster.broken and cluster.run(fsdplab.rank) == [0, 1]


def test_steps_whose_ranks_agree_pass(cluster):
    for kind in ("flag", "sum"):
        verdict = check("10-planted-hang", _step(kind), cluster=cluster, timeout=TIMEOUT)
        assert verdict.ok, (kind, verdict)
        assert "3 steps, step 2 skipped on every rank" in verdict.message, verdict


def test_wrong_fixes_hear_what_is_wrong(cluster):
    _not_yet(check("10-planted-hang", _step("no guard"), cluster=cluster, timeout=TIMEOUT),
             "completes on every rank, but at step 2 it updated every rank's parameters: the lab's step skips it "
             "on every rank (rank 1's loss at step 2 is nan: its batch has every target masked)")
    _not_yet(check("10-planted-hang", _step("guard the optimizer"), cluster=cluster, timeout=TIMEOUT),
             "at step 2 it updated rank 0's parameters: the lab's step skips it on every rank")
    _not_yet(check("10-planted-hang", _step("always skip"), cluster=cluster, timeout=TIMEOUT),
             "at step 1 it updated no rank's parameters: the lab's step updates every rank's")
    _not_yet(check("10-planted-hang", _step("two steps"), cluster=cluster, timeout=TIMEOUT),
             "parameters differ from the lab's by")
    assert not cluster.broken


def test_a_desync_is_said_with_both_collectives(cluster):
    verdict = check("10-planted-hang", _step("rank 0 logs"), cluster=cluster, timeout=TIMEOUT)
    _not_yet(verdict, "hangs at step 1 of 3", "rank 0 waits in all_reduce #", "rank 1 waits in all_gather #",
             "The lab restarted the ranks.")
    assert "returned from" not in verdict.message, verdict         # no rank left the step: both wait
    assert not cluster.broken and cluster.run(fsdplab.rank) == [0, 1]


def test_no_function_one_rank_or_a_step_that_raises(cluster):
    _not_yet(check("10-planted-hang", 3, cluster=cluster, timeout=TIMEOUT), "expected your function")
    one = types.SimpleNamespace(world_size=1, running=True, broken=None)
    _not_yet(check("10-planted-hang", _step("flag"), cluster=one, timeout=TIMEOUT), "1 rank", "2 or more ranks")
    raised = check("10-planted-hang", _step("raises"), cluster=cluster, timeout=TIMEOUT)
    _not_yet(raised, "your step raised at step 1 on ranks 0-1: ValueError: no batch today")
    assert "second line" not in raised.message and "restarted" not in raised.message, raised
    # one rank raises while the other waits for it in a collective: the lab says so at once, the group restarts
    waited = check("10-planted-hang", _step("raises on the masked rank"), cluster=cluster, timeout=TIMEOUT)
    _not_yet(waited, "your step raised at step 2 on rank 1: ValueError: no batch today",
             "meanwhile rank 0 waits in", "The lab restarted the ranks.")
    assert not cluster.broken and check("10-planted-hang", _step("flag"), cluster=cluster, timeout=TIMEOUT).ok


def test_the_verdict_names_nan_before_the_steps_and_gaps():
    import torch

    from fsdplab.lessons.planted_hang import hang_verdict

    def run(changed, nan=(False, False, False), params=(1.0, 2.0)):
        return {"notes": [{"changed": c, "nan": n} for c, n in zip(changed, nan)], "params": torch.tensor(params),
                "device": "cpu"}

    ref = [run((True, False, True))] * 2
    ok, message = hang_verdict([run((True, False, True))] * 2, ref)
    assert ok and "step 2 skipped on every rank" in message, message
    ok, message = hang_verdict([run((True, True, True), (False, True, True))] * 2, ref)
    assert not ok and "after step 2 ranks 0-1 hold nan in the parameters" in message, message
    ok, message = hang_verdict([run((True, False, True)), run((True, False, True), params=(1.0, 2.1))], ref)
    assert not ok and "rank 1's parameters differ from the lab's by 4.5e-02" in message, message
