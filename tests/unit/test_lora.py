"""The LoRA path: model sizes, adapters, FSDP1's extra gradients (lesson 06), the toy task, and the torchrun
recipe."""

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from fsdplab.lessons import qwen7b_lora as Q
from fsdplab.models import blocks_of, count_params
from fsdplab.recipes import lora as L
from fsdplab.settings import GIB, TrainSetting
from fsdplab.sharding import build_model, make_optimizer


def lora(model, rank=None, targets="all-linear", **kw):
    return build_model(TrainSetting(model=model, lora_rank=rank, lora_targets=targets), **kw)


def test_qwen_sizes_and_lora_counts():
    qwen7b = lora("qwen-7b", 64)
    assert count_params(qwen7b) - count_params(qwen7b, trainable_only=True) == 7_721_324_544
    qwen2 = lora("qwen2-7b", 64, "all-linear")
    assert count_params(qwen2, trainable_only=True) == 161_480_704
    # Base weights frozen, adapters trainable, all on the meta device.
    assert all(("lora_" in n) == p.requires_grad for n, p in qwen2.named_parameters())
    assert {p.device.type for p in qwen2.parameters()} == {"meta"}
    # Attention only: A (r x in) and B (out x r) for q, k, v, o; k/v project to 4 KV heads x 128.
    attn = lora("qwen2-7b", 64, "attention")
    h, kv = 3584, 512
    assert count_params(attn, trainable_only=True) == 28 * 64 * ((h + h) * 2 + (h + kv) * 2)
    full = lora("qwen-7b")
    assert count_params(full, trainable_only=True) == 7_721_324_544


def test_user_mistakes_raise_valueerror():
    with pytest.raises(ValueError, match="lora_targets"):
        lora("tiny", 8, "mlp")
    with pytest.raises(ValueError, match="lora_rank"):
        lora("tiny", 0)
    with pytest.raises(ValueError, match="no trainable"):
        make_optimizer(lora("tiny", device="cpu").requires_grad_(False))
    with pytest.raises(TypeError, match="seq"):
        Q.setting(seq=4096)


def test_checkpointing_wraps_every_layer_and_keeps_gradients():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    config = L.miniature_config()
    task = L.StringTask("reverse")
    ids, labels = task.batch(4, seed=3)
    grads = []
    for ckpt in (False, True, "reentrant"):
        model = build_model(TrainSetting(model=config, lora_rank=8, activation_checkpointing=ckpt), device="cpu",
                            seed=0)
        layers = blocks_of(model)
        assert len(layers) == config.num_hidden_layers
        assert all(isinstance(layer, CheckpointWrapper) for layer in layers) == bool(ckpt)
        # reentrant under a frozen embedding: transformers' input hook, once
        assert len(getattr(model, "_require_grads_hooks", [])) == (ckpt == "reentrant")
        model(input_ids=ids, labels=labels).loss.backward()
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
                      if p.requires_grad})
        opt = make_optimizer(model, lr=1e-3)
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == count_params(model, True)
    for other in grads[1:]:
        assert grads[0].keys() == other.keys()
        for name in grads[0]:
            torch.testing.assert_close(grads[0][name], other[name])


def test_fsdp1_frozen_gradients():
    per_layer_frozen = 4 * 4096 * 4096 + 3 * 4096 + 3 * 4096 * 11008 + 2 * 4096   # q,k,v,o + biases, MLP, norms
    posts = Q.POSTS_SETTING                       # Qwen-7B, 8 ranks, LoRA r=64 all-linear, fp16
    fp32 = Q.fsdp1_frozen_gradients(posts, model_dtype="fp32")
    assert fp32["mixed_units"] == 32
    assert fp32["frozen_params_with_gradients"] == 32 * per_layer_frozen
    assert abs(fp32["persistent_bytes"] - 32 * per_layer_frozen * 4 / 8) <= 32 * 4 * 2   # padding only
    fp16 = Q.fsdp1_frozen_gradients(posts, model_dtype="fp16")
    assert abs(2 * fp16["persistent_bytes"] - fp32["persistent_bytes"]) <= 32 * 4 * 2
    # fp16 unsharded gradient of one layer's frozen weights + its fp32 copy for the reduce-scatter.
    assert fp32["transient_bytes"] == per_layer_frozen * (2 + 4)
    # Adapting only attention still puts the whole layer (MLP included) in a mixed unit.
    attn = Q.fsdp1_frozen_gradients(posts.replace(lora_targets="attention"))
    assert attn["frozen_params_with_gradients"] == fp32["frozen_params_with_gradients"]
    assert Q.fsdp1_frozen_gradients(posts.replace(world_size=16))["persistent_bytes"] < fp32["persistent_bytes"]


def test_string_task_and_tokenizer():
    tok = L.CharTokenizer("abcdef")
    assert tok.decode(tok.answer("fab")) == "fab"
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("xyz")
    for name in L.TASKS:
        task = L.StringTask(name, tok, min_len=2, max_len=4)
        ids, labels = task.batch(32, seed=7)
        assert ids.shape == labels.shape == (32, task.seq_len)
        for row in range(32):
            sep = ids[row].tolist().index(tok.SEP)
            prompt = tok.decode(ids[row, 1:sep])
            answer = [t for t in labels[row].tolist() if t != -100]
            assert len(set(prompt)) == len(prompt) and 2 <= len(prompt) <= 4
            assert tok.decode(answer) == task.solve(prompt) and answer[-1] == tok.EOS
            assert (labels[row, :sep + 1] == -100).all()          # no loss on the prompt
    assert L.StringTask("sort").solve("dab") == "abd"
    with pytest.raises(ValueError):
        L.StringTask("count")


def test_torchrun_script_loads_trains_and_saves_a_mergeable_adapter(tmp_path):
    """The script as a reader runs it: a checkpoint directory, 2 ranks, a few steps, a peft adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = L.miniature_config()
    base_dir, out_dir = tmp_path / "base", tmp_path / "adapter"
    build_model(TrainSetting(model=config), device="cpu", seed=1).save_pretrained(base_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "fsdplab.recipes.lora", "--model-path", str(base_dir), "--lora-rank", "8", "--steps", "3",
           "--batch-size", "4", "--precision", "fp32", "--log-every", "1", "--output-dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first_loss = float(re.search(r"step\s+0\s+loss ([0-9.]+)", proc.stdout).group(1))

    # Step 0 ran the loaded checkpoint with zero-initialised B: exactly the base model's loss on rank 0's batch.
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    ids, labels = L.StringTask("sort").batch(4, seed=0)
    with torch.no_grad():
        assert math.isclose(base(input_ids=ids, labels=labels).loss.item(), first_loss, rel_tol=1e-3)

    saved = load_file(out_dir / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * config.num_hidden_layers          # A and B of 7 linears per layer
    assert all(".default" not in k for k in saved)
    assert any(("lora_B" in k) and v.abs().sum() > 0 for k, v in saved.items())  # trained, not the zero init
    with warnings.catch_warnings():  # peft asks transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out_dir)
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved)
    merged = L.load_merged(base_dir, out_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_model(input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)
    assert isinstance(L.greedy_answer(merged, L.CharTokenizer(), "abc"), str)


def test_fp16_recipe_trains_through_a_loss_scaler(tmp_path):
    """--precision fp16 steps through a GradScaler (its scale in the log); without one fp16 gradients under
    6e-8 flush to zero. The default, auto, is bf16 on CPU ranks."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "fsdplab.recipes.lora", "--model", "tiny", "--lora-rank", "8", "--steps", "2", "--batch-size", "4",
           "--precision", "fp16", "--log-every", "1", "--output-dir", str(tmp_path / "adapter")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    scales = re.findall(r"step\s+\d+\s+loss [0-9.]+\s+loss scale (\S+)", proc.stdout)
    assert scales == ["65536", "65536"], proc.stdout
    assert L.parse_args([]).precision == "auto"
    assert L.parse_args(["--precision", "fp16"]).precision == "fp16"


def test_inputs_go_where_a_sharded_model_computes_not_where_its_shards_live(monkeypatch):
    """Under CPUOffloadPolicy the shards (so `next(model.parameters()).device`) stay on the host while FSDP2
    gathers them to the mesh's GPU: greedy decoding's ids must go to the GPU. A DTensor on a CUDA mesh (a
    fake process group; the shard on meta, standing in for a device other than the GPU) shows the choice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plain = torch.nn.Linear(3, 4)
    assert L.compute_device(plain) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        sharded = torch.nn.Module()
        sharded.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 3, device="meta"),
                                                               DeviceMesh("cuda", torch.arange(2)), [Shard(0)],
                                                               run_check=False))
        assert sharded.weight.device.type == "meta"
        assert L.compute_device(sharded) == torch.device("cuda", 1)
        on_cpu = torch.nn.Module()
        on_cpu.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 3), DeviceMesh("cpu", torch.arange(2)),
                                                              [Replicate()], run_check=False))
        assert L.compute_device(on_cpu) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_dashboard_fits_and_fsdp1_extra():
    dash = Q.lora_dashboard(gpu_gib=24.0)
    posts = dash.result
    assert posts["fits"] and posts["fsdp1_extra_bytes"] == 0 and posts["setting"] == Q.POSTS_SETTING
    dash.set(api="FSDP1 use_orig_params")
    extra = Q.fsdp1_frozen_gradients(Q.POSTS_SETTING)["extra_peak_bytes"]
    assert dash.result["fsdp1_extra_bytes"] == extra
    assert dash.result["total_gib"] * GIB == pytest.approx(posts["total_gib"] * GIB + extra)
    dash.set(api="FSDP2", seq_len=8192, batch_size=8, activation_checkpointing=False)
    assert not dash.result["fits"] and dash.result["total_gib"] > 24
    assert "does NOT fit" in dash.figure.axes[0].get_title()


def test_tiny_twin_config_saves_with_one_layer_type_per_layer(tmp_path):
    from fsdplab.models import causal_lm, tiny_twin

    twin = tiny_twin("qwen-7b", num_layers=3)
    assert len(twin.layer_types) == 3
    causal_lm(twin, device="cpu").save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists()
