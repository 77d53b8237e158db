"""The `fsdplab` command pauses Python's garbage collector through its imports, in its own process only."""

import gc
import subprocess
import sys

from fsdplab.runtime import collector
from fsdplab.runner.cli import main


def test_resume_turns_collection_back_on_and_sets_aside_what_exists():
    assert gc.isenabled(), "an earlier test left this process's garbage collector off"
    frozen = gc.get_freeze_count()
    collector.pause()
    try:
        assert not gc.isenabled()
        kept = [object() for _ in range(10)]
        collector.resume()
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        collector.resume()                          # a second resume changes nothing
        assert gc.isenabled()
    finally:
        gc.enable()             # what was set aside stays so (harmless: it lives as long as the session)
    del kept


def test_main_called_in_a_process_leaves_its_collector_alone(capsys):
    frozen = gc.get_freeze_count()
    assert main(["compare", "no-such-run", "no-such-run-either"]) == 2
    assert gc.isenabled() and gc.get_freeze_count() <= frozen     # none added (some may have been freed)


def test_the_command_ends_with_collection_on():
    code = ("import gc, sys\nfrom fsdplab.runner.cli import command\nsys.argv = ['fsdplab', 'compare', 'a', 'b']\n"
            "rc = command()\nprint(rc, gc.isenabled(), gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "True", "True"]
