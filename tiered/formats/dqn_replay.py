"""dqn-replay: the DQN Replay Dataset layout (Dopamine's replay-buffer checkpoints).

A dataset root holds ``<game>/<run>/replay_logs/``; each checkpoint ``i`` of a run is six
gzipped ``np.save`` files, as Dopamine's ``OutOfGraphReplayBuffer.save`` writes them::

    $store$_observation_ckpt.<i>.gz   uint8   [N, 84, 84]   one frame per buffer slot
    $store$_action_ckpt.<i>.gz        int32   [N]
    $store$_reward_ckpt.<i>.gz        float32 [N]
    $store$_terminal_ckpt.<i>.gz      uint8   [N]
    add_count_ckpt.<i>.gz             int     []            transitions added (cursor = add_count % N)
    invalid_range_ckpt.<i>.gz         int     [stack + update_horizon]   slots around the cursor

A checkpoint is a circular buffer of ``N`` slots, with ``stack - 1`` zero slots before each
episode. Dopamine's sampler builds the state of slot ``i`` from the slots ``i - 3 .. i``
(modulo ``N``, oldest first) and the next state from ``i - 2 .. i + 1``; it samples slot ``i``
only when it is *valid*: not in ``invalid_range``, no terminal among slots ``i - 3 .. i - 1``
and, while the buffer is not full, ``stack - 1 <= i < cursor - 1``.

Import makes one store row per slot, with the stacks built exactly so::

    observation           uint8   [4, 84, 84]   slots i-3 .. i (stored once per frame: frames=)
    ("next","observation") uint8  [4, 84, 84]   slots i-2 .. i+1
    action                int32   []
    ("next","reward")     float32 [1]
    ("next","terminated") bool    [1]           terminal[i]
    ("next","done")       bool    [1]           derived: terminated, or the buffer's time order
                                                breaks after slot i (the newest slot, the end of
                                                the checkpoint's rows, the unwritten tail)
    ("next","truncated")  bool    [1]           derived: done and not terminated
    valid                 bool    []            derived: Dopamine's sampler may draw slot i
    run, checkpoint       int32   []            derived: which run and checkpoint
    index                 int32   []            derived: the slot i

Rows of one checkpoint are written in the order ``3, 4, ..., N - 1, 0, 1, 2``: the stacks of
slots 0..2 wrap to the end of the buffer, so they come last and the reader never holds more
than one slice of the files in memory. ``ROOT`` may be the dataset root (with one game), a game
directory (all its runs go into one store, told apart by ``run``), a run directory or a
``replay_logs`` directory (one run).

Export (``tiered export STORE OUT --format dqn-replay``, stores imported from this format) writes
the files back under ``OUT`` at the same relative paths. The decompressed ``.npy`` bytes are
identical to the source's (the ``.npy`` headers and the two small files are kept verbatim); the
gzip members are written at level 9 as Dopamine writes them, but with no file name and a
modification time of 0 in their gzip header, so the ``.gz`` files themselves may differ.

Reading is streaming and bounded: every file is decompressed as a stream and read a slice of
rows at a time; sizes from a header are checked against the file before anything is allocated
(deflate cannot expand data more than 1032 times); a ``.npy`` holding Python objects is refused
(nothing is unpickled), and so are truncated, corrupt or mis-shaped files, naming the file.
``episode_end_indices_ckpt.<i>.gz`` (a pickle written by recent Dopamine versions) is not read:
``valid`` ignores the episode ends it lists (it matters only for episodes cut without a
terminal and an update horizon above 1).

Example:
    >>> import tiered.formats as tf
    >>> tf.import_dataset("dqn-replay", "dqn/Pong", "pong.tiered")  # doctest: +SKIP
    ImportReport(rows=5000000, ...)
    >>> tf.export_dataset("pong.tiered", "dqn-again", "dqn-replay")  # doctest: +SKIP
    ExportReport(rows=5000000, ...)
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..errors import InvalidDatasetError, TieredError, UnsupportedFormatError
from ..schema import fits_exactly, narrowest_dtype
from ..util import fileio
from ..util.batch import isin
from ..util.progress import progress_bar
from .common import NPY_MAX_HEADER, chunk_rows_for, iter_store, read_npy_header, writing
from .keymap import ACTION, DONE, NEXT_OBS, OBS, REWARD, TERMINATED, TRUNCATED

__all__ = [
    "DQNReplaySource",
    "write_dqn_replay",
    "find_runs",
    "NpyGzReader",
    "STORE_PREFIX",
    "ARRAYS",
    "GZIP_LEVEL",
    "STACK",
]

#: Prefix of the files of Dopamine's storage arrays.
STORE_PREFIX = "$store$_"
#: Storage arrays of a checkpoint: name -> (dtype, dimensions).
ARRAYS: dict[str, tuple[np.dtype, int]] = {
    "observation": (np.dtype(np.uint8), 3),
    "action": (np.dtype(np.int32), 1),
    "reward": (np.dtype(np.float32), 1),
    "terminal": (np.dtype(np.uint8), 1),
}
#: Small members saved with ``np.save`` next to the arrays.
EXTRAS = ("add_count", "invalid_range")
#: Dopamine writes with ``gzip.GzipFile(fileobj=f, mode="wb")``: the default level, 9.
GZIP_LEVEL = 9
#: Frames per state in the DQN Replay Dataset.
STACK = 4
#: A frame side longer than this is not an Atari screen (refused before anything is allocated).
MAX_SIDE = 4096
#: Deflate's largest expansion: a member of ``c`` bytes decompresses to at most ~1032 * c bytes.
MAX_DEFLATE_RATIO = 1032
#: The small files (add_count, invalid_range) are read whole, up to this many bytes.
MAX_SMALL_BYTES = 1 << 20
_NPY_MAGIC = b"\x93NUMPY"
_CKPT = re.compile(r"^\$store\$_observation_ckpt\.([0-9]+)\.gz$")
_RUN_FIELDS = (("run",), ("checkpoint",), ("index",), ("valid",))
_READ_ERRORS = (OSError, EOFError, zlib.error, ValueError, SyntaxError, struct.error, TypeError)


#: Slots of an action or reward file read at a time while scanning the values' ranges.
SCAN_ROWS = 1 << 20


class _RewardRange:
    """Which of the narrower reward dtypes hold every float32 reward seen so far exactly (fed slice
    by slice), by the test the store's writes apply (:func:`tiered.schema.fits_exactly`)."""

    #: In order of preference. Signed integers only: rewards are signed by nature, and a store
    #: extended later keeps room for both signs. float16 only without a NaN: a float32 NaN does not
    #: come back bit for bit through it (fits_exactly refuses it; export promises the bits).
    CANDIDATES = (torch.int8, torch.int16, torch.float16)

    def __init__(self) -> None:
        self.fits = dict.fromkeys(self.CANDIDATES, True)

    def add(self, values: np.ndarray) -> None:
        v = torch.from_numpy(values)
        for dtype in self.CANDIDATES:  # a dtype stays a candidate while every value so far fits it
            if self.fits[dtype]:
                self.fits[dtype] = fits_exactly(v, dtype)

    def dtype(self) -> torch.dtype | None:
        return next((d for d in self.CANDIDATES if self.fits[d]), None)


def _file_name(logs: str, name: str, ckpt: int | str) -> str:
    """A checkpoint's file; ``ckpt`` as its file names spell it (``"7"``; an int: its plain spelling)."""
    return os.path.join(logs, f"{name}_ckpt.{ckpt}.gz")


#: Checkpoint numbers are stored in an int32 column (``checkpoint``): larger ones are refused.
MAX_CHECKPOINT = (1 << 31) - 1


def _checkpoints(logs: str, files: list[str]) -> list[tuple[int, str]]:
    """The checkpoints of a ``replay_logs`` directory: ``(number, spelling)`` in number order.

    The number is compared as written: two spellings of one number (``.1.`` and ``.01.``) would
    read one checkpoint twice and drop the other, so they are refused, naming both files.

    Raises:
        InvalidDatasetError: two files spell one checkpoint number, or a number does not fit the
            ``checkpoint`` column (int32).

    Example:
        >>> _checkpoints("logs", ["$store$_observation_ckpt.10.gz", "$store$_observation_ckpt.9.gz"])
        [(9, '9'), (10, '10')]
    """
    seen: dict[int, str] = {}
    for f in files:
        m = _CKPT.match(f)
        if m is None:
            continue
        spelling = m.group(1)
        digits = spelling.lstrip("0") or "0"  # int() of a very long string is refused by Python itself
        if len(digits) > 10 or int(digits) > MAX_CHECKPOINT:
            raise InvalidDatasetError(
                f"{os.path.join(logs, f)}: checkpoint number {spelling[:40]}{'...' if len(spelling) > 40 else ''} "
                f"is larger than {MAX_CHECKPOINT} (the largest a store's int32 checkpoint column holds); "
                "Dopamine numbers checkpoints by training iteration: rename the files")
        number = int(digits)
        if number in seen:
            first, second = sorted([seen[number], spelling])
            raise InvalidDatasetError(
                f"{_file_name(logs, STORE_PREFIX + 'observation', first)} and "
                f"{_file_name(logs, STORE_PREFIX + 'observation', second)} both name checkpoint {number}; "
                "keep one of them (Dopamine writes the number without leading zeros)")
        seen[number] = spelling
    return sorted(seen.items())


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Read errors of ``path`` (gzip, zlib, the .npy header parser) as InvalidDatasetError naming it."""
    try:
        yield
    except (TieredError, FileNotFoundError, MemoryError):
        raise
    except _READ_ERRORS as e:
        raise InvalidDatasetError(
            f"{path}: cannot read it as a gzipped .npy file ({type(e).__name__}: {e}); the file is damaged, "
            "truncated or not a Dopamine replay checkpoint") from e


class NpyGzReader:
    """A gzipped ``.npy`` file read as a stream of row slices (nothing else held in memory).

    Args:
        path: the ``.gz`` file.
        dtype: the dtype the array must have (``None``: any plain dtype).
        ndim: the number of dimensions it must have (``None``: any).

    Raises:
        InvalidDatasetError: not a gzipped ``.npy``, another dtype or shape, a header larger than
            the file could hold, or (on read) fewer rows than the header says.
        PickledDataError: the array holds Python objects.

    Example:
        >>> import gzip, os, tempfile, numpy as np
        >>> p = os.path.join(tempfile.mkdtemp(), "a.gz")
        >>> with gzip.open(p, "wb") as f:
        ...     np.save(f, np.arange(5, dtype=np.int32))
        >>> r = NpyGzReader(p, np.dtype(np.int32), 1)
        >>> r.shape, r.read(3).tolist(), r.read(2).tolist()
        ((5,), [0, 1, 2], [3, 4])
        >>> r.finish(); r.close()
    """

    def __init__(self, path: str, dtype: np.dtype | None = None, ndim: int | None = None) -> None:
        self.path = path
        self._gz: Any = None
        self._gz = gzip.open(path, "rb")
        try:
            with _naming(path):
                self.header = self._read_header()
                self.shape, fortran, self.dtype = read_npy_header(io.BytesIO(self.header), path)
            self._check(dtype, ndim, fortran)
        except BaseException:
            self.close()
            raise
        self.rows = self.shape[0] if self.shape else 1
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.pos = 0

    def _read_header(self) -> bytes:
        head = self._exact(10)
        if head[:6] != _NPY_MAGIC:
            raise InvalidDatasetError(f"{self.path}: not a .npy file inside the gzip stream (magic {head[:6]!r})")
        if head[6] == 1:
            n = int.from_bytes(head[8:10], "little")
            return bytes(head + self._exact(n))
        more = self._exact(2)
        n = int.from_bytes(head[8:10] + more, "little")
        if n > NPY_MAX_HEADER:
            raise InvalidDatasetError(f"{self.path}: a .npy header of {n} bytes; numpy writes at most a few hundred")
        return bytes(head + more + self._exact(n))

    def _check(self, dtype: np.dtype | None, ndim: int | None, fortran: bool) -> None:
        if dtype is not None and self.dtype != dtype:
            raise InvalidDatasetError(
                f"{self.path}: the array is {self.dtype.str}, expected {dtype.str} ({dtype}) as Dopamine writes it")
        if ndim is not None and len(self.shape) != ndim:
            raise InvalidDatasetError(
                f"{self.path}: the array has shape {self.shape}, expected {ndim} dimension(s)")
        if fortran and len(self.shape) > 1:
            raise InvalidDatasetError(f"{self.path}: the array is Fortran-ordered; Dopamine writes C order")
        if any(d > MAX_SIDE for d in self.shape[1:]) or any(d < 0 for d in self.shape):
            raise InvalidDatasetError(f"{self.path}: implausible shape {self.shape} in the .npy header")
        nbytes = int(np.prod(self.shape, dtype=np.float64)) * self.dtype.itemsize
        limit = MAX_DEFLATE_RATIO * os.path.getsize(self.path) + (1 << 16)
        if nbytes > limit:
            raise InvalidDatasetError(
                f"{self.path}: the header says {self.shape} ({nbytes:,} bytes), more than a gzip file of "
                f"{os.path.getsize(self.path):,} bytes can hold; the file is truncated or its header is corrupt")

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self._fill(memoryview(buf))
        return buf

    def _fill(self, view: memoryview) -> None:
        n, got = len(view), 0
        with _naming(self.path):
            while got < n:
                k = self._gz.readinto(view[got:])
                if not k:
                    raise InvalidDatasetError(
                        f"{self.path}: the file ends after {got} of {n} bytes expected; it is truncated")
                got += k

    def read(self, n: int) -> np.ndarray:
        """The next ``n`` rows (fewer only past the end: never, for a complete file)."""
        n = max(0, min(n, self.rows - self.pos))
        raw = self._exact(n * self.row_bytes) if n else b""
        self.pos += n
        return np.frombuffer(raw, dtype=self.dtype).reshape(n, *self.shape[1:])

    def read_into(self, out: np.ndarray) -> int:
        """Read the next rows into ``out`` (C-contiguous, this array's dtype and row shape), as many
        as it holds or as are left; return how many."""
        n = max(0, min(out.shape[0], self.rows - self.pos))
        if n:
            self._fill(memoryview(out[:n].reshape(-1).view(np.uint8)))
        self.pos += n
        return n

    def read_all(self) -> np.ndarray:
        """The whole array (for the small files only)."""
        out = np.frombuffer(self._exact(self.rows * self.row_bytes if self.shape else self.dtype.itemsize),
                            dtype=self.dtype)
        self.pos = self.rows
        return out.reshape(self.shape)

    def finish(self) -> None:
        """Check that the stream ends right after the array (trailing bytes would not round-trip)."""
        with _naming(self.path):
            extra = self._gz.read(1)
        if extra:
            raise InvalidDatasetError(f"{self.path}: bytes follow the array in the gzip stream; not an np.save file")

    def close(self) -> None:
        if self._gz is not None:
            self._gz.close()
            self._gz = None


def _open_reader(path: str, dtype: np.dtype | None, ndim: int | None) -> NpyGzReader:
    if not os.path.isfile(path):
        raise InvalidDatasetError(f"{path}: missing; a Dopamine checkpoint has all six files {_six_files()}")
    with _naming(path):
        return NpyGzReader(path, dtype, ndim)


def _six_files() -> str:
    return ", ".join([f"{STORE_PREFIX}{a}_ckpt.<i>.gz" for a in ARRAYS] + [f"{e}_ckpt.<i>.gz" for e in EXTRAS])


def _read_small(path: str) -> tuple[bytes, np.ndarray]:
    """A small member (add_count, invalid_range): its decompressed bytes and its array."""
    if not os.path.isfile(path):
        raise InvalidDatasetError(f"{path}: missing; a Dopamine checkpoint has all six files {_six_files()}")
    if os.path.getsize(path) > MAX_SMALL_BYTES:
        raise InvalidDatasetError(f"{path}: {os.path.getsize(path):,} bytes; this file holds a few numbers")
    r = _open_reader(path, None, None)
    try:
        if r.rows * r.row_bytes > MAX_SMALL_BYTES or r.dtype.kind not in "iuf":
            raise InvalidDatasetError(f"{path}: expected a few integers, found {r.dtype} {r.shape}")
        arr = r.read_all()
        r.finish()
        raw = r.header + arr.tobytes()
    finally:
        r.close()
    return raw, arr


def _sort_names(names: list[str]) -> list[str]:
    return sorted(names, key=lambda s: (0, int(s), s) if s.isdigit() else (1, 0, s))


def find_runs(root: str | os.PathLike[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """The game and the runs under ``root``: ``(game, [(run name, replay_logs path relative to root)])``.

    Raises:
        UnsupportedFormatError: ``root`` holds no replay_logs, or several games.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, "Pong", "1", "replay_logs"))
        >>> find_runs(d)
        ('Pong', [('1', 'Pong/1/replay_logs')])
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such directory (expected ROOT/<game>/<run>/replay_logs)")
    name = os.path.basename(os.path.normpath(os.path.abspath(root)))
    if any(_CKPT.match(f) for f in os.listdir(root)):  # a replay_logs directory itself
        return None, [(os.path.basename(os.path.dirname(os.path.abspath(root))) or "0", ".")]
    if os.path.isdir(os.path.join(root, "replay_logs")):  # a run
        return None, [(name, "replay_logs")]
    subs = _sort_names([d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))])
    runs = [(d, f"{d}/replay_logs") for d in subs if os.path.isdir(os.path.join(root, d, "replay_logs"))]
    if runs:  # a game: all its runs
        return name, runs
    games = [g for g in subs if any(os.path.isdir(os.path.join(root, g, r, "replay_logs"))
                                    for r in os.listdir(os.path.join(root, g)))]
    if len(games) == 1:
        _, inner = find_runs(os.path.join(root, games[0]))
        return games[0], [(r, f"{games[0]}/{rel}") for r, rel in inner]
    if games:
        raise UnsupportedFormatError(
            f"{root} holds several games ({', '.join(games)}); a store holds one game: import "
            f"{os.path.join(root, games[0])} (all its runs) or {os.path.join(root, games[0], '1')} (one run)")
    raise UnsupportedFormatError(
        f"{root}: no replay_logs directory found (expected ROOT/<game>/<run>/replay_logs/ with "
        f"{STORE_PREFIX}observation_ckpt.<i>.gz files)")


@dataclass
class _Segment:
    """One checkpoint of one run: where its rows go in the store and what its files say."""

    run: int
    run_name: str
    rel: str
    logs: str
    ckpt: int
    rows: int
    start: int
    spelling: str
    frame: tuple[int, int]
    headers: dict[str, bytes]
    extras: dict[str, bytes]
    add_count: int
    invalid: np.ndarray

    def path(self, name: str) -> str:
        return _file_name(self.logs, name, self.spelling)


def _scan_segment(run: int, run_name: str, rel: str, logs: str, ckpt: int, spelling: str, start: int,
                  stack: int) -> _Segment:
    """Read the headers and small files of one checkpoint and check that they agree."""
    headers, shapes = {}, {}
    ckpt_int, ckpt = ckpt, spelling  # file names as written
    for name, (dtype, ndim) in ARRAYS.items():
        r = _open_reader(_file_name(logs, STORE_PREFIX + name, ckpt), dtype, ndim)
        headers[name], shapes[name] = r.header, r.shape
        r.close()
    n = shapes["observation"][0]
    for name, shape in shapes.items():
        if shape[0] != n:
            raise InvalidDatasetError(
                f"{_file_name(logs, STORE_PREFIX + name, ckpt)}: {shape[0]} rows, but the observations of "
                f"checkpoint {ckpt} have {n}; the checkpoint's files must have one row per buffer slot")
    if n <= stack:
        raise InvalidDatasetError(
            f"{_file_name(logs, STORE_PREFIX + 'observation', ckpt)}: {n} slots; a buffer of {stack}-frame "
            f"stacks needs more than {stack}")
    extras, arrays = {}, {}
    for name in EXTRAS:
        extras[name], arrays[name] = _read_small(_file_name(logs, name, ckpt))
    if arrays["add_count"].size != 1 or arrays["add_count"].dtype.kind not in "iu" or arrays["add_count"].item() < 0:
        raise InvalidDatasetError(
            f"{_file_name(logs, 'add_count', ckpt)}: expected one non-negative integer, found "
            f"{arrays['add_count'].dtype} {arrays['add_count'].shape}")
    frame = shapes["observation"][1:]
    if min(frame) < 1:
        raise InvalidDatasetError(
            f"{_file_name(logs, STORE_PREFIX + 'observation', ckpt)}: frames of shape {tuple(frame)} hold no "
            "pixels; a Dopamine checkpoint holds [N, height, width] frames (84 x 84 in the DQN Replay Dataset)")
    invalid = _checked_invalid_range(_file_name(logs, "invalid_range", ckpt), arrays["invalid_range"])
    return _Segment(run, run_name, rel, logs, ckpt_int, n, start, spelling, (frame[0], frame[1]), headers, extras,
                    int(arrays["add_count"].item()), invalid)


def _checked_invalid_range(path: str, values: np.ndarray) -> np.ndarray:
    """``invalid_range`` as int64 slot numbers: finite whole numbers only (a NaN or an infinity has
    no slot, and casting it gives an arbitrary one).

    Raises:
        InvalidDatasetError: naming the file and the first bad value.
    """
    values = values.reshape(-1)
    if values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (np.abs(values) >= 2.0 ** 53)
        bad[~bad] = values[~bad] != np.floor(values[~bad])
        if bad.any():
            raise InvalidDatasetError(
                f"{path}: invalid_range holds {values[bad][0]!r}; it lists buffer slots (whole numbers), "
                "as Dopamine writes them: the file is damaged or not a Dopamine checkpoint")
    elif values.dtype.kind == "u" and values.size and int(values.max()) > np.iinfo(np.int64).max:
        raise InvalidDatasetError(f"{path}: invalid_range holds {int(values.max())}, not a buffer slot")
    return values.astype(np.int64)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


class DQNReplaySource:
    """A DQN Replay Dataset directory read as store rows (see the module docstring).

    Args:
        root: the dataset root with one game, a game, a run or a ``replay_logs`` directory.
        stack: frames per state (4 in the dataset).

    Raises:
        UnsupportedFormatError: no checkpoints under ``root``, or several games.
        InvalidDatasetError: a file is missing, damaged, or disagrees with the others.
        PickledDataError: an array holds Python objects.
    """

    #: Frame-stack dimension of the stacked fields (the import stores each frame once).
    frames = {OBS: 0}

    def __init__(self, root: str | os.PathLike[str], stack: int = STACK) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.stack = int(stack)
        self.game, runs = find_runs(self.root)
        names = [r for r, _ in runs]
        # runs named by numbers keep them as ids, unless two spell one number ("1", "01") or one is too large
        numbered = all(re.fullmatch("[0-9]{1,9}", r) for r in names) and len({int(r) for r in names}) == len(names)
        ids = [int(r) for r in names] if numbered else list(range(len(runs)))
        self.segments: list[_Segment] = []
        self.dropped: list[str] = []
        start = 0
        for (run_name, rel), run_id in zip(runs, ids, strict=True):
            logs = os.path.normpath(os.path.join(self.root, rel))
            files = os.listdir(logs)
            ckpts = _checkpoints(logs, files)
            known = {os.path.basename(_file_name(logs, p + a, spelling)) for _, spelling in ckpts
                     for p, a in [(STORE_PREFIX, x) for x in ARRAYS] + [("", e) for e in EXTRAS]}
            self.dropped += [os.path.normpath(os.path.join(rel, f)) for f in sorted(files) if f not in known]
            for c, spelling in ckpts:
                seg = _scan_segment(run_id, run_name, rel, logs, c, spelling, start, self.stack)
                self.segments.append(seg)
                start += seg.rows
        if not self.segments:
            raise UnsupportedFormatError(f"{self.root}: no {STORE_PREFIX}observation_ckpt.<i>.gz file found")
        frames = {s.frame for s in self.segments}
        if len(frames) > 1:
            raise InvalidDatasetError(f"{self.root}: checkpoints have frames of different sizes {sorted(frames)}")
        self.num_rows = start

    def narrow_dtypes(self, progress: bool | None = False) -> dict[tuple[str, ...], torch.dtype]:
        """The narrowest column dtypes that hold every value of this dataset exactly: what an
        import stores the dense columns in when its caller names no ``dense_dtypes``.

        Reads the action and reward files of every checkpoint once, as streams (4 MB each for a
        checkpoint of 1M slots; never the observations). Actions go to the smallest integer dtype
        of their range (``uint8`` for Atari's 18 actions); rewards to ``int8`` or ``int16`` when
        every one is a whole number in range (and none is ``-0.0``), else ``float16`` when every
        one survives the round trip with its sign (a NaN keeps ``float32``: its payload bits
        could change, and export gives back the bits), else they stay ``float32``; the derived
        ``run``, ``checkpoint`` and ``index`` columns by their known ranges. Reads give the
        dataset's dtypes back and export writes Dopamine's bytes, as with any ``dense_dtypes``.

        Example:
            >>> import tiered.formats as tf
            >>> tf.open_source("dqn-replay", "dqn/Pong").narrow_dtypes()  # doctest: +SKIP
            {('action',): torch.uint8, ('run',): torch.uint8, ('checkpoint',): torch.uint8, ('next', 'reward'): torch.int8}

        Args:
            progress: show a progress bar over the checkpoints (``None``: only on a terminal).

        Returns:
            ``{key: dtype}`` for the columns that fit a narrower dtype.

        Raises:
            InvalidDatasetError: an action or reward file is damaged or disagrees with the others.
        """
        lo, hi = np.iinfo(np.int64).max, np.iinfo(np.int64).min
        rewards = _RewardRange()
        total = 2 * sum(seg.rows for seg in self.segments)
        bar = progress_bar(total, "scan actions and rewards", unit="values", enabled=progress)
        try:
            for seg in self.segments:  # read in slices of SCAN_ROWS: memory stays bounded whatever a checkpoint's size
                for name, scan in (("action", None), ("reward", rewards)):
                    r = _open_reader(seg.path(STORE_PREFIX + name), *ARRAYS[name])
                    try:  # the files' slot counts were checked against each other at construction
                        while r.pos < r.rows:
                            values = r.read(SCAN_ROWS)
                            if scan is None:
                                lo, hi = min(lo, int(values.min())), max(hi, int(values.max()))
                            else:
                                scan.add(values)
                            bar.update(values.size)
                        r.finish()
                    finally:
                        r.close()
        finally:
            bar.close()
        ranges = {
            ACTION: (lo, hi),
            ("run",): (min(s.run for s in self.segments), max(s.run for s in self.segments)),
            ("checkpoint",): (min(s.ckpt for s in self.segments), max(s.ckpt for s in self.segments)),
            ("index",): (0, max(s.rows for s in self.segments) - 1),
        }
        # the int32 columns' narrower dtypes (uint8, int8, int16: a 4-byte one gains nothing)
        out = {key: dtype for key, (a, b) in ranges.items()
               if (dtype := narrowest_dtype(torch.tensor([a, b]), torch.int32)) is not None}
        if (reward := rewards.dtype()) is not None:
            out[REWARD] = reward
        return out

    def attrs(self) -> dict[str, Any]:
        """The import sidecar: what export needs to write the files back byte for byte."""
        return {
            "format": "dqn-replay",
            "origin": self.root,
            "game": self.game,
            "stack": self.stack,
            "rows": self.num_rows,
            "derived": [DONE, TRUNCATED, *_RUN_FIELDS],
            "dropped": self.dropped,
            "gzip_level": GZIP_LEVEL,
            "segments": [
                {"run": s.run, "run_name": s.run_name, "path": s.rel, "checkpoint": s.ckpt,
                 **({} if s.spelling == str(s.ckpt) else {"checkpoint_name": s.spelling}),
                 "rows": s.rows, "start": s.start, "add_count": s.add_count,
                 "headers": {k: _b64(v) for k, v in s.headers.items()},
                 "extras": {k: _b64(v) for k, v in s.extras.items()}}
                for s in self.segments
            ],
        }

    def chunks(self, chunk_rows: int | None = None) -> Iterator[TensorDict]:
        """Store rows, segment by segment, in slices of at most ``chunk_rows`` rows."""
        h, w = self.segments[0].frame
        step = chunk_rows_for(2 * self.stack * h * w + 32, chunk_rows)
        for seg in self.segments:
            yield from _SegmentStream(seg, self.stack, step).rows()

    def close(self) -> None:
        """Nothing is held open between calls."""


class _SegmentStream:
    """The rows of one checkpoint, in the order ``stack-1, ..., N-1, 0, ..., stack-2``.

    The files are read as one stream of slots ``0, 1, ..., N-1`` followed by slots ``0..stack-1``
    again (kept from the start): emitted row ``k`` is slot ``i = (k + stack - 1) % N``, its state
    the stream's items ``k .. k+stack-1`` and its next state ``k+1 .. k+stack``.
    """

    def __init__(self, seg: _Segment, stack: int, step: int) -> None:
        self.seg, self.stack, self.step = seg, stack, step
        n, a = seg.rows, seg.add_count
        self.cursor, self.full = a % n, a >= n
        # where the buffer's time order breaks after a slot: the newest slot, the unwritten tail
        self.breaks = np.array([(self.cursor - 1) % n] if a else [], dtype=np.int64)
        if not self.full:
            self.breaks = np.append(self.breaks, n - 1)
        self.invalid = seg.invalid.astype(np.int64)

    def rows(self) -> Iterator[TensorDict]:
        seg, s, n = self.seg, self.stack, self.seg.rows
        readers: dict[str, NpyGzReader] = {}
        try:
            for name, (dtype, ndim) in ARRAYS.items():
                readers[name] = _open_reader(seg.path(STORE_PREFIX + name), dtype, ndim)
            # per array one buffer of stack + step items: the last `stack` items of a slice move to
            # its start and at most `step` items are read in behind them (no concatenation, no copy
            # of a slice): at most step + stack frames are held, whatever the frame size
            step = self.step
            buf = {k: np.empty((s + step, *r.shape[1:]), r.dtype) for k, r in readers.items()}
            for k, r in readers.items():
                r.read_into(buf[k][:s])
            head = {k: v[:s].copy() for k, v in buf.items()}  # slots 0..stack-1, again after slot N-1
            fill, k0, again = s, 0, 0  # again: items of `head` already appended after slot N-1
            while again < s:
                if readers["observation"].pos < n:
                    got = {k: r.read_into(buf[k][fill:]) for k, r in readers.items()}
                    fill += got["observation"]  # the four files have the same rows (checked)
                    if readers["observation"].pos == n:
                        for r in readers.values():
                            r.finish()
                else:
                    take = min(step, s - again)
                    for k in buf:
                        buf[k][fill:fill + take] = head[k][again:again + take]
                    fill, again = fill + take, again + take
                m = fill - s
                if m <= 0:
                    continue
                yield self._batch({k: v[:fill] for k, v in buf.items()}, k0, m)
                for v in buf.values():
                    v[:s] = v[m:fill].copy()  # the two ranges overlap when m < stack
                fill, k0 = s, k0 + m
        finally:
            for r in readers.values():
                r.close()

    def _batch(self, buf: dict[str, np.ndarray], k0: int, m: int) -> TensorDict:
        s, seg, n = self.stack, self.seg, self.seg.rows
        win = np.lib.stride_tricks.sliding_window_view(buf["observation"], s, axis=0)  # [m+1, H, W, s]
        win = np.moveaxis(win, -1, 1)
        index = (k0 + s - 1 + np.arange(m, dtype=np.int64)) % n
        term = buf["terminal"][s - 1: s - 1 + m]
        prior = np.lib.stride_tricks.sliding_window_view(buf["terminal"], s - 1)[:m].any(axis=1)
        valid = ~prior & ~isin(index, self.invalid)
        if not self.full:
            valid &= (index >= s - 1) & (index < self.cursor - 1)
        if np.any((term != 0) & (term != 1)):
            raise InvalidDatasetError(
                f"{seg.path(STORE_PREFIX + 'terminal')}: terminal flags must be 0 or 1, found "
                f"{np.unique(term[(term != 0) & (term != 1)])[:3].tolist()}")
        terminated = term.astype(bool)
        done = terminated | isin(index, self.breaks)
        if k0 + m == n:
            done[-1] = True  # the checkpoint's last row: the next rows are another buffer
        col = np.full(m, 0, dtype=np.int32)
        # the m + 1 stacks once (a copy: the caller's buffer is reused); the state of row j is
        # stack j and its next state stack j + 1, two views of the same bytes
        stacks = torch.from_numpy(win[: m + 1].copy())
        return TensorDict(
            {
                OBS: stacks[:m],
                NEXT_OBS: stacks[1:],
                ACTION: torch.from_numpy(buf["action"][s - 1: s - 1 + m].copy()),
                REWARD: torch.from_numpy(buf["reward"][s - 1: s - 1 + m].reshape(m, 1).copy()),
                TERMINATED: torch.from_numpy(terminated.reshape(m, 1)),
                DONE: torch.from_numpy(done.reshape(m, 1)),
                TRUNCATED: torch.from_numpy((done & ~terminated).reshape(m, 1)),
                ("valid",): torch.from_numpy(valid),
                ("run",): torch.from_numpy(col + seg.run),
                ("checkpoint",): torch.from_numpy(col + seg.ckpt),
                ("index",): torch.from_numpy(index.astype(np.int32)),
            },
            batch_size=[m],
        )


def write_dqn_replay(
    store: Any, rows: np.ndarray, tmp: str, source: dict[str, Any] | None, chunk_rows: int | None, progress: Any
) -> dict[str, Any]:
    """Write a store imported from dqn-replay back as the Dopamine files under the directory ``tmp``.

    Raises:
        UnsupportedFormatError: the store was not imported from dqn-replay, or was changed since
            (another number of rows).
    """
    if not source or source.get("format") != "dqn-replay":
        raise UnsupportedFormatError(
            "export to dqn-replay needs a store imported from dqn-replay (tiered import ROOT DST --format "
            "dqn-replay): Dopamine's files hold buffer slots that other stores do not record")
    if len(store) != int(source["rows"]):
        raise UnsupportedFormatError(
            f"the store has {len(store)} rows, but its dqn-replay import had {source['rows']}; it was changed "
            "since, and the checkpoints cannot be written back")
    stack = int(source["stack"])
    level = int(source.get("gzip_level", GZIP_LEVEL))
    fileio.makedirs(tmp)
    files = 0
    for seg in source["segments"]:
        logs = os.path.normpath(os.path.join(tmp, seg["path"]))
        fileio.makedirs(logs)
        _write_segment(store, seg, logs, stack, level, chunk_rows, progress)
        files += len(ARRAYS) + len(EXTRAS)
    return {"files": files, "rows": int(source["rows"]), "gzip_level": level}


def _gz_writer(stack: contextlib.ExitStack, path: str, level: int) -> gzip.GzipFile:
    raw = fileio.WritableFile(path)
    stack.enter_context(writing(raw))
    # no file name and mtime 0 in the gzip header: the same store exports the same bytes
    return stack.enter_context(gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=level, mtime=0))


def _write_segment(
    store: Any, seg: dict[str, Any], logs: str, stack: int, level: int, chunk_rows: int | None, progress: Any
) -> None:
    n, start = int(seg["rows"]), int(seg["start"])
    ckpt = seg.get("checkpoint_name")  # the file names as the source spelled them (a sidecar is not trusted)
    if not (isinstance(ckpt, str) and re.fullmatch("[0-9]{1,10}", ckpt) and int(ckpt) == int(seg["checkpoint"])):
        ckpt = str(int(seg["checkpoint"]))
    # slot i is store row start + (i - stack + 1) % n (rows were written from slot stack - 1 on)
    order = start + (np.arange(n, dtype=np.int64) - (stack - 1)) % n
    headers = {k: base64.b64decode(v) for k, v in seg["headers"].items()}
    keys = [OBS, ACTION, REWARD, TERMINATED]
    with contextlib.ExitStack() as es:
        out = {name: _gz_writer(es, _file_name(logs, STORE_PREFIX + name, ckpt), level) for name in ARRAYS}
        for name, f in out.items():
            f.write(headers[name])
        frame = read_npy_header(io.BytesIO(headers["observation"]), logs)[0][1:]
        step = chunk_rows_for(stack * int(np.prod(frame)) + 16, chunk_rows)
        for lo, hi, td in iter_store(store, order, step, keys=keys):
            obs = td.get(OBS)[:, -1].contiguous().numpy()
            out["observation"].write(memoryview(np.ascontiguousarray(obs)).cast("B"))
            out["action"].write(td.get(ACTION).numpy().astype(np.int32, copy=False).tobytes())
            out["reward"].write(td.get(REWARD).reshape(-1).numpy().astype(np.float32, copy=False).tobytes())
            out["terminal"].write(td.get(TERMINATED).reshape(-1).numpy().astype(np.uint8).tobytes())
            progress.update(hi - lo)
    for name in EXTRAS:
        with contextlib.ExitStack() as es:
            _gz_writer(es, _file_name(logs, name, ckpt), level).write(base64.b64decode(seg["extras"][name]))
