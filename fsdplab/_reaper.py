"""Watcher that kills a cluster's processes when the notebook kernel that owns them is gone.

Run as `python -m fsdplab._reaper KERNEL_PID PIDFILE`. The pid file lists the rank and controller
processes (rewritten on restart). Cluster.stop() kills this watcher on a normal shutdown.
"""

import os
import signal
import sys
import time


def _pids(path):
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def main(kernel_pid: int, pidfile: str) -> None:
    while True:
        try:
            os.kill(kernel_pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(0.5)
    for pid in _pids(pidfile):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
