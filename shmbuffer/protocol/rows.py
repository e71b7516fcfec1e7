"""The row arithmetic of the commit protocol: the only place where these rules are written in Python.

Rows, lanes and ids
-------------------
A ring of ``capacity`` slots is split into ``lanes`` lanes of ``lane_capacity`` slots (one lane
by default). Each lane has a cursor: the count of rows ever reserved in it, a 64-bit number that
never wraps. Row number ``n`` of lane ``l`` lives in slot ``l * lane_capacity + n % lane_capacity``
(``slot``) and has the global id ``n * lanes + l`` (``row_id``): ids never repeat, so an id names
one row forever, and a stale id (its slot has since been overwritten) is detectable. A lane keeps
one writer's (or one env's) consecutive pushes in consecutive slots, which windows need.

Stamps
------
Each slot has a commit stamp. ``0``: empty. ``2n + 1`` (``writing``): row ``n`` is being written
there. ``2n + 2`` (``committed``): row ``n`` is there, whole. A row read between two loads of its
stamp is intact (``intact``) when both loads show ``committed(n)``: neither torn, nor half-written,
nor overwritten. The C extension states the same rules once, in ``native/layout.h``
(``slot_of``, ``committed_stamp``), and ``tests/test_native.py`` checks the two against each other.

Which rows count
----------------
Per lane, the rows from the lane's base (its last ``clear()``) up to its cursor, at most a lane's
capacity back from the cursor (``bounds``).

Every function takes Python ints, numpy int64 arrays or torch int64 tensors alike (``device/``
does the same arithmetic on the device). The walk from positions to ids lane by lane is the
uniform draw's (``samplers.ids_at``): ``sampling/`` lies below this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import PositionError
from .layout import Lane

Ints = Any
"""An int, an int64 array or an int64 tensor: every function here takes and gives each."""

_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)


def lane_capacity(capacity: int, lanes: int) -> int:
    """The slots of each lane: the ring's ``capacity`` split into ``lanes`` equal lanes."""
    return capacity // lanes


def slot(lane: Ints, n: Ints, lane_capacity: int) -> Ints:
    """The slot (row of the columns) that row number ``n`` of lane ``lane`` lives in."""
    return lane * lane_capacity + n % lane_capacity


def run_slots(lane: int, n0: int, n1: int, lane_capacity: int) -> slice:
    """The slots of rows ``[n0, n1)`` of ``lane`` (ints), which do not wrap: one slice."""
    s0 = int(slot(lane, n0, lane_capacity))
    return slice(s0, s0 + n1 - n0)


def pieces(lane: int, first: int, stop: int, lane_capacity: int, most: int = 2**62) -> Iterator[tuple[int, int, slice]]:
    """Rows ``[first, stop)`` of ``lane`` (ints) as pieces of consecutive slots, cut where the lane
    wraps and every ``most`` rows: each piece's ``(n0, n1, run_slots)``."""
    while first < stop:
        n1 = min(stop, first + most, (first // lane_capacity + 1) * lane_capacity)
        yield first, n1, run_slots(lane, first, n1, lane_capacity)
        first = n1


def row_id(n: Ints, lane: Ints, lanes: int) -> Ints:
    """The global id of row number ``n`` of lane ``lane``."""
    return n * lanes + lane


def lane_of(ids: Ints, lanes: int) -> Ints:
    """The lane of each id."""
    return ids % lanes


def number_of(ids: Ints, lanes: int) -> Ints:
    """The row number (within its lane) of each id."""
    return ids // lanes


def newest_at(position: Ints, newest: Ints, lane_capacity: int) -> Ints:
    """The newest row number, at most ``newest``, that lives at ``position`` of its lane (its
    slot is ``slot(lane, n, ...)``, its position ``n % lane_capacity``): SB3's ``pos`` as a row."""
    return newest - (newest - position) % lane_capacity


def slot_of_id(ids: Ints, lanes: int, lane_capacity: int) -> Ints:
    """The slot of each id."""
    if lanes == 1:
        return ids % lane_capacity
    return slot(ids % lanes, (ids // lanes), lane_capacity)


def id_of_slot(slots: Ints, stamps: Ints, lanes: int, lane_capacity: int) -> Ints:
    """The ids of the rows whose ``stamps`` the ``slots`` hold (numpy arrays or torch tensors)."""
    return row_id(number_of_stamp(stamps), slots // lane_capacity, lanes)


def writing(n: Ints) -> Ints:
    """The stamp of row number ``n`` while it is being written (odd)."""
    return 2 * n + 1


def committed(n: Ints) -> Ints:
    """The stamp of row number ``n`` once committed (even, never 0)."""
    return 2 * n + 2


def committed_of_id(ids: np.ndarray, lanes: int) -> np.ndarray:
    """The committed stamp each id must show (a new array)."""
    out = ids * 2 if lanes == 1 else (ids // lanes) * 2
    out += 2
    return out


def number_of_stamp(stamp: Ints) -> Ints:
    """The row number a committed or being-written stamp names (``-1`` for an empty slot)."""
    return (stamp - 1) // 2


def is_writing(stamp: Ints) -> Ints:
    """Whether a stamp says its row is being written (odd): a push or an update between its
    reservation and its commit, or a writer that died there."""
    return stamp & 1 == 1


def is_committed(stamp: Ints) -> Ints:
    """Whether a stamp says a row is there whole (even and not empty)."""
    return (stamp > 0) & (stamp % 2 == 0)


def intact(before: np.ndarray, after: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """The intact-row rule: a row copied between two loads of its stamp, ``before`` and ``after``,
    is kept only if both equal the stamp its id must show (``expected``)."""
    ok = before == expected
    ok &= after == expected
    return ok


def window(anchors: np.ndarray, offsets: np.ndarray, lanes: int, start: np.ndarray,
           stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rows ``anchor + offset`` of each anchor's lane, ``(len(anchors), len(offsets))``,
    and whether each lies inside its lane's rows (``start``/``stop``: ``bounds``)."""
    lane = anchors % lanes
    n = (anchors // lanes)[:, None] + offsets[None, :]
    inside = (n >= start[lane][:, None]) & (n < stop[lane][:, None])
    return n * lanes + lane[:, None], inside


def bounds(lanes_table: np.ndarray, lane_capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Per lane, the first and one-past-last row numbers that count, from a ``_lanes`` column:
    rows from the base on (the last ``clear()``), at most a lane's capacity back from the cursor."""
    cur = lanes_table[:, _CURSOR].copy()
    start = np.maximum(lanes_table[:, _BASE], cur - lane_capacity)
    return np.minimum(start, cur), cur


def positions(index: object, total: int) -> np.ndarray:
    """Logical positions ``index`` (an int, a slice or an array of ints, negative from the end)
    among ``total`` rows, checked: ``get``'s indexing."""
    if isinstance(index, slice):
        return np.arange(total)[index]
    pos = np.asarray(index)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"get: expected an int, a slice or an array of ints, got {pos.dtype}")
    pos = np.where(pos < 0, pos + total, pos)
    if pos.size and (pos.min() < 0 or pos.max() >= total):
        raise PositionError(f"get({index!r}): index out of range for {total} row{'' if total == 1 else 's'}")
    return pos
