"""Every bad value a user can give `fsdplab estimate` (flags, a config.json) and `fsdplab run -p`
is refused before any work starts: exit 2, one line on stderr naming the flag or field and the
value, no traceback. The estimator and the lesson runner are replaced by functions that fail if
called, so a case passes only when the value was refused first."""

import json
from pathlib import Path

import pytest

import fsdplab.memory.checks
import fsdplab.memory.exact
import fsdplab.memory.sweep
from fsdplab.runner import cli
from fsdplab.models import resolve_model
from fsdplab.settings import TrainSetting

SMALL = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, vocab_size=256,
             max_position_embeddings=128)
QUICK = ["--world-size", "2", "--seq-len", "32"]
GPT2 = {"model_type": "gpt2", "hidden_size": None, "num_hidden_layers": None,
        "num_attention_heads": None, "num_key_value_heads": None, "n_embd": 64, "n_head": 4}

# name: (changes to SMALL, None drops a field), the words the line must hold
CONFIGS = {
    "negative layers": ({"num_hidden_layers": -3}, ["num_hidden_layers", "-3", "positive integer"]),
    "zero vocabulary": ({"vocab_size": 0}, ["vocab_size", "0", "positive integer"]),
    "string hidden size": ({"hidden_size": "64"}, ["hidden_size", "'64'", "a str"]),
    "missing hidden size": ({"hidden_size": None}, ["no hidden_size", "config.json"]),
    "null hidden size": ({"hidden_size": "null"}, ["hidden_size", "None", "positive integer"]),
    "bool layers": ({"num_hidden_layers": True}, ["num_hidden_layers", "True", "a bool"]),
    "float hidden size": ({"hidden_size": 64.5}, ["hidden_size", "64.5", "a float"]),
    "hidden not a multiple of heads": ({"hidden_size": 66},
                                       ["hidden_size (66)", "multiple of num_attention_heads (4)"]),
    "kv heads do not divide heads": ({"num_key_value_heads": 3},
                                     ["num_key_value_heads (3)", "divide"]),
    "zero kv heads": ({"num_key_value_heads": 0}, ["num_key_value_heads", "0"]),
    "negative MLP width": ({"intermediate_size": -128}, ["intermediate_size", "-128"]),
    "100,000 layers": ({"num_hidden_layers": 100_000},
                       ["num_hidden_layers", "100000", "at most 512", "126 layers"]),
    "qwen2 negative layers": ({"model_type": "qwen2", "num_hidden_layers": -3},
                              ["num_hidden_layers", "-3"]),
    "gpt2 names": ({**GPT2, "n_layer": 0}, ["n_layer", "0", "positive integer"]),
}

# name: (flags after QUICK, words the line must hold); {tmp} is a folder, {file} a file in it
FLAGS = {
    "world size 1e11": (["--world-size", "99999999999"],
                        ["--world-size", "99999999999", "at most 65,536"]),
    "world size in a list": (["--world-size", "2,100000"], ["--world-size", "2,100000", "at most"]),
    "world size 0": (["--world-size", "0"], ["--world-size", "'0'", "positive integers"]),
    "world size text": (["--world-size", "eight"], ["--world-size", "'eight'"]),
    "seq len negative": (["--seq-len", "-5"], ["--seq-len", "'-5'", "positive integers"]),
    "seq len 0": (["--seq-len", "0"], ["--seq-len", "'0'"]),
    "batch 0": (["--batch-size", "0"], ["--batch-size", "'0'"]),
    "batch in a list": (["--batch-size", "1,-2"], ["--batch-size", "'1,-2'"]),
    "lora rank 0": (["--lora-rank", "0"], ["--lora-rank", "0", "1 or more"]),
    "lora rank negative": (["--lora-rank", "-3"], ["--lora-rank", "-3", "1 or more"]),
    "lora rank text": (["--lora-rank", "abc"], ["--lora-rank", "'abc'", "invalid int"]),
    "lora rank float": (["--lora-rank", "1.5"], ["--lora-rank", "'1.5'", "invalid int"]),
    "gpu memory 0": (["--gpu-mem-gib", "0"], ["--gpu-mem-gib", "0.0", "positive number"]),
    "gpu memory negative": (["--gpu-mem-gib", "-1"], ["--gpu-mem-gib", "-1.0"]),
    "gpu memory nan": (["--gpu-mem-gib", "nan"], ["--gpu-mem-gib", "nan"]),
    "gpu memory inf": (["--gpu-mem-gib", "inf"], ["--gpu-mem-gib", "inf"]),
    "gpu memory text": (["--gpu-mem-gib", "lots"], ["--gpu-mem-gib", "'lots'", "invalid float"]),
    "loss chunks 0": (["--loss-chunks", "0"], ["--loss-chunks", "0", "1 or more"]),
    "grad accum 0": (["--grad-accum", "0"], ["--grad-accum", "0", "1 or more"]),
    "no sync alone": (["--no-sync"], ["--no-sync", "--grad-accum K"]),
    "lora dropout without lora": (["--lora-dropout", "0.1"], ["--lora-dropout", "--lora-rank"]),
    "lora dropout 1": (["--lora-rank", "8", "--lora-dropout", "1"], ["lora_dropout", "[0, 1)"]),
    "custom model not importable": (["--model", "no_module_of_that_name:build"],
                                    ["cannot import 'no_module_of_that_name'"]),
    "workers 0": (["--workers", "0"], ["--workers", "0", "1 or more"]),
    "reshard to 1": (["--reshard-to", "1"], ["--reshard-to", "1", "2 or more"]),
    "reshard to not dividing": (["--world-size", "6", "--reshard-to", "4"],
                                ["--reshard-to 4", "(6)", "divide"]),
    "shard group 0": (["--strategy", "hybrid_shard", "--shard-group-size", "0"],
                      ["--shard-group-size", "0"]),
    "hybrid group in a sweep": (["--world-size", "8,6", "--strategy", "hybrid_shard",
                                 "--shard-group-size", "4"],
                                ["world_size (6)", "shard_group_size (4)"]),
    "precision choice": (["--precision", "bf8"], ["--precision", "'bf8'", "choose from"]),
    "checkpointing mode": (["--activation-checkpointing", "often"],
                           ["--activation-checkpointing", "'often'"]),
    "plot is a folder": (["--plot", "{tmp}/figure.png"], ["--plot", "figure.png", "is a folder"]),
    "plot under a file": (["--seq-len", "32,64", "--plot", "{file}/heat.png"],
                          ["--plot", "is a file"]),
    "plot not a png": (["--plot", "{tmp}/heat.jpg"], ["--plot", "heat.jpg", ".png"]),
    "timeline is a folder": (["--timeline", "{tmp}/figure.png"], ["--timeline", "is a folder"]),
    "snapshot is a folder": (["--memory-snapshot", "{tmp}"], ["--memory-snapshot", "is a folder"]),
    "snapshot under a file": (["--memory-snapshot", "{file}/step.pickle"],
                              ["--memory-snapshot", "is a file"]),
}

# name: (lesson, -p NAME VALUE, words the line must hold)
PARAMETERS = {
    "list for an int": ("02", ("dim", "[1, 2]"),
                        ["-p dim", "'[1, 2]'", "dim = 64", "an int", "a list"]),
    "text for an int": ("02", ("dim", "wide"),
                        ["-p dim", "'wide'", "an int", "not a Python literal"]),
    "float for an int": ("02", ("dim", "2.5"), ["-p dim", "'2.5'", "a float"]),
    "bool for an int": ("02", ("dim", "True"), ["-p dim", "'True'", "a bool"]),
    "int for a list": ("01", ("world_sizes", "4"),
                       ["-p world_sizes", "'4'", "a list of int", "an int"]),
    "float in a list of ints": ("01", ("world_sizes", "[1, 2.5]"),
                                ["-p world_sizes", "a list of int"]),
    "int for a bool": ("03", ("exact_estimates", "1"), ["-p exact_estimates", "'1'", "a bool"]),
    "text for a float": ("10", ("hang_timeout", "soon"), ["-p hang_timeout", "'soon'", "a float"]),
}


def _no_work(*args, **kwargs):
    raise AssertionError("work started for a value that should have been refused first")


@pytest.fixture
def no_work(monkeypatch):
    """The estimator, the sweep, the meta-device check and the lesson runner fail if called."""
    for module, name in ((fsdplab.memory.exact, "estimate"), (fsdplab.memory.exact, "memory_snapshot"),
                         (fsdplab.memory.sweep, "sweep"), (fsdplab.memory.checks, "check"), (cli, "run_lessons")):
        monkeypatch.setattr(module, name, _no_work)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_config(folder: Path, name: str, changes: dict) -> Path:
    data = dict(SMALL)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = None if value == "null" else value
    path = folder / name.replace(" ", "_").replace(",", "") / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return path


def exit_code(argv) -> int:
    """`fsdplab ARGV`'s exit status, run in this process (argparse refuses through SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as done:
        return done.code


def one_line(capsys, code, words):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("fsdplab") and "Traceback" not in captured.err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_bad_config_json_is_one_line_before_any_work(capsys, tmp_path, no_work, case):
    changes, words = CONFIGS[case]
    path = write_config(tmp_path, case, changes)
    one_line(capsys, exit_code(["estimate", "--model", str(path), *QUICK]), [str(path), *words])
    with pytest.raises(ValueError) as refused:    # the Python API refuses it where the value enters
        resolve_model(str(path))
    assert str(path) in str(refused.value) and all(word in str(refused.value) for word in words)


@pytest.mark.parametrize("case", list(FLAGS))
def test_a_bad_flag_is_one_line_before_any_work(capsys, tmp_path, no_work, case):
    (tmp_path / "figure.png").mkdir()
    (tmp_path / "file").write_text("")
    argv, words = FLAGS[case]
    argv = [a.format(tmp=tmp_path, file=tmp_path / "file") for a in argv]
    code = exit_code(["estimate", "--model", "tiny", *QUICK, *argv])    # later flags win
    one_line(capsys, code, words)
    assert not (tmp_path / "file" / "heat.png").exists()


@pytest.mark.parametrize("case", list(PARAMETERS))
def test_a_lesson_parameter_of_the_wrong_type_is_one_line_before_any_kernel(capsys, tmp_path,
                                                                             no_work, case):
    lesson, (name, value), words = PARAMETERS[case]
    code = exit_code(["run", lesson, "-p", name, value, "--out", str(tmp_path / "runs")])
    one_line(capsys, code, words)


def test_a_lesson_parameter_takes_its_defaults_kind(monkeypatch, tmp_path):
    """An int for a float, a tuple for a list, the text itself for a str."""
    seen = {}

    def run_lessons(paths, out, world_size, params, **kwargs):
        seen.update(params)
        return []
    monkeypatch.setattr(cli, "run_lessons", run_lessons)
    pairs = [("hang_timeout", "3"), ("world_sizes", "1,2"), ("checkpoint_dir", "2024"),
             ("dim", "128")]
    argv = ["run", "01", "02", "05", "10", "--out", str(tmp_path / "runs")]
    for name, value in pairs:
        argv += ["-p", name, value]
    assert cli.main(argv) == 0
    assert seen == {"hang_timeout": 3, "world_sizes": [1, 2], "checkpoint_dir": "2024", "dim": 128}


def test_the_setting_refuses_the_same_values(tmp_path):
    """TrainSetting, where values enter the Python API, refuses what the command line refuses."""
    from transformers import LlamaConfig

    bad = [(dict(world_size=99_999_999_999), "world_size must be at most 65,536"),
           (dict(world_size=True), "world_size must be a positive integer, got True (a bool)"),
           (dict(seq_len=True), "seq_len and batch_size must be positive integers, got True"),
           (dict(lora_rank=True), "lora_rank must be a positive integer"),
           (dict(model=-1.0), "parameter count must be a positive number"),
           (dict(model=LlamaConfig(num_hidden_layers=-3)),
            "LlamaConfig: num_hidden_layers must be a positive"),
           (dict(model=LlamaConfig(num_hidden_layers=100_000)),
            "num_hidden_layers must be at most 512")]
    for changes, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            TrainSetting(**changes)
    config = LlamaConfig(**{k: v for k, v in SMALL.items() if k != "model_type"})
    config.num_key_value_heads = 3
    path = write_config(tmp_path, "kv", {"num_key_value_heads": 3})
    with pytest.raises(ValueError) as from_file:
        resolve_model(str(path))
    with pytest.raises(ValueError) as from_setting:
        TrainSetting(model=config)
    # the same line, each naming where the config came from
    assert str(from_file.value).split(": ", 1)[1] == str(from_setting.value).split(": ", 1)[1]


def test_good_values_still_pass_the_checks(capsys, tmp_path):
    """A GPT-2 config (its own field names), Gemma's explicit head_dim (50 wide, 4 heads of 16) and one without
    num_key_value_heads load."""
    gpt2 = write_config(tmp_path, "gpt2", {**GPT2, "n_layer": 2})
    gemma = write_config(tmp_path, "gemma", {"model_type": "gemma", "hidden_size": 50,
                                             "num_attention_heads": 4, "head_dim": 16})
    no_kv = write_config(tmp_path, "no_kv", {"num_key_value_heads": None})
    for path in (gpt2, gemma, no_kv):
        assert resolve_model(str(path)).name_or_path == str(path)
    assert TrainSetting(world_size=65_536).world_size == 65_536
