"""What a cluster's start costs the process that starts it: no torch import in the kernel where no GPU can be
there (torch alone takes about a second of a 2-core machine's start), and the same answer as torch's where one
may be."""

import json
import os
import subprocess
import sys

from fsdplab.runtime import processes
from fsdplab.runtime.processes import BACKEND_ENV


def _fresh(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}   # backend="auto", as a user has it
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_choosing_the_backend_imports_no_torch_without_gpu_devices():
    if processes.gpu_device_nodes() != []:
        import pytest

        pytest.skip("GPU device files here (or not Linux): torch is asked")
    seen = _fresh("import json, sys, fsdplab\n"
                  "cluster = fsdplab.Cluster(2, quiet=True)\n"
                  "print(json.dumps([cluster.backend, 'torch' in sys.modules]))")
    assert seen == ["gloo", False]


def test_gpu_count_agrees_with_torch():
    seen = _fresh("import json, torch\n"
                  "from fsdplab.runtime.processes import gpu_count\n"
                  "print(json.dumps([gpu_count(),"
                  " torch.cuda.device_count() if torch.cuda.is_available() else 0]))")
    assert seen[0] == seen[1]


def test_an_engine_waits_for_the_whole_connection_file(tmp_path):
    # The engines start with the controller, which writes its connection file in place: an engine that read it
    # half-written would fail to parse it and exit.
    import threading

    from fsdplab.runtime.engine import _wait_for_connection_file

    url_file = tmp_path / "ipcontroller-engine.json"
    url_file.write_text('{"key": "abc", "interface": "tcp://127.0.0.1"')   # the controller still writing
    written = threading.Event()

    def finish():
        for _ in range(3):   # several of the engine's looks see the half file
            threading.Event().wait(0.05)
        url_file.write_text('{"key": "abc", "interface": "tcp://127.0.0.1", "registration": 5555}')
        written.set()

    threading.Thread(target=finish).start()
    _wait_for_connection_file(["--IPEngine.enable_nanny=False", f"--IPEngine.url_file={url_file}",
                               "--IPEngine.wait_for_url_file=60"], poll_s=0.01)
    assert written.is_set()
    assert json.loads(url_file.read_text())["registration"] == 5555


def test_an_engine_given_its_connection_in_the_environment_does_not_wait(tmp_path):
    from fsdplab.runtime.engine import _wait_for_connection_file

    # No url_file (Slurm, mpiexec, ssh: the connection comes in IPP_CONNECTION_INFO): returns at once, even
    # with a wait that would outlast the test's timeout.
    _wait_for_connection_file(["--IPEngine.enable_nanny=False", "--IPEngine.wait_for_url_file=100000"])


def test_an_engine_whose_file_never_comes_stops_waiting(tmp_path):
    from fsdplab.runtime.engine import _wait_for_connection_file

    # ipengine itself then reports the missing file and exits: the wait must end for it to say so.
    _wait_for_connection_file([f"--IPEngine.url_file={tmp_path / 'missing.json'}",
                               "--IPEngine.wait_for_url_file=0.2"], poll_s=0.01)
