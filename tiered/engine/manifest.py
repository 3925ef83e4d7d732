"""Snapshots of the index, row tables and dense columns, and the manifest (format version 1).

A commit writes, in this order (docs/format.md):

1. new blob bytes to the cold segments, then fsync them (the tier's ``flush``);
2. a new generation directory ``gen-<g>/`` holding ``.npy`` files of every index column, row
   table and dense column, each fsynced, then the directory fsynced;
3. ``manifest.json`` via a temp file, fsync, rename, fsync of the store directory.

Only then is the previous generation directory removed. Opening reads ``manifest.json``
(always either the old or the new one, never a mix) and memory-maps the files it names,
so reopening costs O(1) in the number of rows. Every file listed in the manifest carries its
size; the manifest carries a SHA-256 of its own body, so a torn or garbage manifest is
detected rather than trusted.

All file writes go through :mod:`tiered.fileio`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import numpy as np

from .. import fileio
from ..errors import CorruptionError, FormatVersionError, NotATieredStoreError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "save_npy", "load_npy", "write_manifest",
           "read_manifest", "gen_dir_name"]

FORMAT_NAME = "tiered"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def gen_dir_name(generation: int) -> str:
    return f"gen-{generation:08d}"


def save_npy(path: str, arr: np.ndarray) -> int:
    """Write ``arr`` as a ``.npy`` file through :mod:`tiered.fileio` and fsync it; return its size."""
    arr = np.require(arr, requirements="C")  # keeps 0-d arrays 0-d (ascontiguousarray makes them 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(arr))
    head = header.getvalue()
    fd = fileio.open_for_write(path)
    try:
        fileio.pwrite(fd, head, 0)
        if arr.nbytes:
            fileio.pwrite(fd, memoryview(arr.reshape(-1).view(np.uint8)), len(head))
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    return len(head) + arr.nbytes


def load_npy(path: str, expected_size: int | None = None, mmap: bool = True) -> np.ndarray:
    """Memory-map (copy-on-write) a ``.npy`` file written by :func:`save_npy`, checking its size."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptionError(f"{path}: file named by the manifest is missing; the store is damaged "
                              "(restore it from a copy)") from None
    if expected_size is not None and size != expected_size:
        raise CorruptionError(f"{path}: expected {expected_size} bytes, found {size} (truncated or overwritten)")
    try:
        if size == 0:
            raise ValueError("empty file")
        arr = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
        if mmap and arr.size == 0:
            arr = np.load(path, allow_pickle=False)
        return arr
    except (ValueError, OSError, EOFError) as e:
        raise CorruptionError(f"{path}: not a valid .npy file ({e})") from None


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(directory: str, body: dict[str, Any]) -> None:
    """Atomically publish a manifest (temp file, fsync, rename, fsync of the directory)."""
    body = dict(body, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    doc = {"body": body, "sha256": _body_digest(body)}
    fileio.write_file_atomic(os.path.join(directory, MANIFEST), json.dumps(doc, indent=1).encode())


def read_manifest(directory: str) -> dict[str, Any]:
    """Read and check a manifest; raise a specific error for every way it can be wrong."""
    if not os.path.isdir(directory):
        raise NotATieredStoreError(f"{directory!r} is not a directory, so it is not a tiered store")
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise NotATieredStoreError(
            f"{directory!r} has no {MANIFEST}: it is not a tiered store (or its first commit never "
            "completed). Create one with TieredStore(capacity, path=...).")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise CorruptionError(f"{path}: the manifest is empty; the store's last commit is damaged")
    try:
        doc = json.loads(raw)
        body = doc["body"]
        digest = doc["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CorruptionError(f"{path}: the manifest is not valid JSON of a tiered store (garbage or "
                              "truncated)") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise NotATieredStoreError(f"{path}: not a tiered manifest (format={body.get('format')!r})"
                                   if isinstance(body, dict) else f"{path}: not a tiered manifest")
    version = body.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise FormatVersionError(
            f"{path}: format version {version!r}; this tiered reads versions 1..{FORMAT_VERSION}. "
            "Upgrade tiered (pip install -U tiered) to open it.")
    if _body_digest(body) != digest:
        raise CorruptionError(f"{path}: manifest checksum mismatch (the file was modified or torn)")
    return body
