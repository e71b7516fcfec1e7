"""The lanes' rows as readers see them, the base of ``ring.Ring``: which rows count (``bounds``),
the ids the slots hold (``ids_of_slots``), ids at positions (``ids_at``, by ``samplers.ids_at``'s
lane walk), the checks of ids (``check_ids``, ``current``, ``cleared``), a lane's run of slots
(``contiguous``). The arithmetic is ``rows.py``'s; with the C extension (``native_view``)
``current``, ``check_ids`` and a prioritized draw's ``ids_of_slots`` are C loops over it."""

from __future__ import annotations

import numpy as np

from .. import native
from ..errors import FieldError, UnknownIdError
from ..sampling.samplers import INVALID, ids_at
from . import rows
from .layout import Lane, check_lanes

_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
_INT64_MAX = np.iinfo(np.int64).max
_EMPTY = np.empty(0, np.int64)


class Lanes:
    """Bounds, ids and their checks over a block's ``_lanes`` cursors and ``_stamp`` column."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self._lanes = arrays["_lanes"]
        # a memoryview reads single int64s several times faster than numpy indexing (``span``, the push)
        self._cur = self._lanes.reshape(-1).data
        self.stamp = arrays["_stamp"]
        self.lanes = int(self._lanes.shape[0])
        self.capacity = int(self.stamp.shape[0])
        self.lane_capacity = rows.lane_capacity(self.capacity, self.lanes)
        contiguous = all(a.dtype == np.int64 and a.flags.c_contiguous for a in (self.stamp, self._lanes))
        self._lib = native.lib if contiguous else None
        self.native_view = (self.stamp, self._lanes) if self._lib is not None else None
        """``(stamp, cursors)`` for the C kernels that read ids, stamps and bounds (a tree draw,
        ``current``, ``check_ids``), or ``None``: the numpy code below runs."""

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the first and one-past-last row numbers that count now."""
        return rows.bounds(self._lanes, self.lane_capacity)

    def base(self, lanes: np.ndarray) -> np.ndarray:
        """The first row number of each lane since the last ``clear()``."""
        return self._lanes[lanes, _BASE]

    def next_slot(self) -> int:
        """The slot a one-lane ring's next row goes to (0 again after ``clear()``): what cpprb's
        ``get_next_index`` and Velora's ``position`` report."""
        return int(self.slots(self.bounds()[1][:1])[0])  # the one lane's next row id is its row number

    def span(self) -> tuple[int, int]:
        """``bounds()`` of a one-lane ring, as ints (the sampling fast path)."""
        cur = self._cur[_CURSOR]
        start = max(self._cur[_BASE], cur - self.lane_capacity)
        return min(start, cur), cur

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """The slot (row of the columns) of each row id."""
        return rows.slot_of_id(ids, self.lanes, self.lane_capacity)

    def expected(self, ids: np.ndarray) -> np.ndarray:
        """The committed stamp each id must show."""
        return rows.committed_of_id(ids, self.lanes)

    def committed_ids(self) -> np.ndarray:
        """Ids of every committed row that counts now (a scan of the stamps; the slow path)."""
        start, stop = self.bounds()
        st = self.stamp.reshape(self.lanes, self.lane_capacity)
        out = []
        for lane in range(self.lanes):
            s = st[lane]
            n = rows.number_of_stamp(s)
            ok = rows.is_committed(s) & (n >= start[lane]) & (n < stop[lane])
            out.append(rows.row_id(n[ok], lane, self.lanes))
        ids = np.concatenate(out)
        ids.sort()
        return ids

    def ids_of_slots(self, slots: np.ndarray, live: np.ndarray | None = None) -> np.ndarray:
        """The id of the committed row in each slot now, or ``INVALID`` (empty, being written,
        cleared, or where ``live`` is false); reading ids this way is the first stamp read of
        the commit protocol."""
        s = self.stamp.take(slots)
        n = rows.number_of_stamp(s)
        lc = self.lane_capacity
        if self.lanes == 1:
            ids = n
            start = self.span()[0]
        else:
            lane = slots // lc
            ids = rows.row_id(n, lane, self.lanes)
            start = self.bounds()[0][lane]
        bad = ~rows.is_committed(s) | (n < start)
        if live is not None:
            bad |= ~live
        ids[bad] = INVALID
        return ids

    def check_ids(self, values: object, what: str) -> np.ndarray:
        """Row ids from a caller (``batch.index``: an integer array-like or tensor) as int64.
        An id is valid when it is ``>= 0`` and its row number ``id // lanes`` is below its lane's
        cursor; others never named a row (a huge id's stamp ``2 n + 2`` would even wrap to an
        empty slot's): ``UnknownIdError``, raised before any arithmetic on them. Ids that are not
        integers raise ``FieldError``."""
        if hasattr(values, "detach"):  # a torch tensor, maybe on a device
            values = values.detach().cpu().numpy()
        a = np.asarray(values)
        if a.size == 0:
            return np.empty(0, np.int64)
        if a.dtype.kind not in "iu":
            raise FieldError(f"{what}: expected integer row ids (batch.index), got dtype {a.dtype}; pass batch.index as it came")
        a = a.reshape(-1)
        lib = self._lib
        if lib is not None and a.dtype == np.int64 and a.flags.c_contiguous and lib.known(a, self._lanes):
            return a  # every id known, in one C call; the code below finds the ones that are not
        stop = self._lanes[:, _CURSOR]
        lanes = self.lanes
        if a.dtype.kind == "u" and a.max() > _INT64_MAX:
            never = a[a > _INT64_MAX]
        else:
            ids = a.astype(np.int64, copy=False)
            lane = rows.lane_of(ids, lanes)  # in [0, lanes), also for negative ids
            never = ids[(ids < 0) | (rows.number_of(ids, lanes) >= stop[lane])]
            if not never.size:
                return ids
        below = f"id < {int(stop[0])}" if lanes == 1 else f"id // {lanes} < {stop.tolist()}[id % {lanes}]"
        raise UnknownIdError(
            f"{what}: ids {never[:5].tolist()}{' ...' if never.size > 5 else ''} never named a row of this "
            f"buffer: expected ids from batch.index, >= 0 and below the next row of their lane ({below}); "
            "nothing was changed"
        )

    def held_ids(self) -> np.ndarray:
        """The ids of every row that counts now, lane by lane, oldest first (rows being written
        and dead writers' rows included: readers check them)."""
        first, last = self.bounds()
        return np.concatenate([rows.row_id(np.arange(a, b), lane, self.lanes) for lane, (a, b) in enumerate(zip(first, last, strict=True))])

    def ids_at(self, index: object) -> np.ndarray:
        """Ids of the rows at logical positions ``index`` (an int, a slice or an array of ints;
        0 the oldest, -1 the newest, lane by lane); an int gives a 0-d array."""
        start, stop = self.bounds()
        sizes = stop - start
        pos = rows.positions(index, int(sizes.sum()))
        return ids_at(pos.reshape(-1).astype(np.int64), start, stop).reshape(pos.shape)

    def contiguous(self, start: int, stop: int, lane: int) -> tuple[slice, np.ndarray]:
        """The slots of logical rows ``[start, stop)`` of ``lane`` as one slice, and their ids;
        ``ValueError`` when they wrap past the lane's end (two pieces cannot be one view)."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane: expected a lane in [0, {self.lanes}), got {lane}")
        first, last = self.bounds()
        held = int(last[lane] - first[lane])
        lo, hi, step = slice(start, stop).indices(held)
        if step != 1 or hi < lo:
            raise ValueError(f"view({start}, {stop}): expected 0 <= start <= stop within {held} rows")
        lc = self.lane_capacity
        s0 = (int(first[lane]) + lo) % lc
        if s0 + (hi - lo) > lc:
            raise ValueError(
                f"view({start}, {stop}): those rows wrap past the end of the ring (slot {lc}); "
                "take two views, or get() for one copy"
            )
        ids = rows.row_id(int(first[lane]) + np.arange(lo, hi), lane, self.lanes)
        return rows.run_slots(lane, int(first[lane]) + lo, int(first[lane]) + hi, lc), ids

    def current(self, ids: np.ndarray) -> np.ndarray:
        """Which ids still name the committed row in their slot and count (not overwritten, not
        being written, not cleared)."""
        lib = self._lib
        if lib is not None and ids.dtype == np.int64 and ids.flags.c_contiguous:
            ok = np.empty(ids.shape, np.bool_)
            lib.current(ids, self.stamp, self._lanes, ok)
            return ok
        ok = self.stamp.take(self.slots(ids)) == self.expected(ids)
        cleared = self.cleared(ids)
        if cleared.size:
            ok[cleared] = False
        return ok

    def cleared(self, ids: np.ndarray, lowest: int | None = None) -> np.ndarray:
        """Positions of ``ids`` older than their lane's last ``clear()``: a cleared row keeps its
        stamp, so this is the check that makes a clear final for readers. ``lowest``: the
        smallest of ``ids`` when the caller knows it."""
        if self.lanes == 1:
            base = self._cur[_BASE]
            if not ids.size or (ids.min() if lowest is None else lowest) >= base:
                return _EMPTY
            return np.flatnonzero(ids < base)
        return np.flatnonzero(rows.number_of(ids, self.lanes) < self._lanes[rows.lane_of(ids, self.lanes), _BASE])

    def check_push(self, k: int, lane: int | np.ndarray) -> None:
        """Refuse, before touching anything, a push the ring can never hold (``layout.check_lanes``)."""
        check_lanes(k, lane, self.lanes, self.lane_capacity)
