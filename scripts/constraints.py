"""The package versions a test run used, and constraints.txt, the set the last green CI run tested.

    python scripts/constraints.py versions        # one line per package that matters here (CI prints them)
    python scripts/constraints.py write [PATH]    # constraints.txt (or PATH) from this environment
    python scripts/constraints.py diff            # what this environment has that constraints.txt does not

`pip install -c constraints.txt ...` then installs the tested set when a new release breaks something. CI writes
.ci/venv/constraints.txt right after it installs (before it moves the runtime's stack to its floors): after a
green run, copy it over constraints.txt when `diff` reported a change.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
# What CI prints near the top of its log: the packages whose releases have broken the lab before.
SHOWN = ("torch", "cloudpickle", "ipython", "ipykernel", "ipyparallel", "jupyter_client", "jupyterlab",
         "papermill", "nbclient", "transformers", "peft", "ipywidgets", "matplotlib")
# Installers, and the project itself: not part of the tested set.
LEFT_OUT = {"pip", "setuptools", "wheel", "fsdplab"}
HEADER = ("# The exact versions of the last green CI run (Python {python}), written by\n"
          "# `python scripts/constraints.py write`. If a new release breaks the lab, install this set:\n"
          "#   python -m pip install torch==2.13.0 && python -m pip install -c constraints.txt -e \".[test]\"\n")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict:
    """normalized name -> version of every distribution in this environment (local labels like +cpu dropped:
    `torch==2.13.0` also matches a CUDA build of the same release)."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and normalize(name) not in LEFT_OUT:
            found[normalize(name)] = dist.version.split("+")[0]
    return found


def read(path: Path = CONSTRAINTS) -> dict:
    """normalized name -> version pinned in a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return pins


def versions() -> str:
    have = installed()
    return "\n".join(f"{name:<15} {have.get(normalize(name), 'not installed')}" for name in SHOWN)


def write(path: Path = CONSTRAINTS) -> None:
    python = ".".join(map(str, sys.version_info[:2]))
    lines = [f"{name}=={version}" for name, version in sorted(installed().items())]
    path.write_text(HEADER.format(python=python) + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pins to {path}")


def diff(path: Path = CONSTRAINTS) -> list:
    """Lines naming each package whose installed version is not the pinned one."""
    pins, have = read(path), installed()
    return [f"{name}: {pins.get(name, 'not pinned')} in {path.name}, {have[name]} here"
            for name in sorted(have) if pins.get(name) != have[name]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["versions", "write", "diff"])
    parser.add_argument("path", nargs="?", type=Path, default=CONSTRAINTS, help="for write: where to write")
    args = parser.parse_args(argv)
    if args.command == "versions":
        print(versions())
    elif args.command == "write":
        write(args.path)
    else:
        changed = diff()
        print("\n".join(changed) if changed else f"this environment matches {CONSTRAINTS.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
