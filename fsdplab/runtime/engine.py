"""A rank process: an ipyparallel engine that imports torch while it registers with the controller.

Run as `python -m fsdplab.runtime.engine [ipengine options]`, at the same time as the controller. Registration
mostly waits on the controller's start and heartbeat; importing torch (about 1-2 s) in that time instead of at
the first call shortens start-up.
"""

import json
import threading
import time


def _wait_for_connection_file(argv: list, poll_s: float = 0.02) -> None:
    """Until the controller's connection file named by --IPEngine.url_file holds its whole JSON (the
    controller writes it in place, so it can be seen half-written), for --IPEngine.wait_for_url_file
    seconds at most; without a url_file, nothing (the engine was given its connection in its environment)."""
    options = dict(arg[len("--IPEngine."):].split("=", 1) for arg in argv
                   if arg.startswith("--IPEngine.") and "=" in arg)
    if not options.get("url_file"):
        return
    deadline = time.monotonic() + float(options.get("wait_for_url_file", 10))
    while True:
        try:
            with open(options["url_file"]) as f:
                json.load(f)
            return
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return   # ipengine itself then says which file never arrived
            time.sleep(poll_s)


def _import_torch():
    try:
        import torch.distributed.device_mesh  # noqa: F401 - warms the import for fsdplab.runtime.on_rank.setup
    except Exception:  # noqa: BLE001 - setup() imports it again and reports any error there
        pass


if __name__ == "__main__":
    from ipyparallel.engine.app import main  # first, in this thread: the two imports never interleave

    import sys

    threading.Thread(target=_import_torch, name="fsdplab-import-torch", daemon=True).start()
    _wait_for_connection_file(sys.argv[1:])
    main()
