"""A cluster's cleanup (its finalizer: stop(), the garbage collector, interpreter exit) ends the
ranks through the launcher's own stop, handed in, so the runtime's process helpers import no
launcher."""

from fsdplab.runtime.processes import cleanup


def test_cleanup_calls_the_launchers_stop_and_removes_the_scratch_folder(tmp_path):
    calls = []
    workdir = tmp_path / "scratch"
    workdir.mkdir()
    cleanup(None, [], None, str(workdir), lambda: calls.append("stopped"))
    assert calls == ["stopped"] and not workdir.exists()


def test_a_stop_that_raises_does_not_stop_the_cleanup(tmp_path):
    def broken_stop():
        raise RuntimeError("scancel is gone")

    workdir = tmp_path / "scratch"
    workdir.mkdir()
    cleanup(None, [], None, str(workdir), broken_stop)    # never raises: the finalizer calls it
    assert not workdir.exists()
    cleanup(None, [], None, str(workdir), broken_stop)    # twice is safe
    cleanup(None, [], None, None)
