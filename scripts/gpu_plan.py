"""The steps of the one-shot GPU check (scripts/gpu_run.py --check, from scripts/gpu_check.sh), chosen by GPU count.

    python scripts/gpu_plan.py machine OUT/machine.json    the machine record (printed, and its facts as JSON)

`plan(facts, out, python)` returns phases; a phase is lanes that run side by side, a lane steps in order (dicts of
gpu_run.Step's fields). The estimator's measurement runs alone in the last phase: `mem_get_info` and the device's
memory in use are the whole GPU's, so nothing else may run on it then. Lanes share GPUs only in the default
compute mode; where any GPU is EXCLUSIVE_PROCESS every step runs in one lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MACHINE_JSON = "machine.json"
RECIPE = ["-m", "torch.distributed.run", "--standalone"]
LESSON_LINES = r"^\d\d_\w+\s+(ok|FAILED|interrupted|not run)\b|lesson\(s\) failed|^lesson\s+status"
RECIPE_LINES = r"steps in |peak memory|Error|nan|inf\b"


def machine_step(out: Path) -> dict:
    """The machine record: a record, not a check (it fails only where torch does not import)."""
    return dict(name="00_machine",
                cmd=[sys.executable, str(Path(__file__).resolve()), "machine", str(out / MACHINE_JSON)],
                limit_s=60, min_s=0, keep=r"^(torch|python|gpu \d|CUDA_VISIBLE_DEVICES|/dev/shm|tmpfs|shm)")


def read_facts(out: Path) -> dict:
    path = out / MACHINE_JSON
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"gpus": [], "no_gpu_reason": f"no machine record ({path} missing: torch did not import?)"}


def visible_ids(facts: dict) -> list:
    """CUDA_VISIBLE_DEVICES values for the GPUs torch sees, in torch's order (respecting a set mask)."""
    mask = facts.get("cuda_visible_devices")
    ids = [i.strip() for i in mask.split(",") if i.strip()] if mask else []
    return [ids[i] if i < len(ids) else str(i) for i in range(len(facts.get("gpus", [])))]


def _on(ids) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def plan(facts: dict, out: Path, python: str = sys.executable) -> list:
    """The steps for the GPUs in `facts` (the machine record); with none, those of one GPU (listed, not run)."""
    ids = visible_ids(facts) or ["0"]
    ngpu = len(ids)
    n = min(ngpu, 8)
    py = [python]
    figures = lambda name: {"FSDPLAB_FIGURES": str(out / name / "figures"), "MPLBACKEND": "Agg"}  # noqa: E731
    gpu_run = lambda name, budget, *args: [*py, str(ROOT / "scripts" / "gpu_run.py"), "--out", str(out / name),  # noqa: E731
                                            "--budget", str(budget), *args]

    def lessons(name, world_size, gpus, limit, *which):
        return dict(name=name, cmd=[*py, "-m", "fsdplab", "run", *which, "--world-size", str(world_size),
                                    "--out", str(out / name), "--no-progress"],
                    limit_s=limit, min_s=60, env={**_on(gpus), **figures(name)}, keep=LESSON_LINES)

    def recipe(name, limit, *flags):
        return dict(name=name, cmd=[*py, *RECIPE, "--nproc_per_node", str(n), "-m", "fsdplab.recipes.lora",
                                    "--model", "tiny", *flags, "--output-dir", str(out / name / "adapter")],
                    limit_s=limit, min_s=20, env={**_on(ids[:n]), **figures(name)}, keep=RECIPE_LINES)

    doctor = dict(name="01_doctor", cmd=[*py, "-m", "fsdplab", "doctor"], limit_s=60, min_s=10, keep=r".",
                  explain={r"invalid choice: 'doctor'": "this checkout has no `fsdplab doctor` command "
                                                        "(fsdplab/runner/doctor.py): nothing was checked by it"})
    # Lane 1: every lesson at world size 1 on the first GPU (their one-GPU branches).
    ws1 = [lessons("02_lessons_ws1", 1, ids[:1], 330)]
    # Lane 2 (2+ GPUs): every lesson at world size 2 on nccl, on GPUs the first lane does not use where there are
    # enough; with 4+, lessons 04 and 07 at their own 4 ranks.
    multi = []
    if ngpu >= 2:
        pair = ids[1:3] if ngpu >= 3 else ids[:2]
        multi.append(lessons("03_lessons_ws2_nccl", 2, pair, 330))
        if ngpu >= 4:
            multi.append(lessons("03b_lessons_ws4_nccl", 4, ids[:4], 90, "04", "07"))
    # Lane 3: tests/gpu (one pytest process per file; the lessons and the estimator have steps of their own), then
    # the torchrun recipe on every GPU (up to 8): bf16, fp16 (the posts' dtype), CPU offload.
    tests = dict(name="04_gpu_tests", cmd=gpu_run("04_gpu_tests", 110, "--file-limit", "60", "-k", "not one_b",
                                                  "env", "cluster", "fsdp1", "offload"),
                 limit_s=120, min_s=30, env=figures("04_gpu_tests"), gpu_run=True)
    recipes = [recipe("05_recipe_bf16", 90, "--steps", "30", "--log-every", "10"),
               recipe("06_recipe_fp16", 90, "--steps", "30", "--log-every", "10", "--precision", "fp16"),
               recipe("07_recipe_cpu_offload", 90, "--steps", "10", "--log-every", "5", "--cpu-offload")]
    # Alone at the end: the 17 settings of the estimator against max_memory_allocated / reserved / device used.
    memory = dict(name="08_memory", cmd=gpu_run("08_memory", 160, "--file-limit", "160", "memory"),
                  limit_s=170, min_s=60, env={**_on(ids[:1]), **figures("08_memory")}, gpu_run=True)
    lanes = [ws1, multi, [tests, *recipes]]
    if any("exclusive" in str(g.get("compute_mode", "")).lower() for g in facts.get("gpus", [])):
        lanes = [[step for lane in lanes for step in lane]]
    return [[[doctor]], [lane for lane in lanes if lane], [[memory]]]


def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"({' '.join(cmd)}: {err})\n"


def machine(path: Path) -> int:
    """Print the machine record and write its facts to `path` (JSON)."""
    facts = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpus": []}
    print(_run(["date", "-u"]).strip())
    print(_run(["git", "-C", str(ROOT), "log", "-1", "--format=commit %H %s"]).strip())
    print(f"python {sys.version.split()[0]} ({sys.executable}); {os.cpu_count()} CPUs")
    print("CUDA_VISIBLE_DEVICES="
          f"{facts['cuda_visible_devices'] if facts['cuda_visible_devices'] is not None else '<unset>'}")
    print(_run(["df", "-h", "/dev/shm"]).strip())   # NCCL's SHM transport fails in containers with a 64 MB /dev/shm
    smi = _run(["nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total,memory.used,compute_mode",
                "--format=csv,noheader"]) if _has("nvidia-smi") else ""
    modes = [line.split(",")[-1].strip() for line in smi.splitlines() if line.count(",") >= 5]
    if smi:
        print(_run(["nvidia-smi"]))
        print(_run(["nvidia-smi", "topo", "-m"]))
    else:
        print("nvidia-smi: not found")
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - the record says why, the check stops there
        facts["no_gpu_reason"] = f"torch does not import: {type(err).__name__}: {err}"
        print(facts["no_gpu_reason"])
        path.write_text(json.dumps(facts, indent=1))
        return 1
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() and torch.distributed.is_nccl_available() else None
    facts.update(torch=torch.__version__, cuda=torch.version.cuda,
                 nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {facts['nccl']}, "
          f"{torch.cuda.device_count()} GPU(s) visible to torch")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": round(total / 2**30, 1),
               "free_gib": round(free / 2**30, 1), "compute_mode": modes[i] if i < len(modes) else None}
        facts["gpus"].append(gpu)
        print(f"gpu {i}: " + ", ".join(f"{k} {v}" for k, v in gpu.items()))
    if not facts["gpus"]:
        facts["no_gpu_reason"] = (f"torch {torch.__version__} is a CPU build" if not torch.version.cuda else
                                  f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                                  f"(CUDA_VISIBLE_DEVICES={facts['cuda_visible_devices']!r})")
        print(f"no GPU: {facts['no_gpu_reason']}")
    path.write_text(json.dumps(facts, indent=1))
    return 0


def _has(program: str) -> bool:
    return any((Path(d) / program).exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "machine":
        sys.exit("usage: python scripts/gpu_plan.py machine OUT/machine.json")
    sys.exit(machine(Path(sys.argv[2])))
