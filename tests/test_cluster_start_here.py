"""Lesson 00's checked exercise: the checker accepts the measured sequence number and hints otherwise."""

from fsdplab.exercises import check


def test_hang_seq_checker_accepts_the_measured_number_and_hints_at_wrong_ones(capsys):
    assert check("00-hang-seq", 3, measured=3).ok
    off_by_one = check("00-hang-seq", 2, measured=3)
    assert not off_by_one.ok and "last one every rank finished" in off_by_one.message
    assert not check("00-hang-seq", 7, measured=3).ok
    assert not check("00-hang-seq", "three", measured=3).ok
    assert not check("00-hang-seq", None, measured=3).ok
    assert "00-hang-seq: correct" in capsys.readouterr().out
