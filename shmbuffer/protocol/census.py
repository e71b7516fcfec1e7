"""A buffer's shared counters and rows per writer at one instant, for a monitor (``shmbuffer top``).

``take`` reads the lanes once, then the counters (so the rows it counts are never more than the
rows inserted while writers go on), and which writer entry holds each committed row that counts
and each slot being written. ``pushed`` spreads the rows added to each lane between two censuses
over the writers that reserved them. ``unmapped`` reads the lanes of a block it does not map
(``shmbuffer ls``/``inspect`` of any buffer, a damaged one too). Nothing here takes the lock or writes: a census of a busy
buffer is a moment's picture, good to a few rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import LayoutError
from ..shm import segment
from ..shm.lock import WAITS
from . import rows
from .layout import LANE_WORDS, WRITERS, Counter, Lane
from .reader import Source


@dataclass
class Census:
    """One census of a buffer (``take``)."""

    cursors: np.ndarray
    """each lane's rows ever reserved"""
    rows: int
    """the rows that count (since the last ``clear()``, not lapped), end and deleted rows included"""
    removed: bool
    """whether rows were ever deleted or used up (``len`` then leaves them out: a scan)"""
    held: np.ndarray
    """per writer entry, the committed rows that count that it wrote"""
    writing: np.ndarray
    """the writer entry of each slot being written now (or left half-written by a dead writer)"""
    inserted: int
    sampled: int
    reclaimed: int
    lock_recoveries: int
    lock_waits: int
    writer_pid: np.ndarray
    writer_start: np.ndarray
    writer_sampled: np.ndarray
    """per writer entry, the rows it sampled without the lock"""
    device_lag_rows: int | None
    """how many rows a device copy's newest refresh is behind (None: no device copy refreshes)"""
    device_lag_ms: float | None


def take(src: Source) -> Census:
    """The census of ``src`` now."""
    arrays = src.block.arrays
    stamp, owner = arrays["_stamp"], arrays["_owner"]
    lc = src.ring.lane_capacity
    lanes_now = arrays["_lanes"].copy()
    lo, hi = rows.bounds(lanes_now, lc)
    held = np.zeros(WRITERS, np.int64)
    for lane in np.flatnonzero(hi > lo):
        n = np.arange(int(lo[lane]), int(hi[lane]))
        slots = rows.slot(int(lane), n, lc)
        held += np.bincount(owner[slots][stamp[slots] == rows.committed(n)], minlength=WRITERS)
    stats = arrays["_stats"].copy()
    wsampled = arrays["_sampled"].copy()
    inserted = int(stats[Counter.INSERTED])
    at = int(stats[Counter.DEVICE_AT])
    return Census(
        cursors=lanes_now[:, Lane.CURSOR].copy(), rows=int((hi - lo).sum()), removed=bool(stats[Counter.REMOVED]),
        held=held, writing=owner[np.flatnonzero(rows.is_writing(stamp))],
        inserted=inserted, sampled=int(stats[Counter.SAMPLED]) + int(wsampled.sum()),
        reclaimed=int(stats[Counter.RECLAIMED]), lock_recoveries=int(stats[Counter.LOCK_RECOVERIES]),
        lock_waits=int(arrays["_mutex"].reshape(-1)[WAITS:WAITS + 8].view(np.int64)[0]),
        writer_pid=arrays["_writer_pid"].copy(), writer_start=arrays["_writer_start"].copy(), writer_sampled=wsampled,
        device_lag_rows=inserted - int(stats[Counter.DEVICE_ROWS]) if at else None,
        device_lag_ms=(time.monotonic_ns() - at) / 1e6 if at else None,
    )


def pushed(src: Source, before: np.ndarray, cursors: np.ndarray) -> np.ndarray:
    """Per writer entry, about how many rows it pushed while the lanes' cursors went from
    ``before`` to ``cursors``: each lane's new rows shared out by the writers of the slots they
    fill now (rows already lapped are gone, so the share of those left stands for them)."""
    owner = src.block.arrays["_owner"]
    lc = src.ring.lane_capacity
    out = np.zeros(WRITERS)
    for lane in np.flatnonzero(cursors != before):
        new = int(cursors[lane] - before[lane])
        first = max(int(before[lane]), int(cursors[lane]) - lc)
        slots = rows.slot(int(lane), np.arange(first, int(cursors[lane])), lc)
        out += np.bincount(owner[slots], minlength=WRITERS) * (new / slots.size)
    return out


def unmapped(h: segment.Header) -> tuple[int, int, list[tuple[int, int]]]:
    """Rows held, capacity and each lane's ``[first, stop)`` of the block ``h`` heads, read from
    its ``_lanes`` column without mapping the block, as ``Ring.bounds`` computes them;
    ``LayoutError`` when its options and columns do not agree."""
    opts = h.meta.get("options")
    capacity, lanes = (opts.get("capacity"), opts.get("lanes")) if isinstance(opts, dict) else (None, None)
    if not (type(capacity) is int and type(lanes) is int and 0 < lanes <= capacity and capacity % lanes == 0):
        raise LayoutError(f"buffer {h.name!r} is damaged: capacity {segment.clip(capacity)} and lanes "
                          f"{segment.clip(lanes)} in its options, expected positive ints, lanes dividing capacity")
    cols = {c["name"]: c for c in h.meta["columns"]}
    col, stamps = cols.get("_lanes"), cols.get("_stamp")
    if col is None or col["shape"] != [lanes, 8] or col["dtype"] != "<i8" or stamps is None or stamps["shape"] != [capacity]:
        raise LayoutError(f"buffer {h.name!r} is damaged: its _lanes and _stamp columns do not match capacity "
                          f"{capacity} in {lanes} lanes")
    raw = segment.read_data(h, col["offset"], lanes * 8 * 8)
    first, cur = rows.bounds(np.frombuffer(raw, np.int64).reshape(lanes, LANE_WORDS), rows.lane_capacity(capacity, lanes))
    return int((cur - first).sum()), capacity, [(int(a), int(b)) for a, b in zip(first, cur, strict=True)]
