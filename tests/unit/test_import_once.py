"""Importing fsdplab first makes transformers read its model folder once, and not again in the next process; the
lazy import tables it builds are the ones transformers builds alone."""

import json
import os
import subprocess
import sys

# Imports transformers' models package in a fresh process, counts the folder reads that were not answered from
# memory, and prints the tables of transformers' two lazy modules.
PROBE = """
import json, sys
if sys.argv[1] == "fsdplab":
    import fsdplab  # noqa: F401
import transformers.utils.import_utils as utils
wrapped = utils.create_import_structure_from_path.__name__ == "read_once"   # fsdplab's hook
import transformers.models, transformers.models.qwen2.modeling_qwen2  # noqa: E401
from transformers.models.qwen2 import Qwen2ForCausalLM  # the lazy table answers a name
tables = {name: {key: sorted(value) for key, value in sys.modules[name]._class_to_module.items()} | {
              "modules": sorted(sys.modules[name]._modules)}
          for name in ("transformers", "transformers.models")}
print(json.dumps({"wrapped": wrapped, "tables": tables, "class": Qwen2ForCausalLM.__name__}))
"""

def in_fresh_process(code: str, *args: str, cache) -> str:
    """The last line `code` prints in a fresh process whose fsdplab cache folder is `cache`'s."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()[-1]


def test_the_tables_are_the_ones_transformers_builds_alone(tmp_path):
    alone = json.loads(in_fresh_process(PROBE, "transformers", cache=tmp_path))
    assert not list(tmp_path.rglob("*.pickle")), "transformers alone kept a table"
    read, kept = (json.loads(in_fresh_process(PROBE, "fsdplab", cache=tmp_path)) for _ in range(2))
    assert list((tmp_path / "fsdplab").glob("transformers-imports-*.pickle")), "no table kept on disk"
    assert not alone["wrapped"] and read["wrapped"] and kept["wrapped"]
    assert read["class"] == kept["class"] == "Qwen2ForCausalLM"
    for name in ("transformers", "transformers.models"):       # read in the first process, loaded in the second
        assert read["tables"][name] == alone["tables"][name] == kept["tables"][name], name
    assert len(alone["tables"]["transformers.models"]["modules"]) > 100     # the models folder, read


def test_the_models_folder_is_read_once():
    from fsdplab import import_once

    reads = []

    def read(path, *more):
        reads.append(path)
        return {"folder": {"nested": {"a"}}}

    read_once = import_once.remembered(read)                               # no disk: memory only
    first = read_once("/tmp")
    first["folder"]["nested"].add("changed by a caller")
    again = read_once("/tmp/")
    assert reads == ["/tmp"] and again == {"folder": {"nested": {"a"}}}      # a copy each time, read once
    assert read_once("/tmp", "new argument") and reads[-1] == "/tmp"        # a signature it does not know: passed on
    odd = import_once.remembered(lambda path: {"reads": lambda: path})     # a table pickle cannot copy
    assert odd("/tmp")["reads"]() == "/tmp" and odd("/tmp") is not odd("/tmp")   # read each time, as without


# Counts, in a fresh process, how often each folder is read for real (not answered from memory).
COUNT = """
import os
import fsdplab.import_once as once
original, reads = once.remembered, []
def counting(read, disk):
    def counted(path):
        reads.append(os.path.realpath(path))
        return read(path)
    counted.__wrapped__ = read      # the stamp names transformers' reader
    return original(counted, disk)
once.remembered = counting
import transformers.models
models = os.path.realpath(os.path.join(os.path.dirname(transformers.__file__), "models"))
print(reads.count(models), len(reads), len(set(reads)))
"""


def test_transformers_reads_its_models_folder_once_then_not_in_the_next_process(tmp_path):
    models, reads, folders = map(int, in_fresh_process(COUNT, cache=tmp_path).split())
    assert models == 1 and reads == folders > 100, (models, reads, folders)   # every folder once (without: twice)
    assert in_fresh_process(COUNT, cache=tmp_path).split() == ["0", "0", "0"]   # the tables kept on disk


def test_a_changed_file_is_read_again_and_a_broken_table_too(tmp_path):
    from fsdplab import import_once

    folder, disk, reads = tmp_path / "pkg", tmp_path / "cache", []
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.py").write_text("__all__ = ['A']")

    def read(path):
        reads.append(path)
        return {"sub": {"A"}, "reads": len(reads)}

    def in_a_new_process():
        return import_once.remembered(read, disk)(str(folder))

    assert in_a_new_process() == in_a_new_process() == {"sub": {"A"}, "reads": 1}     # read once, then loaded
    (folder / "sub" / "a.py").write_text("__all__ = ['A', 'B']")                      # an edit (a new size): read again
    assert in_a_new_process()["reads"] == 2 and in_a_new_process()["reads"] == 2
    [kept] = disk.glob("transformers-imports-*.pickle")                                 # the stale one removed
    kept.write_bytes(kept.read_bytes()[:10])                                            # cut short: read again
    assert in_a_new_process()["reads"] == 3 and in_a_new_process()["reads"] == 3


def test_a_new_table_removes_only_the_old_tables_it_wrote(tmp_path):
    from fsdplab import import_once

    folder, disk, yours = tmp_path / "pkg", tmp_path / "cache", tmp_path / "yours.pickle"
    folder.mkdir()
    (folder / "a.py").write_text("__all__ = ['A']")
    yours.write_bytes(b"a user's file")
    import_once.remembered(lambda path: {"a": 1}, disk)(str(folder))
    [first] = disk.glob("transformers-imports-*.pickle")
    folder_part = first.name.rsplit("-", 1)[0]
    link = disk / f"{folder_part}-{'0' * 24}.pickle"            # named like a stale table, a link to a user's file
    link.symlink_to(yours)
    other = disk / f"{folder_part}-notes.pickle"                  # not a name this module writes
    other.write_bytes(b"kept")
    (folder / "a.py").write_text("__all__ = ['A', 'B']")          # a new stamp: a new table, the old one dropped
    import_once.remembered(lambda path: {"a": 2}, disk)(str(folder))
    assert not first.exists() and link.is_symlink() and yours.read_bytes() == b"a user's file"
    assert other.read_bytes() == b"kept" and not list(disk.glob(".tmp-*"))
