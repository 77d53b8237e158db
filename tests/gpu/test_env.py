"""The GPU machine itself: torch's CUDA build, the GPUs, NCCL, and what the lessons need to run."""

import importlib
import importlib.metadata as md
import importlib.util
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# What tests/gpu/test_memory.py, test_offload.py and the recipe import besides torch.
MODEL_MODULES = ("transformers", "peft", "safetensors")


def floor_of(name: str, pyproject: Path = ROOT / "pyproject.toml") -> tuple | None:
    """The `name>=X.Y` floor of pyproject's dependencies, as a tuple of ints (None if it has none)."""
    found = re.search(rf'"{re.escape(name)}\s*>=\s*([\d.]+)', pyproject.read_text())
    return tuple(int(x) for x in found.group(1).split(".")) if found else None


def release_of(version: str) -> tuple:
    """'2.11.0+cu130' -> (2, 11, 0)."""
    return tuple(int(x) for x in re.match(r"[\d.]+", version).group(0).rstrip(".").split("."))

# What `python -m fsdplab run` imports: papermill and the kernel stack, ipyparallel for the ranks.
LESSON_MODULES = ("papermill", "nbclient", "nbformat", "jupyter_client", "ipykernel", "IPython", "ipyparallel",
                  "cloudpickle", "zmq", "tornado", "ipywidgets", "matplotlib")
PACKAGES = ("torch", "transformers", "peft", "accelerate", "numpy", "matplotlib", "papermill", "ipykernel",
            "ipyparallel", "cloudpickle", "ipywidgets", "psutil")


def test_gpus(record):
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1)})
    record("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    record("gpus", gpus)
    record("bf16_supported", torch.cuda.is_bf16_supported())     # True on a T4 too: it counts emulation
    record("bf16_native", [tuple(map(int, g["capability"].split("."))) >= (8, 0) for g in gpus])
    assert gpus and all(g["free_gib"] > 1 for g in gpus), gpus


def test_nccl(record):
    assert torch.distributed.is_nccl_available(), "this torch build has no NCCL: fsdplab.Cluster needs it on GPUs"
    version = torch.cuda.nccl.version()
    record("nccl", ".".join(map(str, version)) if isinstance(version, tuple) else str(version))


def test_lesson_packages(record):
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    record("packages", versions)
    missing = [m for m in LESSON_MODULES if importlib.util.find_spec(m) is None]
    assert not missing, (f"missing for the lessons: {', '.join(missing)}; install the wheels in .whl/ "
                         "(scripts/fetch_gpu_wheels.sh fetches them, scripts/gpu_check.sh installs them)")


def test_python3_kernel(record):
    from jupyter_client.kernelspec import KernelSpecManager

    argv = KernelSpecManager().get_kernel_spec("python3").argv   # raises NoSuchKernel without one
    record("python3_kernel", argv[0])


def test_torch_at_the_floor(record):
    floor = floor_of("torch")
    record("torch_floor", ".".join(map(str, floor)) if floor else None)
    assert floor, "pyproject.toml names no torch>= floor"
    have = release_of(torch.__version__)
    assert have[:len(floor)] >= floor, (f"torch {torch.__version__} is older than the lab's floor torch>="
                                        f"{'.'.join(map(str, floor))} (pyproject.toml): install torch>="
                                        f"{'.'.join(map(str, floor))} built for this machine's CUDA")


def test_model_packages_import(record):
    versions, broken = {}, {}
    for name in MODEL_MODULES:
        try:
            module = importlib.import_module(name)
            versions[name] = getattr(module, "__version__", None)
        except Exception as err:  # noqa: BLE001 - each broken package named, with its error
            broken[name] = f"{type(err).__name__}: {err}"
    record("model_packages", versions)
    assert not broken, f"test_memory, test_offload and the recipe need these: {broken}"
