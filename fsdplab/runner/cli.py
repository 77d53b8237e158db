"""Command line: `fsdplab lab` opens the learner's copy of the lessons in JupyterLab; `fsdplab run` executes the
lessons with papermill; `fsdplab estimate` sizes a run; `fsdplab doctor` checks a GPU machine first."""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
from pathlib import Path

from ..runtime import collector
from . import lab as lab_module
from . import export
from .estimate_command import estimate_command
from .flags import check_folder
from .run import (INTERRUPTED, declared_parameters, figures_folder, output_lock, print_table,  # noqa: F401
                     run_lessons, stop_signals)

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"    # shipped with the package
BACKENDS = ("auto", "gloo", "nccl")
BACKEND_ENV = "FSDPLAB_BACKEND"     # read by the lessons' clusters: the kernels and their ranks inherit it


def lesson_paths(names=()) -> list:
    """Notebook paths for `names` (paths, or lesson stems like '01' / '01_sharding_math'); all lessons if empty."""
    lessons = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        if not lessons:
            raise ValueError(f"no lesson notebooks found in {NOTEBOOK_DIR}; pass notebook paths explicitly.")
        return lessons
    paths = []
    for name in names:
        path = Path(name)
        if not path.is_file():
            matches = [p for p in lessons if p.stem.startswith(str(name).removesuffix(".ipynb"))]
            if len(matches) != 1:
                raise ValueError(f"{name!r} is not a notebook path nor one lesson; the lessons are: "
                                 f"{', '.join(p.stem for p in lessons)} (a number like 02 is enough).")
            path = matches[0]
        paths.append(path)
    return paths


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_parameters(paths, pairs) -> dict:
    """`-p NAME VALUE` pairs as Python values, checked against the type of NAME's default in each
    selected lesson's parameters cell before any kernel starts: an int is taken for a float, a tuple
    for a list, the text itself for a str; a None default takes anything. A wrong shape is refused
    with the fix."""
    params = {}
    for name, text in pairs:
        value = _value(text)
        for path in paths:
            defaults = pm_defaults(path)
            if name in defaults:
                value = _as_default_type(name, text, value, defaults[name], path)
        params[name] = value
    return params


def _as_default_type(name: str, text: str, value, default, path):
    """`value` in the shape of `default` (see parse_parameters), or ValueError naming both."""
    if default is None:
        return value
    if isinstance(default, str):
        return value if isinstance(value, str) else text
    kind = type(default)
    if kind is float and type(value) is int:
        return value
    if kind is list and type(value) is tuple:      # "1,2" reads as a tuple
        value = list(value)
    fits = type(value) is kind
    if fits and kind is list and default:
        item = type(default[0])
        if all(type(v) is item for v in default):   # a list of one kind (ints) takes that kind only
            fits = all(type(v) is item or (item is float and type(v) is int) for v in value)
    if not fits:
        got = "not a Python literal of one" if isinstance(value, str) else f"{_kind(value)}, not one"
        raise ValueError(f"-p {name} {text!r}: {path.stem} declares {name} = {default!r}, "
                         f"{_kind(default)}, and {text!r} is {got} "
                         f"(e.g. -p {name} {_example(default)}).")
    return value


def _kind(value) -> str:
    """'an int', 'a list of int', 'a list': what a parameter's value is, in words."""
    name = type(value).__name__
    kinds = {type(v).__name__ for v in value} if isinstance(value, (list, tuple)) else set()
    of = f" of {kinds.pop()}" if len(kinds) == 1 else ""
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}{of}"


def _example(default) -> str:
    text = repr(default)
    plain = text.replace(".", "").replace("-", "").replace("e", "").isalnum()
    return text if plain else f'"{text}"'


def pm_defaults(path) -> dict:
    """The defaults of a lesson's parameters as Python values (None where one is not a literal)."""
    import papermill as pm

    defaults = {}
    for name, info in pm.inspect_notebook(str(path)).items():
        try:
            defaults[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            defaults[name] = None
    return defaults


def warn_undeclared(paths, parameters) -> list:
    """Warn (one line on stderr) about each parameter that no selected lesson declares; returns those names."""
    declared = set()
    for path in paths:
        declared.update(declared_parameters(path))
    unknown = [name for name in parameters if name not in declared]
    for name in unknown:
        print(f"fsdplab: warning: no selected lesson declares parameter {name!r}, so it is ignored "
              f"(declared: {', '.join(sorted(declared)) or 'none'}).", file=sys.stderr)
    return unknown


@contextlib.contextmanager
def _backend_environment(backend):
    """FSDPLAB_BACKEND=`backend` for the run (the kernels inherit it), the caller's value back afterwards;
    None leaves the environment as it is."""
    if backend is None:
        yield
        return
    saved = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = backend
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = saved


def _progress_bars(args) -> bool:
    """papermill's per-cell bars only on a terminal: in a log file (CI, `> run.log`) they are most of it."""
    return not args.no_progress and sys.stderr.isatty()


def run_command(args) -> int:
    """`fsdplab run`: execute the lessons, print a summary and where the executed notebooks are."""
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size is a number of ranks (1 or more), got {args.world_size}.")
    paths = lesson_paths(args.notebooks)
    params = parse_parameters(paths, args.parameter)
    warn_undeclared(paths, {**params, **({} if args.world_size is None else {"world_size": args.world_size})})
    out = check_folder("--out", args.out, paths)
    check_folder("--figures", figures_folder(args.figures, out), paths)
    # SIGTERM (`timeout`, a CI cancelling) ends a run as Ctrl-C does: summary, cleanup, no stray processes
    with stop_signals() as stop:
        with output_lock(out), _backend_environment(getattr(args, "backend", None)):
            rows = run_lessons(paths, out, args.world_size, params, progress=_progress_bars(args),
                               figures=args.figures)
        stopped = stop is not None and stop.signum is not None
    print_table(rows)
    failed = [r for r in rows if r[1] != "ok"]
    if stopped or any(r[1] == INTERRUPTED for r in rows):
        import logging

        # the kernel's pending reply, cut off by the interrupt, would end the run with asyncio's traceback
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        print(f"\ninterrupted; the executed notebooks so far are in {out}")
        return 130
    if failed:
        print(f"\n{len(failed)} lesson(s) failed; the executed notebooks in {out} show where.")
    else:
        print(f"\nexecuted notebooks: {out}")
    figures = figures_folder(args.figures, out)
    if figures.is_dir():
        print(f"figures: {figures}")
    return 1 if failed else 0


def _one_line_error(parser):
    """argparse's refusal of a flag (a bad choice, a number that is not one) as one line, exit 2,
    as the command's own checks do, instead of the usage text and then the error."""
    def error(message):
        parser.exit(2, f"{parser.prog}: {message}; see {parser.prog} --help.\n")
    return error


def main(argv=None) -> int:
    from ..models import MODELS
    from ..settings import ATTENTIONS, BASE_DTYPES, EXACT_STRATEGIES, OPTIMIZERS, PRECISIONS

    parser = argparse.ArgumentParser(prog="fsdplab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lab = sub.add_parser("lab", help="copy the lessons into a working folder (never over your edits) and open "
                                     "JupyterLab there")
    lab.add_argument("folder", nargs="?", default=lab_module.DEFAULT_DIR,
                     help=f"working folder for your copy of the lessons (default: ./{lab_module.DEFAULT_DIR})")
    lab.add_argument("--copy-only", action="store_true", help="copy the lessons, do not start JupyterLab")
    lab.add_argument("--no-browser", action="store_true", help="start JupyterLab without opening a browser")
    lab.add_argument("--port", type=int, default=None, help="JupyterLab's port (default: JupyterLab's own, 8888)")
    lab.add_argument("--allow-root", action="store_true", help="let JupyterLab run as root (in a container, say)")

    run = sub.add_parser("run", help="execute lesson notebooks with papermill and print a summary")
    run.add_argument("notebooks", nargs="*", help="lesson numbers or names (e.g. 02), or notebook paths (default: all)")
    run.add_argument("--world-size", type=int, default=None, help="ranks for lessons that take world_size")
    run.add_argument("--out", default="runs", help="folder for the executed notebooks and the files lessons "
                                                   "write (default: runs)")
    run.add_argument("--figures", metavar="DIR", default=None,
                     help="folder for the lessons' figures (default: $FSDPLAB_FIGURES, else OUT/figures); "
                          "`--figures docs/figures` regenerates the README's pictures")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                     help="papermill parameter for lessons that declare it, e.g. -p steps 200")
    run.add_argument("--no-progress", action="store_true",
                     help="no per-cell progress bar (there is none when stderr is not a terminal)")
    run.add_argument("--backend", choices=BACKENDS, default=None,
                     help="the lessons' process groups: auto (nccl with one GPU per rank when there are enough, "
                          "else gloo on CPU ranks), gloo (CPU ranks even on a GPU machine) or nccl; sets "
                          f"{BACKEND_ENV} (default: the environment's {BACKEND_ENV}, else auto)")

    doc = sub.add_parser("doctor", help="check this machine before the lessons: GPUs, torch's CUDA build, bf16, "
                                        "NCCL, memory, /dev/shm, CUDA_VISIBLE_DEVICES, packages")
    doc.add_argument("--world-size", type=int, default=None, help="ranks you mean to run (one GPU each on nccl)")
    doc.add_argument("--json", action="store_true", help="print one JSON object: the facts and the findings")

    web = sub.add_parser("site", help="a static website of lessons already executed by `fsdplab run` (runs nothing)")
    web.add_argument("run", nargs="?", default="runs", help="the folder `fsdplab run --out` wrote (default: runs)")
    web.add_argument("--out", default="site", help="folder for the site (default: site; replaced if it exists)")

    cmp = sub.add_parser("compare", help="the records of two runs side by side: what moved beyond its tolerance")
    cmp.add_argument("run_a", metavar="RUN_A", help="a folder `fsdplab run --out` wrote, or its records.json")
    cmp.add_argument("run_b", metavar="RUN_B", help="the run to compare with RUN_A")
    cmp.add_argument("--all", action="store_true", help="list every record, the unchanged ones too")

    export.add_parser(sub)

    est = sub.add_parser("estimate", help="per-GPU memory of a training setup, exact (fake tensors)",
                         description="Exact per-GPU memory of a training setup on fake tensors (no GPU needed). "
                                     "--seq-len, --batch-size and --world-size take comma lists: every combination "
                                     "is estimated (a sweep).")
    est.add_argument("--model", default="qwen-7b",
                     help=f"a registered name ({', '.join(MODELS)}), a config.json, a model folder, a Hub id "
                          "(org/name; the local Hugging Face cache is tried first), or your own nn.Module as "
                          "package.module:function returning a fsdplab.custom.CustomModel")
    est.add_argument("--world-size", default="8", help="GPUs, or a comma list (e.g. 4,8)")
    est.add_argument("--gpu-mem-gib", type=float, default=24.0)
    est.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tune)")
    est.add_argument("--lora-targets", default="all-linear",
                     help="all-linear, attention, or module names separated by commas (e.g. q_proj,v_proj)")
    est.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                     help="peft's LoRA dropout (e.g. 0.05): each adapted Linear keeps its dropped input")
    est.add_argument("--grad-accum", type=int, default=1, metavar="K",
                     help="micro-batches per optimizer step (each of --batch-size sequences)")
    est.add_argument("--no-sync", action="store_true",
                     help="with --grad-accum: reduce gradients after the last micro-batch only")
    est.add_argument("--adapter-dtype", default="fp32", choices=PRECISIONS,
                     help="storage dtype of the LoRA adapters (fp32: peft's; bf16 as torchtune and LitGPT)")
    est.add_argument("--seq-len", default="2048", help="tokens per sequence, or a comma list (e.g. 512,1024,2048)")
    est.add_argument("--batch-size", default="1", help="micro-batch per GPU, or a comma list (e.g. 1,2,4)")
    est.add_argument("--precision", default="bf16", choices=PRECISIONS, help="compute dtype")
    est.add_argument("--base-dtype", default="fp32", choices=BASE_DTYPES,
                     help="storage dtype of the base weights (16-bit is how most LoRA runs load the frozen base; "
                          "nf4 is QLoRA's 4-bit base, with --lora-rank)")
    est.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    est.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", metavar="MODE",
                     help="recompute activations in backward: full (every block; the flag alone), K (every K-th "
                          "block, e.g. 2), selective (torchtitan's per-op policy), or reentrant (every block, "
                          "use_reentrant=True)")
    est.add_argument("--attention", default=None, choices=ATTENTIONS,
                     help="transformers' attention: sdpa (its default), flash (flash_attention_2), or eager (stores "
                          "the score matrices)")
    est.add_argument("--loss-chunks", type=int, default=1, metavar="K",
                     help="chunked cross-entropy over K pieces of the sequence, as torchtune's (default 1: plain)")
    est.add_argument("--embed-head-units", action="store_true",
                     help="the embedding and the output head as FSDP units of their own (as torchtitan wraps them)")
    est.add_argument("--use-cache", action="store_true", help="keep transformers' KV cache on while training")
    est.add_argument("--strategy", choices=EXACT_STRATEGIES, default=None,
                     help="full_shard (default), shard_grad_op, hybrid_shard (sharded inside a node, replicated "
                          "across nodes), ddp (torch's DistributedDataParallel: every rank keeps everything, plus "
                          "gradient buckets), replicate (FSDP2's replicate(): DDP's layout on FSDP2), or FSDP1's "
                          "fsdp1_full_shard, fsdp1_shard_grad_op, fsdp1_no_shard (FullyShardedDataParallel)")
    est.add_argument("--shard-group-size", type=int, default=None,
                     help="hybrid_shard: GPUs one parameter is sharded over, usually one node's (default min(N, 8))")
    est.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                     help="--no-reshard-after-forward is --strategy shard_grad_op")
    est.add_argument("--reshard-to", type=int, default=None, metavar="N",
                     help="full_shard: after forward keep parameters sharded over N ranks (e.g. 8, one node), not all")
    est.add_argument("--cpu-offload", action="store_true")
    est.add_argument("--sweep", action="store_true", help="sweep output (table / JSON of points) even for one point")
    est.add_argument("--plot", metavar="FILE.png", help="write a heat map of the per-GPU peak (implies a sweep)")
    est.add_argument("--workers", type=int, default=2, help="estimates run in parallel during a sweep (default 2)")
    est.add_argument("--timeline", metavar="FILE.png",
                     help="write a figure of memory over one step by category, the peak marked (one setting)")
    est.add_argument("--memory-snapshot", metavar="FILE.pickle",
                     help="write the step as PyTorch's memory visualizer reads it "
                          "(pytorch.org/memory_viz; one setting)")
    est.add_argument("--json", action="store_true", help="print one JSON object")

    est.error = _one_line_error(est)

    args = parser.parse_args(argv)
    if args.command != "estimate":        # an estimate resumes itself: a sweep before its workers start, one
        collector.resume()                #   setting after the estimate (its build imports the model's module)
    try:
        if args.command == "lab":
            return lab_module.lab_command(args)
        if args.command == "run":
            return run_command(args)
        if args.command == "doctor":
            from .doctor import doctor_command

            return doctor_command(args)
        if args.command == "site":
            from . import site

            return site.site_command(args)
        if args.command == "export":
            [path] = lesson_paths([args.lesson])
            return export.export_command(args, path, parse_parameters([path], args.parameter), pm_defaults(path))
        if args.command == "compare":
            from .compare import compare_command

            return compare_command(args)
        return estimate_command(args)
    except ValueError as e:  # a user mistake: one line with the fix, no traceback
        print("fsdplab: " + " ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return 2


def command() -> int:
    """The `fsdplab` command in a process of its own (the console script, `python -m fsdplab`): `main()` with
    the garbage collector paused through the imports (fsdplab.runtime.collector)."""
    collector.pause()
    try:
        return main()
    finally:
        collector.resume()                # the collection at exit skips what the imports made


if __name__ == "__main__":
    sys.exit(command())
