"""mkdocs hooks of the documentation site (named in mkdocs.yml).

Two pages join the site only when their files exist, so the site builds (strictly) before and
after they are written:

- ``docs/reliability.md``: "Reliability" in the nav, after "Format spec";
- ``CHANGELOG.md`` at the repository root: rendered as ``changelog.md``, "Changelog" last but one
  in the nav (before the API reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"


def _insert_after(nav: list[Any], title: str, entry: dict[str, str]) -> None:
    titles = [next(iter(item)) if isinstance(item, dict) else None for item in nav]
    nav.insert(titles.index(title) + 1 if title in titles else len(nav), entry)


def on_config(config: Any) -> Any:
    nav = config["nav"]
    docs = Path(config["docs_dir"])
    if (docs / "reliability.md").exists() and not any("Reliability" in item for item in nav if isinstance(item, dict)):
        _insert_after(nav, "Format spec", {"Reliability": "reliability.md"})
    if CHANGELOG.exists() and not any("Changelog" in item for item in nav if isinstance(item, dict)):
        _insert_after(nav, "Benchmarks", {"Changelog": "changelog.md"})
    return config


def on_files(files: Any, config: Any) -> Any:
    if CHANGELOG.exists() and files.get_file_from_path("changelog.md") is None:
        from mkdocs.structure.files import File

        files.append(File.generated(config, "changelog.md", content=CHANGELOG.read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    # CHANGELOG.md is written for the repository root: its links into docs/ point one level up here
    if page.file.src_uri == "changelog.md":
        markdown = markdown.replace("](docs/", "](")
    return markdown
