#!/usr/bin/env bash
# The GPU checks in one run (at most 7.5 minutes by default): scripts/gpu_run.py runs each tests/gpu file in
# its own pytest process under a time budget; without a GPU every test is skipped with the reason. Usage:
#
#   bash scripts/gpu_check.sh [OUT_DIR] [scripts/gpu_run.py options]
#
# OUT_DIR defaults to $OUT, else runs/gpu_check; results: OUT_DIR/gpu_run.json and one log per file.
# If pytest / papermill / ipyparallel / ipykernel are missing and wheels lie in .whl/ (scripts/fetch_gpu_wheels.sh),
# they are installed into /tmp/site first (no network needed). Exit code 1 if any test failed.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"

OUT_DIR="${OUT:-runs/gpu_check}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && [ ! -e "$ROOT/tests/gpu/test_$1.py" ]; then
  OUT_DIR="$1"
  shift
fi

if ! "$PY" -c "import pytest, papermill, ipyparallel, ipykernel, cloudpickle" 2>/dev/null; then
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    SITE="${GPU_CHECK_SITE:-/tmp/site}"
    echo "installing $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$ROOT"/.whl/*.whl || echo "wheel install failed: test_env and test_lessons will say what is missing"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# gpu_run.py keeps to its own --budget (default 450 s); the hard limit here is a last resort.
exec timeout -k 15 "${GPU_CHECK_HARD_LIMIT_S:-540}" "$PY" "$ROOT/scripts/gpu_run.py" --out "$OUT_DIR" "$@"
