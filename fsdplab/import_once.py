"""transformers reads its model folders once per process, not twice.

transformers builds its lazy import table by reading every file under `transformers/models` (about 0.27 s here),
once from `transformers/__init__.py` and again from `transformers/models/__init__.py`: the two calls name the
folder differently (the folder, a file in it), and the cache that would catch the subfolders holds 128 of its
more than 500. Every estimate, lesson and rank that imports a model paid that twice. Importing fsdplab first
installs a hook that remembers each folder's table the first time it is read and hands out copies after that:
the same table, read once. A transformers that is already imported, or one whose module lacks the function, is
left as it is.
"""

import importlib.abc
import importlib.machinery
import os
import pickle
import sys

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"


def remembered(read):
    """`read(path)` (a folder, or a file standing for its folder) once per folder; a copy after that. The
    subfolders a read walks into are read as part of it, as before."""
    tables, depth = {}, [0]

    def read_once(module_path, *args, **kwargs):
        if depth[0] or args or kwargs or not isinstance(module_path, (str, os.PathLike)):
            return read(module_path, *args, **kwargs)     # a subfolder inside its parent's read, or a new signature
        folder = os.path.realpath(os.path.dirname(module_path) if os.path.isfile(module_path) else module_path)
        if folder not in tables:
            depth[0] += 1
            try:
                table = read(folder)
            finally:
                depth[0] -= 1
            try:
                tables[folder] = pickle.dumps(table)      # a copy (sets, dicts, strings): 4 ms, not a read
            except Exception:  # noqa: BLE001 - a table pickle cannot copy: not remembered, as without the hook
                return table
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
                setattr(module, FUNCTION, remembered(read))

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the hook first on sys.meta_path (once; importing fsdplab calls it, before anything imports
    transformers)."""
    if MODULE not in sys.modules and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
