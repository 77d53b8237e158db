"""The GPU machine itself: torch's CUDA build, the GPUs, NCCL, and what the lessons need to run."""

import importlib.metadata as md
import importlib.util

import torch

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
    record("bf16_supported", torch.cuda.is_bf16_supported())
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
