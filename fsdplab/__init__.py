"""fsdplab: a hands-on lab for PyTorch FSDP, run from a notebook on real ranks.

Importing fsdplab starts nothing: no process, no CUDA, no process group.
"""

from . import import_noise, import_once
from .runtime.cluster import Cluster
from .runtime.errors import RankDied, RankError, RankHang
from .runtime.launchers import Local, Mpi, Slurm, Ssh
from .ranks import backend, device, local_rank, mesh, node_mesh, node_rank, print0, rank, world_size

__version__ = "0.1.0"
import_noise.install()
import_once.install()

__all__ = ["Cluster", "Local", "Slurm", "Mpi", "Ssh", "RankError", "RankHang", "RankDied", "rank", "world_size",
           "device", "mesh", "node_mesh", "local_rank", "node_rank", "print0", "backend", "load_ipython_extension"]


def load_ipython_extension(ipython):
    """`%load_ext fsdplab` registers the %%ranks cell magic."""
    from .runtime.magics import register

    register(ipython)
