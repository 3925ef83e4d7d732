"""The documentation site builds strictly and loads in a real browser (tools/check_site.py).

Needs the ``docs`` extra (mkdocs-material, mkdocstrings) and Chromium (Debian: ``apt-get install
-y chromium``); skipped, with the reason, where either is missing. Slow (a full site build, then
Chromium): ``.ci/run`` runs the same check on the site it has just built, when Chromium is there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import check_site  # noqa: E402


def _missing() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed (pip install -e '.[docs]')"
    if check_site.find_chromium() is None:
        return "Chromium is not installed (Debian: apt-get install -y chromium)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_missing() is not None, reason=str(_missing()))
def test_site_builds_and_loads_in_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    problems = check_site.check_site(tmp_path / "site", tmp_path / "shots")
    out = capsys.readouterr().out
    assert problems == [], "\n".join(problems)
    assert (tmp_path / "shots" / "home.png").stat().st_size > 10_000
    assert (tmp_path / "shots" / "benchmarks.png").stat().st_size > 10_000
    # the benchmarks page shows its plots, every one decoded by the browser
    assert "0 problem(s)" in out and "images decoded" in out


def test_the_check_finds_a_missing_plot(tmp_path: Path) -> None:
    """The crawl alone (no build, no browser): a page naming an image that is not there fails."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text('<html><body><img src="plots/gone.svg"><a href="page/">p</a></body></html>')
    (site / "page").mkdir()
    (site / "page" / "index.html").write_text('<html><body><a href="../missing/">m</a></body></html>')
    with check_site.serve(site) as base:
        pages, problems, images = check_site.crawl(base)
    assert len(pages) == 2 and images == 1
    assert any("gone.svg -> HTTP 404" in p for p in problems)
    assert any("missing/: HTTP 404" in p for p in problems)
