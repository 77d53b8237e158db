"""The lab writes into, empties and replaces only folders it made (fsdplab.owned_folders): a
user's folder that holds files is refused in one line and left whole, a symlink planted in the
temporary folder is not followed, a folder the lab marked is reused. Lesson 05's folder, the figure
folder and lesson 10's dump folders use it; the site's replacement is tested in tests/lessons/test_site.py.
"""

import os
import tempfile
from pathlib import Path

import pytest

from fsdplab import owned_folders as owned
from fsdplab.lessons import debugging as dbg
from fsdplab.lessons.checkpoints import lesson_folder


def _user_files(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"notes.txt": "mine", "01_start.ipynb": "{}", ".lock": "42"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def _still_there(folder: Path, files: dict) -> bool:
    return all((folder / name).read_text() == text for name, text in files.items())


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary folder of this test's own, as tempfile sees it (TMPDIR re-read)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("FSDPLAB_OUT", raising=False)
    return folder


def test_the_run_folder_itself_is_refused_in_one_line_and_kept_whole(tmp_path, monkeypatch):
    out = tmp_path / "run"
    files = _user_files(out)
    monkeypatch.setenv("FSDPLAB_OUT", str(out))
    with pytest.raises(ValueError) as err:
        lesson_folder(".")                               # -p checkpoint_dir . under fsdplab run
    message = str(err.value)
    assert "\n" not in message and str(out) in message and "choose a new or empty folder" in message
    assert message.startswith("checkpoint_dir ")
    assert _still_there(out, files)


def test_a_home_like_folder_given_by_its_path_is_refused_and_kept_whole(tmp_path, monkeypatch):
    home = tmp_path / "home"
    files = _user_files(home)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id").write_text("key")
    monkeypatch.setenv("FSDPLAB_OUT", str(tmp_path / "run"))
    with pytest.raises(ValueError, match="choose a new or empty folder"):
        lesson_folder(str(home))
    assert _still_there(home, files) and (home / ".ssh" / "id").read_text() == "key"


def test_a_folder_the_lab_made_is_reused_and_emptied(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDPLAB_OUT", str(tmp_path / "run"))
    folder, keep = lesson_folder("ckpt")
    assert keep and folder == (tmp_path / "run" / "ckpt").resolve() and owned.is_owned(folder)
    (folder / "step-8").mkdir()
    (folder / "latest").write_text("step-8")
    again, _ = lesson_folder(str(folder))
    assert again == folder and owned.is_owned(folder)
    assert [p.name for p in folder.iterdir()] == [owned.MARK]    # the lab's files went, its mark stays
    empty = tmp_path / "empty"
    empty.mkdir()
    assert lesson_folder(str(empty))[0] == empty.resolve() and owned.is_owned(empty)


def test_a_symlink_planted_at_the_fixed_temporary_name_is_not_followed(tmp_path, private_tmp):
    victim = tmp_path / "victim"
    files = _user_files(victim)
    (private_tmp / "ckpt").symlink_to(victim)
    with pytest.raises(ValueError, match="is a symlink"):
        lesson_folder("ckpt")                            # no FSDPLAB_OUT: TMPDIR/ckpt
    (private_tmp / "deeper").symlink_to(victim)          # a symlink part way down, too
    with pytest.raises(ValueError, match="is a symlink"):
        lesson_folder("deeper/ckpt")
    assert _still_there(victim, files) and not (victim / "ckpt").exists()
    made, keep = lesson_folder("fresh/ckpt")             # nothing planted: made private
    assert keep and owned.is_owned(made) and made.parent == (private_tmp / "fresh").resolve()
    assert made.stat().st_mode & 0o077 == 0
    assert (private_tmp / "fresh").stat().st_mode & 0o077 == 0


def test_the_figure_folder_never_writes_through_a_planted_symlink(tmp_path, private_tmp, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fsdplab import display

    monkeypatch.delenv("FSDPLAB_FIGURES", raising=False)
    monkeypatch.setattr(owned, "_temp_fallbacks", {})
    victim = tmp_path / "victim"
    files = _user_files(victim)
    (private_tmp / "fsdplab-figures").symlink_to(victim)
    fig = plt.figure()
    path = display.save_figure(fig, "notes")             # the name of a file of the victim's
    plt.close(fig)
    assert _still_there(victim, files) and not (victim / "notes.png").exists()
    assert path.parent.parent == private_tmp.resolve() and owned.is_owned(path.parent)
    assert path.parent.name.startswith("fsdplab-figures-")
    assert path.parent.stat().st_mode & 0o077 == 0
    assert display.figure_dir() == path.parent     # the same fallback for the rest of the process


def test_the_figure_folder_is_the_fixed_name_when_nothing_is_planted(private_tmp, monkeypatch):
    from fsdplab import display

    monkeypatch.delenv("FSDPLAB_FIGURES", raising=False)
    monkeypatch.setattr(owned, "_temp_fallbacks", {})
    folder = display.figure_dir()
    assert folder == (private_tmp / "fsdplab-figures").resolve() and owned.is_owned(folder)
    assert display.figure_dir() == folder


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to give a folder to another user")
def test_a_folder_of_another_user_in_the_temporary_folder_is_not_used(private_tmp):
    planted = private_tmp / "ckpt"
    planted.mkdir(mode=0o777)
    (planted / owned.MARK).write_text("planted")
    os.chown(planted, 65534, 65534)
    os.chown(planted / owned.MARK, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to another user"):
        lesson_folder("ckpt")
    assert (planted / owned.MARK).read_text() == "planted"


def test_clear_owned_refuses_a_folder_without_the_mark(tmp_path):
    files = _user_files(tmp_path / "mine")
    with pytest.raises(ValueError, match="not a folder the lab made"):
        owned.clear_owned(tmp_path / "mine")
    assert _still_there(tmp_path / "mine", files)


def test_a_failed_replacement_leaves_the_old_folder_whole(tmp_path):
    def first(new):
        (new / "page.html").write_text("old")

    def broken(new):
        (new / "page.html").write_text("half")
        raise OSError(28, "No space left on device")

    folder = owned.replace_owned(tmp_path / "out", first)
    with pytest.raises(OSError):
        owned.replace_owned(folder, broken)
    assert (folder / "page.html").read_text() == "old" and owned.is_owned(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]    # no half-built folder beside it


class _NoCluster:
    """Records what `plant` asks of a cluster: nothing may run when the dump folder is refused."""
    broken = False

    def __init__(self):
        self.calls = []

    def execute(self, source, **kwargs):
        self.calls.append(source)

    def flight_recorder_dumps(self, folder):
        self.calls.append(folder)
        return {}


def test_lesson_10s_dump_folders_are_emptied_only_when_the_lab_made_them(tmp_path):
    files = _user_files(tmp_path / "mine")
    cluster = _NoCluster()
    with pytest.raises(ValueError, match="dump_dir .*choose a new or empty folder"):
        dbg.plant(cluster, "pass", timeout=1, dump_dir=tmp_path / "mine")
    assert cluster.calls == [] and _still_there(tmp_path / "mine", files)
    with pytest.raises(ValueError, match="choose a new or empty folder"):
        dbg.repair_group_names(tmp_path / "no-dumps", tmp_path / "mine")
    assert _still_there(tmp_path / "mine", files)
    dumps = tmp_path / "dumps"
    dbg.plant(cluster, "pass", timeout=1, dump_dir=dumps)
    (dumps / "rank_0").write_bytes(b"an earlier dump")
    dbg.plant(cluster, "pass", timeout=1, dump_dir=dumps)     # the lab's folder: emptied again
    assert [p.name for p in dumps.iterdir()] == [owned.MARK] and len(cluster.calls) == 4


def test_a_checkpoint_listing_leaves_out_the_lab_s_mark(tmp_path):
    # Lesson 05 prints checkpoint_files of a folder the lab made: the mark is no file of the checkpoint.
    from fsdplab.checkpoint import checkpoint_files

    folder = owned.make_owned(tmp_path / "ckpt")
    (folder / "latest").write_text("step-1")
    assert checkpoint_files(folder) == [("latest", 6)]


def test_shared_lesson_folder_without_a_group_is_lesson_folder(tmp_path, monkeypatch):
    # Rank code calls it; outside a process group (a plain script, this test) it is lesson_folder itself. Under a
    # group, rank 0 makes the folder and every rank gets its path: tests/lessons/test_script_export.py (09 pasted).
    monkeypatch.setenv("FSDPLAB_OUT", str(tmp_path))
    folder, keep = owned.shared_lesson_folder("", "09_training_loop")
    assert folder == tmp_path / "09_training_loop" and keep and folder.is_dir()
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="pretrained_dir"):
        owned.shared_lesson_folder(str(tmp_path / "theirs"), "09_training_loop", what="pretrained_dir")
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "mine"


def test_defined_reads_a_scripts_top_level_and_names_a_missing_cell(monkeypatch):
    import sys

    import IPython

    from fsdplab.ranks import defined

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)   # a script: no shell (an earlier test may start one)
    monkeypatch.setattr(sys.modules["__main__"], "my_ring", "the learner's", raising=False)
    assert defined("my_ring") == "the learner's"
    with pytest.raises(NameError, match="'not_written' is not defined on this rank: run the %%ranks cell"):
        defined("not_written")
