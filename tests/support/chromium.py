"""Drive a real JupyterLab in headless Chromium: open a notebook, run it, touch its widgets.

Used by tests/browser/test_browser.py. Needs Debian's chromium (/usr/bin/chromium) and the playwright package
(its driver only: the browser is the system one, nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from fsdplab.runtime.processes import free_port

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@contextmanager
def jupyterlab(root: Path, home: Path):
    """A JupyterLab server on loopback with a token, its settings kept in `home` (no news pop-ups)."""
    token, port = "fsdplab-test-token", free_port()
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Render every cell, not only those in view, so the page text holds the whole notebook.
    notebook_settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True, exist_ok=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), FSDPLAB_FIGURES=str(home / "figures"))
    log = open(home / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0", "--allow-root"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start; log: "
                                       f"{(home / 'jupyterlab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def shutdown_kernels(base: str, token: str) -> None:
    """Stop every kernel of the server (and with it that notebook's cluster)."""
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as r:
        kernels = json.load(r)
    for kernel in kernels:
        request = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30)


class LabPage:
    """A notebook open in JupyterLab, with the few actions a reader takes."""

    def __init__(self, page):
        self.page = page

    def open(self, base: str, token: str, notebook: str):
        # A workspace of its own, reset, so no tab of an earlier notebook is restored beside it.
        workspace = Path(notebook).stem.replace("_", "-")
        self.page.goto(f"{base}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={token}")
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        # The kernel is ready when the status bar says so ("Python 3 (ipykernel) | Idle").
        self.page.wait_for_function(
            "() => /\\| Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.innerText ?? '')",
            timeout=90_000)

    def run_all(self, timeout_s: float = 300):
        self.page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        self.page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        self.wait_until_done(timeout_s)

    def prompts(self) -> list:
        """The prompts of the code cells whose input shows; a collapsed cell (a lesson's hidden checks cell)
        has an empty placeholder prompt whatever its state, so it is left out here and waited for through
        the kernel's status."""
        return self.page.evaluate("""() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea .jp-InputPrompt')]
                                      .map(e => e.textContent.trim())""")

    def kernel_idle(self) -> bool:
        return self.page.evaluate(
            "() => /\\| Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.innerText ?? '')")

    def wait_until_done(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        time.sleep(1)
        idle_polls = 0
        while time.monotonic() < deadline:
            prompts = self.prompts()
            # the kernel idle on two polls a second apart: no hidden cell is still queued or running
            idle_polls = idle_polls + 1 if self.kernel_idle() else 0
            if prompts and all(p and "*" not in p and p != "[ ]:" for p in prompts) and idle_polls >= 2:
                return prompts
            if prompts and not any("*" in p for p in prompts) and self.errors():
                raise AssertionError(f"run stopped at an error: {self.errors()[0]}")
            time.sleep(1)
        raise TimeoutError(f"cells still running after {timeout_s} s: prompts {self.prompts()}")

    def errors(self) -> list:
        """Text of every error output (a traceback) shown in the page."""
        return self.page.evaluate("""() => [...document.querySelectorAll(
            '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"], \
.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"]')]
            .map(e => e.textContent.slice(0, 2000))""")

    def text(self) -> str:
        return self.page.evaluate("() => document.querySelector('.jp-Notebook').innerText")

    def output_of(self, source_part: str) -> str:
        """The output text of the first code cell whose source contains `source_part`."""
        return self.page.evaluate("""(part) => {
            const cell = [...document.querySelectorAll('.jp-CodeCell')]
                .find(c => c.querySelector('.jp-InputArea')?.innerText.includes(part));
            return cell ? cell.querySelector('.jp-OutputArea')?.innerText ?? '' : null;
        }""", source_part)
