"""Saving and loading sharded models: full state dicts, sharded (DCP) checkpoints, resharding, exports.

Every function that gathers or scatters parameters is a collective: call it on EVERY rank (inside
`cluster.run(fn)`), never under `if rank == 0:`. Only the file writing is rank 0's job.

- `save_full` / `load_full`: one ordinary file (safetensors or torch.save) with the whole model, gathered
  with every rank's help and written by rank 0 alone, atomically (temp name, fsync, `os.replace`).
- `save_sharded` / `load_sharded`: `torch.distributed.checkpoint` (DCP) with model AND optimizer state,
  each rank writing its own shards. A save goes to `DIR/step-N.tmp` and is renamed to `DIR/step-N` only
  after every rank has finished, then `DIR/latest` is switched atomically: a crash at any moment of a save
  leaves the last complete checkpoint in charge (re-saving step N parks the old copy as `step-N.old`
  until the new one is in place). The next save clears what a failed or crashed one left behind; a full
  disk is reported as one line (`CheckpointDiskFull`). Loading works at any world size (DCP reshards).
  The file-system side (atomic writes, fsync, clearing debris, the full-disk line) is `fsdplab.safe_files`.
  Every save records its files' SHA-256 (`fsdplab.checksums`); a load refuses a damaged checkpoint in one line
  on every rank (`fallback=True` takes the newest undamaged step instead). Missing, malformed or
  unreadable checksums are damage too; a checkpoint from before checksums loads only with
  `trust_unverified=True`, which records them from its files as they are.
- `full_state` / `state_fingerprint` / `equal_state`: bit-exact comparisons (torch.equal, every tensor).
- `export_pretrained`: a `save_pretrained` folder (config.json + model.safetensors) plain transformers loads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from . import checksums
from . import safe_files as files
from .owned_folders import MARK
from .ranks import this_rank, this_world_size
from .safe_files import CheckpointDiskFull  # raised below; callers catch it as checkpoint.CheckpointDiskFull

LATEST = "latest"


# --- the ranks' part: every rank waits for rank 0's file work and learns how it went ---------------------

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    dist = _dist()
    if dist:
        dist.barrier()


def _on_rank0(fn, doing: str = "writing the checkpoint"):
    """Run `fn()` on rank 0 only, then let every rank know how it went: an error on rank 0 is raised on
    every rank (instead of rank 0 raising while the others wait for it at the next barrier forever).
    A refusal (CheckpointDamaged, a ValueError) keeps its type and line on every rank; a full
    disk stays CheckpointDiskFull. Works as a barrier too. Returns fn's value on rank 0, None
    elsewhere."""
    value, failure = None, None
    if this_rank() == 0:
        try:
            value = fn()
        except Exception as err:  # reported to every rank below, then re-raised on rank 0
            failure = err
    dist = _dist()
    if dist:
        text = getattr(failure, "strerror", None) or str(failure)   # an OSError's text without "[Errno N]"
        kind = type(failure).__name__
        message = [None if failure is None else (kind, text, getattr(failure, "errno", None))]
        dist.broadcast_object_list(message, src=0)
        if message[0] is not None and failure is None:
            kind, text, code = message[0]
            if code in files.DISK_FULL:   # keep the type: callers catch a full disk as such on every rank
                raise CheckpointDiskFull(code, f"rank 0 failed while {doing}: {kind}: {text}")
            if kind in _SAME_ON_EVERY_RANK:   # a verdict on the files, not a failure of rank 0
                raise _SAME_ON_EVERY_RANK[kind](text)
            raise RuntimeError(f"rank 0 failed while {doing}: {kind}: {text}")
    if failure is not None:
        raise failure
    return value


_SAME_ON_EVERY_RANK = {"CheckpointDamaged": checksums.CheckpointDamaged,
                       "CheckpointUnverified": checksums.CheckpointUnverified,
                       "ValueError": ValueError}


# --- full state dicts -----------------------------------------------------------------------------------

def full_model_state(model: nn.Module) -> dict:
    """The whole model's state on rank 0 as plain CPU tensors ({} on other ranks). Collective: call on all
    ranks. Each parameter in turn is all-gathered on the ranks' device, then copied to CPU memory: a GPU
    holds at most one full parameter beyond its shards at a time, never the full model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if _dist() is None:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full(model: nn.Module, path) -> Path | None:
    """Gather the whole model with every rank's help; rank 0 writes `path` atomically; all ranks wait.

    Collective: call it on EVERY rank (the posts' `safe_save` calls it on rank 0 only, and hangs).
    Returns the path on rank 0, None elsewhere."""
    path = Path(path)
    state = full_model_state(model)
    # Every rank waits until the file is complete (nobody reads it, or exits, too early).
    return _on_rank0(lambda: checksums.write_sidecar(files.atomic_save_tensors(state, path)) and path)


def load_full(model: nn.Module, path, trust_unverified: bool = False) -> None:
    """Load a file written by `save_full` into a (sharded) model. Collective: call it on every rank.
    Rank 0 verifies the file against its `.sha256` sidecar, reads it and broadcasts; each rank
    keeps only its own shards. A damaged file, or a missing, malformed or unreadable sidecar, is
    refused on every rank (CheckpointDamaged). `trust_unverified=True` accepts a file saved before
    sidecars existed, once: it records the sidecar from the file as it is now."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(path)

    def read():
        checksums.verify_file(path, trust_unverified)
        return files.read_tensors(path)

    if _dist() is None:
        model.load_state_dict(read())
        return
    # Rank 0 reads inside _on_rank0: a refusal or a failed read reaches the ranks waiting to
    # receive the weights, instead of leaving them in the broadcast until the timeout.
    state = _on_rank0(read, doing="reading the checkpoint")
    set_model_state_dict(model, state if this_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_state(model: nn.Module, optimizer=None) -> dict:
    """Model (and optimizer) state as one flat dict of full CPU tensors on rank 0 ({} elsewhere), for
    bit-exact comparisons across world sizes: keys 'model.<fqn>' and 'optim.<fqn>.<exp_avg|...>'. A
    snapshot: later training does not change it. Collective: call it on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # Copies: in a group of one rank the "gathered" tensors are the live parameters, which training changes.
    out = {f"model.{k}": v.detach().clone() for k, v in full_model_state(model).items()}
    if optimizer is not None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd = get_optimizer_state_dict(model, optimizer, options=options)
        for fqn, per_param in osd.get("state", {}).items():
            for name, value in per_param.items():
                value = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"optim.{fqn}.{name}"] = torch.as_tensor(value).detach().cpu().clone()
    return out if this_rank() == 0 else {}


def state_fingerprint(state: dict) -> dict:
    """name -> (shape, dtype, sha256 of the bytes): a compact identity of a state dict's tensors."""
    prints = {}
    for name, t in sorted(state.items()):
        t = torch.as_tensor(t).detach().cpu().contiguous()
        digest = hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
        prints[name] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), digest[:16])
    return prints


def equal_state(a: dict, b: dict) -> list:
    """Compare two state dicts tensor by tensor with torch.equal (bit-exact, dtype and shape included).

    Returns rows (name, shape, dtype, equal); a name present in only one dict is a row with equal=False.
    `all(row[-1] for row in rows)` is the verdict."""
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows.append((name, None, None, False))
            continue
        # on the CPU: one side is often a tensor a GPU rank returned, the other one read from a file
        x, y = (torch.as_tensor(t).detach().cpu() for t in (a[name], b[name]))
        same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        rows.append((name, tuple(x.shape), str(x.dtype).replace("torch.", ""), bool(same)))
    return rows


# --- sharded checkpoints (DCP) -------------------------------------------------------------------------------

def latest_checkpoint(root) -> Path | None:
    """The newest COMPLETE checkpoint folder under `root` (None if there is none).

    Trusts the `latest` pointer when it names a complete folder. A re-save of the pointer's step that
    crashed between its two renames left the previous copy as `step-N.old`: that one is returned.
    Otherwise the highest complete `step-N` folder (has DCP's `.metadata`). `step-N.tmp` folders, left
    by a save that failed or crashed before its commit, never count."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if files.STEP_DIR.match(name):
            for folder in (root / name, root / f"{name}.old"):
                if files.complete(folder):
                    return folder
    complete = []
    for p in root.glob("step-*"):
        if (m := files.STEP_DIR.match(p.name)) and files.complete(p):
            complete.append((int(m.group(1)), 1, p))
        elif (m := files.OLD_DIR.match(p.name)) and files.complete(p) and not (root / f"step-{m.group(1)}").exists():
            complete.append((int(m.group(1)), 0, p))
    return max(complete)[2] if complete else None


def _train_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def write_shards(model, optimizer, root, step: int) -> Path:
    """Phase 1 of `save_sharded`: every rank writes its shards into `root/step-N.tmp` (DCP). Collective.

    First rank 0 clears what earlier failed or crashed saves left in `root` (`safe_files.clear_debris`). If
    the disk fills up, the partial `step-N.tmp` is removed and every rank raises `CheckpointDiskFull` with one
    line (which ranks ran out, where, what to do) instead of DCP's per-rank tracebacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0 (the training step), got {step!r}.")
    root = Path(root)
    tmp = root / f"step-{step}.tmp"

    def prepare():
        root.mkdir(parents=True, exist_ok=True)
        files.clear_debris(root)

    _on_rank0(prepare)
    state = _train_state(model, optimizer)
    state["step"] = step
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp.save(state, checkpoint_id=str(tmp), no_dist=_dist() is None)
    except (Exception, CheckpointException) as err:
        # DCP reports a failure to every rank at the same collective step, after every rank's writes have
        # ended: rank 0 can delete the partial folder without pulling it from under a writer.
        if this_rank() == 0 or _dist() is None:
            files.remove(tmp)
        cause = files.disk_full_cause(err)
        if cause is None:
            raise
        ranks = files.disk_full_ranks(err)
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        last = latest_checkpoint(root)
        still = (f"the latest complete checkpoint is still {last.name}" if last is not None
                 else "there is no complete checkpoint in that folder yet")
        raise files.disk_full_error(cause, f"{who} wrote the shards of step {step}", root,
                                    f"removed the partial {tmp.name}", still) from None
    return tmp


def commit(root, step: int) -> Path:
    """Phase 2 of `save_sharded`: after a barrier (every rank has written), rank 0 renames `step-N.tmp` to
    `step-N` and points `latest` at it. Collective. Only now does the checkpoint exist for a loader.

    Re-saving a step that exists parks the old copy as `step-N.old` first and deletes it last: a crash
    between the two renames leaves `latest` naming `step-N`, which `latest_checkpoint` then finds as
    `step-N.old`, and the next save renames it back."""
    root = Path(root)
    tmp, final, parked = root / f"step-{step}.tmp", root / f"step-{step}", root / f"step-{step}.old"
    _barrier()  # every rank has returned from write_shards: all shards are on disk

    def rename():
        if not files.complete(tmp):
            raise ValueError(f"{tmp} is not a finished DCP save: call write_shards(...) on every rank first.")
        if final.exists():  # saving the same step again: park the old copy, then put the new one in place
            files.remove(parked)
            os.replace(final, parked)
        try:
            checksums.write_manifest(tmp)      # what a load verifies before it trusts a byte
        except OSError as err:
            if err.errno not in files.DISK_FULL:
                raise
            files.remove(tmp)
            last = latest_checkpoint(root)
            raise files.disk_full_error(err, f"recording the checksums of {tmp.name}", root,
                                        f"removed the partial {tmp.name}",
                                        "the latest complete checkpoint is still "
                                        f"{last.name if last else 'none'}") from None
        os.replace(tmp, final)
        files.fsync_dir(root)
        try:
            files.atomic_write_bytes(root / LATEST, final.name.encode())
        except OSError as err:
            if err.errno not in files.DISK_FULL:
                raise
            # step-N is complete and loadable by name; only the pointer could not be moved.
            raise files.disk_full_error(err, f"pointing {LATEST} at {final.name}", root,
                                        f"{final.name} is complete on disk",
                                        f"{LATEST} still names the previous checkpoint") from None
        files.remove(parked)

    _on_rank0(rename)
    return final


def save_sharded(model: nn.Module, optimizer, root, step: int) -> Path:
    """A resumable checkpoint: model + optimizer shards of every rank (DCP), then an atomic commit.

    Collective: call on every rank. Layout: root/step-N/{.metadata, __R_0.distcp per rank}, root/latest."""
    write_shards(model, optimizer, root, step)
    return commit(root, step)


def load_sharded(model: nn.Module, optimizer=None, root=None, checkpoint=None, storage_reader=None,
                 fallback: bool = False, trust_unverified: bool = False) -> int:
    """Load the newest complete checkpoint under `root` (or the folder `checkpoint`) into `model` and
    `optimizer`, at whatever world size is running now (DCP reshards on load). Returns the saved step.

    Collective: call on every rank, after sharding the model the way it will train (fully_shard first).
    `storage_reader`: a DCP StorageReader to read with instead of the default FileSystemReader (it is
    pointed at the checkpoint's folder), e.g. one that counts the bytes each rank reads.

    The checkpoint is verified first (`fsdplab.checksums`): damaged files, or a missing, malformed
    or unreadable checksums.json, are refused in one line on every rank (CheckpointDamaged); with
    `fallback=True` the newest older undamaged step is loaded instead. `trust_unverified=True`
    accepts a checkpoint written before checksums existed, once: it records checksums.json from its
    files as they are."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if checkpoint is None:
        if root is None:
            raise ValueError("load_sharded needs root= (a folder of step-N checkpoints) or checkpoint= (one).")
        checkpoint = latest_checkpoint(root)
        if checkpoint is None:
            raise ValueError(f"no complete checkpoint under {root}: save one with save_sharded(...) first.")
    checkpoint = _verified(Path(checkpoint), fallback, trust_unverified)
    state = _train_state(model, optimizer)
    state["step"] = -1
    with warnings.catch_warnings():
        # Loading in one process without a process group is intended here (resharding to world size 1).
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(checkpoint), storage_reader=storage_reader, no_dist=_dist() is None)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def _verified(checkpoint: Path, fallback: bool, trust_unverified: bool) -> Path:
    """`checkpoint` if its files are as saved (checksums.json); else, with `fallback`, the newest older complete
    step that is, said in one line; else CheckpointDamaged on every rank. Collective."""
    try:
        checksums.verify_folder(checkpoint, trust_unverified=trust_unverified)
        return checkpoint
    except checksums.CheckpointDamaged as damage:
        older = sorted((int(m.group(1)), p) for p in checkpoint.parent.glob("step-*")
                       if (m := files.STEP_DIR.match(p.name)) and files.complete(p) and p != checkpoint)
        older = [p for step, p in older if step < int(files.STEP_DIR.match(checkpoint.name).group(1))] \
            if files.STEP_DIR.match(checkpoint.name) else []
        if not fallback or not older:
            raise
        if this_rank() == 0:
            print(f"fsdplab: {damage} Loading {older[-1].name} instead (fallback=True).", flush=True)
        return _verified(older[-1], fallback, trust_unverified)


def checkpoint_files(root) -> list:
    """(relative path, bytes) of every file under `root`, sorted: what a directory listing shows, less the
    lab's own folder mark (`owned_folders.MARK`), which is no part of a checkpoint."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*")
                  if p.is_file() and p != root / MARK)


def shard_bytes(checkpoint) -> dict:
    """rank -> bytes of the DCP data file(s) that rank wrote (`__R_*.distcp`)."""
    out = {}
    for p in Path(checkpoint).glob("__*_*.distcp"):
        r = int(p.name.split("_")[2])
        out[r] = out.get(r, 0) + p.stat().st_size
    return dict(sorted(out.items()))


# --- exports ---------------------------------------------------------------------------------------------

def export_pretrained(model: nn.Module, path, config=None) -> Path | None:
    """Write a folder `AutoModelForCausalLM.from_pretrained(path)` loads: config.json + model.safetensors.

    Collective (the weights are gathered with every rank's help); rank 0 writes into `path.tmp` and
    renames it to `path` at the end, so a half export never looks like a model."""
    path = Path(path)
    config = config if config is not None else getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError("export_pretrained needs a transformers config: pass config=model.config "
                         "(or a config from fsdplab.models.hf_config).")
    state = full_model_state(model)

    def write():
        tmp = path.with_name(path.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        config.save_pretrained(tmp)
        files.atomic_save_tensors(state, tmp / "model.safetensors")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        files.fsync_dir(path.parent)
        return path

    return _on_rank0(write)


# --- models the lesson saves and the posts' FSDP1 defaults ---------------------------------------------------

def sharded_tiny(cfg=None, seed: int = 0, lr: float = 1e-2):
    """(model, optimizer): the lab's TinyTransformer, FSDP2-sharded per block over all ranks (a plain model
    when no process group is running: world size 1), with AdamW. Parameters are initialised from `seed`."""
    from .models import TinyConfig
    from .sharding import apply_fsdp, build_tiny

    model = build_tiny(cfg or TinyConfig(), seed=seed)
    if _dist() is not None:
        from .ranks import mesh

        model = apply_fsdp(model, mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def sharded_hf(config, seed: int = 0):
    """A transformers causal LM from `config` (e.g. models.hf_config("tiny")), FSDP2-sharded per decoder
    layer over all ranks; every rank initialises the same weights from `seed` before sharding."""
    from .models import causal_lm
    from .sharding import apply_fsdp

    torch.manual_seed(seed)
    model = causal_lm(config, device="cpu")
    if _dist() is not None:
        from .ranks import mesh

        model = apply_fsdp(model, mesh())
    return model


def fsdp1_state_dict_defaults() -> dict:
    """What FSDP1 (FullyShardedDataParallel) does when nobody sets a state dict type, read from the installed
    torch (no GPU needed): the default type and the default FullStateDictConfig fields. Raises
    PrivateAPIError when torch moved the private code the default is read from."""
    from torch.distributed.fsdp import FullStateDictConfig

    from ._torch_private import fsdp1_default_state_dict_type

    config = FullStateDictConfig()
    return {"default state_dict_type": fsdp1_default_state_dict_type(),
            "FullStateDictConfig().offload_to_cpu": config.offload_to_cpu,
            "FullStateDictConfig().rank0_only": config.rank0_only}


# --- a training loop whose result does not depend on the world size ----------------------------------------------

def train_steps(model, optimizer, cfg, steps: int, start_step: int = 0, global_batch: int = 8,
                seed: int = 0, device=None) -> list:
    """`steps` optimizer steps from `start_step` on the toy task. Every step uses the same global batch at
    any world size (rank r takes its slice of it), so a run resumed at another world size sees the same
    data. The batch goes to `device` (None: this rank's). Returns the global mean loss of each step (the same
    on every rank)."""
    from .models import default_device, random_batch
    from .sharding import train_step

    device = default_device(device)

    world, rank = this_world_size(), this_rank()
    if global_batch % world:
        raise ValueError(f"global_batch={global_batch} must divide evenly among {world} ranks; "
                         f"use a multiple of {world}.")
    per_rank = global_batch // world
    dist = _dist()
    losses = []
    for step in range(start_step, start_step + steps):
        tokens, targets = random_batch(cfg, global_batch, seed=seed + step, device="cpu")
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        total = train_step(model, optimizer, (tokens[mine].to(device), targets[mine].to(device)))
        if dist:
            dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        losses.append(total.item() / world)
    return losses
