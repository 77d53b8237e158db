"""Importing fsdplab first makes transformers read its model folder once, and the lazy import tables it builds
are the ones transformers builds alone."""

import json
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

def probe(first: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, first], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_tables_are_the_ones_transformers_builds_alone():
    alone, after_fsdplab = probe("transformers"), probe("fsdplab")
    assert not alone["wrapped"] and after_fsdplab["wrapped"]
    assert after_fsdplab["class"] == "Qwen2ForCausalLM"
    for name in ("transformers", "transformers.models"):
        assert after_fsdplab["tables"][name] == alone["tables"][name], name
    assert len(alone["tables"]["transformers.models"]["modules"]) > 100     # the models folder, read


def test_the_models_folder_is_read_once():
    from fsdplab import import_once

    reads = []

    def read(path, *more):
        reads.append(path)
        return {"folder": {"nested": {"a"}}}

    read_once = import_once.remembered(read)
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
def counting(read):
    def counted(path):
        reads.append(os.path.realpath(path))
        return read(path)
    return original(counted)
once.remembered = counting
import transformers.models
models = os.path.realpath(os.path.join(os.path.dirname(transformers.__file__), "models"))
print(reads.count(models), len(reads), len(set(reads)))
"""


def test_transformers_reads_its_models_folder_once_in_a_process():
    done = subprocess.run([sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    models, reads, folders = map(int, done.stdout.split()[-3:])
    assert models == 1 and reads == folders > 100, done.stdout        # every folder once (without: models twice)
