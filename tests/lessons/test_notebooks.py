"""Every lesson notebook runs end to end with papermill at its small defaults; its own checks are the check.

A lesson that ends with a cell tagged `checks` (fsdplab.records.check calls) records at least one number and
every one of its checks is ok, read back from the executed notebook.

A run also must leave the repository as it was (figures and files go under the output folder) and show no
warning the learner did not ask for."""

import re
import shutil
from pathlib import Path

import nbformat
import pytest

from fsdplab import records
from fsdplab.runner import forkserver
from fsdplab.runner.cli import NOTEBOOK_DIR, lesson_paths, run_lessons
from fsdplab.runtime.processes import PYTHON_COMMAND_ENV

LESSONS = lesson_paths()
REPOSITORY = NOTEBOOK_DIR.parent
# Output a learner should not see: library warnings, progress bars frozen in the saved output.
NOISE = re.compile(r"\w*Warning\b|Unable to parse line|\b0%\|")


def repository_files() -> dict:
    """Path -> modification time of everything under notebooks/ and docs/."""
    return {p: p.stat().st_mtime_ns for folder in ("notebooks", "docs")
            for p in (REPOSITORY / folder).rglob("*") if p.is_file()}


def noise(executed: Path) -> list:
    """The stderr lines of an executed notebook that look like a warning or a frozen progress bar."""
    lines = []
    for cell in nbformat.read(executed, as_version=4).cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines += [line.strip() for line in out["text"].splitlines() if NOISE.search(line)]
    return lines




def has_checks_cell(path: Path) -> bool:
    """A converted lesson: its last cell is the code cell tagged `checks`, collapsed."""
    last = nbformat.read(path, as_version=4).cells[-1]
    return (last.cell_type == "code" and "checks" in last.metadata.get("tags", [])
            and last.metadata.get("jupyter", {}).get("source_hidden") is True)


@pytest.fixture(scope="session")
def lesson_server(tmp_path_factory):
    """One fork server for the lesson runs of this test process, as one `fsdplab run` of every lesson has (a
    server per lesson imported torch, transformers and peft again for each). None where there is none."""
    socket = tmp_path_factory.mktemp("forkserver") / "forkserver.sock"
    if not forkserver.available() or len(str(socket)) > 100:    # a Unix socket's path: at most 107 bytes
        yield None
        return
    server = forkserver.start(str(socket.parent))
    forkserver.point_clusters_at(None)      # only the lesson runs fork from it (`serving`)
    yield str(socket) if server is not None else None
    forkserver.stop(server)


@pytest.fixture
def serving(lesson_server, monkeypatch):
    """The session's lesson server, for this test's runs to find (fsdplab.runner.forkserver.running)."""
    if lesson_server:
        monkeypatch.setenv(forkserver.ENV, lesson_server)
        monkeypatch.setenv(PYTHON_COMMAND_ENV, "")          # restored after the test; set just below
        forkserver.point_clusters_at(lesson_server)
    return lesson_server


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs(path: Path, tmp_path, monkeypatch, estimate_cache, executed_lessons, serving):
    monkeypatch.delenv("FSDPLAB_FIGURES", raising=False)   # the runner's default: under its output folder
    monkeypatch.setenv("FSDPLAB_ESTIMATE_CACHE", str(estimate_cache))
    before = repository_files()
    [(lesson, status, seconds, detail)] = run_lessons([path], out_dir=tmp_path, progress=False)
    executed = tmp_path / path.name
    assert status == "ok", f"{lesson} failed at {detail}; executed notebook: {executed}"
    assert forkserver.running() == serving, "the run did not leave the shared server as it found it"
    after = repository_files()
    changed = sorted(str(p.relative_to(REPOSITORY)) for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"running {lesson} wrote into the repository: {changed}"
    assert not noise(executed), f"{lesson} shows warnings a learner did not ask for: {noise(executed)}"
    if has_checks_cell(path):
        found = records.read(executed)
        values = [r for r in found if r["kind"] == "value"]
        checks = [r for r in found if r["kind"] == "check"]
        assert values, f"{lesson} recorded no number (fsdplab.records.record)"
        assert checks, f"{lesson}'s cell tagged checks recorded no check"
        failed = [records.line(r) for r in checks if not r["ok"]]
        assert not failed, f"{lesson}: {failed}"
        names = [r["name"] for r in found]
        assert len(names) == len(set(names)), f"{lesson} records a name twice: {names}"
        assert all(name.startswith(path.stem[:2] + "-") for name in names), f"{lesson}: {names}"
    for name in (path.name, "run_info.json"):   # for tests/lessons/test_site.py: the site is built from these
        shutil.copy(tmp_path / name, executed_lessons / name)


# Every lesson's code cells read without scrolling: at most 20 lines, none over 100 characters.
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_code_cells_fit_on_a_screen(path: Path):
    too_long = {}
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        lines = cell.source.splitlines() if cell.cell_type == "code" else []
        wide = [n for n, line in enumerate(lines, 1) if len(line) > 100]
        if len(lines) > 20 or wide:
            too_long[index] = f"{len(lines)} lines, lines over 100 characters: {wide}"
    assert not too_long, f"cells to shorten (cell index: what): {too_long}"
