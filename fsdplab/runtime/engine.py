"""A rank process: an ipyparallel engine that imports torch while it registers with the controller.

Run as `python -m fsdplab.runtime.engine [ipengine options]`. Registration mostly waits on the controller's
heartbeat; importing torch (about 2 s) in that time instead of at the first call shortens start-up.
"""

import threading


def _import_torch():
    try:
        import torch.distributed.device_mesh  # noqa: F401 - warms the import for fsdplab.runtime.on_rank.setup
    except Exception:  # noqa: BLE001 - setup() imports it again and reports any error there
        pass


if __name__ == "__main__":
    from ipyparallel.engine.app import main  # first, in this thread: the two imports never interleave

    threading.Thread(target=_import_torch, name="fsdplab-import-torch", daemon=True).start()
    main()
