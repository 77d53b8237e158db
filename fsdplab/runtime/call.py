"""How the kernel waits for the ranks: results, output, and every way a call can fail.

`wait` runs while a call is in flight: it polls the results, echoes the ranks' output, and turns a failure
into `RankError` (a rank raised; early when the others wait for it in a collective), `RankHang` (the timeout
passed: what each rank is doing and where it is stuck), `RankDied` (a rank process exited, or its node
stopped answering) or a KeyboardInterrupt that says whether the group is still usable. A rank on this
machine is watched through its process; a rank on another node through the controller's heartbeat and its
answering port (fsdplab.runtime.group holds both).
"""

from __future__ import annotations

import signal
import time

from . import introspect
from .errors import RankDied, RankError, RankHang, failures_in, is_failure, strip_ansi
from .tracebacks import failure_text, format_frames, rank_list

_POLL_S = 0.01
# How long ranks that still run may take after another rank failed before the kernel looks at them:
# a rank blocked in a collective with the failed one would otherwise wait for the collective timeout.
_FAILED_PEER_CHECK_S = 0.3
_INTERRUPT_GRACE_S = 2.0
# A finished call's result and its printed output come on separate channels (a loaded machine can
# deliver the result first): wait at most this long for the output before the last lines are shown.
_OUTPUT_WAIT_S = 5.0


def select(group, ranks) -> list:
    """The ranks a call goes to (all for None), after checking the group can take a call."""
    if group is None or group.client is None:
        raise RuntimeError("the cluster is not running: call cluster.start() (or restart()) first.")
    if group.broken:
        raise RuntimeError(f"the cluster is unusable after {group.broken}: call cluster.restart().")
    # A rank that died while the group was idle: say so now, not as an ipyparallel lookup error.
    raise_if_dead(group)
    if ranks is None:
        return list(range(group.world_size))
    ranks = [ranks] if isinstance(ranks, int) else sorted(set(ranks))
    bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < group.world_size)]
    if bad:
        raise ValueError(f"ranks {bad} do not exist: this cluster has ranks 0..{group.world_size - 1}.")
    return ranks


def wait(group, results: dict, timeout: float, echo) -> list:
    """The values of `results` (rank -> ipyparallel AsyncResult) in rank order, once all are in; raises what
    went wrong (see the module's docstring). `echo` shows the ranks' output (fsdplab.runtime.output.Echo)."""
    __tracebackhide__ = True  # noqa: F841 - IPython shows the user's frames, not these
    deadline = time.monotonic() + timeout
    failed_since = next_peer_check = None
    looks = {}   # rank -> the collective it sat in at the last look (see _check_peers_of_failure)
    try:
        while True:
            echo.update(results)
            done = all(ar.ready() for ar in results.values())
            # Checked even when every call is done: the call of a rank that died completes too,
            # with ipyparallel's EngineError.
            raise_if_dead(group)
            if done:
                _wait_for_output(results)
                break
            now = time.monotonic()
            if now > deadline:
                _raise_hang(group, [r for r, ar in results.items() if not ar.ready()], timeout)
            if failed_since is None and failures_in(results):
                failed_since = now
                next_peer_check = now + _FAILED_PEER_CHECK_S
            if next_peer_check is not None and now >= next_peer_check:
                looks = _check_peers_of_failure(group, results, looks)
                next_peer_check = now + 0.5
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _interrupt(group, results)
    finally:
        echo.update(results, final=True)
    failures, errors = {}, {}
    for r, ar in results.items():
        try:
            value = ar.get(0)
        except Exception as e:  # a local ipyparallel error (a RemoteError of the plumbing itself)
            errors[r] = (getattr(e, "ename", type(e).__name__), str(getattr(e, "evalue", e)),
                         strip_ansi(getattr(e, "traceback", None) or repr(e)))
            continue
        if is_failure(value):
            failures[r] = value
            errors[r] = (value.ename, value.evalue, failure_text(value))
    if errors:
        raise RankError(errors, failures) from None
    return [results[r].get(0) for r in sorted(results)]


def raise_if_dead(group) -> None:
    __tracebackhide__ = True  # noqa: F841
    dead = group.dead()
    if dead:
        group.mark_broken("a rank died")
        hosts = {r: group.host_of(r) for r in dead if group.host_of(r)}
        raise RankDied({r: group.exit_code(r) for r in dead}, hosts) from None


def _check_peers_of_failure(group, results: dict, before: dict) -> dict:
    """A rank failed while others still run: if they wait in a collective (for it), raise now. Returns this
    look, for the next.

    A rank counts as waiting when it sits in the same collective at two looks half a second apart
    (a rank merely passing through a collective of a subgroup without the failed rank moves on)."""
    __tracebackhide__ = True  # noqa: F841
    pending = [r for r, ar in results.items() if not ar.ready()]
    states = group.ask(pending)
    now = {r: (introspect.latest(s) or {}).get("seq") for r, s in states.items() if introspect.in_collective(s)}
    blocked = {r: introspect.explain(r, states[r]) for r, seq in now.items() if r in before and before[r] == seq}
    if not blocked:
        return now
    failures = failures_in(results)
    errors = {r: (f.ename, f.evalue, failure_text(f)) for r, f in failures.items()}
    group.mark_broken("a rank raised while the others waited for it in a collective")
    raise RankError(errors, failures, waiting=blocked) from None


def _raise_hang(group, stuck: list, timeout: float):
    __tracebackhide__ = True  # noqa: F841
    everyone = list(range(group.world_size))
    states = group.ask(everyone)
    lines = {r: introspect.explain(r, states.get(r)) for r in everyone}
    stacks, where = {}, {}
    for r in stuck:
        frames = [tuple(f) for f in (states.get(r) or {}).get("frames") or []]
        if frames:
            stacks[r] = format_frames(frames, indent="", collapse=False)
            where[r] = format_frames(frames, indent="")
    missing = [r for r in stuck if r not in stacks]
    if missing:
        stacks.update(group.stacks(missing))
    group.mark_broken("a hang")
    collectives = {r: introspect.latest(states.get(r)) for r in everyone}
    raise RankHang(stuck, stacks, timeout, lines, where, collectives) from None


def _interrupt(group, results: dict):
    """The kernel was interrupted: interrupt the ranks still running, then raise KeyboardInterrupt."""
    __tracebackhide__ = True  # noqa: F841
    pending = [r for r, ar in results.items() if not ar.ready()]
    for r in pending:
        group.signal(r, signal.SIGINT)
    deadline = time.monotonic() + _INTERRUPT_GRACE_S
    while time.monotonic() < deadline and not all(results[r].ready() for r in pending):
        time.sleep(_POLL_S)
    stuck = [r for r in pending if not results[r].ready()]
    if stuck:
        group.mark_broken("an interrupt inside a collective")
        states = group.ask(stuck)
        detail = "; ".join(introspect.explain(r, states.get(r)) for r in stuck)
        raise KeyboardInterrupt(f"interrupted; {rank_list(stuck)} did not stop ({detail}): "
                                "call cluster.restart().") from None
    raise KeyboardInterrupt(f"interrupted {rank_list(pending)}; the group is still usable."
                            if pending else "interrupted") from None


def _wait_for_output(results: dict) -> None:
    """Wait (at most _OUTPUT_WAIT_S in all) until every finished call's printed output has arrived."""
    deadline = time.monotonic() + _OUTPUT_WAIT_S
    for ar in results.values():
        ar.wait_for_output(max(0.0, deadline - time.monotonic()))
