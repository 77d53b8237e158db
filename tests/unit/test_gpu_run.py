"""scripts/gpu_run.py without a GPU: every file of tests/gpu is reported, its tests skipped with the CUDA
reason (not failed), the JSON written; a failing test, or a file past its time limit, makes the exit code 1; a file
cut by the budget or never started makes it 3. The one-shot check (gpu_check.sh, gpu_run.py --check): without a
GPU it says so and exits 4; its step table and exit code with fake steps; the steps gpu_plan.py picks per GPU count."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_run.py"


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


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
    assert (files["test_bad"]["status"] == "failed"
            and (files["test_bad"]["failed"], files["test_bad"]["passed"]) == (1, 1))
    assert "assert 1 == 2" in files["test_bad"]["tail"]
    assert files["test_slow"]["status"] == "timeout" and files["test_slow"]["seconds"] < 40
    # The budget spent: a file is reported as not run, which is not a failure but not a pass either.
    proc, report = gpu_run("--tests", tests, "--out", tmp_path / "out2", "--budget", 1, "ok", timeout=60)
    assert report["files"]["test_ok"]["status"] == "not run"
    assert proc.returncode == 3 and report["exit_code"] == 3, proc.stdout + proc.stderr


def test_a_file_cut_by_the_budget_gives_exit_code_3(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tests / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    # The file's own limit (100 s) is far off; the total budget (20 s) stops it: "cut", and the run is incomplete.
    proc, report = gpu_run("--tests", tests, "--out", tmp_path / "out", "--budget", 20, "--file-limit", 100,
                           timeout=120)
    assert report["files"]["test_ok"]["status"] == "passed"
    assert report["files"]["test_slow"]["status"] == "cut", report["files"]["test_slow"]
    assert proc.returncode == 3 and report["exit_code"] == 3, proc.stdout + proc.stderr


def test_check_without_a_gpu_says_so_and_exits_4(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "no GPU:" in proc.stdout and "Nothing was checked" in proc.stdout, proc.stdout
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert rows[0][:2] == ["step", "status"] and rows[1][:2] == ["00_machine", "passed"]
    assert len(rows) > 3 and all(r[1] == "not run (no GPU)" for r in rows[2:]), rows
    assert {r[0] for r in rows} >= {"01_doctor", "02_lessons_ws1", "08_memory"}
    facts = json.loads((tmp_path / "machine.json").read_text())
    assert facts["gpus"] == [] and facts["no_gpu_reason"]
    assert json.loads((tmp_path / "check.json").read_text())["exit_code"] == 4


def fake(gr, name, code, limit=30, min_s=0, **kw):
    return gr.Step(name=name, cmd=[sys.executable, "-c", code], limit_s=limit, min_s=min_s, **kw)


def test_check_steps_table_and_exit_code(tmp_path):
    gr = load("gpu_run")
    ok = fake(gr, "ok", "print('peak 1.5 GiB'); print('noise')", keep=r"^peak")
    bad = fake(gr, "bad", "import sys; print('boom: it broke'); sys.exit(2)")
    doctor = fake(gr, "doctor", "import sys; print(\"error: argument command: invalid choice: 'doctor'\"); sys.exit(2)",
                  explain={r"invalid choice: 'doctor'": "no doctor command"})
    hang = fake(gr, "hang", "import time; time.sleep(60)", limit=2)
    tests = fake(gr, "tests", "import sys; sys.exit(3)", gpu_run=True)
    cut = fake(gr, "cut", "import time; time.sleep(60)", limit=60)
    late = fake(gr, "late", "pass", min_s=30)
    t0 = time.monotonic()
    # Two lanes side by side (ok+bad, doctor+hang), then tests, then a step the budget's end cuts, then one it skips.
    results = gr.run_phases([[[ok, bad], [doctor, hang]], [[tests]], [[cut]], [[late]]], tmp_path, budget=8)
    status = {r["step"]: r["status"] for r in results}
    assert status == {"ok": "passed", "bad": "failed", "doctor": "failed", "hang": "timeout", "tests": "incomplete",
                      "cut": "cut", "late": "skipped (budget)"}, results
    assert time.monotonic() - t0 < 30
    by_name = {r["step"]: r for r in results}
    assert by_name["bad"]["rc"] == 2 and by_name["bad"]["detail"] == "boom: it broke"
    assert by_name["doctor"]["detail"] == "no doctor command"
    assert gr.check_exit_code(results) == 1
    assert gr.check_exit_code([by_name["ok"], by_name["cut"]]) == 3
    assert gr.check_exit_code([by_name["ok"], by_name["late"]]) == 3
    assert gr.check_exit_code([by_name["ok"], by_name["tests"]]) == 3
    assert gr.check_exit_code([by_name["ok"]]) == 0
    gr.write_table(results, tmp_path)
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [r[:2] for r in rows[1:]] == [["ok", "passed"], ["bad", "failed"], ["doctor", "failed"], ["hang", "timeout"],
                                         ["tests", "incomplete"], ["cut", "cut"], ["late", "skipped (budget)"]]
    assert (tmp_path / "bad.log").read_text().endswith("boom: it broke\n") and not (tmp_path / "late.log").exists()
    assert gr.measurements(ok, tmp_path) == ["peak 1.5 GiB"]


def names(phases):
    return [[[s["name"] for s in lane] for lane in phase] for phase in phases]


def gpus(n, mode="Default"):
    return {"cuda_visible_devices": None, "gpus": [{"name": "H200", "compute_mode": mode}] * n}


def test_plan_by_gpu_count(tmp_path):
    plan = load("gpu_plan").plan
    one = plan(gpus(1), tmp_path, "py")
    assert names(one) == [[["01_doctor"]], [["02_lessons_ws1"],
                                             ["04_gpu_tests", "05_recipe_bf16", "06_recipe_fp16",
                                              "07_recipe_cpu_offload"]],
                          [["08_memory"]]]
    steps = {s["name"]: s for phase in one for lane in phase for s in lane}
    assert steps["01_doctor"]["cmd"] == ["py", "-m", "fsdplab", "doctor"]
    assert steps["02_lessons_ws1"]["cmd"][:4] == ["py", "-m", "fsdplab", "run"]
    assert ("--world-size" in steps["02_lessons_ws1"]["cmd"]
            and steps["02_lessons_ws1"]["env"]["CUDA_VISIBLE_DEVICES"] == "0")
    recipe = steps["06_recipe_fp16"]["cmd"]
    assert recipe[recipe.index("--nproc_per_node") + 1] == "1" and "--precision" in recipe and "fp16" in recipe
    assert "--cpu-offload" in steps["07_recipe_cpu_offload"]["cmd"]
    assert steps["08_memory"]["cmd"][-1] == "memory" and steps["08_memory"]["gpu_run"]

    eight = plan(gpus(8), tmp_path, "py")
    lanes = names(eight)[1]
    assert lanes[1] == ["03_lessons_ws2_nccl", "03b_lessons_ws4_nccl"]
    steps = {s["name"]: s for phase in eight for lane in phase for s in lane}
    ws2 = steps["03_lessons_ws2_nccl"]
    assert ws2["cmd"][ws2["cmd"].index("--world-size") + 1] == "2" and ws2["env"]["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert steps["05_recipe_bf16"]["cmd"][steps["05_recipe_bf16"]["cmd"].index("--nproc_per_node") + 1] == "8"
    assert steps["05_recipe_bf16"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert steps["02_lessons_ws1"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"

    two = {s["name"]: s for phase in plan(gpus(2), tmp_path, "py") for lane in phase for s in lane}
    assert two["03_lessons_ws2_nccl"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" and "03b_lessons_ws4_nccl" not in two
    # A set mask is kept: the GPUs are the mask's.
    masked = plan({**gpus(2), "cuda_visible_devices": "4,6"}, tmp_path, "py")
    assert ({s["name"]: s for p in masked for line in p for s in line}["05_recipe_bf16"]["env"]["CUDA_VISIBLE_DEVICES"]
            == "4,6")
    # EXCLUSIVE_PROCESS: a GPU takes one process, so nothing runs side by side.
    exclusive = names(plan(gpus(4, "Exclusive_Process"), tmp_path, "py"))
    assert len(exclusive[1]) == 1 and exclusive[1][0][0] == "02_lessons_ws1"


def test_fetch_gpu_wheels_targets_the_python_asked_for():
    script = ROOT / "scripts" / "fetch_gpu_wheels.sh"
    for args, want in (([], f"{sys.version_info.major}.{sys.version_info.minor}"), (["3.10"], "3.10")):
        proc = subprocess.run(["bash", str(script), "--dry-run", *args], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHON=sys.executable))
        assert proc.returncode == 0, proc.stderr
        assert f"--python-version {want}" in proc.stdout and "--python-version 3.12" not in proc.stdout.replace(
            f"--python-version {want}", ""), proc.stdout
    bad = subprocess.run(["bash", str(script), "--dry-run", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "3.11" in bad.stderr


def test_memory_cases_settings_fp16_and_fit():
    mc = load_path("memory_cases", ROOT / "tests" / "gpu" / "memory_cases.py")
    assert len(mc.CASES) == 17 and not any(name.endswith("-off") for name in mc.CASES)
    settings = {name: mc.setting_of(name) for name in mc.CASES}
    assert all(s.world_size == 1 and not s.cpu_offload for s in settings.values())
    assert settings["1b-full+ac-replicate"].strategy == "replicate" and settings["1b-full"].strategy == "full_shard"
    assert settings["1b-full-eager"].attention == "eager" and settings["1b-full-chunks8"].loss_chunks == 8
    assert settings["qwen7b-lora64-ac-bf16-s8192"].seq_len == 8192
    # No native bf16 below compute capability 8.0 (a T4 is 7.5): every bf16 becomes fp16, nothing else changes.
    t4 = mc.setting_of("qwen7b-lora64-ac-bf16", (7, 5))
    assert (t4.precision, t4.base_dtype) == ("fp16", "fp16")
    assert t4.replace(precision="bf16", base_dtype="bf16") == settings["qwen7b-lora64-ac-bf16"]
    assert mc.setting_of("1b-full", (7, 5)).precision == "fp16" and mc.setting_of("1b-full", (8, 6)).precision == "bf16"
    assert mc.setting_of("1b-full", (7, 5)).base_dtype == settings["1b-full"].base_dtype   # the fp32 master stays
    # A setting runs only where it fits: a 16 GB T4 has no room for 21 GiB; 139 GiB free has.
    view = {"nvidia_smi": 21 * 2**30}
    reason = mc.skip_reason(view, 15 * 2**30)
    assert reason and "15.0 GiB free" in reason and "21.0 GiB" in reason
    assert mc.skip_reason(view, 139 * 2**30) is None
    assert mc.error(18.76, 18.69) == pytest.approx(0.003745, rel=1e-3) and mc.error(0, 0) == 0.0


def load_path(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_env_check_refuses_a_torch_below_the_floor(tmp_path, monkeypatch):
    env = load_path("gpu_test_env", ROOT / "tests" / "gpu" / "test_env.py")
    (tmp_path / "pyproject.toml").write_text('dependencies = [\n    "torch>=2.10",\n    "peft>=0.21",\n]\n')
    assert env.floor_of("torch", tmp_path / "pyproject.toml") == (2, 10)
    assert env.floor_of("numpy", tmp_path / "pyproject.toml") is None
    floor = env.floor_of("torch")
    below = f"{floor[0]}.{floor[1] - 1}.0+cu121" if floor[1] else f"{floor[0] - 1}.99.0"
    monkeypatch.setattr(env, "torch", type("T", (), {"__version__": below}))
    with pytest.raises(AssertionError, match="older than the lab's floor"):
        env.test_torch_at_the_floor(lambda name, value: None)
    monkeypatch.setattr(env, "torch", type("T", (), {"__version__": ".".join(map(str, floor)) + ".1+cu130"}))
    env.test_torch_at_the_floor(lambda name, value: None)
    monkeypatch.setattr(env, "MODEL_MODULES", ("json", "no_such_module_here"))
    with pytest.raises(AssertionError, match="no_such_module_here"):
        env.test_model_packages_import(lambda name, value: None)
