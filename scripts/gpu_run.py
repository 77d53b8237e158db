"""Run the GPU checks (tests/gpu/test_*.py) on a GPU machine under a time budget, one pytest process per file.

    python scripts/gpu_run.py [--out runs/gpu_check] [--budget 450] [--file-limit 300] [-k EXPR] [FILE ...]
    (or: bash scripts/gpu_check.sh [OUT] [options], which installs the lessons' wheels first)

Each file runs as `python -m pytest -v -rs FILE` in a process session of its own, so a crash, a hang or a
CUDA error stops that file only; a file still running at its limit is killed with everything it started.
Files run in the order env, cluster, fsdp1, memory, offload, lessons (then any others): the lessons, the
longest, come last and get what the budget leaves (each lesson has its own limit, FSDPLAB_LESSON_TIMEOUT). \
After every file OUT/gpu_run.json is rewritten: per file the counts of
passed / failed / skipped / errors, seconds, status, the measurements its tests recorded (the `record`
fixture of tests/gpu/conftest.py), skip reasons and the tail of the output; OUT/<file>.log holds all of it.
Exit code 1 if any test failed or errored, or a file ran past its own limit; 3 if nothing failed but a file
was cut short by the total budget or not started for lack of it (a partial run is never reported as a pass);
skipped tests are fine.

    python scripts/gpu_run.py --check [--out OUT] [--budget 450]      (what scripts/gpu_check.sh runs)

runs the whole one-shot GPU check instead: the machine record, then the steps scripts/gpu_plan.py chooses for the
GPU count (fsdplab doctor, the lessons, tests/gpu, the torchrun recipe, the estimator against the GPU), each in a
process session of its own under the one budget, independent lanes side by side; OUT/steps.tsv, OUT/<step>.log,
OUT/check.json; a step table and every measurement at the end. Exit code 0 every step passed, 1 a step failed or
timed out, 3 a step was cut, skipped for the budget or incomplete, 4 no GPU (nothing was checked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("env", "cluster", "fsdp1", "memory", "offload", "lessons")
UNLIMITED = ("lessons",)  # files whose tests limit themselves: no --file-limit, only what the budget leaves
MIN_START_S = 15          # a file is not started with less of the budget left than this
TAIL_CHARS = 3000
COUNTS = ("passed", "failed", "skipped", "errors")
# pytest's last line ("=== 2 passed, 1 skipped in 3.1s ==="), one line per test with -v, and -rs's reasons.
SUMMARY_LINE = re.compile(r"^=+ (.*\bin [\d.]+s.*) =+$", re.M)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")
TEST_LINE = re.compile(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)\b")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] [^\n]*?:\d+: (.*)$", re.M)
EXIT_FAILED, EXIT_INCOMPLETE, EXIT_NO_GPU = 1, 3, 4


def test_files(folder: Path, names) -> list:
    """test_*.py files of `folder` (or those named: 'memory', 'test_memory', a path), in ORDER."""
    files = sorted(folder.glob("test_*.py"))
    if names:
        wanted = {Path(n).stem.removeprefix("test_") for n in names}
        unknown = wanted - {f.stem.removeprefix("test_") for f in files}
        if unknown:
            raise SystemExit(f"gpu_run: no test file for {sorted(unknown)} in {folder}")
        files = [f for f in files if f.stem.removeprefix("test_") in wanted]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(files, key=lambda f: (rank.get(f.stem.removeprefix("test_"), len(ORDER)), f.name))


def counts_of(output: str) -> dict:
    """Test counts from pytest's summary line; from the per-test lines when the run was cut short."""
    found = SUMMARY_LINE.findall(output)
    if found:
        counts = {("errors" if kind.startswith("error") else kind): int(n) for n, kind in COUNT.findall(found[-1])}
    else:
        words = TEST_LINE.findall(output)
        counts = {"passed": words.count("PASSED"), "failed": words.count("FAILED"),
                  "skipped": words.count("SKIPPED"), "errors": words.count("ERROR")}
    return {k: counts.get(k, 0) for k in COUNTS}


def kill_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the file's whole process session (pytest, ranks, kernels), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def run_file(path: Path, timeout: float, own_limit: float, out: Path, pytest_args: list) -> dict:
    """One test file in its own pytest process; its result as a dict."""
    log, measured = out / f"{path.stem}.log", out / f"{path.stem}.record.json"
    measured.unlink(missing_ok=True)
    env = dict(os.environ, FSDPLAB_GPU_RECORD=str(measured), FSDPLAB_GPU_OUT=str(out), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", str(path), *pytest_args]
    t0 = time.monotonic()
    killed = False
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            killed = True
        finally:                      # also on SIGTERM / Ctrl-C of this runner: take the file's processes down
            kill_session(proc)
    seconds = time.monotonic() - t0
    output = log.read_text(errors="replace")
    counts = counts_of(output)
    if killed:
        # Past its own limit it hung or is too slow: a failure. Stopped by the total budget: unfinished.
        status = "timeout" if timeout >= own_limit else "cut"
    elif proc.returncode in (0, 5):   # 5: no tests collected (e.g. all deselected by -k)
        status = "passed" if counts["passed"] else "skipped" if counts["skipped"] else "no tests"
    else:
        status = "failed"
    return {"status": status, **counts, "seconds": round(seconds, 1), "returncode": proc.returncode,
            "limit_s": round(timeout), "measurements": json.loads(measured.read_text()) if measured.exists() else {},
            "skip_reasons": sorted(set(SKIP_REASON.findall(output))), "tail": output[-TAIL_CHARS:]}


def is_bad(result: dict) -> bool:
    return result["status"] in ("failed", "timeout") or result["failed"] > 0 or result["errors"] > 0


def files_exit_code(results) -> int:
    """1 for a failure, error or timeout; else 3 when a file was cut by the total budget or never started
    (its tests did not all run, so the run checked less than it was asked to); else 0."""
    results = list(results)
    if any(is_bad(r) for r in results):
        return EXIT_FAILED
    return EXIT_INCOMPLETE if any(r["status"] in ("cut", "not run") for r in results) else 0


def print_summary(report: dict) -> None:
    files = report["files"]
    width = max([4] + [len(name) for name in files])
    print(f"\n{'file':<{width}}  {'status':<8} {'passed':>6} {'failed':>6} {'skipped':>7} {'errors':>6} {'seconds':>8}")
    for name, r in files.items():
        print(f"{name:<{width}}  {r['status']:<8} {r['passed']:>6} {r['failed']:>6} {r['skipped']:>7} "
              f"{r['errors']:>6} {r['seconds']:>8.1f}")
    for name, r in files.items():
        for reason in r["skip_reasons"][:3]:
            print(f"  {name} skipped: {reason}")
        for test, values in r["measurements"].items():
            print(f"  {name}::{test}: " + ", ".join(f"{k}={v}" for k, v in values.items())[:240])
    print(f"total {report['total_s']:.0f} s of {report['budget_s']:.0f}; results in {report['json']}; "
          f"exit code {report['exit_code']}")


# --- the one-shot check: steps under one budget (--check) --------------------------------------------------------

@dataclass
class Step:
    """One command of the check. Not started with less than `min_s` of the budget left ("skipped (budget)");
    killed at `limit_s` ("timeout") or where the budget ends first ("cut")."""
    name: str
    cmd: list
    limit_s: float
    min_s: float = MIN_START_S
    env: dict = field(default_factory=dict)
    keep: str = ""            # regex: the log lines that are measurements, printed in the summary
    gpu_run: bool = False     # a `gpu_run.py` of test files: exit code 3 is "incomplete", its JSON has the records
    explain: dict = field(default_factory=dict)   # regex in the log -> what it means, for the step table

    @property
    def folder(self) -> str:
        return self.name


def step_result(step: Step, status: str, *, rc=None, seconds=0.0, limit=0.0, detail="") -> dict:
    return {"step": step.name, "status": status, "rc": rc, "seconds": round(seconds, 1), "limit_s": round(limit),
            "detail": detail, "cmd": " ".join(map(str, step.cmd))}


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


LIVE = set()   # processes of the steps running now: a SIGTERM of the check takes their sessions down too


def kill_live(signum=None, frame=None):
    for proc in list(LIVE):
        kill_session(proc)
    if signum is not None:
        sys.exit(128 + signum)


def run_step(step: Step, out: Path, left: float) -> dict:
    """Run `step` with `left` seconds of the budget; OUT/<name>.log has its output."""
    if left < step.min_s:
        return step_result(step, "skipped (budget)",
                           detail=f"{max(left, 0):.0f} s of the budget left, needs {step.min_s:.0f}")
    limit = min(step.limit_s, left)
    log = out / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{k: str(v) for k, v in step.env.items()})
    t0 = time.monotonic()
    killed = False
    with open(log, "w") as sink:
        sink.write(f"$ {' '.join(map(str, step.cmd))}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(list(map(str, step.cmd)), cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            return step_result(step, "failed", detail=f"cannot start: {err}")
        LIVE.add(proc)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            killed = True
        finally:                      # a session of its own: ranks, kernels and torchrun's workers go with it
            kill_session(proc)
            LIVE.discard(proc)
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    if killed:
        status = "timeout" if limit >= step.limit_s else "cut"
        detail = f"stopped at {limit:.0f} s" + ("" if status == "timeout" else " (the budget's end)")
    elif proc.returncode == 0:
        status, detail = "passed", ""
    elif step.gpu_run and proc.returncode == EXIT_INCOMPLETE:
        status, detail = "incomplete", "a test file was cut or not started: see its gpu_run.json"
    else:
        status, detail = "failed", last_line(text)
    for pattern, meaning in step.explain.items():
        if re.search(pattern, text):
            detail = meaning
    return step_result(step, status, rc=proc.returncode, seconds=seconds, limit=limit, detail=detail)


def run_phases(phases: list, out: Path, budget: float, start: float | None = None) -> list:
    """Run phases one after another; a phase's lanes side by side (threads), each lane's steps in order; every
    step gets what is left of the one budget. Results in the order of `phases`."""
    start = time.monotonic() if start is None else start
    results = {}

    def lane_worker(lane):
        for step in lane:
            left = budget - (time.monotonic() - start)
            print(f"=== {step.name} (at most {min(step.limit_s, max(left, 0)):.0f} s): "
                  f"{' '.join(map(str, step.cmd))[:200]}", flush=True)
            results[step.name] = r = run_step(step, out, left)
            print(f"    {step.name}: {r['status']} in {r['seconds']:.0f} s {r['detail']}".rstrip(), flush=True)

    for phase in phases:
        threads = [threading.Thread(target=lane_worker, args=(lane,), daemon=True) for lane in phase if lane]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():   # short joins: a SIGTERM's handler runs in this thread meanwhile
                thread.join(0.5)
    return [results[step.name] for phase in phases for lane in phase for step in lane]


def check_exit_code(results: list) -> int:
    statuses = [r["status"] for r in results]
    if any(s in ("failed", "timeout") for s in statuses):
        return EXIT_FAILED
    return EXIT_INCOMPLETE if any(s != "passed" for s in statuses) else 0


def write_table(results: list, out: Path) -> None:
    rows = ["step\tstatus\trc\tseconds\tlimit_s\tdetail"]
    rows += [f"{r['step']}\t{r['status']}\t{'' if r['rc'] is None else r['rc']}\t{r['seconds']}\t{r['limit_s']}\t"
             f"{r['detail'].replace(chr(9), ' ')}" for r in results]
    (out / "steps.tsv").write_text("\n".join(rows) + "\n")


def measurements(step: Step, out: Path) -> list:
    """The lines of `step`'s results worth keeping: its tests' records (gpu_run.json), else its log's `keep` lines."""
    lines = []
    report = out / step.folder / "gpu_run.json"
    if step.gpu_run and report.exists():
        for name, r in json.loads(report.read_text())["files"].items():
            lines.append(f"{name}: {r['status']}, {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped, "
                         f"{r['errors']} errors in {r['seconds']} s")
            lines += [f"  skipped: {reason}" for reason in r["skip_reasons"][:4]]
            for test, values in r["measurements"].items():
                lines.append(f"  {test}: " + ", ".join(f"{k}={v}" for k, v in values.items())[:400])
    elif step.keep and (out / f"{step.name}.log").exists():
        pattern = re.compile(step.keep)
        lines += [line.rstrip() for line in (out / f"{step.name}.log").read_text(errors="replace").splitlines()
                  if pattern.search(line)][:60]
    return lines


def print_check_summary(steps: list, results: list, out: Path, total: float, budget: float, code: int) -> None:
    width = max(len(r["step"]) for r in results)
    print(f"\n{'step':<{width}}  {'status':<17} {'rc':>4} {'seconds':>8} {'limit':>6}  detail")
    for r in results:
        rc = "" if r["rc"] is None else r["rc"]
        print(f"{r['step']:<{width}}  {r['status']:<17} {rc!s:>4} {r['seconds']:>8.1f} {r['limit_s']:>6}  "
              f"{r['detail']}")
    for step in steps:
        lines = measurements(step, out)
        if lines:
            print(f"\n--- {step.name}")
            print("\n".join(lines))
    print(f"\ntotal {total:.0f} s of {budget:.0f}; steps in {out / 'steps.tsv'}, logs in {out}; exit code {code}")


def check(out: Path, budget: float) -> int:
    """The one-shot GPU check (see the module's docstring): the machine record, then gpu_plan's steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_plan

    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    machine = Step(**gpu_plan.machine_step(out))
    results = run_phases([[[machine]]], out, budget, start)
    facts = gpu_plan.read_facts(out)
    phases = [[[Step(**spec) for spec in lane] for lane in phase]
              for phase in gpu_plan.plan(facts, out, sys.executable)]
    planned = [step for phase in phases for lane in phase for step in lane]
    if not facts.get("gpus"):
        reason = facts.get("no_gpu_reason") or "the machine record found none (see " + str(out / machine.name) + ".log)"
        print(f"\nno GPU: {reason}."
              f"\nNothing was checked; the {len(planned)} GPU steps were not run.", flush=True)
        results += [step_result(step, "not run (no GPU)") for step in planned]
        code = EXIT_NO_GPU
    else:
        print(f"{len(facts['gpus'])} GPU(s): {', '.join(sorted({g['name'] for g in facts['gpus']}))}; "
              f"{len(planned)} steps in {len(phases)} phases", flush=True)
        results += run_phases(phases, out, budget, start)
        code = check_exit_code(results)
    total = time.monotonic() - start
    write_table(results, out)
    (out / "check.json").write_text(json.dumps({"budget_s": budget, "total_s": round(total, 1), "exit_code": code,
                                                 "machine": facts, "steps": results}, indent=1, default=str))
    print_check_summary([machine] + planned, results, out, total, budget, code)
    return code


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("files", nargs="*",
                   help=f"test files to run, e.g. memory lessons (default: all; order {','.join(ORDER)})")
    p.add_argument("--tests", type=Path, default=ROOT / "tests" / "gpu", help="folder of test_*.py files "
                   "(default: tests/gpu)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu_check"),
                   help="output folder (default: $OUT, else runs/gpu_check)")
    p.add_argument("--budget", type=float, default=450, help="seconds for all files together (default 450)")
    p.add_argument("--file-limit", type=float, default=300, help="seconds one file may take (default 300; "
                   f"not for {', '.join(UNLIMITED)})")
    p.add_argument("-k", dest="keyword", help="pytest -k expression, e.g. '1b or 03_'")
    p.add_argument("--check", action="store_true", help="the whole one-shot GPU check (scripts/gpu_plan.py's steps) "
                   "instead of test files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # `timeout` (gpu_check.sh) stops this runner with SIGTERM: exit through run_file's cleanup.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.check:
        signal.signal(signal.SIGTERM, kill_live)
        return check(args.out.resolve(), args.budget)
    files = test_files(args.tests.resolve(), args.files)
    if not files:
        raise SystemExit(f"gpu_run: no test_*.py files in {args.tests}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    pytest_args = ["-k", args.keyword] if args.keyword else []
    start = time.monotonic()
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tests": str(args.tests), "budget_s": args.budget,
              "file_limit_s": args.file_limit, "json": str(out / "gpu_run.json"), "files": {}}
    for path in files:
        left = args.budget - (time.monotonic() - start)
        if left < MIN_START_S:
            result = {"status": "not run", **dict.fromkeys(COUNTS, 0), "seconds": 0.0, "returncode": None,
                      "limit_s": 0, "measurements": {}, "skip_reasons": [f"total budget of {args.budget:.0f} s spent"],
                      "tail": ""}
        else:
            limit = math.inf if path.stem.removeprefix("test_") in UNLIMITED else args.file_limit
            print(f"--- {path.name} (at most {min(left, limit):.0f} s)", flush=True)
            result = run_file(path, min(left, limit), limit, out, pytest_args)
            print(f"    {result['status']}: {result['passed']} passed, {result['failed']} failed, {result['skipped']} "
                  f"skipped, {result['errors']} errors in {result['seconds']:.0f} s", flush=True)
        report["files"][path.stem] = result
        report["total_s"] = round(time.monotonic() - start, 1)
        report["exit_code"] = files_exit_code(report["files"].values())
        Path(report["json"]).write_text(json.dumps(report, indent=1, default=str))
    print_summary(report)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
