"""Run the GPU checks (tests/gpu/test_*.py) on a GPU machine under a time budget, one pytest process per file.

    python scripts/gpu_run.py [--out runs/gpu_check] [--budget 450] [--file-limit 300] [-k EXPR] [FILE ...]
    (or: bash scripts/gpu_check.sh [OUT] [options], which installs the lessons' wheels first)

Each file runs as `python -m pytest -v -rs FILE` in a process session of its own, so a crash, a hang or a
CUDA error stops that file only; a file still running at its limit is killed with everything it started.
Files run in the order env, cluster, fsdp1, memory, offload, lessons (then any others): the lessons, the
longest, come last and get what the budget leaves (each lesson has its own limit, FSDPLAB_LESSON_TIMEOUT). After every file OUT/gpu_run.json is rewritten: per file the counts of
passed / failed / skipped / errors, seconds, status, the measurements its tests recorded (the `record`
fixture of tests/gpu/conftest.py), skip reasons and the tail of the output; OUT/<file>.log holds all of it.
Exit code 1 if any test failed or errored, or a file ran past its own limit; skipped tests are fine.
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
import time
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("files", nargs="*", help=f"test files to run, e.g. memory lessons (default: all; order {','.join(ORDER)})")
    p.add_argument("--tests", type=Path, default=ROOT / "tests" / "gpu", help="folder of test_*.py files "
                   "(default: tests/gpu)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu_check"),
                   help="output folder (default: $OUT, else runs/gpu_check)")
    p.add_argument("--budget", type=float, default=450, help="seconds for all files together (default 450)")
    p.add_argument("--file-limit", type=float, default=300, help="seconds one file may take (default 300; "
                   f"not for {', '.join(UNLIMITED)})")
    p.add_argument("-k", dest="keyword", help="pytest -k expression, e.g. '1b or 03_'")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # `timeout` (gpu_check.sh) stops this runner with SIGTERM: exit through run_file's cleanup.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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
        report["exit_code"] = int(any(is_bad(r) for r in report["files"].values()))
        Path(report["json"]).write_text(json.dumps(report, indent=1, default=str))
    print_summary(report)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
