"""fsdplab.estimates_ahead: later lessons' full-scale estimates made ahead during a run of several lessons."""

import json

import nbformat

from fsdplab import cli, estimates_ahead, memory
from fsdplab.lessons.activation_checkpointing import estimate_settings
from fsdplab.lessons.cpu_offload import exact_settings
from fsdplab.lessons.qwen7b_lora import POSTS_SETTING
from fsdplab.settings import TrainSetting


def test_settings_are_the_later_lessons_own_once_each_in_lesson_order():
    stems = ["00_start_here", "01_sharding_math", "03_cpu_offload", "06_qwen7b_lora_8xA10", "08_activation"]
    assert estimates_ahead.settings_for(stems) == [exact_settings()[2], POSTS_SETTING, estimate_settings()[0]]
    assert estimates_ahead.settings_for(["00_start_here", "01_sharding_math"]) == []


def test_main_fills_the_cache_and_skips_what_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(tmp_path))
    tiny = TrainSetting(model="tiny", world_size=2, seq_len=32)
    listing = json.dumps([memory._setting_payload(tiny)])
    estimates_ahead.main(listing)
    cached = memory._cache_path(tiny)
    assert cached.exists() and memory.cached_estimate(tiny).peak_bytes > 0
    before = cached.stat().st_mtime_ns
    estimates_ahead.main(listing)
    assert cached.stat().st_mtime_ns == before, "a cached setting was estimated again"


def test_started_in_the_background_and_stopped(tmp_path):
    process = estimates_ahead.start(["08_activation"], str(tmp_path))
    try:
        assert process.poll() is None, "the background estimates ended at once"
    finally:
        estimates_ahead.stop(process)
    assert process.poll() is not None
    assert estimates_ahead.start(["00_start_here"], str(tmp_path)) is None


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
