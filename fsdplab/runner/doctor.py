"""`fsdplab doctor`: a preflight to run first on a GPU machine. It looks at what the lessons will meet: torch's
CUDA build against the GPUs' compute capability, native bf16 (else fp16 with a GradScaler), NCCL, free memory
and compute mode per GPU, /dev/shm (NCCL's shared-memory transport), CUDA_VISIBLE_DEVICES against the world
size, and the installed packages against fsdplab's requirements. Each problem is one line, its fix the next.

Two steps: `probe()` gathers facts (a JSON-able dict; it asks CUDA, so it opens a CUDA context on every GPU)
and `findings(facts, world_size)` judges them (pure, so every finding is tested with made-up facts).
`fsdplab doctor` probes in its own process; `doctor()`, for a notebook, probes in a child process, because a
kernel that has opened CUDA contexts holds GPU memory the ranks need and, on GPUs in exclusive-process mode,
the GPUs themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from ..settings import GIB, MIB, native_bf16

ERROR, WARNING, OK = "error", "warning", "ok"
SHM_MIN_BYTES = 1 * GIB            # Docker's default is 64 MiB; NCCL's SHM transport wants far more per peer pair
FREE_MEMORY_WARN = 0.9             # below this share of a GPU free, another process holds it
NVIDIA_SMI_QUERY = "index,name,compute_mode,memory.total,memory.used"


@dataclass(frozen=True)
class Finding:
    level: str           # error (blocks), warning (runs, but not as it should), ok (for the record)
    text: str            # one line: what was found
    fix: str = ""        # one line: what to do about it
    detail: bool = False # an ok line that only `fsdplab doctor` prints, not a notebook's short report

    def lines(self) -> list:
        head = {ERROR: "error:   ", WARNING: "warning: ", OK: "ok:      "}[self.level] + self.text
        return [head] + ([f"         fix: {self.fix}"] if self.fix else [])


class Report(list):
    """The findings, in order; `ok` is False when one of them blocks. `str()` is every line (what `fsdplab
    doctor` prints); a notebook shows `brief()`: the problems and the GPUs, one line on a CPU machine."""

    @property
    def ok(self) -> bool:
        return not any(f.level == ERROR for f in self)

    def problems(self) -> list:
        return [f for f in self if f.level != OK]

    def __str__(self) -> str:
        return "\n".join(line for f in self for line in f.lines())

    def brief(self) -> str:
        return "\n".join(line for f in self if not f.detail for line in f.lines())

    def _repr_pretty_(self, printer, cycle):
        printer.text(self.brief())


# --- facts --------------------------------------------------------------------------------------------------

def _nvidia_smi() -> list | None:
    """nvidia-smi's view of every GPU on the machine (it ignores CUDA_VISIBLE_DEVICES); None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        index, name, mode, total, used = parts
        rows.append({"index": index, "name": name, "compute_mode": mode, "memory_total_mib": _number(total),
                     "memory_used_mib": _number(used)})
    return rows


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def _shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        return shutil.disk_usage(path).total
    except OSError:
        return None


def _packages() -> list:
    """fsdplab's own requirements (not its extras) with the installed version of each, None where missing."""
    from importlib import metadata

    try:
        requires = metadata.requires("fsdplab") or []
    except metadata.PackageNotFoundError:
        return []
    from packaging.requirements import Requirement

    rows = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            version = None
        rows.append({"name": req.name, "required": str(req.specifier), "version": version})
    return rows


def probe() -> dict:
    """Facts about this machine as torch and the system see them. Opens a CUDA context on every visible GPU
    (mem_get_info): call it in a process of its own, never in a kernel that later forks ranks."""
    import torch

    facts = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
             "arch_list": [], "cuda_available": False, "cuda_error": None, "gpus": [], "nccl": None,
             "bf16_torch": None, "nvidia_smi": _nvidia_smi(), "shm_bytes": _shm_bytes(),
             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "packages": _packages()}
    try:
        facts["cuda_available"] = bool(torch.cuda.is_available())
        if facts["cuda_available"]:
            facts["arch_list"] = list(torch.cuda.get_arch_list())
            for index in range(torch.cuda.device_count()):
                facts["gpus"].append(_gpu(torch, index))
            # torch's own answer, for the record: with emulation allowed it says True on a T4
            facts["bf16_torch"] = bool(torch.cuda.is_bf16_supported(including_emulation=False))
            nccl = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception as err:  # noqa: BLE001 - a driver error is itself the finding
        facts["cuda_error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return facts


def _gpu(torch, index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    gpu = {"index": index, "name": props.name, "capability": [props.major, props.minor],
           "total_bytes": int(props.total_memory), "free_bytes": None, "error": None}
    try:
        free, total = torch.cuda.mem_get_info(index)
        gpu.update(free_bytes=int(free), total_bytes=int(total))
    except Exception as err:  # noqa: BLE001 - e.g. busy: another process holds it in exclusive-process mode
        gpu["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return gpu


def probe_in_subprocess(timeout: float = 120) -> dict:
    """`probe()` in a child process, so that the caller (a notebook's kernel) opens no CUDA context."""
    out = subprocess.run([sys.executable, "-m", "fsdplab.runner.doctor", "--facts"], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the doctor's probe failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- judgement ----------------------------------------------------------------------------------------------

def covers(arch_list, capability) -> bool:
    """Whether torch's compiled kernels run on a GPU of `capability`: a cubin sm_XY runs on the same major at
    minor Y or newer, PTX compute_XY is compiled by the driver for any GPU of XY or newer."""
    major, minor = capability
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = "".join(ch for ch in number if ch.isdigit())     # sm_90a -> 90
        if len(digits) < 2:
            continue
        arch_major, arch_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def _gib(n) -> str:
    return f"{n / GIB:.1f} GiB"


def findings(facts: dict, world_size: int | None = None) -> Report:
    """Judge `probe()`'s facts for a run of `world_size` ranks (None: no particular size)."""
    report = Report()
    report += _torch_findings(facts)
    gpus = facts.get("gpus") or []
    for gpu in gpus:
        report += _gpu_findings(facts, gpu)
    if gpus:
        report += _nccl_findings(facts, world_size)
    report += _visible_findings(facts, world_size)
    report += _package_findings(facts)
    return report


def _torch_findings(facts) -> list:
    smi = facts.get("nvidia_smi") or []
    torch_version = facts["torch"]
    if facts.get("cuda_error"):
        return [Finding(ERROR, f"torch {torch_version} failed to reach CUDA: {facts['cuda_error']}",
                        "check the driver with nvidia-smi; a GPU held by another process in exclusive-process "
                        "mode must be freed first")]
    if not facts.get("gpus"):
        if smi and facts.get("torch_cuda") is None:
            return [Finding(ERROR, f"nvidia-smi lists {len(smi)} GPU(s) but torch {torch_version} is a CPU build",
                            "install a CUDA build of torch (a +cuXYZ wheel your driver supports), then run "
                            "fsdplab doctor again")]
        if smi and facts.get("cuda_visible_devices") is None:
            return [Finding(ERROR, f"nvidia-smi lists {len(smi)} GPU(s) but torch {torch_version} (CUDA "
                            f"{facts['torch_cuda']}) sees none",
                            "the driver may be older than this CUDA: update it, or install torch built for an "
                            "older CUDA")]
        if not smi:
            return [Finding(OK, f"no GPU found: the lab runs CPU ranks with gloo (torch {torch_version})")]
        return []     # GPUs exist but CUDA_VISIBLE_DEVICES hides them: _visible_findings says so
    return [Finding(OK, f"torch {torch_version}, CUDA {facts['torch_cuda']}, kernels for "
                        f"{' '.join(facts.get('arch_list') or []) or 'no listed arch'}", detail=True)]


def _gpu_findings(facts, gpu) -> list:
    major, minor = gpu["capability"]
    sm = f"sm_{major}{minor}"
    label = f"GPU {gpu['index']} ({gpu['name']}, {sm}, {_gib(gpu['total_bytes'])})"
    out = []
    arch_list = facts.get("arch_list") or []
    if arch_list and not covers(arch_list, (major, minor)):
        out.append(Finding(ERROR, f"{label}: torch {facts['torch']} has no kernels for {sm} "
                                  f"(built for {' '.join(arch_list)})",
                           f"install a torch build whose arch list includes {sm} (a newer CUDA build for "
                           f"new GPUs, an older one for old GPUs)"))
    if native_bf16((major, minor)):
        out.append(Finding(OK, f"{label}: native bf16", detail=True))
    else:
        out.append(Finding(WARNING, f"{label}: no native bf16 (it needs compute capability 8.0; torch "
                                    "emulates it, slowly, and attention falls back to the math kernel)",
                           "use fp16 with a GradScaler: precision \"auto\" picks it (the LoRA recipe's default)"))
    if gpu.get("error"):
        out.append(Finding(ERROR, f"{label}: cannot open it: {gpu['error']}",
                           "another process holds it (nvidia-smi shows which): stop it or choose other GPUs "
                           "with CUDA_VISIBLE_DEVICES"))
    elif gpu.get("free_bytes") is not None:
        free, total = gpu["free_bytes"], gpu["total_bytes"]
        if free < FREE_MEMORY_WARN * total:
            out.append(Finding(WARNING, f"{label}: only {_gib(free)} of {_gib(total)} free",
                               "another process holds the rest (nvidia-smi lists it): stop it, or size the "
                               "lessons with fsdplab estimate --gpu-mem-gib " + f"{free / GIB:.0f}"))
        else:
            out.append(Finding(OK, f"{label}: {_gib(free)} free"))
    return out


def _nccl_findings(facts, world_size) -> list:
    out = []
    if facts.get("nccl"):
        out.append(Finding(OK, f"NCCL {facts['nccl']}", detail=True))
    else:
        out.append(Finding(ERROR, f"torch {facts['torch']} has no NCCL",
                           "install a CUDA build of torch for Linux, which ships NCCL"))
    modes = {row["index"]: row["compute_mode"] for row in facts.get("nvidia_smi") or []}
    exclusive = [i for i, mode in modes.items() if mode.lower().startswith("exclusive")]
    if exclusive:
        out.append(Finding(WARNING, f"GPU(s) {', '.join(exclusive)} in exclusive-process compute mode: one "
                                    "process per GPU, so a kernel that touches CUDA locks its rank out",
                           "keep CUDA out of the notebook's kernel (work on the ranks), or ask for Default "
                           "mode (nvidia-smi -c DEFAULT, as root)"))
    shm = facts.get("shm_bytes")
    several = len(facts.get("gpus") or []) >= 2 or (world_size or 0) >= 2
    if several and shm is not None and shm < SHM_MIN_BYTES:
        out.append(Finding(WARNING, f"/dev/shm is {shm / MIB:.0f} MiB: NCCL's shared-memory transport between "
                                    "ranks can fail or stall with so little (Docker's default is 64 MiB)",
                           "start the container with --shm-size=8g (or --ipc=host)"))
    return out


def _visible_findings(facts, world_size) -> list:
    visible = len(facts.get("gpus") or [])
    smi = facts.get("nvidia_smi") or []
    cvd = facts.get("cuda_visible_devices")
    if cvd is not None and smi and visible < len(smi):
        shown = f"CUDA_VISIBLE_DEVICES={cvd!r} shows {visible} of the machine's {len(smi)} GPUs"
        if world_size and world_size > visible:
            return [Finding(ERROR, f"{shown}, and --world-size {world_size} needs one GPU per rank",
                            f"export CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(min(world_size, len(smi))))}"
                            f" (or unset it), or run --world-size {max(visible, 1)}")]
        return [Finding(WARNING if visible == 0 else OK, shown, "unset CUDA_VISIBLE_DEVICES to use them all"
                        if visible == 0 else "")]
    if world_size and visible and world_size > visible:
        return [Finding(ERROR, f"--world-size {world_size} needs one GPU per rank; {visible} visible (the lab "
                               "would fall back to CPU ranks with gloo)",
                        f"run --world-size {visible}, or run on CPU ranks on purpose: fsdplab run --backend gloo")]
    return []


def _package_findings(facts) -> list:
    from packaging.specifiers import SpecifierSet

    rows = facts.get("packages") or []
    if not rows:
        return [Finding(WARNING, "fsdplab's requirements are unknown: it is not installed as a package",
                        "pip install -e . in the repository (or pip install fsdplab)")]
    out = []
    for row in rows:
        want = f"{row['name']}{row['required']}"
        if row["version"] is None:
            out.append(Finding(ERROR, f"{row['name']} is not installed (fsdplab needs {want})",
                               f"pip install '{want}'"))
        elif row["required"] and not SpecifierSet(row["required"]).contains(row["version"], prereleases=True):
            out.append(Finding(WARNING, f"{row['name']} {row['version']} is outside what fsdplab supports "
                                        f"({want}): lessons may fail",
                               f"pip install '{want}'"))
    if not out:
        out.append(Finding(OK, f"{len(rows)} packages within fsdplab's requirements", detail=True))
    return out


# --- entry points -------------------------------------------------------------------------------------------

def doctor(world_size: int | None = None, *, facts: dict | None = None) -> Report:
    """The preflight as a notebook calls it: the GPU queries run in a child process, so this kernel opens no
    CUDA context before its ranks start. Returns the findings (printed as one line each, with its fix)."""
    return findings(facts if facts is not None else probe_in_subprocess(), world_size)


def doctor_command(args) -> int:
    """`fsdplab doctor`: probe here (this process is the CLI, not a kernel), print, exit 1 when blocked."""
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size is a number of ranks (1 or more), got {args.world_size}.")
    facts = probe()
    report = findings(facts, args.world_size)
    if args.json:
        print(json.dumps({"facts": facts, "findings": [f.__dict__ for f in report], "ok": report.ok}))
        return 0 if report.ok else 1
    print(report)
    blocked = [f for f in report if f.level == ERROR]
    print(f"\n{len(blocked)} problem(s) block the lab; fix them first." if blocked else
          "\nnothing blocks the lab.")
    return 0 if report.ok else 1


if __name__ == "__main__":       # the child process of doctor(): the facts as one JSON line
    if sys.argv[1:] == ["--facts"]:
        print(json.dumps(probe()))
    else:
        sys.exit("usage: python -m fsdplab.runner.doctor --facts (or: fsdplab doctor)")
