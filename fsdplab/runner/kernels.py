"""The run's kernels reach papermill over Unix sockets rather than TCP ports.

jupyter_client picks five free TCP ports, closes them and writes them down; the kernel binds them a moment
later. In between, any process on the machine (another run, a rank's gloo connection) can take one, and the
kernel dies with "Address already in use". A Unix socket's path belongs to this run alone.
"""

import os
import uuid

import zmq
from jupyter_client.manager import AsyncKernelManager

from .forkserver import short_temp_dir


class UnixSocketKernelManager(AsyncKernelManager):
    """papermill's kernel manager with `transport="ipc"`: the kernel binds `<prefix>-1` .. `<prefix>-5` in the
    temporary folder (the lesson's scratch folder under `fsdplab run`), and jupyter_client removes them when
    the kernel shuts down."""

    def __init__(self, **kwargs):
        if not zmq.has("ipc"):   # Windows: TCP, as jupyter_client's default
            super().__init__(**kwargs)
            return
        kwargs.setdefault("transport", "ipc")
        # jupyter_client's own default is relative ("kernel-ipc"), read from the client's folder and the
        # kernel's, which differ under papermill's cwd
        kwargs.setdefault("ip", os.path.join(short_temp_dir(), f"kernel-{uuid.uuid4().hex[:8]}"))
        super().__init__(**kwargs)
