"""Stand-in for `python -m MODULE ARGS...` that asks fsdplab's fork server to run MODULE in a fork of itself.

    python -I .../fsdplab/runner/fork_client.py MODULE [ARGS...]
    python -I .../fsdplab/runner/fork_client.py --multiprocessing TRACKER_FD PIPE_FD FD,FD,...

The second form stands in for a worker of multiprocessing's "spawn" start method (fsdplab.memory.workers): the
fork runs `spawn_main(tracker_fd=TRACKER_FD, pipe_handle=PIPE_FD)` with the listed descriptors open at the same
numbers, as the spawned interpreter would have them; the client dies with the process that started it.

Run by path in isolated mode, it imports only the standard library (about 20 ms) instead of torch. It sends
the server its environment, working folder and standard streams, then stays as the process its launcher
started: it passes on the signals it gets and exits as the forked process did (same code, same signal). When
FSDPLAB_FORKSERVER names no server that answers, it becomes `python -m MODULE ARGS...` itself.
"""

import json
import os
import signal
import socket
import sys

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


MULTIPROCESSING = "--multiprocessing"


def _fallback(module: str, args: list):
    if module == MULTIPROCESSING:   # what multiprocessing's spawn runs
        code = f"from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd={args[0]}, pipe_handle={args[1]})"
        os.execv(sys.executable, [sys.executable, "-c", code, "--multiprocessing-fork"])
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _die_with_parent() -> None:
    """SIGKILL when the process that started this one exits (Linux's PR_SET_PDEATHSIG), as a spawned worker
    would be killed with it: the server then kills the fork, whose client is gone."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _read_line(conn: socket.socket):
    """One line from the server; b"" when it closed the connection, None when it was killed (reset)."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = conn.recv(64)
        except ConnectionResetError:
            return None
        if not chunk:
            return b""
        data += chunk
    return data


def _end_as_asked(pending: list) -> None:
    """A stop signal came before there was a fork to pass it on to: end as that signal would have."""
    for signum in pending:
        if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def main(argv: list) -> None:
    module, args = argv[0], argv[1:]
    path = os.environ.get("FSDPLAB_FORKSERVER")
    if not path:
        _fallback(module, args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:   # no server (it ended, or never started): an ordinary start
        conn.close()
        _fallback(module, args)
    pending = []   # signals that come before the fork's pid: passed on once it is known
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    env = {**os.environ, "FSDPLAB_LAUNCHED_BY": str(os.getpid())}   # which process the launcher watches
    request = {"module": module, "args": args, "env": env, "cwd": os.getcwd()}
    fds = [0, 1, 2]
    if module == MULTIPROCESSING:
        _die_with_parent()
        request["fds"] = [int(fd) for fd in args[2].split(",")]
        fds += request["fds"]
    data = json.dumps(request).encode()
    socket.send_fds(conn, [len(data).to_bytes(8, "big")], fds)
    conn.sendall(data)
    line = _read_line(conn)
    if line is None:   # the server was killed (the run is ending): no fork, and no ordinary start
        os._exit(1)
    if not line:   # the server closed without forking: an ordinary start
        conn.close()
        _end_as_asked(pending)
        _fallback(module, args)
    pid = int(line)
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    for signum in pending:
        os.kill(pid, signum)
    line = _read_line(conn)   # the forked process's wait status, once it has exited
    if not line:              # the server died, and its forks with it
        os._exit(1)
    code = os.waitstatus_to_exitcode(int(line))
    if code < 0:              # ended by a signal: end the same way, so the launcher sees the same status
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
