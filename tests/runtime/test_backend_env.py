"""FSDPLAB_BACKEND: what backend="auto" means for a whole run (`fsdplab run --backend`, the CPU test suite)."""

import pytest

import fsdplab
from fsdplab.runtime import processes


def test_the_cpu_suite_runs_on_gloo_even_with_gpus(monkeypatch):
    # tests/conftest.py sets FSDPLAB_BACKEND=gloo: the suite's Cluster(n) stay on CPU ranks on a GPU machine.
    monkeypatch.setattr(processes, "gpu_count", lambda: 8)
    assert processes.choose_backend(2) == "gloo"
    assert fsdplab.Cluster(2).backend == "gloo"


@pytest.mark.parametrize("env, backend, expected", [
    (None, "auto", "nccl"), ("auto", "auto", "nccl"), ("gloo", "auto", "gloo"), ("nccl", "auto", "nccl"),
    ("gloo", "nccl", "nccl"), ("nccl", "gloo", "gloo"),   # an explicit backend= wins
])
def test_auto_follows_fsdplab_backend(monkeypatch, env, backend, expected):
    monkeypatch.setattr(processes, "gpu_count", lambda: 4)
    if env is None:
        monkeypatch.delenv(processes.BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(processes.BACKEND_ENV, env)
    assert processes.choose_backend(2, backend) == expected


def test_fsdplab_backend_nccl_without_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(processes, "gpu_count", lambda: 0)
    monkeypatch.setenv(processes.BACKEND_ENV, "nccl")
    with pytest.raises(ValueError, match="backend='gloo'"):
        processes.choose_backend(2)


@pytest.mark.parametrize("bad", ["cuda", "NCCL ", "mpi"])
def test_a_bad_fsdplab_backend_gets_the_fix(monkeypatch, bad):
    monkeypatch.setenv(processes.BACKEND_ENV, bad)
    with pytest.raises(ValueError, match="FSDPLAB_BACKEND=.* set it to auto, gloo or nccl"):
        fsdplab.Cluster(2)
