"""Lesson 11 (your first FSDP2 script) only: where its scripts go, torchrun started in a clean environment, the
scripts' `RESULT {json}` lines parsed and shown, torchrun's failure summary cut short, and the checkers of the
two "break the script on purpose" exercises, which run the learner's edited script under torchrun."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import owned_folders
from ..runtime.processes import python_command
from .checkers import exercise

# What a surrounding launcher (torchrun, Slurm, a notebook rank) may have set: torchrun must set them afresh.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
OUTCOMES = ("runs to the end", "fails at once", "hangs until the timeout")
# The lines the optimizer-order exercise moves, as the lesson's script writes them.
OPT_LINE = "    opt = torch.optim.AdamW(model.parameters(), lr=LR)\n"
SHARD_LINES = "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n"
LOG_LINE = "        dist.all_reduce(total)"
FAIL_AFTER = "    for step in range(STEPS):\n"
_TIMEOUT_LINE = re.compile(r"^TIMEOUT_S = \d+", re.M)


def lesson_folder(script_dir: str = "") -> tuple:
    """(folder, keep): an empty folder of the lab's for the scripts (`owned_folders.lesson_folder`); a temporary
    one (keep False) is deleted when this kernel stops."""
    folder, keep = owned_folders.lesson_folder(script_dir, "11_first_fsdp2_script", what="script_dir")
    if not keep:
        atexit.register(shutil.rmtree, folder, True)
    return folder, keep


def clean_environment(extra: dict | None = None) -> dict:
    """This kernel's environment without a launcher's RANK, WORLD_SIZE, MASTER_PORT, ... (torchrun sets its own),
    one OpenMP thread per rank (torchrun's default, set here so it does not warn), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


@dataclass
class Run:
    """One torchrun: its command, exit code, seconds, output, and each rank's RESULT (by rank)."""

    command: list
    returncode: int
    seconds: float
    stdout: str
    stderr: str
    results: dict = field(default_factory=dict)

    @property
    def lines(self) -> list:
        """What the ranks printed, without the RESULT lines."""
        text = _split_results(self.stdout)[1]
        text = re.sub(r"(?<=\S)(rank \d+ of \d+ starting)", r"\n\1", text)   # two ranks' lines on one
        return [line for line in text.splitlines() if line.strip()]

    @property
    def starts(self) -> int:
        """How many times a rank started the script ("... starting, torchrun attempt N" lines)."""
        return self.stdout.count(" starting, torchrun attempt ")

    @property
    def timed_out(self) -> bool:
        """A collective gave up after the group's timeout (gloo's or NCCL's watchdog's words)."""
        return bool(re.search(r"Timed out waiting|timed out|Watchdog caught collective operation timeout",
                              self.stderr))

    def summary(self) -> list:
        """torchrun's failure report, short: the ranks' error lines (each once, with its count when attempts
        repeated it), then the summary block's root cause (the script FAILED, which rank, its exit code)."""
        errors = [line for line in self.stderr.splitlines()
                  if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", line)]
        # one line per error, counted: each restart repeats the same errors (with another peer's port)
        counts = Counter(_same_error(line) for line in errors)
        first = {_same_error(line): line for line in reversed(errors)}
        out = [_short(first[key]) + (f"  (x{n})" if n > 1 else "") for key, n in counts.items()][:3]
        block = self.stderr.split("Root Cause (first observed failure):")
        failed = re.findall(r"^\S+ FAILED$", self.stderr, re.M)
        if failed:
            out.append(f"torchrun: {failed[-1]}")
        if len(block) > 1:
            for key in ("rank", "exitcode"):
                found = re.search(rf"^\s*{key}\s*:\s*(.*)$", block[1], re.M)
                if found:
                    out.append(f"  root cause {key}: " + re.sub(r"\s*\(pid: \d+\)", "", found.group(1)).strip())
        return out


def _split_results(stdout: str) -> tuple:
    """([each rank's RESULT dict], the rest of stdout). The ranks share one pipe, unbuffered (torchrun starts
    them with `python -u`), and print() writes a line and its newline apart: two RESULTs may share a line, so
    each JSON object is cut out by its own extent."""
    decoder, results, rest, at = json.JSONDecoder(), [], [], 0
    while (start := stdout.find("RESULT {", at)) >= 0:
        try:
            result, end = decoder.raw_decode(stdout, start + len("RESULT "))
        except json.JSONDecodeError:
            rest.append(stdout[at:start + len("RESULT ")])
            at = start + len("RESULT ")
            continue
        results.append(result)
        rest.append(stdout[at:start])
        at = end
    rest.append(stdout[at:])
    return results, "".join(rest)


def _same_error(line: str) -> str:
    """An error line without what differs between attempts: a peer's address and port."""
    return re.sub(r"\[[^\]\s]+\]:\d+", "[address]", line)


def _short(line: str, width: int = 150) -> str:
    line = re.sub(r"\[/__w/\S+\] ", "", line)          # gloo's build path
    return line if len(line) <= width else line[:width - 3] + "..."


def _shown(command: list) -> str:
    return " ".join(["python" if part == sys.executable else str(part) for part in command])


_RUNS: dict = {}


def launch(command: list, *, env: dict | None = None, timeout: float = 300, quiet: bool = False) -> Run:
    """Run `command` (a torchrun command line) in a clean environment (`clean_environment(env)`); print it, what
    the ranks printed (not their RESULT lines), torchrun's failure summary when it failed, and the exit code."""
    if not quiet:
        print("$", (" ".join(f"{k}={v}" for k, v in (env or {}).items()) + " ").lstrip() + _shown(command))
    t0 = time.perf_counter()
    code, stdout, stderr = _run([str(c) for c in command], clean_environment(env), timeout)
    run = Run(list(command), code, time.perf_counter() - t0, stdout, stderr)
    run.results = {r["rank"]: r for r in sorted(_split_results(stdout)[0], key=lambda r: r["rank"])}
    if not quiet:
        for line in _brief(run.lines):
            print("  " + line)
        if code:
            for line in run.summary():
                print("  " + line)
        print(f"exit code {code} after {run.seconds:.1f} s")
    return run


def _run(command: list, env: dict, timeout: float) -> tuple:
    """(exit code, stdout, stderr) of `command`, through the run's fork server where there is one (`forked`). At
    the timeout or an interrupt torchrun gets SIGTERM, on which it stops its ranks, and SIGKILL 30 s later:
    SIGKILL at once (subprocess.run's way) would leave the ranks running, in sessions of their own."""
    proc = subprocess.Popen(forked(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except BaseException as error:
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        return 124, stdout, stderr + f"\nkilled after {timeout:.0f} s"


def forked(command: list) -> list:
    """A `python -m torch.distributed.run ...` command with torchrun itself a fork of `fsdplab run`'s fork server,
    which imported torch once (`processes.python_command`); any other command, or with no fork server (a kernel
    that JupyterLab started), as it is. The ranks stay `python SCRIPT` processes: a fork's exit skips the
    interpreter's teardown (about 0.5 s with torch loaded), and then the rank that raises and the rank whose
    collective it breaks end in the same instant: torchrun's summary named rank 0 the first failure, not the
    rank that raised."""
    runner = python_command("torch.distributed.run")
    if runner[:2] == [sys.executable, "-m"] or command[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        return command
    return runner + command[3:]


_MODEL_PRINTS: set = set()


def _brief(lines: list) -> list:
    """`lines` with a `print(model)` already shown in this kernel cut to one line."""
    out, skipping = [], False
    for line in lines:
        if skipping:
            skipping = line != ")"
            continue
        if line.endswith("(") and line[:1].isupper() and not line.startswith(" "):
            end = lines.index(")", lines.index(line)) if ")" in lines else len(lines)
            printed = "\n".join(lines[lines.index(line):end + 1])
            if printed in _MODEL_PRINTS:
                out.append(f"{line}...)   (print(model), {end - lines.index(line) + 1} lines as above)")
                skipping = True
                continue
            _MODEL_PRINTS.add(printed)
        out.append(line)
    return out


def torchrun(script, world_size: int, *options) -> list:
    """The command line: python -m torch.distributed.run --standalone --nproc-per-node N [options] script."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
            *map(str, options), str(script)]


def run_script(script, world_size: int, *, env: dict | None = None) -> Run:
    """`launch` the script quietly under torchrun, once per script text and world size (a checker and the
    checks cell share the run)."""
    key = (Path(script).read_text(), world_size, tuple(sorted((env or {}).items())))
    if key not in _RUNS:
        _RUNS[key] = launch(torchrun(script, world_size), env=env, quiet=True)
    return _RUNS[key]


def run_scripts(*scripts, world_size: int) -> list:
    """`run_script` for each script at once (threads: each mostly waits for its torchrun)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(scripts)) as pool:
        return list(pool.map(lambda s: run_script(s, world_size), scripts))


def show_results(run: Run) -> None:
    """One line per rank: device, classes, one weight's full and local shape, the head's rows, the optimizer."""
    print(f"{'rank':>4}  {'device':8} {'classes':22} {'blocks.0.up.weight':22} {'head.weight':12} optimizer holds")
    for rank, r in run.results.items():
        classes = f"{r['model']} / {r['block']}"
        weight = f"{tuple(r['full_shape'])} -> {tuple(r['local_shape'])}"
        head = str(tuple(r["head_local_shape"]))
        print(f"{rank:>4}  {r['device']:8} {classes:22} {weight:22} {head:12} "
              f"{r['optimizer_holds']}, {r['optimizer_states']} states")
    losses = run.results[0]["losses"] if run.results else []
    if losses:
        print(f"mean loss over the ranks: {' -> '.join(f'{v:.4f}' for v in losses)}; weights changed: "
              f"{run.results[0]['weights_changed']}")


def loss_gap(a: list, b: list) -> float:
    """The largest relative difference between two loss curves of the same length (inf if the lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


# --- the variants the lesson and its exercises run ---------------------------------------------------------

def failing(text: str) -> str:
    """The script with the last rank raising at step 2."""
    return text.replace(FAIL_AFTER,
                        FAIL_AFTER + "        if rank == world - 1 and step == 2:    # the last rank fails\n"
                        "            raise RuntimeError(f\"rank {rank} fails at step {step}\")\n", 1)


def optimizer_first(text: str) -> str:
    """The script with the optimizer built before fully_shard."""
    return text.replace(OPT_LINE, "", 1).replace(SHARD_LINES, OPT_LINE + SHARD_LINES, 1)


def rank0_only_log(text: str, timeout_s: int) -> str:
    """The script with the loss's all_reduce on rank 0 only, and a group timeout of `timeout_s`."""
    text = _TIMEOUT_LINE.sub(f"TIMEOUT_S = {timeout_s}", text, count=1)
    return text.replace(LOG_LINE, "        if rank == 0:\n    " + LOG_LINE, 1)


def outcome(run: Run, world_size: int) -> str | None:
    """Which of OUTCOMES a run had; None when the group did not even form (not every rank got to training)."""
    if run.returncode == 0:
        return OUTCOMES[0]
    if "connectFullMesh" in run.stderr:        # init_process_group failed: the group never formed
        return None
    return OUTCOMES[2] if run.timed_out else OUTCOMES[1]


def _ran(run: Run) -> str:
    last = (run.summary() or run.stderr.strip().splitlines()[-1:] or ["no output"])[0]
    return f"torchrun exited {run.returncode}: {last.strip()}"


# --- the exercises' checkers -----------------------------------------------------------------------------

@exercise("11-optimizer-order")
def _optimizer_order(answer, *, script, world_size):
    """Do the weights change when the optimizer is built before fully_shard? Runs the learner's script."""
    if not isinstance(answer, bool):
        return False, f"expected True or False (do the weights change after the steps?), got {answer!r}."
    run = run_script(script, world_size)
    if run.returncode or not run.results:
        return False, f"your edited script did not run to the end ({_ran(run)}); fix the edit first."
    r = run.results[0]
    if r["optimizer_holds"] == "DTensor":
        return False, ("your script still builds the optimizer after fully_shard (it holds DTensor parameters): "
                       "move the `opt = ...` line above the first fully_shard.")
    if answer == r["weights_changed"]:
        losses = ", ".join(f"{v:.4f}" for v in r["losses"])
        return True, (f"measured: weights changed = {r['weights_changed']}, {r['optimizer_states']} optimizer "
                      f"states, losses {losses}. fully_shard replaced each parameter by a new DTensor one; the "
                      f"optimizer kept the old plain tensors, which get no gradient, so step() skips them - and "
                      f"no error or warning says so.")
    return False, ("that is not what your script measured. Hint: which tensors does the optimizer hold "
                   "(opt.param_groups[0]['params']), and which ones does backward() give a .grad?")


@exercise("11-skip-collective")
def _skip_collective(answer, *, script, world_size):
    """What happens when only rank 0 calls a collective? Runs the learner's script."""
    text = Path(script).read_text()
    if not re.search(r"if [^\n]*rank[^\n]*:\s*\n\s+dist\.all_reduce\(total\)", text):
        return False, "your script still calls dist.all_reduce(total) on every rank: put it under `if rank == 0:`."
    if answer not in OUTCOMES:
        return False, f"expected one of {', '.join(map(repr, OUTCOMES))}, got {answer!r}."
    run = run_script(script, world_size)
    seen = outcome(run, world_size)
    if seen is None:
        return False, ("the group did not form before the training started (a busy machine and a short "
                       "TIMEOUT_S?): run the cell again, or raise hang_timeout.")
    if answer == seen:
        why = {OUTCOMES[0]: "with one rank there is nobody to wait for: rerun with world_size 2 or more.",
               OUTCOMES[2]: "rank 0 waited in all_reduce while the others went on to the next step's "
                            "all-gather; nobody matched its call until TIMEOUT_S ran out, then torchrun "
                            "stopped every rank.",
               OUTCOMES[1]: "a rank failed before the timeout."}[seen]
        return True, f"torchrun ran {run.seconds:.0f} s: {why}"
    return False, ("that is not what your script did. Hint: a collective returns only when every rank of the "
                   "group has called it; what are the other ranks doing meanwhile, and who tells rank 0 to stop?")
