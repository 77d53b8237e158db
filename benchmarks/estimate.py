"""Time and memory of the exact estimator at full scale, this working tree against an earlier commit.

    python benchmarks/estimate.py                  # the Qwen cases, 2 runs of each code path
    python benchmarks/estimate.py --repeat 3       # more runs: the medians steady on a busy machine
    python benchmarks/estimate.py --quick          # the tiny model only
    python benchmarks/estimate.py --before HEAD~3  # against another commit
    python benchmarks/estimate.py --command        # the whole `python -m fsdplab estimate` process, start to exit

Each run is a fresh subprocess (its peak RSS is its own) that imports fsdplab either from this working tree
("after") or from `git archive <before> fsdplab`, unpacked in a temporary folder ("before"; the archive only
reads the repository). The two alternate, so a change in the machine's load hits both alike. Every number
an estimate reports (the peak, each category, each category's own peak, the resident shards, the tracker's
raw split) must be the same from both: any difference is printed and the exit status is 1. The table shows
the median seconds of the estimate() call, the median peak RSS of the process, and after / before. With
`--command` each run is the whole command a user waits for, `python -m fsdplab estimate ... --json` from its
start to its exit (imports and interpreter shutdown included), and the seconds are that wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# main before the estimator's speed-up: the DTensor optimizer step and two full training steps.
BEFORE = "76be922ab4c718abcb80bd18b3925052c530ada9"

SETTINGS = [
    # The case: Qwen2-7B LoRA r=64 in fp16 with checkpointing, 2048 tokens, 8 ranks.
    dict(model="qwen2-7b", world_size=8, lora_rank=64, precision="fp16", activation_checkpointing=True,
         seq_len=2048),
    dict(model="qwen-7b", world_size=8, lora_rank=None, seq_len=2048),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048, activation_checkpointing=True),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048, precision="fp16", activation_checkpointing=True,
         cpu_offload=True),
    # QLoRA: an NF4 base in bf16 compute with checkpointing, 7B and 70B (lesson 12's settings)
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048, precision="bf16", activation_checkpointing=True,
         base_dtype="nf4"),
    dict(model="llama2-70b", world_size=8, lora_rank=64, seq_len=2048, precision="bf16", activation_checkpointing=True,
         base_dtype="nf4"),
]
QUICK = [dict(model="tiny", world_size=2, seq_len=64), dict(model="tiny", world_size=3, seq_len=64, lora_rank=8)]
# What must not change (MemoryReport fields; `seconds` and `notes` may).
NUMBERS = ("peak_bytes", "by_category", "category_peaks", "resident", "detail")

CHILD = """
import json, resource, sys, time
from fsdplab.memory import estimate
kwargs = json.loads(sys.argv[1])
t0 = time.perf_counter()
report = estimate(progress=False, subprocess_mode=False, **kwargs)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "numbers": {k: getattr(report, k) for k in json.loads(sys.argv[2])}}))
"""


def unpack(commit: str, into: str) -> str:
    """`git archive <commit> fsdplab` unpacked under `into` (read-only use of the repository)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit, "fsdplab"],
                             capture_output=True, check=True).stdout
    path = os.path.join(into, "before.tar")
    with open(path, "wb") as f:
        f.write(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into


def run(code_root: str, setting: dict) -> dict:
    """One estimate in a fresh process that imports fsdplab from `code_root` (its working directory, so
    that no other checkout shadows it)."""
    env = dict(os.environ, PYTHONPATH=code_root)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(setting), json.dumps(NUMBERS)],
                         capture_output=True, text=True, cwd=code_root, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"estimate failed in {code_root}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def flags(setting: dict) -> list:
    """`fsdplab estimate` flags for one of SETTINGS."""
    argv = ["--model", setting["model"], "--world-size", str(setting["world_size"]), "--seq-len",
            str(setting["seq_len"])]
    if setting.get("lora_rank"):
        argv += ["--lora-rank", str(setting["lora_rank"])]
    if setting.get("precision"):
        argv += ["--precision", setting["precision"]]
    if setting.get("activation_checkpointing"):
        argv += ["--activation-checkpointing", "full"]
    if setting.get("cpu_offload"):
        argv += ["--cpu-offload"]
    if setting.get("base_dtype"):
        argv += ["--base-dtype", setting["base_dtype"]]
    return argv


def run_command(code_root: str, setting: dict) -> dict:
    """The whole `python -m fsdplab estimate ... --json` process from `code_root`: its wall seconds from start
    to exit, its own peak RSS (wait4) and the numbers it printed. No estimate cache: each run estimates."""
    env = dict(os.environ, PYTHONPATH=code_root, FSDPLAB_ESTIMATE_CACHE="")
    with tempfile.TemporaryFile("w+") as errors:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "fsdplab", "estimate", *flags(setting), "--json"],
                                cwd=code_root, env=env, stdout=subprocess.PIPE, stderr=errors, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)          # this child's own rusage
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"fsdplab estimate failed in {code_root}:\n{errors.read()[-3000:]}")
    rss_mib = usage.ru_maxrss / 1024
    data = json.loads(out.strip().splitlines()[-1])
    return {"seconds": seconds, "rss_mib": rss_mib, "numbers": {k: data[k] for k in NUMBERS}}


def label(setting: dict) -> str:
    return setting["model"] + " " + ", ".join(f"{k}={v}" for k, v in setting.items() if k != "model")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each code path per setting (default 2)")
    parser.add_argument("--before", default=BEFORE, help=f"the commit to compare with (default {BEFORE[:9]})")
    parser.add_argument("--first", type=int, default=None, help="only the first N settings")
    parser.add_argument("--command", action="store_true",
                        help="time the whole `python -m fsdplab estimate` process (start to exit), not the call")
    args = parser.parse_args(argv)
    from fsdplab.settings import GIB

    settings = (QUICK if args.quick else SETTINGS)[:args.first]
    rows, differ = [], False
    with tempfile.TemporaryDirectory(prefix="est-before-") as tmp:
        roots = {"before": unpack(args.before, tmp), "after": ROOT}
        print(f"before: {args.before} (unpacked in {tmp}); after: the working tree {ROOT}", flush=True)
        for setting in settings:
            print(f"\n{label(setting)}", flush=True)
            runs = {"before": [], "after": []}
            for i in range(args.repeat):
                for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    r = (run_command if args.command else run)(roots[side], setting)
                    runs[side].append(r)
                    print(f"  {side:<6} run {i + 1}: {r['seconds']:6.1f} s  peak RSS {r['rss_mib']:6.0f} MiB  "
                          f"peak {r['numbers']['peak_bytes']} B", flush=True)
            reference = runs["before"][0]["numbers"]
            for side, results in runs.items():
                for r in results:
                    bad = [k for k in NUMBERS if r["numbers"][k] != reference[k]]
                    if bad:
                        differ = True
                        print(f"  DIFFERENT ({side}): " + "; ".join(f"{k}: {r['numbers'][k]} vs {reference[k]}"
                                                                   for k in bad), flush=True)
            med = {side: (statistics.median(r["seconds"] for r in results),
                          statistics.median(r["rss_mib"] for r in results)) for side, results in runs.items()}
            rows.append((setting, med, reference["peak_bytes"]))

    width = max(len(label(setting)) for setting, _, _ in rows)
    print(f"\nmedians of {args.repeat} runs each; 'same' = every reported number equal before and after")
    print(f"{'setting':<{width}} {'before s':>8} {'after s':>8} {'ratio':>6} {'RSS before':>10} {'RSS after':>9} "
          f"{'peak GiB':>8}")
    for setting, med, peak in rows:
        (tb, mb), (ta, ma) = med["before"], med["after"]
        print(f"{label(setting):<{width}} {tb:8.1f} {ta:8.1f} {ta / tb:6.2f} {mb:8.0f} M {ma:7.0f} M "
              f"{peak / GIB:8.2f}")
    print("numbers: " + ("DIFFERENT (see above)" if differ else "same"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
