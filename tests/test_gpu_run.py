"""scripts/gpu_run.py without a GPU: every file of tests/gpu is reported, its tests skipped with the CUDA
reason (not failed), the JSON written; a failing test, or a file past its time limit, makes the exit code 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_run.py"


def gpu_run(*args, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")     # the CPU path, even on a machine with GPUs
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    return proc, json.loads((Path(args[args.index("--out") + 1]) / "gpu_run.json").read_text())


def test_without_a_gpu_every_file_skips_with_the_reason(tmp_path):
    proc, report = gpu_run("--out", tmp_path, "--budget", 240)
    assert proc.returncode == 0 and report["exit_code"] == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(report["files"]) == ["test_env", "test_cluster", "test_fsdp1", "test_memory", "test_offload",
                                     "test_lessons"]
    assert len(report["files"]) == len(list((ROOT / "tests" / "gpu").glob("test_*.py")))
    for name, result in report["files"].items():
        assert result["status"] == "skipped" and result["skipped"] > 0, (name, result)
        assert result["passed"] == result["failed"] == result["errors"] == 0, (name, result)
        assert result["skip_reasons"] and all(r.startswith("needs CUDA") for r in result["skip_reasons"]), result
        assert (tmp_path / f"{name}.log").exists()
    assert "needs CUDA" in proc.stdout and "exit code 0" in proc.stdout


def test_a_failure_or_a_hang_gives_exit_code_1(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tests / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n\ndef test_fine():\n    pass\n")
    (tests / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    proc, report = gpu_run("--tests", tests, "--out", tmp_path / "out", "--file-limit", 10, timeout=120)
    assert proc.returncode == 1 and report["exit_code"] == 1, proc.stdout + proc.stderr
    files = report["files"]
    assert files["test_ok"]["status"] == "passed" and files["test_ok"]["passed"] == 1
    assert files["test_bad"]["status"] == "failed" and (files["test_bad"]["failed"], files["test_bad"]["passed"]) == (1, 1)
    assert "assert 1 == 2" in files["test_bad"]["tail"]
    assert files["test_slow"]["status"] == "timeout" and files["test_slow"]["seconds"] < 40
    # The budget spent: a file is reported as not run, which is not a failure.
    proc, report = gpu_run("--tests", tests, "--out", tmp_path / "out2", "--budget", 1, "ok", timeout=60)
    assert proc.returncode == 0 and report["files"]["test_ok"]["status"] == "not run"
