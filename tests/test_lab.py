"""`fsdplab lab`: the lessons ship inside the package, are copied into the learner's working folder without ever
overwriting a copy there, and an installed wheel (not the repository) carries them."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path
import pytest

from fsdplab import cli, lab

ROOT = Path(__file__).resolve().parent.parent


def cli_args(argv):
    """What `fsdplab ARGV` hands its command, parsed by the real parser (its command is replaced by a recorder)."""
    seen = {}
    original = lab.lab_command
    lab.lab_command = lambda args: seen.setdefault("args", args) and 0
    try:
        cli.main(argv)
    finally:
        lab.lab_command = original
    return seen["args"]


def test_copy_keeps_the_learners_edits_and_adds_new_lessons(tmp_path):
    shipped = [p.name for p in lab.shipped_lessons()]
    assert shipped == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    copied, kept = lab.copy_lessons(tmp_path / "mine")
    assert copied == shipped and kept == []
    edited = tmp_path / "mine" / shipped[1]
    edited.write_text("my edits")
    (tmp_path / "mine" / shipped[2]).unlink()               # as if a newer release had added this lesson
    copied, kept = lab.copy_lessons(tmp_path / "mine")
    assert copied == [shipped[2]] and len(kept) == len(shipped) - 1
    assert edited.read_text() == "my edits"


def test_a_file_in_place_of_the_folder_is_refused_with_the_fix(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert cli.main(["lab", str(tmp_path / "f"), "--copy-only"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_lab_starts_jupyterlab_in_the_working_folder(tmp_path, monkeypatch):
    started = {}

    def call(command, cwd):
        started.update(command=command, cwd=cwd)
        return 0

    monkeypatch.setattr(lab.subprocess, "call", call)
    args = cli_args(["lab", str(tmp_path / "w"), "--no-browser", "--port", "8899", "--allow-root"])
    assert lab.lab_command(args) == 0
    folder = (tmp_path / "w").resolve()
    assert started["cwd"] == folder and started["command"][1:3] == ["-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={folder}" in started["command"] and "--no-browser" in started["command"]
    assert "--port=8899" in started["command"] and "--allow-root" in started["command"]


def test_a_built_wheel_carries_the_lessons_and_runs_them_from_outside_the_repository(tmp_path):
    """Built as a user's `pip install fsdplab` would get it; imported from the unpacked wheel, not the repository."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("fsdplab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    lessons = sorted(n for n in names if n.startswith("fsdplab/notebooks/") and n.endswith(".ipynb"))
    assert [Path(n).name for n in lessons] == [p.name for p in lab.shipped_lessons()]
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    work = tmp_path / "work"
    code = ("import fsdplab, fsdplab.cli as c; print(fsdplab.__file__); "
            "print(len(c.lesson_paths()), c.lesson_paths()[0].parent)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0].startswith(str(tmp_path / "site")), out
    assert out[1] == f"{len(lessons)} {tmp_path / 'site' / 'fsdplab' / 'notebooks'}"
    done = subprocess.run([sys.executable, "-m", "fsdplab", "lab", str(work), "--copy-only"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.iterdir()) == [Path(n).name for n in lessons]
    assert f"{len(lessons)} copied" in done.stdout


@pytest.mark.parametrize("argv", [["lab", "--help"]])
def test_lab_is_listed_in_the_command_line(argv, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "--copy-only" in capsys.readouterr().out
