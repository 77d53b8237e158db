"""Lesson 00's checked exercise: the checker accepts the measured sequence number and rejects the wrong answers a
learner gives, and the exercise's cell measures the same number each time it runs."""

import nbformat
import papermill
import pytest

from fsdplab.runner.cli import NOTEBOOK_DIR
from fsdplab.runner.kernels import UnixSocketKernelManager
from fsdplab.exercises import check


def test_hang_seq_checker_accepts_the_measured_number_and_hints_at_wrong_ones(capsys):
    assert check("00-hang-seq", 3, measured=3).ok
    off_by_one = check("00-hang-seq", 2, measured=3)
    assert not off_by_one.ok and "last one every rank finished" in off_by_one.message
    assert not check("00-hang-seq", 7, measured=3).ok
    assert not check("00-hang-seq", "three", measured=3).ok
    assert not check("00-hang-seq", None, measured=3).ok
    # What else a learner types: a yes/no, a fraction, the number as text, the count of barriers alone.
    for wrong in (True, False, 2.5, "3", 1, 0, -3):
        assert not check("00-hang-seq", wrong, measured=3).ok, wrong
    assert not check("00-hang-seq", True, measured=1).ok
    assert check("00-hang-seq", 3.0, measured=3).ok
    assert "00-hang-seq: correct" in capsys.readouterr().out


@pytest.mark.notebook
def test_the_seq_exercise_stays_right_when_its_cell_runs_again(tmp_path):
    """Lesson 00 up to its checked exercise, the learner's answer 3 in the cell, and the cell run a second
    time, as its feedback invites: both runs measure 3 and say correct."""
    nb = nbformat.read(NOTEBOOK_DIR / "00_start_here.ipynb", as_version=4)
    [index] = [i for i, c in enumerate(nb.cells) if 'check("00-hang-seq"' in c.source]
    answered = nb.cells[index].source.replace("my_seq = None", "my_seq = 3", 1)
    assert answered != nb.cells[index].source
    nb.cells[index].source = answered
    nb.cells[index + 1:] = [nbformat.v4.new_code_cell(answered), nbformat.v4.new_code_cell("cluster.stop()")]
    path = tmp_path / "00_rerun.ipynb"
    nbformat.write(nb, path)
    papermill.execute_notebook(str(path), str(path), parameters={"world_size": 2}, kernel_name="python3",
                               progress_bar=False, cwd=str(tmp_path), kernel_manager_class=UnixSocketKernelManager)
    runs = [nbformat.read(path, as_version=4).cells[i] for i in (index + 1, index + 2)]
    texts = ["".join(out.get("text", "") for out in cell.outputs) for cell in runs]
    for text in texts:
        assert "00-hang-seq: correct" in text, texts
        # RankHang's report, which names the number, comes only after the verdict on the answer
        assert text.index("00-hang-seq: correct") < text.index("waits in barrier #3"), texts
