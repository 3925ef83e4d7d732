"""The ``tiered`` command: inspect, check, import and export stores.

Commands (``tiered COMMAND --help`` shows each one's options and examples)::

    tiered info STORE [--json]                 schema, rows, bytes per row, ratios, tier bytes, format version
    tiered verify STORE [--json] [--decode]    check every file and every blob checksum
    tiered import SRC DST --format FORMAT      d4rl | minari | torchrl | npz | dqn-replay -> a new store
    tiered export STORE DST --format FORMAT    a store -> d4rl | minari | torchrl | npz | dqn-replay
    tiered demo                                Atari frames in a TorchRL replay buffer

``python -m tiered`` is the same command. ``--debug`` (show the traceback of an error) is
accepted before or after the command name. ``tiered --help`` and ``--version`` import no torch:
each command imports what it needs when it runs.

Exit codes:

====  ==========================================================================
0     success (``verify``: no problem found)
1     an unexpected error (a bug: rerun with ``--debug`` and report the traceback)
2     usage: bad arguments, a path that is not a store or not a dataset of that format
3     corruption: ``verify`` found damage, or a store file is damaged or truncated
4     out of space (:class:`~tiered.errors.StorageFullError`)
5     the store is locked by another writer (:class:`~tiered.errors.StoreLockedError`)
6     the store's format version is not supported (:class:`~tiered.errors.FormatVersionError`)
====  ==========================================================================

Errors are printed as one message, without a traceback (``--debug`` shows it). Pointed at a
dataset instead of a store, ``info``, ``verify`` and ``export`` say which ``tiered import``
command converts it.

Example:
    >>> from tiered.cli import main
    >>> main(["--version"])  # doctest: +SKIP
    tiered 0.1.0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

from . import errors as E
from .version import __version__

__all__ = [
    "main",
    "build_parser",
    "exit_code_for",
    "guess_format",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_CORRUPT",
    "EXIT_FULL",
    "EXIT_LOCKED",
    "EXIT_VERSION",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CORRUPT, EXIT_FULL, EXIT_LOCKED, EXIT_VERSION = 0, 1, 2, 3, 4, 5, 6
FORMATS = ("d4rl", "minari", "torchrl", "npz", "dqn-replay")  # = tiered.formats.FORMATS (not imported: keeps --help light)


#: (exception types, exit code), the first match wins: FormatVersionError and NotATieredStoreError
#: before CorruptionError, which they subclass
_EXIT_CODES: tuple[tuple[Any, int], ...] = (
    (E.FormatVersionError, EXIT_VERSION),
    (E.NotATieredStoreError, EXIT_USAGE),
    (E.CorruptionError, EXIT_CORRUPT),
    (E.StorageFullError, EXIT_FULL),
    (E.StoreLockedError, EXIT_LOCKED),
    ((E.UnsupportedFormatError, E.UnknownCodecError, E.StoreExistsError, FileNotFoundError, FileExistsError,
      NotADirectoryError, IsADirectoryError, E.SchemaMismatchError, E.CodecUnavailableError,
      E.IndexOutOfRangeError,  # e.g. exporting a store whose rows include never-written holes
      ValueError), EXIT_USAGE),
)


def exit_code_for(exc: BaseException) -> int:
    """The exit code of an exception (see the module docstring)."""
    return next((code for types, code in _EXIT_CODES if isinstance(exc, types)), EXIT_ERROR)


def _fmt_bytes(n: float | None) -> str:
    # here, not at the top: util.units loads numpy, which `tiered --help` does without
    from .util.units import format_bytes

    return format_bytes(n, none="-")  # a figure a store lacks, or an unbounded budget


def _progress(args: argparse.Namespace) -> bool | None:
    # None: tqdm shows the bar only when stderr is a terminal
    return False if getattr(args, "quiet", False) else None


# ----------------------------------------------------------------------------------------------- info


def _info_spill(args: argparse.Namespace, dirs: list[str]) -> int:
    """``tiered info`` of a spill directory, or of a directory holding spill directories."""
    from .tiers.spill import describe

    found = [describe(d) for d in dirs]
    if args.json:
        print(json.dumps({"spill": found}, indent=1))
        return EXIT_OK
    print("spill tiers of stores without a path (temporary; removed on close and at exit):")
    print(f"{'dir':44} {'owner':>8} {'state':8} {'segments':>9} {'on disk':>12}")
    for d in found:
        state = "running" if d["owner_alive"] else "dead"
        print(f"{d['dir']:44} {d['owner_pid'] or '-':>8} {state:8} {d['segments']:>9,} {_fmt_bytes(d['bytes']):>12}")
    if any(not d["owner_alive"] for d in found):
        print("a dead owner's directory is removed by the next process that spills there")
    return EXIT_OK


def _info(args: argparse.Namespace) -> int:
    from .durable.manifest import MANIFEST, read_manifest
    from .durable.summary import read_summary
    from .sidecar import read_source

    if os.path.isdir(args.store) and not os.path.exists(os.path.join(args.store, MANIFEST)):
        # not a store: a spill directory, or a folder holding some (this import loads torch,
        # which a store's figures do without)
        from .tiers.spill import is_spill_dir, spill_dirs

        if is_spill_dir(args.store):
            return _info_spill(args, [os.path.abspath(args.store)])
        found = spill_dirs(args.store)
        if found:
            return _info_spill(args, found)
    with _suggest_import(args.store):
        body = read_manifest(os.fspath(args.store))
    # the figures from the manifest and the blob index (no torch), or from opening the store
    st = read_summary(os.fspath(args.store), body) or _opened_figures(args.store)
    schema = st["schema"]
    source = read_source(args.store)
    doc: dict[str, Any] = {
        "path": os.path.abspath(args.store),
        "format_version": body.get("format_version"),
        "generation": body.get("generation"),
        "codec": body.get("codec"),
        "backend": body.get("backend"),
        "rows": st["rows"],
        "capacity": st["capacity"],
        "cursor": body.get("cursor"),
        "options": body.get("options"),
        "schema": schema,
        "fields": st["fields"],
        "tiers": st["tiers"],
        "blobs": st.get("blobs"),
        "resident_bytes": st["resident_bytes"],
        "bytes_per_row": st["bytes_per_row"],
        "imported_from": (
            {k: source.get(k) for k in ("format", "origin", "rows", "derived")} if source else None
        ),
    }
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
        return EXIT_OK
    p = print
    p(f"store         {doc['path']}")
    p(
        f"format        tiered v{doc['format_version']}, generation {doc['generation']}, "
        f"backend {doc['backend']}"
    )
    p(f"codec         {doc['codec']}")
    p(f"rows          {doc['rows']:,} of capacity {doc['capacity']:,} (next write at row {doc['cursor']})")
    resident = doc["resident_bytes"]
    p(f"bytes per row {_fmt_bytes(doc['bytes_per_row'])} (blobs once, dense columns and row tables included"
      + (f"; resident_bytes {_fmt_bytes(resident)} in memory when opened read-only)" if resident is not None
         else "; from the files: a process that opens it holds only the pages it uses)"))
    if source:
        derived = ", ".join("/".join(k) for k in source.get("derived", [])) or "none"
        p(f"imported from {source.get('format')} {source.get('origin')} (derived fields: {derived})")
    if schema:
        p("")
        p(f"{'field':32} {'dtype':9} {'shape':16} {'kind':5} {'logical':>12} {'stored':>12} {'ratio':>8}")
        for f in schema:
            fs = st["fields"].get(f["key"], {})
            ratio = fs.get("ratio")
            p(
                f"{f['key']:32} {f['dtype']:9} {str(f['shape']):16} {f['kind']:5} "
                f"{_fmt_bytes(fs.get('logical_bytes')):>12} {_fmt_bytes(fs.get('stored_bytes')):>12} "
                f"{(f'{ratio:.1f}x' if isinstance(ratio, float) and ratio != float('inf') else '-'):>8}"
            )
        narrowed = [f"{f['key']} as {f['stored_dtype']}" for f in schema if f.get("stored_dtype")]
        if narrowed:
            p(f"stored narrower (dense_dtypes, or the values fit; reads give the dtype above): {', '.join(narrowed)}")
        numbered = [f["key"] for f in schema if f.get("row_number")]
        if numbered:
            p(f"row numbers, stored as nothing (every value is its row; reads give the dtype above): {', '.join(numbered)}")
        flagged = [f["key"] for f in schema if f.get("flag_bit") is not None]
        if flagged:
            p(f"bits of one flags byte per row (stored: each field's share): {', '.join(flagged)}")
    p("")
    p(f"{'tier':6} {'bytes used':>12} {'budget':>12} {'blobs':>10} {'fragmentation':>14}")
    for name, t in st["tiers"].items():
        p(
            f"{name:6} {_fmt_bytes(t['bytes_used']):>12} {_fmt_bytes(t['budget']):>12} {t['blobs']:>10,} "
            f"{t['fragmentation']:>14.1%}"
        )
    return EXIT_OK


def _opened_figures(path: str) -> dict[str, Any]:
    """``TieredStore.stats()`` of the store opened read-only, with its ``schema`` entries."""
    from .store import TieredStore  # here only: it imports torch, which read_summary does without

    with TieredStore.open(path, mode="r", warm_bytes=0, hot_bytes=0) as store:
        st = store.stats()
        st["schema"] = (
            [dict(f.to_json(), key="/".join(f.key)) for f in store.schema.values()] if store.schema else []
        )
    return st


# --------------------------------------------------------------------------------------------- verify


def _verify(args: argparse.Namespace) -> int:
    from .verify import verify_store

    with _suggest_import(args.store):
        report = verify_store(args.store, progress=_progress(args), decode=args.decode, open_check=args.open)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(report.summary())
    return EXIT_OK if report.ok else EXIT_CORRUPT


# --------------------------------------------------------------------------------------- import/export


def _parse_key_values(items: Sequence[str] | None, valid: Any, convert: Any, error: Any,
                      ) -> dict[tuple[str, ...], Any] | None:
    """``KEY=VALUE`` options (repeatable, nested keys as ``a/b``) as ``{key tuple: convert(VALUE)}``;
    ``error(item)`` is raised for an item without a key or whose value ``valid`` refuses."""
    if not items:
        return None
    from .schema import str_to_key  # here, not at the top: `tiered --help` imports no torch

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not valid(value):
            raise error(item)
        out[str_to_key(key.strip("/"))] = convert(value)
    return out


def _parse_frames(items: Sequence[str] | None) -> dict[tuple[str, ...], int] | None:
    return _parse_key_values(items, lambda dim: dim.lstrip("-").isdigit(), int, lambda item: E.UnsupportedFormatError(
        f"--frames takes KEY=DIM (e.g. observation=0 or next/pixels=0), got {item!r}"))


def _parse_dense_dtypes(items: Sequence[str] | None) -> dict[tuple[str, ...], str] | None:
    return _parse_key_values(items, bool, str.strip, lambda item: E.SchemaMismatchError(
        f"--dense-dtype takes KEY=DTYPE (e.g. action=uint8 or next/reward=int8), got {item!r}"))


def _import(args: argparse.Namespace) -> int:
    from .formats import import_dataset

    _require_format(args)

    report = import_dataset(
        args.format,
        args.src,
        args.dst,
        codec=args.codec,
        frames=_parse_frames(args.frames),
        chunk_frames=args.chunk_frames,
        capacity=args.capacity,
        backend=args.backend,
        chunk_rows=args.chunk_rows,
        progress=_progress(args),
        force=args.force,
        dense_dtypes={} if args.keep_dtypes else _parse_dense_dtypes(args.dense_dtype),
    )
    if not args.quiet:
        ratio = report.source_bytes / report.store_bytes if report.store_bytes else float("nan")
        print(
            f"imported {report.rows:,} rows from {args.format} {args.src} into {args.dst} "
            f"in {report.seconds:.1f} s "
            f"({report.rows_per_s:,.0f} rows/s)"
        )
        print(
            f"  source {_fmt_bytes(report.source_bytes)} -> store {_fmt_bytes(report.store_bytes)} ({ratio:.1f}x)"
        )
        print(f"  fields: {', '.join(report.fields)}")
        if report.derived:
            print(f"  derived (dropped again on export to {args.format}): {', '.join(report.derived)}")
        if report.dropped:
            print(f"  not imported: {', '.join(report.dropped)}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from .formats import export_dataset

    with _suggest_import(args.store):
        report = export_dataset(
            args.store,
            args.dst,
            args.format,
            chunk_rows=args.chunk_rows,
            progress=_progress(args),
            force=args.force,
            layout=args.layout,
            dataset_id=args.dataset_id,
        )
    if not args.quiet:
        print(
            f"exported {report.rows:,} rows of {args.store} as {args.format} to {args.dst} "
            f"in {report.seconds:.1f} s "
            f"({_fmt_bytes(report.output_bytes)})"
        )
        dropped = report.details.get("dropped")
        if dropped:
            print(f"  not representable in {args.format}, left out: {', '.join(dropped)}")
    return EXIT_OK


# ------------------------------------------------------------------------------ guessing a source


_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_ZIP_MAGIC = b"PK\x03\x04"


def guess_format(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """The import format a path looks like, from its files alone (nothing is parsed).

    Returns:
        ``(format, what it looks like)``, or ``None`` for a path that looks like none of them
        (a tiered store included).

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> open(os.path.join(d, "meta.json"), "w").close()
        >>> guess_format(d)
        ('torchrl', 'a TensorDict memmap directory (what TorchRL datasets and LazyMemmapStorage write)')
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, "manifest.json")):
            return None  # a store (maybe a damaged one): nothing to import
        if os.path.isfile(os.path.join(p, "data", "main_data.hdf5")):
            return "minari", "a Minari dataset directory"
        if os.path.isfile(os.path.join(p, "meta.json")):
            return "torchrl", "a TensorDict memmap directory (what TorchRL datasets and LazyMemmapStorage write)"
        if os.path.isfile(os.path.join(p, "storage", "meta.json")):
            return "torchrl", "a TorchRL replay-buffer checkpoint (rb.dumps)"
        if _looks_like_dqn_replay(p):
            return "dqn-replay", "a Dopamine replay directory (DQN Replay Dataset: <game>/<run>/replay_logs)"
        return None
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if head == _HDF5_MAGIC:
        return "d4rl", "an HDF5 file (D4RL layout)"
    if head.startswith(_ZIP_MAGIC) and p.endswith(".npz"):
        return "npz", "a NumPy .npz archive"
    return None


def _looks_like_dqn_replay(p: str) -> bool:
    """A replay_logs directory, a run (``replay_logs/``) or a game (``*/replay_logs/``); names only."""
    with contextlib.suppress(OSError):
        names = os.listdir(p)
        if any(n.startswith("$store$_observation_ckpt.") for n in names) or "replay_logs" in names:
            return True
        return any(os.path.isdir(os.path.join(p, n, "replay_logs")) for n in names[:1000])
    return False


def _import_command(src: str, fmt: str) -> str:
    stem = os.path.splitext(os.path.basename(os.path.normpath(src)))[0] or "store"
    return f"tiered import {src} {stem}.tiered --format {fmt}"


@contextlib.contextmanager
def _suggest_import(path: str) -> Iterator[None]:
    """Re-raise "not a tiered store" with the ``tiered import`` command when ``path`` is a dataset."""
    try:
        yield
    except (E.NotATieredStoreError, NotADirectoryError) as e:  # a file where a store directory goes
        guess = guess_format(path)
        if guess is None:
            raise
        fmt, what = guess
        raise E.NotATieredStoreError(
            f"{path!r} is not a tiered store; it looks like {what}. Import it first: {_import_command(path, fmt)}"
        ) from e


def _require_format(args: argparse.Namespace) -> None:
    """Refuse ``tiered import`` without ``--format``, naming the format ``SRC`` looks like."""
    if args.format is None:
        guess = guess_format(args.src)
        hint = f"; {args.src!r} looks like {guess[1]}: add --format {guess[0]}" if guess else ""
        raise E.UnsupportedFormatError(
            f"tiered import needs --format FORMAT (one of {', '.join(FORMATS)}){hint}"
        )


# ----------------------------------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        import torchrl  # noqa: F401

        from .atari import cached_rollout  # noqa: F401
    except ImportError as e:
        raise E.CodecUnavailableError(
            f"the demo needs TorchRL and ale-py: pip install 'tiered[torchrl,atari]' ({e})"
        ) from None
    result = run_demo(args.steps, args.batch, args.rounds, memory=not args.no_memory)
    return EXIT_OK if result.identical else EXIT_ERROR  # as the demo's own main


# --------------------------------------------------------------------------------------------- parser


def _epilog(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tiered`` (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="tiered",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, check, import and export tiered stores "
        "(compressed RL replay buffers and datasets).",
        epilog=_epilog("""
            exit codes: 0 ok, 1 unexpected error, 2 usage, 3 corruption, 4 out of space,
                        5 locked by another writer, 6 unsupported format version

            examples:
              tiered import hopper-medium-v2.hdf5 hopper.tiered --format d4rl
              tiered info hopper.tiered
              tiered verify hopper.tiered
              tiered export hopper.tiered hopper.hdf5 --format d4rl
            """),
    )
    p.add_argument("--version", action="version", version=f"tiered {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    # Each command accepts --debug too (the error message says "rerun with --debug", and users
    # add it at the end); SUPPRESS keeps a command's parser from resetting a --debug given first.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_parser_with(debug))
    sub.required = True
    for add_command in (_add_info, _add_verify, _add_import, _add_export, _add_demo):
        add_command(sub)
    return p


def _parser_with(parent: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """An ArgumentParser class whose instances all inherit ``parent``'s arguments."""

    class _CommandParser(argparse.ArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, parents=[parent], **kwargs)

    return _CommandParser


def _command(sub: Any, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser; ``sub`` is what ``ArgumentParser.add_subparsers`` returned."""
    return sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, help=help,
                          description=description, epilog=_epilog(epilog))


def _add_info(sub: Any) -> None:
    s = _command(
        sub,
        "info",
        help="show a store's schema, size, ratios and tiers",
        description="Show a store's schema, rows, per-field compression ratios, per-tier bytes, "
        "format version, generation and codec. Opens the store read-only. Given a spill directory "
        "(stats()['tiers']['spill']['dir'] of a store without a path) or a directory holding spill "
        "directories, show their owner process, whether it runs, and their bytes on disk.",
        epilog="""
            examples:
              tiered info pong.tiered
              tiered info pong.tiered --json | jq .fields
              tiered info /tmp          # the spill directories there
            """,
    )
    s.add_argument("store", help="the store directory (or a spill directory, or a directory holding them)")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.set_defaults(func=_info)


def _add_verify(sub: Any) -> None:
    s = _command(
        sub,
        "verify",
        help="check every file and blob checksum",
        description="Check every file the manifest names (presence, size, header) and the "
        "checksum of every stored blob, reading the files directly (no torch: fast on a "
        "small store); --open also opens the store read-only as a user would. Exit code 0: "
        "no problem; 3: damage found (each damaged blob is named with its field, "
        "rows, file and byte offset).",
        epilog="""
            examples:
              tiered verify pong.tiered
              tiered verify pong.tiered --decode      # also decompress every blob
              tiered verify pong.tiered --open        # then open it through tiered.open (imports torch)
              tiered verify pong.tiered --json -q > report.json
            """,
    )
    s.add_argument("store", help="the store directory")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--decode", action="store_true", help="also decompress every blob (slower)")
    s.add_argument("--open", action="store_true",
                   help="when the files check clean, also open the store read-only through tiered.open "
                   "(imports torch; slower)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_verify)


def _add_import(sub: Any) -> None:
    s = _command(
        sub,
        "import",
        help="import a dataset into a new store",
        description="Import a dataset into a new store. The dataset is read in slices of rows, "
        "so datasets larger than RAM import with bounded memory. The store appears "
        "under DST only once complete. Keys are mapped to TorchRL's layout "
        "(docs/cli.md); export to the same format gives back the source's arrays.",
        epilog="""
            formats:
              d4rl     one HDF5 file: observations, actions, rewards, terminals, timeouts, ...
              minari   a minari dataset directory (data/main_data.hdf5 + data/metadata.json)
              torchrl  a TensorDict memmap directory (TensorDict.memmap / TorchRL caches)
              npz      a .npz archive (D4RL names, or '/'-joined TorchRL keys)
              dqn-replay  Dopamine's replay checkpoints (the DQN Replay Dataset): SRC is a game
                       directory <game>/ (all its runs, told apart by the field 'run'), a run
                       <game>/<run>/ or a replay_logs/ directory; every buffer slot becomes a row
                       with Dopamine's 4-frame stacks (stored once per frame), and 'valid' marks
                       the slots Dopamine's sampler draws (docs/cli.md)

            examples:
              tiered import hopper-medium-v2.hdf5 hopper.tiered --format d4rl
              tiered import ~/.minari/datasets/D4RL/door/human-v2 door.tiered --format minari
              tiered import ~/.cache/torchrl/atari/Pong pong.tiered --format torchrl \\
                  --frames observation=0 --chunk-frames 8
              tiered import rollouts.npz rollouts.tiered --format npz --codec zstd:9
              tiered import dqn/Pong pong.tiered --format dqn-replay --chunk-frames 8
              tiered import dqn/Pong pong.tiered --format dqn-replay --dense-dtype action=uint8
            """,
    )
    s.add_argument("src", metavar="SRC", help="the dataset (file or directory)")
    s.add_argument("dst", metavar="DST", help="the new store directory (must not exist)")
    s.add_argument("--format", choices=FORMATS,
                   help="the dataset's format (required; as for export)")
    s.add_argument(
        "--codec",
        default="zstd",
        help="codec of large fields: zstd, zstd:LEVEL, lz4, raw (default: %(default)s)",
    )
    s.add_argument(
        "--frames",
        action="append",
        metavar="KEY=DIM",
        help="KEY holds a stack of frames along DIM (e.g. observation=0 for [4, 84, 84] stacks): "
        "each frame is stored once. Repeatable; nested keys as next/pixels. Default: found in "
        "the first slice (stacks whose rows share all but one frame)",
    )
    s.add_argument(
        "--chunk-frames",
        type=int,
        default=None,
        metavar="K",
        help="frames of one episode compressed together (default: the store's, 8)",
    )
    s.add_argument(
        "--capacity", type=int, metavar="N", help="rows of the store (default: the dataset's rows)"
    )
    dtypes = s.add_mutually_exclusive_group()
    dtypes.add_argument(
        "--dense-dtype",
        action="append",
        metavar="KEY=DTYPE",
        help="store the dense column KEY in a narrower DTYPE (e.g. action=uint8, next/reward=int8); "
        "reads give the dataset's dtype back, and a value DTYPE cannot hold exactly stops the import. "
        "Repeatable; naming any replaces the dtypes dqn-replay picks by itself",
    )
    dtypes.add_argument(
        "--keep-dtypes",
        action="store_true",
        help="store every dense column in the dataset's own dtype (dqn-replay otherwise stores actions, "
        "rewards and its run/checkpoint/index columns in the narrowest dtypes that hold their values exactly)",
    )
    s.add_argument(
        "--backend",
        choices=("memmap", "hdf5"),
        default="memmap",
        help="cold-tier files (default: %(default)s)",
    )
    s.add_argument(
        "--chunk-rows",
        type=int,
        metavar="N",
        help="rows per slice read (default: 4096, fewer for large rows: at most 32 MiB)",
    )
    s.add_argument("--force", action="store_true", help="replace DST if it exists")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(func=_import)


def _add_export(sub: Any) -> None:
    s = _command(
        sub,
        "export",
        help="export a store as a dataset",
        description="Export a store (opened read-only) as a dataset, oldest rows first, written "
        "in slices of rows. The output appears under DST only once complete. For "
        "a store imported from the same format, the output holds exactly the "
        "source's arrays.",
        epilog="""
            examples:
              tiered export hopper.tiered hopper.hdf5 --format d4rl
              tiered export door.tiered door-minari --format minari \\
                  --dataset-id D4RL/door/human-v2
              tiered export pong.tiered pong-td --format torchrl
                  # then: TensorDict.load_memmap("pong-td", allow_pickle=False)
              tiered export pong.tiered pong.npz --format npz --layout d4rl
              tiered export pong.tiered dqn-again --format dqn-replay
                  # Dopamine's files back, byte-identical once decompressed
            """,
    )
    s.add_argument("store", metavar="STORE", help="the store directory")
    s.add_argument("dst", metavar="DST",
                   help="the output (file for d4rl/npz, directory for minari/torchrl/dqn-replay; must not exist)")
    s.add_argument("--format", required=True, choices=FORMATS, help="the output format")
    s.add_argument(
        "--layout",
        choices=("ted", "d4rl"),
        help="npz only: array names ('/'-joined TorchRL keys, or D4RL names); default: as imported, else ted",
    )
    s.add_argument("--dataset-id", help="minari only: dataset_id written into metadata.json")
    s.add_argument("--chunk-rows", type=int, metavar="N", help="rows per slice written")
    s.add_argument("--force", action="store_true", help="replace DST (once the new output is complete)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary")
    s.set_defaults(func=_export)


def _add_demo(sub: Any) -> None:
    s = _command(
        sub,
        "demo",
        help="Atari frames in a TorchRL replay buffer",
        description="Play ALE Pong with a random policy, fill a TorchRL replay buffer on "
        "TieredStorage and one on LazyTensorStorage, check that their samples are "
        "bit-identical, and report bytes held (anon RSS growth), extend and sample rates, "
        "measured as benchmarks/bench_storages.py measures them "
        "(needs tiered[torchrl,atari]; the same as examples/atari_replay.py).",
        epilog="""
            examples:
              tiered demo
              tiered demo --steps 20000 --batch 256
            """,
    )
    from .demo import add_arguments  # stdlib only at import: --help stays light

    add_arguments(s)
    s.set_defaults(func=_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tiered`` command; return its exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("tiered: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tiered info --json | head`
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - every error becomes one message and an exit code
        if args.debug:
            import traceback

            traceback.print_exc()
        code = exit_code_for(e)
        msg = str(e) or type(e).__name__
        if code == EXIT_ERROR:
            msg = (
                f"unexpected {type(e).__name__}: {msg} (rerun with --debug for the traceback, and report it)"
            )
        print(f"tiered: error: {msg}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
