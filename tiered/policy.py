"""Residency policies: which blobs leave a full tier, which new blobs a cache takes, which read
blobs move up. A policy only decides; it never moves bytes.

The store tells a policy which blobs were inserted, read and released (and the blobs' priorities:
each blob's maximum over the rows that reference it, kept exact by the store). When a memory tier
is full it asks :meth:`Policy.victims` which of the blobs in that tier should leave first; when
new blobs are written to a store with a cold tier it asks :meth:`Policy.admit` which of them the
memory tier caches; after a read it asks :meth:`Policy.promote` which of the blobs that came from
a slower tier should move up. The :class:`TierState` passed to the last two is all a policy knows
of the tier.

* ``fifo``: the oldest written blobs leave first.
* ``lru``: the least recently read blobs leave first. Recency is counted per ``get`` call
  (an epoch counter), a CLOCK-like approximation that costs one vectorized store per call.
* ``priority``: the caller passes row priorities (``store.set_priority(rows, p)``, or TorchRL's
  prioritized samplers through :class:`tiered.torchrl.TieredStorage`); blobs rank by sampling
  weight per byte (the ``priority ** alpha`` of the rows that name a blob, over its size), the
  lowest leave first, and a blob enters a full tier (admission, promotion, or at once when its
  priority changes) only when its rank beats the rank of the blobs it would push out by a
  margin (hysteresis: priorities that jitter do not make the hot set thrash).

Ties are broken by age (the blob written first leaves first), then by the order of the ids the
store passed. A policy's state (:meth:`Policy.state_arrays`) is plain numpy arrays, saved with
each commit, so a reopened store decides as the one that wrote it.

Example:
    >>> import numpy as np
    >>> from tiered.policy import get_policy
    >>> p = get_policy("lru")
    >>> p.on_insert(np.array([0, 1, 2]))
    >>> p.on_access(np.array([0]))
    >>> p.order(np.array([0, 1, 2])).tolist()  # eviction order: least recently used first
    [1, 2, 0]
    >>> p.victims(np.array([0, 1, 2]), np.array([16, 16, 16]), need=20).tolist()
    [1, 2]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import CorruptionError, InvalidPriorityError
from .util.dirty import DirtyBlocks, union
from .util.units import align

__all__ = [
    "TierState",
    "Policy",
    "FifoPolicy",
    "LruPolicy",
    "PriorityPolicy",
    "get_policy",
    "POLICIES",
]


@dataclass(frozen=True)
class TierState:
    """What a policy may know of a memory tier when it decides on admission or promotion.

    Attributes:
        name: ``"hot"`` or ``"warm"``.
        budget: the tier's byte budget (``None``: unbounded).
        bytes_used: bytes the tier holds now (aligned sizes).
        exclusive: ``True`` when the store has no cold tier, so a blob lives in exactly one
            memory tier (promoting moves it); ``False`` when the tier is a cache over a cold
            tier that holds every blob (promoting copies it).
        ids: the blobs the tier holds, for policies that compare candidates with them
            (:attr:`Policy.wants_residents`); ``None`` when the store did not gather them.
        sizes: their aligned sizes in bytes (``None`` with ``ids``).

    Example:
        >>> TierState("warm", budget=1 << 20, bytes_used=0, exclusive=False)
        TierState(name='warm', budget=1048576, bytes_used=0, exclusive=False)
    """

    name: str
    budget: int | None
    bytes_used: int
    exclusive: bool
    ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    sizes: np.ndarray | None = field(default=None, repr=False, compare=False)


class _Column:
    """A growable per-blob-id numpy column; ``size`` is one past the largest id ever written."""

    def __init__(self, dtype: type, fill: float) -> None:
        self.fill = fill
        self.data = np.full(1024, fill, dtype=dtype)
        self.size = 0
        self.dirty = DirtyBlocks()  # ids changed since the last commit

    def ensure(self, max_id: int) -> None:
        if max_id >= self.data.shape[0]:
            new = np.full(max(max_id + 1, self.data.shape[0] * 2), self.fill, dtype=self.data.dtype)
            new[: self.data.shape[0]] = self.data
            self.data = new

    def reserve(self, ids: np.ndarray) -> None:
        """Make room for writes to ``ids`` (non-empty) and count them in ``size``."""
        top = int(np.maximum.reduce(ids, axis=None))  # (the ufunc: .max() adds wrapper calls)
        self.ensure(top)
        self.size = max(self.size, top + 1)

    def set(self, ids: np.ndarray, values: np.ndarray | float) -> None:
        if ids.size:
            self.reserve(ids)
            self.dirty.mark(ids)
            self.data[ids] = values

    def set_read(self, ids: np.ndarray, value: float) -> None:
        """:meth:`set` of one value for the blob ids of a read (every ``get``; flat int64, >= 0):
        without the calls of :meth:`reserve` and :meth:`ensure` where the column holds the ids
        already, nor those of the dirty mark's normalizing."""
        if ids.size:
            top = int(np.maximum.reduce(ids, axis=None))
            if top >= self.data.shape[0]:
                self.ensure(top)
            if top >= self.size:
                self.size = top + 1
            self.dirty.mark_known(ids, top)
            self.data[ids] = value

    def get(self, ids: np.ndarray) -> np.ndarray:
        if ids.size:
            self.ensure(int(ids.max()))
        return self.data[ids]

    def load(self, values: np.ndarray, copy: bool = True) -> None:
        """Take ``values`` as the column (``copy=False``: used as they are when writeable and of
        the column's dtype, e.g. a private memory map of a store, whose pages are read on use)."""
        if not copy and values.flags.writeable and values.dtype == self.data.dtype and values.shape[0]:
            self.data = values
        else:
            self.data = np.full(max(1024, values.shape[0]), self.fill, dtype=self.data.dtype)
            self.data[: values.shape[0]] = values
        self.size = int(values.shape[0])


def _ids(ids: np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class Policy(ABC):
    """Decides residency. Subclasses implement :meth:`_keys` (lower leaves first).

    The base class keeps each blob's birth (the insert call that wrote it, counted by a clock
    that every insert advances); ties of :meth:`_keys` are broken by birth. Subclasses with more
    per-blob state add their columns to :meth:`_columns` so that :meth:`state_arrays` and
    :meth:`load_state_arrays` carry them.
    """

    name: str
    #: whether :meth:`admit` and :meth:`promote` need :attr:`TierState.ids` (the tier's blobs)
    wants_residents: bool = False
    #: whether the store asks :meth:`promote` about blobs whose priority changed (not only about
    #: blobs just read), and copies the chosen ones up from the cold tier at once
    promotes_on_priority: bool = False

    def __init__(self) -> None:
        self._clock = 0
        self._birth = _Column(np.int64, 0)

    # -- events -------------------------------------------------------------------------------

    def on_insert(self, ids: np.ndarray) -> None:
        """New blobs were written (an id given again after :meth:`on_release` is a new blob)."""
        self._clock += 1
        self._birth.set(_ids(ids), self._clock)

    def on_access(self, ids: np.ndarray) -> None:  # noqa: B027 - only LRU cares
        """Blobs were read by a ``get``."""

    def on_release(self, ids: np.ndarray) -> None:
        """Blobs were deleted; their ids may be reused. Forgets their state."""
        ids = _ids(ids)
        for column in self._columns().values():
            column.set(ids, column.fill)

    def set_priority(self, ids: np.ndarray, priority: np.ndarray | float) -> None:
        """Set blob priorities (the store passes, per blob, the max over the rows that reference
        it); policies other than ``priority`` only validate them.

        Args:
            ids: blob ids (an id may appear several times: it gets the largest of its values).
            priority: one priority per id, or one for all.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing changes).

        Example:
            >>> import numpy as np
            >>> get_policy("fifo").set_priority(np.array([0]), np.array([np.nan]))
            Traceback (most recent call last):
            ...
            tiered.errors.InvalidPriorityError: priorities must be finite and >= 0, got [nan]; ...
        """
        self._checked_priorities(ids, priority)

    def set_sizes(self, ids: np.ndarray, sizes: np.ndarray) -> None:  # noqa: B027 - only priority cares
        """The stored (aligned) sizes of blobs, told along with their priorities.

        Example:
            >>> import numpy as np
            >>> get_policy("lru").set_sizes(np.array([0]), np.array([64]))  # lru ignores sizes
        """

    def set_alpha(self, alpha: float) -> None:  # noqa: B027 - only priority cares
        """The sampler's exponent (rows are drawn with probability ``priority ** alpha``).

        Example:
            >>> get_policy("lru").set_alpha(0.6)  # lru ignores it
        """

    def set_mass(self, ids: np.ndarray, mass: np.ndarray) -> None:  # noqa: B027 - only priority cares
        """The sampling weight of blobs (the sum of ``priority ** alpha`` over the table entries
        that name them, each row's weight split over its entries), told with their priorities.

        Example:
            >>> import numpy as np
            >>> get_policy("fifo").set_mass(np.array([0]), np.array([0.5]))  # fifo ignores it
        """

    @staticmethod
    def _checked_priorities(ids: np.ndarray, priority: np.ndarray | float) -> np.ndarray:
        """``priority`` as float64 broadcast over ``ids``; raises on NaN, infinite or negative values."""
        priority = np.asarray(priority, dtype=np.float64)
        bad = priority[~np.isfinite(priority) | (priority < 0)]
        if bad.size:
            raise InvalidPriorityError(
                f"priorities must be finite and >= 0, got {bad.reshape(-1)[:5].tolist()}; "
                "fix the TD error / priority computation (e.g. nan_to_num, abs) before updating")
        return np.broadcast_to(priority.reshape(-1) if priority.ndim else priority, _ids(ids).shape)

    # -- decisions ----------------------------------------------------------------------------

    @abstractmethod
    def _keys(self, ids: np.ndarray) -> np.ndarray:
        """Sort keys: the smallest leaves first."""

    def _eviction_permutation(self, ids: np.ndarray) -> np.ndarray:
        # lexsort: last key is primary; age breaks ties, then the stable order of `ids`.
        return np.lexsort((self._birth.get(ids), self._keys(ids)))

    def order(self, ids: np.ndarray) -> np.ndarray:
        """Return ``ids`` in eviction order (first to leave first)."""
        ids = _ids(ids)
        if ids.size == 0:
            return ids
        return ids[self._eviction_permutation(ids)]

    def victims(self, ids: np.ndarray, sizes: np.ndarray, need: int) -> np.ndarray:
        """The shortest eviction-ordered prefix of ``ids`` whose ``sizes`` add up to ``need`` bytes.

        All of ``ids`` when they hold fewer than ``need`` bytes; none when ``need <= 0``.

        Example:
            >>> import numpy as np
            >>> p = get_policy("fifo")
            >>> p.on_insert(np.array([7])); p.on_insert(np.array([3]))
            >>> p.victims(np.array([3, 7]), np.array([32, 32]), need=1).tolist()  # 7 is older
            [7]
        """
        ids = _ids(ids)
        if need <= 0 or ids.size == 0:
            return np.empty(0, dtype=np.int64)
        perm = self._eviction_permutation(ids)
        cum = np.cumsum(np.asarray(sizes, dtype=np.int64).reshape(-1)[perm])
        k = int(np.searchsorted(cum, need)) + 1
        return ids[perm[:k]]

    def admit(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Which new blobs to copy into cache tier ``tier`` when they are written.

        Args:
            ids: the new blobs (already stored in the cold tier).
            sizes: their aligned sizes in bytes.
            tier: the memory tier asked to cache them.

        Returns:
            A bool mask over ``ids``. The default admits every blob (the store then makes room
            by :meth:`victims`, and skips caching when even that fails).

        Example:
            >>> import numpy as np
            >>> warm = TierState("warm", budget=4096, bytes_used=0, exclusive=False)
            >>> get_policy("lru").admit(np.array([0, 1]), np.array([16, 32]), warm).tolist()
            [True, True]
        """
        return np.ones(_ids(ids).shape, dtype=bool)

    def promote(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Which blobs just read from a slower tier to copy up into ``tier``.

        Args:
            ids: the blobs, in the order the read met them.
            sizes: their sizes in bytes (aligned here again, so raw sizes give the same answer).
            tier: the faster tier they could move to.

        Returns:
            A bool mask over ``ids``. The default takes the prefix whose aligned sizes add up to
            at most a quarter of the budget when ``tier.exclusive`` (so one sample cannot flush
            the whole hot set), at most half of it when the tier is a cache (a batch larger than
            the cache still promotes part of itself); nothing when the budget is ``None`` or 0.

        Example:
            >>> import numpy as np
            >>> hot = TierState("hot", budget=256, bytes_used=0, exclusive=True)
            >>> p = get_policy("lru")
            >>> p.promote(np.array([4, 5, 6]), np.array([32, 32, 32]), hot).tolist()  # <= 64 bytes
            [True, True, False]
            >>> cache = TierState("hot", budget=256, bytes_used=0, exclusive=False)
            >>> p.promote(np.array([4, 5, 6]), np.array([32, 32, 32]), cache).tolist()  # <= 128
            [True, True, True]
        """
        sizes = align(np.asarray(sizes, dtype=np.int64).reshape(-1))
        if not tier.budget:
            return np.zeros(sizes.shape, dtype=bool)
        limit = tier.budget // 4 if tier.exclusive else tier.budget // 2
        return np.cumsum(sizes) <= limit

    def prefetch(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Which blobs whose priority a ``set_priority`` changed to read up from the cold tier
        into cache ``tier`` now, before any sample asks for them (the store asks only a policy
        that :attr:`promotes_on_priority`). Unlike :meth:`promote`, whose blobs were just read
        anyway, every blob taken here costs a read from disk.

        Args:
            ids: the blobs (in the cold tier, not in ``tier``).
            sizes: their sizes in bytes.
            tier: the cache they could be copied into.

        Returns:
            A bool mask over ``ids``. The default: what :meth:`promote` would take.

        Example:
            >>> import numpy as np
            >>> cache = TierState("warm", budget=256, bytes_used=0, exclusive=False)
            >>> get_policy("lru").prefetch(np.array([4, 5]), np.array([32, 32]), cache).tolist()
            [True, True]
        """
        return self.promote(ids, sizes, tier)

    # -- state --------------------------------------------------------------------------------

    def _columns(self) -> dict[str, _Column]:
        """Per-blob state columns by their name in :meth:`state_arrays`."""
        return {"birth": self._birth}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything the policy's future decisions depend on, as plain numpy arrays.

        ``"clock"`` (int64 scalar) and one 1-D column per per-blob state, all of one length
        (ids past it were never written): ``"birth"`` (int64) for every policy,
        ``"last_access"`` (int64) for ``lru``, ``"priority"`` (float64) for ``priority``. Saved
        with ``np.save`` they need no pickle.

        Example:
            >>> import numpy as np
            >>> p = get_policy("lru")
            >>> p.on_insert(np.array([0, 1])); p.on_access(np.array([0]))
            >>> {k: v.tolist() for k, v in p.state_arrays().items()}
            {'clock': 2, 'birth': [1, 1], 'last_access': [2, 1]}
            >>> q = get_policy("lru")
            >>> q.load_state_arrays(p.state_arrays())
            >>> q.order(np.array([0, 1])).tolist()
            [1, 0]
        """
        return {key: array.copy() for key, array in self.state_views().items()}

    def state_views(self) -> dict[str, np.ndarray]:
        """:meth:`state_arrays` without copies: views of the columns, valid until the next change
        (what a commit writes from)."""
        columns = self._columns()
        n = max(column.size for column in columns.values())
        for column in columns.values():
            column.ensure(n - 1)
        return {"clock": np.array(self._clock, dtype=np.int64),
                **{key: column.data[:n] for key, column in columns.items()}}

    def take_dirty(self) -> np.ndarray:
        """The bitmap of blob-id blocks (:class:`~tiered.util.dirty.DirtyBlocks`) whose state
        changed since the last call, and start over."""
        return union([column.dirty.take() for column in self._columns().values()])

    def merge_dirty(self, bits: np.ndarray) -> None:
        """Mark again what :meth:`take_dirty` returned (its commit failed)."""
        self._birth.dirty.merge(bits)

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray], *, copy: bool = True) -> None:
        """Restore the state :meth:`state_arrays` returned (by a policy of the same kind).

        Everything is checked before anything changes: on an error the policy is as it was.
        ``copy=False`` uses writeable arrays of the right dtype as they are (the caller gives them
        up: a store's private memory maps), instead of copying them.

        Raises:
            CorruptionError: a key is missing or unknown, an array has the wrong dtype or shape,
                the columns differ in length, a clock value is negative or ahead of the clock, or
                a priority is NaN, infinite or negative.

        Example:
            >>> import numpy as np
            >>> get_policy("fifo").load_state_arrays({"clock": np.array(1)})
            Traceback (most recent call last):
            ...
            tiered.errors.CorruptionError: fifo policy state: missing 'birth' (has 'clock'); ...
        """
        columns = self._columns()
        clock = self._checked_state(arrays, columns)
        self._clock = clock
        for key, column in columns.items():
            column.load(arrays[key], copy=copy)

    def _checked_state(self, arrays: Mapping[str, np.ndarray], columns: dict[str, _Column]) -> int:
        """Validate saved state arrays against ``columns``; return the clock."""
        def damaged(what: str) -> CorruptionError:
            return CorruptionError(f"{self.name} policy state: {what}; the saved policy state is damaged "
                                   "or was written by another policy")

        if not isinstance(arrays, Mapping):
            raise damaged(f"expected a mapping of names to arrays, got {type(arrays).__name__}")
        expected = ["clock", *columns]
        missing = [k for k in expected if k not in arrays]
        unknown = sorted(str(k) for k in arrays if k not in expected)
        if missing or unknown:
            parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + \
                    ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else [])
            raise damaged("; ".join(parts) + f" (has {', '.join(map(repr, sorted(map(str, arrays))))})")
        for key in expected:
            value = arrays[key]
            dtype = np.dtype(np.int64) if key == "clock" else columns[key].data.dtype
            shape = "a scalar" if key == "clock" else "a 1-D array"
            if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != (0 if key == "clock" else 1):
                got = (f"{value.dtype} with shape {value.shape}" if isinstance(value, np.ndarray)
                       else type(value).__name__)
                raise damaged(f"{key!r} must be {shape} of {dtype}, got {got}")
        clock = int(arrays["clock"])
        if clock < 0:
            raise damaged(f"'clock' is negative ({clock})")
        lengths = {key: int(arrays[key].shape[0]) for key in columns}
        if len(set(lengths.values())) > 1:
            raise damaged(f"the per-blob columns differ in length ({lengths})")
        for key in columns:
            value = arrays[key]
            if value.dtype == np.int64:
                if not value.size or (int(value.min()) >= 0 and int(value.max()) <= clock):
                    continue  # two reductions, no temporaries: the usual case
                bad = (value < 0) | (value > clock)
                if bad.any():
                    raise damaged(f"{key!r} holds {int(value[bad][0])} for blob {int(np.flatnonzero(bad)[0])}, "
                                  f"outside the clock's range [0, {clock}]")
            else:
                bad = ~np.isfinite(value) | (value < 0)
                if bad.any():
                    raise damaged(f"{key!r} holds {float(value[bad][0])} for blob {int(np.flatnonzero(bad)[0])}; "
                                  "priorities are finite and >= 0")
        return clock


class FifoPolicy(Policy):
    """Oldest written first.

    Example:
        >>> import numpy as np
        >>> p = FifoPolicy()
        >>> p.on_insert(np.array([5])); p.on_insert(np.array([2])); p.on_access(np.array([5]))
        >>> p.order(np.array([2, 5])).tolist()  # reads do not matter
        [5, 2]
    """

    name = "fifo"

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return self._birth.get(ids)


class LruPolicy(Policy):
    """Least recently accessed first (per-call epochs: a CLOCK-like approximation of LRU).

    Blobs read in the same call share an epoch; among them the older leaves first.

    Example:
        >>> import numpy as np
        >>> p = LruPolicy()
        >>> p.on_insert(np.array([0, 1, 2]))
        >>> p.on_access(np.array([2])); p.on_access(np.array([0]))
        >>> p.order(np.array([0, 1, 2])).tolist()
        [1, 2, 0]
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._last = _Column(np.int64, 0)

    def on_insert(self, ids: np.ndarray) -> None:
        super().on_insert(ids)
        self._last.set(_ids(ids), self._clock)

    def on_access(self, ids: np.ndarray) -> None:
        self._clock += 1
        # a read's ids are flat int64 already (asarray and reshape: ~2 us of calls on every get)
        flat = ids if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1 else _ids(ids)
        self._last.set_read(flat, self._clock)

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return self._last.get(ids)

    def _columns(self) -> dict[str, _Column]:
        return {**super()._columns(), "last_access": self._last}


class PriorityPolicy(Policy):
    """Lowest sampling mass per byte first; a blob enters a full tier only by beating its victims
    by a margin.

    Priorities come from the store: each blob's maximum over the rows that reference it (the
    store keeps it exact across calls, overwrites, staged rows, shared frames and time chunks).
    A blob the store has not given a priority counts as ``default``.

    The rank of a blob is its sampling weight per byte it takes in a tier, so that a byte budget
    holds as much of the sampling mass as it can (a small blob beats a large one of the same
    weight). The weight is what the store tells with :meth:`set_mass` (the sum of
    ``priority ** alpha`` over the table entries that name the blob, each row's weight split
    over its entries: rows are sampled with probability ``priority ** alpha``), or, for a blob
    the store told no mass, ``priority ** alpha`` of its best row. The store also tells each
    blob's size (:meth:`set_sizes`) and the sampler's ``alpha``; a blob whose size was never told
    counts as one byte, so without sizes, masses and with ``alpha`` 1 the rank is the priority.

    Admission (new blobs, stores with a cold tier) and promotion follow one rule: candidates are
    taken best first; those that fit the tier's free space are taken; a candidate that needs room
    is taken only when its rank is more than ``1 + margin`` times the rank of the last blob that
    would leave for it (the tier's lowest-ranked blobs leave first, as :meth:`victims` orders
    them). The margin is the hysteresis that keeps jittering priorities from swapping blobs in
    and out on every call. At most an eighth of the budget moves per call, so that the arena
    finds room for the batch in its holes without pushing out more than the policy chose.
    :attr:`promotes_on_priority` is set: a store with a cold tier asks :meth:`prefetch` about
    the blobs whose priority a ``set_priority`` changed, not only :meth:`promote` about the
    blobs a read met, so a blob whose priority jumps moves up before it is sampled. Such a read
    from disk is paid whether or not the blob is then sampled, while a blob a read met is
    already in memory: into a full tier, :meth:`prefetch` takes a blob only when it beats the
    blob that would leave by ``1 + prefetch_margin`` (4x by default: its priority jumped, not
    merely changed). Free space is filled best first either way.

    Args:
        default: the priority of a blob no :meth:`set_priority` call has named (finite, >= 0).
        margin: the relative advantage a candidate needs over the blobs it displaces (>= 0).
        prefetch_margin: the same for a blob read from the cold tier only to be cached, when
            its priority changed (>= 0).

    Example:
        >>> import numpy as np
        >>> p = PriorityPolicy()
        >>> p.on_insert(np.array([0, 1, 2]))
        >>> p.set_priority(np.array([0, 0, 2]), np.array([0.5, 3.0, 0.5]))  # blob 0 gets the max
        >>> p.order(np.array([0, 1, 2])).tolist()  # 2 (0.5), 1 (default 1.0), 0 (3.0)
        [2, 1, 0]
        >>> p.set_sizes(np.array([0, 1, 2]), np.array([512, 64, 16]))  # per byte: 0 is the largest
        >>> p.order(np.array([0, 1, 2])).tolist()  # 3.0/512, 1.0/64, 0.5/16
        [0, 1, 2]
        >>> p.on_insert(np.array([3, 4])); p.set_priority(np.array([3, 4]), np.array([0.01, 4.0]))
        >>> p.set_sizes(np.array([1, 2, 3, 4]), np.array([256, 256, 32, 32]))
        >>> full = TierState("warm", budget=512, bytes_used=512, exclusive=False,
        ...                  ids=np.array([1, 2]), sizes=np.array([256, 256]))
        >>> p.promote(np.array([3, 4]), np.array([32, 32]), full).tolist()  # 4.0/32 beats 0.5/256
        [False, True]
    """

    name = "priority"
    wants_residents = True
    promotes_on_priority = True
    #: the share of the budget that may move into a tier per admission or promotion call
    share = 1 / 8

    def __init__(self, default: float = 1.0, margin: float = 0.25, prefetch_margin: float = 3.0) -> None:
        super().__init__()
        default, margin, prefetch_margin = float(default), float(margin), float(prefetch_margin)
        if not np.isfinite(default) or default < 0:
            raise InvalidPriorityError(f"the default priority must be finite and >= 0, got {default}")
        for name, value in (("margin", margin), ("prefetch_margin", prefetch_margin)):
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        self._prio = _Column(np.float64, default)
        self._size = _Column(np.float64, 1.0)  # told by the store at every priority change; not saved
        self._mass = _Column(np.float64, np.nan)  # likewise (NaN: never told)
        self._alpha = 1.0
        self.default = default
        self.margin = margin
        self.prefetch_margin = prefetch_margin

    @property
    def alpha(self) -> float:
        """The sampler's exponent: a blob ranks by ``priority ** alpha / size`` (1.0 until set).

        Example:
            >>> p = PriorityPolicy(); p.alpha = 0.6; p.alpha
            0.6
        """
        return self._alpha

    def set_alpha(self, alpha: float) -> None:
        self.alpha = alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        value = float(value)
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"alpha must be finite and >= 0, got {value}")
        self._alpha = value

    # on_insert keeps the priority column as it is: a new id holds the fill value (``default``;
    # on_release restores it), and an open time chunk that closes keeps the max its rows gave it.

    def on_release(self, ids: np.ndarray) -> None:
        super().on_release(ids)
        self._size.set(_ids(ids), self._size.fill)
        self._mass.set(_ids(ids), self._mass.fill)

    def set_priority(self, ids: np.ndarray, priority: np.ndarray | float) -> None:
        """Set the priority of blobs (the store passes, per blob, the max over its rows).

        An id named several times gets the largest of its priorities in this call; a later call
        replaces it.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing changes).
        """
        priority = self._checked_priorities(ids, priority)
        ids = _ids(ids)
        if ids.size:
            # Several references may name one blob: keep the max (np.maximum.at handles duplicates).
            self._prio.reserve(ids)
            self._prio.dirty.mark(ids)
            self._prio.data[ids] = -np.inf
            np.maximum.at(self._prio.data, ids, priority)

    def set_sizes(self, ids: np.ndarray, sizes: np.ndarray) -> None:
        """The stored (aligned) sizes of blobs: the rank is per byte (0 counts as 1 byte)."""
        self._size.set(_ids(ids), np.maximum(np.asarray(sizes, dtype=np.float64).reshape(-1), 1.0))

    def set_mass(self, ids: np.ndarray, mass: np.ndarray) -> None:
        """The sampling weight of blobs: where told, the rank is ``mass / size`` (the share of
        the samples a byte of the blob serves) instead of ``priority ** alpha / size``."""
        mass = np.asarray(mass, dtype=np.float64).reshape(-1)
        if mass.size and (~np.isfinite(mass) | (mass < 0)).any():
            raise InvalidPriorityError(f"blob masses must be finite and >= 0, got {mass[:5].tolist()}")
        self._mass.set(_ids(ids), mass)

    def priorities(self, ids: np.ndarray) -> np.ndarray:
        """The priority of each blob of ``ids`` (``default`` where none was set).

        Example:
            >>> import numpy as np
            >>> p = PriorityPolicy(default=0.5)
            >>> p.set_priority(np.array([1]), 2.0)
            >>> p.priorities(np.array([0, 1])).tolist()
            [0.5, 2.0]
        """
        return self._prio.get(_ids(ids)).copy()

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        prio = self._prio.get(ids)
        weight = prio if self._alpha == 1.0 else prio ** self._alpha
        mass = self._mass.get(ids)
        told = ~np.isnan(mass)
        if told.any():
            weight = np.where(told, mass, weight)
        return weight / self._size.get(ids)

    def admit(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """New blobs enter by the rule of the class docstring (free space, or a better rank)."""
        return self._replacing(ids, sizes, tier)

    def promote(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Blobs move up by the rule of the class docstring (free space, or a better rank)."""
        return self._replacing(ids, sizes, tier)

    def prefetch(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState) -> np.ndarray:
        """Blobs whose priority changed are read up by the same rule with ``prefetch_margin``.

        Example:
            >>> import numpy as np
            >>> p = PriorityPolicy()
            >>> p.set_priority(np.arange(18), np.r_[np.ones(16), 2.0, 8.0])
            >>> full = TierState("warm", budget=256, bytes_used=256, exclusive=False,
            ...                  ids=np.arange(16), sizes=np.full(16, 16))
            >>> p.promote(np.array([16, 17]), np.array([16, 16]), full).tolist()  # 2x, 8x beat 1.25x
            [True, True]
            >>> p.prefetch(np.array([16, 17]), np.array([16, 16]), full).tolist()  # only 8x beats 4x
            [False, True]
        """
        return self._replacing(ids, sizes, tier, self.prefetch_margin)

    def _replacing(self, ids: np.ndarray, sizes: np.ndarray, tier: TierState,
                   margin: float | None = None) -> np.ndarray:
        ids = _ids(ids)
        sizes = align(np.asarray(sizes, dtype=np.int64).reshape(-1))
        take = np.zeros(ids.shape, dtype=bool)
        if not tier.budget or ids.size == 0:
            return take
        limit = int(tier.budget * self.share)  # a small share per call: the arena finds room for it
        key = self._keys(ids)
        best_first = np.argsort(-key, kind="stable")
        moved = np.cumsum(sizes[best_first])
        displaced = moved - max(int(tier.budget) - int(tier.bytes_used), 0)  # bytes that must leave
        fits = displaced <= 0
        if tier.ids is not None and tier.ids.size:
            held, held_sizes = self._lowest(_ids(tier.ids), align(np.asarray(tier.sizes, dtype=np.int64)), limit)
            left = np.cumsum(held_sizes)
            last = np.searchsorted(left, displaced)  # the last blob that leaves for each prefix
            bar = np.full(ids.shape, np.inf)
            ok = last < held.size
            bar[ok] = self._keys(held[last[ok]]) * (1.0 + (self.margin if margin is None else margin))
            fits |= key[best_first] > bar
        take[best_first[np.logical_and.accumulate(fits & (moved <= limit))]] = True
        return take

    def _lowest(self, held: np.ndarray, sizes: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """The tier's first blobs in eviction order, enough to free ``limit`` bytes, and their sizes.

        A partial selection: ``np.argpartition`` picks the ``m`` lowest-ranked blobs, where ``m``
        blobs of the smallest size already hold ``limit`` bytes, and only those ``m`` are sorted:
        O(residents + m log m), not a sort of the tier (nor of the store).
        """
        m = min(held.size, int(limit // max(int(sizes.min()), 1)) + 1)
        if m < held.size:
            keys = self._keys(held)
            # ties at the cut: take every blob whose key equals the m-th lowest, so the order stays exact
            cut = keys[np.argpartition(keys, m - 1)[m - 1]]
            pick = np.flatnonzero(keys <= cut)
            held, sizes = held[pick], sizes[pick]
        perm = self._eviction_permutation(held)
        return held[perm], sizes[perm]

    def _columns(self) -> dict[str, _Column]:
        return {**super()._columns(), "priority": self._prio}


POLICIES: dict[str, type[Policy]] = {"fifo": FifoPolicy, "lru": LruPolicy, "priority": PriorityPolicy}


def get_policy(policy: str | Policy) -> Policy:
    """Resolve ``"fifo"``, ``"lru"`` or ``"priority"`` (or pass a :class:`Policy` through).

    Example:
        >>> get_policy("LRU").name, get_policy(FifoPolicy()).name
        ('lru', 'fifo')
    """
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[str(policy).lower()]()
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}") from None
