"""Watcher that kills a cluster's processes when the notebook kernel that owns them is gone.

Run as `python -m fsdplab.runtime.reaper KERNEL_PID WORKDIR`, before the cluster starts any process. When the
kernel is gone it kills every process started for the cluster: those listed in WORKDIR/pids and any
process whose command line or environment names WORKDIR (ipyparallel passes its profile folder, which
lives there, to the controller and every engine), so a kernel killed half-way through start-up leaves
nothing behind, and it cancels the Slurm jobs listed in WORKDIR/slurm_jobs (ranks on other nodes).
Then it removes WORKDIR (it holds the connection keys). Cluster.stop() kills this watcher on a normal
shutdown.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import psutil


def _pids(path):
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _gone(kernel) -> bool:
    # A killed kernel stays a zombie until its parent reaps it: that counts as gone.
    try:
        return kernel.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _names_workdir(proc, workdir: str) -> bool:
    try:
        if any(workdir in arg for arg in proc.cmdline()):
            return True
        return any(workdir in value for value in proc.environ().values())
    except psutil.Error:
        return False


def _victims(workdir: str) -> list:
    found = {}
    for pid in _pids(os.path.join(workdir, "pids")):
        try:
            found[pid] = psutil.Process(pid)
        except psutil.Error:
            pass
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid != me and proc.pid not in found and _names_workdir(proc, workdir):
            found[proc.pid] = proc
    # Children first collected, then killed: a killed parent's children would be re-parented and lost.
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            pass
    return list(found.values())


def _cancel_jobs(workdir: str) -> None:
    try:
        with open(os.path.join(workdir, "slurm_jobs")) as f:
            listed = json.load(f)
    except (OSError, ValueError):
        return
    env = dict(os.environ)
    if listed.get("slurm_conf"):
        env["SLURM_CONF"] = listed["slurm_conf"]
    try:
        subprocess.run(["scancel", *map(str, listed.get("jobs") or [])], env=env, timeout=30,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        pass


def main(kernel_pid: int, workdir: str) -> None:
    if os.path.isfile(workdir):  # an older caller passed WORKDIR/pids
        workdir = os.path.dirname(workdir)
    try:
        kernel = psutil.Process(kernel_pid)
    except psutil.NoSuchProcess:
        kernel = None
    while kernel is not None and not _gone(kernel):
        time.sleep(0.5)
    _cancel_jobs(workdir)
    # A process being launched while the kernel died appears a moment later: look a few times.
    for _ in range(3):
        for proc in _victims(workdir):
            try:
                proc.kill()
            except psutil.Error:
                pass
        time.sleep(0.5)
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
