"""Lesson 03, section 5: clip_grad_norm_ with CPU offload.

The exercise "03-clip-backend" on the live ranks: the right backend string passes, each wrong one a learner writes
gets a line that says what is wrong and names no right answer. Then the GPU path these CPU ranks cannot run, as if on
one nccl rank with a GPU (`fsdplab._torch_private.fake_cuda`, docs/fake_cuda.md): FSDP2 with CPUOffloadPolicy
gathers CUDA tensors in a group made like init_process_group("nccl") and passes, and the clip's all-reduce of the
offloaded gradients' norm fails there with "No backend type associated with device type cpu"; in the group the
lab makes for nccl ranks (a CPU backend too) it runs.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fsdplab
from fsdplab.exercises import check
from fsdplab.lessons.cpu_offload import clip_sentence, device_backends

ROOT = Path(__file__).resolve().parents[2]


def _not_yet(verdict, *words):
    """Not ok, says `words` in one line, and gives no right answer away."""
    assert not verdict.ok and all(word in verdict.message for word in words), verdict.message
    for answer in ("cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"):
        assert answer not in verdict.message.replace(" ", ""), verdict.message
    assert "\n" not in verdict.message and "Traceback" not in verdict.message, verdict.message


def test_clip_backend_checker(cluster):
    right = check("03-clip-backend", "cpu:gloo,cuda:nccl", cluster=cluster)
    assert right.ok and "every rank clipped by the global norm" in right.message, right.message
    assert "B sent per rank" in right.message, right.message
    if not torch.distributed.is_nccl_available():
        assert "gloo stood in for nccl" in right.message, right.message
    assert check("03-clip-backend", " CUDA:nccl, cpu:gloo", cluster=cluster).ok          # order and case are free
    # the line as the lesson gives it: the clip's all-reduce of a CPU tensor finds no backend
    _not_yet(check("03-clip-backend", "nccl", cluster=cluster),
             "failed on rank 0", "No backend type associated with device type cpu", "no backend for CPU tensors")
    _not_yet(check("03-clip-backend", "cuda:nccl", cluster=cluster), "no backend for CPU tensors")
    _not_yet(check("03-clip-backend", "gloo", cluster=cluster), "the clip ran", "NCCL's work")
    _not_yet(check("03-clip-backend", "cpu:gloo", cluster=cluster),
             "the clip ran", "no backend for CUDA tensors", "device type cuda")
    _not_yet(check("03-clip-backend", "cpu:nccl,cuda:gloo", cluster=cluster), "nccl cannot move CPU tensors")


def test_clip_backend_refuses_what_cannot_run(cluster):
    _not_yet(check("03-clip-backend", "gloo+nccl", cluster=cluster), "neither a backend torch knows")
    _not_yet(check("03-clip-backend", "cpu:gloo,cuda", cluster=cluster), "not a 'device:backend' pair")
    _not_yet(check("03-clip-backend", 3, cluster=cluster), "expected the backend string")
    assert check("03-clip-backend", "cpu:gloo,cuda:nccl", cluster=cluster).ok          # the ranks are fine after it
    _not_yet(check("03-clip-backend", "cpu:gloo,cuda:nccl", cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")


def test_device_backends_reads_the_string_as_torch_does():
    assert device_backends("nccl") == {"cuda": "nccl"}                    # init_process_group("nccl"): CUDA only
    assert device_backends("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert device_backends("cuda:nccl, cpu:gloo") == {"cuda": "nccl", "cpu": "gloo"}
    for wrong, words in (("cpu:gloo,cpu:nccl", "named twice"), ("tpu:gloo", "'cpu' and 'cuda'"),
                         ("cpu:glo", "backends"), ("cpu:", "pair")):
        with pytest.raises(ValueError, match=words):
            device_backends(wrong)


def test_clip_sentence_says_the_numbers():
    collectives = [{"kind": "all_reduce", "sent_bytes": 212.0}]
    text = clip_sentence({"gradient": "DTensor, local shard on cpu"}, 0.0, collectives, 0.31,
                         "ranks 0-1: RuntimeError: No backend type associated with device type cpu  (Cell In[3])")
    assert "212 B per rank (all-reduce)" in text and "0.31x" in text and "0.0e+00" in text, text
    assert "failed: `RuntimeError: No backend type associated with device type cpu`." in text, text


class _OneRank:
    """Stands in for a cluster of 1 rank: the clip all-reduces nothing, so a group without a CPU backend passes."""

    running, broken = True, None

    def run(self, fn, *args):
        return [{"rank": 0, "lab_norm": 1.25, "norm": 1.25, "bytes": 0}]


def test_one_rank_does_not_hide_the_missing_cpu_backend():
    _not_yet(check("03-clip-backend", "nccl", cluster=_OneRank()), "no backend for CPU tensors", "more than one rank")
    assert check("03-clip-backend", "cpu:gloo,cuda:nccl", cluster=_OneRank()).ok


# --- the GPU path, as if on one nccl rank with a GPU ------------------------------------------------------------

def needs_fake_cuda(test):
    """Skipped where fake_cuda cannot or need not run (as in tests/unit/test_fake_cuda.py)."""
    no_compiler = not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
    for mark in (pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU is here: tests/gpu run it for real"),
                 pytest.mark.skipif(no_compiler, reason="fake_cuda builds its CUDA device guard with a C++ compiler")):
        test = mark(test)
    return test

# Rank 0's side of section 5 on a GPU: offloaded shards, FSDP's forward on CUDA tensors, then the clip. Backward does
# not run under fake_cuda, so each parameter gets the gradient FSDP2's offloaded reduce-scatter leaves: a DTensor like
# its sharded parameter, with a CPU local shard. The clip runs under CommCounter: a dispatch mode that lets DTensor
# desugar first, without which the harness's collective guard does not see the all-reduce DTensor launches.
CLIP_ON_GPU_RANK = """
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from fsdplab.comms import CommCounter
cfg = models.TinyConfig()
model = sharding.build_tiny(cfg, device=fsdplab.device())
for unit in [*model.layers, model]:
    fully_shard(unit, mesh=fsdplab.mesh(), offload_policy=CPUOffloadPolicy(pin_memory=False))
assert {p.to_local().device.type for p in model.parameters()} == {"cpu"}
loss = sharding.loss_of(model, models.random_batch(cfg, 2, device=fsdplab.device()))   # all-gathers of CUDA tensors
assert loss.device.type == "cuda", loss.device
model.reshard()
for p in model.parameters():
    p.grad = p.detach().clone()
assert {p.grad.to_local().device.type for p in model.parameters()} == {"cpu"}
with CommCounter(fsdp_labels=False) as comms:
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        outcome = "clipped"
    except RuntimeError as err:
        outcome = str(err).splitlines()[0]
print("GROUP", sorted(d.type for d in dist.group.WORLD._device_types))
print("COLLECTIVES", [c["kind"] for c in comms.records])
print("OUTCOME", outcome)
"""


def _as_gpu_rank(group_backend: str | None) -> dict:
    """Run CLIP_ON_GPU_RANK inside fake_cuda(2) in a fresh interpreter, the group made as `group_backend` says
    (None: the lab's choice for nccl ranks); its GROUP, COLLECTIVES and OUTCOME lines."""
    patch = "" if group_backend is None else (
        f"from fsdplab.runtime import on_rank\non_rank.group_backend = lambda *args, **kwargs: {group_backend!r}\n")
    source = ("import torch, fsdplab\nfrom fsdplab._torch_private.fake_cuda import fake_cuda\n"
              "from fsdplab import models, sharding\n" + patch + "with fake_cuda(2):\n"
              + textwrap.indent(textwrap.dedent(CLIP_ON_GPU_RANK), "    ") + "print('OK')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and "OK" in lines, (done.stdout + done.stderr)[-3000:]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines if " " in line}


@needs_fake_cuda
def test_clip_fails_in_an_nccl_only_group_as_on_a_gpu():
    """init_process_group("nccl"): a group for CUDA tensors only. FSDP's forward passes; the clip fails."""
    seen = _as_gpu_rank("cuda:nccl")
    assert seen["GROUP"] == "['cuda']", seen
    assert seen["OUTCOME"].startswith("No backend type associated with device type cpu"), seen


@needs_fake_cuda
def test_clip_runs_in_the_labs_group_as_on_a_gpu():
    """The group the lab makes for nccl ranks serves CPU tensors too: the clip's one all-reduce runs."""
    seen = _as_gpu_rank(None)
    assert seen["GROUP"] == "['cpu', 'cuda']", seen
    assert seen["OUTCOME"] == "clipped" and seen["COLLECTIVES"] == "['all_reduce']", seen

