"""The worker groups of `-n 2 --dist loadgroup` (tests/support/worker_groups.py) name tests that exist: a renamed
test would otherwise leave its group silently, and run beside the tests it shares a folder or a daemon with."""

import re
from pathlib import Path

from worker_groups import EXECUTED_LESSON_TESTS, MATRIX, MULTINODE, worker_group

ROOT = Path(__file__).resolve().parents[2]


def test_each_group_id_names_a_test_file_and_function():
    assert (ROOT / MULTINODE).is_dir() and list((ROOT / MULTINODE).glob("test_*.py"))
    for prefix in (MATRIX, *EXECUTED_LESSON_TESTS):
        path, _, name = prefix.partition("::")
        source = (ROOT / path).read_text()
        pattern = r"^def test_\w*" if not name else rf"^def {re.escape(name.rstrip('['))}"
        assert re.search(pattern, source, re.M), f"{prefix!r} names no test in {path}"


def test_groups_by_id():
    assert worker_group("tests/multinode/test_slurm.py::test_x") == "multinode"
    assert worker_group(MATRIX + "00-ws1]") == "matrix"
    assert worker_group("tests/lessons/test_notebooks.py::test_lesson_runs[05_checkpoints]") == "executed-lessons"
    assert worker_group("tests/lessons/test_notebooks.py::test_something_else") is None
