"""The lab as a reader meets it: JupyterLab in a real (headless) Chromium.

Runs lesson 00 and checks `%%ranks` output per rank on the page; runs lesson 01, moves a slider of its
dashboard and checks that the figure was redrawn; no cell may show an error. Skipped (with the reason)
where Chromium or playwright is missing, unless FSDPLAB_REQUIRE_BROWSER=1 (CI sets it), which turns a
missing browser into a failure.
"""

import os
import shutil
import time
from pathlib import Path

import pytest

from chromium import CHROMIUM_ARGS, LabPage, chromium_path, jupyterlab, shutdown_kernels

pytestmark = pytest.mark.browser

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
REQUIRED = os.environ.get("FSDPLAB_REQUIRE_BROWSER") == "1"


def _need(condition, reason):
    if not condition:
        if REQUIRED:
            pytest.fail(reason + " (FSDPLAB_REQUIRE_BROWSER=1)")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _need(chromium_path() is not None, "no chromium on PATH: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright is not installed: pip install playwright (no browser download needed)")
    home = tmp_path_factory.mktemp("jupyter-home")
    # Serve copies: JupyterLab autosaves, and the committed notebooks must stay free of outputs.
    root = tmp_path_factory.mktemp("notebooks")
    for path in NOTEBOOKS.glob("*.ipynb"):
        shutil.copy(path, root / path.name)
    with jupyterlab(root, home) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield LabPage(page), base, token, home
        browser.close()


def _open_fresh(lab, name):
    page, base, token, _ = lab
    shutdown_kernels(base, token)
    page.open(base, token, name)
    return page


def test_ranks_output_appears_per_rank_in_the_page(lab):
    page = _open_fresh(lab, "00_start_here.ipynb")
    page.run_all(timeout_s=240)
    assert page.errors() == []
    shards = page.output_of("dist.all_gather(gathered, shard)")
    assert "[rank 0] my shard" in shards and "[rank 1] my shard" in shards, f"the cell showed: {shards!r}"
    # the lesson's collapsed last cell shows one line per check, each ok
    checks = [line for line in page.text().splitlines() if line.startswith("check 00-")]
    assert checks and all(line.endswith(" ok") for line in checks), checks
    # `%%ranks --tabs`: one tab per rank, rank 0's shown first, rank 1's after a click on its tab
    tabs = page.output_of("%%ranks --tabs")
    assert "rank 0 keeps 4 of 8 numbers" in tabs and "rank 1 keeps" not in tabs, f"the tabs showed: {tabs!r}"
    page.page.locator(".lm-TabBar-tab", has_text="rank 1").first.click()
    deadline = time.monotonic() + 10
    while "rank 1 keeps 4 of 8 numbers" not in page.output_of("%%ranks --tabs") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "rank 1 keeps 4 of 8 numbers" in page.output_of("%%ranks --tabs")


def test_dashboard_slider_redraws_the_figure(lab):
    page = _open_fresh(lab, "01_sharding_math.ipynb")
    page.run_all(timeout_s=400)
    assert page.errors() == []
    images = page.page.locator("img.widget-image")
    handles = page.page.locator(".widget-slider .noUi-handle")
    assert images.count() >= 1 and handles.count() >= 1, "no dashboard with a slider on the page"
    before = [images.nth(i).get_attribute("src") for i in range(images.count())]
    out_dir = lab[3]
    page.page.screenshot(path=str(out_dir / "before.png"))
    handle = handles.first
    handle.scroll_into_view_if_needed()
    handle.focus()
    page.page.keyboard.press("ArrowRight")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = [images.nth(i).get_attribute("src") for i in range(images.count())]
        if after != before:
            break
        time.sleep(0.5)
    page.page.screenshot(path=str(out_dir / "after.png"))
    assert after != before, "moving the slider did not redraw any dashboard figure"
    assert page.errors() == []
