"""Lesson 06's code exercise, "06-lora-fsdp": LoRA added to the miniature and sharded, run on the live ranks next
to the recipe. The right answer passes; the wrong ones a learner writes each get a line that says what is wrong."""

import fsdplab
from fsdplab.exercises import check


def _lora_fsdp(order="lora, layers, root", targets="all-linear", rank=16, alpha=32, unfreeze=False):
    """A learner's my_lora_fsdp: peft's adapters ("lora"), each decoder layer ("layers") and the root ("root") in
    `order`; `unfreeze` makes every weight trainable again after peft froze the base."""
    def my_lora_fsdp(model, mesh):
        from peft import LoraConfig, get_peft_model
        from torch.distributed.fsdp import fully_shard

        from fsdplab.models import blocks_of

        layers = blocks_of(model)
        for part in order.split(", "):
            if part == "lora":
                model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
                if unfreeze:
                    model.requires_grad_(True)
            elif part == "layers":
                for layer in layers:
                    fully_shard(layer, mesh=mesh)
            else:
                fully_shard(model, mesh=mesh)
        return model
    return my_lora_fsdp


def _not_yet(verdict, *words):
    """Not ok, says `words`, in one line, and gives no code away."""
    assert not verdict.ok and all(word in verdict.message for word in words), verdict.message
    for code in ("fully_shard(", "get_peft_model(", "LoraConfig(", "Traceback", "\n"):
        assert code not in verdict.message, verdict.message


def test_lora_fsdp_checker(cluster):
    right = check("06-lora-fsdp", _lora_fsdp(), cluster=cluster)
    assert right.ok and "156,160 adapter parameters train" in right.message, right.message
    assert "base is bit-identical" in right.message and "sharded on dim 0 over 2 ranks" in right.message
    _not_yet(check("06-lora-fsdp", lambda model, mesh: model, cluster=cluster), "came back as it was given",
             "795,776", "156,160")
    _not_yet(check("06-lora-fsdp", _lora_fsdp("layers, root, lora"), cluster=cluster),
             "56 adapter weights are plain tensors", "after the layers were sharded", "KiB")
    _not_yet(check("06-lora-fsdp", _lora_fsdp(unfreeze=True), cluster=cluster),
             "the base is not frozen", "951,936 trainable", "KiB")
    _not_yet(check("06-lora-fsdp", _lora_fsdp(targets=["q_proj", "v_proj"]), cluster=cluster),
             "32,768 trainable parameters where peft counts 156,160", "sit on q_proj and v_proj with rank 16")
    _not_yet(check("06-lora-fsdp", _lora_fsdp(rank=8, alpha=16), cluster=cluster), "with rank 8")
    _not_yet(check("06-lora-fsdp", _lora_fsdp("lora, root"), cluster=cluster), "none of the 4 decoder layers")
    _not_yet(check("06-lora-fsdp", _lora_fsdp("lora, layers"), cluster=cluster),
             "root was not sharded", "model.embed_tokens, model.norm and lm_head")
    _not_yet(check("06-lora-fsdp", _lora_fsdp("lora, root, layers"), cluster=cluster),
             "root was sharded before the decoder layers")
    _not_yet(check("06-lora-fsdp", _lora_fsdp(alpha=16), cluster=cluster), "0.50x", "alpha")


def test_lora_fsdp_refuses_what_cannot_run(cluster):
    _not_yet(check("06-lora-fsdp", 3, cluster=cluster), "expected a function")

    def raises(model, mesh):
        raise ValueError("no adapters yet\nsecond line")

    raised = check("06-lora-fsdp", raises, cluster=cluster)
    _not_yet(raised, "your function raised on the ranks: ValueError: no adapters yet")
    assert "second line" not in raised.message                              # the error's first line only
    assert check("06-lora-fsdp", _lora_fsdp(), cluster=cluster).ok          # the ranks are fine after it
    _not_yet(check("06-lora-fsdp", _lora_fsdp(), cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")
