"""Lesson 09's code exercise, checked on the live ranks: the accumulation loop that syncs once per optimizer step,
tried with the right loop and with the wrong ones a learner writes."""

from fsdplab.exercises import check


def _loop(sync="every", divide=True):
    """An accumulation loop over a sharded model. `sync`: "every" (the lesson's broken loop), "last", "never"
    (turned off, never on again) or "all but last" (the switch the wrong way round)."""
    def accumulate(model, parts):
        from fsdplab.lessons.training_loop import next_token_loss

        k = len(parts)
        if sync == "never":
            model.set_requires_gradient_sync(False)
        for i, (x, y) in enumerate(parts):
            if sync == "last":
                model.set_requires_gradient_sync(i == k - 1)
            elif sync == "all but last":
                model.set_requires_gradient_sync(i != k - 1)
            loss = next_token_loss(model, x, y)
            (loss / k if divide else loss).backward()
    return accumulate


def _not_yet(verdict, *words):
    """Not ok, says `words`, and gives no code away."""
    assert not verdict.ok, verdict
    assert all(word in verdict.message for word in words), verdict
    assert "set_requires_gradient_sync" not in verdict.message and "Traceback" not in verdict.message, verdict


def test_the_loop_that_syncs_once(cluster):
    right = check("09-sync-once", _loop("last"), cluster=cluster)
    assert right.ok and "synced once, after micro-batch 4 of 4: 5 reduce-scatters" in right.message, right
    assert check("09-sync-once", _loop("last"), cluster=cluster, micro_batches=2).ok


def test_wrong_loops_hear_what_is_wrong(cluster):
    _not_yet(check("09-sync-once", _loop("every"), cluster=cluster),
             "gradients match, but rank 0 synced after each of the 4 micro-batches: 20 reduce-scatters",
             "once, after the last: 5 reduce-scatters")
    _not_yet(check("09-sync-once", _loop("never"), cluster=cluster), "holds no gradient", "no micro-batch of 4 synced")
    _not_yet(check("09-sync-once", _loop("all but last"), cluster=cluster),
             "synced after micro-batches 1, 2 and 3 of 4, not after the last")
    _not_yet(check("09-sync-once", _loop("last", divide=False), cluster=cluster), "4.00x", "not their sum")


def test_no_function_or_one_that_raises(cluster):
    _not_yet(check("09-sync-once", 3, cluster=cluster), "expected a function")

    def raises(model, parts):
        raise ValueError("parts is empty\nsecond line")

    raised = check("09-sync-once", raises, cluster=cluster)
    _not_yet(raised, "your loop raised on the ranks:", "parts is empty")
    assert "second line" not in raised.message                              # the error's first line only
    assert check("09-sync-once", _loop("last"), cluster=cluster).ok      # the ranks are fine after it
