"""Ranks on the nodes of a Slurm cluster: the options, their checks, and the job's life.

`Cluster(world_size, launcher=fsdplab.Slurm(nodes=2, ...))` keeps the kernel and the ipyparallel controller
where the notebook runs (a login node) and starts the ranks with ipyparallel's own Slurm engine
launcher: one `sbatch` job, one `srun` task per rank. Everything here is what fsdplab adds to it: the
batch script (nodes, tasks per node, GPUs, partition, time limit, extra #SBATCH lines), checks that
turn bad input into a ValueError that says the fix, the job's state while it starts (a job that stays
pending ends in an error naming Slurm's reason), and cancelling it (`scancel`, then waiting until
`squeue` no longer lists it).

Nothing assumes a shared filesystem: the engines get the controller's address in their environment
(sbatch --export=ALL), and everything else goes over the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import time

from ..hosts import this_address
from .remote import RemoteLauncher

TOOLS = ("sbatch", "squeue", "scancel", "sinfo")
# Slurm job states that end a job: the ranks will never start.
_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
          "PREEMPTED", "TIMEOUT"}


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    """Where the ranks run: `nodes` nodes, `per_node` ranks on each, the job's settings."""

    nodes: int
    per_node: int
    gpus_per_node: int
    partition: str | None
    time_limit: str | None
    sbatch_args: tuple
    env: dict  # the environment for Slurm's tools (SLURM_CONF set when given)
    address: str  # where the nodes reach this machine (the controller)
    cpus_per_task: int = 1  # each rank's CPUs: sbatch's --cpus-per-task in sbatch_args, read once by `options`


def _slurm_env(slurm_conf) -> dict:
    env = dict(os.environ)
    if slurm_conf is not None:
        if not os.path.isfile(slurm_conf):
            raise ValueError(f"slurm_conf={slurm_conf!r} is not a file. Give the path of the cluster's "
                             "slurm.conf (often /etc/slurm/slurm.conf), or leave it out to use $SLURM_CONF.")
        env["SLURM_CONF"] = os.path.abspath(slurm_conf)
    elif env.get("SLURM_CONF") and not os.path.isfile(env["SLURM_CONF"]):
        raise ValueError(f"$SLURM_CONF names {env['SLURM_CONF']!r}, which does not exist. Point it at the "
                         "cluster's slurm.conf, or pass slurm_conf=PATH.")
    return env


def _node_gpus(env: dict, partition) -> list[int]:
    """GPUs of each node of the partition (from its GRES), asking slurmctld through sinfo."""
    argv = ["sinfo", "-h", "-N", "-o", "%N|%G"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    except subprocess.TimeoutExpired:
        raise ValueError("sinfo did not answer within 30 s: is slurmctld reachable from here "
                         "(SLURM_CONF, the network)?") from None
    if out.returncode != 0:
        raise ValueError(f"Slurm does not answer here: `{' '.join(argv)}` said: {out.stderr.strip()}. "
                         "Run the notebook on a node of the cluster (a login node) and set SLURM_CONF, "
                         "or pass slurm_conf=PATH.")
    gpus = {}
    for line in out.stdout.splitlines():
        name, _, gres = line.partition("|")
        count = 0
        for item in gres.split(","):
            parts = item.split("(")[0].split(":")
            if parts[0] == "gpu" and parts[-1].isdigit():
                count += int(parts[-1])
        gpus[name] = count
    if not gpus:
        raise ValueError(f"the partition {partition!r} has no nodes (sinfo lists none). "
                         "Give an existing partition= (sinfo lists them) or leave it out for the default.")
    return list(gpus.values())


def options(world_size: int, backend: str, *, nodes, gpus_per_node, partition, time_limit, sbatch_args,
            slurm_conf, address) -> tuple[SlurmOptions, str]:
    """Checked options and the backend ('auto' -> nccl when the nodes have a GPU per rank; the caller,
    Slurm.prepare, has checked its name)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ValueError(f"launcher='slurm' needs Slurm's tools ({', '.join(missing)} not found). Run the "
                         "notebook on a login node of the cluster, or install the client (Debian/Ubuntu: "
                         "apt-get install slurm-client) and set SLURM_CONF.")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"nodes is the number of Slurm nodes, a whole number >= 1, got {nodes!r}.")
    if world_size % nodes:
        raise ValueError(f"world_size={world_size} does not split evenly over nodes={nodes}: every node runs "
                         f"the same number of ranks. Use a world_size that is a multiple of {nodes}.")
    per_node = world_size // nodes
    args = tuple(sbatch_args or ())
    if not all(isinstance(a, str) and a.startswith("-") for a in args):
        raise ValueError(f"sbatch_args is a list of sbatch options such as ['--account=proj', "
                         f"'--qos=debug'], got {sbatch_args!r}.")
    cpus = cpus_per_task(args)   # a bad --cpus-per-task fails here, before a job is submitted
    env = _slurm_env(slurm_conf)
    node_gpus = _node_gpus(env, partition)
    most = max(node_gpus)
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 0):
        raise ValueError(f"gpus_per_node is a whole number >= 0, got {gpus_per_node!r}.")
    if gpus_per_node is not None and gpus_per_node > most:
        raise ValueError(f"gpus_per_node={gpus_per_node} is more than any node of the partition has "
                         f"({most}). Use gpus_per_node<={most}, or another partition=.")
    gpus = per_node if gpus_per_node is None else gpus_per_node
    if backend == "nccl" and (most < per_node or gpus < per_node):
        raise ValueError(f"backend='nccl' needs one GPU per rank: {per_node} rank(s) per node, but the nodes "
                         f"have at most {most} GPU(s)" + (f" and gpus_per_node={gpus_per_node}"
                                                          if gpus_per_node is not None else "")
                         + ". Use backend='gloo' (CPU ranks), more nodes, or a GPU partition=.")
    if backend == "auto":
        backend = "nccl" if most >= per_node and gpus >= per_node else "gloo"
    chosen = SlurmOptions(nodes, per_node, gpus if backend == "nccl" else (gpus_per_node or 0), partition,
                          time_limit, args, env, address or this_address(), cpus_per_task=cpus)
    return chosen, backend


def cpus_per_task(sbatch_args) -> int:
    """The CPUs each rank gets: sbatch's --cpus-per-task (or -c) in `sbatch_args`, else Slurm's default of 1;
    given twice, the later one, as sbatch takes it. Read from the options, not from this process's
    SLURM_CPUS_PER_TASK: the kernel runs outside the job. `options` reads it once, into SlurmOptions."""
    # exit_on_error=False: a bad value raises ArgumentError instead of ending the kernel with SystemExit
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("-c", "--cpus-per-task", type=int, default=1)
    fix = "--cpus-per-task (or -c) in sbatch_args takes a whole number of CPUs >= 1"
    try:
        cpus = parser.parse_known_args(list(sbatch_args or ()))[0].cpus_per_task
    except argparse.ArgumentError as e:   # not a whole number, or no value after the option
        raise ValueError(f"{fix}: {e.message}.") from None
    if cpus < 1:
        raise ValueError(f"{fix}, got {cpus}.")
    return cpus


def batch_template(opts: SlurmOptions) -> str:
    """ipyparallel's Slurm engine script with fsdplab's layout: `per_node` tasks on each of `nodes` nodes."""
    lines = ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=fsdplab-{cluster_id}",
             f"#SBATCH --nodes={opts.nodes}", f"#SBATCH --ntasks-per-node={opts.per_node}",
             "#SBATCH --ntasks={n}", "#SBATCH --output=/dev/null"]
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    if opts.time_limit:
        lines.append(f"#SBATCH --time={opts.time_limit}")
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    # The user's own options last: sbatch lets a later one win. Braces would be template fields.
    lines += ["#SBATCH " + a.replace("{", "{{").replace("}", "}}") for a in opts.sbatch_args]
    # --kill-on-bad-exit=0: one rank that dies must not take the others down before the kernel looks.
    # srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and later): it is asked for again.
    cpus = opts.cpus_per_task
    lines.append("srun --kill-on-bad-exit=0 " + (f"--cpus-per-task={cpus} " if cpus > 1 else "") + "{program_and_args}")
    return "\n".join(lines) + "\n"


def job_ids(ipp_cluster) -> list[str]:
    return [js.job_id for js in list(ipp_cluster.engines.values()) if getattr(js, "job_id", "")]


def job_state(job: str, env: dict) -> tuple[str | None, str]:
    """(state, reason) of a job as squeue reports it; (None, '') once it has left the queue."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True, text=True,
                             env=env, timeout=10)
    except subprocess.TimeoutExpired:
        return "UNKNOWN", "squeue did not answer"
    line = out.stdout.strip().splitlines()
    if out.returncode != 0 or not line:
        return None, ""
    state, _, reason = line[0].partition("|")
    return state, reason


def cancel(jobs, env: dict, wait_s: float = 20.0) -> list[str]:
    """scancel the jobs and wait until squeue no longer lists them; returns those still listed."""
    jobs = [j for j in jobs if j]
    if not jobs:
        return []
    subprocess.run(["scancel", *jobs], capture_output=True, env=env, timeout=30)
    deadline = time.monotonic() + wait_s
    while True:
        left = [j for j in jobs if job_state(j, env)[0] is not None]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def start_problem(job: str, env: dict, waited_s: float, timed_out: bool) -> str | None:
    """Why the job's ranks are not up yet, as an error message; None while waiting longer makes sense."""
    state, reason = job_state(job, env)
    if state in _ENDED or (state is None and not timed_out):
        return (f"the Slurm job {job} ended before its ranks connected (state {state or 'gone'}"
                + (f", reason {reason}" if reason and reason != "None" else "")
                + "). Check that the nodes can run this Python and reach this machine, or run sbatch "
                  "with --output=FILE in sbatch_args to see the ranks' output.")
    if not timed_out:
        return None
    if state == "PENDING":
        return (f"the Slurm job {job} was still pending after {waited_s:.0f} s: Slurm's reason is "
                f"'{reason}'. The job was cancelled. Ask for fewer nodes or GPUs, another partition=, or a "
                "longer start_timeout= if the cluster is just busy.")
    return (f"the Slurm job {job} is {state} but its ranks did not connect within {waited_s:.0f} s. The job "
            "was cancelled. The nodes must reach this machine's controller ports (see the README, 'More "
            "than one machine').")


def placement() -> dict:
    """On a rank: where Slurm put it (task id, node index, index on the node) and its host."""
    def number(name):
        value = os.environ.get(name, "")
        return int(value) if value.isdigit() else None

    return {"procid": number("SLURM_PROCID"), "nodeid": number("SLURM_NODEID"),
            "localid": number("SLURM_LOCALID"), "host": socket.gethostname(), "pid": os.getpid()}


@dataclasses.dataclass(frozen=True)
class Slurm(RemoteLauncher):
    """The ranks run in one Slurm job of `nodes` nodes: Cluster(8, launcher=Slurm(nodes=2, partition="gpu")).

    `gpus_per_node` (default: one per rank under nccl), `partition`, `time_limit` (sbatch --time, e.g.
    "1:00:00"), `sbatch_args` (more sbatch options, e.g. ["--account=proj"]; CPU ranks run as many threads as
    its --cpus-per-task, else 1), `slurm_conf` (default $SLURM_CONF), `address` (where the nodes reach this
    machine; default what its host name resolves to). A job still pending after the cluster's start_timeout
    is cancelled, with Slurm's reason."""

    kind = "slurm"
    nodes: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time_limit: str | None = None
    sbatch_args: list | None = None
    slurm_conf: str | None = None
    address: str | None = None

    def prepare(self, world_size: int, backend: str) -> tuple:
        from ..processes import choose_backend, requested_backend

        choose_backend(world_size, "gloo")  # checks world_size
        return options(world_size, requested_backend(backend), nodes=self.nodes or 1,
                       gpus_per_node=self.gpus_per_node, partition=self.partition, time_limit=self.time_limit,
                       sbatch_args=self.sbatch_args, slurm_conf=self.slurm_conf, address=self.address)

    def threads(self, plan, world_size: int, backend: str) -> int:
        return plan.cpus_per_task if backend == "gloo" else 4   # a Slurm task gets one CPU unless asked for more

    def configure(self, ipp, plan, env: dict, path) -> None:
        """Point ipyparallel's Slurm launcher at the nodes: batch script, engine command and environment."""
        launcher = ipp.config.SlurmEngineSetLauncher
        launcher.batch_template = batch_template(plan)
        # sbatch runs with the kernel's environment plus these; --export=ALL hands them to every rank.
        launcher.environment = {**env, **({"SLURM_CONF": plan.env["SLURM_CONF"]} if "SLURM_CONF" in plan.env else {})}
        launcher.batch_file_name = path("slurm_engines.sbatch")
        launcher.engine_args = list(ipp.config.LocalEngineSetLauncher.engine_args)
        launcher.engine_cmd = self.engine_cmd()

    def refused(self, error: Exception) -> str | None:
        if isinstance(error, subprocess.CalledProcessError):
            return (f"sbatch refused the job (exit code {error.returncode}; its message is printed above): check "
                    "nodes=, partition=, time_limit= and sbatch_args=.")
        return None

    def jobs(self, ipp) -> list:
        return job_ids(ipp)

    def tool_env(self, plan) -> dict | None:
        return plan.env

    def start_problem(self, plan, ipp, jobs: list, waited_s: float, timed_out: bool) -> str | None:
        if not jobs:
            return None
        problem = start_problem(jobs[0], plan.env, waited_s, timed_out)
        if problem:
            left = cancel(jobs, plan.env)
            problem += f" (squeue still lists {left})" if left else ""
        return problem

    def places(self, plan, group) -> list:
        return group.client[group.engine_ids].apply_async(placement).get(timeout=120)

    def stop(self, plan, ipp, jobs: list) -> list:
        """Cancel the ranks' job; its steps stop while the controller is still there."""
        jobs[:] = cancel(jobs, plan.env) if jobs else []
        return [f"Slurm job {j} (squeue still lists it)" for j in jobs]
