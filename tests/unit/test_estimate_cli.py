"""`fsdplab estimate` on the user's own model (config file, model folder, Hub id from the local cache), its
one-line errors, the 16-bit base, and sweeps (table, JSON, heat map). Small configs, 2 ranks, 32 tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdplab.runner.cli import main
from fsdplab.display import plot_sweep
from fsdplab.memory import MemoryReport
from fsdplab.models import resolve_model
from fsdplab.settings import GIB, TrainSetting
from fsdplab.memory.sweep import Sweep

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=128)
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {}, "gpt_neox": {}, "gemma": dict(head_dim=16)}
QUICK = ["--world-size", "2", "--seq-len", "32"]


def write_config(folder: Path, model_type: str, **extra) -> Path:
    """A small config.json of `model_type`, as a checkpoint folder holds it; returns the folder."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES.get(model_type, {}), **extra}).save_pretrained(folder)
    return folder


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `fsdplab estimate ARGV` run in this process."""
    code = main(["estimate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("configs")
    folders = {name: write_config(root / name, name) for name in FAMILIES}
    folders["t5"] = write_config(root / "t5", "t5", architectures=["T5ForConditionalGeneration"])
    AutoConfig.for_model("gemma3").save_pretrained(root / "gemma3")   # multimodal: text sizes nested
    (root / "broken.json").write_text('{"model_type": "llama",\n "hidden_size" 64}')
    return root, folders


# --- the user's own model ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_file_of_each_family_is_estimated(capsys, configs, family):
    folder = configs[1][family]
    for text in (str(folder), str(folder / "config.json")):
        config = resolve_model(text)
        assert config.model_type == family and config.name_or_path == text
    code, out, _ = cli(capsys, "--model", str(folder / "config.json"), *QUICK, "--lora-rank", "8", "--json")
    data = json.loads(out)
    assert code == 0 and data["peak_bytes"] > 0 and data["settings"]["model"] == str(folder / "config.json")
    assert data["resident"]["gradients"] < data["resident"]["parameters"]   # only the adapters train


def test_registered_names_stay_names():
    assert resolve_model("tiny") == "tiny"


def _run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "fsdplab", "estimate", *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)


def test_hub_id_from_the_local_cache_offline(tmp_path):
    # The Hugging Face cache layout: hub/models--ORG--NAME/{refs/main, snapshots/COMMIT/config.json}
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    write_config(repo / "snapshots" / "abc123", "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    done = _run_cli("--model", "acme/tiny-llama", *QUICK, "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["settings"]["model"] == "acme/tiny-llama"
    missing = _run_cli("--model", "acme/not-cached", *QUICK, env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [
        "fsdplab: acme/not-cached is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it "
        "where there is a network (hf download acme/not-cached config.json, or copy its config.json here) and pass "
        "the file or folder, or copy the Hugging Face cache (~/.cache/huggingface) here."]


# --- bad input: one line with the fix, exit code 2 ------------------------------------------------------------

BAD = {
    "unknown name": (["--model", "qwen-8b"], "unknown model 'qwen-8b': did you mean qwen-7b or qwen2-7b?"),
    "missing file": (["--model", "no/such/config.json"], "no such file or folder: no/such/config.json"),
    "broken json": (["--model", "{root}/broken.json"], "broken.json is not valid JSON (line 2 column 16"),
    "not a causal LM": (["--model", "{root}/t5"], "transformers cannot build T5ForConditionalGeneration as a "
                                                  "causal language model"),
    "multimodal": (["--model", "{root}/gemma3"], "Gemma3ForConditionalGeneration is a multimodal model (its "
                                                  "language model's sizes are in a nested text config)"),
    "world size": (["--model", "tiny", "--world-size", "0"], "--world-size takes positive integers"),
    "seq over max": (["--model", "{root}/llama", "--seq-len", "512"],
                     "seq_len 512 is over the model's maximum (128 positions, max_position_embeddings): use "
                     "--seq-len 128 or less."),
    "lora targets": (["--model", "{root}/gpt_neox", "--lora-rank", "8", "--lora-targets", "attention"],
                     "LoRA targets ['q_proj', 'k_proj', 'v_proj', 'o_proj'] match no module of GPTNeoXForCausalLM; "
                     "its Linear layers are dense, dense_4h_to_h, dense_h_to_4h, query_key_value"),
    "hub offline": (["--model", "acme/not-cached"], "acme/not-cached is not in the local Hugging Face cache"),
    "mesh": (["--model", "tiny", "--world-size", "6", "--strategy", "hybrid_shard", "--shard-group-size", "4"],
             "hybrid_shard needs world_size (6) to be a multiple of shard_group_size (4)."),
    "shard group alone": (["--model", "tiny", "--shard-group-size", "4"],
                          "--shard-group-size sets hybrid_shard's shard group: add --strategy hybrid_shard."),
    "contradiction": (["--model", "tiny", "--strategy", "ddp", "--no-reshard-after-forward"],
                      "--no-reshard-after-forward is --strategy shard_grad_op; it contradicts --strategy ddp"),
    "gpu memory nan": (["--model", "tiny", "--gpu-mem-gib", "nan"], "--gpu-mem-gib is a GPU's memory in GiB"),
    "gpu memory negative": (["--model", "tiny", "--gpu-mem-gib", "-1"], "a positive number (e.g. 24), got -1.0"),
    "shard group 0": (["--model", "tiny", "--strategy", "hybrid_shard", "--shard-group-size", "0"],
                      "--shard-group-size is a number of GPUs (1 or more"),
    "plot folder": (["--model", "tiny", "--seq-len", "32,64", "--plot", "{root}/broken.json/heat.png"],
                    "--plot "),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_with_the_fix(capsys, configs, monkeypatch, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv, message = BAD[case]
    code, out, err = cli(capsys, *QUICK, *[a.format(root=configs[0]) for a in argv])   # later flags win
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("fsdplab: "), err
    assert message in lines[0]


def test_bad_input_from_the_command_line_has_no_traceback():
    done = _run_cli("--model", "llama2-7", *QUICK)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "fsdplab: unknown model 'llama2-7': did you mean llama2-7b, llama2-70b or llama2-13b? Use a registered name "
        "(qwen-7b, qwen2-7b, llama2-7b, llama2-13b, llama2-70b, tiny), a config.json, a model folder, or a Hub id "
        "such as Qwen/Qwen2-7B."]


# --- every strategy, exact ------------------------------------------------------------------------------------

def test_each_strategy_has_an_exact_estimate(capsys):
    """HSDP at 4 ranks in groups of 2 keeps what FULL_SHARD keeps at 2; DDP keeps what one rank keeps."""
    resident = {}
    for name, argv in {"full_shard x2": ["--world-size", "2"], "full_shard x1": ["--world-size", "1"],
                       "hybrid_shard": ["--world-size", "4", "--strategy", "hybrid_shard", "--shard-group-size", "2"],
                       "ddp": ["--world-size", "4", "--strategy", "ddp"]}.items():
        code, out, err = cli(capsys, "--model", "tiny", "--seq-len", "32", *argv, "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data["settings"]["strategy"] == name.split()[0]
        resident[name] = data["resident"]
    assert resident["hybrid_shard"] == resident["full_shard x2"]
    assert resident["ddp"] == resident["full_shard x1"]


# --- the frozen base in 16 bits ------------------------------------------------------------------------------

def test_bf16_base_holds_less_than_fp32(capsys):
    resident = {}
    for dtype in ("fp32", "bf16"):
        code, out, _ = cli(capsys, "--model", "tiny", *QUICK, "--lora-rank", "8", "--base-dtype", dtype, "--json")
        data = json.loads(out)
        assert code == 0 and data["settings"]["base_dtype"] == dtype
        resident[dtype] = data["resident"]
    assert resident["bf16"]["parameters"] < 0.7 * resident["fp32"]["parameters"]
    assert resident["bf16"]["optimizer_state"] == resident["fp32"]["optimizer_state"]   # fp32 adapters either way


# --- sweeps ---------------------------------------------------------------------------------------------------------

def test_sweep_json_and_heat_map(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    code, out, err = cli(capsys, "--model", "tiny", "--world-size", "2", "--seq-len", "32,64", "--batch-size", "1,2",
                         "--lora-rank", "8", "--json", "--plot", str(png))
    assert code == 0
    data = json.loads(out)        # one JSON object on stdout; the progress bar went to stderr
    assert "4/4" in err
    points = {(p["seq_len"], p["batch_size"]): p for p in data["points"]}
    assert len(data["points"]) == 4 and set(points) == {(32, 1), (32, 2), (64, 1), (64, 2)}
    for batch in (1, 2):
        assert points[64, batch]["peak_bytes"] > points[32, batch]["peak_bytes"]
    assert all(p["fits"] and p["world_size"] == 2 and p["settings"]["lora_rank"] == 8 for p in data["points"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_sweep_table_marks_what_does_not_fit(tmp_path):
    result = Sweep(TrainSetting(model="tiny", lora_rank=8), [512, 1024], [1, 2], [4, 8], gpu_mem_gib=24.0,
                   seconds=12.0, workers=2)
    for world_size, seq_len, batch in result.points():
        gib = seq_len * batch / 64 * 8 / world_size
        result.reports[world_size, seq_len, batch] = MemoryReport(int(gib * GIB), {}, world_size)
    table = result.table()
    assert "8 points in 12 s (2 workers)" in table and "world size 4" in table and "world size 8" in table
    assert "64.00*" in table and " 16.00 " in table      # 1024 x 2 on 4 ranks does not fit; 1024 x 1 on 8 does
    plot_sweep(result, tmp_path / "two_panels.png")
    assert (tmp_path / "two_panels.png").stat().st_size > 10_000


def test_the_command_imports_no_jupyter_machinery_to_estimate():
    """`fsdplab estimate` is a whole process a user waits for: jupyter_client, zmq and papermill are for runs."""
    code = ("import sys; from fsdplab.runner import cli; "
            "print(sorted(m for m in ('jupyter_client', 'zmq', 'papermill', 'nbclient') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
