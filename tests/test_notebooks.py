"""Every lesson notebook runs end to end with papermill at its small defaults; its own asserts are the check."""

from pathlib import Path

import pytest

from fsdplab.cli import lesson_paths, run_lessons

LESSONS = lesson_paths()


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(path: Path, tmp_path, monkeypatch):
    # The lessons save their headline figures; keep the committed ones in docs/figures untouched.
    monkeypatch.setenv("FSDPLAB_FIGURES", str(tmp_path / "figures"))
    [(lesson, status, seconds, detail)] = run_lessons([path], out_dir=tmp_path, progress=False)
    assert status == "ok", f"{lesson} failed at {detail}; executed notebook: {tmp_path / path.name}"
