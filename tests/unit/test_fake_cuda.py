"""The lessons' rank code as if on one nccl rank with a GPU, on a CPU-only torch (fsdplab._torch_private.fake_cuda).

Each case runs a code path in a fresh process as rank 0 of 2 fake nccl ranks: fsdplab.device() is cuda:0, the
mesh is a cuda mesh, tensors are fake. It passes when no op mixes a CUDA tensor with a CPU tensor and no CPU
tensor reaches a collective of a group without a CPU backend (init_process_group("nccl") has none).

What this cannot catch: kernels and their numerics, values (fake tensors hold none: every check of a number
passes), backward and the optimizer's step (skipped: gradients stay None), NCCL's asynchrony and hangs, what
ranks other than 0 do, and memory. A fresh process per case: the fake CUDA device guard cannot be unloaded.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU is here: tests/gpu run the real thing"),
    pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")),
                       reason="fake_cuda builds a 3-line CUDA device guard and needs a C++ compiler (c++/g++)"),
]

PRELUDE = """
import torch, fsdplab
from fsdplab._torch_private.fake_cuda import fake_cuda
from fsdplab import models, sharding
"""


def run_as_cuda(*parts: str, timeout: float = 60) -> str:
    """Run the code `parts` inside `with fake_cuda(2):` in a fresh interpreter; fail with its traceback's last lines."""
    source = (PRELUDE + "with fake_cuda(2):\n" + textwrap.indent("".join(textwrap.dedent(p) for p in parts), "    ")
              + "\nprint('OK')\n")
    source_root = os.environ.get("FSDPLAB_SOURCE", str(ROOT))   # another checkout of the code under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source_root,
                                                                   os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=source_root)
    lines = [line.removeprefix("[rank0]: ") for line in (done.stdout + done.stderr).splitlines()]
    if done.returncode != 0 or "OK" not in lines:
        tail = "\n".join(line for line in lines if "File " in line or "Error" in line or "error" in line)
        pytest.fail(f"as if on cuda, the code failed (exit {done.returncode}):\n{tail[-3000:]}", pytrace=False)
    return done.stdout


SHARDED_TINY = """
cfg = models.TinyConfig()
model = sharding.build_tiny(cfg)
sharding.apply_fsdp(model, fsdplab.mesh())
optimizer = sharding.make_optimizer(model)
"""


def test_the_harness_catches_both_kinds_of_device_bug():
    """It can fail: a CUDA/CPU mix raises, and a CPU tensor in a collective of a cuda-only group raises."""
    run_as_cuda("""
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
        try:
            torch.ones(3, device="cuda") + torch.ones(3)
            raise AssertionError("a cuda + cpu add passed")
        except FakeTensorDeviceMismatchError:
            pass
        for fn in (lambda: torch.equal(torch.ones(3, device="cuda"), torch.ones(3)),):
            try:
                fn()
                raise AssertionError("torch.equal of cuda and cpu passed")
            except RuntimeError as e:
                assert "same device" in str(e), e
        group = dist.new_group([0, 1], backend=dist.get_backend())
        group._device_types  # the fake group's devices, as the runtime chooses them for nccl
    """)
    # A group made like init_process_group("nccl"): cuda only.
    run_as_cuda("""
        import torch.distributed as dist
        from fsdplab._torch_private import fake_cuda as fc
        group = dist.new_group([0, 1], backend=fc._register_backend(["cuda"]))
        dist.all_reduce(torch.ones(4, device="cuda"), group=group)
        try:
            dist.all_reduce(torch.ones(4), group=group)
            raise AssertionError("a cpu tensor passed a cuda-only collective")
        except RuntimeError as e:
            assert "No backend type associated with device type cpu" in str(e), e
    """)


def test_rank_helpers_answer_cuda():
    run_as_cuda("""
        assert fsdplab.device() == torch.device("cuda", 0), fsdplab.device()
        assert fsdplab.mesh().device_type == "cuda" and fsdplab.backend() == "nccl"
        with torch.device("meta"):
            model = models.TinyTransformer(models.TinyConfig())
        sharding.apply_fsdp(model, fsdplab.mesh())
        model.to_empty(device=fsdplab.device())
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        tokens, targets = models.random_batch(models.TinyConfig(), device=fsdplab.device())
        assert model(tokens).device.type == "cuda"
    """)


def test_lesson_00_collective_on_a_cpu_tensor():
    """Lesson 00's `hello` / `all_gather` cells: collectives on torch.ones(...) made on the CPU, in the group the
    runtime makes for nccl (nccl alone has no CPU backend)."""
    run_as_cuda("""
        import torch.distributed as dist
        t = torch.ones(4) * (fsdplab.rank() + 1)
        dist.all_reduce(t)
        out = [torch.zeros(4) for _ in range(fsdplab.world_size())]
        dist.all_gather(out, t)
    """)


def test_train_step_with_random_batch():
    """Lesson 10's straggler cell, lesson 02's traced_step: a CPU-built model sharded to cuda, the default batch."""
    run_as_cuda(SHARDED_TINY, """
        loss = sharding.train_step(model, optimizer, models.random_batch(cfg))
        assert loss.device.type == "cuda"
    """)


def test_checkpoint_train_steps_and_equal_state():
    """Lesson 05: ck.train_steps with its default device, then equal_state of a rank's (cuda) state and a CPU one."""
    run_as_cuda(SHARDED_TINY, """
        from fsdplab import checkpoint as ck
        ck.train_steps(model, optimizer, cfg, steps=1)
        plain = {"w": torch.ones(3, 4)}
        rows = ck.equal_state(plain, {"w": torch.ones(3, 4, device="cuda")})
        assert rows[0][0] == "w"
    """)


def test_training_loop_helpers():
    """Lesson 09 cell 9: shard_agreement of a cuda-sharded model against a plain reference built on the CPU."""
    run_as_cuda("""
        from fsdplab.lessons import training_loop as tl
        cfg = models.TinyConfig()
        reference = sharding.build_tiny(cfg)
        model = sharding.build_tiny(cfg)
        sharding.apply_fsdp(model, fsdplab.mesh())
        tl.shard_agreement(model, reference)
        tl.grad_gap(model, reference)
        tokens, targets = tl.global_batch(cfg, step=0, size=4)
        micro = tl.split_batch((tokens, targets), fsdplab.rank(), fsdplab.world_size(), 1, device=fsdplab.device())
        tl.next_token_loss(model, *micro[0])
    """)


def test_scaling_out_held_rows():
    """Lesson 07: which rows a rank's cuda shard holds, against the full weight copied before sharding (CPU)."""
    run_as_cuda("""
        from fsdplab.lessons.scaling_out import held_rows
        full = torch.arange(12.0).reshape(4, 3)
        local = full[:2].to(fsdplab.device())
        held_rows(local, full)
    """)


def test_comms_toy_step_and_count_train_step():
    """Lessons 01/02's counted steps: comms.toy_step with its default device, and count_train_step."""
    run_as_cuda(SHARDED_TINY, """
        from fsdplab import comms
        comms.toy_step(model, optimizer, cfg, batch_size=2, seed=0)
        comms.count_train_step("full_shard", batch_size=2)
    """)


def test_lesson_12_rank_code():
    """Lesson 12: the LoRA twin built on the rank's device with an NF4 base, its batch, the planted dtype model
    and the checkers' rank functions (their models and batches on the rank's device)."""
    run_as_cuda("""
        from peft import LoraConfig, get_peft_model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from fsdplab.lessons import lora_qlora as lesson
        from fsdplab.nf4 import apply_nf4
        config = lesson.twin_config(num_layers=2, vocab_size=512)
        batch = lesson.token_batch(config, 2, 16, seed=fsdplab.rank(), device=fsdplab.device())
        model = models.causal_lm(config, device=fsdplab.device(), dtype=torch.bfloat16)
        apply_nf4(model, fsdplab.world_size())
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in models.blocks_of(model):
            fully_shard(block, mesh=fsdplab.mesh(), mp_policy=policy)
        fully_shard(model, mesh=fsdplab.mesh(), mp_policy=policy)
        assert model(**batch).loss.device.type == "cuda"
        planted = lesson.planted_dtype_model(config, 4)
        assert {p.device.type for p in planted.parameters()} == {"cuda"}

        def fix(model):
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
            return model

        out = lesson.try_uniform(fix, 256, 4)
        assert "loss" in out, out
        assert "loss" in lesson.qlora_loss(config, torch.bfloat16, 300.0, 4, 2, 16)
    """, timeout=120)


def test_lesson_15_rank_code():
    """Lesson 15: shard and gather a parameter on the rank's device, the four reference hooks around a model built
    there (one forward: gathered, then freed), and section 1's checker run with the reference."""
    run_as_cuda("""
        from fsdplab.lessons import build_fsdp as lesson
        from fsdplab.models import blocks_of, random_batch
        full = torch.arange(15.0, device=fsdplab.device()).view(5, 3)
        piece = lesson.shard(full)
        assert piece.device.type == "cuda" and lesson.gather(piece, full.shape).device.type == "cuda"
        cfg = models.TinyConfig(dim=32, num_layers=2, seq_len=16)
        model = sharding.build_tiny(cfg, seed=0, device=fsdplab.device())
        lesson.apply_my_fsdp(model, blocks_of(model), lesson.REFERENCE)
        tokens, targets = random_batch(cfg, batch_size=2, seed=0, device=fsdplab.device())
        assert model(tokens).device.type == "cuda"
        out = lesson.try_shard_gather((lesson.shard, lesson.gather))
        assert not out["problems"], out
    """, timeout=120)


def test_lesson_14_rank_code():
    """Lesson 14: the reference ring on a tensor of the rank's device, the tiny model built there and wrapped by
    the reference DDP and the reference ZeRO-1, one forward each (the harness runs no backward; torch's own DDP
    reads its parameters' data when built, which fake tensors do not have)."""
    run_as_cuda("""
        import torch.distributed as dist
        from fsdplab.lessons import build_ddp as lesson
        from fsdplab.models import random_batch
        x = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(fsdplab.device())
        assert lesson.reference_ring(x).device.type == "cuda"
        cfg = lesson.ddp_config()
        batch = random_batch(cfg, batch_size=2, seed=0, device=fsdplab.device())
        model = sharding.build_tiny(cfg, seed=0, device=fsdplab.device())
        assert sharding.loss_of(lesson.ReferenceDDP(model, 16384), batch).device.type == "cuda"
        zero = lesson.ReferenceZeRO1(list(model.parameters()), torch.optim.AdamW, lr=1e-2)
        assert sharding.loss_of(model, batch).device.type == "cuda"
    """, timeout=120)
