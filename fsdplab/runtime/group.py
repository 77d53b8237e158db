"""The ranks of a started cluster as the kernel sees them.

A `Group` holds what one start of a cluster made: ipyparallel's cluster and client, each rank's engine id and
process handle, what each rank's setup returned, the settings the ranks joined with, and the scratch folder.
It answers for the ranks: which are alive, how a dead one exited, what each is doing (`ask`, `status_rows`), where a
stuck one is (`stacks`), and what each one's flight recorder holds (`write_dumps`). The cluster owns one;
waiting on calls (fsdplab.runtime.call) and the launchers use it.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import time
from pathlib import Path

from . import introspect
from .errors import running_text, stack_of_thread
from .launchers.remote import RemoteRank
from .processes import alive


class Group:
    def __init__(self, world_size: int, backend: str, collective_timeout: float, threads: int, workdir: str):
        self.world_size, self.backend = world_size, backend
        self.collective_timeout, self.threads, self.workdir = collective_timeout, threads, workdir
        self.ipp = self.client = None
        self.engine_ids: list = []      # engine id of each rank, in rank order
        self.procs: dict = {}           # rank -> psutil.Process (RemoteRank for a rank on another node)
        self.launched_by: dict = {}     # rank pid -> the launcher's process, where they differ (fork server)
        self.info: list = []            # what each rank's setup returned, in rank order
        self.broken: str | None = None  # why the group is unusable, or None
        self.on_broken = None           # called with the reason when the group breaks (the cluster starts spares)

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def wait_for_new_engines(self, old_ids: set, timeout: float, start_problem) -> list:
        """The ids of `world_size` engines the controller registered that are not in `old_ids`, in id order.
        Each second (and at the deadline) `start_problem(elapsed, late)` says what keeps them (a failed or waiting
        job, an mpiexec that exited), raised as RuntimeError."""
        t0 = time.monotonic()
        deadline, next_look = t0 + timeout, t0 + 1.0
        while True:
            new = sorted(set(self.client.ids) - old_ids)
            if len(new) >= self.world_size:
                return new[:self.world_size]
            now = time.monotonic()
            if now > next_look or now > deadline:
                next_look = now + 1.0
                problem = start_problem(now - t0, now > deadline)
                if problem:
                    raise RuntimeError(problem)
            if now > deadline:
                raise RuntimeError(f"{self.world_size} rank process(es) did not start within {timeout:g} s; see the "
                                   f"engine logs in {self.path('profile/log')}, or try a smaller world_size.")
            time.sleep(0.02)

    def mark_broken(self, reason: str) -> None:
        self.broken = reason
        if self.on_broken is not None:
            self.on_broken(reason)

    def rank_alive(self, rank: int) -> bool:
        proc = self.procs[rank]
        return proc.alive(self.client) if isinstance(proc, RemoteRank) else alive(proc)

    def dead(self) -> list:
        return [r for r in self.procs if not self.rank_alive(r)]

    def host_of(self, rank: int) -> str | None:
        return getattr(self.procs[rank], "host", None)

    def ask(self, ranks: list, wait_s: float = 1.0, request: str | None = None) -> dict:
        """What each live rank of `ranks` is doing (fsdplab.runtime.introspect), by rank."""
        live = [r for r in ranks if r in self.procs and self.rank_alive(r)]
        return introspect.ask({r: self.procs[r].ask_target if isinstance(self.procs[r], RemoteRank)
                               else self.path(f"ask-rank{r}") for r in live}, wait_s=wait_s, request=request)

    def status_rows(self, world_size: int) -> list:
        """Per rank: pid, host, device, memory in use and what it runs right now (Cluster.status's rows)."""
        states = self.ask(list(range(world_size)))
        rows = []
        for r in range(world_size):
            state = states.get(r) or {}
            rows.append({"rank": r, "pid": self.procs[r].pid, "host": self.host_of(r) or socket.gethostname(),
                         "device": self.info[r]["device"], "rss_bytes": state.get("rss"),
                         "cuda_allocated_bytes": state.get("cuda_allocated"),
                         "cuda_reserved_bytes": state.get("cuda_reserved"),
                         "running": running_text(r, state, self.rank_alive(r))})
        return rows

    def write_dumps(self, folder, ranks: list, wait_s: float) -> dict:
        """Each rank's flight recorder dump in `folder`/rank_<r> (Cluster.flight_recorder_dumps): rank -> path,
        for the ranks that answered."""
        answers = self.ask(ranks, wait_s=wait_s,
                           request=f"{introspect.DUMP_REQUEST}{os.getpid()}-{time.monotonic_ns()}")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = {}
        for rank, answer in sorted(answers.items()):
            if "fr_dump" in answer:
                written[rank] = folder / f"rank_{rank}"
                written[rank].write_bytes(base64.b64decode(answer["fr_dump"]))
        return written

    def signal(self, rank: int, sig) -> None:
        try:
            self.procs[rank].send_signal(sig)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def stacks(self, stuck: list) -> dict:
        """The main thread's stack of each rank in `stuck` on this machine, from faulthandler (a rank stuck in a
        collective sits in C++ code, where only faulthandler's signal reaches it)."""
        offsets = {}
        stuck = [r for r in stuck if not isinstance(self.procs.get(r), RemoteRank)]  # no file to read there
        for r in stuck:
            path = self.path(f"stack-rank{r}.txt")
            offsets[r] = os.path.getsize(path) if os.path.exists(path) else 0
            self.signal(r, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in stuck:
            try:
                with open(self.path(f"stack-rank{r}.txt")) as f:
                    f.seek(offsets[r])
                    stacks[r] = stack_of_thread(f.read(), self.info[r]["main_thread"])
            except OSError:
                stacks[r] = "(no stack captured)"
        return stacks

    def exit_code(self, rank: int):
        proc = self.procs[rank]
        if isinstance(proc, RemoteRank):
            return None  # the launcher does not report it (Slurm without accounting): "lost contact"
        proc = self.launched_by.get(proc.pid, proc)   # forked: its stand-in exits with the same code
        # ipyparallel's launcher thread reaps the engine and psutil caches the code on that Process
        # object; waiting here as well would race it for the code.
        # Copies: ipyparallel drops a dead engine from these tables while we look.
        for engine_set in list(self.ipp.engines.values()) if self.ipp is not None else []:
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                if launcher.pid == proc.pid and getattr(launcher, "_wait_thread", None) is not None:
                    launcher._wait_thread.join(timeout=5)
        code = getattr(proc, "_exitcode", None)
        if not isinstance(code, int):
            try:
                code = proc.wait(timeout=1)
            except Exception:  # noqa: BLE001
                code = None
        return None if code is None else int(code)
