"""Read the built documentation site in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright
over every page reachable from the navigation, served on localhost. Each page must answer 200 with no console error,
no failed request, every image loaded, every in-site anchor present and no code block wider than its box at 1280 px;
the search's first hit for each task's words must be its guide page. Prints one line per problem; exit 1 if any.

    python tools/check_site.py [--site build/site] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

WIDTH, HEIGHT = 1280, 900
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # a closed network: no background connections
SEARCHES = {  # the words a reader types -> the page that answers them first
    "profile": "guide/profile/", "sweep": "guide/paper/", "GPTQ": "guide/gptq-awq/", "NVFP4": "guide/linear/",
    "perplexity": "guide/perplexity/", "sensitivity": "guide/sensitivity/", "install": "", "notebook": "guide/notebooks/",
    "Hub": "guide/your-model/", "export": "guide/checkpoints/",
}
PAGE_CHECKS = """() => {
  const wide = [...document.querySelectorAll('pre > code')].filter(p => p.scrollWidth > p.clientWidth + 1)
    .map(p => p.innerText.split('\\n').reduce((a, b) => a.length > b.length ? a : b).slice(0, 90));
  const images = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'));
  const ids = new Set([...document.querySelectorAll('[id]')].map(e => e.id));
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const nav = [...document.querySelectorAll('nav.md-nav a.md-nav__link[href]')].map(a => a.href);  // what the menu reaches
  return {wide, images, ids: [...ids], links, nav};
}"""


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The site on a free localhost port, quietly."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


def check_page(page, url: str, root: str, problems: list[str], anchors: dict) -> tuple[list[str], list[str]]:
    """Open ``url``; append its problems; return (its in-site links, its navigation's links)."""
    console, failed = [], []
    page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
    page.on("requestfailed", lambda r: failed.append(r.url))
    resp = page.goto(url, wait_until="networkidle")
    name = url.removeprefix(root) or "index"
    if resp is None or resp.status != 200:
        problems.append(f"{name}: status {resp.status if resp else 'none'}")
        return [], []
    got = page.evaluate(PAGE_CHECKS)
    problems += [f"{name}: console error: {c[:160]}" for c in console]
    problems += [f"{name}: request failed: {u}" for u in failed]
    problems += [f"{name}: image not loaded: {i}" for i in got["images"]]
    problems += [f"{name}: code wider than its box at {WIDTH} px: {w}" for w in got["wide"]]
    anchors[url] = set(got["ids"])
    return [u for u in got["nav"] + got["links"] if u.startswith(root)], got["nav"]


def check_anchors(links: dict[str, list[str]], anchors: dict[str, set], root: str, problems: list[str]) -> None:
    """Every in-site link with a fragment points at an id of a page that was read."""
    for src, targets in links.items():
        for t in targets:
            base, frag = urldefrag(t)
            base = base.removesuffix("index.html")  # a directory and its index.html are one page
            if frag and base in anchors and frag not in anchors[base]:
                problems.append(f"{src.removeprefix(root) or 'index'}: broken anchor {t.removeprefix(root)}")


def check_search(browser, root: str, problems: list[str]) -> None:
    """The first search hit for each of ``SEARCHES`` is its page (each query on a fresh page)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for words, want in SEARCHES.items():
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.goto(root, wait_until="networkidle")
        page.click("input.md-search__input")  # opens the search; typing then runs it, keystroke by keystroke
        for _ in range(3):
            page.keyboard.type(words, delay=30)
            try:
                page.wait_for_function("() => /matching/.test(document.querySelector('.md-search-result__meta')"
                                       "?.textContent || '')", timeout=10000)
                break
            except PlaywrightTimeout:  # the index was still loading: typed again
                page.fill("input.md-search__input", "")
        first = page.eval_on_selector(".md-search-result__item a", "a => a.href") \
            if page.query_selector(".md-search-result__item a") else ""
        got = urlparse(urldefrag(first)[0]).path.lstrip("/")
        if got != want:
            problems.append(f"search {words!r}: first hit {got or 'index'}, expected {want or 'index'}")
        page.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default="build/site")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    a = ap.parse_args()
    site = Path(a.site)
    if not (site / "index.html").exists():
        print(f"check_site: {site}/index.html not found; build the site first (make docs)", file=sys.stderr)
        return 2
    if not Path(a.chromium).exists():
        print(f"check_site: no Chromium at {a.chromium}; install Debian's (apt-get install chromium) or pass --chromium",
              file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    srv, root = serve(site)
    problems, anchors, links, seen, queue = [], {}, {}, set(), [root]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=a.chromium, args=ARGS)
        while queue:
            url = urldefrag(queue.pop(0))[0]
            if url in seen or not url.endswith("/") and not url.endswith(".html"):
                continue
            seen.add(url)
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            links[url], nav = check_page(page, url, root, problems, anchors)
            page.close()
            queue += [urldefrag(urljoin(url, n))[0] for n in (*nav, *links[url])]
        check_anchors(links, anchors, root, problems)
        check_search(browser, root, problems)
        browser.close()
    srv.shutdown()
    for line in problems:
        print(line)
    print(f"check_site: {len(seen)} pages, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
