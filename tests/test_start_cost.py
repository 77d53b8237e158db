"""What a cluster's start costs the process that starts it: no torch import in the kernel where no GPU can be
there (torch alone takes about a second of a 2-core machine's start), and the same answer as torch's where one
may be."""

import json
import os
import subprocess
import sys

from fsdplab.runtime import processes
from fsdplab.runtime.processes import BACKEND_ENV


def _fresh(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}   # backend="auto", as a user has it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_choosing_the_backend_imports_no_torch_without_gpu_devices():
    if processes.gpu_device_nodes() != []:
        import pytest

        pytest.skip("GPU device files here (or not Linux): torch is asked")
    seen = _fresh("import json, sys, fsdplab\n"
                  "cluster = fsdplab.Cluster(2, quiet=True)\n"
                  "print(json.dumps([cluster.backend, 'torch' in sys.modules]))")
    assert seen == ["gloo", False]


def test_gpu_count_agrees_with_torch():
    seen = _fresh("import json, torch\n"
                  "from fsdplab.runtime.processes import gpu_count\n"
                  "print(json.dumps([gpu_count(),"
                  " torch.cuda.device_count() if torch.cuda.is_available() else 0]))")
    assert seen[0] == seen[1]
