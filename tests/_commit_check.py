"""A check run after every commit of the tests: each array file a commit wrote equals memory.

An incremental commit writes only the pages that changed, in place; a bug there would leave a file
that differs from the array in memory, found only when a later open reads it. Installed for the
whole test suite (``tests/conftest.py``), this check reads back every array file after every
commit and compares it with memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from tiered.durable import store_files
from tiered.durable.array_files import FileState, array_file
from tiered.durable.manifest import PAGE_BYTES, load_npy


def check_written(files: store_files.StoreFiles, arrays: dict[str, np.ndarray], written: dict[str, FileState], g: int) -> None:
    """Every array file commit ``g`` wrote equals the array
    in memory, except on pages of lazily opened arrays that no use checked (which hold what
    the file held)."""
    for name, arr in arrays.items():
        disk = load_npy(array_file(files.path, name, written[name].file), mmap=False)
        lazy = files.unchecked_pages(name, arr) and files.lazy[name][0]
        if lazy and not lazy.checked.all():
            ok = lazy.checked.copy()
            ok[0] = False  # the header page's head may differ; compare only array bytes
            keep = np.repeat(ok, PAGE_BYTES)[lazy.offset:lazy.offset + arr.nbytes]
            same = disk.shape == arr.shape and np.array_equal(
                disk.reshape(-1).view(np.uint8)[keep[:disk.nbytes]],
                np.ascontiguousarray(arr).reshape(-1).view(np.uint8)[keep])
            if not same:
                raise AssertionError(f"incremental commit {g} left array {name!r} different from memory")
        elif disk.shape != arr.shape or disk.tobytes() != np.ascontiguousarray(arr).tobytes():
            raise AssertionError(f"incremental commit {g} left array {name!r} different from memory")


def check_commits(on: bool = True) -> None:
    """Run :func:`check_written` after every commit from now on (``on=False``: no more)."""
    hooks = store_files.AFTER_COMMIT
    if on and check_written not in hooks:
        hooks.append(check_written)
    elif not on and check_written in hooks:
        hooks.remove(check_written)


@contextlib.contextmanager
def commits_unchecked() -> Iterator[None]:
    """No :func:`check_written` in the ``with`` block (a test measuring memory: the check reads
    every array file into memory)."""
    was = check_written in store_files.AFTER_COMMIT
    check_commits(False)
    try:
        yield
    finally:
        check_commits(was)
