"""A checkpoint's checksums cannot be switched off: a missing, malformed or unreadable manifest
(checksums.json) or sidecar (<file>.sha256) is itself a damaged checkpoint, refused in one line that
names the file, on every rank of a real gloo group, long before the collective's timeout. A
checkpoint with no checksums at all (written before they existed) loads only when the caller says
`trust_unverified=True`, which records them from the bytes as they are, once."""

import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle
import pytest

from fsdplab import checkpoint as ck
from fsdplab import checksums
from fsdplab.models import TinyConfig

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TinyConfig(dim=32, num_layers=2, seq_len=16)
TIMEOUT = 60          # what cluster.run waits before it reports a RankHang
QUICK = 20            # a refusal must come long before that
NOBODY = 65534


def _good_entry(folder: Path, name: str) -> dict:
    return json.loads((folder / checksums.MANIFEST).read_text())[name]


# What a manifest can be instead of the one a save wrote; each returns words its refusal must hold.
def _manifest_missing(folder):
    (folder / checksums.MANIFEST).unlink()
    return "trust_unverified=True"


def _manifest_empty(folder):
    (folder / checksums.MANIFEST).write_bytes(b"")
    return "empty"


def _manifest_not_json(folder):
    (folder / checksums.MANIFEST).write_bytes(b'{".metadata": {"bytes": 1')
    return "not JSON"


def _manifest_wrong_type(folder):
    (folder / checksums.MANIFEST).write_text(json.dumps(sorted(p.name for p in folder.iterdir())))
    return "JSON object"


def _manifest_wrong_field_types(folder):
    entries = json.loads((folder / checksums.MANIFEST).read_text())
    name = sorted(entries)[-1]
    entries[name]["bytes"] = str(entries[name]["bytes"])
    (folder / checksums.MANIFEST).write_text(json.dumps(entries))
    return name


def _manifest_wrong_fields(folder):
    entries = json.loads((folder / checksums.MANIFEST).read_text())
    name = sorted(entries)[-1]
    entries[name] = {"size": entries[name]["bytes"], "md5": "0" * 32}
    (folder / checksums.MANIFEST).write_text(json.dumps(entries))
    return name


def _manifest_records_nothing(folder):
    (folder / checksums.MANIFEST).write_text("{}")
    return "records no files"


def _manifest_skips_a_shard(folder):
    # Verifying only what a manifest lists would leave this shard unchecked: it must be listed too.
    shard = sorted(folder.glob("__*_*.distcp"))[-1].name
    entries = json.loads((folder / checksums.MANIFEST).read_text())
    del entries[shard]
    (folder / checksums.MANIFEST).write_text(json.dumps(entries))
    return shard


def _manifest_a_folder(folder):
    (folder / checksums.MANIFEST).unlink()
    (folder / checksums.MANIFEST).mkdir()
    return "not a regular file"


def _manifest_a_fifo(folder):
    # Opening a FIFO for reading blocks until a writer comes: never open what is not a plain file.
    (folder / checksums.MANIFEST).unlink()
    os.mkfifo(folder / checksums.MANIFEST)
    return "not a regular file"


def _manifest_unreadable(folder):
    (folder / checksums.MANIFEST).chmod(0)
    return "unreadable"


MANIFEST_CASES = {f.__name__.removeprefix("_manifest_"): f for f in (
    _manifest_missing, _manifest_empty, _manifest_not_json, _manifest_wrong_type,
    _manifest_wrong_field_types, _manifest_wrong_fields, _manifest_records_nothing,
    _manifest_skips_a_shard, _manifest_a_folder, _manifest_a_fifo, _manifest_unreadable)}


def _sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + checksums.SIDECAR)


def _sidecar_missing(path):
    _sidecar_of(path).unlink()
    return "trust_unverified=True"


def _sidecar_empty(path):
    _sidecar_of(path).write_bytes(b"")
    return "empty"


def _sidecar_not_a_checksum(path):
    _sidecar_of(path).write_text('{"sha256": "not this format"}\n')
    return "not a checksum line"


def _sidecar_wrong_types(path):
    want, size = _sidecar_of(path).read_text().split()
    _sidecar_of(path).write_text(f"{want}  {size}.0\n")
    return "not a checksum line"


def _sidecar_a_folder(path):
    _sidecar_of(path).unlink()
    _sidecar_of(path).mkdir()
    return "not a regular file"


def _sidecar_unreadable(path):
    _sidecar_of(path).chmod(0)
    return "unreadable"


SIDECAR_CASES = {f.__name__.removeprefix("_sidecar_"): f for f in (
    _sidecar_missing, _sidecar_empty, _sidecar_not_a_checksum, _sidecar_wrong_types,
    _sidecar_a_folder, _sidecar_unreadable)}


# --- on the ranks -------------------------------------------------------------------------------

def _as_nobody(enabled: bool):
    """Read files as an unprivileged user would (root reads a file of mode 0 anyway): the file
    system uid of this thread becomes `nobody`, which drops root's override of file permissions
    until it is set back."""
    setfsuid = getattr(ctypes.CDLL(None, use_errno=True), "setfsuid")

    class Nobody:
        def __enter__(self):
            if enabled and os.geteuid() == 0:
                setfsuid(NOBODY)

        def __exit__(self, *exc):
            if enabled and os.geteuid() == 0:
                setfsuid(0)

    return Nobody()


def _refusal(load) -> tuple:
    try:
        load()
    except Exception as err:
        return type(err).__name__, str(err), isinstance(err, checksums.CheckpointDamaged)
    return "loaded", "", False


def _load_sharded_on_ranks(root, unprivileged_ranks=(), **options):
    model, opt = ck.sharded_tiny(CFG, seed=3)
    import fsdplab

    with _as_nobody(fsdplab.rank() in unprivileged_ranks):
        return _refusal(lambda: ck.load_sharded(model, opt, root, **options))


def _load_full_on_ranks(path, unprivileged_ranks=(), **options):
    import fsdplab

    model, _ = ck.sharded_tiny(CFG, seed=3)
    with _as_nobody(fsdplab.rank() in unprivileged_ranks):
        return _refusal(lambda: ck.load_full(model, path, **options))


def _save_on_ranks(root, path):
    model, opt = ck.sharded_tiny(CFG, seed=0)
    ck.save_sharded(model, opt, root, step=1)
    ck.save_full(model, path)


@pytest.fixture(scope="module")
def saved(cluster):
    """A 2-rank sharded checkpoint (step-1) and a save_full file, in a folder any user can read (the
    unreadable cases read as `nobody`), copied afresh for each test."""
    base = Path(tempfile.mkdtemp(prefix="fsdplab-integrity-"))
    base.chmod(0o755)
    cluster.run(_save_on_ranks, str(base / "dcp"), str(base / "model.safetensors"),
                timeout=TIMEOUT, quiet=True)
    for p in base.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def copy_of(saved):
    folder = Path(tempfile.mkdtemp(prefix="case-", dir=saved))
    folder.chmod(0o755)
    shutil.copytree(saved / "dcp", folder / "dcp")
    shutil.copy2(saved / "model.safetensors", folder)
    shutil.copy2(_sidecar_of(saved / "model.safetensors"), folder)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _refused_quickly_on_every_rank(cluster, fn, *args, **options) -> str:
    t0 = time.monotonic()
    said = cluster.run(fn, *args, timeout=TIMEOUT, quiet=True, **options)
    elapsed = time.monotonic() - t0
    assert elapsed < QUICK, f"the refusal took {elapsed:.1f} s"
    assert len(set(said)) == 1, said                # one verdict, the same on every rank
    name, message, is_damaged = said[0]
    assert is_damaged, said[0]
    assert len(message.splitlines()) == 1 and len(message) < 600, message
    return message


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_a_bad_manifest_is_refused_on_every_rank(cluster, copy_of, case):
    folder = copy_of / "dcp" / "step-1"
    words = MANIFEST_CASES[case](folder)
    message = _refused_quickly_on_every_rank(cluster, _load_sharded_on_ranks, str(copy_of / "dcp"),
                                             [0, 1])
    assert "step-1" in message and str(copy_of / "dcp") in message, message
    assert checksums.MANIFEST in message and words in message, message
    assert "nothing was loaded" in message, message


@pytest.mark.parametrize("case", SIDECAR_CASES)
def test_a_bad_sidecar_is_refused_on_every_rank(cluster, copy_of, case):
    path = copy_of / "model.safetensors"
    words = SIDECAR_CASES[case](path)
    message = _refused_quickly_on_every_rank(cluster, _load_full_on_ranks, str(path), [0, 1])
    assert str(path) in message and _sidecar_of(path).name in message and words in message, message


def test_a_shard_only_one_rank_cannot_read_is_refused_on_every_rank(cluster, copy_of):
    # Each rank checks its share of the files: an error on one must reach the others, who would
    # otherwise wait for it in the collective that gathers the findings.
    for shard in (copy_of / "dcp" / "step-1").glob("__*_*.distcp"):
        shard.chmod(0)
    message = _refused_quickly_on_every_rank(cluster, _load_sharded_on_ranks, str(copy_of / "dcp"),
                                             [1])
    assert "unreadable" in message and ".distcp" in message, message


def test_a_file_only_rank0_cannot_read_is_refused_on_every_rank(cluster, copy_of):
    path = copy_of / "model.safetensors"
    path.chmod(0)
    message = _refused_quickly_on_every_rank(cluster, _load_full_on_ranks, str(path), [0])
    assert "unreadable" in message and str(path) in message, message


def test_a_checkpoint_from_before_checksums_loads_once_when_trusted(cluster, copy_of):
    root, folder = copy_of / "dcp", copy_of / "dcp" / "step-1"
    want = _good_entry(folder, ".metadata")
    _manifest_missing(folder)
    assert cluster.run(_load_sharded_on_ranks, str(root), trust_unverified=True, quiet=True) == \
        [("loaded", "", False)] * 2
    assert _good_entry(folder, ".metadata") == want          # recorded from the bytes as they are
    assert cluster.run(_load_sharded_on_ranks, str(root), quiet=True) == [("loaded", "", False)] * 2
    path = copy_of / "model.safetensors"
    _sidecar_missing(path)
    assert cluster.run(_load_full_on_ranks, str(path), trust_unverified=True, quiet=True) == \
        [("loaded", "", False)] * 2
    assert _sidecar_of(path).is_file()
    assert cluster.run(_load_full_on_ranks, str(path), quiet=True) == [("loaded", "", False)] * 2


def test_trusting_does_not_accept_damage_a_manifest_records(cluster, copy_of):
    folder = copy_of / "dcp" / "step-1"
    shard = sorted(folder.glob("__*_*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    message = _refused_quickly_on_every_rank(cluster, _load_sharded_on_ranks, str(copy_of / "dcp"),
                                             trust_unverified=True)
    assert shard.name in message, message
    _manifest_not_json(folder)
    message = _refused_quickly_on_every_rank(cluster, _load_sharded_on_ranks, str(copy_of / "dcp"),
                                             trust_unverified=True)
    assert "not JSON" in message
    assert (folder / checksums.MANIFEST).read_bytes().startswith(b'{".metadata"')     # left alone


# --- in one process -----------------------------------------------------------------------------

def test_no_checkpoint_at_a_path_is_a_value_error_naming_it(tmp_path):
    model, _ = ck.sharded_tiny(CFG, seed=0)
    with pytest.raises(ValueError, match="no file") as err:
        ck.load_full(model, tmp_path / "nothing.safetensors")
    assert str(tmp_path / "nothing.safetensors") in str(err.value)
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        ck.load_sharded(model, checkpoint=tmp_path / "step-3")


@pytest.mark.parametrize("case", MANIFEST_CASES)
def test_a_bad_manifest_is_refused_in_one_process(copy_of, case):
    folder = copy_of / "dcp" / "step-1"
    words = MANIFEST_CASES[case](folder)
    model, opt = ck.sharded_tiny(CFG, seed=3)
    with _as_nobody(True), pytest.raises(checksums.CheckpointDamaged) as err:
        ck.load_sharded(model, opt, copy_of / "dcp")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, checksums.CheckpointUnverified) == (case == "missing")


def test_checking_a_share_outside_a_group_checks_every_file(copy_of):
    # rank/world_size used to pick a share even with no group to hear from the other ranks.
    folder = copy_of / "dcp" / "step-1"
    shards = sorted(folder.glob("__*_*.distcp"))
    shards[0].write_bytes(b"damaged")
    for rank in (0, 1):
        with pytest.raises(checksums.CheckpointDamaged, match=shards[0].name):
            checksums.verify_folder(folder, rank, 2)


def test_refusals_keep_their_type_on_every_rank(cluster, copy_of):
    # Rank 0's CheckpointDamaged must not reach the others as a RuntimeError "while writing".
    path = copy_of / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    message = _refused_quickly_on_every_rank(cluster, _load_full_on_ranks, str(path))
    assert "is damaged" in message and "writing" not in message, message


def test_the_temp_file_of_a_manifest_write_that_died_is_not_saved_data(copy_of):
    (copy_of / "dcp" / "step-1" / f".{checksums.MANIFEST}.tmp-4242").write_bytes(b'{"half')
    (copy_of / "dcp" / "step-1" / "notes.txt").write_text("not recorded")
    model, opt = ck.sharded_tiny(CFG, seed=3)
    with pytest.raises(checksums.CheckpointDamaged, match="does not record notes.txt\\)"):
        ck.load_sharded(model, opt, copy_of / "dcp")
