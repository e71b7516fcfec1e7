"""Rows by slot and by their place in a lane: what the facades ask of a buffer when their library
addresses a ring by position (SB3's ``pos`` and its arrays, TorchRL's storage indices,
DI-engine's ``priority_idx``, cpprb's and Velora's next index).

Each function is one of ``rows.py``'s and ``ring.py``'s rules applied to a ``reader.Source``, so
no module above ``protocol/`` reads stamps or cursors or does slot arithmetic itself. A slot
holds a row when its stamp says that row is committed there and the row counts (not cleared,
not lapped: ``Ring.ids_of_slots``).
"""

from __future__ import annotations

import numpy as np

from . import rows
from .reader import Source
from .ring import INVALID

__all__ = ["INVALID", "cleared", "cursor", "free", "held", "ids_at", "in_lane", "in_slot_order", "is_run", "known", "lane_slots", "lanes",
           "live", "newest", "newest_at", "next_slot", "position", "row_ids", "slots_of", "write_free"]


def ids_at(src: Source, slots: np.ndarray) -> np.ndarray:
    """The id of the row each slot holds now, or ``INVALID`` (empty, being written, cleared)."""
    return src.ring.ids_of_slots(np.asarray(slots, np.int64))


def slots_of(src: Source, ids: np.ndarray) -> np.ndarray:
    """The slot of each row id (where its row is, or was before it was overwritten)."""
    return src.ring.slots(np.asarray(ids, np.int64))


def live(src: Source) -> np.ndarray:
    """The ids of the rows held and committed now, lane by lane, oldest first (rows deleted,
    being written or lost left out)."""
    ring = src.ring
    held_ids = ring.held_ids()
    return held_ids[ring.ids_of_slots(ring.slots(held_ids)) == held_ids]


def known(src: Source, ids: object, what: str) -> np.ndarray:
    """Row ids a caller gave (a batch's ``index``), as int64, each checked to have named a row of
    this buffer (``Ring.check_ids``: ``UnknownIdError`` naming ``what`` otherwise)."""
    return src.ring.check_ids(ids, what)


def next_slot(src: Source) -> int:
    """The slot a one-lane buffer's next row goes to (0 again after ``clear()``)."""
    return src.ring.next_slot()


def cursor(src: Source) -> int:
    """A one-lane buffer's cursor: the rows ever reserved in it. Any process's push moves it on."""
    return src.ring.span()[1]


def held(src: Source, slots: np.ndarray) -> np.ndarray:
    """Whether each slot of a one-lane buffer is among those its rows since the last ``clear()``
    fill (written, or being written now)."""
    first, stop = src.ring.span()
    return (np.asarray(slots, np.int64) - first) % src.ring.capacity < stop - first


def free(src: Source) -> np.ndarray:
    """The slots that hold no row now (never written, cleared, deleted or being written)."""
    every = np.arange(src.ring.capacity, dtype=np.int64)
    return every[src.ring.ids_of_slots(every) == INVALID]


def write_free(src: Source, slots: np.ndarray, field: str, values: np.ndarray) -> None:
    """Write ``values`` of ``field`` at those ``slots`` that hold no row and are not being written,
    under the lock so no reservation takes one meanwhile (``Ring.write_free``): values no reader
    reads, which the next row pushed there replaces (SB3's arrays written where no row is)."""
    src.ring.write_free(np.asarray(slots, np.int64), src.block.fields[field], values)


def lanes(src: Source) -> tuple[np.ndarray, np.ndarray]:
    """Per lane, its cursor (the next row number) and the rows written to it since the last
    ``clear()`` (counting on past its capacity)."""
    ring = src.ring
    stop = ring.bounds()[1]
    return stop, stop - ring.base(np.arange(ring.lanes))


def position(src: Source, n: np.ndarray | int) -> np.ndarray | int:
    """The place of row number ``n`` in its lane: its slot, counted from the lane's first."""
    return rows.slot(0, n, src.ring.lane_capacity)  # the slot in lane 0 is the place in any lane


def in_lane(src: Source, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each row id lives within its lane: ``(position, lane)`` (SB3's ``[pos, env]``)."""
    ids = np.asarray(ids, np.int64)
    lanes = src.ring.lanes
    return rows.slot(0, rows.number_of(ids, lanes), src.ring.lane_capacity), rows.lane_of(ids, lanes)


def lane_slots(src: Source, lane: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The slot of row number ``n`` of ``lane`` (broadcast together)."""
    return rows.slot(np.asarray(lane, np.int64), np.asarray(n, np.int64), src.ring.lane_capacity)


def row_ids(src: Source, n: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """The id of row number ``n`` of ``lane`` (broadcast together)."""
    return rows.row_id(np.asarray(n, np.int64), np.asarray(lane, np.int64), src.ring.lanes)


def newest(src: Source, lane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each lane's newest row number (its cursor - 1) and whether that row is one since the lane's
    last ``clear()``."""
    ring = src.ring
    lane = np.asarray(lane, np.int64)
    last = ring.bounds()[1][lane] - 1
    return last, last >= ring.base(lane)


def newest_at(src: Source, place: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row numbers of the newest rows of ``lane`` in its slots at ``place`` (``position``), and
    each lane's newest row number. A place the lane has not reached since its last ``clear()``
    gives a row number below its first (``cleared``)."""
    lane = np.asarray(lane, np.int64)
    last = src.ring.bounds()[1][lane] - 1
    return rows.newest_at(np.asarray(place, np.int64), last, src.ring.lane_capacity), last


def cleared(src: Source, ids: np.ndarray) -> np.ndarray:
    """Whether each row id is older than its lane's last ``clear()`` (or below a lane's first row)."""
    ids = np.asarray(ids, np.int64)
    out = np.zeros(ids.shape, bool)
    out.reshape(-1)[src.ring.cleared(ids.reshape(-1))] = True
    return out


def is_run(slots: np.ndarray, first: int, cap: int) -> bool:
    """Whether ``slots`` are ``first, first + 1, ...`` modulo ``cap``."""
    k = slots.size
    if not k:
        return True
    if int(slots[0]) != first:
        return False
    expected = np.arange(first, first + k, dtype=np.int64)
    if first + k > cap:
        expected %= cap
    return bool((slots == expected).all())


def in_slot_order(rows: dict[str, np.ndarray], capacity: int) -> dict[str, np.ndarray]:
    """Exported rows (``export``: with ``index``) in the order of their slots (``index %
    capacity``, the buffer's rows: with ``ndim=2`` a row is a step of every env), so a load puts
    each back in its slot; oldest first where rows are missing in the middle (a writer died mid-push)."""
    slots = rows.pop("index") % capacity
    rows.pop("episode", None)
    order = np.argsort(slots, kind="stable")
    if not np.array_equal(slots[order], np.arange(slots.size)):
        return rows
    return {n: a[order] for n, a in rows.items()}
