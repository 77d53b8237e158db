"""Watcher that kills a cluster's processes when the notebook kernel that owns them is gone.

Run as `python -m fsdplab._reaper KERNEL_PID PIDFILE`. The pid file lists the rank and controller
processes (rewritten on restart). Cluster.stop() kills this watcher on a normal shutdown.
"""

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


def main(kernel_pid: int, pidfile: str) -> None:
    try:
        kernel = psutil.Process(kernel_pid)
    except psutil.NoSuchProcess:
        kernel = None
    while kernel is not None and not _gone(kernel):
        time.sleep(0.5)
    # The controller runs its schedulers as child processes: collect every descendant before killing,
    # or they would outlive it as orphans.
    victims = []
    for pid in _pids(pidfile):
        try:
            proc = psutil.Process(pid)
            victims += [proc] + proc.children(recursive=True)
        except psutil.Error:
            pass
    for proc in victims:
        try:
            proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
