"""`fsdplab lab [DIR]`: the learner's own copy of the lessons, opened in JupyterLab.

JupyterLab saves outputs into the notebook it has open. Opened in the package (or a clone of the repository), the
lessons would change under the learner's edits and outputs, and an upgrade would overwrite them. So the lessons
are copied into a working folder first, and a lesson already there is never overwritten: the learner's edits
stay, and lessons added by a newer release are copied in beside them.

A copy is written under a temporary name and renamed into place whole, so a full disk or a signal
never leaves half a lesson that later runs would keep as the learner's edit; a lesson file that is
not JSON at all (half a copy an older release left) is moved aside, with a printed line, and copied
afresh.

JupyterLab runs in a session of its own, owned by the command: Ctrl-C, SIGTERM or SIGHUP to the
command stop it and its kernels, and the command exits 130.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "notebooks"
DEFAULT_DIR = "fsdplab-lessons"
PARTIAL = ".partial"       # a copy under way: `.NAME.XXXX.partial`, hidden beside the lessons
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_WAIT_S = 30.0         # JupyterLab's own shutdown (its kernels first) before it is killed


def shipped_lessons() -> list:
    """The lesson notebooks that ship with the package, in lesson order."""
    lessons = sorted(SHIPPED.glob("[0-9][0-9]_*.ipynb"))
    if not lessons:
        raise ValueError(f"no lesson notebooks ship with this install (looked in {SHIPPED}); reinstall fsdplab.")
    return lessons


def copy_atomically(source: Path, target: Path) -> None:
    """Write `source`'s bytes to `target` whole or not at all: a temporary name in the same folder,
    fsync, then a rename (atomic on one filesystem)."""
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(source.read_bytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    try:   # the rename itself reaches the disk with the folder's entry
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError:
        pass


def is_whole_json(path: Path) -> bool:
    """Whether `path` holds a JSON document (an edited notebook does; half a copy does not)."""
    try:
        json.loads(path.read_bytes())
        return True
    except (OSError, ValueError):
        return False


def aside_name(path: Path) -> Path:
    """A free name beside `path` for a broken copy: 05_x.broken.ipynb, 05_x.broken-2.ipynb, ..."""
    candidate, n = path.with_name(f"{path.stem}.broken{path.suffix}"), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}.broken-{n}{path.suffix}")
    return candidate


def copy_lessons(folder) -> tuple:
    """Copy the shipped lessons into `folder` (made if missing); returns (copied, kept) lists of
    file names. A file of the same name already in `folder` is kept as it is, unless it is not JSON:
    then it is moved aside (printed) and the lesson copied afresh."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: name a folder for the lessons.")
    folder.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for lesson in shipped_lessons():
        target = folder / lesson.name
        for stale in folder.glob(f".{lesson.name}.*{PARTIAL}"):   # a killed command's copy
            stale.unlink(missing_ok=True)
        if target.exists() and not is_whole_json(target):
            aside = aside_name(target)
            os.replace(target, aside)
            print(f"  {lesson.name} was not a whole notebook (not valid JSON): moved it to "
                  f"{aside.name} and copied the lesson afresh")
        if target.exists():
            kept.append(lesson.name)
            continue
        try:
            copy_atomically(lesson, target)
        except OSError as err:
            raise ValueError(f"could not copy {lesson.name} into {folder} ({err.strerror or err}); "
                             f"nothing half-written was left: free some space and run "
                             f"`fsdplab lab` again.") from None
        copied.append(lesson.name)
    return copied, kept


class _Stop(Exception):
    """A stop signal reached the command while JupyterLab ran."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_jupyterlab(process: subprocess.Popen, wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM JupyterLab (it shuts its kernels down and exits), SIGKILL it after `wait_s` or at a
    further stop signal, then kill whatever it started that is still there (a kernel it could not
    stop)."""
    import psutil

    started = _descendants(process.pid)
    for signum in STOP_SIGNALS:   # a second Ctrl-C skips the wait; nothing interrupts the cleanup
        signal.signal(signum, lambda *_: process.kill())
    try:
        process.terminate()
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for child in started + _descendants(process.pid):
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(started, timeout=5)
    finally:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def serve(command: list, folder: Path) -> int:
    """Run JupyterLab until it exits (its exit code) or a stop signal reaches this command (130)."""
    from ..runtime.processes import die_with_parent

    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    try:
        process = None
        try:
            # Its own session: a Ctrl-C in the terminal reaches only this command, which stops
            # JupyterLab without its y/n question; PR_SET_PDEATHSIG: a killed command takes it.
            process = subprocess.Popen(command, cwd=folder, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=die_with_parent)
            code = process.wait()
            return code if code >= 0 else 128 - code   # killed by a signal: the shell's convention
        except _Stop as stop:
            if process is not None:
                stop_jupyterlab(process)
            name = signal.Signals(stop.signum).name
            print(f"fsdplab lab: stopped by {name}; JupyterLab and its kernels are stopped (the "
                  f"lessons stay in {folder})", file=sys.stderr)
            return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def lab_command(args) -> int:
    folder = Path(args.folder).expanduser().resolve()
    copied, kept = copy_lessons(folder)
    print(f"lessons in {folder}: {len(copied)} copied, {len(kept)} already there and left as they are")
    if kept:
        print("  kept (your edits stay): " + ", ".join(kept))
        print("  to start a lesson afresh, delete or rename your copy and run `fsdplab lab` again")
    if args.copy_only:
        return 0
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={folder}"]
    if args.no_browser:
        command.append("--no-browser")
    if getattr(args, "allow_root", False):
        command.append("--allow-root")
    if args.port is not None:
        command.append(f"--port={args.port}")
    print("starting JupyterLab: " + " ".join(command[1:]), flush=True)
    return serve(command, folder)
