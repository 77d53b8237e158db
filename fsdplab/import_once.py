"""transformers reads its model folders once, not twice per process, and not again in the next process.

transformers builds its lazy import table by reading every file under `transformers/models` (about 0.27 s here),
once from `transformers/__init__.py` and again from `transformers/models/__init__.py`: the two calls name the
folder differently (the folder, a file in it), and the cache that would catch the subfolders holds 128 of its
more than 500. Every estimate, lesson and rank that imports a model paid that twice. Importing fsdplab first
installs a hook that remembers each folder's table the first time it is read and hands out copies after that:
the same table, read once. The table is also kept on disk (`~/.cache/fsdplab`, or under $XDG_CACHE_HOME) under a
stamp of what it was read from: every .py file's path, size and modification time, transformers' reader and
Python's version. A later process with the same files loads it (a few ms, the stamp 20 ms) instead of reading.
A transformers that is already imported, or one whose module lacks the function, is left as it is.
"""

import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import re
import sys
import tempfile
from pathlib import Path

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
PREFIX = "transformers-imports-"
KEPT_NAME = re.compile(re.escape(PREFIX) + r"[0-9a-f]{12}-[0-9a-f]{24}\.pickle")   # what `remembered` writes


def cache_dir() -> Path:
    """Where the tables are kept between processes (fsdplab's cache folder)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdplab"


def stamp(folder: str, reader_file: str) -> str:
    """A digest of what `folder`'s table is read from: each .py file under it (path, size, modification time),
    the reader's own file and Python's version. Any edit, install or upgrade changes it."""
    files, todo = [], [folder]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        todo.append(entry.path)
                elif entry.name.endswith(".py"):
                    info = entry.stat()
                    files.append(f"{entry.path}\0{info.st_size}\0{info.st_mtime_ns}")
    info = os.stat(reader_file)
    files.append(f"{reader_file}\0{info.st_size}\0{info.st_mtime_ns}\0{sys.version_info[:2]}")
    return hashlib.sha256("\n".join(sorted(files)).encode()).hexdigest()[:24]


def _load(path: Path):
    """(the kept bytes, their table), or (None, None) for no file or a broken one (a file cut short by a full
    disk is read again, not trusted)."""
    try:
        data = path.read_bytes()
        return data, pickle.loads(data)
    except Exception:  # noqa: BLE001 - no file, or a broken one: read the folder as without the cache
        return None, None


def _keep(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole (a parallel process reads the old file or the new one), and drop the tables
    of the same folder with another stamp (an upgraded transformers' old ones): only regular files named as this
    module names them, never a link or anything else in the folder. Nothing if it cannot."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-" + PREFIX, delete=False) as out:
            temporary = out.name
            out.write(data)
        os.replace(temporary, path)
        temporary = None
        folder_part = path.name.rsplit("-", 1)[0]
        for old in path.parent.glob(folder_part + "-*.pickle"):
            if old != path and KEPT_NAME.fullmatch(old.name) and old.is_file() and not old.is_symlink():
                old.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        if temporary is not None:                  # the write or the rename failed: no half file left behind
            Path(temporary).unlink(missing_ok=True)


def remembered(read, disk: Path | None = None):
    """`read(path)` (a folder, or a file standing for its folder) once per folder; a copy after that. The
    subfolders a read walks into are read as part of it, as before. With `disk` (a folder), a table is also
    kept there, stamped, for the next process."""
    tables, depth = {}, [0]
    base = read
    while hasattr(base, "__wrapped__"):          # transformers' reader is an lru_cache
        base = base.__wrapped__
    reader_file = getattr(getattr(base, "__code__", None), "co_filename", None)

    def from_disk(folder):
        if disk is None or reader_file is None or not os.path.isfile(reader_file):
            return None, None, None
        try:
            name = hashlib.sha256(folder.encode()).hexdigest()[:12]
            path = disk / f"{PREFIX}{name}-{stamp(folder, reader_file)}.pickle"
        except OSError:
            return None, None, None
        return (*_load(path), path)

    def read_once(module_path, *args, **kwargs):
        if depth[0] or args or kwargs or not isinstance(module_path, (str, os.PathLike)):
            return read(module_path, *args, **kwargs)     # a subfolder inside its parent's read, or a new signature
        folder = os.path.realpath(os.path.dirname(module_path) if os.path.isfile(module_path) else module_path)
        if folder not in tables:
            kept, table, path = from_disk(folder)
            if kept is not None:
                tables[folder] = kept
                return table
            depth[0] += 1
            try:
                table = read(folder)
            finally:
                depth[0] -= 1
            try:
                tables[folder] = pickle.dumps(table)      # a copy (sets, dicts, strings): 4 ms, not a read
            except Exception:  # noqa: BLE001 - a table pickle cannot copy: not remembered, as without the hook
                return table
            if path is not None:
                _keep(path, tables[folder])
        return pickle.loads(tables[folder])

    read_once.__wrapped__ = read
    return read_once


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' import_utils as Python would, then wraps FUNCTION once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            read = getattr(module, FUNCTION, None)
            if callable(read):
                setattr(module, FUNCTION, remembered(read, cache_dir()))

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the hook first on sys.meta_path (once; importing fsdplab calls it, before anything imports
    transformers)."""
    if MODULE not in sys.modules and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
