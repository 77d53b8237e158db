"""The lab as a static website, built from lessons already executed by `fsdplab run` (nothing runs again).

    fsdplab site [RUN] [--out DIR]        RUN: the folder `fsdplab run --out RUN` wrote (default: runs)

Each executed lesson becomes a page (nbconvert's HTML exporter, figures embedded, so a page is one file); the
home page lists the lessons with the verdicts each one printed (right / partly / wrong badges, each a link to the
cell that printed it); the README and the pages in docs/ become pages too, where the repository is at hand; a
search page looks through every page's text (an index written at build time, searched in the browser). Nothing is
fetched while building or viewing: the exporter's links to a CDN (require.js, MathJax) are left out. The machine
and torch version the lessons ran on come from RUN/run_info.json, which `fsdplab run` writes.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

from ..owned_folders import replace_owned

REPOSITORY = Path(__file__).resolve().parent.parent.parent
# A printed verdict: "claim 13 'saving ...': WRONG. ...", "claim #7 PCIe ...: PARTLY: ...", "Claim 15 (partly): ...",
# "belief 'no_sync saves memory': HALF RIGHT. ..."; and a row of a lesson's verdict table:
# "| 4 | ... | **WRONG** | ...".
_WORD = r"half right|partly right|partly true|partly|plausible|right|true|wrong"
VERDICT = re.compile(r"^(?P<what>(?:claims? #?\d+(?:(?:, | and |-)\d+)*|belief)\b.{0,160}?)[:(]\s*\**(?P<word>"
                     + _WORD + r")\b", re.I)
TABLE_ROW = re.compile(r"^\|\s*(?P<claim>\d+)\s*\|.*?\*\*(?P<word>" + _WORD + r")\*\*", re.I)
BADGES = {"right": "#1a7f37", "partly": "#9a6700", "wrong": "#cf222e", "other": "#57606a"}
_NO_ICON = '<link rel="icon" href="data:,">'   # no favicon request (a 404 in the browser's console)
_LESSON_STYLE = ('<style>.badge{display:inline-block;color:#fff;border-radius:1em;padding:0 .6em;margin:.1em .2em;'
                 'font-size:.8em;text-decoration:none}.machine{color:#57606a;font-size:.9em}</style>')
_CDN_SCRIPT = re.compile(r'<script[^>]*src="https?://[^"]*"[^>]*>\s*</script>\s*', re.I)


def run_info() -> dict:
    """The machine a run executes on (no host name): what `fsdplab run` writes to OUT/run_info.json. Cheap: torch
    is not imported (its version from the installed package, the GPUs from nvidia-smi where there is one)."""
    import datetime
    import importlib.metadata
    import os
    import platform
    import subprocess

    gpus = []
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout
            gpus = [line.strip() for line in names.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            gpus = []
    return {"date": datetime.date.today().isoformat(), "torch": importlib.metadata.version("torch"),
            "python": platform.python_version(), "cpus": os.cpu_count(), "processor": platform.machine(),
            "gpus": gpus, "device": f"{len(gpus)} x {gpus[0]}" if gpus else "CPU only (gloo ranks)"}


def _kind(word: str) -> str:
    word = word.lower()
    return "wrong" if word == "wrong" else "right" if word in ("right", "true") else "partly"


def verdicts(nb) -> list:
    """[(what, verdict word, badge kind, cell id)] from what the lesson printed: verdict lines and the rows of
    its verdict tables (markdown outputs), once per claim and verdict."""
    found, seen = [], set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            lines = []
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                lines = [(VERDICT, line) for line in out.get("text", "").splitlines()]
            markdown = out.get("data", {}).get("text/markdown")
            if markdown:
                lines += [(TABLE_ROW, line) for line in "".join(markdown).splitlines()]
            for pattern, line in lines:
                m = pattern.match(line.strip())
                if not m:
                    continue
                what = f"claim {m.group('claim')}" if pattern is TABLE_ROW else m.group("what").strip()
                word = m.group("word").upper()
                if (_label(what), word) not in seen:
                    seen.add((_label(what), word))
                    found.append((what, word, _kind(word), cell.get("id", "")))
    return found


_WIDGET = "application/vnd.jupyter.widget-view+json"


def _static_widgets(nb):
    """Widgets without a kernel: the static image a dashboard saved beside its widget, or a line saying where the
    live one is; no widget state, so nbconvert adds no loader that fetches the widget renderer from a CDN."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if _WIDGET in data:
                del data[_WIDGET]
                if not any(k.startswith("image/") for k in data):
                    data["text/plain"] = "(an interactive widget: open the lesson in JupyterLab to use it)"
                    data.pop("text/html", None)
    return nb


def _claim_list(stem: str, found: list) -> str:
    """The top of a lesson page: each claim the lesson decided, its verdict as a badge, a link to the deciding cell."""
    if not found:
        return ""
    rows = "".join(f'<li><a class="badge" style="background:{BADGES[kind]}" href="{stem}.html#cell-id={cid}">'
                   f'{word.lower()}</a> {html.escape(what)} '
                   f'(<a href="#cell-id={cid}">the cell that decides it</a>)</li>'
                   for what, word, kind, cid in found)
    return (f'<details open><summary><b>What this lesson decides ({len(found)} verdicts, computed in this run)</b>'
            f'</summary><ul style="list-style:none;padding-left:0">{rows}</ul></details>')


def _records_table(nb) -> str:
    """The numbers the lesson recorded (fsdplab.records) as a small table, and its checks in one line."""
    from .. import records

    found = records.by_name(records.from_notebook(nb)).values()
    values = [r for r in found if r.get("kind") != "check"]
    checks = [r for r in found if r.get("kind") == "check"]
    if not values and not checks:
        return ""
    rows = "".join(f"<tr><td><code>{html.escape(r['name'])}</code></td>"
                   f"<td>{html.escape(records.line(r).split(' = ', 1)[1])}</td>"
                   f"<td>{'' if r.get('claim') is None else r['claim']}</td>"
                   f"<td>{'timing' if r.get('tolerance') == records.TIMING else ''}</td>"
                   f"<td>{html.escape(r.get('note') or '')}</td></tr>" for r in values)
    failed = [r for r in checks if not r.get("ok")]
    summary = (f"<p>Checks: {len(checks) - len(failed)} of {len(checks)} ok"
               + "".join(f'; <b>{html.escape(r["name"])} failed</b>: {html.escape(r.get("detail") or "")}'
                         for r in failed) + "</p>") if checks else ""
    table = ('<table class="records"><tr><th>record</th><th>value</th><th>claim</th><th></th><th>note</th></tr>'
             f"{rows}</table>") if values else ""
    return f'<details class="records" open><summary>Recorded by this run</summary>{table}{summary}</details>'


def _label(what: str) -> str:
    """A badge's words: "claim 13" for a claim, the belief itself for a belief (quotes dropped), at most 48 letters."""
    claim = re.match(r"claims? #?(\d+(?:(?:, | and |-)\d+)*)", what, re.I)
    if claim:
        return f"claim {claim.group(1)}"
    quoted = re.search(r"'([^']+)'", what)
    text = quoted.group(1) if quoted else what
    return text if len(text) <= 48 else text[:47] + "…"


def _title(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        parts.append(cell.source)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
    return re.sub(r"\s+", " ", "\n".join(parts))


_STYLE = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;line-height:1.5;\
color:#1f2328}
a{color:#0969da}nav a{margin-right:1em}.badge{display:inline-block;color:#fff;border-radius:1em;padding:0 .6em;
margin:.1em .2em;font-size:.8em;text-decoration:none}.lesson{border-top:1px solid #d0d7de;padding:.6em 0}
.machine{color:#57606a;font-size:.9em}pre{background:#f6f8fa;padding:.6em;overflow-x:auto}code{background:#f6f8fa}
table{border-collapse:collapse}td,th{border:1px solid #d0d7de;padding:.2em .5em;vertical-align:top}
img{max-width:100%}#results li{margin:.3em 0}"""


def _page(title: str, body: str) -> str:
    nav = ('<nav><a href="index.html">Lessons</a><a href="readme.html">README</a>'
           '<a href="search.html">Search</a></nav>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)} · fsdplab</title>'
            f'{_NO_ICON}<style>{_STYLE}</style></head><body>{nav}{body}</body></html>\n')


def _heading_with_id(m) -> str:
    """A heading with GitHub's anchor for it, so that links such as `troubleshooting.md#on-a-gpu-machine` work on
    the site as they do on GitHub: the text lower-cased, punctuation dropped, spaces made hyphens."""
    text = html.unescape(re.sub(r"<[^>]+>", "", m.group(2)))
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    return f'<h{m.group(1)} id="{html.escape(slug)}">{m.group(2)}</h{m.group(1)}>'


def _markdown(text: str, pages: set) -> str:
    """Markdown to HTML with mistune (nbconvert's own renderer); links to .md pages and lesson notebooks point
    at their pages on the site, and a link to a page the site does not have (a lesson this run did not execute,
    a file of the repository) becomes plain text."""
    import mistune

    body = re.sub(r"<h([1-6])>(.*?)</h\1>", _heading_with_id, mistune.html(text), flags=re.S)
    body = re.sub(r'href="(?:\.\./)?(?:docs/)?([\w-]+)\.md(#[^"]*)?"',
                  lambda m: f'href="{"readme" if m.group(1) == "README" else m.group(1)}.html{m.group(2) or ""}"', body)
    body = re.sub(r'href="(?:\.\./)?(?:notebooks/)?(\d\d_\w+)\.ipynb"', r'href="\1.html"', body)
    body = re.sub(r'href="(?:\.\./)?benchmarks/README\.md"', 'href="benchmarks.html"', body)

    def keep(m):
        target = m.group(1).split("#")[0]
        if re.match(r"[a-z]+:", m.group(1)) or not target or target in pages:
            return m.group(0)
        return m.group(2)

    return re.sub(r'<a href="([^"]*)">(.*?)</a>', keep, body, flags=re.S)


def _docs() -> dict:
    """page name -> (title, markdown), from the repository when it is at hand (a wheel ships no docs)."""
    pages = {}
    sources = [("readme", REPOSITORY / "README.md"), ("benchmarks", REPOSITORY / "benchmarks" / "README.md")]
    sources += [(p.stem, p) for p in sorted((REPOSITORY / "docs").glob("*.md"))]
    for name, path in sources:
        if path.is_file():
            text = path.read_text()
            first = next((line[2:] for line in text.splitlines() if line.startswith("# ")), name)
            pages[name] = ("README" if name == "readme" else first.strip(), text)
    return pages


def _images(folder: Path, text: str, out: Path) -> None:
    """Copy the images a markdown page links to (docs/figures/...) next to the site's pages."""
    for rel in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
        src = (folder / rel).resolve()
        if src.is_file():
            dest = out / rel.replace("../", "")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)


def build(run_dir="runs", out_dir="site") -> dict:
    """Build the site from the executed lessons in `run_dir` into `out_dir`; returns what was built.
    `out_dir` is new, empty, or a site this command built (it has the lab's mark), else refused."""
    run, out = Path(run_dir), Path(out_dir)
    lessons = sorted(run.glob("[0-9][0-9]_*.ipynb"))
    if not lessons:
        raise ValueError(f"no executed lessons in {run}: run `fsdplab run --out {run}` first, then "
                         f"`fsdplab site {run}`.")
    built = {"lessons": [], "docs": [], "verdicts": 0}
    # Built beside the old site, then swapped in: a failure (a bad notebook, a full disk) leaves
    # the old site whole.
    replace_owned(out, lambda new: _write_site(run, lessons, new, built), what="--out")
    built["pages"] = sorted(p.name for p in out.glob("*.html"))
    return built


def _write_site(run: Path, lessons: list, out: Path, built: dict) -> None:
    import nbformat
    from nbconvert import HTMLExporter

    info_file = run / "run_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    machine = (f"Executed on {info.get('device', '?')}, {info.get('cpus', '?')} CPU cores, "
               f"torch {info.get('torch', '?')}, Python {info.get('python', '?')}, {info.get('date', '?')}" if info else
               "Executed on a machine this run did not record (run_info.json is missing).")
    exporter = HTMLExporter(template_name="lab", embed_images=True)
    index, entries = [], []
    for path in lessons:
        nb = nbformat.read(path, as_version=4)
        title = _title(nb, path.stem)
        body, _ = exporter.from_notebook_node(_static_widgets(nb),
                                              resources={"metadata": {"name": f"{title} · fsdplab"}})
        body = _CDN_SCRIPT.sub("", body).replace("<head>", "<head>" + _NO_ICON + _LESSON_STYLE, 1)
        body = body.replace("<body", f'<body data-machine="{html.escape(machine)}"', 1)
        found = verdicts(nb)
        badges = "".join(f'<a class="badge" style="background:{BADGES[kind]}" href="{path.stem}.html#cell-id={cid}" '
                         f'title="{html.escape(what)}">{html.escape(_label(what))}: {word.lower()}</a>'
                         for what, word, kind, cid in found)
        top = (f'<div style="margin:1em 1em 0 100px"><p class="machine"><a href="index.html">All lessons</a> · '
               f'{html.escape(machine)}</p>{_claim_list(path.stem, found)}{_records_table(nb)}</div>')
        body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + top, body, count=1)
        (out / f"{path.stem}.html").write_text(body)
        index.append(f'<div class="lesson"><a href="{path.stem}.html"><b>{html.escape(title)}</b></a><br>'
                     f'{badges}</div>')
        entries.append({"url": f"{path.stem}.html", "title": title, "text": _text(nb)})
        built["lessons"].append(path.stem)
        built["verdicts"] += len(found)
    docs = _docs()
    pages = {f"{stem}.html" for stem in built["lessons"]} | {f"{n}.html" for n in docs} | {"index.html", "search.html"}
    for name, (title, text) in docs.items():
        (out / f"{name}.html").write_text(_page(title, _markdown(text, pages)))
        source = REPOSITORY / ("README.md" if name == "readme" else "benchmarks/README.md" if name == "benchmarks"
                               else f"docs/{name}.md")
        _images(source.parent, text, out)
        entries.append({"url": f"{name}.html", "title": title, "text": re.sub(r"\s+", " ", text)})
        built["docs"].append(name)
    docs_links = "".join(f'<li><a href="{n}.html">{html.escape(docs[n][0])}</a></li>' for n in built["docs"])
    gpu_note = ("" if info.get("gpus") else "<p>GPU runs: none published yet. Build a second site from a run on GPUs "
                "(<code>fsdplab run --out runs-gpu</code>, then <code>fsdplab site runs-gpu --out site-gpu</code>); "
                "its pages carry the GPUs' names the same way.</p>")
    (out / "index.html").write_text(_page("fsdplab", (
        "<h1>fsdplab: a hands-on lab for PyTorch FSDP</h1><p>Every lesson below was executed on live ranks; each "
        "badge is a verdict the lesson computed, linked to the cell that printed it.</p>"
        f'<p class="machine">{html.escape(machine)}</p>{gpu_note}' + "".join(index)
        + (f"<h2>Documentation</h2><ul>{docs_links}</ul>" if docs_links else ""))))
    (out / "search.json").write_text(json.dumps(entries))
    # The index is also inlined in the search page, so search works from file:// too (no fetch needed).
    inline = json.dumps(entries).replace("</", "<\\/")
    (out / "search.html").write_text(_page("Search", f"<script>window.SEARCH_INDEX = {inline};</script>" + _SEARCH))


# The search page: the index (window.SEARCH_INDEX, inlined above it); a page matches when it has every word.
_SEARCH = """<h1>Search</h1><input id="q" size="50" placeholder="e.g. reduce_dtype, set_epoch, RankHang" autofocus>
<ul id="results"></ul><script>
let pages = window.SEARCH_INDEX || [];
function run() {
  const words = document.getElementById("q").value.toLowerCase().split(/\\s+/).filter(w => w);
  const list = document.getElementById("results"); list.innerHTML = "";
  if (!words.length) return;
  for (const p of pages) {
    const text = p.text.toLowerCase();
    if (!words.every(w => text.includes(w))) continue;
    const at = text.indexOf(words[0]);
    const snippet = p.text.slice(Math.max(0, at - 80), at + 120);
    const li = document.createElement("li"); const a = document.createElement("a");
    a.href = p.url; a.textContent = p.title; li.appendChild(a);
    li.appendChild(document.createTextNode(" … " + snippet + " …")); list.appendChild(li);
  }
  if (!list.children.length) list.innerHTML = "<li>No page has all of these words.</li>";
}
document.getElementById("q").addEventListener("input", run);
</script>"""


def site_command(args) -> int:
    built = build(args.run, args.out)
    print(f"built {len(built['pages'])} pages ({len(built['lessons'])} lessons, {built['verdicts']} verdicts, "
          f"{len(built['docs'])} docs pages) in {args.out}; open {Path(args.out) / 'index.html'}, or serve it: "
          f"python -m http.server -d {args.out}")
    return 0
