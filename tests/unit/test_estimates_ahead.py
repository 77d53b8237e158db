"""fsdplab.runner.estimates_ahead: later lessons' full-scale estimates made ahead during a run of several lessons."""

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest

from fsdplab import lessons, memory
from fsdplab.runner import cli
from fsdplab.memory import cache as estimate_cache, exact, sweep
from fsdplab.runner import estimates_ahead
from fsdplab.lessons.activation_checkpointing import estimate_settings
from fsdplab.lessons.cpu_offload import exact_settings
from fsdplab.lessons.qwen7b_lora import POSTS_SETTING
from fsdplab.settings import TrainSetting


def test_settings_are_the_later_lessons_own_once_each_in_lesson_order():
    stems = ["00_start_here", "01_sharding_math", "03_cpu_offload", "06_qwen7b_lora_8xA10", "08_activation"]
    assert estimates_ahead.settings_for(stems) == [exact_settings()[2], POSTS_SETTING, estimate_settings()[0]]
    assert estimates_ahead.settings_for(["00_start_here", "01_sharding_math"]) == []


def test_every_lesson_has_its_module():
    notebooks = sorted(cli.NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert notebooks
    for path in notebooks:
        name = lessons.MODULES[path.stem[:2]]
        assert path.stem[3:].startswith(name), f"{path.name} is not the lesson of fsdplab.lessons.{name}"
        assert (Path(lessons.__file__).parent / f"{name}.py").is_file()


def test_the_cache_is_filled_and_what_is_there_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    estimates_ahead.estimate_missing([tiny])
    cached = estimate_cache.cache_path(tiny)
    assert cached.exists() and estimate_cache.cached_estimate(tiny).peak_bytes > 0
    before = cached.stat().st_mtime_ns
    estimates_ahead.estimate_missing([tiny])
    assert cached.stat().st_mtime_ns == before, "a cached setting was estimated again"


def test_the_worker_reads_lesson_names_and_estimates_their_settings(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(estimates_ahead, "estimate_missing", asked.append)
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", "elsewhere")
    assert estimates_ahead.estimate_for(["00_start_here", "06_qwen7b_lora_8xA10"], str(tmp_path)) == 1
    assert asked == [[POSTS_SETTING]] and os.environ["FSDPLAB_ESTIMATE_CACHE"] == str(tmp_path)


def test_started_in_the_background_at_the_lowest_priority_and_stopped_with_nothing_left(tmp_path):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = estimates_ahead.start(["08_activation"], str(tmp_path))
    worker, future = started
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ({p.pid for p in psutil.Process().children()} - before):
        time.sleep(0.1)
    # (multiprocessing's resource tracker, started with the first spawned process, lives as long as this one)
    workers = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert workers, "no background worker started"
    time.sleep(3)
    assert not future.done(), "the background estimates ended at once"
    [process] = [p for p in workers if p.nice() == 19]            # the worker itself (beside the executor's helpers)
    assert process.pid == os.getpgid(process.pid) == os.getsid(process.pid)   # a session of its own
    estimates_ahead.stop(started)
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == [], f"left behind: {alive}"
    # (the killed worker's marker stays until a later look finds its maker gone: see estimate_cache)
    nothing = estimates_ahead.start(["00_start_here"], str(tmp_path / "other"))   # nothing to estimate: it ends
    assert nothing[1].result(timeout=120) == 0 and not (tmp_path / "other").exists()
    estimates_ahead.stop(nothing)


def test_one_module_starts_estimate_processes():
    """Every estimate out of process goes through fsdplab.memory.workers (one set-up, one way to stop it)."""
    package = Path(memory.__file__).parent.parent
    starts = re.compile(r"ProcessPoolExecutor\(|multiprocessing\.(Process|Pool)\(|get_context\("
                        r"|-m\", \"fsdplab\.(memory|estimates_ahead)")
    found = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if starts.search(p.read_text()))
    assert found == ["memory/workers.py"], found


def test_runs_of_several_lessons_at_their_defaults_estimate_ahead(tmp_path, monkeypatch):
    started, stopped = [], []
    monkeypatch.setattr(estimates_ahead, "start", lambda paths, cache: started.append((list(paths), cache)) or "p")
    monkeypatch.setattr(estimates_ahead, "stop", stopped.append)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("steps = 3")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("x = steps")]
    paths = [tmp_path / "a.ipynb", tmp_path / "b.ipynb"]
    for path in paths:
        nbformat.write(nb, path)
    cli.run_lessons(paths, tmp_path / "out", progress=False)
    assert [p for p, _ in started] == [paths] and stopped == ["p"]
    cli.run_lessons(paths, tmp_path / "out", parameters={"steps": 4}, progress=False)   # other settings: none
    cli.run_lessons(paths[:1], tmp_path / "out", progress=False)                      # one lesson: none
    assert len(started) == 1 and len(stopped) == 3


def test_a_lesson_waits_for_an_estimate_made_ahead_instead_of_making_it_again(tmp_path, monkeypatch):
    import shutil
    import subprocess
    import sys
    import threading
    import time

    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path / "elsewhere"))
    made = memory.estimate(tiny, progress=False, subprocess_mode=False)   # the report the other process will write
    elsewhere = estimate_cache.cache_path(tiny)
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path / "run"))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])   # stands for estimates ahead
    try:
        estimate_cache.pending_path(tiny).parent.mkdir(parents=True)
        estimate_cache.pending_path(tiny).write_text(json.dumps(estimate_cache._maker_identity(other.pid)))
        assert estimate_cache.estimate_under_way(tiny)
        pending = sweep.start_estimates([tiny, tiny])
        assert pending._pool is None, "a worker started for a setting another process is estimating"
        writer = threading.Timer(1.0, lambda: shutil.copy(elsewhere, estimate_cache.cache_path(tiny)))
        writer.start()
        t0 = time.perf_counter()
        reports = pending.result()
        assert time.perf_counter() - t0 >= 0.9 and pending._pool is None
        assert [r.peak_bytes for r in reports] == [made.peak_bytes] * 2
    finally:
        other.kill()
        other.wait()
    estimate_cache.cache_path(tiny).unlink()
    assert not estimate_cache.estimate_under_way(tiny), "a marker of a process that ended counts as under way"
    assert memory.estimate(tiny, progress=False, subprocess_mode=False).peak_bytes == made.peak_bytes


def test_estimates_ahead_marks_the_setting_it_is_making(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    seen = []
    real = exact.estimate
    monkeypatch.setattr(exact, "estimate", lambda s, **kw: seen.append(estimate_cache.pending_path(s).read_text())
                        or real(s, **kw))
    estimates_ahead.estimate_missing([tiny])
    assert [json.loads(m)["pid"] for m in seen] == [os.getpid()] and not estimate_cache.pending_path(tiny).exists()


def test_a_marker_whose_maker_is_gone_or_reused_is_stale_and_removed(tmp_path, monkeypatch):
    """An interrupted run leaves its markers; later the pid is someone else's (here: this very test's parent)."""
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    marker = estimate_cache.pending_path(tiny)
    marker.parent.mkdir(parents=True, exist_ok=True)
    reused = estimate_cache._maker_identity(os.getppid())
    for stale in ({**reused, "started": reused["started"] - 5},       # the pid lives, but it is another process
                  {**reused, "host": "another-host"},                  # a cache shared across machines
                  "12345",                                             # the old format: a bare pid
                  "{torn"):
        marker.write_text(stale if isinstance(stale, str) else json.dumps(stale))
        assert not estimate_cache.estimate_under_way(tiny), stale
        assert not marker.exists(), f"stale marker {stale} left in place"
    marker.write_text(json.dumps(reused))                              # the real maker, alive: wait for it
    assert estimate_cache.estimate_under_way(tiny)


def test_a_wait_for_another_process_has_an_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    marker = estimate_cache.pending_path(tiny)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(estimate_cache._maker_identity(os.getppid())))   # alive, and never finishing
    t0 = time.monotonic()
    assert estimate_cache.wait_for_estimate(tiny, timeout=1.0) is None
    assert 1.0 <= time.monotonic() - t0 < 30        # its own timeout, not the other process's end
    assert f"process {os.getppid()}" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["", "{", "[1, 2]", '{"peak_bytes": "x"}'])
def test_a_bad_cache_entry_is_a_miss_that_names_the_file(tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    entry = estimate_cache.cache_path(tiny)
    entry.write_text(damage)
    assert estimate_cache.cached_estimate(tiny) is None
    assert str(entry) in capsys.readouterr().err and not entry.exists()
    report = memory.estimate(tiny, progress=False, subprocess_mode=False)   # estimated again, and kept
    assert estimate_cache.cached_estimate(tiny).peak_bytes == report.peak_bytes


def test_an_unwritable_cache_is_no_cache(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path / "file" / "cache"))   # a file where a folder must be
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    report = memory.estimate(tiny, progress=False, subprocess_mode=False)
    assert report.peak_bytes > 0 and "it is not cached" in capsys.readouterr().err


def test_the_cache_key_covers_the_whole_package_code():
    # a change to the step or a model changes what an estimate reports, so it must change the key
    package = Path(memory.__file__).resolve().parent.parent
    covered = set(estimate_cache.code_files())
    assert {package / "sharding.py", package / "models.py", package / "memory" / "exact.py"} <= covered
