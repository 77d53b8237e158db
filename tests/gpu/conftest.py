"""GPU checks: every test here needs CUDA and is skipped, with the reason, without it.

scripts/gpu_run.py runs each file of this folder in its own process under a time budget and keeps what the
tests `record` (ratios, bandwidths, step times) in its JSON report; `python -m pytest tests/gpu` runs them
too. They call the package's own functions, the ones the lessons call, so a check and a lesson cannot
disagree about how something is measured.
"""

import json
import os
from pathlib import Path

import pytest
import torch

import fsdplab
from fsdplab.runtime.processes import BACKEND_ENV

RECORD_ENV = "FSDPLAB_GPU_RECORD"   # JSON file the measurements go to ({test: {name: value}}); set by gpu_run.py
OUT_ENV = "FSDPLAB_GPU_OUT"         # folder for what a test produces (executed lessons); set by gpu_run.py


def no_cuda_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    if not torch.version.cuda:
        return f"needs CUDA: torch {torch.__version__} is a CPU build"
    return f"needs CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


@pytest.fixture(scope="session", autouse=True)
def cuda():
    """GPU 0. Session-scoped and autouse, so it runs (and skips) before any module fixture starts ranks."""
    reason = no_cuda_reason()
    if reason:
        pytest.skip(reason)
    return torch.device("cuda", 0)


@pytest.fixture(scope="module", autouse=True)
def auto_backend():
    """tests/conftest.py keeps the CPU suite on gloo (FSDPLAB_BACKEND); the GPU checks are about what "auto" picks
    on a GPU machine, so here it is unset (and set back after each file: the CPU tests of a run over all of tests/
    stay on gloo). Clusters and lesson runs started here inherit the environment without it."""
    saved = os.environ.pop(BACKEND_ENV, None)
    yield
    if saved is not None:
        os.environ[BACKEND_ENV] = saved


@pytest.fixture(scope="module")
def gpu_cluster(auto_backend):
    """One rank on GPU 0, for the whole file: backend "auto" must pick nccl when every rank has a GPU."""
    with fsdplab.Cluster(1) as cluster:
        assert cluster.backend == "nccl", f"Cluster(1) chose {cluster.backend} although a GPU is visible"
        yield cluster


@pytest.fixture
def record(request):
    """record(name, value): keep a measurement of this test. The JSON file is rewritten at every call, so
    a file killed at its time limit keeps what it measured until then."""
    path = os.environ.get(RECORD_ENV)

    def record(name: str, value) -> None:
        print(f"{request.node.name}: {name} = {value}")
        if not path:
            return
        file = Path(path)
        data = json.loads(file.read_text()) if file.exists() else {}
        data.setdefault(request.node.name, {})[name] = value
        file.write_text(json.dumps(data, indent=1, default=str))

    return record
