"""`fsdplab export LESSON`: a lesson notebook as one torchrun script, its cells in order.

Every rank runs the script from top to bottom. The kernel's cells run on every rank (rank 0 prints); a `%%ranks`
cell's code runs inline, its output shown per rank; `fsdplab.Cluster(...)` becomes the script's own ranks
(fsdplab.runtime.script.Cluster), so `cluster.run(fn)`, `pull` and `push` keep working. Markdown headings become
comments, a cell tagged `writes-files` runs on one rank at a time, the parameters are constants (changed with -p as
`fsdplab run` takes them), `!command` runs on rank 0.
A notebook's edits travel with it: export the copy you edited (a path) to get your cells.
"""

from __future__ import annotations

import ast
import re
import shlex
import textwrap
from pathlib import Path

from ..runtime.script import rank_code

DROPPED_MAGICS = ("%load_ext", "%reload_ext", "%matplotlib", "%config")
CLUSTER = re.compile(r"\bfsdplab\.Cluster\(")
IPYTHON_DISPLAY = re.compile(r"from IPython\.display import .*\bdisplay\b")


def _ranks_option(line: str):
    """The ranks a `%%ranks` line names (-r 0,1), read with the magic's own parser; None for all."""
    # deferred: the magics import IPython (40 ms), which every other command of the CLI (estimate) can do without
    from ..runtime.magics import ranks_parser

    ranks = ranks_parser().parse_args(shlex.split(line)[1:]).ranks
    return tuple(int(r) for r in ranks.split(",")) if ranks else None


def _code_cell(source: str, number: int) -> str:
    """One code cell as script lines."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%ranks"):
        body = rank_code("\n".join(lines[1:]))
        ranks = _ranks_option(lines[0])
        if ranks:
            return (f"# %%ranks (cell {number}): ranks {', '.join(map(str, ranks))} run this\n"
                    f"if fsdplab.rank() in {ranks!r}:\n    with script.ranks_output({ranks!r}):\n"
                    + textwrap.indent(body or "pass", "        "))
        return (f"# %%ranks (cell {number}): every rank runs this\nwith script.ranks_output():\n"
                + textwrap.indent(body or "pass", "    "))
    if lines and lines[0].startswith("%%writefile"):
        target = " ".join(shlex.split(lines[0])[1:])
        return (f"# %%writefile (cell {number}): rank 0 writes the file\n"
                f"script.write_file(f{target!r}, {chr(10).join(lines[1:]) + chr(10)!r})")
    if lines and lines[0].startswith("%%"):
        raise ValueError(f"cell {number} is a {lines[0].split()[0]} cell, which a script cannot run; "
                         "rewrite it as Python to export the lesson.")
    out = []
    for line in lines:
        stripped = line.lstrip()
        indent = line[:len(line) - len(stripped)]
        if stripped.startswith(DROPPED_MAGICS):
            out.append(f"{indent}# {stripped}   (notebook only)")
        elif stripped.startswith("!"):
            out.append(f"{indent}script.shell(f{stripped[1:].strip()!r})")
        elif stripped.startswith("%"):
            raise ValueError(f"cell {number} uses the magic {stripped.split()[0]}, which a script cannot run; "
                             "rewrite the line as Python to export the lesson.")
        else:
            out.append(CLUSTER.sub("script.Cluster(", line))
            if IPYTHON_DISPLAY.match(stripped):
                out.append(f"{indent}display = script.display   # (script) display() as text")
    return "\n".join(out)


def _headings(source: str) -> list:
    return [f"# {line}" for line in source.splitlines() if line.startswith("#")]


def export_script(path, parameters: dict | None = None) -> str:
    """The script text of the notebook at `path`, with `parameters` replacing the defaults of its parameters cell."""
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    why = nb.metadata.get("fsdplab", {}).get("no_export")
    if why:
        raise ValueError(f"{path.stem} does not export as one script: {why}.")
    if parameters:   # as papermill injects them: a cell after the one tagged `parameters`
        from papermill.iorw import load_notebook_node
        from papermill.parameterize import parameterize_notebook

        nb = parameterize_notebook(load_notebook_node(str(path)), parameters, kernel_name="python3", language="python")
    head = [
        f"# {path.stem}, exported from {path.name} by `fsdplab export`. Every rank runs this file:",
        f"#   torchrun --standalone --nproc-per-node N {path.stem}.py",
        "# The kernel's cells run on every rank (rank 0 prints); %%ranks cells run inline, their output per rank.",
        "import fsdplab",
        "from fsdplab.runtime import script",
        "from fsdplab.runtime.script import display  # noqa: F401 - the notebook's display(), as text",
        "import torch, torch.distributed as dist  # noqa: E401, F401 - what a %%ranks cell has",
    ]
    parts = ["\n".join(head)]
    body = ["script.begin()   # torchrun's process group; figures off-screen; ranks other than 0 quiet "
            "outside rank code"]
    for number, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            if cell.source.strip():
                body.append("\n".join(_headings(cell.source)) or None)
            continue
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        tags = cell.metadata.get("tags", [])
        label = f"# --- cell {number}" + (f" ({', '.join(tags)})" if tags else "")
        text = _code_cell(cell.source, number)
        if "writes-files" in tags:
            text = ("# writes files: the ranks run this cell one at a time, rank 0 first\n"
                    "for _turn in script.one_rank_at_a_time():\n" + textwrap.indent(text, "    "))
        try:
            ast.parse(text)
        except SyntaxError as err:
            raise ValueError(f"{path.name}, cell {number}: not Python once exported ({err.msg}, line {err.lineno}); "
                             "edit the cell and export again.") from None
        body.append(f"{label}\n{text}")
    body.append("script.end()")
    # The lesson runs only in the process torchrun started: a worker it starts with multiprocessing (the
    # estimator's) imports this file as __mp_main__ and must not run the lesson again.
    parts.append('if __name__ == "__main__":\n' + textwrap.indent("\n\n".join(b for b in body if b), "    "))
    return "\n\n".join(p for p in parts if p) + "\n"



def sbatch_script(script: str, nodes: int, ranks_per_node: int, gpus: bool = True) -> str:
    """A Slurm batch file that runs `script` on `nodes` nodes, `ranks_per_node` ranks each: one torchrun per node
    (srun), c10d rendezvous at the first node, on a port of the job's own. `gpus`: ask Slurm for a GPU per rank."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"--sbatch needs at least 1 node and 1 rank per node, got {nodes} and {ranks_per_node}.")
    name = Path(script).stem
    gres = f"#SBATCH --gpus-per-node={ranks_per_node}\n" if gpus else ""
    return f"""#!/bin/bash
# {name} on {nodes} node(s) x {ranks_per_node} rank(s), written by `fsdplab export --sbatch`. \
Submit: sbatch {name}.sbatch
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gres}#SBATCH --output={name}-%j.log
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The rendezvous port from the job id (below Linux's ephemeral ports): two jobs that share their first node
# meet at two stores, not at one.
port=$((10000 + SLURM_JOB_ID % 20000))
srun --nodes {nodes} --ntasks-per-node 1 python -m torch.distributed.run --nnodes {nodes} \\
    --nproc-per-node {ranks_per_node} --rdzv-backend c10d --rdzv-endpoint "$head:$port" \\
    --rdzv-id "$SLURM_JOB_ID" {script}
"""


def add_parser(sub) -> None:
    """The `export` subcommand's arguments."""
    exp = sub.add_parser("export", help="a lesson as one torchrun script (its cells in order, every rank runs it)")
    exp.add_argument("lesson", help="a lesson number or name (e.g. 02), or the path of a notebook you edited")
    exp.add_argument("--out", default=None, help="the script's file (default: ./LESSON.py)")
    exp.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                     help="a parameter's value in place of the lesson's default, e.g. -p steps 200")
    exp.add_argument("--force", action="store_true", help="replace --out if it exists")
    exp.add_argument("--sbatch", type=int, metavar="NODES", default=None,
                     help="also write OUT.sbatch, a Slurm batch file running the script on NODES nodes (one "
                          "torchrun per node, c10d rendezvous)")
    exp.add_argument("--ranks-per-node", type=int, default=None,
                     help="with --sbatch: ranks (GPUs) per node (default: the lesson's world_size / NODES)")
    exp.add_argument("--cpu", action="store_true", help="with --sbatch: ask Slurm for no GPUs (CPU ranks on gloo)")


def export_command(args, path: Path, params: dict, defaults: dict) -> int:
    """`fsdplab export LESSON`: write the lesson as one torchrun script; refuse to overwrite without --force."""
    text = export_script(path, params)
    out = Path(args.out) if args.out else Path(f"{path.stem}.py")
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; name the script's file, e.g. --out {out / (path.stem + '.py')}")
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; choose another --out, or --force to replace it.")
    ranks = params.get("world_size") or defaults.get("world_size") or 2
    batch = None
    if args.sbatch is not None:
        batch = out.with_suffix(".sbatch")
        if batch.exists() and not args.force:
            raise ValueError(f"{batch} exists; choose another --out, or --force to replace it.")
        per_node = args.ranks_per_node or max(1, ranks // max(args.sbatch, 1))   # sbatch_script refuses < 1
        batch_text = sbatch_script(out.name, args.sbatch, per_node, gpus=not args.cpu)
    out.write_text(text)
    print(f"wrote {out}: run it with  torchrun --standalone --nproc-per-node {ranks} {out}")
    if batch is not None:
        batch.write_text(batch_text)
        print(f"wrote {batch}: {args.sbatch} node(s) x {per_node} rank(s); submit it with  sbatch {batch}")
    return 0
