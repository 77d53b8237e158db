"""fsdplab.memory.workers: the one way estimates run out of process; progress comes back as it happens, errors
with the worker's message, and the worker is a spawned process without the caller's rank variables."""

import pytest

from fsdplab.memory.workers import Workers, estimate_elsewhere
from fsdplab.memory import estimate_here, estimate
from fsdplab.settings import TrainSetting

TINY = TrainSetting(model="tiny", world_size=2, seq_len=32)


def _environment_of_worker():
    import multiprocessing
    import os

    return {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR")}, multiprocessing.current_process().name


def test_an_estimate_elsewhere_equals_one_here_and_relays_its_stages(monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", "")
    lines = []
    there = estimate_elsewhere(estimate_here, TINY, progress=lines.append)
    here = estimate(TINY, progress=False, subprocess_mode=False)
    assert there.peak_bytes == here.peak_bytes and there.by_category == here.by_category
    assert lines and all(line.startswith("[estimate tiny x2]") for line in lines), lines
    assert any("peak" in line for line in lines), lines


def _fails():
    import os

    raise ValueError(f"no such model (in process {os.getpid()})")


def test_the_workers_error_reaches_the_caller_with_its_message():
    import os

    with Workers(1) as workers, pytest.raises(ValueError, match=r"no such model \(in process (\d+)\)") as error:
        workers.submit(_fails).result(timeout=120)
    assert str(os.getpid()) not in str(error.value)


def test_a_worker_has_no_rank_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with Workers(1) as workers:
        env, name = workers.submit(_environment_of_worker).result(timeout=120)
    assert env == {"RANK": None, "MASTER_ADDR": None} and name != "MainProcess"
