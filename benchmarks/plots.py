"""Plots of the benchmark results, drawn from the JSON the benchmark scripts write.

Each benchmark script calls its function here right after writing its raw results to
``benchmarks/out/``, so a plot is redrawn by the run that measured it:

- ``bench_storages.py`` -> :func:`plot_storages`: bytes held per transition against sample rate,
  one point per storage, and the chunk-size (K) trade-off of the tiered stores it measured;
- ``bench_tiers.py`` -> :func:`plot_tiers`: sample rate with the blobs warm, cold and on disk,
  beside LazyMemmapStorage, and the disk bytes each cold batch read;
- ``bench_import.py`` -> :func:`plot_import`: the importer's memory over time, per format.

``python benchmarks/plots.py`` redraws every plot from the JSON already in ``benchmarks/out/``
(a full run's file is preferred over a ``--quick`` one). The figures go to ``benchmarks/out/plots/``
as PNG and SVG, and to ``docs/plots/`` (which the docs show) only when asked: a script's
``--write-docs``, or ``python benchmarks/plots.py --docs``. A plot drawn from a ``--quick`` run says
so in its title.

Needs matplotlib (``pip install -e ".[docs]"``); without it the scripts print one line and go on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "benchmarks" / "out"
PLOT_DIR = REPO / "docs" / "plots"


def plot_dir(to_docs: bool) -> Path:
    """Where a run's plots go: the docs' folder when asked (``--write-docs``), else beside the JSON."""
    return PLOT_DIR if to_docs else OUT_DIR / "plots"

# the storages in a fixed order and colour, so every plot reads the same way
STORE_STYLE = {
    "lts": ("LazyTensorStorage", "#7f7f7f", "s"),
    "lms": ("LazyMemmapStorage", "#8c564b", "D"),
    "cls": ("CompressedListStorage", "#9467bd", "^"),
}
TIERED_COLOR = "#1f77b4"


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        print('plots: matplotlib is not installed (pip install -e ".[docs]"); no plots drawn')
        return None
    matplotlib.use("Agg")
    # the same input draws the same SVG bytes (no random ids, no date)
    matplotlib.rcParams["svg.hashsalt"] = "tiered"
    import matplotlib.pyplot as plt

    return plt


def _load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _run_note(data: dict[str, Any]) -> str:
    """The line under a title: what produced the numbers, and whether it was a quick run."""
    facts = data.get("facts", {})
    quick = bool(data.get("args", {}).get("quick"))
    date = str(facts.get("date", ""))[:16].replace("T", " ")
    cores = facts.get("logical_cores")
    machine = f"{cores} cores" if cores else ""
    parts = [p for p in (f"`{facts.get('command', '')}`".replace("`", ""), date, machine) if p]
    return ("QUICK RUN (small data): indicative only. " if quick else "") + "; ".join(parts)


def _save(fig: Any, name: str, plt: Any, where: Path) -> list[Path]:
    where.mkdir(parents=True, exist_ok=True)
    paths = [where / f"{name}.png", where / f"{name}.svg"]
    fig.savefig(paths[0], dpi=110, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    for p in paths:
        print(f"plot: {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    return paths


def _title(ax: Any, title: str, data: dict[str, Any]) -> None:
    quick = " (quick run)" if data.get("args", {}).get("quick") else ""
    ax.set_title(f"{title}{quick}", fontsize=11)
    # the run's command and date under the figure (kept out of the axes so layouts stay intact)
    ax.figure.text(0.01, -0.02, textwrap.fill(_run_note(data), 150), fontsize=7, color="#555555",
                   va="top", ha="left")


def _chunk_frames(name: str) -> int | None:
    m = re.search(r"K=(\d+)", name)
    return int(m.group(1)) if m else None


def plot_storages(json_path: Path | str, where: Path = OUT_DIR / "plots") -> list[Path]:
    """Bytes per transition vs sample rate per storage, and the K trade-off, from bench_storages.

    Args:
        json_path: ``benchmarks/out/bench_storages.json`` (or ``_quick.json``).
        where: the folder the PNG and SVG go to (:func:`plot_dir`).

    Returns:
        The files written (none without matplotlib or memory figures).
    """
    plt = _pyplot()
    if plt is None:
        return []
    data = _load(Path(json_path))
    stores: dict[str, str] = data.get("stores", {})
    rates: dict[str, dict[str, float | None]] = data.get("rates", {})
    memory: dict[str, dict[str, Any]] = data.get("memory", {})
    written: list[Path] = []

    def per_transition(key: str) -> float | None:
        m = memory.get(key)
        return m["anon_growth"] / m["transitions"] if m and "error" not in m and m.get("transitions") else None

    # -- bytes held per transition vs sample rate (log-log)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    drawn = 0
    for key, name in stores.items():
        x, y = per_transition(key), (rates.get(key) or {}).get("sample256_rb")
        if x is None or y is None or x <= 0:
            continue
        label, color, marker = STORE_STYLE.get(key, (name, TIERED_COLOR, "o"))
        if key not in STORE_STYLE:
            label = name
        ax.scatter([x], [y], s=70, color=color, marker=marker, label=label, zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
        drawn += 1
        disk = (memory.get(key) or {}).get("disk", {}).get("allocated")
        if disk:  # LazyMemmapStorage keeps its rows in files: show those bytes too
            xd = disk / memory[key]["transitions"]
            ax.scatter([xd], [y], s=70, facecolors="none", edgecolors=color, marker=marker,
                       label=f"{label} (file bytes)", zorder=3)
            ax.plot([x, xd], [y, y], ls=":", color=color, lw=1)
            ax.annotate(f"{label}\n(its files)", (xd, y), textcoords="offset points", xytext=(6, -18),
                        fontsize=8)
    if drawn:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bytes held per transition (anonymous RSS growth of a fresh process; log)")
        ax.set_ylabel("rb.sample(), B=256: transitions/s (log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.text(0.99, 0.01, "better: up and to the left", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=8, color="#555555")
        n = data.get("transitions")
        _title(ax, f"Memory vs sample rate, {n:,} Atari transitions" if n else "Memory vs sample rate", data)
        written += _save(fig, "storages_bytes_vs_rate", plt, where)
    else:
        plt.close(fig)

    # -- sample rate against batch size, per storage (rb.sample() solid, the storage's get dashed)
    batches = sorted({int(m[len("sample"):-len("_rb")]) for r in rates.values() for m in (r or {})
                      if m.startswith("sample") and m.endswith("_rb") and m[len("sample"):-len("_rb")].isdigit()})
    if len(batches) >= 3:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        drawn = 0
        palette = iter(["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#17becf", "#bcbd22"])
        for key, name in stores.items():
            label, color, marker = STORE_STYLE.get(key, (name, TIERED_COLOR, "o"))
            if key not in STORE_STYLE:  # several tiered rows: one colour each
                label, color = name, next(palette, TIERED_COLOR)
            for path, ls, suffix in (("rb", "-", "_rb"), ("get", "--", "_raw")):
                prefix = "sample" if path == "rb" else "get"
                pts = [(b, (rates.get(key) or {}).get(f"{prefix}{b}{suffix}")) for b in batches]
                pts = [(b, r) for b, r in pts if r]
                if len(pts) >= 2:
                    ax.plot([b for b, _ in pts], [r for _, r in pts], ls=ls, marker=marker, color=color,
                            label=f"{label} ({'rb.sample()' if path == 'rb' else 'storage get'})")
                    drawn += 1
        if drawn:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_xlabel("batch size")
            ax.set_ylabel("transitions/s (log)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
            _title(ax, "Sample rate vs batch size", data)
            written += _save(fig, "storages_rate_vs_batch", plt, where)
        else:
            plt.close(fig)

    # -- K trade-off: compressed bytes and sample rate against chunk_frames
    points = []
    for key, name in stores.items():
        k = _chunk_frames(name)
        m = memory.get(key) or {}
        tiers = m.get("tiers") or {}
        rate = (rates.get(key) or {}).get("get256_raw")
        if k is None or not tiers or rate is None:
            continue
        points.append((k, sum(v or 0 for v in tiers.values()) / m["transitions"], per_transition(key), rate))
    if len(points) >= 2:
        points.sort()
        ks = [p[0] for p in points]
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        ax.plot(ks, [p[1] for p in points], "o-", color=TIERED_COLOR, label="compressed blobs / transition")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K = chunk_frames (frames of one trajectory compressed together)")
        ax.set_ylabel("compressed bytes per transition")
        ax.set_ylim(bottom=0)
        right = ax.twinx()
        right.plot(ks, [p[3] for p in points], "s-", color="#d62728", label="store.get, B=256: transitions/s")
        right.set_ylabel("transitions/s", color="#d62728")
        right.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center")
        ax.grid(True, alpha=0.3)
        _title(ax, "Chunk size K: bytes vs decode work", data)
        written += _save(fig, "storages_k_tradeoff", plt, where)
    return written


def plot_tiers(json_path: Path | str, where: Path = OUT_DIR / "plots") -> list[Path]:
    """Sample rate warm vs cold vs LazyMemmapStorage, and disk bytes per batch, from bench_tiers.

    Args:
        json_path: ``benchmarks/out/bench_tiers.json`` (or ``_quick.json``).
        where: the folder the PNG and SVG go to (:func:`plot_dir`).

    Returns:
        The files written.
    """
    plt = _pyplot()
    if plt is None:
        return []
    data = _load(Path(json_path))
    cases = [(k, c) for k, c in data.get("cases", {}).items() if c.get("rate")]
    if not cases:
        return []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    labels = [c["label"] for _, c in cases]
    colors = [STORE_STYLE["lms"][1] if k.startswith("lms") else TIERED_COLOR for k, _ in cases]
    ypos = list(range(len(cases)))[::-1]
    ax.barh(ypos, [c["rate"] for _, c in cases], color=colors)
    ax.set_yticks(ypos, labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("store.get / storage.get, B=256: transitions/s (log)")
    for y, (_, c) in zip(ypos, cases, strict=True):
        ax.text(c["rate"], y, f" {c['rate']:,.0f}", va="center", fontsize=7)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    _title(ax, "Warm vs cold vs LazyMemmapStorage", data)

    disk = [(k, c) for k, c in cases if c.get("read_bytes_median") is not None and "disk" in k]
    if disk:
        yp = list(range(len(disk)))[::-1]
        vals = [max(c["read_bytes_median"], 1) / 1e6 for _, c in disk]
        ax2.barh(yp, vals, color=[STORE_STYLE["lms"][1] if k.startswith("lms") else TIERED_COLOR
                                  for k, _ in disk])
        ax2.set_yticks(yp, [c["label"] for _, c in disk], fontsize=8)
        ax2.set_xscale("log")
        ax2.set_xlabel("MB read from the disk per batch (median; log)")
        for y, v in zip(yp, vals, strict=True):
            ax2.text(v, y, f" {v:.2f}", va="center", fontsize=7)
        ax2.grid(True, axis="x", which="both", alpha=0.3)
        ax2.set_title("Cold batches: bytes the disk delivered", fontsize=11)
    else:
        ax2.axis("off")
    fig.tight_layout()
    return _save(fig, "tiers_warm_cold", plt, where)


def plot_import(json_path: Path | str, where: Path = OUT_DIR / "plots") -> list[Path]:
    """The importer's memory growth over time, one line per format, from bench_import.

    Args:
        json_path: ``benchmarks/out/bench_import.json``.
        where: the folder the PNG and SVG go to (:func:`plot_dir`).

    Returns:
        The files written.
    """
    plt = _pyplot()
    if plt is None:
        return []
    data = _load(Path(json_path))
    results = [r for r in data.get("results", []) if r.get("timeline")]
    if not results:
        return []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in results:
        t = [p[0] for p in r["timeline"]]
        ax.plot(t, [p[2] / 2**20 for p in r["timeline"]], lw=1.3,
                label=f"{r['fmt']}: {r['source_bytes'] / 1e9:.2f} GB source, {r['rows']:,} rows")
    ax.set_xlabel("seconds since import_dataset started")
    ax.set_ylabel("RssAnon growth over the baseline (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    size = data.get("args", {}).get("size_gb")
    title = f"Import memory over time ({size:g} GB per format)" if size else "Import memory over time"
    # bench_import has no --quick: a small --size-gb is its quick run
    if size is not None and size < 1:
        data = {**data, "args": {**data["args"], "quick": True}}
    _title(ax, title, data)
    return _save(fig, "import_memory", plt, where)


def plot_torchrl_dqn(json_path: Path | str, where: Path = OUT_DIR / "plots") -> list[Path]:
    """Bytes per transition and replay time per update per storage, from bench_torchrl_dqn.

    Args:
        json_path: ``benchmarks/out/bench_torchrl_dqn.json``.
        where: the folder the PNG and SVG go to (:func:`plot_dir`).

    Returns:
        The files written.
    """
    plt = _pyplot()
    if plt is None:
        return []
    data = _load(Path(json_path))
    results = list(data.get("results", {}).items())
    if not results:
        return []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [r["label"] for _, r in results]
    colors = [TIERED_COLOR if k.startswith("tiered") else
              STORE_STYLE["lms" if k.startswith("lmm") else "lts"][1] for k, _ in results]
    ypos = list(range(len(results)))[::-1]
    per_row = [r["bytes_per_transition"] for _, r in results]
    ax.barh(ypos, per_row, color=colors)
    ax.set_yticks(ypos, labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per transition (log; x 1M = the example's buffer)")
    for y, v in zip(ypos, per_row, strict=True):
        ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    _title(ax, "TorchRL's DQN Atari pipeline: bytes", data)
    extend = [r["extend_ms"] / 100 for _, r in results]
    sample = [r["sample_ms"] for _, r in results]
    ax2.barh(ypos, sample, color=colors, label="rb.sample() of 32")
    ax2.barh(ypos, extend, left=sample, color=colors, alpha=0.45, label="share of rb.extend(400)")
    ax2.set_yticks(ypos, [""] * len(ypos))
    ax2.set_xlabel("replay time per update (ms)")
    for y, s, e in zip(ypos, sample, extend, strict=True):
        ax2.text(s + e, y, f" {s + e:.2f}", va="center", fontsize=7)
    ax2.legend(fontsize=7, loc="lower right")
    ax2.grid(True, axis="x", alpha=0.3)
    ax2.set_title("Replay time per update (extend / 100 + sample)", fontsize=11)
    fig.tight_layout()
    return _save(fig, "torchrl_dqn", plt, where)


PLOTTERS = {
    "bench_storages": plot_storages,
    "bench_tiers": plot_tiers,
    "bench_import": plot_import,
    "bench_torchrl_dqn": plot_torchrl_dqn,
}


def replot(out_dir: Path = OUT_DIR, to_docs: bool = False) -> list[Path]:
    """Redraw every plot from the JSON in ``out_dir``: a full run's file, else a ``--quick`` one
    (into ``docs/plots/`` with ``to_docs``, else ``benchmarks/out/plots/``)."""
    written: list[Path] = []
    for stem, plot in PLOTTERS.items():
        for candidate in (out_dir / f"{stem}.json", out_dir / f"{stem}_quick.json"):
            if candidate.exists():
                print(f"{candidate.relative_to(REPO) if candidate.is_relative_to(REPO) else candidate}:")
                written += plot(candidate, plot_dir(to_docs))
                break
        else:
            print(f"{stem}: no JSON in {out_dir}; run benchmarks/{stem}.py first")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Redraw the benchmark plots from benchmarks/out/*.json")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the benchmark JSON is")
    p.add_argument("--docs", action="store_true", help="into docs/plots/ (what the docs show), not benchmarks/out/plots/")
    args = p.parse_args(argv)
    return 0 if replot(args.out_dir, args.docs) else 1


if __name__ == "__main__":
    sys.exit(main())
