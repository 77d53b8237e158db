"""fsdplab.checkpoint: atomic files, the `latest` protocol, bit-exact comparisons, full and sharded (DCP)
save/load on 2 real gloo ranks, resharding 2 -> 1 and 1 -> 2, a crash mid-save, the posts' hanging
safe_save, and an export that plain transformers loads."""

import sys

import cloudpickle
import pytest
import torch

import fsdplab
from fsdplab import checkpoint as ck
from fsdplab.models import TinyConfig

# The rank functions below travel by value: the ranks cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TinyConfig(dim=32, num_layers=2, seq_len=16)


# --- no ranks needed ---------------------------------------------------------------------------------

def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "latest"
    ck.atomic_write_bytes(target, b"step-1")
    ck.atomic_write_bytes(target, b"step-22")
    assert target.read_bytes() == b"step-22"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def _fake_checkpoint(root, name, complete=True):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (folder / ".metadata").write_bytes(b"m")
    return folder


def test_latest_checkpoint_ignores_tmp_and_unfinished(tmp_path):
    assert ck.latest_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, "step-2")
    _fake_checkpoint(tmp_path, "step-10")
    _fake_checkpoint(tmp_path, "step-30.tmp")                 # crashed before the rename
    _fake_checkpoint(tmp_path, "step-20", complete=False)     # DCP never finished
    assert ck.latest_checkpoint(tmp_path).name == "step-10"   # numeric order, not text order
    ck.atomic_write_bytes(tmp_path / "latest", b"step-2")
    assert ck.latest_checkpoint(tmp_path).name == "step-2"    # the pointer wins when it is valid
    ck.atomic_write_bytes(tmp_path / "latest", b"step-30.tmp")
    assert ck.latest_checkpoint(tmp_path).name == "step-10"   # ... and is ignored when it is not


def test_equal_state_is_bit_exact():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    assert all(row[-1] for row in ck.equal_state(a, {k: v.clone() for k, v in a.items()}))
    flipped = a["w"].clone()
    flipped.view(torch.int32)[0, 1] ^= 1                      # one bit of one float
    rows = {r[0]: r[-1] for r in ck.equal_state(a, {"w": flipped, "b": a["b"]})}
    assert rows == {"b": True, "w": False}
    assert not ck.equal_state(a, {"w": a["w"].double(), "b": a["b"]})[1][-1]   # dtype counts
    assert ck.equal_state(a, {"w": a["w"]}) == [("b", None, None, False), ("w", (2, 3), "float32", True)]
    prints = ck.state_fingerprint(a)
    assert prints == ck.state_fingerprint({k: v.clone() for k, v in a.items()})
    assert prints != ck.state_fingerprint({"w": flipped, "b": a["b"]})


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_save_full_round_trip_in_one_process(tmp_path, name):
    model, _ = ck.sharded_tiny(CFG, seed=0)
    ck.save_full(model, tmp_path / name)
    other, _ = ck.sharded_tiny(CFG, seed=1)
    assert not all(r[-1] for r in ck.equal_state(ck.full_state(model), ck.full_state(other)))
    ck.load_full(other, tmp_path / name)
    assert all(r[-1] for r in ck.equal_state(ck.full_state(model), ck.full_state(other)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]   # no temp file left behind


def test_sharded_round_trip_in_one_process_keeps_optimizer(tmp_path):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.train_steps(model, opt, CFG, 2, global_batch=4)
    ck.save_sharded(model, opt, tmp_path, step=2)
    assert (tmp_path / "latest").read_text() == "step-2" and not (tmp_path / "step-2.tmp").exists()
    other, other_opt = ck.sharded_tiny(CFG, seed=1)
    assert ck.load_sharded(other, other_opt, tmp_path) == 2
    rows = ck.equal_state(ck.full_state(model, opt), ck.full_state(other, other_opt))
    assert all(r[-1] for r in rows) and any(r[0].endswith(".exp_avg_sq") for r in rows)
    assert ck.train_steps(model, opt, CFG, 2, start_step=2, global_batch=4) == \
        ck.train_steps(other, other_opt, CFG, 2, start_step=2, global_batch=4)


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.save_sharded(model, opt, tmp_path, step=1)
    ck.train_steps(model, opt, CFG, 1, global_batch=4)
    ck.save_sharded(model, opt, tmp_path, step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    other, other_opt = ck.sharded_tiny(CFG, seed=1)
    ck.load_sharded(other, other_opt, tmp_path)
    assert all(r[-1] for r in ck.equal_state(ck.full_state(model), ck.full_state(other)))


def test_user_mistakes_raise_value_error(tmp_path):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        ck.load_sharded(model, opt, tmp_path)
    with pytest.raises(ValueError, match="root="):
        ck.load_sharded(model, opt)
    with pytest.raises(ValueError, match="step must be"):
        ck.save_sharded(model, opt, tmp_path, step=-1)
    with pytest.raises(ValueError, match="config"):
        ck.export_pretrained(model, tmp_path / "export")
    with pytest.raises(ValueError, match="write_shards"):
        ck.commit(tmp_path, step=5)


def test_fsdp1_default_is_full_state_dict():
    # Claim 13's "fix" is FSDP1's default; if torch moves this, the lesson's text must change too.
    defaults = ck.fsdp1_state_dict_defaults()
    assert defaults == {"default state_dict_type": "FULL_STATE_DICT", "FullStateDictConfig().offload_to_cpu": False,
                        "FullStateDictConfig().rank0_only": False}


def test_export_loads_in_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdplab.models import hf_config

    model = ck.sharded_hf(hf_config("tiny"), seed=0)
    ck.export_pretrained(model, tmp_path / "tiny")
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "tiny.tmp").exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    tokens = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=tokens).logits, model(input_ids=tokens).logits)


# --- on 2 gloo ranks ------------------------------------------------------------------------------------

def _state_dict_layout():
    model, _ = ck.sharded_tiny(CFG, seed=0)
    v = model.state_dict()["tok_emb.weight"]
    return type(v).__name__, tuple(v.shape), tuple(v.to_local().shape), repr(v.placements[0])


def test_fsdp2_state_dict_holds_dtensor_shards(cluster):
    assert cluster.run(_state_dict_layout, quiet=True) == [("DTensor", (256, 32), (128, 32), "Shard(dim=0)")] * 2


def _save_full_on_ranks(path):
    model, _ = ck.sharded_tiny(CFG, seed=0)
    gathered = ck.full_model_state(model)
    ck.save_full(model, path)
    other, _ = ck.sharded_tiny(CFG, seed=1)
    ck.load_full(other, path)
    return len(gathered), ck.full_state(model), ck.full_state(other)


def test_save_full_every_rank_gathers_rank0_writes(cluster, tmp_path):
    out = cluster.run(_save_full_on_ranks, str(tmp_path / "full.safetensors"), quiet=True)
    (n0, saved, loaded), (n1, _, _) = out
    assert n0 == 2 + 12 * CFG.num_layers + 3 and n1 == 0          # the full dict lives on rank 0 only
    assert all(r[-1] for r in ck.equal_state(saved, loaded))
    from safetensors.torch import load_file

    on_disk = {f"model.{k}": v for k, v in load_file(tmp_path / "full.safetensors").items()}
    assert all(r[-1] for r in ck.equal_state(on_disk, saved))


def _save_full_to(path):
    model, _ = ck.sharded_tiny(CFG, seed=0)
    ck.save_full(model, path)


def test_a_failed_write_on_rank0_raises_on_every_rank(cluster, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(fsdplab.RankError) as err:   # not a RankHang: rank 1 learns that rank 0 failed
        cluster.run(_save_full_to, str(tmp_path / "a_file" / "model.safetensors"), timeout=60, quiet=True)
    assert sorted(err.value.errors) == [0, 1]


def _train_save_resume(root, steps):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.train_steps(model, opt, CFG, steps, global_batch=4)
    ck.save_sharded(model, opt, root, step=steps)
    saved = ck.full_state(model, opt)
    after = ck.train_steps(model, opt, CFG, steps, start_step=steps, global_batch=4)
    other, other_opt = ck.sharded_tiny(CFG, seed=1)
    step = ck.load_sharded(other, other_opt, root)
    resumed = ck.train_steps(other, other_opt, CFG, steps, start_step=step, global_batch=4)
    return step, saved, after, resumed


def test_dcp_resume_and_reshard_to_one_process(cluster, tmp_path):
    [(step, saved, after, resumed), (_, _, after1, resumed1)] = cluster.run(
        _train_save_resume, str(tmp_path), 3, quiet=True)
    assert step == 3 and resumed == after and after1 == after   # bit-identical losses on every rank
    assert sorted(ck.shard_bytes(tmp_path / "step-3")) == [0, 1]
    # Reshard 2 -> 1: load the 2-rank checkpoint right here, without a process group.
    model, opt = ck.sharded_tiny(CFG, seed=2)
    assert ck.load_sharded(model, opt, tmp_path) == 3
    rows = ck.equal_state(saved, ck.full_state(model, opt))
    assert len(rows) == 4 * len(ck.full_state(model)) and all(r[-1] for r in rows)   # params + 3 AdamW states
    single = ck.train_steps(model, opt, CFG, 3, start_step=3, global_batch=4)
    assert max(abs(a - b) for a, b in zip(single, after)) < 1e-4


def _load_on_ranks(root):
    model, opt = ck.sharded_tiny(CFG, seed=5)
    return ck.load_sharded(model, opt, root), ck.full_state(model, opt)


def test_reshard_one_process_to_two_ranks(cluster, tmp_path):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.train_steps(model, opt, CFG, 2, global_batch=4)
    ck.save_sharded(model, opt, tmp_path, step=2)
    (step, loaded), (step1, empty) = cluster.run(_load_on_ranks, str(tmp_path), quiet=True)
    assert step == step1 == 2 and empty == {}
    assert all(r[-1] for r in ck.equal_state(ck.full_state(model, opt), loaded))


def test_train_steps_needs_a_divisible_batch(cluster):
    with pytest.raises(fsdplab.RankError, match="global_batch=3"):
        cluster.run(lambda: ck.train_steps(*ck.sharded_tiny(CFG), CFG, 1, global_batch=3), quiet=True)


def test_posts_safe_save_hangs_and_restart_recovers(cluster, tmp_path):
    cluster.execute("from fsdplab import checkpoint as ck\nfrom fsdplab.models import TinyConfig\n"
                    "model, opt = ck.sharded_tiny(TinyConfig(dim=32, num_layers=2, seq_len=16))", quiet=True)
    safe_save = ("if rank() == 0:\n"
                 "    full = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
                 f"    torch.save(full, {str(tmp_path / 'x.pt')!r})")
    with pytest.raises(fsdplab.RankHang) as hang:
        cluster.execute(safe_save, timeout=4, quiet=True)
    assert hang.value.ranks == [0] and "full_tensor" in hang.value.stacks[0]
    assert not (tmp_path / "x.pt").exists()
    cluster.restart()
    assert cluster.run(_state_dict_layout, quiet=True)[0][0] == "DTensor"


def test_crash_mid_save_keeps_last_good_checkpoint(cluster, tmp_path):
    # Last in this file: it leaves the group broken (conftest's cluster fixture restarts it for the next module).
    cluster.push(root=str(tmp_path))
    crash = ("from fsdplab import checkpoint as ck\nfrom fsdplab.models import TinyConfig\nimport os\n"
             "cfg = TinyConfig(dim=32, num_layers=2, seq_len=16)\n"
             "model, opt = ck.sharded_tiny(cfg, seed=0)\n"
             "ck.save_sharded(model, opt, root, step=1)\n"
             "ck.train_steps(model, opt, cfg, 1, global_batch=4)\n"
             "ck.write_shards(model, opt, root, step=2)\n"
             "if rank() == 1:\n    os._exit(7)\n"
             "ck.commit(root, step=2)\n")
    with pytest.raises(fsdplab.RankDied) as died:
        cluster.execute(crash, timeout=60)
    assert list(died.value.exits) == [1] and died.value.exits[1] in (7, None)
    assert (tmp_path / "step-2.tmp" / ".metadata").is_file() and not (tmp_path / "step-2").exists()
    assert (tmp_path / "latest").read_text() == "step-1"
    assert ck.latest_checkpoint(tmp_path).name == "step-1"
    model, opt = ck.sharded_tiny(CFG, seed=3)
    assert ck.load_sharded(model, opt, tmp_path) == 1
