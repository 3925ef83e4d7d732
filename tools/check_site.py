"""Check the documentation site in a real browser: build it, serve it, load it in headless Chromium.

Run: ``python tools/check_site.py [--site DIR] [--no-build] [--shots DIR]``

1. ``mkdocs build --strict`` into ``--site`` (skipped with ``--no-build``: check a built site);
2. serve it with Python's ``http.server`` on 127.0.0.1 (a free port);
3. crawl every page from the home page and request every internal link and resource it names
   (``<a href>``, ``<img src>``, ``<link href>``, ``<script src>``): each must answer 200, and an
   image must not be empty;
4. load the home page and the benchmarks page in headless Chromium (Debian's ``chromium``),
   driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``: no extra
   package), and fail on an uncaught exception, a console error, a failed or >= 400 request, or
   an ``<img>`` that did not decode (``naturalWidth == 0``); save a full-page screenshot of each.

Exit status 0 when everything loaded; 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64decode
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BROWSER_PAGES = ("", "benchmarks/")  # the home page and the benchmarks page
LINK_ATTRS = {"a": "href", "img": "src", "link": "href", "script": "src", "source": "src"}


def find_chromium() -> str | None:
    """The Chromium executable on PATH (Debian: ``chromium``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def build_site(site: Path) -> None:
    """``mkdocs build --strict`` into ``site``; raises with mkdocs' output when it fails."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{out.stdout}{out.stderr}")


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on 127.0.0.1 on a free port; yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (tag, url)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        want = LINK_ATTRS.get(tag)
        for name, value in attrs:
            if name == want and value:
                self.links.append((tag, value))


def _fetch(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, b"", ""


def crawl(base: str) -> tuple[list[str], list[str], int]:
    """Every page reachable from ``base``, and the problems found: (pages, problems, images)."""
    seen: set[str] = set()
    pages: list[str] = []
    problems: list[str] = []
    images = 0
    todo = [base]
    checked: dict[str, tuple[int, int]] = {}
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        status, body, ctype = _fetch(page)
        if status != 200:
            problems.append(f"{page}: HTTP {status}")
            continue
        if "html" not in ctype:
            continue
        pages.append(page)
        parser = _Links()
        parser.feed(body.decode("utf-8", "replace"))
        for tag, link in parser.links:
            url = urllib.parse.urljoin(page, link)
            parts = urllib.parse.urlsplit(url)
            if not url.startswith(base) or parts.scheme not in ("http", "https"):
                continue  # another host (none expected) or mailto:/javascript:
            url = urllib.parse.urlunsplit(parts._replace(fragment=""))
            if tag == "a" and (url.endswith("/") or url.endswith(".html")):
                todo.append(url)
                continue
            if url not in checked:
                st, data, _ = _fetch(url)
                checked[url] = (st, len(data))
            st, size = checked[url]
            if tag == "img":
                images += 1
            if st != 200:
                problems.append(f"{page}: <{tag}> {link} -> HTTP {st}")
            elif tag == "img" and size == 0:
                problems.append(f"{page}: <img> {link} is empty")
    return sorted(pages), problems, images


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (fd 3 in, fd 4 out)."""

    def __init__(self, executable: str, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire() -> None:  # in the child: the protocol pipes become fds 3 and 4
            # copies above both numbers first, so neither dup2 overwrites the other's source
            a, b = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [executable, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--hide-scrollbars", f"--user-data-dir={profile}",
             "about:blank"],
            preexec_fn=wire, close_fds=False,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 120) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str, since: int, timeout: float = 120) -> None:
        """Read events until ``method`` arrives for ``session`` (looking at events from ``since`` on)."""
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events[since:]):
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except Exception:  # already gone: the wait below reaps it
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


IMAGES_JS = """JSON.stringify({
  title: document.title,
  images: Array.from(document.images).map(i => ({src: i.currentSrc || i.src, complete: i.complete,
                                                   width: i.naturalWidth, height: i.naturalHeight})),
  height: document.documentElement.scrollHeight,
})"""


def load_page(browser: Browser, url: str, shot: Path) -> tuple[dict[str, Any], list[str]]:
    """Load ``url`` in a fresh tab; returns what the page showed and the problems seen."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        browser.send(f"{domain}.enable", session=session)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=session)
    start = len(browser.events)
    browser.send("Page.navigate", {"url": url}, session=session)
    browser.wait_for("Page.loadEventFired", session, start)
    time.sleep(1.0)  # let late scripts (search worker, highlighting) report their errors
    info = json.loads(browser.send("Runtime.evaluate", {"expression": IMAGES_JS, "returnByValue": True},
                                   session=session)["result"]["value"])
    problems = []
    for e in browser.events[start:]:
        if e.get("sessionId") != session:
            continue
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            problems.append(f"{url}: uncaught exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            problems.append(f"{url}: console error: {p['entry']['text']} ({p['entry'].get('url', '')})")
        elif method == "Runtime.consoleAPICalled" and p["type"] == "error":
            problems.append(f"{url}: console.error: {[a.get('value') for a in p.get('args', [])]}")
        elif method == "Network.loadingFailed" and not p.get("canceled"):
            problems.append(f"{url}: request failed: {p.get('errorText')} (request {p.get('requestId')})")
        elif method == "Network.responseReceived" and p["response"]["status"] >= 400:
            problems.append(f"{url}: HTTP {p['response']['status']} for {p['response']['url']}")
    for img in info["images"]:
        if not img["complete"] or img["width"] == 0:
            problems.append(f"{url}: image did not load: {img['src']}")
    shot.parent.mkdir(parents=True, exist_ok=True)
    data = browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                   "clip": {"x": 0, "y": 0, "width": 1280,
                                                            "height": min(info["height"], 6000), "scale": 1}},
                        session=session)["data"]
    shot.write_bytes(b64decode(data))
    browser.send("Target.closeTarget", {"targetId": target})
    return info, problems


def check_site(site: Path, shots: Path, *, build: bool = True, chromium: str | None = None) -> list[str]:
    """Build (optionally), serve, crawl and load the site; returns the problems (empty: all good)."""
    if build:
        build_site(site)
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium on PATH (Debian: apt-get install -y chromium)")
    with serve(site) as base, tempfile.TemporaryDirectory(prefix="check_site_profile_") as profile:
        pages, problems, images = crawl(base)
        print(f"crawled {len(pages)} pages from {base}: {images} <img> links checked, "
              f"{len(problems)} problem(s)")
        browser = Browser(chromium, profile)
        try:
            version = browser.send("Browser.getVersion")["product"]
            for rel in BROWSER_PAGES:
                name = rel.strip("/") or "home"
                info, found = load_page(browser, base + rel, shots / f"{name}.png")
                loaded = sum(1 for i in info["images"] if i["width"] > 0)
                print(f"{version}: {base + rel}: title {info['title']!r}, {loaded} of {len(info['images'])} "
                      f"images decoded, {len(found)} problem(s); screenshot {shots / (name + '.png')}")
                problems += found
        finally:
            browser.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", type=Path, default=None, help="where the site is built (default: a temp dir)")
    p.add_argument("--no-build", action="store_true", help="check an already built --site")
    p.add_argument("--shots", type=Path, default=REPO / "benchmarks" / "out" / "site-check",
                   help="where the screenshots go")
    args = p.parse_args(argv)
    if args.no_build and args.site is None:
        p.error("--no-build needs --site")
    with tempfile.TemporaryDirectory(prefix="check_site_") as tmp:
        site = args.site or Path(tmp) / "site"
        problems = check_site(site, args.shots, build=not args.no_build)
    for line in problems:
        print("PROBLEM:", line)
    print("site check:", "OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
