"""The LoRA recipe under multi-node torchrun, for real: one torchrun per node on the two network namespaces of
`netns.two_nodes()` (node-a, node-b: their own addresses, hostnames and hosts files), 1 rank per node, with
static rendezvous (--node-rank, --master-addr) and with c10d rendezvous (--rdzv-endpoint node-a:PORT).
Both must train what 2 data-parallel ranks train (same seed): the reference is this process stepping on the
mean loss of both ranks' batches (seconds, where a third torchrun would take tens; the ranks match it to the
bit); only rank 0, on node-a, writes the adapter. Then lesson 07's cross-node section, through papermill,
on 2 real Slurm nodes.

Needs root (namespaces); skips without it, or fails under FSDPLAB_REQUIRE_MULTINODE=1."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from netns import NODES, two_nodes

pytestmark = pytest.mark.multinode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = ["-m", "fsdplab.recipes.lora", "--lora-rank", "8", "--steps", "3", "--batch-size", "4",
          "--precision", "fp32", "--log-every", "1"]
TIMEOUT_S = 240


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GLOO_SOCKET_IFNAME")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"   # what torchrun sets for several ranks on one machine: the same arithmetic
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _losses(stdout: str) -> list:
    return [float(x) for x in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", stdout)]


def _adapter(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def _run_on_nodes(nodes, argv_of: dict) -> tuple:
    """Start one command per node at once; wait for both. Returns ({node: CompletedProcess-like}, seconds)."""
    start = time.perf_counter()
    procs = {node: subprocess.Popen(nodes.cmd(node, argv_of[node]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=_env()) for node in NODES}
    outs = {}
    try:
        for node, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            outs[node] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs, time.perf_counter() - start


@pytest.fixture(scope="module")
def nodes():
    with two_nodes() as n:
        yield n


@pytest.fixture(scope="module")
def one_machine():
    """The reference, in this process: RECIPE's model, adapters and optimizer, each step on the mean of
    rank 0's and rank 1's losses (what FSDP's averaged gradients give), rank 0's loss kept (what it prints)."""
    import torch

    from fsdplab.recipes import lora as L
    from fsdplab.settings import TrainSetting
    from fsdplab.sharding import build_model, loss_of, make_optimizer

    task = L.StringTask("sort")
    setting = TrainSetting(model=L.miniature_config(task.tokenizer), world_size=2, precision="fp32", lora_rank=8,
                           seq_len=task.seq_len, batch_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the ranks' OMP_NUM_THREADS: the same kernels, the same sums
    try:
        model = build_model(setting.replace(activation_checkpointing=False), device="cpu", seed=0)
        optimizer = make_optimizer(model, "adamw", lr=2e-3)
        losses = []
        for step in range(3):
            per_rank = [loss_of(model, dict(zip(("input_ids", "labels"), task.batch(4, seed=100_003 * r + step))))
                        for r in range(2)]
            (sum(per_rank) / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(round(per_rank[0].item(), 4))
    finally:
        torch.set_num_threads(threads)
    adapter = {k.replace(".default.", "."): v.detach() for k, v in model.state_dict().items() if "lora_" in k}
    return {"losses": losses, "adapter": adapter}


def _check_same_training(outs, out_dir, one_machine):
    for node in NODES:
        assert outs[node].returncode == 0, f"{node}:\n{outs[node].stdout[-3000:]}\n{outs[node].stderr[-3000:]}"
    head = outs["node-a"].stdout
    # rank 0 ran on node-a and wrote the adapter there; node-b's rank printed nothing of its own
    assert f"adapter saved to {out_dir} on node-a" in head, head
    assert "adapter saved" not in outs["node-b"].stdout
    assert _losses(head) == one_machine["losses"] and len(one_machine["losses"]) == 3
    adapter, expected = _adapter(out_dir), one_machine["adapter"]
    assert adapter.keys() == expected.keys()
    for name in expected:   # equal to the bit here; the tolerance leaves room for another CPU's kernels
        torch.testing.assert_close(adapter[name], expected[name], rtol=1e-5, atol=1e-7)


def test_static_rendezvous(nodes, one_machine, tmp_path):
    master = nodes.addresses["node-a"]
    argv = {node: _torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(i), "--master-addr",
                            master, "--master-port", "29400", *RECIPE, "--output-dir", str(tmp_path))
            for i, node in enumerate(NODES)}
    outs, seconds = _run_on_nodes(nodes, argv)
    _check_same_training(outs, tmp_path, one_machine)
    print(f"static rendezvous, 2 nodes: {seconds:.1f} s")


def test_c10d_rendezvous_by_hostname(nodes, one_machine, tmp_path):
    # each node's hostname resolves to its routable address (its hosts file), as on a real cluster: the
    # endpoint is a hostname and torchrun needs neither --local-addr nor is_host
    argv = {node: _torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "node-a:29500", "--rdzv-id", "fsdplab-lora", *RECIPE,
                            "--output-dir", str(tmp_path))
            for node in NODES}
    outs, seconds = _run_on_nodes(nodes, argv)
    _check_same_training(outs, tmp_path, one_machine)
    print(f"c10d rendezvous, 2 nodes: {seconds:.1f} s")


@pytest.fixture(scope="module")
def slurm_conf(nodes):
    """One real Slurm cluster on the two nodes for this file's Slurm tests (its start takes most of a minute)."""
    from slurm_nodes import slurm_nodes

    with slurm_nodes(nodes) as conf:
        yield conf


def test_lesson_07_across_real_nodes_through_slurm(nodes, slurm_conf, tmp_path):
    """Lesson 07's section 5 for real: papermill in node-a (a login node), 2 Slurm nodes x 1 rank; the bytes
    node-a's and node-b's interfaces carried against the count and the cost model."""
    import json

    env = {**_env(), "SLURM_CONF": str(slurm_conf), "FSDPLAB_FIGURES": str(tmp_path / "figures")}
    cmd = [sys.executable, "-m", "fsdplab", "run", "07", "--world-size", "1", "--no-progress",
           "-p", "nodes_launcher", "slurm", "-p", "slurm_conf", str(slurm_conf), "--out", str(tmp_path)]
    start = time.perf_counter()
    proc = subprocess.run(nodes.cmd("node-a", cmd), capture_output=True, text=True, env=env, timeout=400,
                          cwd=ROOT)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    executed = json.loads(next(tmp_path.glob("**/07_scaling_out*.ipynb")).read_text())
    text = "".join(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"])
                   for c in executed["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    rows = {}
    for strategy in ("FULL_SHARD", "HSDP"):
        line = re.search(rf"^{strategy}\s+(\S+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)"
                         rf"\s+([\d.]+)$", text, re.M)
        assert line, text[-3000:]
        interface, *numbers = line.groups()
        wire, wire_rx, counted, model, as_run = (float(x.replace(",", "")) for x in numbers[:5])
        rows[strategy] = dict(interface=interface, wire=wire, wire_rx=wire_rx, counted=counted, model=model,
                              as_run=as_run)
        assert interface != "lo"                                   # the veth between the nodes, not loopback
        assert counted == pytest.approx(model)
        # what left the nodes: at least gloo's payload, at most a few percent of headers and messages on top
        assert as_run <= wire <= 1.1 * as_run, rows
        assert wire_rx == pytest.approx(wire, rel=0.02)            # node-a's tx is node-b's rx and back
    assert rows["HSDP"]["wire"] < rows["FULL_SHARD"]["wire"]
    print(f"lesson 07 across 2 Slurm nodes: {seconds:.1f} s; bytes per step across the nodes: "
          + "; ".join(f"{k} wire {v['wire']:,.0f} counted {v['counted']:,.0f} model {v['model']:,.0f} "
                      f"as run {v['as_run']:,.0f}" for k, v in rows.items()))


def _first_error(log: str) -> str:
    """A failed job's log, shortened to its first traceback (the cause: a node that fails first takes the store
    down, and the other node's traceback that follows names only that) and its last lines."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line or "Error" in line), len(lines))
    return "\n".join(["first error:", *lines[max(0, first - 5):first + 40], "...", "last lines:", *lines[-30:]])


def test_an_exported_lesson_runs_as_a_slurm_batch_job_on_both_nodes(nodes, slurm_conf, tmp_path):
    """`fsdplab export 14 --sbatch 2 --ranks-per-node 1 --cpu`, submitted with sbatch on node-a: one torchrun per
    node through srun, c10d rendezvous at the job's first node. Rank 0's records show that both ranks took part
    (the ring's bytes sent by each) and the lesson's checks passed."""
    import json

    from fsdplab.runner.cli import main

    script = tmp_path / "lesson14.py"
    assert main(["export", "14", "--out", str(script), "--sbatch", "2", "--ranks-per-node", "1", "--cpu"]) == 0
    records = tmp_path / "records.jsonl"
    env = {**_env(), "SLURM_CONF": str(slurm_conf), "FSDPLAB_RECORDS": str(records),
           "FSDPLAB_FIGURES": str(tmp_path / "figures"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}   # the job's python
    start = time.perf_counter()
    proc = subprocess.run(nodes.cmd("node-a", ["sbatch", "--wait", "--chdir", str(tmp_path),
                                               str(tmp_path / "lesson14.sbatch")]),
                          capture_output=True, text=True, env=env, timeout=400)
    seconds = time.perf_counter() - start
    logs = "".join(p.read_text() for p in tmp_path.glob("lesson14-*.log"))
    assert proc.returncode == 0, proc.stdout + proc.stderr + _first_error(logs)
    found = {r["name"]: r for r in map(json.loads, records.read_text().splitlines())}
    tensor_bytes = 4 * 2**18                              # the lesson's ring_numel fp32 elements
    assert found["14-ring-sent"]["value"] == [tensor_bytes, tensor_bytes]     # 2(N-1)/N at N = 2, on each rank
    failed = [name for name, r in found.items() if "ok" in r and not r["ok"]]
    assert not failed and found["14-ddp-rule"]["ok"], failed
    print(f"lesson 14 as a Slurm batch job on 2 nodes: {seconds:.1f} s, {len(found)} records")
