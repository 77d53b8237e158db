"""fsdplab.checkpoint: atomic files, the `latest` protocol, bit-exact comparisons, full and sharded (DCP)
save/load on 2 real gloo ranks, resharding 2 -> 1 and 1 -> 2, faults (a full disk, a crash at every point
of a save and re-save, debris of failed saves), the posts' hanging safe_save, and an export that plain
transformers loads."""

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

import fsdplab
from fsdplab import checkpoint as ck
from fsdplab import safe_files as files
from fsdplab.models import TinyConfig

# The rank functions below travel by value: the ranks cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TinyConfig(dim=32, num_layers=2, seq_len=16)


@pytest.fixture
def saved_step1(tmp_path):
    """(model, optimizer) of the tiny model, saved as step 1 under tmp_path: what a later save starts from."""
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.save_sharded(model, opt, tmp_path, step=1)
    return model, opt


# --- no ranks needed ---------------------------------------------------------------------------------

def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "latest"
    files.atomic_write_bytes(target, b"step-1")
    files.atomic_write_bytes(target, b"step-22")
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
    files.atomic_write_bytes(tmp_path / "latest", b"step-2")
    assert ck.latest_checkpoint(tmp_path).name == "step-2"    # the pointer wins when it is valid
    files.atomic_write_bytes(tmp_path / "latest", b"step-30.tmp")
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
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, name + ".sha256"]   # no temp file left behind


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


def test_saving_the_same_step_twice_replaces_it(tmp_path, saved_step1):
    model, opt = saved_step1
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


# --- faults: a full disk, a crash at any point, debris of failed saves --------------------------------------

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_full_at_step2(model, opt, root) -> ck.CheckpointDiskFull:
    with pytest.raises(ck.CheckpointDiskFull) as err:
        ck.save_sharded(model, opt, root, step=2)
    return err.value


def _full_disk_writer(transforms, stream, *args, **kwargs):
    # What DCP's writer meets on a full disk: part of a shard goes out, then the write fails.
    stream.write(b"x" * 64)
    _no_space()


def test_atomic_write_on_a_full_disk_leaves_no_temp_file(tmp_path, monkeypatch):
    target = files.atomic_write_bytes(tmp_path / "latest", b"step-1")
    monkeypatch.setattr(os, "fsync", _no_space)   # the page cache took the bytes; the disk cannot
    with pytest.raises(OSError) as err:
        files.atomic_write_bytes(target, b"step-2")
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["latest"] and target.read_bytes() == b"step-1"


def test_save_full_on_a_full_disk_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import safetensors.torch

    model, _ = ck.sharded_tiny(CFG, seed=0)
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda state, name, **kw: (open(name, "wb").write(b"x"), _no_space()))
    with pytest.raises(ck.CheckpointDiskFull) as err:
        ck.save_full(model, tmp_path / "model.safetensors")
    message = str(err.value)
    assert err.value.errno == errno.ENOSPC and "\n" not in message and "ENOSPC" in message
    assert str(tmp_path) in message and err.value.__cause__ is None and err.value.__suppress_context__
    assert list(tmp_path.iterdir()) == []


def test_full_disk_during_a_sharded_save_is_one_line_and_the_next_save_works(tmp_path, monkeypatch, saved_step1):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    model, opt = saved_step1
    monkeypatch.setattr(dcp_fs, "_write_item", _full_disk_writer)
    err = _disk_full_at_step2(model, opt, tmp_path)
    message = str(err)
    assert err.errno == errno.ENOSPC and isinstance(err, OSError) and "\n" not in message
    for part in ("No space left on device (ENOSPC)", "rank 0", "step 2", str(tmp_path),
                 "removed the partial step-2.tmp", "still step-1", "Free space"):
        assert part in message, (part, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]   # no debris holds the disk
    monkeypatch.undo()
    ck.save_sharded(model, opt, tmp_path, step=3)
    assert ck.latest_checkpoint(tmp_path).name == "step-3"


def test_full_disk_when_moving_latest_keeps_the_previous_checkpoint_in_charge(tmp_path, monkeypatch, saved_step1):
    monkeypatch.setattr(files, "atomic_write_bytes", _no_space)
    message = str(_disk_full_at_step2(*saved_step1, tmp_path))
    assert "\n" not in message and "latest still names the previous checkpoint" in message
    assert ck.latest_checkpoint(tmp_path).name == "step-1" and (tmp_path / "step-2" / ".metadata").is_file()


def test_the_next_save_clears_what_failed_saves_left(tmp_path, saved_step1):
    model, opt = saved_step1
    _fake_checkpoint(tmp_path, "step-7.tmp", complete=False)      # a save that died while writing
    _fake_checkpoint(tmp_path, "step-5.tmp")                      # ... and one that died before its commit
    _fake_checkpoint(tmp_path, ".step-1.old-4242")                # a parked copy, as earlier versions named it
    (tmp_path / ".latest.tmp-4242").write_bytes(b"")              # a pointer write that died
    ck.save_sharded(model, opt, tmp_path, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-2"]


class _Crash(BaseException):
    """The process dies here: not an Exception, so no `except Exception` cleanup runs after it."""


def _crash_at(patch, k: int) -> list:
    """Make the k-th (1-based) file-system step of a save (fsdplab.checkpoint and fsdplab.safe_files) raise
    _Crash; k=0 never does.
    Returns the list the steps are recorded in."""
    calls = []

    def step(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            if len(calls) == k:
                raise _Crash(name)
            return fn(*args, **kwargs)
        return wrapped

    patch.setattr(os, "replace", step("os.replace", os.replace))
    patch.setattr(files, "remove", step("remove", files.remove))
    patch.setattr(ck, "_barrier", step("barrier (shards written)", ck._barrier))
    return calls


@pytest.mark.parametrize("same_step", [False, True], ids=["new step", "same step again"])
def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_latest(tmp_path, monkeypatch, same_step):
    def attempt(root, k):
        """Save A at step 1, train, save B (step 1 again or step 2) crashing at step k of the sequence."""
        model, opt = ck.sharded_tiny(CFG, seed=0)
        ck.save_sharded(model, opt, root, step=1)
        a = ck.full_state(model, opt)
        ck.train_steps(model, opt, CFG, 1, global_batch=4)
        with monkeypatch.context() as patch:
            calls = _crash_at(patch, k)
            try:
                ck.save_sharded(model, opt, root, step=1 if same_step else 2)
            except _Crash:
                pass
        return a, ck.full_state(model, opt), calls

    *_, points = attempt(tmp_path / "clean", 0)
    assert len(points) >= 3 + same_step, points
    seen = []
    for k in range(1, len(points) + 1):
        root = tmp_path / f"crash-{k}"
        a, b, calls = attempt(root, k)
        latest = ck.latest_checkpoint(root)
        assert latest is not None, (k, calls, ck.checkpoint_files(root))
        other, other_opt = ck.sharded_tiny(CFG, seed=1)
        step = ck.load_sharded(other, other_opt, root)
        loaded = ck.full_state(other, other_opt)
        is_a, is_b = (all(r[-1] for r in ck.equal_state(loaded, x)) for x in (a, b))
        assert is_a or is_b, (k, calls[-1], latest)
        seen.append((calls[-1], latest.name, "new" if is_b else "old"))
        # The next save puts everything in order: no temporaries, no parked copy, step-1 back if it was parked.
        ck.save_sharded(other, other_opt, root, step=3)
        names = sorted(p.name for p in root.iterdir())
        assert all(re.fullmatch(r"latest|step-\d+", n) for n in names) and "step-1" in names, (k, names)
        assert ck.latest_checkpoint(root).name == "step-3" and step in (1, 2)
    assert seen[0][2] == "old" and seen[-1][2] == "new", seen       # the pointer is the commit point
    if same_step:   # the crash between the two renames: only the parked copy is complete under its name
        assert ("os.replace", "step-1.old", "old") in seen, seen


_REAL_CRASH = """
import os, sys
from fsdplab import checkpoint as ck
from fsdplab.models import TinyConfig
root, where = sys.argv[1], sys.argv[2]
cfg = TinyConfig(dim=32, num_layers=2, seq_len=16)
model, opt = ck.sharded_tiny(cfg, seed=0)
ck.save_sharded(model, opt, root, step=1)
ck.train_steps(model, opt, cfg, 1, global_batch=4)
if where == "between the renames":
    replace = os.replace
    def dying_replace(src, dst):
        if str(src).endswith("step-1.tmp"):   # step-1 is already parked as step-1.old
            os._exit(9)
        replace(src, dst)
    os.replace = dying_replace
else:
    import torch.distributed.checkpoint.filesystem as dcp_fs
    def dying_write(transforms, stream, *args, **kwargs):
        stream.write(b"half a shard")
        stream.flush()
        os._exit(9)
    dcp_fs._write_item = dying_write
ck.save_sharded(model, opt, root, step=1)
"""


def test_a_process_killed_while_re_saving_a_step_leaves_it_loadable(tmp_path):
    # Real deaths (os._exit, no cleanup runs), in two processes side by side: mid-write and between the renames.
    wheres = {"mid-write": tmp_path / "a", "between the renames": tmp_path / "b"}
    procs = {w: subprocess.Popen([sys.executable, "-c", _REAL_CRASH, str(root), w], stderr=subprocess.PIPE)
             for w, root in wheres.items()}
    for where, proc in procs.items():
        assert proc.wait(timeout=300) == 9, (where, proc.stderr.read().decode()[-2000:])
    left = {w: sorted(p.name for p in root.iterdir()) for w, root in wheres.items()}
    assert left == {"mid-write": ["latest", "step-1", "step-1.tmp"],
                    "between the renames": ["latest", "step-1.old", "step-1.tmp"]}, left
    assert not (wheres["mid-write"] / "step-1.tmp" / ".metadata").exists()
    saved, _ = ck.sharded_tiny(CFG, seed=0)                        # what step 1 was saved from
    for where, root in wheres.items():
        latest = ck.latest_checkpoint(root)
        assert latest.name == ("step-1" if where == "mid-write" else "step-1.old"), (where, latest)
        model, opt = ck.sharded_tiny(CFG, seed=1)
        assert ck.load_sharded(model, opt, root) == 1
        assert all(r[-1] for r in ck.equal_state(ck.full_state(saved), ck.full_state(model)))
        ck.save_sharded(model, opt, root, step=2)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-2"], where


def test_full_state_is_a_snapshot_in_a_group_of_one_rank():
    # With one rank the "gathered" full tensors are the live parameters themselves; training must not
    # change a snapshot taken before it.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdplab.sharding import apply_fsdp, build_tiny

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = apply_fsdp(build_tiny(CFG, seed=0), init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ck.train_steps(model, opt, CFG, 1, global_batch=4)
        before = ck.full_state(model, opt)
        ck.train_steps(model, opt, CFG, 1, start_step=1, global_batch=4)
        rows = ck.equal_state(before, ck.full_state(model, opt))
        assert not any(r[-1] for r in rows if r[0].startswith("model.")), "the snapshot moved with the model"
    finally:
        dist.destroy_process_group()


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


def _full_disk_on_one_rank(root, full_rank):
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs

    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.save_sharded(model, opt, root, step=1)
    write = dcp_fs._write_item
    if fsdplab.rank() == full_rank:
        dcp_fs._write_item = _full_disk_writer
    try:
        ck.save_sharded(model, opt, root, step=2)
        failure = None
    except ck.CheckpointDiskFull as err:
        failure = (err.errno, str(err))
    finally:
        dcp_fs._write_item = write
    dist.barrier()
    left = sorted(p.name for p in Path(root).iterdir())
    ck.save_sharded(model, opt, root, step=3)
    return failure, left, ck.latest_checkpoint(root).name


def _full_disk_under_save_full(path):
    import safetensors.torch

    model, _ = ck.sharded_tiny(CFG, seed=0)
    save_file = safetensors.torch.save_file
    if fsdplab.rank() == 0:
        safetensors.torch.save_file = lambda state, name, **kw: (open(name, "wb").write(b"x"), _no_space())
    try:
        ck.save_full(model, path)
    except ck.CheckpointDiskFull as err:
        return err.errno, str(err)
    finally:   # the session's shared ranks serve the next test (the next module, with -n 2)
        safetensors.torch.save_file = save_file


def test_a_full_disk_on_one_rank_is_one_line_on_every_rank(cluster, tmp_path):
    out = cluster.run(_full_disk_on_one_rank, str(tmp_path / "dcp"), 1, quiet=True)
    for rank, (failure, left, latest) in enumerate(out):
        code, message = failure
        assert code == errno.ENOSPC and "\n" not in message and len(message) < 400, (rank, message)
        assert "rank 1 wrote the shards of step 2" in message and str(tmp_path / "dcp") in message, message
        assert left == ["latest", "step-1"] and latest == "step-3", (left, latest)
    (code0, line0), (code1, line1) = cluster.run(_full_disk_under_save_full, str(tmp_path / "full.safetensors"),
                                                 quiet=True)
    assert code0 == code1 == errno.ENOSPC and "\n" not in line0 + line1 and "ENOSPC" in line0
    assert "rank 0 failed while writing the checkpoint" in line1 and line0.split("] ", 1)[1] in line1
    assert list(tmp_path.glob("*full.safetensors*")) == []


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


# --- damaged checkpoints are refused, in one line, on every rank ------------------------------------------

def _flip(path: Path, at: int, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, min(at + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(folder: Path, how: str) -> str:
    shard = sorted(folder.glob("__*_*.distcp"))[-1]
    if how == "flipped":
        _flip(shard, shard.stat().st_size // 2)
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.unlink()
    return shard.name


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing"])
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_file_and_step(tmp_path, saved_step1, how):
    """Flipped bytes used to load silently (a weight 3411.4 that was -0.0013, then a NaN loss)."""
    model, opt = saved_step1
    ck.save_sharded(model, opt, tmp_path, step=2)
    name = _damage(tmp_path / "step-2", how)
    fresh, fresh_opt = ck.sharded_tiny(CFG, seed=5)
    before = ck.full_state(fresh)
    with pytest.raises(ck.checksums.CheckpointDamaged) as info:
        ck.load_sharded(fresh, fresh_opt, tmp_path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and name in message and "step-2" in message, message
    assert all(r[-1] for r in ck.equal_state(before, ck.full_state(fresh)))       # nothing was loaded
    assert ck.load_sharded(fresh, fresh_opt, tmp_path, fallback=True) == 1       # only when asked: step 1
    assert all(r[-1] for r in ck.equal_state(ck.full_state(fresh), _state_of_step(tmp_path / "step-1")))


def _state_of_step(folder):
    model, opt = ck.sharded_tiny(CFG, seed=9)
    ck.load_sharded(model, opt, checkpoint=folder)
    return ck.full_state(model)


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_a_damaged_full_state_dict_is_refused(tmp_path, name):
    model, _ = ck.sharded_tiny(CFG, seed=0)
    ck.save_full(model, tmp_path / name)
    _flip(tmp_path / name, (tmp_path / name).stat().st_size - 64)
    with pytest.raises(ck.checksums.CheckpointDamaged, match=f"{name} is damaged"):
        ck.load_full(ck.sharded_tiny(CFG, seed=1)[0], tmp_path / name)


def _load_damaged_on_ranks(root):
    from fsdplab import checkpoint as ck

    model, opt = ck.sharded_tiny(CFG, seed=3)
    try:
        ck.load_sharded(model, opt, root)
    except ck.checksums.CheckpointDamaged as err:
        return str(err)
    return "loaded"


def test_a_damaged_shard_is_refused_on_every_rank_of_a_group(cluster, tmp_path):
    cluster.restart()                  # the crash test above leaves a rank dead; this one needs every rank
    cluster.run(_train_save_resume, str(tmp_path), 2)
    latest = ck.latest_checkpoint(tmp_path)
    name = _damage(latest, "flipped")
    said = cluster.run(_load_damaged_on_ranks, str(tmp_path))
    assert len(set(said)) == 1 and name in said[0] and latest.name in said[0], said
