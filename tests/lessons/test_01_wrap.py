"""Lesson 01's code exercise, "01-wrap": the learner's wrap of a model the lesson has not seen, run on the live
ranks. The right answer passes; the wrong ones a learner writes each get a line that says what is wrong."""

import fsdplab
from fsdplab.exercises import check


def _wrap(order="blocks, root", give_back=True):
    """A learner's wrap: fully_shard the parts in `order` ("blocks", "root", "container"), then return the model
    or None."""
    def wrap(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for part in order.split(", "):
            if part == "blocks":
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
            elif part == "container":          # the Sequential that holds the blocks, as one unit
                fully_shard(model.blocks, mesh=mesh)
            else:
                fully_shard(model, mesh=mesh)
        return model if give_back else None
    return wrap


def _not_yet(verdict, *words):
    assert not verdict.ok and all(word in verdict.message for word in words), verdict.message
    assert "fully_shard(" not in verdict.message and "\n" not in verdict.message, verdict.message


def test_wrap_checker(cluster):
    right = check("01-wrap", _wrap(), cluster=cluster)
    assert right.ok and "blocks.0, blocks.1, blocks.2" in right.message, right.message
    _not_yet(check("01-wrap", _wrap("root"), cluster=cluster), "none of the 3 blocks", "once")
    _not_yet(check("01-wrap", _wrap("blocks"), cluster=cluster), "root was not wrapped", "embed, norm and head")
    _not_yet(check("01-wrap", _wrap("root, blocks"), cluster=cluster), "root was wrapped before the blocks")
    _not_yet(check("01-wrap", _wrap("container, root"), cluster=cluster), "none of the 3 blocks", "(root, blocks)")
    _not_yet(check("01-wrap", _wrap(give_back=False), cluster=cluster), "returns None")
    _not_yet(check("01-wrap", lambda model, mesh: model, cluster=cluster), "nothing was sharded")


def test_wrap_checker_refuses_what_cannot_run(cluster):
    _not_yet(check("01-wrap", 3, cluster=cluster), "expected a function")

    def raises(model, mesh):
        return model.layers                      # the lesson's model has `layers`; this one has `blocks`

    _not_yet(check("01-wrap", raises, cluster=cluster), "raised on the ranks: AttributeError")
    _not_yet(check("01-wrap", _wrap(), cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")   # never started
