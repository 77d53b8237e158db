"""The package's shape as data, checked: which wing each module lives in, the order of the
wings, and the arrows that break the order today until a move fixes them.

The rules (the design's "Shape"): no import circles among modules; no module imports one of a
wing on a floor above its own; every module is in a wing.

The import graph counts every `import` and `from ... import` of a file, at module level or
deferred inside a function, resolved as Python resolves it: relative to the file's package (in
a package's `__init__.py`, "." is that package), and `from pkg import mod` reaching the module
`mod` when it is a submodule. `import a.b.c` runs a and a.b first, but the arrow goes to a.b.c
alone: Python resolves a package that is still being run on the way, so counting those would
make a circle of every module that imports a sibling by its absolute name.

scripts/house.py prints a measure of the house from this module's data.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdplab"

# The wings, top floor first. A module imports its own floor and those below, never one above.
# The estimator sits above the subject: it estimates a TrainSetting of a registered model by
# running sharding's own step, so memory imports the subject, never the other way round.
FLOORS = (
    ("face", "lessons", "app"),
    ("memory",),
    ("subject", "instruments"),
    ("runtime", "_torch_private"),
)
FLOOR_OF = {wing: level for level, wings in enumerate(FLOORS) for wing in wings}

# Every module's wing. A folder's entry covers the package and everything in it; a module at the
# top level of fsdplab/ is listed by itself (the top level holds what a notebook imports, and
# what still waits to move into its wing's folder).
WING_OF = {
    # the face: what a notebook imports by name
    "fsdplab": "face",
    "fsdplab.__main__": "face",
    "fsdplab.ranks": "face",
    "fsdplab.dist": "face",                 # the older name of fsdplab.ranks
    "fsdplab.exercises": "face",
    "fsdplab.display": "face",
    "fsdplab.records": "face",
    "fsdplab.import_noise": "face",         # what importing fsdplab silences of peft's and torchao's imports
    "fsdplab.import_once": "face",          # what importing fsdplab spares of transformers' import
    # the lessons: one module per lesson, the checkers, the posts' claims
    "fsdplab.lessons": "lessons",
    "fsdplab.recipes": "lessons",           # the lessons' case studies as torchrun scripts
    # the app: everything behind the `fsdplab` command
    "fsdplab.runner": "app",
    # the subject: one setting, one model registry, the apply_* functions and the step
    "fsdplab.settings": "subject",
    "fsdplab.models": "subject",
    "fsdplab.sharding": "subject",
    "fsdplab.step": "subject",              # the one train_step
    "fsdplab.nf4": "subject",               # QLoRA's 4-bit base, for the builder and the estimator
    "fsdplab.custom": "subject",            # a model of your own (imports nothing of fsdplab)
    # instruments and files
    "fsdplab.comms": "instruments",
    "fsdplab.network": "instruments",
    "fsdplab.timeline": "instruments",
    "fsdplab.checkpoint": "instruments",
    "fsdplab.checksums": "instruments",
    "fsdplab.safe_files": "instruments",
    "fsdplab.owned_folders": "instruments",
    # the estimator
    "fsdplab.memory": "memory",
    # the bottom: the ranks behind the notebook, and every private torch API
    "fsdplab.runtime": "runtime",
    "fsdplab._torch_private": "_torch_private",
}

# Arrows up a floor today, (importer, imported): the move that removes it. The test fails when
# one is gone (delete it here, so the list only shrinks) and when one not listed appears.
_RANKS = ("rank(), device() and mesh() are the face's names for state the runtime keeps "
          "(runtime.on_rank): gone when they move into the runtime and the face re-exports them")
KNOWN_EXCEPTIONS = {
    ("fsdplab.checkpoint", "fsdplab.ranks"): _RANKS,
    ("fsdplab.comms", "fsdplab.ranks"): _RANKS,
    ("fsdplab.memory.live", "fsdplab.ranks"): _RANKS,
    ("fsdplab.safe_files", "fsdplab.ranks"): _RANKS,
    ("fsdplab.sharding", "fsdplab.ranks"): _RANKS,
    ("fsdplab.timeline", "fsdplab.ranks"): _RANKS,
}


# --- the import graph ------------------------------------------------------------------------

def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of a file of the package: fsdplab/runtime/__init__.py is fsdplab.runtime."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = PACKAGE) -> dict:
    """{module name: path} of every .py file under `root`."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(source: str, module: str, is_package: bool, known) -> list:
    """(imported module, line) for each import in `source`, the text of `module`, of a module in
    `known` (`is_package`: the text is that package's __init__.py)."""
    package = module if is_package else module.rpartition(".")[0]

    def nearest(name: str) -> str | None:
        # `import a.b.c` where c is a name in a.b, not a module, reaches a.b
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for node in ast.walk(ast.parse(source)):      # every node: imports inside functions too
        if isinstance(node, ast.Import):
            targets = [nearest(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise ValueError(f"{module}: line {node.lineno} imports beyond the top package")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            # `from pkg import mod` imports the submodule; `from mod import name`, the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else nearest(base)
                       for alias in node.names]
        else:
            continue
        found += [(target, node.lineno) for target in targets if target not in (None, module)]
    return found


def import_graph(modules: dict) -> dict:
    """{module: {imported module: its first line}} for `modules` ({name: path})."""
    graph = {}
    for name, path in modules.items():
        edges = graph[name] = {}
        for target, line in imports_of(path.read_text(), name, path.name == "__init__.py", modules):
            edges.setdefault(target, line)
    return graph


def circular_groups(graph: dict) -> list:
    """The sets of modules that reach one another through imports (Tarjan's algorithm)."""
    index, low, stack, groups = {}, {}, [], []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def cycles_of(graph: dict) -> list:
    """One circle per circular group: a shortest closed path [a, b, ..., a] from its first name."""
    return [_shortest_circle(graph, group) for group in circular_groups(graph)]


def _shortest_circle(graph: dict, group: set) -> list:
    start = min(group)
    paths, seen = [[start]], {start}
    for path in paths:                 # breadth first: paths grows while it is walked
        nexts = sorted(graph[path[-1]])
        if start in nexts:
            return path + [start]
        for nxt in nexts:
            if nxt in group and nxt not in seen:
                seen.add(nxt)
                paths.append(path + [nxt])
    raise AssertionError(f"no circle through {sorted(group)}")


def wing_of(module: str, table: dict = WING_OF, top: str = "fsdplab") -> str | None:
    """The wing of `module`: its own entry, else the entry of the nearest folder above it. The top
    package's entry is its __init__ alone: a new module beside it must be listed by itself."""
    if module in table:
        return table[module]
    name = module.rpartition(".")[0]
    while name and name != top:
        if name in table:
            return table[name]
        name = name.rpartition(".")[0]
    return None


def arrows_up(graph: dict, wing=wing_of, floor_of: dict = FLOOR_OF) -> dict:
    """{(importer, imported): line} for each import of a wing on a floor above the importer's."""
    return {(a, b): line for a, edges in graph.items() for b, line in edges.items()
            if wing(a) and wing(b) and floor_of[wing(b)] < floor_of[wing(a)]}


def against_exceptions(found: dict, exceptions: dict) -> tuple:
    """(arrows up that are not listed, listed arrows that are no longer there)."""
    new = {arrow: line for arrow, line in found.items() if arrow not in exceptions}
    return new, [arrow for arrow in exceptions if arrow not in found]


# --- the house as it is ----------------------------------------------------------------------

MODULES = package_modules()
GRAPH = import_graph(MODULES)
HERE = "tests/unit/test_architecture.py"


def _where(module: str) -> str:
    return str(MODULES[module].relative_to(PACKAGE.parent))


def test_every_module_is_in_a_wing():
    unmapped = [f"{m} ({_where(m)})" for m in MODULES if wing_of(m) is None]
    assert not unmapped, (f"{', '.join(unmapped)}: in no wing. Add it to WING_OF in {HERE} "
                          f"(wings: {', '.join(FLOOR_OF)}), or move it into its wing's folder.")
    assert set(WING_OF.values()) <= set(FLOOR_OF), set(WING_OF.values()) - set(FLOOR_OF)
    stale = [name for name in WING_OF if name not in MODULES]
    assert not stale, f"WING_OF lists {stale}, which do not exist: remove them from {HERE}."


def test_no_import_cycles():
    circles = [" -> ".join(f"{a} (line {GRAPH[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[0]}"
               for c in cycles_of(GRAPH)]
    assert not circles, "import circles: " + "; ".join(circles)


def test_no_arrow_goes_up_a_floor_but_the_known_exceptions():
    new, gone = against_exceptions(arrows_up(GRAPH), KNOWN_EXCEPTIONS)
    assert not new, "imports of a wing on a floor above the importer's: " + "; ".join(
        f"{a} ({wing_of(a)}, {_where(a)} line {line}) imports {b} ({wing_of(b)})"
        for (a, b), line in new.items())
    assert not gone, f"no longer there, delete them from KNOWN_EXCEPTIONS in {HERE}: {gone}"
    assert all(isinstance(why, str) and why.strip() for why in KNOWN_EXCEPTIONS.values())


# --- the resolver and the rules, on synthetic source -----------------------------------------

KNOWN = {"pkg", "pkg.a", "pkg.sub", "pkg.sub.mod", "pkg.sub.other", "pkg.sub.deep",
         "pkg.sub.deep.leaf"}


def _targets(source: str, module: str, is_package: bool = False) -> set:
    return {target for target, _ in imports_of(source, module, is_package, KNOWN)}


def test_relative_imports_in_a_package_init_resolve_inside_that_package():
    # in pkg/sub/__init__.py, "." is pkg.sub itself (not pkg.sub.__init__, not pkg)
    assert _targets("from .mod import name", "pkg.sub", is_package=True) == {"pkg.sub.mod"}
    assert _targets("from . import other", "pkg.sub", is_package=True) == {"pkg.sub.other"}
    assert _targets("from .. import a", "pkg.sub", is_package=True) == {"pkg.a"}
    assert _targets("from .deep import leaf", "pkg.sub", is_package=True) == {"pkg.sub.deep.leaf"}
    # the same lines in a plain module of pkg.sub
    assert _targets("from .mod import name", "pkg.sub.other") == {"pkg.sub.mod"}
    assert _targets("from .. import a", "pkg.sub.mod") == {"pkg.a"}
    assert _targets("from ..sub.deep import leaf", "pkg.sub.mod") == {"pkg.sub.deep.leaf"}


def test_from_a_package_import_a_submodule_reaches_the_submodule():
    assert _targets("from .sub import mod", "pkg.a") == {"pkg.sub.mod"}
    assert _targets("from .sub import mod, name_in_init", "pkg.a") == {"pkg.sub.mod", "pkg.sub"}
    assert _targets("from pkg.sub.deep import leaf", "pkg.a") == {"pkg.sub.deep.leaf"}
    assert _targets("from . import sub", "pkg.a") == {"pkg.sub"}
    assert _targets("from . import name_in_init", "pkg.a") == {"pkg"}
    assert _targets("from pkg.sub import *", "pkg.a") == {"pkg.sub"}


def test_plain_and_deferred_imports_count():
    assert _targets("import pkg.sub.mod", "pkg.a") == {"pkg.sub.mod"}
    assert _targets("import pkg.sub.mod.name as x, os, torch.nn", "pkg.a") == {"pkg.sub.mod"}
    assert _targets("import os\nfrom torch import nn\nimport pkgx", "pkg.a") == set()
    deferred = ("def f():\n    if True:\n        from .sub import mod\n"
                "class C:\n    def g(self):\n        import pkg.sub.other\n")
    assert _targets(deferred, "pkg.a") == {"pkg.sub.mod", "pkg.sub.other"}
    assert _targets("from . import a", "pkg.a") == set()           # itself: no arrow
    assert imports_of("\n\nfrom .sub import mod", "pkg.a", False, KNOWN) == [("pkg.sub.mod", 3)]
    with pytest.raises(ValueError, match="beyond the top package"):
        imports_of("from ... import x", "pkg.a", False, KNOWN)


# The runtime's circle as it was: processes.cleanup imported the Slurm launcher to cancel a job,
# while the launchers import processes.
_RUNTIME_AS_IT_WAS = {
    "fsdplab/runtime/__init__.py": "",
    "fsdplab/runtime/processes.py": (
        "import shutil\n\n"
        "def choose_backend(world_size, backend='auto'):\n    return 'gloo'\n\n"
        "def cleanup(ipp_cluster, pids, reaper, workdir, jobs=(), slurm_env=None):\n"
        "    if jobs:\n"
        "        try:\n"
        "            from .launchers import slurm\n\n"
        "            slurm.cancel(list(jobs), slurm_env, wait_s=10)\n"
        "        except Exception:\n"
        "            pass\n"),
    "fsdplab/runtime/launchers/__init__.py": (
        "from .base import Launcher\nfrom .slurm import Slurm\n"),
    "fsdplab/runtime/launchers/base.py": "import dataclasses\n",
    "fsdplab/runtime/launchers/remote.py": (
        "from .base import Launcher\n\n"
        "def hosts_plan(kind, world_size, backend):\n"
        "    from ..processes import choose_backend, requested_backend\n"),
    "fsdplab/runtime/launchers/slurm.py": "from .remote import RemoteLauncher\n",
}


def _graph_of(tmp_path: Path, files: dict) -> dict:
    for name, text in {"fsdplab/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return import_graph(package_modules(tmp_path / "fsdplab"))


def test_the_runtimes_old_circle_is_caught(tmp_path):
    graph = _graph_of(tmp_path, _RUNTIME_AS_IT_WAS)
    assert graph["fsdplab.runtime.launchers"] == {"fsdplab.runtime.launchers.base": 1,
                                                  "fsdplab.runtime.launchers.slurm": 2}
    assert graph["fsdplab.runtime.processes"] == {"fsdplab.runtime.launchers.slurm": 9}
    assert cycles_of(graph) == [["fsdplab.runtime.launchers.remote", "fsdplab.runtime.processes",
                                 "fsdplab.runtime.launchers.slurm",
                                 "fsdplab.runtime.launchers.remote"]]


def test_cleanup_handed_the_launchers_stop_closes_no_circle(tmp_path):
    fixed = {**_RUNTIME_AS_IT_WAS, "fsdplab/runtime/processes.py": (
        "def cleanup(ipp_cluster, pids, reaper, workdir, stop_launcher=None):\n"
        "    if stop_launcher is not None:\n        stop_launcher()\n")}
    graph = _graph_of(tmp_path, fixed)
    assert graph["fsdplab.runtime.processes"] == {}
    assert cycles_of(graph) == []


def test_each_circle_is_reported_once_by_its_shortest_path():
    graph = {"a": {"b": 1}, "b": {"c": 1, "a": 2}, "c": {"a": 1, "d": 1}, "d": {},
             "e": {"f": 1}, "f": {"e": 1}, "g": {"g": 1}}
    assert sorted(cycles_of(graph)) == [["a", "b", "a"], ["e", "f", "e"], ["g", "g"]]
    assert sorted(map(sorted, circular_groups(graph))) == [["a", "b", "c"], ["e", "f"], ["g"]]
    assert cycles_of({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_wings_cover_folders_and_the_top_level_module_by_module():
    table = {"fsdplab": "face", "fsdplab.runtime": "runtime", "fsdplab.memory": "memory"}
    assert wing_of("fsdplab", table) == "face"
    assert wing_of("fsdplab.runtime", table) == "runtime"
    assert wing_of("fsdplab.runtime.launchers.slurm", table) == "runtime"
    assert wing_of("fsdplab.memory", table) == "memory"
    assert wing_of("fsdplab.new_module", table) is None     # "fsdplab" covers its __init__ alone


def test_arrows_up_a_floor_are_found_and_checked_against_the_exceptions():
    wings = {"fsdplab.cli": "app", "fsdplab.memory": "memory", "fsdplab.ranks": "face",
             "fsdplab.runtime.cluster": "runtime", "fsdplab._torch_private": "_torch_private"}
    graph = {"fsdplab.cli": {"fsdplab.memory": 3, "fsdplab.ranks": 4},             # down, across
             "fsdplab.memory": {"fsdplab.ranks": 7, "fsdplab._torch_private": 8},  # up, down
             "fsdplab.runtime.cluster": {"fsdplab._torch_private": 2, "fsdplab.cli": 9}}
    found = arrows_up(graph, wing=wings.get)
    assert found == {("fsdplab.memory", "fsdplab.ranks"): 7,
                     ("fsdplab.runtime.cluster", "fsdplab.cli"): 9}
    listed = {("fsdplab.memory", "fsdplab.ranks"): "why",
              ("fsdplab.sweep", "fsdplab.display"): "why"}
    assert against_exceptions(found, listed) == ({("fsdplab.runtime.cluster", "fsdplab.cli"): 9},
                                                 [("fsdplab.sweep", "fsdplab.display")])
