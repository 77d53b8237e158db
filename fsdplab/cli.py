"""Command line: `fsdplab run` executes the lessons with papermill; `fsdplab estimate` sizes a run."""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def lesson_paths(names=()) -> list:
    """Notebook paths for `names` (paths, or lesson stems like '01' / '01_sharding_math'); all lessons if empty."""
    if not names:
        found = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
        if not found:
            raise ValueError(f"no lesson notebooks found in {NOTEBOOK_DIR}; pass notebook paths explicitly.")
        return found
    paths = []
    for name in names:
        path = Path(name)
        if not path.exists():
            matches = sorted(NOTEBOOK_DIR.glob(f"{name}*.ipynb"))
            if len(matches) != 1:
                raise ValueError(f"{name!r} is not a notebook path nor a single lesson name in {NOTEBOOK_DIR}.")
            path = matches[0]
        paths.append(path)
    return paths


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def run_lessons(paths, out_dir="runs", world_size=None, parameters=None, progress=True) -> list:
    """Execute each notebook with papermill; returns rows of (lesson, status, seconds, detail)."""
    import papermill as pm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, path in enumerate(paths, 1):
        declared = pm.inspect_notebook(str(path))
        params = {k: v for k, v in (parameters or {}).items() if k in declared}
        if world_size is not None and "world_size" in declared:
            params["world_size"] = world_size
        print(f"[{i}/{len(paths)}] {path.stem} {params or ''}", flush=True)
        t0 = time.perf_counter()
        status, detail = "ok", ""
        try:
            pm.execute_notebook(str(path), str(out / path.name), parameters=params, cwd=str(path.parent),
                                progress_bar=progress, kernel_name="python3")
        except pm.PapermillExecutionError as e:
            status = "FAILED"
            detail = f"cell {e.exec_count} ({e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''})"
        except Exception as e:  # a kernel that died, a missing kernel spec, ...
            status, detail = "FAILED", f"{type(e).__name__}: {e}"
        rows.append((path.stem, status, time.perf_counter() - t0, detail))
    return rows


def print_table(rows) -> None:
    width = max([len("lesson")] + [len(r[0]) for r in rows])
    print(f"\n{'lesson':<{width}}  status  seconds  detail")
    for lesson, status, seconds, detail in rows:
        print(f"{lesson:<{width}}  {status:<6}  {seconds:7.1f}  {detail}")


def estimate_command(args) -> int:
    """`fsdplab estimate`: print the per-category table (or one JSON object) and whether it fits."""
    import json

    from .memory import estimate
    from .settings import TrainSetting

    setting = TrainSetting(model=args.model, world_size=args.world_size, lora_rank=args.lora_rank,
                           seq_len=args.seq_len, batch_size=args.batch_size, precision=args.precision,
                           optimizer=args.optimizer, activation_checkpointing=args.activation_checkpointing,
                           strategy="full_shard" if args.reshard_after_forward else "shard_grad_op",
                           cpu_offload=args.cpu_offload)
    report = estimate(setting, progress=not args.json)
    if args.json:
        data = report.to_dict()
        data.update(gpu_mem_gib=args.gpu_mem_gib, fits=report.fits(args.gpu_mem_gib))
        print(json.dumps(data))
    else:
        print(report.table(gpu_mem_gib=args.gpu_mem_gib))
        print(f"  ({report.seconds:.1f} s on fake tensors)")
    return 0


def main(argv=None) -> int:
    from .models import MODELS
    from .settings import OPTIMIZERS, PRECISIONS

    parser = argparse.ArgumentParser(prog="fsdplab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="execute lesson notebooks with papermill and print a summary")
    run.add_argument("notebooks", nargs="*", help="notebook paths or lesson names (default: all)")
    run.add_argument("--world-size", type=int, default=None, help="ranks for lessons that take world_size")
    run.add_argument("--out", default="runs", help="folder for the executed notebooks (default: runs)")
    run.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                     help="papermill parameter for lessons that declare it, e.g. -p steps 200")
    run.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")

    est = sub.add_parser("estimate", help="per-GPU memory of a training setup, exact (fake tensors)")
    est.add_argument("--model", default="qwen-7b", choices=list(MODELS))
    est.add_argument("--world-size", type=int, default=8)
    est.add_argument("--gpu-mem-gib", type=float, default=24.0)
    est.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: full fine-tune)")
    est.add_argument("--seq-len", type=int, default=2048)
    est.add_argument("--batch-size", type=int, default=1)
    est.add_argument("--precision", default="bf16", choices=PRECISIONS)
    est.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    est.add_argument("--activation-checkpointing", action="store_true")
    est.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    est.add_argument("--cpu-offload", action="store_true")
    est.add_argument("--json", action="store_true", help="print one JSON object")

    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            params = {name: _value(value) for name, value in args.parameter}
            rows = run_lessons(lesson_paths(args.notebooks), args.out, args.world_size, params,
                               progress=not args.no_progress)
            print_table(rows)
            failed = [r for r in rows if r[1] != "ok"]
            if failed:
                print(f"\n{len(failed)} lesson(s) failed; the executed notebooks in {args.out}/ show where.")
            return 1 if failed else 0
        return estimate_command(args)
    except ValueError as e:
        print(f"fsdplab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
