"""`fsdplab doctor`: every finding on made-up machines (torch.cuda monkeypatched, a fake nvidia-smi on PATH),
the exit code, and the notebook's call, which must leave CUDA to a child process."""

import json
import os
import stat
from types import SimpleNamespace

import pytest
import torch

from fsdplab.runner.cli import main
from fsdplab.runner import doctor as D
from fsdplab.settings import GIB, MIB

T4 = ("Tesla T4", (7, 5), 15 * GIB)
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB)
CUDA_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def fake_gpus(monkeypatch, gpus, *, arch_list=CUDA_ARCHS, free=None, busy=(), nccl=(2, 21, 5), cuda="12.6"):
    """torch.cuda as a CUDA build with `gpus` [(name, capability, bytes)] visible would answer."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))

    def properties(index):
        name, (major, minor), total = gpus[index]
        return SimpleNamespace(name=name, major=major, minor=minor, total_memory=total)

    def mem_get_info(index):
        if index in busy:
            raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")
        total = gpus[index][2]
        return (total if free is None else free[index]), total

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: gpus[0][1] >= (8, 0) or including_emulation)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)


def fake_nvidia_smi(monkeypatch, tmp_path, rows):
    """An nvidia-smi on PATH that answers the doctor's query with `rows` [(name, compute mode, MiB)]."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    lines = "\n".join(f"{i}, {name}, {mode}, {mib}, 0" for i, (name, mode, mib) in enumerate(rows))
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{lines}\nEOF\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine without nvidia-smi, CUDA_VISIBLE_DEVICES unset and 16 GiB of /dev/shm, to change per test."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(D.shutil, "which", lambda name: None if name == "nvidia-smi" else _which(name))
    monkeypatch.setattr(D, "_shm_bytes", lambda path="/dev/shm": 16 * GIB)
    return monkeypatch


_which = D.shutil.which


def with_smi(monkeypatch, tmp_path, rows):
    monkeypatch.setattr(D.shutil, "which", _which)
    fake_nvidia_smi(monkeypatch, tmp_path, rows)


def levels(report, level):
    return [f for f in report if f.level == level]


def test_a_t4_pair_gets_fp16_with_a_grad_scaler_and_a_small_shm_warning(machine, tmp_path):
    fake_gpus(machine, [T4, T4])
    with_smi(machine, tmp_path, [("Tesla T4", "Default", 15360)] * 2)
    machine.setattr(D, "_shm_bytes", lambda path="/dev/shm": 64 * MIB)
    facts = D.probe()
    assert [g["capability"] for g in facts["gpus"]] == [[7, 5], [7, 5]] and facts["nccl"] == "2.21.5"
    assert facts["bf16_torch"] is False                   # asked without emulation, which says True on a T4
    report = D.findings(facts, world_size=2)
    bf16 = [f for f in levels(report, D.WARNING) if "no native bf16" in f.text]
    assert len(bf16) == 2 and "GPU 0 (Tesla T4, sm_75, 15.0 GiB)" in bf16[0].text
    assert bf16[0].fix.startswith("use fp16 with a GradScaler")
    [shm] = [f for f in levels(report, D.WARNING) if "/dev/shm" in f.text]
    assert "64 MiB" in shm.text and "--shm-size" in shm.fix
    assert report.ok                                      # warnings: the lab still runs
    assert all(len(f.lines()) == (2 if f.fix else 1) for f in report)   # one line, and one for the fix


def test_cuda_visible_devices_shorter_than_the_world_size_is_one_error(machine, tmp_path, capsys):
    fake_gpus(machine, [H100])                            # CUDA_VISIBLE_DEVICES=0 leaves torch one GPU
    with_smi(machine, tmp_path, [("NVIDIA H100 80GB HBM3", "Default", 81559)] * 2)
    machine.setenv("CUDA_VISIBLE_DEVICES", "0")
    [error] = levels(D.findings(D.probe(), world_size=2), D.ERROR)
    assert error.text == ("CUDA_VISIBLE_DEVICES='0' shows 1 of the machine's 2 GPUs, and --world-size 2 needs "
                          "one GPU per rank")
    assert error.fix.startswith("export CUDA_VISIBLE_DEVICES=0,1")
    assert main(["doctor", "--world-size", "2"]) == 1     # it blocks: non-zero exit
    out = capsys.readouterr().out
    assert "error:   CUDA_VISIBLE_DEVICES='0'" in out and "1 problem(s) block the lab" in out
    assert main(["doctor", "--world-size", "1"]) == 0


def test_more_ranks_than_gpus_without_cuda_visible_devices(machine, tmp_path):
    fake_gpus(machine, [H100])
    with_smi(machine, tmp_path, [("NVIDIA H100 80GB HBM3", "Default", 81559)])
    [error] = levels(D.findings(D.probe(), world_size=4), D.ERROR)
    assert "--world-size 4 needs one GPU per rank; 1 visible" in error.text and "--backend gloo" in error.fix


def test_a_cpu_machine_says_so_in_one_line(machine, capsys):
    machine.setattr(torch.cuda, "is_available", lambda: False)
    report = D.findings(D.probe(), world_size=2)
    assert report.ok and not report.problems()
    assert report.brief() == "ok:      no GPU found: the lab runs CPU ranks with gloo (torch " + torch.__version__ + ")"
    assert main(["doctor", "--world-size", "2"]) == 0
    assert "nothing blocks the lab" in capsys.readouterr().out


def test_a_cpu_build_of_torch_on_a_gpu_machine_blocks(machine, tmp_path):
    machine.setattr(torch.cuda, "is_available", lambda: False)
    machine.setattr(torch.version, "cuda", None)
    with_smi(machine, tmp_path, [("Tesla T4", "Default", 15360)])
    [error] = levels(D.findings(D.probe()), D.ERROR)
    assert "nvidia-smi lists 1 GPU(s) but torch" in error.text and "CPU build" in error.text
    assert "CUDA build of torch" in error.fix


def test_a_gpu_newer_than_the_build_blocks_and_ptx_covers_newer_gpus(machine):
    blackwell = ("NVIDIA RTX PRO 6000", (12, 0), 96 * GIB)
    fake_gpus(machine, [blackwell])
    [error] = levels(D.findings(D.probe()), D.ERROR)
    assert "has no kernels for sm_120" in error.text and "sm_120" in error.fix
    assert D.covers(["sm_80", "sm_90a"], (9, 0)) and D.covers(["sm_80"], (8, 6))      # same major, newer minor
    assert not D.covers(["sm_86"], (8, 0)) and not D.covers(["sm_80"], (9, 0))
    assert D.covers(["sm_80", "compute_90"], (12, 0))                               # PTX, compiled by the driver


def test_a_busy_or_full_gpu_and_exclusive_process_mode(machine, tmp_path):
    fake_gpus(machine, [H100, H100], free=[10 * GIB, None], busy=(1,))
    with_smi(machine, tmp_path, [("NVIDIA H100 80GB HBM3", "Exclusive_Process", 81559)] * 2)
    report = D.findings(D.probe(), world_size=2)
    [busy] = levels(report, D.ERROR)
    assert busy.text.startswith("GPU 1 (") and "busy or unavailable" in busy.text
    warnings = [f.text for f in levels(report, D.WARNING)]
    assert any("GPU 0 (" in w and "only 10.0 GiB of 80.0 GiB free" in w for w in warnings)
    assert any("GPU(s) 0, 1 in exclusive-process compute mode" in w for w in warnings)
    assert not report.ok


def test_an_h100_with_room_has_nothing_to_fix(machine, tmp_path):
    fake_gpus(machine, [H100, H100])
    with_smi(machine, tmp_path, [("NVIDIA H100 80GB HBM3", "Default", 81559)] * 2)
    report = D.findings(D.probe(), world_size=2)
    assert report.ok and not report.problems()
    assert "ok:      GPU 1 (NVIDIA H100 80GB HBM3, sm_90, 80.0 GiB): 80.0 GiB free" in report.brief()
    assert "NCCL 2.21.5" in str(report) and "NCCL" not in report.brief()     # a detail for the CLI only


def test_packages_against_fsdplab_requirements(machine):
    facts = D.probe()
    torch_row = next(row for row in facts["packages"] if row["name"] == "torch")
    assert torch_row["version"] == torch.__version__ and torch_row["required"].startswith(">=")
    assert all(row["name"] not in ("pytest", "playwright") for row in facts["packages"])    # extras are not needed
    facts["packages"] = [{"name": "torch", "required": ">=2.13", "version": "2.11.0+cu130"},
                         {"name": "peft", "required": ">=0.21", "version": None}]
    report = D.findings(facts)
    [old] = levels(report, D.WARNING)
    assert old.text.startswith("torch 2.11.0+cu130 is outside what fsdplab supports (torch>=2.13)")
    [missing] = levels(report, D.ERROR)
    assert (missing.text == "peft is not installed (fsdplab needs peft>=0.21)"
            and missing.fix == "pip install 'peft>=0.21'")


def test_the_notebook_call_leaves_cuda_to_a_child_process(machine):
    """doctor() in a kernel: any CUDA query in this process would raise here, yet the report comes back."""
    def no_cuda_here(*args, **kwargs):
        raise AssertionError("the kernel itself asked CUDA")

    for name in ("is_available", "device_count", "get_device_properties", "mem_get_info", "init"):
        machine.setattr(torch.cuda, name, no_cuda_here)
    report = D.doctor(world_size=2)
    assert report.ok and report.brief().startswith("ok:      no GPU found: the lab runs CPU ranks with gloo")


def test_json_output_and_a_bad_world_size(machine, capsys):
    machine.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["facts"]["gpus"] == [] and data["findings"][0]["text"].startswith("no GPU found")
    assert main(["doctor", "--world-size", "0"]) == 2
    assert "--world-size is a number of ranks" in capsys.readouterr().err

