"""A lesson as a torchrun script: the notebook's cluster played by the script's own ranks.

`fsdplab export` writes a lesson as one script that every rank runs from top to bottom. The kernel's cells run
on every rank (the same values everywhere; only rank 0 prints), a `%%ranks` cell's code runs inline, and the
notebook's `fsdplab.Cluster(...)` becomes `Cluster(...)` from here: `run(fn)` calls fn on this rank and gathers
every rank's value, `pull`/`push` read and set the script's own variables, `execute` runs source on the ranks.
What a script cannot do (restart its ranks, change their number, a timeout per group) is refused in one line.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import shutil
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

from .host_copy import to_host
from .on_rank import group_backend, rank_device

BACKEND_ENV = "FSDPLAB_BACKEND"   # the same switch as the notebook's: gloo keeps a GPU machine's ranks on CPU
# The names a %%ranks cell has without importing them. The script has one namespace where the notebook has the
# kernel's and the ranks': a parameter `world_size = 2` would hide the function, so rank code's calls are
# written out in full (fsdplab.ranks.world_size()).
RANK_NAMES = ("rank", "world_size", "device", "mesh", "print0", "local_rank", "node_rank", "node_mesh")
RANK_CALL = re.compile(r"(?<![\w.])(?<!def )(" + "|".join(RANK_NAMES) + r")\(")


RANK_IMPORT = re.compile(r"^([ \t]*)from fsdplab\.ranks import ([\w ,]+?)[ \t]*(#.*)?$", re.M)


def _rank_import(match) -> str:
    """A cell's `from fsdplab.ranks import rank, world_size, ...` as the script needs it: the rank names are
    written out in full below, so importing them would hide the parameters of the same name."""
    indent, names, comment = match.group(1), [n.strip() for n in match.group(2).split(",")], match.group(3)
    others = [n for n in names if n not in RANK_NAMES]
    line = indent + "import fsdplab.ranks" + (f"; from fsdplab.ranks import {', '.join(others)}" if others else "")
    return line + (f"   {comment}" if comment else "")


def rank_code(source: str) -> str:
    """`source` of a %%ranks cell (or cluster.execute) with its calls of the rank names written out in full."""
    return RANK_CALL.sub(r"fsdplab.ranks.\1(", RANK_IMPORT.sub(_rank_import, source))


def _namespace() -> dict:
    return sys.modules["__main__"].__dict__


class _Prefixed(io.TextIOBase):
    """Lines written to `out` with "[rank R] " in front, as the notebook shows a rank's output. Each whole line
    goes out in one write, so the ranks' lines (one pipe under torchrun) do not cut into each other."""

    def __init__(self, out, rank: int):
        self.out, self.prefix, self.pending = out, f"[rank {rank}] ", ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            self.out.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.out.flush()
        return len(text)

    def flush(self):
        if self.pending:
            self.out.write(f"{self.prefix}{self.pending}\n")
            self.pending = ""
        self.out.flush()


class _Quiet(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


_REAL_STDOUT = sys.stdout


def begin() -> None:
    """Join torchrun's group (gloo on CPU; "cpu:gloo,cuda:nccl" with a GPU per rank), write the lesson's files
    under FSDPLAB_OUT (default ./SCRIPT-files), draw figures off-screen, and quiet every rank but 0 outside rank
    code (the kernel's cells run on every rank, rank 0 speaks)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("this script is one rank of many: start it with torchrun, e.g. "
                         f"torchrun --standalone --nproc-per-node 2 {os.path.basename(sys.argv[0])}")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and os.environ.get(BACKEND_ENV, "auto") != "gloo" else "gloo"
        rank_device(backend, int(os.environ.get("LOCAL_RANK", 0)))          # the rank's GPU made current
        dist.init_process_group(group_backend(backend))
    # One folder for the lesson's files that every rank names alike (a temporary folder would differ per rank).
    out = os.environ.setdefault("FSDPLAB_OUT", os.path.abspath(f"{Path(sys.argv[0]).stem}-files"))
    Path(out).mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    warnings.filterwarnings("ignore", message=".*non-interactive.*cannot be shown")
    if dist.get_rank() != 0:
        sys.stdout = _Quiet()
        # Rank 0 draws the lesson's figures; the others' copies go to a folder of their own, gone at exit.
        figures = tempfile.mkdtemp(prefix=f"fsdplab-figures-rank{dist.get_rank()}-")
        atexit.register(shutil.rmtree, figures, True)
        os.environ["FSDPLAB_FIGURES"] = figures


def end() -> None:
    """Leave the group (the script's last line)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class ranks_output:
    """Every rank's output shown, "[rank R] " in front, while rank code runs (a %%ranks cell, cluster.run)."""

    def __init__(self, ranks=None):
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ranks = None if ranks is None else list(ranks)

    def __enter__(self):
        import torch.distributed as dist

        self.saved = sys.stdout
        sys.stdout.flush()
        if self.ranks is None:   # every rank is here: rank 0's kernel output is out before any rank's starts
            dist.barrier()
        if self.ranks is None or self.rank in self.ranks:
            sys.stdout = _Prefixed(_REAL_STDOUT, self.rank) if self.world > 1 else _REAL_STDOUT
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stdout = self.saved
        return False


class Cluster:
    """The notebook's `fsdplab.Cluster`, played by the ranks of the script itself."""

    def __init__(self, world_size: int | None = None, **options):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("call fsdplab.runtime.script.begin() first (the exported script's first lines do).")
        self.world_size = dist.get_world_size()
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"this part of the lesson starts {world_size} ranks, and the script runs on "
                             f"{self.world_size}: start it with torchrun --nproc-per-node {world_size} (a script "
                             "cannot change its number of ranks).")
        self.backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        self.running, self.broken, self.options = False, None, options

    def start(self) -> "Cluster":
        self.running = True
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self) -> None:
        import torch.distributed as dist

        if self.running:
            dist.barrier()
        self.running = False

    def restart(self, quiet: bool = False):
        raise RuntimeError("a script cannot restart its ranks: torchrun's --max-restarts N runs the whole script "
                           "again when a rank dies.")

    def _gather(self, value, ranks) -> list:
        import torch.distributed as dist

        values = [None] * self.world_size
        dist.all_gather_object(values, to_host(value))
        return values if ranks is None else [values[r] for r in ranks]

    @staticmethod
    def _ranks(ranks):
        return None if ranks is None else ([ranks] if isinstance(ranks, int) else list(ranks))

    def run(self, fn, *args, timeout=None, ranks=None, quiet: bool = False, **kwargs) -> list:
        """fn(*args, **kwargs) on this rank (if it is among `ranks`); every chosen rank's value, in rank order."""
        import torch.distributed as dist

        ranks = self._ranks(ranks)
        value = None
        sys.stdout.flush()
        dist.barrier()           # every rank calls run(): the kernel's output before the ranks'
        if ranks is None or dist.get_rank() in ranks:
            with ranks_output(ranks or list(range(self.world_size))) if not quiet else _silent():
                value = fn(*args, **kwargs)
        return self._gather(value, ranks)

    def execute(self, source: str, timeout=None, ranks=None, quiet: bool = False, filename=None, output=None):
        """Run `source` in the script's namespace on the chosen ranks (what a %%ranks cell does)."""
        import torch.distributed as dist

        ranks = self._ranks(ranks)
        sys.stdout.flush()
        dist.barrier()
        if ranks is None or dist.get_rank() in ranks:
            with ranks_output(ranks or list(range(self.world_size))) if not quiet else _silent():
                exec(compile(rank_code(textwrap.dedent(source)), filename or "<ranks>", "exec"), _namespace())

    def pull(self, name: str, ranks=None, timeout=None) -> list:
        """`name`'s value on each chosen rank, in rank order (tensors on the CPU)."""
        namespace = _namespace()
        if name not in namespace:
            raise NameError(f"pull({name!r}): no variable {name!r} on this rank")
        return self._gather(namespace[name], self._ranks(ranks))

    def push(self, ranks=None, timeout=None, **values) -> None:
        """Set variables in the script's namespace (on the chosen ranks)."""
        import torch.distributed as dist

        ranks = self._ranks(ranks)
        if ranks is None or dist.get_rank() in ranks:
            _namespace().update(values)

    def flight_recorder_dumps(self, *args, **kwargs):
        raise RuntimeError("flight recorder dumps are read by the notebook's cluster; in a script, set "
                           "TORCH_FR_DUMP_TEMP_FILE and TORCH_NCCL_TRACE_BUFFER_SIZE and read the files.")


class _silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def display(*objects, **kwargs) -> None:
    """The notebook's display() as text: Markdown as its source, a figure saved by the lesson already, a dashboard
    as its title and values, anything else as print() shows it."""
    for obj in objects:
        if hasattr(obj, "_repr_markdown_"):
            text = obj._repr_markdown_()
            print(text[0] if isinstance(text, tuple) else text)
        elif hasattr(obj, "controls") and hasattr(obj, "values"):     # an fsdplab.display.Dashboard
            shown = ", ".join(f"{k}={v}" for k, v in obj.values.items())
            print(f"[dashboard{': ' + obj.title if getattr(obj, 'title', '') else ''}; in the notebook it has "
                  f"sliders; here: {shown}]")
        elif type(obj).__module__.startswith("ipywidgets"):
            print(f"[a {type(obj).__name__} widget: open the notebook to use it]")
        elif hasattr(obj, "savefig"):
            pass                                                      # a figure: the lesson saves its own
        else:
            print(obj)


def one_rank_at_a_time():
    """For a kernel cell that writes files (tagged `writes-files`): each rank runs it in turn, rank 0 first, the
    others waiting, so no rank reads or rewrites a file while another writes it; all end with the cell's values
    (and the later ranks see rank 0's files: some writers, transformers' save_pretrained, write on rank 0 only)."""
    import torch.distributed as dist

    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            yield turn
        dist.barrier()


def write_file(path: str, text: str) -> None:
    """A notebook's %%writefile cell: rank 0 writes the file, the others wait for it."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"Writing {path}")
    dist.barrier()


def shell(command: str) -> int:
    """A notebook's `!command`, run by rank 0 while the others wait; its exit code."""
    import subprocess

    import torch.distributed as dist

    code = 0
    if dist.get_rank() == 0:
        sys.stdout.flush()
        code = subprocess.run(command, shell=True, stdout=_REAL_STDOUT, stderr=sys.stderr).returncode
    dist.barrier()
    return code
