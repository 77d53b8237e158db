"""Any nn.Module in the estimator (fsdplab.custom): named as package.module:function on the CLI and across processes,
as a CustomModel in Python; its estimate against live ranks is in test_memory.py, its published figures in
test_published.py."""

import json

import pytest

from fsdplab.custom import CustomModel
from fsdplab.memory import estimate, formula
from fsdplab.memory.published import lightning_transformer_tiny
from fsdplab.settings import TrainSetting, setting_payload

TINY = "fsdplab.memory.published:lightning_transformer_tiny"
SMALL = dict(world_size=2, seq_len=35, batch_size=2, precision="fp32", progress=False)


@pytest.mark.parametrize("spec, words", [("no_such_module_here:f", "cannot import 'no_such_module_here'"),
                                         ("fsdplab.memory.published:nothing", "has no function 'nothing'"),
                                         ("fsdplab.memory.published:llama31_8b", "returned a LlamaConfig")])
def test_a_spec_that_does_not_load_says_why(spec, words):
    with pytest.raises(ValueError, match=words):
        TrainSetting(model=spec)


def test_what_a_custom_model_cannot_take_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="put your own adapters inside build"):
        TrainSetting(model=TINY, lora_rank=8)
    with pytest.raises(ValueError, match="estimate"):
        formula(model=TINY)
    no_blocks = CustomModel(build=lightning_transformer_tiny().build, batch=lightning_transformer_tiny().batch,
                            loss=lightning_transformer_tiny().loss)
    with pytest.raises(ValueError, match="blocks"):
        TrainSetting(model=no_blocks, activation_checkpointing=True)


def test_a_custom_model_object_estimates_as_its_spec_does_and_says_why_it_cannot_travel():
    made_here = lightning_transformer_tiny()          # no spec: it exists in this process only
    assert made_here.spec is None
    here = estimate(model=made_here, subprocess_mode=False, **SMALL)
    named = estimate(model=TINY, subprocess_mode=False, **SMALL)
    assert (here.peak_bytes, here.by_category, here.resident) == (named.peak_bytes, named.by_category, named.resident)
    with pytest.raises(ValueError, match="package.module:function"):
        setting_payload(TrainSetting(model=made_here))
    assert setting_payload(TrainSetting(model=TINY))["model"] == TINY


def test_without_blocks_the_whole_model_is_one_unit():
    whole = lightning_transformer_tiny()
    one_unit = CustomModel(build=whole.build, batch=whole.batch, loss=whole.loss)
    per_layer = estimate(model=whole, subprocess_mode=False, **SMALL)
    single = estimate(model=one_unit, subprocess_mode=False, **SMALL)
    # one unit gathers every parameter at once: more in flight than one layer at a time
    assert single.category_peaks["parameters"] > per_layer.category_peaks["parameters"]
    assert single.resident == per_layer.resident


def test_the_cli_estimates_a_module_named_by_its_function(capsys):
    from fsdplab.runner.cli import main

    assert main(["estimate", "--model", TINY, "--world-size", "2", "--seq-len", "35", "--batch-size", "2",
                 "--precision", "fp32", "--strategy", "ddp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # torch's DDP: a whole copy of the model per rank, and its gradient buckets as large as the gradients
    assert data["by_category"]["communication_buffers"] == data["resident"]["gradients"] > 0
    assert data["resident"]["parameters"] == data["resident"]["gradients"]
    assert main(["estimate", "--model", "not_a_module_anywhere:build", "--json"]) != 0
    assert "cannot import 'not_a_module_anywhere'" in capsys.readouterr().err


def test_a_sweep_of_a_custom_model_gives_each_point_its_own_estimate():
    # the demo's forward makes its position table the first time: a model shared between points would hide it
    from fsdplab.memory import estimate_group

    base = TrainSetting(model=TINY, world_size=2, seq_len=64, precision="fp32", strategy="ddp")
    swept = estimate_group([base.replace(seq_len=32), base])
    alone = estimate(base, progress=False, subprocess_mode=False)
    assert (swept[1].peak_bytes, swept[1].category_peaks) == (alone.peak_bytes, alone.category_peaks)


READS_A_WEIGHT = """
import torch
from torch import nn

from fsdplab.custom import CustomModel


def build():
    layer = nn.Linear(4, 4)
    layer.weight.data *= 1 / layer.weight.abs().max().item()    # reads a value: no module on the meta device
    return layer


def model():
    return CustomModel(build=build, batch=lambda batch_size, seq_len: (torch.ones(batch_size, 4),),
                       loss=lambda model, batch: model(*batch).sum(), name="reads a weight")
"""


@pytest.mark.parametrize("points", [[], ["--batch-size", "1,2"]], ids=["one estimate", "a sweep"])
def test_a_module_that_reads_a_weight_while_built_is_refused_with_the_way_out(points, tmp_path, monkeypatch,
                                                                                capsys):
    from fsdplab.runner.cli import main

    (tmp_path / "reads_a_weight.py").write_text(READS_A_WEIGHT)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "--model", "reads_a_weight:model", "--world-size", "2", *points, "--json"]) != 0
    err = capsys.readouterr().err
    assert "reads a weight: building it on the meta device failed" in err and "no .item()" in err, err
