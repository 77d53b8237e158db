#!/usr/bin/env bash
# The one-shot GPU check of fsdplab: at most 8 minutes on one GPU and on 2-8 GPUs. Usage, from anywhere:
#
#   bash scripts/gpu_check.sh [OUT_DIR]          (OUT_DIR: $OUT, else runs/gpu_check)
#   BUDGET_S=450  seconds for all steps together (default 450); a step is not started when less is left than
#                 it needs, and that counts as incomplete; GPU_CHECK_HARD_LIMIT_S=480 stops everything.
#
# The steps, their budget logic, the step table and the exit code live in scripts/gpu_run.py (--check); which
# steps run for how many GPUs in scripts/gpu_plan.py. Without a GPU it records the machine, says so and exits 4
# in seconds (nothing was checked). Results: OUT/steps.tsv (step, status, rc, seconds, limit, detail), one log
# per step OUT/<step>.log, OUT/check.json, OUT/<step>/ (gpu_run.json with the tests' measurements, executed
# notebooks, adapters). Exit code: 0 every step passed; 1 a step failed or timed out; 3 a step was cut by the
# budget, skipped for it, or a test file in it was; 4 no GPU.
#
# Expected times (s), from the 2026-12-04 H200 run's logs (test files, lessons, measure.py) and, for 8 GPUs and
# for what had not run there (fixed lessons, the recipe on tiny, fsdplab doctor), estimates:
#
#   step                     what                                                   1 x H200    8 GPUs
#   00_machine               nvidia-smi, topo, /dev/shm, CUDA_VISIBLE_DEVICES,        3-5        3-5
#                            torch / CUDA / NCCL, each GPU's capability and memory
#   01_doctor                python -m fsdplab doctor (its exit code recorded)       5-15       5-15
#   -- phase 2, lanes side by side (one lane where a GPU is EXCLUSIVE_PROCESS) --
#   02_lessons_ws1           all 16 lessons at --world-size 1 on GPU 0             220-290    220-290
#                            (2026-12-04: 00-08 took 144 s while 6 of them stopped early; 09+10 27 s;
#                            11-13 estimated from CPU runs: 12's estimates run on the CPU, about 20 s)
#   03_lessons_ws2_nccl      all 16 at --world-size 2 on nccl (2+ GPUs)                -      240-320
#   03b_lessons_ws4_nccl     04 and 07 at 4 ranks on nccl (4+ GPUs)                    -       40-60
#   04_gpu_tests             tests/gpu env, cluster, fsdp1, offload (not the 1B)      75-90      85-100
#                            (2026-12-04: 3.2 + 14.2 + 24.3 + 28.6 s of pytest, ~4 s start each)
#   05_recipe_bf16           torchrun -m fsdplab.recipes.lora, tiny, 30 steps         15-30      20-40
#   06_recipe_fp16           the same, --precision fp16                               15-30      20-40
#   07_recipe_cpu_offload    the same, --cpu-offload, 10 steps                        15-30      20-40
#   -- phase 3, alone on the GPU (device-wide memory is read) --
#   08_memory                tests/gpu/test_memory.py: 17 settings, estimate (CPU     80-120     80-120
#                            workers, side by side) vs measured on one rank (measure.py: 49.5 s of builds and
#                            3 steps each, +12 s Cluster(1) start)
#   total                                                                          310-410    330-450
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-runs/gpu_check}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"

# The lessons' Jupyter stack and pytest, from wheels in .whl/ (scripts/fetch_gpu_wheels.sh; no network needed).
if ! "$PY" -c "import pytest, papermill, ipyparallel, ipykernel, cloudpickle" 2>/dev/null; then
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    SITE="${GPU_CHECK_SITE:-/tmp/site}"
    echo "installing $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$ROOT"/.whl/*.whl || echo "wheel install failed: tests/gpu/test_env.py and the lessons will say what is missing"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# gpu_run.py keeps to the budget itself; the hard limit is a last resort (8 minutes).
timeout -k 10 "${GPU_CHECK_HARD_LIMIT_S:-480}" "$PY" "$ROOT/scripts/gpu_run.py" --check --out "$OUT_DIR" \
  --budget "${BUDGET_S:-450}"
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "gpu_check: stopped at the hard limit of ${GPU_CHECK_HARD_LIMIT_S:-480} s; see $OUT_DIR/steps.tsv" >&2
  exit 1
fi
exit "$rc"
