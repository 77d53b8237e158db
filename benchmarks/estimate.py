"""Time and memory of the exact estimator at full scale: each setting runs in its own subprocess (fresh
process, so its peak RSS is its own). Prints one table row per setting.

    python benchmarks/estimate.py            # Qwen-7B on 8 ranks: full fine-tune and LoRA r=64
    python benchmarks/estimate.py --quick    # the tiny model only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SETTINGS = [
    dict(model="qwen-7b", world_size=8, lora_rank=None, seq_len=2048),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048, activation_checkpointing=True),
    dict(model="qwen-7b", world_size=8, lora_rank=64, seq_len=2048, precision="fp16", activation_checkpointing=True,
         cpu_offload=True),
]
QUICK = [dict(model="tiny", world_size=2, seq_len=64), dict(model="tiny", world_size=2, seq_len=64, lora_rank=8)]

CHILD = """
import json, resource, sys, time
from fsdplab.memory import estimate
kwargs = json.loads(sys.argv[1])
t0 = time.perf_counter()
report = estimate(progress=False, subprocess_mode=False, **kwargs)
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_bytes": report.peak_bytes, "by_category": report.by_category}))
"""


def run(setting: dict) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(setting)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    args = parser.parse_args(argv)
    from fsdplab.settings import GIB as gib

    print(f"{'model':<9} {'settings':<58} {'seconds':>8} {'peak RSS MiB':>12} {'peak GiB':>9}")
    for setting in QUICK if args.quick else SETTINGS:
        r = run(dict(setting))
        extra = {k: v for k, v in setting.items() if k != "model"}
        text = ", ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{setting['model']:<9} {text:<58} {r['seconds']:8.1f} {r['rss_mib']:12.0f} {r['peak_bytes'] / gib:9.2f}",
              flush=True)
        print("          " + ", ".join(f"{k} {v / gib:.2f}" for k, v in r["by_category"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
