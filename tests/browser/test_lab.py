"""`fsdplab lab`: the lessons ship inside the package, are copied into the learner's working folder without ever
overwriting a copy there, and an installed wheel (not the repository) carries them."""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

import psutil
import pytest
from jupyter_client import BlockingKernelClient

from fsdplab.runner import cli, lab

ROOT = Path(__file__).resolve().parents[2]


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
    edited.write_text('{"cells": [], "metadata": {"my": "edits"}}')   # JupyterLab saves JSON
    (tmp_path / "mine" / shipped[2]).unlink()               # as if a newer release had added this lesson
    copied, kept = lab.copy_lessons(tmp_path / "mine")
    assert copied == [shipped[2]] and len(kept) == len(shipped) - 1
    assert json.loads(edited.read_text())["metadata"] == {"my": "edits"}


def test_a_file_in_place_of_the_folder_is_refused_with_the_fix(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert cli.main(["lab", str(tmp_path / "f"), "--copy-only"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_lab_starts_jupyterlab_in_the_working_folder(tmp_path, monkeypatch):
    started = {}

    def call(command, cwd):
        started.update(command=command, cwd=cwd)
        return 0

    monkeypatch.setattr(lab, "serve", call)
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
    code = ("import fsdplab, fsdplab.runner.cli as c; print(fsdplab.__file__); "
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


def test_a_copy_cut_short_by_a_full_disk_leaves_no_half_lesson(tmp_path):
    """A file-size limit cuts the copy short as a full disk would: one line, exit 2, no partial lesson
    left to be kept as an edit; the next command copies every lesson whole."""
    sizes = sorted(p.stat().st_size for p in lab.shipped_lessons())
    limit = (sizes[0] + sizes[-1]) // 2                 # some lessons fit, the largest does not

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the write fails with EFBIG, as with ENOSPC
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    work = tmp_path / "work"
    command = [sys.executable, "-m", "fsdplab", "lab", str(work), "--copy-only"]
    cut = subprocess.run(command, preexec_fn=limited, capture_output=True, text=True, timeout=120)
    assert cut.returncode == 2, cut
    assert len(cut.stderr.strip().splitlines()) == 1 and "nothing half-written" in cut.stderr, cut.stderr
    for path in work.iterdir():
        assert not path.name.startswith("."), f"{path.name}: a partial copy was left"
        json.loads(path.read_text())                       # whole, not cut short
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done
    for lesson in lab.shipped_lessons():
        assert (work / lesson.name).read_bytes() == lesson.read_bytes(), lesson.name


def test_a_lesson_that_is_not_json_is_moved_aside_and_copied_afresh(tmp_path, capsys):
    """Half a copy an older release left is not an edit: it is moved aside (never deleted) with a line."""
    lesson = lab.shipped_lessons()[3]
    work = tmp_path / "work"
    work.mkdir()
    torn = lesson.read_bytes()[:1000]
    (work / lesson.name).write_bytes(torn)
    (work / (lesson.stem + ".broken.ipynb")).write_text("an earlier one")   # never overwritten
    copied, kept = lab.copy_lessons(work)
    assert lesson.name in copied and lesson.name not in kept
    assert (work / lesson.name).read_bytes() == lesson.read_bytes()
    assert (work / (lesson.stem + ".broken-2.ipynb")).read_bytes() == torn
    assert (work / (lesson.stem + ".broken.ipynb")).read_text() == "an earlier one"
    out = capsys.readouterr().out
    assert f"{lesson.name} was not a whole notebook" in out and f"{lesson.stem}.broken-2.ipynb" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_jupyterlab_and_its_kernels(tmp_path, signum):
    """SIGTERM, or a Ctrl-C sent to the command alone: JupyterLab and the kernel it started are gone,
    its port is free, the command exits 130 with one line of its own and no traceback."""
    port = _free_port()
    env = {**os.environ, "JUPYTER_TOKEN": "test-token", "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    command = [sys.executable, "-m", "fsdplab", "lab", str(tmp_path / "work"), "--no-browser", "--port",
               str(port), "--allow-root"]
    lab_process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(lab_process.stdout), daemon=True)
    reader.start()
    started = []
    try:
        # JupyterLab is up when its port answers (its printed address can come before it listens)
        deadline = time.monotonic() + 180
        while True:
            assert lab_process.poll() is None, "".join(lines)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"JupyterLab did not listen on {port} in 180 s: {lines}"
                time.sleep(0.5)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=b"{}", method="POST",
                                         headers={"Authorization": "token test-token"})
        kernel_id = json.loads(urllib.request.urlopen(request, timeout=120).read())["id"]
        # a kernel stopped while it still imports prints its own traceback: wait until it answers
        client = BlockingKernelClient(connection_file=str(tmp_path / "runtime" / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            client.wait_for_ready(timeout=120)
        finally:
            client.stop_channels()
        started = psutil.Process(lab_process.pid).children(recursive=True)
        assert len(started) >= 2, f"JupyterLab and kernel {kernel_id} did not both start: {started}"
        os.kill(lab_process.pid, signum)
        assert lab_process.wait(timeout=60) == 130
        reader.join(timeout=10)
        output = "".join(lines)
        assert "Traceback" not in output, output
        ours = [line for line in lines if line.startswith("fsdplab lab:")]
        assert len(ours) == 1 and signal.Signals(signum).name in ours[0], output
        deadline = time.monotonic() + 10
        while any(map(_alive, started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p.pid for p in started if _alive(p)], "JupyterLab or its kernel outlived the command"
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # refused only while one listens
            s.bind(("127.0.0.1", port))                   # nothing serves on the port any more
    finally:
        for process in [lab_process, *started]:
            try:
                process.kill()
            except (OSError, psutil.Error):
                pass
