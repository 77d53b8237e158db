"""scripts/gpu_check.sh without a GPU: every section reports PASS or SKIP with a reason, the JSON holds
what each measured, and a FAIL makes the exit code non-zero."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(out, *args, timeout=240, shell=True):
    """scripts/gpu_check.sh (or, quicker, gpu_check.py itself) with the GPUs hidden."""
    cmd = ["bash", str(SCRIPT), str(out)] if shell else [sys.executable, str(ROOT / "scripts" / "gpu_check.py"),
                                                         "--out", str(out)]
    return subprocess.run(cmd + ["--cpu", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_script(out, "--sections", "env,cluster,fsdp1,memory,offload,lessons", "--lessons", "none",
                      "--memory-variants", "lora+ac", "--budget", "200")
    report = json.loads((out / "gpu_check.json").read_text())
    return proc, report, out


def test_cpu_fallback_exits_zero_with_every_section(cpu_run):
    proc, report, out = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(report["sections"]) == ["env", "cluster", "fsdp1", "memory", "offload", "lessons"]
    assert report["exit_code"] == 0 and report["failed"] == []
    assert {r["status"] for r in report["sections"].values()} <= {"PASS", "SKIP"}
    assert all(r["reason"] for r in report["sections"].values())
    log = (out / "gpu_check.log").read_text()
    assert "=== summary ===" in log and "[fsdp1] SKIP" in log


def test_env_and_cluster_on_cpu(cpu_run):
    import torch

    _, report, _ = cpu_run
    env = report["sections"]["env"]
    assert env["status"] == "PASS" and env["details"]["torch"] == torch.__version__
    assert env["details"]["cuda_available"] is False and env["details"]["gpus"] == []
    cluster = report["sections"]["cluster"]
    assert cluster["status"] == "PASS" and cluster["details"]["backend"] == "gloo"
    assert cluster["details"]["rank0"]["value"] == cluster["details"]["rank0"]["expected"] == 1.0


def test_gpu_sections_skip_with_reasons(cpu_run):
    _, report, _ = cpu_run
    fsdp1 = report["sections"]["fsdp1"]
    assert fsdp1["status"] == "SKIP" and "needs a GPU" in fsdp1["reason"]
    # The same FSDP1 code ran with device_id=cpu forced: every case but CPU offload, and the state dict save.
    cases = {c["case"]: c for c in fsdp1["details"]["cases"]}
    assert cases["CPUOffload(offload_params=True)"]["skipped"]
    ran = [c for c in cases.values() if not c.get("skipped")]
    assert len(ran) == 8 and all(c["problems"] == [] for c in ran)
    assert cases["MixedPrecision(param_dtype=bfloat16)"]["layer0_weight_and_input_dtype"] == \
        ["torch.bfloat16", "torch.bfloat16"]
    assert cases["FULL_SHARD"]["effective_strategy"] == "NO_SHARD"      # FSDP1 at world size 1
    offload = report["sections"]["offload"]
    assert offload["status"] == "SKIP" and "need a GPU" in offload["reason"]
    assert report["sections"]["lessons"]["status"] == "SKIP"


def test_memory_estimate_column_runs_without_gpu(cpu_run):
    _, report, _ = cpu_run
    memory = report["sections"]["memory"]
    assert memory["status"] == "PASS" and "real-GPU column is skipped" in memory["reason"]
    [case] = memory["details"]["cases"]
    assert case["model"] == "tiny" and case["lora"] and case["activation_checkpointing"]
    assert case["measured_bytes"] is None and case["ratio"] is None
    # At world size 1 the whole fp32 model sits on the one rank: the estimate is above that.
    assert case["estimate_bytes"] > 4 * case["params"]
    # The recipe's real code path ran on CPU: LoRA trains fewer parameters than the model has.
    assert 0 < case["trainable_params"] < case["params"]
    assert len(case["losses"]) == 2


def test_failed_section_gives_nonzero_exit(tmp_path):
    proc = run_script(tmp_path, "--sections", "lessons", "--lessons", "99_no_such_lesson", timeout=120, shell=False)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 1 and report["exit_code"] == 1 and report["failed"] == ["lessons"]
    assert "99_no_such_lesson" in report["sections"]["lessons"]["reason"]


def test_spent_budget_skips_sections(tmp_path):
    proc = run_script(tmp_path, "--sections", "env,offload", "--budget", "5", timeout=60, shell=False)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0
    assert all(r["status"] == "SKIP" and "budget" in r["reason"] for r in report["sections"].values())


def test_arguments_and_exit_code():
    gc = load_module()
    assert gc.exit_code({"a": {"status": "PASS"}, "b": {"status": "SKIP"}}) == 0
    assert gc.exit_code({"a": {"status": "PASS"}, "b": {"status": "FAIL"}}) == 1
    for bad in (["--sections", "env,bogus"], ["--memory-models", "7b"], ["--memory-variants", "half"],
                ["--lesson-world-size", "two"]):
        with pytest.raises(SystemExit) as err:
            gc.parse_args(bad)
        assert err.value.code == 2
    args = gc.parse_args(["--sections", "lessons,env"])
    assert args.section_list == ["env", "lessons"]           # always the script's own order


def test_lesson_plan_keeps_multi_rank_lessons():
    gc = load_module()
    plan = gc.lesson_plan(gc.parse_args(["--lessons", "all"]))
    assert plan, "no lessons found"
    for path, world_size, why in plan:
        if path.stem[:2] in gc.LESSON_KEEPS_WORLD_SIZE:
            assert world_size is None and "own world_size" in why
        else:
            assert world_size == 1
    [(path, world_size, _)] = gc.lesson_plan(gc.parse_args(["--lessons", "03", "--lesson-world-size", "2"]))
    assert path.name.startswith("03_") and world_size == 2
