"""What a new user installs is what CI tests: the README's commands in .ci/run, a constraints file with the
tested set, and pyproject's floors tested at the floor (tests/floors.txt) or the tested release itself."""

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import constraints  # noqa: E402


def requirements() -> list:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras]


def floor(req: Requirement) -> Version:
    [spec] = [s for s in req.specifier if s.operator == ">="]
    return Version(spec.version)


def test_every_direct_dependency_has_a_floor_and_a_pin_that_meets_it():
    pins = constraints.read()
    for req in requirements():
        name = constraints.normalize(req.name)
        assert name in pins, f"constraints.txt does not pin {req.name}: run `python scripts/constraints.py write`"
        assert req.specifier.contains(pins[name]), f"constraints.txt pins {name}=={pins[name]}, outside {req}"
        floor(req)  # every requirement states its floor


def test_the_floors_ci_installs_are_pyprojects_floors():
    floors = constraints.read(ROOT / "tests" / "floors.txt")
    assert {"ipython", "cloudpickle", "ipykernel", "ipyparallel"} <= set(floors), floors
    direct = {constraints.normalize(r.name): r for r in requirements()}
    for name, version in floors.items():
        assert name in direct, f"tests/floors.txt pins {name}, which pyproject does not ask for"
        assert floor(direct[name]) == Version(version), f"{direct[name]} in pyproject, {name}=={version} tested"


def test_ci_installs_with_the_readmes_commands_into_a_fresh_environment():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_command = next(c for c in commands if "pytest" in c)
    for step in test_command.split(" && "):      # the installs, then the test command itself
        assert step.strip() in ci, f".ci/run does not run the README's `{step.strip()}`"
    assert re.search(r"python3 -m venv \S+", ci) and "rm -rf" in ci, ".ci/run must make a fresh venv each run"


def test_the_constraints_reader_and_the_difference_report(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# a comment\nTorch==2.13.0\nipython_pygments-lexers==1.1.1  # why\n")
    assert constraints.read(path) == {"torch": "2.13.0", "ipython-pygments-lexers": "1.1.1"}
    report = constraints.diff(path)
    assert any(line.startswith("pytest: not pinned in c.txt, ") for line in report), report
    assert not any(line.startswith("torch:") for line in report), report  # 2.13.0+cpu is the pinned 2.13.0
