"""`fsdplab lab [DIR]`: the learner's own copy of the lessons, opened in JupyterLab.

JupyterLab saves outputs into the notebook it has open. Opened in the package (or a clone of the repository), the
lessons would change under the learner's edits and outputs, and an upgrade would overwrite them. So the lessons
are copied into a working folder first, and a lesson already there is never overwritten: the learner's edits
stay, and lessons added by a newer release are copied in beside them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "notebooks"
DEFAULT_DIR = "fsdplab-lessons"


def shipped_lessons() -> list:
    """The lesson notebooks that ship with the package, in lesson order."""
    lessons = sorted(SHIPPED.glob("[0-9][0-9]_*.ipynb"))
    if not lessons:
        raise ValueError(f"no lesson notebooks ship with this install (looked in {SHIPPED}); reinstall fsdplab.")
    return lessons


def copy_lessons(folder) -> tuple:
    """Copy the shipped lessons into `folder` (made if missing); returns (copied, kept) lists of file names.
    A file of the same name already in `folder` is kept as it is."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: name a folder for the lessons.")
    folder.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for lesson in shipped_lessons():
        target = folder / lesson.name
        if target.exists():
            kept.append(lesson.name)
            continue
        shutil.copyfile(lesson, target)
        copied.append(lesson.name)
    return copied, kept


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
    print("starting JupyterLab: " + " ".join(command[1:]))
    try:
        return subprocess.call(command, cwd=folder)
    except KeyboardInterrupt:
        return 0
