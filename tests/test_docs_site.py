"""The documentation site, opened in headless Chromium (Debian's ``chromium``, driven by Playwright).

Every page reachable from the index is loaded over HTTP. Each must render
(status 200, a non-empty main article), every image must decode, every
internal link must lead to a page or file that exists (and to the anchor it
names), and each notebook page must show the plots its notebook draws.

The site is the one ``make docs`` built when ``NBATTN_DOCS_HTML`` names its
folder (``make test`` does this); otherwise the test builds it first.
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PLOTS = ("plt.", "display(Image", "Image(filename", ".plot(", "imshow(")

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install '.[docs]'")


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium found: apt-get install chromium (CI's .ci/run does)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("NBATTN_DOCS_HTML")
    if given:
        path = Path(given)
        if not path.is_absolute():
            path = ROOT / path
        assert (path / "index.html").is_file(), f"{path} holds no built site: run make docs"
        return path
    out = tmp_path_factory.mktemp("html")
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                        str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


def serve(folder: Path):
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


_PAGE_JS = """() => ({
  text: (document.querySelector('article') || document.body).innerText.trim().length,
  ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id)
        .concat(Array.from(document.querySelectorAll('a[name]')).map(e => e.name)),
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  images: Array.from(document.images).map(i => ({src: i.currentSrc || i.src,
        ok: i.complete && i.naturalWidth > 0,
        output: !!i.closest('.cell_output, .output')})),
})"""


def crawl(browser, folder: Path) -> dict:
    """Load every page reachable from ``index.html``; returns what was seen and what broke."""
    server, base = serve(folder)
    problems: list[str] = []
    pages: dict[str, dict] = {}
    anchors: list[tuple[str, str, str]] = []          # (from page, to page, fragment)
    files_checked: set[str] = set()
    page = browser.new_page()
    bad_requests: list[str] = []
    page.on("requestfailed", lambda req: bad_requests.append(f"{req.url} ({req.failure})")
            if req.url.startswith(base) else None)
    page.on("response", lambda resp: bad_requests.append(f"{resp.url} (HTTP {resp.status})")
            if resp.url.startswith(base) and resp.status >= 400 else None)
    queue = deque([base + "index.html"])
    seen = {base + "index.html"}
    try:
        while queue:
            url = queue.popleft()
            rel = url[len(base):]
            bad_requests.clear()
            resp = page.goto(url, wait_until="load")
            if resp is None or resp.status != 200:
                problems.append(f"{rel}: HTTP {resp.status if resp else 'no response'}")
                continue
            info = page.evaluate(_PAGE_JS)
            pages[rel] = info
            if info["text"] == 0:
                problems.append(f"{rel}: renders no text")
            problems += [f"{rel}: image does not load: {img['src'][:120]}"
                         for img in info["images"] if not img["ok"]]
            problems += [f"{rel}: request failed: {b}" for b in bad_requests]
            for link in info["links"]:
                target, frag = urldefrag(link)
                if not target.startswith(base):
                    continue                                       # external: not ours to check
                path = urlparse(target).path
                if frag:
                    anchors.append((rel, target[len(base):], frag))
                if path.endswith(".html") or path.endswith("/"):
                    if path.endswith("/"):
                        target += "index.html"
                    if target not in seen:
                        seen.add(target)
                        queue.append(target)
                elif target not in files_checked:
                    files_checked.add(target)
                    r = page.request.get(target)
                    if r.status != 200:
                        problems.append(f"{rel}: link to a missing file {target[len(base):]} "
                                        f"(HTTP {r.status})")
    finally:
        page.close()
        server.shutdown()
    for src, dst, frag in anchors:
        if dst in pages and frag not in pages[dst]["ids"]:
            problems.append(f"{src}: link to {dst}#{frag}, an anchor that page lacks")
    return {"pages": pages, "problems": problems}


def test_the_checker_catches_a_broken_site(browser, tmp_path):
    """The crawl is only worth something if it fails on a broken page."""
    (tmp_path / "index.html").write_text(
        "<html><body><article>home <a href='a.html'>a</a> <a href='gone.html'>gone</a>"
        "<a href='a.html#nowhere'>anchor</a> <a href='missing.zip'>zip</a>"
        "<img src='nothing.png'></article></body></html>")
    (tmp_path / "a.html").write_text("<html><body><article>a</article></body></html>")
    problems = "\n".join(crawl(browser, tmp_path)["problems"])
    assert "gone.html: HTTP 404" in problems
    assert "image does not load" in problems and "nothing.png" in problems
    assert "a.html#nowhere" in problems
    assert "missing.zip" in problems


def test_every_page_renders_and_every_link_and_image_resolves(browser, site):
    seen = crawl(browser, site)
    assert not seen["problems"], "\n".join(seen["problems"][:40])
    pages = seen["pages"]
    for must in ["index.html", "install.html", "gpu.html", "gallery.html", "notebooks.html",
                 "concepts/layouts.html", "concepts/masks.html", "concepts/state.html",
                 "concepts/scheduler.html", "concepts/performance.html",
                 "api/reference.html", "api/cuda.html", "api/layout.html", "api/sched.html",
                 "api/perf.html", "api/cli.html",
                 *[f"notebooks/{nb.stem}.html" for nb in NOTEBOOKS]]:
        assert must in pages, f"{must} is not reachable from the index"

    from nbattn import figures
    gallery = [i for i in pages["gallery.html"]["images"] if i["ok"]]
    assert len(gallery) >= len(figures.figure_names())

    for nb in NOTEBOOKS:
        draws = any(p in nb.read_text() for p in PLOTS)
        shown = [i for i in pages[f"notebooks/{nb.stem}.html"]["images"] if i["output"] and i["ok"]]
        if draws:
            assert shown, f"{nb.name} draws figures but its page shows none"

    api = pages["api/reference.html"]["ids"]
    for fn in ("batch_prefill_paged", "batch_decode_paged", "merge_state", "cascade"):
        assert any(i.endswith(fn) for i in api), f"API reference lacks {fn}"
    assert any(i.endswith("BatchDecodeWithPagedKVCacheWrapper") for i in pages["api/cuda.html"]["ids"])
