"""A measure of the package's house, from the architecture test's data (tests/unit/test_architecture.py).

    python scripts/house.py

rooms: modules; floors: modules on the longest chain of imports (a circular group counts as one
room); arrows: import edges between modules; circles: circular groups of modules; arrows back up:
imports of a wing on a floor above the importer's (and how many are known exceptions); the
biggest module; lines over 100 characters.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def architecture():
    path = ROOT / "tests" / "unit" / "test_architecture.py"
    spec = importlib.util.spec_from_file_location("test_architecture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def longest_chain(graph: dict, groups: list) -> int:
    """Modules on the longest import chain, a circular group's modules counted as one room."""
    room = {m: m for m in graph}
    for group in groups:
        for m in group:
            room[m] = min(group)
    rooms = {}
    for a, edges in graph.items():
        rooms.setdefault(room[a], set()).update(room[b] for b in edges if room[b] != room[a])

    @cache
    def depth(node) -> int:
        return 1 + max((depth(n) for n in rooms.get(node, ())), default=0)

    return max((depth(n) for n in rooms), default=0)


def measure(arch) -> dict:
    graph = arch.GRAPH
    groups = arch.circular_groups(graph)
    up = arch.arrows_up(graph)
    lines = {m: p.read_text().splitlines() for m, p in arch.MODULES.items()}
    biggest = max(lines, key=lambda m: len(lines[m]))
    return {
        "rooms": len(graph),
        "floors": longest_chain(graph, groups),
        "arrows": sum(len(edges) for edges in graph.values()),
        "circles": len(groups),
        "arrows back up": len(up),
        "  known exceptions": sum(arrow in arch.KNOWN_EXCEPTIONS for arrow in up),
        "biggest module": f"{biggest} ({len(lines[biggest])} lines)",
        "lines over 100 characters": sum(len(ln) > 100 for text in lines.values() for ln in text),
    }


def main() -> int:
    sys.setrecursionlimit(10_000)
    for name, value in measure(architecture()).items():
        print(f"{name + ':':<28} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
