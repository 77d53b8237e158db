"""One 2-rank cluster for the whole test session: starting one costs seconds, and most test modules need one.

`cluster` hands each module the shared cluster, healthy: if an earlier module left it stopped, broken (a
planted hang, a killed rank) or unresponsive, it is restarted first. A module that needs a cluster of its
own (another world size, a fresh start) makes it itself; `fault_on_fresh_pair` does it for a planted fault
that must be reported in time and recovered from, `assert_killed_rank_is_died_then_restarts` for a rank
killed by a signal.
"""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

import fsdplab
from fsdplab.runtime.processes import BACKEND_ENV

# The tests' own tools (chromium, netns, slurm_nodes), importable from every folder of tests.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from worker_groups import worker_group  # noqa: E402  (pytest-xdist's groups: tests/support/worker_groups.py)

# The suite tests the CPU lab: its clusters (backend "auto", like most Cluster(n) here) must be gloo clusters on a
# machine with GPUs too, where "auto" would pick nccl. tests/gpu/conftest.py takes this out for the GPU checks.
os.environ[BACKEND_ENV] = "gloo"

# The interrupt tests need SIGINT handled, as a Jupyter kernel handles it. A shell's background job
# (`bash .ci/run &`) starts with SIGINT ignored, which Python keeps, and `_thread.interrupt_main()` then does
# nothing; restore Python's handler (child processes, the multi-node scenarios among them, inherit it).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        """xdist's scope scheduling with one scope per group and one per other test, largest first."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid) or nodeid

    return Groups(config, log)


def _healthy(cluster) -> bool:
    if not cluster.running or cluster.broken is not None:
        return False
    try:
        return cluster.run(fsdplab.rank, timeout=20, quiet=True) == list(range(cluster.world_size))
    except Exception:
        return False


@pytest.fixture(scope="session")
def _shared_cluster():
    cluster = fsdplab.Cluster(2)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def cluster(_shared_cluster):
    if not _shared_cluster.running:
        _shared_cluster.start()
    elif not _healthy(_shared_cluster):
        _shared_cluster.restart()
    yield _shared_cluster


@pytest.fixture(scope="session")
def estimate_cache(tmp_path_factory, request):
    """The lesson runs of a test session share exact estimates, as the lessons of one `fsdplab run` do: all workers
    of one pytest-xdist run share one cache (the matrix and the default runs estimate many settings alike); its
    `.pending` markers make a worker wait for an estimate another is making."""
    base = tmp_path_factory.getbasetemp()
    worker = hasattr(request.config, "workerinput")       # an xdist worker: basetemp is <the run>/popen-gwN
    return (base.parent if worker else base) / "estimate-cache"


def _fault_on_a_fresh_pair(code: str, error: type, *, within: float, timeout: float) -> BaseException:
    """Run `code` on a fresh 2-rank gloo cluster: it must raise `error` in under `within` seconds (long before
    `timeout`, when a hang would be reported instead). Then the cluster must restart and answer again.
    Returns the error for the caller's own checks."""
    with fsdplab.Cluster(2, backend="gloo", quiet=True) as c:
        t0 = time.monotonic()
        with pytest.raises(error) as info:
            c.execute(code, timeout=timeout)
        elapsed = time.monotonic() - t0
        assert elapsed < within, f"{error.__name__} after {elapsed:.1f} s, not under {within} s"
        c.restart()
        assert c.run(fsdplab.rank) == [0, 1]
    return info.value


@pytest.fixture
def fault_on_fresh_pair():
    """`_fault_on_a_fresh_pair` for a test to call (a fixture: test modules do not import conftest)."""
    return _fault_on_a_fresh_pair


def _assert_killed_rank_is_died_then_restarts(cluster, wait_until_dead) -> None:
    """Kill rank 1 of the 2-rank `cluster` with SIGKILL and call `wait_until_dead(pid)`, which returns once the
    kill has taken (each caller knows how its ranks are reaped). The next call must raise RankDied with the
    signal as the rank's exit, and the cluster must restart and answer again."""
    pid = cluster.pids[1]
    os.kill(pid, signal.SIGKILL)
    wait_until_dead(pid)
    with pytest.raises(fsdplab.RankDied) as info:
        cluster.run(fsdplab.rank)
    assert info.value.exits == {1: -signal.SIGKILL}
    cluster.restart()
    assert cluster.run(fsdplab.rank) == [0, 1]


@pytest.fixture
def assert_killed_rank_is_died_then_restarts():
    """`_assert_killed_rank_is_died_then_restarts` for a test to call."""
    return _assert_killed_rank_is_died_then_restarts


@pytest.fixture(scope="session")
def executed_lessons(tmp_path_factory):
    """Where tests/lessons/test_notebooks.py leaves each lesson it executed (with the run's run_info.json), for the site
    tests to build from without running anything again."""
    return tmp_path_factory.mktemp("executed-lessons")
