"""Lesson 10's own code and the runtime pieces it added: flight recorder dumps from live ranks (also while they
are stuck), the repair torch's analyzer needs on gloo dumps, DETAIL's message cut to what differs, the straggler
numbers, `Cluster(env=...)`, and the exercise checker tried with a learner's wrong answers. The lesson itself runs
in tests/lessons/test_notebooks.py."""

import gc
import pickle

import pytest

import fsdplab
from fsdplab.exercises import check
from fsdplab.lessons import debugging as dbg


def test_a_hang_is_dumped_from_every_rank_and_the_repaired_dumps_name_the_missing_rank(cluster, tmp_path, capsys):
    cluster.restart()       # a flight recorder with this test's collectives only, not those of the tests before it
    cluster.execute("import torch")
    capsys.readouterr()
    record = dbg.plant(cluster, "if rank() == 0:\n    dist.all_reduce(torch.ones(4))", timeout=2,
                       dump_dir=tmp_path / "dumps")
    assert record["outcome"] == "RankHang" and record["ranks"] == [0], record
    assert sorted(record["dumps"]) == [0, 1] and record["restart_s"] is not None and not cluster.broken
    # the restart is the caller's to report (restart_s): no "fresh rank(s) ready" line, and the cluster's own
    # quiet setting untouched (cluster.restart(quiet=True))
    assert "fresh rank" not in capsys.readouterr().out and not cluster.quiet
    dump = pickle.loads((tmp_path / "dumps" / "rank_0").read_bytes())
    assert dump["entries"][-1]["profiling_name"].endswith("all_reduce")
    fixed = dbg.repair_group_names(tmp_path / "dumps", tmp_path / "fixed")
    report = dbg.analyze(fixed)
    assert gc.isenabled(), "the analyzer left this process's garbage collector off"
    assert "Not all ranks joining" in report and "missing ranks: {1}" in report, report
    assert dbg.analyzer_verdict(report).startswith("Not all ranks joining")
    assert cluster.run(lambda: 1) == [1, 1]                   # the restarted group works


def test_repair_is_a_copy_that_leaves_agreeing_names_alone(tmp_path):
    (tmp_path / "in").mkdir()
    entries = [{"process_group": ("0", "default_pg")}]
    broken = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}, "entries": entries}
    fine = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "entries": entries}
    other = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"},
                                              "5": {"name": "5", "desc": "undefined", "ranks": "[0]"}},
             "entries": [{"process_group": ("7", "undefined")}]}   # no default-group entry: nothing to rename
    (tmp_path / "in" / "rank_2").write_bytes(pickle.dumps(other))
    (tmp_path / "in" / "rank_0").write_bytes(pickle.dumps(broken))
    (tmp_path / "in" / "rank_1").write_bytes(pickle.dumps(fine))
    out = dbg.repair_group_names(tmp_path / "in", tmp_path / "out")
    repaired = pickle.loads((out / "rank_0").read_bytes())
    assert repaired["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    assert pickle.loads((out / "rank_1").read_bytes()) == fine
    assert pickle.loads((out / "rank_2").read_bytes()) == other
    assert pickle.loads((tmp_path / "in" / "rank_0").read_bytes()) == broken      # the originals stay


def test_analyzer_failure_is_one_line():
    assert dbg.analyze("/nonexistent-folder").startswith("analyzer failed")
    # torch's analyzer turns the garbage collector off for good; the kernel that ran it keeps its collector on
    assert gc.isenabled()
    assert dbg.analyzer_verdict("analyzer failed: KeyError: ('0', 0)").startswith("analyzer failed")
    assert dbg.analyzer_verdict("") == "(no output)"


def test_detail_summary_keeps_what_differs():
    message = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint("
               "SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes="
               "TensorOptions(dtype=float (default), device=cpu)), but Rank 1 is running collective: "
               "CollectiveFingerPrint(SequenceNumber=0, OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float, "
               "TensorDeviceTypes=...)")
    assert dbg.detail_summary(message) == ("mismatch: rank 0: ALLREDUCE #0 shape [4] Float; "
                                           "rank 1: BROADCAST #0 shape [4] Float")
    assert (dbg.detail_summary("Ranks 1 failed to pass monitoredBarrier\nmore")
            == "Ranks 1 failed to pass monitoredBarrier")


def test_compute_seconds_counts_nested_ranges_once_and_the_score():
    trace = {"events": [{"row": "compute", "start_us": 0, "end_us": 100},
                        {"row": "compute", "start_us": 20, "end_us": 50},      # inside the first
                        {"row": "compute", "start_us": 90, "end_us": 150},     # overlaps its end
                        {"row": "comm", "start_us": 150, "end_us": 400}]}
    assert dbg.compute_seconds(trace) == pytest.approx(150e-6)
    assert dbg.step_seconds(trace) == pytest.approx(400e-6)
    assert dbg.straggler_score([1.0, 1.0, 4.0]) == 4.0 and dbg.straggler_score([1.0, 1.0]) == 1.0


def test_step_time_checker_rejects_the_answers_a_learner_gets_wrong():
    even, delay, measured = 0.080, 0.060, 0.142
    assert check("10-step-time", even + delay, measured=measured)
    for wrong in (even, delay, even + 2 * delay, (even + delay) * 2, even / 2 + delay, "0.14", None):
        assert not check("10-step-time", wrong, measured=measured), wrong
    # a lesson run's numbers: the straggler's work added half again, or a guess well short, are wrong
    even, delay, measured = 0.1150, 0.0926, 0.2076
    assert check("10-step-time", even + delay, measured=measured)
    for wrong in (0.16, 1.5 * even, even):
        assert not check("10-step-time", wrong, measured=measured), wrong
        assert not check("10-step-time", wrong, measured=measured, predicted=even + delay), wrong
    # a loaded machine: the fast ranks waited longer than the work added (33 + 34.5 ms against 80 ms)
    even, delay, measured = 0.0331, 0.0345, 0.0800
    assert not check("10-step-time", even + delay, measured=measured)
    assert check("10-step-time", even + delay, measured=measured, predicted=even + delay)
    for wrong in (1.5 * even, even, delay):
        assert not check("10-step-time", wrong, measured=measured, predicted=even + delay), wrong
    verdict = check("10-step-time", even + delay, measured=measured, predicted=even + delay)
    assert "12 ms more: they waited longer" in verdict.message and "\n" not in verdict.message, verdict
    # shared CPU cores: the fast ranks' steps grew by less than the work added (a lesson run: 42.5 + 45.5 ms
    # against 78.6 ms); the verdict says so, and by how much
    even, delay, measured = 0.0425, 0.0455, 0.0786
    verdict = check("10-step-time", even + delay, measured=measured, predicted=even + delay)
    assert verdict and "9 ms less: their steps grew by less" in verdict.message and "longer" not in verdict.message
    for wrong in (1.5 * even, even, delay, 2 * (even + delay)):
        assert not check("10-step-time", wrong, measured=measured, predicted=even + delay), wrong


def test_cluster_env_reaches_the_ranks_and_is_checked():
    with pytest.raises(ValueError, match="string values"):
        fsdplab.Cluster(2, env={"NCCL_DEBUG": 1})
    with fsdplab.Cluster(1, env={"FSDPLAB_PROBE": "on"}, spares=False) as one:
        assert one.run(lambda: __import__("os").environ.get("FSDPLAB_PROBE")) == ["on"]
