"""The ranks as processes on this machine (the default launcher)."""

from __future__ import annotations

import dataclasses
import os
import sys

from ..processes import choose_backend
from .base import Launcher


@dataclasses.dataclass(frozen=True)
class Local(Launcher):
    """The ranks are processes on this machine (the default)."""

    kind = "local"
    spares = True

    def prepare(self, world_size: int, backend: str) -> tuple:
        return None, choose_backend(world_size, backend)

    def threads(self, plan, world_size: int, backend: str) -> int:
        return max(1, (os.cpu_count() or 1) // world_size) if backend == "gloo" else 4

    def configure(self, ipp, plan, env: dict, path) -> None:
        # The engines start with the controller, not once it has written its connection file: each waits for
        # the file itself (fsdplab.runtime.engine), importing ipyparallel and torch meanwhile. It waits as
        # long as the kernel does (ipyparallel's connection_info_timeout, 60 s).
        ipp.send_engines_connection_env = False
        url_file = os.path.join(ipp.profile_dir, "security", f"ipcontroller-{ipp.cluster_id}-engine.json")
        launcher = ipp.config.LocalEngineSetLauncher
        launcher.engine_args = [*launcher.engine_args, f"--IPEngine.url_file={url_file}",
                                "--IPEngine.wait_for_url_file=60"]

    def join_group(self, plan, group) -> tuple:
        import psutil

        from .. import on_rank

        client, engine_ids = group.client, group.engine_ids
        # Rank 0 binds the group's store to a loopback port the OS picks, so no port can be taken.
        port = client[engine_ids[0]].apply_async(
            on_rank.open_store, world_size=group.world_size, timeout_s=group.collective_timeout).get(timeout=120)
        pending = [client[eid].apply_async(
            on_rank.setup, rank=rank, world_size=group.world_size, master_port=port, backend=group.backend,
            collective_timeout_s=group.collective_timeout, num_threads=group.threads,
            stack_file=group.path(f"stack-rank{rank}.txt"), sys_path=list(sys.path),
            ask_file=group.path(f"ask-rank{rank}")) for rank, eid in enumerate(engine_ids)]
        info = [ar.get(timeout=120) for ar in pending]
        # The launcher's own psutil.Process object is the one that reaps the engine, and psutil caches
        # the exit code on that object: use it, so RankDied can report the code.
        launched = {launcher.pid: launcher.process for engine_set in group.ipp.engines.values()
                    for launcher in getattr(engine_set, "launchers", {}).values()}
        procs = {i["rank"]: launched.get(i["pid"]) or psutil.Process(i["pid"]) for i in info}
        # A rank forked by a fork server: the launcher watches its stand-in, which exits with the rank's code.
        launched_by = {i["pid"]: launched[i["launched_by"]] for i in info
                       if i.get("launched_by") != i["pid"] and i.get("launched_by") in launched}
        return engine_ids, info, procs, launched_by
