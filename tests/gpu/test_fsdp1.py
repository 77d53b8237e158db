"""The posts' FSDP1 code (FullyShardedDataParallel, which refuses CPU ranks) on a GPU, through the functions
lessons 02, 04 and 05 call: backward/forward prefetch, MixedPrecision, and saving a full state dict."""

import pytest
import torch
import torch.distributed as dist

import fsdplab
from fsdplab import checkpoint as ck
from fsdplab import comms
from fsdplab.lessons import precision
from fsdplab.models import TinyConfig
from fsdplab.settings import MIB
from fsdplab.sharding import build_tiny

CFG = TinyConfig(vocab_size=256, dim=128, num_layers=4, num_heads=4, seq_len=64)


@pytest.mark.parametrize("backward_prefetch, forward_prefetch",
                         [("BACKWARD_PRE", False), ("BACKWARD_POST", False), (None, False), ("BACKWARD_PRE", True)])
def test_prefetch_settings_train(gpu_cluster, record, backward_prefetch, forward_prefetch):
    [out] = gpu_cluster.run(comms.fsdp1_step_records, backward_prefetch, forward_prefetch, True, cfg=CFG)
    record("peak_mib", round(out["peak_bytes"] / MIB, 2))
    record("collectives", sum(e["event"] == "collective" for e in out["events"]))
    assert out["peak_bytes"] > 0


def test_mixed_precision(gpu_cluster, record):
    [out] = gpu_cluster.run(precision.fsdp1_mixed_precision_on_rank, CFG)
    record("posts_call", out["posts_call"])
    # The posts' FSDP(model, mixed_precision=torch.float16) is refused; MixedPrecision(param_dtype=fp16)
    # puts even the norms in fp16 (lesson 04, claim 10).
    assert out["posts_call"].startswith("AttributeError"), out["posts_call"]
    assert out["norms"] and all(r["weight"] == "float16" for r in out["norms"]), out["norms"]


# The full-state-dict save is the posts' code (notebook 05 writes it in a cell), run as they wrote it.

def _fsdp1_tiny():
    from fsdplab.sharding import apply_fsdp1

    return apply_fsdp1(build_tiny(CFG, seed=0), fsdplab.device())


def _save_full_state_dict(path):
    """The posts' save, fixed: every rank calls state_dict() under FULL_STATE_DICT, rank 0 writes."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _fsdp1_tiny()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if fsdplab.rank() == 0:
        torch.save(state, path)
    dist.barrier()
    return sorted({v.device.type for v in state.values()})


def _posts_safe_save(path):
    """The posts' safe_save (lesson 05, claim 14): only rank 0 enters the gather, so it waits forever."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    model = _fsdp1_tiny()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        if fsdplab.rank() == 0:
            state = model.state_dict()
            # NCCL queues the gather and returns: without the sync the wait came inside torch.save's copy to the
            # host, after it had created the file, and the file check below would fail for a hang that happened.
            torch.cuda.synchronize()
            torch.save(state, path)


def test_full_state_dict_save_reloads_bit_exact(gpu_cluster, record, tmp_path):
    path = tmp_path / "fsdp1_full.pt"
    [devices] = gpu_cluster.run(_save_full_state_dict, str(path))
    rows = ck.equal_state(build_tiny(CFG, seed=0).state_dict(), torch.load(path, weights_only=True))
    record("file_mib", round(path.stat().st_size / MIB, 3))
    assert devices == ["cpu"], devices                      # offload_to_cpu=True
    assert rows and all(r[-1] for r in rows), [r for r in rows if not r[-1]]


def test_posts_safe_save_hangs(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"the hang needs two ranks on nccl, one GPU each; {torch.cuda.device_count()} visible")
    with fsdplab.Cluster(2) as cluster:
        with pytest.raises(fsdplab.RankHang) as hang:
            cluster.run(_posts_safe_save, str(tmp_path / "safe_save.pt"), timeout=20, quiet=True)
    assert hang.value.ranks == [0]
    assert not (tmp_path / "safe_save.pt").exists()
