"""The package's one path: one settings type, one model registry, one train step, private APIs
behind shims. The import graph's rules (no circles, no arrow up a floor): tests/unit/test_architecture.py."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fsdplab import _torch_private
from fsdplab.memory.formula import formula, spec_of
from fsdplab.models import MODELS, PARAM_COUNTS, ModelEntry, causal_lm, count_params
from fsdplab.settings import TrainSetting, as_setting
from fsdplab.sharding import build_tiny, loss_of, make_optimizer, train_step

PACKAGE = Path(__file__).resolve().parents[2] / "fsdplab"


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_registry_counts_the_published_parameters(name):
    # The formula's sizes and a meta build of the transformers model both come from the one registry entry.
    assert spec_of(name).total_params() == PARAM_COUNTS[name]
    assert count_params(causal_lm(name)) == PARAM_COUNTS[name]


def test_adding_a_model_is_one_registry_entry(monkeypatch):
    entry = ModelEntry("mini-llama", "LlamaConfig", dict(hidden_size=256, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=4,
                                                        intermediate_size=512, vocab_size=1000))
    monkeypatch.setitem(MODELS, entry.name, entry)
    built = count_params(causal_lm("mini-llama"))
    assert formula(model="mini-llama", world_size=2).detail["total_params"] == built
    from fsdplab.runner.cli import main

    assert main(["estimate", "--model", "mini-llama", "--world-size", "2", "--seq-len", "16", "--json"]) == 0


def test_setting_is_validated_once_with_the_fix_in_the_message():
    base = TrainSetting(model="tiny", world_size=2)
    assert as_setting(base, seq_len=64) == dataclasses.replace(base, seq_len=64)
    assert as_setting(None, model="tiny", world_size=2) == base
    bad = [(dict(world_size=0), "world_size must be a positive integer"),
           (dict(strategy="zero9"), "strategy must be one of"),
           (dict(precision="fp8"), "precision must be one of"),
           (dict(optimizer="lion"), "optimizer must be one of"),
           (dict(model="gpt-9"), "unknown model 'gpt-9'"),
           (dict(model=60e6, lora_rank=8), "lora_rank needs a transformer"),
           (dict(seq_len=0), "seq_len and batch_size"),
           (dict(lora_targets="mlp"), "lora_targets must be one of")]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message):
            base.replace(**changes)
    with pytest.raises(ValueError, match="expected a TrainSetting"):
        formula("tiny")
    assert TrainSetting(lora_targets=["q_proj", "v_proj"]).lora_targets == ("q_proj", "v_proj")


def test_train_step_runs_loss_backward_hook_step_zero_grad():
    from fsdplab.models import TinyConfig, random_batch

    cfg = TinyConfig(dim=16, num_layers=1, seq_len=8)
    model = build_tiny(cfg, seed=0)
    opt = make_optimizer(model, "sgd", lr=0.1, momentum=0.0)
    batch = random_batch(cfg, 2)
    seen = []
    before = model.head.weight.detach().clone()
    loss = train_step(model, opt, batch, after_backward=lambda: seen.append(model.head.weight.grad is not None))
    assert seen == [True]                                            # the hook ran between backward and step
    assert all(p.grad is None for p in model.parameters())           # zero_grad(set_to_none=True) ran
    assert not loss.requires_grad and torch.isclose(loss, loss_of(build_tiny(cfg, seed=0), batch))
    torch.testing.assert_close(model.head.weight.detach(), before - 0.1 * _grad_of_head(cfg, batch))


def _grad_of_head(cfg, batch):
    model = build_tiny(cfg, seed=0)
    loss_of(model, batch).backward()
    return model.head.weight.grad


def test_train_step_through_a_grad_scaler_skips_an_inf_step():
    from fsdplab.models import TinyConfig, random_batch

    cfg = TinyConfig(dim=16, num_layers=1, seq_len=8)
    model = build_tiny(cfg, seed=0)
    opt = make_optimizer(model, "adamw", lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    before = [p.detach().clone() for p in model.parameters()]

    def plant_inf():
        model.head.weight.grad[0, 0] = float("inf")

    train_step(model, opt, random_batch(cfg, 2), scaler=scaler, after_backward=plant_inf)
    assert scaler.get_scale() == 2.0 ** 7                            # backed off
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))   # step skipped


def test_a_missing_private_api_fails_loudly(monkeypatch):
    _torch_private.check_private_apis()
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(_torch_private.PrivateAPIError, match=r"torch \d.*_current_graph_task_id.*pip install"):
        _torch_private.graph_task_id()
    with pytest.raises(_torch_private.PrivateAPIError, match="_current_graph_task_id"):
        _torch_private.check_private_apis()


def test_one_home_for_units_dtypes_and_the_step():
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    gib = [p.name for p, s in sources.items() if re.search(r"^\s*GIB\s*=", s, re.M)]
    assert gib == ["settings.py"], gib
    dtype_tables = [p.name for p, s in sources.items() if '"bf16": torch.bfloat16' in s]
    assert dtype_tables == ["settings.py"], dtype_tables
    losses = [p.name for p, s in sources.items() if "cross_entropy(" in s]
    assert losses == ["step.py"], losses
    steps = [p.name for p, s in sources.items() if ".zero_grad(" in s]
    assert steps == ["step.py"], steps


def _from_imports(path: Path) -> list:
    """(module, [names]) of every `from X import ...` in the file, the module resolved to fsdplab.*."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((module, [a.name for a in node.names]))
    return found


def test_the_runtime_shares_no_private_names_and_knows_nothing_of_the_runner():
    runtime = sorted((PACKAGE / "runtime").rglob("*.py"))
    crossing = [(str(p.relative_to(PACKAGE)), module, name) for p in runtime for module, names in _from_imports(p)
                if module.startswith("fsdplab") for name in names if name.startswith("_") and name != "__future__"]
    assert crossing == [], crossing
    # the fork server, the estimates made ahead and the run's folders serve `fsdplab run` only
    runner = [(str(p.relative_to(PACKAGE)), module) for p in runtime for module, _ in _from_imports(p)
              if module.startswith(("fsdplab.runner", "fsdplab.runner.estimates_ahead", "fsdplab.memory.cache"))]
    assert runner == [], runner
    # every launcher is a class of its own file, found by its kind
    from fsdplab.runtime import launchers

    assert {kind: cls.__module__.rsplit(".", 1)[1] for kind, cls in launchers.LAUNCHER_CLASSES.items()} == {
        "local": "local", "slurm": "slurm", "mpi": "mpi", "ssh": "ssh"}
    # the older name of fsdplab.ranks is for users' notebooks only: the package itself uses the new one
    old_name = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") for module, _ in _from_imports(p)
                if module == "fsdplab.dist"]
    assert old_name == [], old_name
    source = (PACKAGE / "runtime" / "cluster.py").read_text()
    branches = re.search(r"""(==|!=|in) *\(?["'](slurm|mpi|ssh|local)["']""", source)
    assert not branches, "cluster.py branches on a launcher"


def test_the_older_name_of_fsdplab_ranks_still_works_with_a_note():
    import fsdplab.dist
    import fsdplab.ranks

    with pytest.warns(FutureWarning, match=r"fsdplab.dist.first_ranks is now fsdplab.ranks.first_ranks"):
        assert fsdplab.dist.first_ranks is fsdplab.ranks.first_ranks
    with pytest.raises(AttributeError):
        fsdplab.dist.no_such_helper
