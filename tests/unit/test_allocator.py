"""The caching-allocator model against sequences worked by hand from c10/cuda/CUDACachingAllocator.cpp's rules,
its invariants under random sequences, and its place in an estimate. (tests/gpu/test_memory.py compares it with
torch.cuda.max_memory_reserved on a GPU.)"""

import random

import pytest

from fsdplab.memory.allocator import CachingAllocator, replay, round_size, segment_size
from fsdplab.memory import estimate

MiB = 1 << 20
GiB = 1 << 30


def test_sizes_are_rounded_as_the_allocator_rounds():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB               # small pool: 2 MiB segments
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 512) == 12 * MiB


def test_a_sequence_worked_by_hand():
    a = CachingAllocator()
    assert a.malloc("a", 100) == 512 and a.reserved == 2 * MiB              # a small segment, split
    assert a.malloc("b", 1000) == 1024 and a.reserved == 2 * MiB            # from the same segment
    assert a.malloc("c", 5 * MiB) == 5 * MiB and a.reserved == 22 * MiB     # a 20 MiB large segment
    a.malloc("d", 12 * MiB)                                                 # best fit: the 15 MiB rest of it
    assert a.reserved == 22 * MiB
    a.free("c")                                                             # 5 MiB cached, 3 MiB rest after d
    a.malloc("e", 6 * MiB)                                                  # fits neither: a new 20 MiB segment
    assert a.reserved == 42 * MiB and a.segments == 3
    a.free("d")                                                             # merges 5 + 12 + 3 MiB
    a.malloc("f", 19 * MiB + 512)                                           # the merged 20 MiB block, not split
    assert a.reserved == 42 * MiB and a.allocated == 20 * MiB + 6 * MiB + 512 + 1024
    a.free("e")
    a.malloc("g", 7 * MiB, stream=1)                                        # another stream: its own segment
    assert a.reserved == 62 * MiB


def test_a_rest_of_one_mib_or_less_is_not_split_off_a_large_block():
    a = CachingAllocator()
    a.malloc("x", 20 * MiB)
    a.free("x")
    assert a.malloc("y", 19 * MiB) == 20 * MiB            # 1 MiB rest: not split, the whole block is used
    a.free("y")
    assert a.malloc("z", 18 * MiB) == 18 * MiB            # 2 MiB rest: split
    assert a.malloc("w", 2 * MiB) == 2 * MiB and a.reserved == 20 * MiB


def test_expandable_segments_grow_in_pages():
    a = CachingAllocator(expandable_segments=True)
    a.malloc("a", 5 * MiB)
    assert a.reserved == 20 * MiB                          # one 20 MiB page of the large pool's segment
    a.malloc("b", 30 * MiB)                                # the free 15 MiB at the end grows by one page
    assert a.reserved == 40 * MiB and a.segments == 1
    plain = CachingAllocator()
    plain.malloc("a", 5 * MiB)
    plain.malloc("b", 30 * MiB)
    assert plain.reserved == 50 * MiB and plain.segments == 2


@pytest.mark.parametrize("expandable", [False, True])
def test_random_sequences_keep_the_books(expandable):
    for seed in range(30):
        rng, a, live = random.Random(seed), CachingAllocator(expandable), []
        for i in range(300):
            if live and rng.random() < 0.45:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                a.malloc(i, rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 40 * MiB)]),
                         rng.choice([0, 1]))
                live.append(i)
            cached = sum(key[0] for keys in a._free.values() for key in keys)
            assert a.reserved == a.allocated + cached      # every reserved byte is a live or a cached block
        for key in live:
            a.free(key)
        assert a.allocated == 0


def test_a_warm_step_reuses_what_the_first_cached():
    step = [("+", 1, 8 * MiB), ("+", 2, 30 * MiB), ("-", 2), ("-", 1), ("+", 3, 30 * MiB), ("-", 3)]
    assert replay(step)["reserved"] == 20 * MiB + 30 * MiB    # the second pass finds both segments cached
    # What was alive when the step began is allocated first and freed by the step that follows.
    assert replay([("+", 0, 4 * MiB), ("-", 0), ("+", 5, 4 * MiB)], preloaded=1)["reserved"] == 20 * MiB


def test_an_estimate_reports_reserved_memory_above_its_active_peak():
    report = estimate(model="tiny", world_size=2, seq_len=256, batch_size=2, progress=False)
    view = report.gpu_view
    assert view["allocated_peak_rounded"] >= report.peak_bytes          # each tensor rounded up to 512 bytes
    assert view["allocated_peak_rounded"] - report.peak_bytes < 0.05 * report.peak_bytes
    assert view["reserved"] >= view["allocated_peak_rounded"] and view["reserved"] % (2 * MiB) == 0
    assert view["nvidia_smi"] == view["reserved"] + view["cuda_context"] + view["nccl"]
    assert "on a GPU: reserved" in report.table()
    assert "measured on an H200 at world size 1" in report.table()


def test_nvidia_smis_extra_is_the_h200_measurement_at_world_size_1_and_an_assumption_above():
    from fsdplab.memory import gpu_measured
    from fsdplab.memory.allocator import allocator_view
    from fsdplab.settings import TrainSetting

    replayed = {"reserved": 10 * GiB, "reserved_expandable": 9 * GiB, "segments": 3, "allocated_peak": 9 * GiB}
    fsdp_rows = [r for r in gpu_measured.ROWS if r.train_setting().strategy == "full_shard"][:10]
    one = allocator_view(replayed, TrainSetting(model="tiny", world_size=1))
    # what the H200 held outside the allocator on the FSDP2 rows measured before any NCCL communicator existed
    assert one["cuda_context"] == fsdp_rows[0].outside_allocator and one["nccl"] == 0
    assert one["nvidia_smi"] == 10 * GiB + fsdp_rows[0].outside_allocator
    ddp = allocator_view(replayed, TrainSetting(model="tiny", world_size=1, strategy="replicate"))
    ddp_row = next(r for r in gpu_measured.ROWS if r.train_setting().strategy == "replicate")
    assert ddp["cuda_context"] + ddp["nccl"] == ddp_row.outside_allocator      # replicate() made a communicator
    # torch's DDP all-reduces too: the same communicator (not measured on its own)
    assert allocator_view(replayed, TrainSetting(model="tiny", world_size=1, strategy="ddp"))["nccl"] == ddp["nccl"]
    eight = allocator_view(replayed, TrainSetting(model="tiny", world_size=8))
    assert eight["nccl"] > 0 and eight["nccl_source"].startswith("assumed")
    assert "measured" in one["cuda_context_source"] and "measured" in ddp["nccl_source"]


def test_the_memory_visualizer_snapshot_reads_back_through_torchs_own_parser(tmp_path):
    import pickle

    from torch.cuda import _memory_viz

    from fsdplab.runner.cli import main
    from fsdplab.memory import memory_snapshot

    path = tmp_path / "step.pickle"
    report = memory_snapshot(None, path, model="tiny", world_size=2, seq_len=128, progress=False)
    data = pickle.loads(path.read_bytes())
    assert sum(seg["total_size"] for seg in data["segments"]) == report.gpu_view["reserved"]
    summary = _memory_viz.segsum(data)            # checks that every segment's blocks add up to its size
    assert f"segments: {len(data['segments'])}" in summary
    trace = data["device_traces"][0]
    assert {e["action"] for e in trace} >= {"alloc", "free_requested", "free_completed"}
    assert "entries" in _memory_viz.trace(data)
    labels = {f["name"] for e in trace for f in e["frames"]}
    assert any(label.startswith("Activation, forward") for label in labels), sorted(labels)[:5]
    assert main(["estimate", "--model", "tiny", "--seq-len", "32,64", "--memory-snapshot", str(path)]) == 2


@pytest.mark.parametrize("lora_rank", [None, 8])
def test_the_snapshot_names_the_block_whose_backward_runs(tmp_path, lora_rank):
    """Backward visits the blocks last to first, and each allocation's label names the module it was made
    in. ModTracker keeps some modules open until the end of backward (inputs that need no gradient); naming
    the deepest open module then named a block done long before ([3, 2, 3, 2, 1, 2, ...])."""
    import itertools
    import pickle
    import re

    from fsdplab.memory import memory_snapshot

    path = tmp_path / "step.pickle"
    memory_snapshot(None, path, model="tiny", world_size=2, seq_len=64, lora_rank=lora_rank, progress=False)
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    labels = [e["frames"][0]["name"] for e in trace if e["action"] == "alloc" and e["frames"]]
    blocks = [int(m.group(1)) for label in labels if ", backward" in label
              for m in [re.search(r"layers\.(\d+)", label)] if m]
    assert [block for block, _ in itertools.groupby(blocks)] == [3, 2, 1, 0]
    # transformers runs apply_rotary_pos_emb as a module of its own ("Func", outside the model's tree)
    assert not [label for label in labels if label.endswith(", Func")]
