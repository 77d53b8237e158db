"""How the kernel waits for the ranks: results, output, and every way a call can fail.

`Waiting` is the part of `fsdplab.Cluster` that runs while a call is in flight: it polls the results,
echoes the ranks' output, and turns a failure into `RankError` (a rank raised; early when the others wait
for it in a collective), `RankHang` (the timeout passed: what each rank is doing and where it is stuck),
`RankDied` (a rank process exited, or its node stopped answering) or a KeyboardInterrupt that says
whether the group is still usable. A rank on this machine is watched through its process; a rank on
another node through the controller's heartbeat and its answering port.
"""

from __future__ import annotations

import os
import signal
import time

from . import hang
from .faults import RankDied, RankError, RankHang, _failures, _is_failure, _stack_of_thread, _strip_ansi
from .processes import _alive
from .remote import RemoteRank
from .tracebacks import failure_text, format_frames, rank_list

_POLL_S = 0.01
# How long ranks that still run may take after another rank failed before the kernel looks at them:
# a rank blocked in a collective with the failed one would otherwise wait for the collective timeout.
_FAILED_PEER_CHECK_S = 0.3
_INTERRUPT_GRACE_S = 2.0
# A finished call's result and its printed output come on separate channels (a loaded machine can
# deliver the result first): wait at most this long for the output before the last lines are shown.
_OUTPUT_WAIT_S = 5.0


class Waiting:
    """Mixin of Cluster: waiting on calls and explaining failures (see the module's docstring)."""

    @property
    def broken(self) -> str | None:
        """Why the group is unusable (after a hang, a death, a rank that raised while others waited), or None.
        When it is set, `restart()` gives a fresh group."""
        return self._broken

    def _ranks(self, ranks) -> list:
        if self._client is None:
            raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
        if self._broken:
            raise RuntimeError(f"the cluster is unusable after {self._broken}: call cluster.restart().")
        # A rank that died while the group was idle: say so now, not as an ipyparallel lookup error.
        self._raise_if_dead()
        if ranks is None:
            return list(range(self.world_size))
        ranks = [ranks] if isinstance(ranks, int) else sorted(set(ranks))
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: this cluster has ranks 0..{self.world_size - 1}.")
        return ranks

    def _wait(self, results: dict, timeout, quiet: bool, output: str | None = None) -> list:
        __tracebackhide__ = True  # noqa: F841
        from .rank_output import Echo

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        echo = Echo(enabled=not (quiet or self.quiet), view=output or self.output)
        failed_since = next_peer_check = None
        self._peer_look = {}
        try:
            while True:
                echo.update(results)
                done = all(ar.ready() for ar in results.values())
                # Checked even when every call is done: the call of a rank that died completes too,
                # with ipyparallel's EngineError.
                self._raise_if_dead()
                if done:
                    _wait_for_output(results)
                    break
                now = time.monotonic()
                if now > deadline:
                    self._raise_hang([r for r, ar in results.items() if not ar.ready()], timeout)
                if failed_since is None and _failures(results):
                    failed_since = now
                    next_peer_check = now + _FAILED_PEER_CHECK_S
                if next_peer_check is not None and now >= next_peer_check:
                    self._check_peers_of_failure(results)
                    next_peer_check = now + 0.5
                time.sleep(_POLL_S)
        except KeyboardInterrupt:
            self._interrupt(results)
        finally:
            echo.update(results, final=True)
        failures, errors = {}, {}
        for r, ar in results.items():
            try:
                value = ar.get(0)
            except Exception as e:  # a local ipyparallel error (a RemoteError of the plumbing itself)
                errors[r] = (getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e)),
                             _strip_ansi(getattr(e, "traceback", None) or repr(e)))
                continue
            if _is_failure(value):
                failures[r] = value
                errors[r] = (value.ename, value.evalue, failure_text(value))
        if errors:
            raise RankError(errors, failures) from None
        return [results[r].get(0) for r in sorted(results)]

    def _check_peers_of_failure(self, results: dict) -> None:
        """A rank failed while others still run: if they wait in a collective (for it), raise now.

        A rank counts as waiting when it sits in the same collective at two looks half a second apart
        (a rank merely passing through a collective of a subgroup without the failed rank moves on)."""
        __tracebackhide__ = True  # noqa: F841
        pending = [r for r, ar in results.items() if not ar.ready()]
        states = self._ask(pending)
        now = {r: (hang.latest(s) or {}).get("seq") for r, s in states.items() if hang.in_collective(s)}
        before, self._peer_look = getattr(self, "_peer_look", {}), now
        blocked = {r: hang.explain(r, states[r]) for r, seq in now.items() if r in before and before[r] == seq}
        if not blocked:
            return
        self._peer_look = {}
        failures = _failures(results)
        errors = {r: (f.ename, f.evalue, failure_text(f)) for r, f in failures.items()}
        self._mark_broken("a rank raised while the others waited for it in a collective")
        raise RankError(errors, failures, waiting=blocked) from None

    def _raise_hang(self, stuck: list, timeout: float):
        __tracebackhide__ = True  # noqa: F841
        everyone = list(range(self.world_size))
        states = self._ask(everyone)
        lines = {r: hang.explain(r, states.get(r)) for r in everyone}
        stacks, where = {}, {}
        for r in stuck:
            frames = [tuple(f) for f in (states.get(r) or {}).get("frames") or []]
            if frames:
                stacks[r] = format_frames(frames, indent="", collapse=False)
                where[r] = format_frames(frames, indent="")
        missing = [r for r in stuck if r not in stacks]
        if missing:
            stacks.update(self._stacks(missing))
        self._mark_broken("a hang")
        collectives = {r: hang.latest(states.get(r)) for r in everyone}
        raise RankHang(stuck, stacks, timeout, lines, where, collectives) from None

    def _raise_if_dead(self) -> None:
        __tracebackhide__ = True  # noqa: F841
        dead = [r for r, p in self._procs.items() if not self._rank_alive(p)]
        if dead:
            self._mark_broken("a rank died")
            hosts = {r: self._procs[r].host for r in dead if isinstance(self._procs[r], RemoteRank)}
            raise RankDied({r: self._exit_code(self._procs[r]) for r in dead}, hosts) from None

    def _rank_alive(self, proc) -> bool:
        return proc.alive(self._client) if isinstance(proc, RemoteRank) else _alive(proc)

    def flight_recorder_dumps(self, folder, ranks=None, wait_s: float = 5.0) -> dict:
        """Write each rank's flight recorder dump, as torch's analyzer reads it, to `folder`/rank_<r>; works while
        ranks are stuck in a collective. Returns rank -> path for the ranks that answered. Analyze the folder with
        `torchfrtrace FOLDER -p rank_` (python -m torch.distributed.flight_recorder.fr_trace)."""
        import base64
        from pathlib import Path

        if self._client is None:
            raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
        ranks = list(range(self.world_size)) if ranks is None else ranks
        alive = [r for r in ranks if r in self._procs and self._rank_alive(self._procs[r])]
        answers = hang.ask({r: self._procs[r].ask_target if isinstance(self._procs[r], RemoteRank)
                            else self._path(f"ask-rank{r}") for r in alive}, wait_s=wait_s,
                           request=f"{hang.DUMP_REQUEST}{os.getpid()}-{time.monotonic_ns()}")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = {}
        for rank, answer in sorted(answers.items()):
            if "fr_dump" in answer:
                written[rank] = folder / f"rank_{rank}"
                written[rank].write_bytes(base64.b64decode(answer["fr_dump"]))
        return written

    def _ask(self, ranks: list) -> dict:
        alive = [r for r in ranks if r in self._procs and self._rank_alive(self._procs[r])]
        return hang.ask({r: self._procs[r].ask_target if isinstance(self._procs[r], RemoteRank)
                         else self._path(f"ask-rank{r}") for r in alive}, wait_s=1.0)

    def _interrupt(self, results: dict):
        """The kernel was interrupted: interrupt the ranks still running, then raise KeyboardInterrupt."""
        __tracebackhide__ = True  # noqa: F841
        pending = [r for r, ar in results.items() if not ar.ready()]
        for r in pending:
            try:
                self._procs[r].send_signal(signal.SIGINT)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + _INTERRUPT_GRACE_S
        while time.monotonic() < deadline and not all(results[r].ready() for r in pending):
            time.sleep(_POLL_S)
        stuck = [r for r in pending if not results[r].ready()]
        if stuck:
            self._mark_broken("an interrupt inside a collective")
            states = self._ask(stuck)
            detail = "; ".join(hang.explain(r, states.get(r)) for r in stuck)
            raise KeyboardInterrupt(f"interrupted; {rank_list(stuck)} did not stop ({detail}): "
                                    "call cluster.restart().") from None
        raise KeyboardInterrupt(f"interrupted {rank_list(pending)}; the group is still usable."
                                if pending else "interrupted") from None

    def _stacks(self, stuck: list) -> dict:
        offsets = {}
        stuck = [r for r in stuck if not isinstance(self._procs.get(r), RemoteRank)]  # no file to read there
        for r in stuck:
            path = self._path(f"stack-rank{r}.txt")
            offsets[r] = os.path.getsize(path) if os.path.exists(path) else 0
            try:
                self._procs[r].send_signal(signal.SIGUSR1)
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.5)
        stacks = {}
        for r in stuck:
            try:
                with open(self._path(f"stack-rank{r}.txt")) as f:
                    f.seek(offsets[r])
                    stacks[r] = _stack_of_thread(f.read(), self._info[r]["main_thread"])
            except OSError:
                stacks[r] = "(no stack captured)"
        return stacks

    def _exit_code(self, proc):
        if isinstance(proc, RemoteRank):
            return None  # the launcher does not report it (Slurm without accounting): "lost contact"
        proc = self._launched_by.get(proc.pid, proc)   # forked: its stand-in exits with the same code
        # ipyparallel's launcher thread reaps the engine and psutil caches the code on that Process
        # object; waiting here as well would race it for the code.
        # Copies: ipyparallel drops a dead engine from these tables while we look.
        for engine_set in list(self._ipp.engines.values()) if self._ipp is not None else []:
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


def _wait_for_output(results: dict) -> None:
    """Wait (at most _OUTPUT_WAIT_S in all) until every finished call's printed output has arrived."""
    deadline = time.monotonic() + _OUTPUT_WAIT_S
    for ar in results.values():
        ar.wait_for_output(max(0.0, deadline - time.monotonic()))
