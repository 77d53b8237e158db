"""Lesson 04's code exercise: the learner's FSDP2 wrapping keeps the norms in fp32 and the matmuls in bf16."""


def _shard(norms="before", output_dtype="bf16", reduce_dtype=None, blocks="bf16"):
    """A learner's `shard(model, mesh)`: each norm its own fp32 unit (norms="before" or "after" the blocks, or
    None: the lesson's stub), then the blocks and the root with the `blocks` policy."""
    def shard(model, mesh):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype and torch.bfloat16,
                                    output_dtype=output_dtype and torch.bfloat16)
        outer = fp32 if blocks == "fp32" else bf16
        norm_modules = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        for module in norm_modules if norms == "before" else []:
            fully_shard(module, mesh=mesh, mp_policy=fp32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=outer)
        for module in norm_modules if norms == "after" else []:
            fully_shard(module, mesh=mesh, mp_policy=fp32)
        fully_shard(model, mesh=mesh, mp_policy=outer)
    return shard


def test_right_wrapping_passes(cluster):
    from fsdplab.exercises import check

    right = check("04-fp32-norms", _shard(), cluster=cluster)
    assert right.ok and "float32 weights" in right.message and "bfloat16" in right.message


def test_wrong_wrappings_say_what_is_wrong(cluster):
    from fsdplab.exercises import check

    stub = check("04-fp32-norms", _shard(norms=None), cluster=cluster)
    assert not stub.ok and "norm `layers.0.norm1` ran with a bfloat16 weight" in stub.message
    assert "param_dtype" in stub.message and "fully_shard(" not in stub.message
    no_output = check("04-fp32-norms", _shard(output_dtype=None), cluster=cluster)
    assert not no_output.ok and "handed on a float32 output" in no_output.message and "raised" in no_output.message
    assert "output_dtype" not in no_output.message
    too_late = check("04-fp32-norms", _shard(norms="after"), cluster=cluster)
    assert not too_late.ok and "fully_shard(`layers.0.norm1`)" in too_late.message
    assert "unit `layers.0`" in too_late.message and "inside out" in too_late.message
    all_fp32 = check("04-fp32-norms", _shard(blocks="fp32"), cluster=cluster)
    assert not all_fp32.ok and "MultiheadAttention `layers.0.attn` got a float32 weight" in all_fp32.message
    bf16_reduce = check("04-fp32-norms", _shard(reduce_dtype="bf16"), cluster=cluster)
    assert not bf16_reduce.ok and "reduce-scattered the gradients of `norm` in bfloat16" in bf16_reduce.message
    assert "reduce_dtype" in bf16_reduce.message


def test_no_function_and_a_raising_one(cluster):
    from fsdplab.exercises import check

    assert not check("04-fp32-norms", 3, cluster=cluster).ok
    unsharded = check("04-fp32-norms", lambda model, mesh: None, cluster=cluster)
    assert not unsharded.ok and "is not sharded" in unsharded.message

    def broken(model, mesh):
        raise RuntimeError("no policy yet\nsecond line")

    raised = check("04-fp32-norms", broken, cluster=cluster)
    assert (not raised.ok and raised.message.endswith("RuntimeError: no policy yet")
            and "Traceback" not in raised.message)
