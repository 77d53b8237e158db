"""Lesson 08's code exercise, "08-checkpoint-blocks": the learner's checkpointing of a LoRA twin with dropout under
fully_shard, run on the live ranks. The right answer passes; the wrong ones a learner writes each hear what is wrong."""

import fsdplab
from fsdplab.exercises import check


def _checkpointing(how="per block"):
    """A learner's my_checkpoint(model). `how`: "per block" (torch's non-reentrant wrapper on each block), "none",
    "posts" (the posts' reentrant call), "no rng" (non-reentrant, preserve_rng_state=False), "root" (the whole
    model in one checkpoint) or "every other" (blocks 0 and 2 of 3)."""
    def my_checkpoint(model):
        import functools

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing, checkpoint_wrapper)
        from torch.utils.checkpoint import checkpoint

        from fsdplab.lessons.activation_checkpointing import BlockCheckpoint
        from fsdplab.models import blocks_of

        blocks = blocks_of(model)
        if how == "root":
            return checkpoint_wrapper(model)
        if how == "posts":
            wrap = BlockCheckpoint
        elif how == "no rng":
            wrap = functools.partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False,
                                     preserve_rng_state=False)
        else:
            wrap = checkpoint_wrapper
        chosen = {"none": [], "every other": blocks[::2]}.get(how, blocks)
        apply_activation_checkpointing(model, check_fn=lambda m: any(m is b for b in chosen),
                                       checkpoint_wrapper_fn=wrap)
        return model
    return my_checkpoint


def _not_yet(verdict, *words):
    """Not ok, says `words` in one line, and gives no code away."""
    assert not verdict.ok and all(word in verdict.message for word in words), verdict
    for key in ("use_reentrant", "preserve_rng_state", "checkpoint_wrapper", "apply_activation_checkpointing", "\n"):
        assert key not in verdict.message, verdict


def test_each_block_checkpointed_passes(cluster):
    right = check("08-checkpoint-blocks", _checkpointing(), cluster=cluster)
    assert right.ok and "each of the 3 blocks ran again in backward on its own" in right.message, right


def test_wrong_checkpointing_hears_what_is_wrong(cluster):
    _not_yet(check("08-checkpoint-blocks", _checkpointing("none"), cluster=cluster),
             "no block ran again in backward: nothing was checkpointed")
    _not_yet(check("08-checkpoint-blocks", _checkpointing("posts"), cluster=cluster),
             "no adapter got a gradient", "does not require grad")
    _not_yet(check("08-checkpoint-blocks", _checkpointing("no rng"), cluster=cluster),
             "adapter gradients differ", "other masks")
    _not_yet(check("08-checkpoint-blocks", _checkpointing("root"), cluster=cluster),
             "ran blocks 0, 1, 2 again in that order", "several blocks as one piece")
    _not_yet(check("08-checkpoint-blocks", _checkpointing("every other"), cluster=cluster),
             "block 1 did not run again in backward")


def test_no_function_one_that_raises_or_stopped_ranks(cluster):
    _not_yet(check("08-checkpoint-blocks", 3, cluster=cluster), "expected a function")

    def raises(model):
        return model.model.layers          # the blocks of a LoRA model sit deeper

    _not_yet(check("08-checkpoint-blocks", raises, cluster=cluster),
             "your function raised on the ranks: AttributeError")
    _not_yet(check("08-checkpoint-blocks", _checkpointing(), cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")
