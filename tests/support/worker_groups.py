"""pytest-xdist (`-n 2 --dist loadgroup`): the tests that share something across a session run on one worker, in
their order: the multi-node daemons (fixed node names and addresses), the matrix (one module fixture runs every
selected lesson), and the tests that read the lessons this session executed (`executed_lessons`, one folder per
worker). The groups are given here by test id: xdist's own xdist_group mark is lost under pytest 9, which no
longer lets a plugin rename a test (pytest-xdist issue 1386). tests/unit/test_worker_groups.py checks that each
id below still names a test."""

MULTINODE = "tests/multinode/"
MATRIX = "tests/lessons/test_cli_run.py::test_lesson_runs_at_any_world_size["
EXECUTED_LESSON_TESTS = ("tests/lessons/test_notebooks.py::test_lesson_runs[", "tests/lessons/test_site.py::",
                         "tests/lessons/test_script_export.py::test_the_exported_lesson_records_what_the_notebook_",
                         "tests/lessons/test_script_export.py::test_ranks_cells_pasted_into_a_script_print_the_")


def worker_group(nodeid: str) -> str | None:
    """The group a test must share a worker with, or None."""
    if nodeid.startswith(MULTINODE):
        return "multinode"
    if nodeid.startswith(MATRIX):
        return "matrix"
    if nodeid.startswith(EXECUTED_LESSON_TESTS):
        return "executed-lessons"
    return None
