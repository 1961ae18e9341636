"""tools/check_site.py finds what it is for, in a real headless Chromium (skipped where Debian's chromium is absent):
a page with a code line wider than its box, a missing image, a console error and a link to a missing anchor gives one
problem each; a clean page gives none."""

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (apt-get install chromium)")

ICON = '<link rel="icon" href="data:,">'  # no favicon.ico request
BOX = ICON + "<style>pre { width: 300px; } pre > code { display: block; overflow: auto; }</style>"
NAV = '<nav class="md-nav"><a class="md-nav__link" href="bad/">bad</a><a class="md-nav__link" href="good/">good</a></nav>'


def _site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    pages = {
        "index.html": f"<html><head>{ICON}</head><body>{NAV}<h1 id='top'>home</h1></body></html>",
        "good/index.html": f"<html><head>{BOX}</head><body><pre><code>short</code></pre><a href='../index.html#top'>"
                           "home</a></body></html>",
        "bad/index.html": f"<html><head>{BOX}</head><body><pre><code>{'x' * 200}</code></pre><img src='gone.png'>"
                          "<script>console.error('boom')</script><a href='../index.html#nowhere'>x</a></body></html>",
    }
    for name, html in pages.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(html)
    return site


def test_each_problem_is_found_and_a_clean_page_passes(tmp_path):
    from playwright.sync_api import sync_playwright

    spec = importlib.util.spec_from_file_location("check_site", ROOT / "tools" / "check_site.py")
    cs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cs)
    srv, root = cs.serve(_site(tmp_path))
    problems, anchors, links = [], {}, {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=cs.ARGS)
            for url in (root, f"{root}good/", f"{root}bad/"):
                page = browser.new_page(viewport={"width": cs.WIDTH, "height": cs.HEIGHT})
                links[url], _ = cs.check_page(page, url, root, problems, anchors)
                page.close()
            browser.close()
    finally:
        srv.shutdown()
    cs.check_anchors(links, anchors, root, problems)
    assert not [x for x in problems if x.startswith(("good/", "index"))], problems
    bad = [x for x in problems if x.startswith("bad/")]
    assert any("code wider than its box" in x for x in bad) and any("image not loaded: gone.png" in x for x in bad)
    assert any("console error: boom" in x for x in bad) and any("broken anchor index.html#nowhere" in x for x in bad)
