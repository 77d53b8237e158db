"""`fsdplab site`: the executed lessons as a static website.

Built from a small run made here (two notebooks with printed verdicts and a figure), and, where the notebook tier
ran in this session, from every lesson it executed (tests/lessons/test_notebooks.py leaves them in `executed_lessons`):
no broken internal link or image, a badge per printed verdict linking to its cell, a search index. The browser
test opens the home page and two lessons in headless Chromium: no console errors, figures load, badges present,
and keeps a screenshot of the home page (in .ci/venv when CI runs it).
"""

import base64
import http.server
import io
import json
import os
import re
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from fsdplab.runner import cli, site

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("FSDPLAB_REQUIRE_BROWSER") == "1"


def _png() -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _lesson(path: Path, title: str, printed: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nWhat the lesson is about."),
                nbformat.v4.new_code_cell("print(verdicts)", outputs=[
                    nbformat.v4.new_output("stream", name="stdout", text=printed)]),
                nbformat.v4.new_code_cell("plt.show()", outputs=[
                    nbformat.v4.new_output("display_data", data={"image/png": _png(), "text/plain": "<Figure>"})])]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    _lesson(run / "01_first.ipynb", "01 · First", "claim 4 'FSDP moves 40% less': WRONG. It moves 1.5x.\n"
            "claim 7 'offload costs 30%': PARTLY. Only on an A10.\nnot a verdict: RIGHT\n")
    _lesson(run / "02_second.ipynb", "02 · Second", "belief 'no_sync saves memory': WRONG. It costs 25 GiB.\n"
            "claim 16 'peaks at 17-19 GB': RIGHT for FSDP1 at long sequences\n")
    (run / "run_info.json").write_text(json.dumps(site.run_info()))
    return run


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for key in ("href", "src"):
            value = attrs.get(key)
            if value and not value.startswith(("http://", "https://", "data:", "mailto:", "javascript:")):
                self.links.append(value)


def broken_links(folder: Path) -> list:
    """Every internal link or image of every page that points at no file, or at an anchor its page lacks."""
    pages = {}
    for page in folder.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text())
        pages[page] = parser
    broken = []
    for page, parser in pages.items():
        for link in parser.links:
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.is_file():
                broken.append(f"{page.name}: {link}")
            elif anchor and path in pages and anchor not in pages[path].ids:
                broken.append(f"{page.name}: {link} (no such anchor)")
    return broken


def test_a_small_run_becomes_pages_with_badges_links_and_search(small_run, tmp_path):
    out = tmp_path / "site"
    assert cli.main(["site", str(small_run), "--out", str(out)]) == 0
    built = json.loads((out / "search.json").read_text())
    assert ({"01_first.html", "02_second.html", "index.html", "search.html", "readme.html"}
            <= {p.name for p in out.iterdir()})
    index = (out / "index.html").read_text()
    badges = re.findall(r'class="badge" style="background:(#\w+)" href="([^"]+)"[^>]*>([^<]+)<', index)
    assert [(label, colour) for colour, _, label in badges] == [
        ("claim 4: wrong", site.BADGES["wrong"]), ("claim 7: partly", site.BADGES["partly"]),
        ("no_sync saves memory: wrong", site.BADGES["wrong"]), ("claim 16: right", site.BADGES["right"])]
    assert all(href.split("#")[1].startswith("cell-id=") for _, href, _ in badges)
    assert f"torch {site.run_info()['torch']}" in index and "GPU runs: none published yet" in index
    assert not broken_links(out), broken_links(out)
    lesson = (out / "01_first.html").read_text()
    assert "data:image/png;base64," in lesson and "All lessons" in lesson
    assert not re.search(r'<script[^>]*src="https?://', lesson)     # nothing fetched (mermaid only with diagrams)
    # The lesson page lists its own verdicts, each linked to the cell that printed it (broken_links checks anchors).
    claims = re.findall(r'<li><a class="badge"[^>]*href="01_first.html#(cell-id=[^"]+)">(\w+)</a> claim (\d+)', lesson)
    assert [(word, claim) for _, word, claim in claims] == [("wrong", "4"), ("partly", "7")], claims
    assert "window.SEARCH_INDEX = [" in (out / "search.html").read_text()   # search works from file:// too
    assert any("40% less" in page["text"] for page in built) and any(page["url"] == "readme.html" for page in built)


def test_a_folder_that_is_not_a_site_is_never_replaced(small_run, tmp_path, capsys):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    assert cli.main(["site", str(small_run), "--out", str(keep)]) == 2
    err = capsys.readouterr().err
    assert (keep / "notes.txt").read_text() == "mine" and "choose a new or empty folder" in err
    assert str(keep) in err and len(err.strip().splitlines()) == 1
    assert cli.main(["site", str(tmp_path / "no-run"), "--out", str(tmp_path / "s")]) == 2
    assert "fsdplab run --out" in capsys.readouterr().err


def test_a_stray_search_json_does_not_make_a_folder_a_site(small_run, tmp_path, capsys):
    keep = tmp_path / "thesis"
    keep.mkdir()
    (keep / "search.json").write_text("[]")
    (keep / "chapter1.tex").write_text("mine")
    assert cli.main(["site", str(small_run), "--out", str(keep)]) == 2
    assert "choose a new or empty folder" in capsys.readouterr().err
    assert (keep / "chapter1.tex").read_text() == "mine"
    assert (keep / "search.json").read_text() == "[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis"]


def _pages(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_site_this_command_built_is_replaced(small_run, tmp_path):
    out = tmp_path / "site"
    site.build(small_run, out)
    assert (out / "02_second.html").is_file()
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    (smaller / "01_first.ipynb").write_bytes((small_run / "01_first.ipynb").read_bytes())
    built = site.build(smaller, out)
    assert built["lessons"] == ["01_first"] and not (out / "02_second.html").exists()
    assert "02_second.html" not in (out / "search.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site", "smaller"]   # nothing beside it


def test_a_failed_build_leaves_the_previous_site_whole(small_run, tmp_path, monkeypatch):
    out = tmp_path / "site"
    site.build(small_run, out)
    before = _pages(out)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "01_first.ipynb").write_bytes((small_run / "01_first.ipynb").read_bytes())
    (broken / "02_half.ipynb").write_text('{"cells": [')                 # a notebook cut short
    with pytest.raises(Exception):
        site.build(broken, out)
    assert _pages(out) == before
    written = []

    def full_disk(folder, text, dest):
        written.append(dest)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(site, "_images", full_disk)     # runs after the lessons' pages are written
    with pytest.raises(OSError, match="No space left"):
        site.build(small_run, out)
    assert written and _pages(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "site"]


def test_every_executed_lesson_builds_into_the_site(executed_lessons, tmp_path):
    """CI: the lessons the notebook tier executed in this session, built without running them again."""
    lessons = sorted(executed_lessons.glob("[0-9][0-9]_*.ipynb"))
    if len(lessons) < len(cli.lesson_paths()):
        pytest.skip(f"the notebook tier left {len(lessons)} of {len(cli.lesson_paths())} executed lessons in this "
                    "session (run tests/lessons/test_notebooks.py in the same session)")
    started = time.perf_counter()
    built = site.build(executed_lessons, tmp_path / "site")
    seconds = time.perf_counter() - started
    print(f"site: {len(built['pages'])} pages, {built['verdicts']} verdicts, built in {seconds:.1f} s")
    assert built["lessons"] == [p.stem for p in lessons] and built["verdicts"] >= 10
    assert not broken_links(tmp_path / "site"), broken_links(tmp_path / "site")


@pytest.mark.browser
def test_the_site_in_chromium(small_run, executed_lessons, tmp_path):
    from chromium import CHROMIUM_ARGS, chromium_path

    if chromium_path() is None:
        (pytest.fail if REQUIRED else pytest.skip)("no chromium on PATH: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        (pytest.fail if REQUIRED else pytest.skip)("playwright is not installed")
    full = len(list(executed_lessons.glob("[0-9][0-9]_*.ipynb"))) == len(cli.lesson_paths())
    built = site.build(executed_lessons if full else small_run, tmp_path / "site")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "site"), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    shots = ROOT / ".ci" / "venv" if (ROOT / ".ci" / "venv").is_dir() else tmp_path
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/index.html")
            assert page.locator("a.badge").count() >= (10 if full else 4)
            page.screenshot(path=str(shots / "site-home.png"), full_page=True)
            with_figures = [n for n in built["lessons"] if "<img" in (tmp_path / "site" / f"{n}.html").read_text()][:2]
            assert len(with_figures) == 2, built["lessons"]
            for name in with_figures:
                page.goto(f"{base}/{name}.html")
                page.wait_for_load_state("load")
                images = page.eval_on_selector_all("img", "els => els.map(e => e.complete && e.naturalWidth > 0)")
                assert images and all(images), (name, images)
            page.goto(f"{base}/search.html")
            page.fill("#q", "claim")
            page.wait_for_selector("#results li a")
            assert errors == [], errors
            browser.close()
    finally:
        server.shutdown()


def test_a_lessons_records_show_as_a_table_on_its_page(tmp_path):
    from fsdplab.records import MIME_TYPE, line

    def shown(rec):
        return nbformat.v4.new_output("display_data", data={MIME_TYPE: rec, "text/plain": line(rec)})

    def value(name, v, unit="", claim=None, tolerance=None):
        return {"name": name, "kind": "value", "value": v, "unit": unit, "claim": claim, "tolerance": tolerance,
                "note": ""}

    run = tmp_path / "run"
    run.mkdir()
    _lesson(run / "03_third.ipynb", "03 · Third", "no verdict\n")
    nb = nbformat.read(run / "03_third.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("record(...)", outputs=[
        shown(value("03-bytes", 1000)), shown(value("03-bytes", 4096, "B", claim=7)),   # a cell run again
        shown(value("03-step", 0.25, "s", tolerance="timing")),
        shown({"name": "03-fits", "kind": "check", "ok": True, "detail": ""}),
        shown({"name": "03-faster", "kind": "check", "ok": False, "detail": "0.3 s > 0.2 s"})]))
    nbformat.write(nb, run / "03_third.ipynb")
    _lesson(run / "04_none.ipynb", "04 · None", "nothing recorded\n")
    out = tmp_path / "site"
    site.build(run, out)
    page = (out / "03_third.html").read_text()
    table = re.search(r'<table class="records">(.*?)</table>', page).group(1)
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    assert cells == [["<code>03-bytes</code>", "4,096 B", "7", "", ""],
                     ["<code>03-step</code>", "0.25 s", "", "timing", ""]]
    assert "Checks: 1 of 2 ok; <b>03-faster failed</b>: 0.3 s &gt; 0.2 s" in page
    assert 'class="records"' not in (out / "04_none.html").read_text()
