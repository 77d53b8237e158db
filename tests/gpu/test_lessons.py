"""Every lesson through `python -m fsdplab run` (papermill), on the GPU: the lesson's own asserts are the check.

Lessons that take a world_size run at 1 (one rank on GPU 0, so that their GPU-only cells run), except those
whose code needs two or more ranks: they keep their own world size (on CPU ranks when GPUs are fewer).
Executed notebooks and figures go to $FSDPLAB_GPU_OUT (gpu_run.py's output folder), else to tmp_path.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdplab.runner.cli import lesson_paths

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("FSDPLAB_LESSON_TIMEOUT", 300))
KEEPS_WORLD_SIZE = {
    "00": "expects a hang and a crash while other ranks wait",
    "02": "divides by the ring factor (N-1)/N",
    "04": "compares two ranks' gradient scalers",
    "05": "kills one rank while the other waits",
    "06": "compares two ranks' measured peaks",
    "07": "two ranks per node over two nodes",
}


@pytest.mark.parametrize("path", lesson_paths(), ids=lambda p: p.stem)
def test_lesson_runs_clean(path, record, tmp_path):
    missing = [m for m in ("papermill", "ipykernel", "ipyparallel", "cloudpickle") if not importlib.util.find_spec(m)]
    assert not missing, f"cannot run notebooks: {', '.join(missing)} missing (scripts/gpu_check.sh installs .whl/)"
    out = Path(os.environ.get("FSDPLAB_GPU_OUT") or tmp_path)
    cmd = [sys.executable, "-m", "fsdplab", "run", str(path), "--out", str(out / "notebooks"), "--no-progress"]
    if path.stem[:2] not in KEEPS_WORLD_SIZE:
        cmd += ["--world-size", "1"]
    env = dict(os.environ, FSDPLAB_FIGURES=str(out / "figures"))   # never into docs/figures
    t0 = time.perf_counter()
    # A session of its own: on a timeout the kernel and its ranks go down with it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{path.stem} did not finish within {TIMEOUT_S:.0f} s:\n{output[-3000:]}")
    record("seconds", round(time.perf_counter() - t0, 1))
    assert proc.returncode == 0, output[-5000:]
