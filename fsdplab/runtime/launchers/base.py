"""What every launcher does for a cluster, and what it does by default.

A launcher is a frozen dataclass of the user's options (`fsdplab.Slurm(nodes=2, partition="gpu")`). The
cluster asks it, in this order: `prepare` (check the options, choose the backend; returns the launcher's
`plan`, the options resolved for this world size), `threads`, `ipp_args` and `configure` (how ipyparallel
starts the engines), `start_problem` while the ranks are awaited, `join_group` (one process group of the
engines, ranks in their order), then `stop`. Every method after `prepare` gets the plan back. Adding a
launcher is one file: a subclass of `Launcher` (or of `RemoteLauncher` for ranks on other machines),
imported in fsdplab/runtime/launchers/__init__.py.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Launcher:
    kind = ""
    # Spare ranks (a second set kept warm for restart()) are worth it on this machine only: elsewhere they
    # would hold nodes idle.
    spares = False

    def prepare(self, world_size: int, backend: str) -> tuple:
        """(plan, backend): the options checked and resolved for `world_size`; ValueError with the fix."""
        raise NotImplementedError

    def threads(self, plan, world_size: int, backend: str) -> int:
        """CPU threads per rank."""
        return 4

    def ipp_args(self, plan) -> dict:
        """ipp.Cluster's arguments for this launcher (which engine launcher, where the controller listens)."""
        return {}

    def configure(self, ipp, plan, env: dict, path) -> None:
        """Configure ipyparallel's engine launcher, after the cluster set engine_cmd and engine_args on the
        local one. `path(name)` is a file in the cluster's scratch folder."""

    def refused(self, error: Exception) -> str | None:
        """The message for a launcher command that failed while starting the ranks (None: not one of those)."""
        return None

    def jobs(self, ipp) -> list:
        """Scheduler jobs holding the ranks (cancelled at stop, and by the watcher if the kernel dies)."""
        return []

    def tool_env(self, plan) -> dict | None:
        """The environment for the scheduler's tools (scancel), or None."""
        return None

    def start_problem(self, plan, ipp, jobs: list, waited_s: float, timed_out: bool) -> str | None:
        """Why the ranks will never connect (an error message), or None while waiting longer makes sense."""
        return None

    def join_group(self, plan, group) -> tuple:
        """Make the engines `group.engine_ids` one process group; (engine ids in rank order, what each
        rank's setup returned, rank -> process handle, rank pid -> its launcher's process where they differ)."""
        raise NotImplementedError

    def stop(self, plan, ipp, jobs: list) -> list:
        """End the ranks; what could not be ended, as text (jobs: updated in place to those still listed)."""
        return []

    def describe(self, plan, jobs: list) -> str:
        """How the ranks run, for the line start() prints ('' on this machine)."""
        return ""

    def __str__(self):
        return self.kind


def engine_pids(ipp) -> list:
    """Processes the engine launchers started on this machine: each local engine, mpiexec (never the remote
    pid an ssh launcher holds)."""
    from ipyparallel.cluster.launcher import LocalProcessLauncher, SSHLauncher

    pids = []
    for engine_set in list(ipp.engines.values()) if ipp is not None else []:
        if isinstance(engine_set, LocalProcessLauncher) and not isinstance(engine_set, SSHLauncher):
            pids += [engine_set.pid] if engine_set.pid > 0 else []
        pids += [launcher.pid for launcher in list(getattr(engine_set, "launchers", {}).values())
                 if not isinstance(launcher, SSHLauncher) and launcher.pid > 0]
    return pids
