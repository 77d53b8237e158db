"""Where the ranks run: on this machine (`Local`), in a Slurm job (`Slurm`), under mpiexec (`Mpi`), or over ssh
(`Ssh`). Each is a class of its own file holding its options, their checks, how it starts, places and stops
the ranks (fsdplab.runtime.launchers.base says what a launcher does). The kernel and the controller always stay
on this machine; ranks elsewhere join one group with rank 0's routable address as MASTER_ADDR, and their
faults are told over the network (fsdplab.runtime.launchers.remote).

`resolve` turns what Cluster was given into a launcher object: an object as it is, or the older form, a
name plus Cluster's flat options (`Cluster(8, launcher="slurm", nodes=2)`), which still works with a note
naming the object to write instead.
"""

from __future__ import annotations

import dataclasses

from .base import Launcher
from .local import Local
from .mpi import Mpi
from .slurm import Slurm
from .ssh import Ssh

LAUNCHER_CLASSES = {cls.kind: cls for cls in (Local, Slurm, Mpi, Ssh)}
LAUNCHERS = tuple(LAUNCHER_CLASSES)
# The flat options Cluster still takes for the older form, and the launchers that have each.
FLAT_OPTIONS = ("nodes", "gpus_per_node", "partition", "time_limit", "sbatch_args", "slurm_conf", "address", "hosts",
                "mpi_args", "ssh_args", "remote_python")


def _owners(option: str) -> list:
    return [kind for kind, cls in LAUNCHER_CLASSES.items() if option in {f.name for f in dataclasses.fields(cls)}]


def resolve(launcher, flat: dict) -> Launcher:
    """The launcher object for Cluster's `launcher` argument and its flat options (see the module's docstring)."""
    given = {name: value for name, value in flat.items() if value is not None}
    if isinstance(launcher, Launcher):
        if given:
            raise ValueError(f"{', '.join(given)} given to Cluster and a launcher object: put them in the object, "
                             f"e.g. launcher=fsdplab.{type(launcher).__name__}({next(iter(given))}=...).")
        return launcher
    if not (isinstance(launcher, str) and launcher in LAUNCHER_CLASSES):
        raise ValueError(f"launcher is fsdplab.Local(), Slurm(...), Mpi(...) or Ssh(...) (or one of "
                         f"{', '.join(map(repr, LAUNCHERS))}), got {launcher!r}: Local runs the ranks on this "
                         "machine, Slurm in a Slurm job, Mpi under mpiexec, Ssh over ssh.")
    cls = LAUNCHER_CLASSES[launcher]
    wrong = [k for k in given if launcher not in _owners(k)]
    if wrong:
        owners = sorted({o for k in wrong for o in _owners(k)}, key=LAUNCHERS.index)
        where = "ranks on this machine" if launcher == "local" else "not " + " or ".join(owners)
        raise ValueError(f"{', '.join(wrong)} only apply to launcher={' or '.join(map(repr, owners))} (this is "
                         f"launcher={launcher!r}, {where}): add launcher={owners[0]!r} or leave them out.")
    if given:
        import warnings

        fits = ", ".join(f"{k}={v!r}" for k, v in given.items())
        warnings.warn(f"launcher={launcher!r} with options on Cluster still works, but the options now belong to "
                      f"the launcher: write launcher=fsdplab.{cls.__name__}({fits}).", FutureWarning, stacklevel=3)
    return cls(**given)


__all__ = ["Launcher", "Local", "Slurm", "Mpi", "Ssh", "LAUNCHERS", "resolve"]
