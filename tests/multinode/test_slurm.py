"""The Cluster across real Slurm nodes: two network namespaces, real munged, slurmctld and slurmds.

The kernel side runs inside node-a, as a notebook on a cluster's login node would: the controller must
listen on an address both nodes reach, and the host itself is on neither node's link. So one scenario
(this file run as a script, `python tests/multinode/test_slurm.py SCENARIO`) starts the cluster in node-a,
goes through start, collectives, output, a planted hang, a killed rank, restarts, stop and a pending
job, and prints what it measured as JSON; the tests below check that record and what is left on the
nodes afterwards. One scenario instead of one per test: each start costs a Slurm job and seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))   # netns, slurm_nodes: also when run as a script
from netns import NODES, two_nodes  # noqa: E402
from slurm_nodes import client, queue, slurm_nodes  # noqa: E402

SCENARIO_TIMEOUT_S = 400
HANG_TIMEOUT_S = 3.0
DAEMONS = ("slurmctld", "slurmscriptd", "slurmd")  # slurmscriptd: slurmctld's helper


@pytest.fixture(scope="module")
def record():
    """Build the nodes and daemons, run the scenario in node-a, and collect what is left afterwards."""
    t0 = time.monotonic()
    with two_nodes() as nodes, slurm_nodes(nodes) as conf:
        daemons_up_s = time.monotonic() - t0
        env = {**os.environ, "SLURM_CONF": str(conf), "PYTHONPATH": str(HERE.parents[1])}
        run = subprocess.run(nodes.cmd("node-a", [sys.executable, __file__, "scenario"]), env=env,
                             capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S, cwd=str(HERE.parents[1]))
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        assert run.returncode == 0 and lines, f"scenario failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
        out = json.loads(lines[-1][len("RESULT "):])
        out["daemons_up_s"] = daemons_up_s
        out["queue_after"] = queue(nodes, env)
        out["left"] = {node: _leftovers(nodes, node) for node in NODES}
        out["sinfo"] = client(nodes, ["sinfo", "-h", "-o", "%P %a"], env).stdout
    out["total_s"] = time.monotonic() - t0
    out["hang_detected_s"] = out["hang"].get("detected_s")
    out["death_detected_s"] = out["died"].get("detected_s")
    print("\nmulti-node timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(out.items())
                                               if k.endswith("_s") and isinstance(v, float)))
    return out


def _leftovers(nodes, node) -> list:
    """Processes in a node other than the Slurm daemons (the cluster's ranks, steps, controller)."""
    left = []
    for pid in nodes.pids(node):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if name not in DAEMONS:
            left.append(f"{pid} {name}: {argv[:120]}")
    return left


@pytest.mark.multinode
def test_ranks_start_on_both_nodes_in_node_order(record):
    places = record["places"]
    assert [p["rank"] for p in places] == [0, 1]
    assert [p["host"] for p in places] == ["node-a", "node-b"]
    # MASTER_ADDR is rank 0's address on the link between the nodes, never loopback.
    assert {p["master_addr"] for p in places} == {record["address_a"]}
    assert [(p["local_rank"], p["local_world_size"], p["node_rank"]) for p in places] == [(0, 1, 0), (0, 1, 1)]


@pytest.mark.multinode
def test_all_reduce_and_node_mesh_cross_the_nodes(record):
    assert record["all_reduce"] == [3.0, 3.0]
    assert record["node_mesh"] == [[2, 1], ["node", "local"]] * 2


@pytest.mark.multinode
def test_execute_shows_each_ranks_output(record):
    assert "hello from rank 0 on node-a" in record["execute_output"]
    assert "hello from rank 1 on node-b" in record["execute_output"]


@pytest.mark.multinode
def test_planted_hang_names_the_rank_on_node_b_and_its_stack(record):
    hang = record["hang"]
    assert hang["type"] == "RankHang" and hang["ranks"] == [1]
    assert "stuck_on_node_b" in hang["stack"]
    assert hang["detected_s"] < HANG_TIMEOUT_S + 5


@pytest.mark.multinode
def test_killed_rank_on_node_b_is_reported_within_seconds(record):
    died = record["died"]
    assert died["type"] == "RankDied" and died["ranks"] == [1] and died["hosts"] == {"1": "node-b"}
    assert "lost contact" in died["message"]
    assert died["detected_s"] < 10


@pytest.mark.multinode
def test_interrupt_reaches_the_rank_on_node_b(record):
    assert "the group is still usable" in record["interrupt"]
    assert record["after_interrupt"] == [0, 1]


@pytest.mark.multinode
def test_a_collected_cluster_leaves_no_job(record):
    assert len(record["collected"]["jobs_before"]) == 1
    assert record["collected"]["queue_after"] == []


@pytest.mark.multinode
def test_a_killed_kernel_leaves_no_job(record):
    assert len(record["killed_kernel"]["jobs_before"]) == 1, record["killed_kernel"]["output"]
    assert record["killed_kernel"]["queue_after"] == []


@pytest.mark.multinode
def test_restart_gives_a_fresh_group_on_both_nodes(record):
    assert record["after_restart"] == [[0, "node-a"], [1, "node-b"]]


@pytest.mark.multinode
def test_stop_cancels_the_job_and_leaves_no_process(record):
    assert record["queue_after_stop"] == []
    assert record["queue_after"] == []
    assert record["left"] == {"node-a": [], "node-b": []}


@pytest.mark.multinode
def test_pending_job_ends_in_slurms_reason_and_is_cancelled(record):
    pending = record["pending"]
    assert pending["type"] == "RuntimeError"
    # Slurm's own words: ReqNodeNotAvail at first, "Nodes required for job are DOWN..." once node-c is DOWN.
    assert "still pending" in pending["message"]
    assert re.search(r"Slurm's reason is '[^']*node", pending["message"], re.IGNORECASE)
    assert "cancelled" in pending["message"] and pending["queue_after"] == []


@pytest.mark.multinode
def test_bad_slurm_input_says_the_fix(record):
    bad = record["bad_input"]
    assert "multiple of 2" in bad["world_size"]
    assert "gpus_per_node<=0" in bad["gpus_per_node"]
    assert "backend='gloo'" in bad["nccl"]
    assert "is not a file" in bad["slurm_conf"]


def test_unknown_launcher_and_missing_slurm_tools(monkeypatch):
    import fsdplab

    with pytest.raises(ValueError, match="or one of 'local', 'slurm'"):
        fsdplab.Cluster(2, launcher="kubernetes")
    with pytest.raises(ValueError, match="only apply to launcher='slurm'"):
        fsdplab.Cluster(2, nodes=2)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="needs Slurm's tools"):
        fsdplab.Cluster(2, launcher="slurm", nodes=2)


def test_launcher_objects_hold_their_options_and_the_flat_form_still_works(monkeypatch):
    import warnings

    import fsdplab
    from fsdplab.runtime import launchers

    flat = dict(nodes=2, partition="gpu", time_limit="2:00:00", gpus_per_node=None, sbatch_args=None,
                slurm_conf=None, address=None, hosts=None, mpi_args=None, ssh_args=None, remote_python=None)
    written = launchers.resolve(fsdplab.Slurm(nodes=2, partition="gpu", time_limit="2:00:00"), dict.fromkeys(flat))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert (launchers.resolve("slurm", flat) == written
                == fsdplab.Slurm(nodes=2, partition="gpu", time_limit="2:00:00"))
    [note] = [w for w in seen if issubclass(w.category, FutureWarning)]
    assert "launcher=fsdplab.Slurm(nodes=2, partition='gpu', time_limit='2:00:00')" in str(note.message)
    assert launchers.resolve(fsdplab.Ssh(hosts=["a"]), dict.fromkeys(flat)).hosts == ["a"]
    assert launchers.resolve("local", dict.fromkeys(flat)) == fsdplab.Local()
    with pytest.raises(ValueError, match=r"hosts only apply to launcher='mpi' or 'ssh'"):
        launchers.resolve("slurm", {**dict.fromkeys(flat), "hosts": ["a"]})
    with pytest.raises(ValueError, match=r"put them in the object, e.g. launcher=fsdplab.Slurm\(nodes=...\)"):
        fsdplab.Cluster(2, launcher=fsdplab.Slurm(partition="gpu"), nodes=2)
    with pytest.raises(ValueError, match="multiple of 3"):
        fsdplab.Cluster(4, launcher=fsdplab.Ssh(hosts=["a", "b", "c"]))
    assert fsdplab.Cluster(2, launcher=fsdplab.Local()).launcher == fsdplab.Local() == fsdplab.Cluster(2).launcher
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="needs Slurm's tools"):
        fsdplab.Cluster(2, launcher=fsdplab.Slurm(nodes=2))


def test_ranks_follow_node_then_local_index_not_engine_id():
    from fsdplab.runtime.launchers.remote import rank_order

    # Engines in the order they connected: ipyparallel's ids follow this, Slurm's task ids do not.
    places = [{"nodeid": 1, "localid": 1, "procid": 3}, {"nodeid": 0, "localid": 1, "procid": 1},
              {"nodeid": 1, "localid": 0, "procid": 2}, {"nodeid": 0, "localid": 0, "procid": 0}]
    assert [places[i]["procid"] for i in rank_order(places)] == [0, 1, 2, 3]


def test_batch_script_asks_for_the_layout_and_passes_options_through():
    from fsdplab.runtime.launchers.slurm import SlurmOptions, batch_template

    opts = SlurmOptions(nodes=2, per_node=4, gpus_per_node=4, partition="gpu", time_limit="1:00:00",
                        sbatch_args=("--account=proj", "--comment={x}"), env={}, address="10.0.0.1")
    script = batch_template(opts).format(cluster_id="c1", n=8, program_and_args="python -m fsdplab.runtime.engine")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --ntasks=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --account=proj", "#SBATCH --comment={x}",
                 "srun --kill-on-bad-exit=0 python -m fsdplab.runtime.engine"):
        assert line in script.splitlines()


def test_ranks_get_the_threads_the_job_asks_for_not_the_kernels_environment(monkeypatch):

    from fsdplab.runtime.launchers.slurm import Slurm, SlurmOptions, batch_template, cpus_per_task

    assert cpus_per_task(None) == 1 and cpus_per_task(["--account=proj"]) == 1
    assert cpus_per_task(["--cpus-per-task=8"]) == 8 and cpus_per_task(["--cpus-per-task", "6"]) == 6
    assert cpus_per_task(["-c", "3"]) == 3 and cpus_per_task(["-c4"]) == 4
    with pytest.raises(ValueError, match="whole number of CPUs"):
        cpus_per_task(["--cpus-per-task=many"])
    # the kernel (a login node, or a job step of its own) may carry a SLURM_CPUS_PER_TASK of its own
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")
    opts = SlurmOptions(nodes=2, per_node=2, gpus_per_node=0, partition=None, time_limit=None,
                        sbatch_args=("--cpus-per-task=8",), env={}, address="10.0.0.1", cpus_per_task=8)
    assert Slurm().threads(opts, 4, "gloo") == 8
    # and each srun task gets those CPUs: srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05)
    script = batch_template(opts).format(cluster_id="c1", n=4, program_and_args="python -m fsdplab.runtime.engine")
    assert "srun --kill-on-bad-exit=0 --cpus-per-task=8 python -m fsdplab.runtime.engine" in script.splitlines()


# --- the scenario: runs inside node-a ---------------------------------------------------------------
def _scenario() -> dict:
    import contextlib
    import io
    import socket

    import fsdplab
    from fsdplab.runtime.hosts import route_address as address_toward

    out: dict = {"address_a": socket.gethostbyname("node-a")}
    t = time.monotonic()
    cluster = fsdplab.Cluster(2, launcher="slurm", nodes=2, timeout=60, start_timeout=90, quiet=True).start()
    out["start_s"] = time.monotonic() - t

    def place():
        env = os.environ
        return {"rank": fsdplab.rank(), "host": socket.gethostname(), "master_addr": env["MASTER_ADDR"],
                "local_rank": int(env["LOCAL_RANK"]), "local_world_size": int(env["LOCAL_WORLD_SIZE"]),
                "node_rank": fsdplab.ranks.node_rank()}

    def all_reduce():
        import torch
        import torch.distributed as dist

        x = torch.ones(1) * (fsdplab.rank() + 1)
        dist.all_reduce(x)
        return x.item()

    def node_mesh():
        mesh = fsdplab.ranks.node_mesh()
        return [list(mesh.shape), list(mesh.mesh_dim_names)]

    out["places"] = cluster.run(place)
    out["all_reduce"] = cluster.run(all_reduce)
    out["node_mesh"] = [x for pair in cluster.run(node_mesh) for x in pair]
    cluster.quiet = False
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        cluster.execute("import socket\nprint(f'hello from rank {rank()} on {socket.gethostname()}')")
    cluster.quiet = True
    out["execute_output"] = buffer.getvalue()

    # An interrupted kernel interrupts the rank on node-b too (through its answering thread).
    import signal
    import threading

    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        cluster.execute("import time\nif rank() == 1:\n    time.sleep(30)", timeout=60)
        out["interrupt"] = "not interrupted"
    except KeyboardInterrupt as error:
        out["interrupt"] = str(error)
    out["after_interrupt"] = cluster.run(fsdplab.rank)

    source = "def stuck_on_node_b():\n    import time\n    time.sleep(600)\n\nif rank() == 1:\n    stuck_on_node_b()\n"
    t = time.monotonic()
    try:
        cluster.execute(source, timeout=HANG_TIMEOUT_S)
        out["hang"] = {"type": None}
    except fsdplab.RankHang as error:
        out["hang"] = {"type": "RankHang", "ranks": error.ranks, "stack": error.stacks.get(1, ""),
                       "message": str(error), "detected_s": time.monotonic() - t}
    out["hang_timeout_s"] = HANG_TIMEOUT_S
    t = time.monotonic()
    cluster.restart()
    out["restart_after_hang_s"] = time.monotonic() - t

    def die_on_node_b():
        if fsdplab.rank() == 1:
            os.kill(os.getpid(), 9)
        time.sleep(60)

    t = time.monotonic()
    try:
        cluster.run(die_on_node_b, timeout=60)
        out["died"] = {"type": None}
    except fsdplab.RankDied as error:
        out["died"] = {"type": "RankDied", "ranks": sorted(error.exits), "hosts": error.hosts,
                       "message": str(error), "detected_s": time.monotonic() - t}
    t = time.monotonic()
    cluster.restart()
    out["restart_after_death_s"] = time.monotonic() - t
    out["after_restart"] = cluster.run(lambda: [fsdplab.rank(), socket.gethostname()])
    t = time.monotonic()
    cluster.stop()
    out["stop_s"] = time.monotonic() - t
    out["queue_after_stop"] = _queue()

    t = time.monotonic()
    try:
        fsdplab.Cluster(3, launcher="slurm", nodes=3, start_timeout=5, quiet=True).start()
        out["pending"] = {"type": None}
    except RuntimeError as error:
        out["pending"] = {"type": type(error).__name__, "message": str(error), "queue_after": _queue()}
    out["pending_s"] = time.monotonic() - t

    # A cluster dropped without stop(): the garbage collector cancels its job.
    import gc

    dropped = fsdplab.Cluster(2, launcher="slurm", nodes=2, quiet=True).start()
    jobs = _queue()
    del dropped
    gc.collect()
    out["collected"] = {"jobs_before": jobs, "queue_after": _queue()}

    # A killed kernel: its watcher cancels the job.
    kernel = subprocess.Popen([sys.executable, "-c", "import fsdplab, time\n"
                               "c = fsdplab.Cluster(2, launcher='slurm', nodes=2, quiet=True).start()\n"
                               "print('up', flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    started = kernel.stdout.readline()
    jobs = _queue()
    kernel.kill()
    kernel.wait()
    t = time.monotonic()
    while _queue() and time.monotonic() - t < 30:
        time.sleep(0.2)
    out["killed_kernel"] = {"jobs_before": jobs, "queue_after": _queue(),
                            "output": started + ("" if started else kernel.stderr.read()[-2000:])}
    out["killed_kernel_cleared_s"] = time.monotonic() - t

    bad = {}
    for name, kwargs in {"world_size": dict(world_size=3, nodes=2), "gpus_per_node": dict(gpus_per_node=1),
                         "nccl": dict(backend="nccl"), "slurm_conf": dict(slurm_conf="/nonexistent.conf")}.items():
        try:
            fsdplab.Cluster(**{"world_size": 2, "nodes": 2, "launcher": "slurm", **kwargs})
            bad[name] = "no error"
        except ValueError as error:
            bad[name] = str(error)
    out["bad_input"] = bad
    out["route_check"] = address_toward(out["address_a"])
    return out


def _queue() -> list:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()


if __name__ == "__main__" and sys.argv[1:] == ["scenario"]:
    print("RESULT " + json.dumps(_scenario()), flush=True)
