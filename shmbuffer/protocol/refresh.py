"""A refresh: the reader whose destination is a copy of the rows kept elsewhere in the ring's slot
layout (the device copy, ``device/rows.py``: its slot lists, its lock, where its rows go). Its
reads of the ring are here, as every reader's are in ``protocol/``; ``native/refresh.c`` does the
same in one C call (given ``sources``). A refresh (``steps``):

1. the rows to copy are found from the lanes' cursors: each lane's rows since the last refresh
   (at most two runs of consecutive slots, the lane's end between them, cut in pieces of
   ``chunk`` rows), and the ``pending`` rows of earlier refreshes whose stamps now say
   committed. No slot is scanned: a refresh costs the rows that came in. The rows changed in
   place since (an ``update()``, a ``delete()``, a failed push put back) are read from the block's
   log of edits (``Counter.EDITS``, ``Ring.log_edits``: each logs its slots once their stamps
   changed and before their bytes do, since an update puts back the stamp it found and the stamps
   cannot tell): their slots are dropped and the rows they hold now are pending. A ``clear()`` (the lanes' bases), or more
   edits than the log holds (``EDIT_LOG``), makes it a full one: the held rows that left their
   lanes are dropped, no row is pending, and every row of the lanes is copied again, a piece at a
   time (the rows not yet copied again stay drawable, as they were committed);
2. each piece's slots are dropped from the usable ones, then the piece is copied by the reader's
   rule (first stamps, the copies, second stamps); a row counts when both reads show it committed
   (``rows.intact``) and no edit logged meanwhile names its slot (the log is read again after the
   copies; if it overflowed meanwhile none of the copies count and the next refresh is a full
   one); the others stay ``pending``, tried again by each refresh until they are held or leave
   their lane. So a torn, half-written, overwritten or half-updated row is never usable;
3. the piece's rows that count are held: usable again.

The copy gives ``steps``: ``lock``, ``held`` (the stamp each slot holds, 0: none), ``next`` and
``bases`` (per lane: the rows below were copied; the lane's base then), ``state``, ``chunk``,
``pending``, ``drop(slots)``, ``hold(slots, stamps)``, ``add_pending(ids)``, and ``copy_run(slot,
n0, k)``/``copy_rows(ids)``, which copy by ``read_run``/``read_rows`` and say which came intact.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .gather import Rows, gather, gather_run
from .layout import EDIT_LOG, Counter, Lane
from .reader import Source
from .rows import committed, committed_of_id, lane_of, number_of, number_of_stamp, pieces, row_id

_UPDATES, _DELETES, _INSERTED = int(Counter.UPDATES), int(Counter.DELETES), int(Counter.INSERTED)
_EDITS, _EDITS_BEGUN = int(Counter.EDITS), int(Counter.EDITS_BEGUN)
_DEVICE_ROWS, _DEVICE_AT = int(Counter.DEVICE_ROWS), int(Counter.DEVICE_AT)
_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
COUNT, PENDING, UPDATES, DELETES, INSERTED, AT, DONE, ERROR, SPENT, TAKEN, WAITED, CPU, EDITS, REDRAWN, DROPS = range(15)
"""The words of a copy's ``state`` (``native/refresh.c``'s ``ST_*``): usable slots, pending ids;
``Counter.UPDATES``, ``DELETES``, ``INSERTED`` and ``time.monotonic_ns()`` as the last refresh
began, refreshes done, 1 once the C refresher stopped on an error; all told: ns spent refreshing,
rows taken in, ns waiting for a sample's lock, CPU ns (the C refresh); ``Counter.EDITS`` as the
last refresh began (-1: copy every row again); all told: rows the C uniform sample drew again (a
refresh dropped their slot meanwhile), changes of the lists that dropped slots (``dropped``)."""
STATE_WORDS = 16
"""The length of a copy's ``state`` (``native.h``'s ``ST_WORDS``): room for a few more words."""


def sources(src: Source) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the C refresh and lag question read (``native/refresh.c``, ``learner.c``'s ``behind``):
    the stamps, the lanes' table, the counters and the log of edits."""
    return src.block.stamp, src.ring.cursors, src.block.counters, src.block.edits


def publish(src: Source, inserted: int, at: int) -> None:
    """Say in the block (``Counter.DEVICE_ROWS``/``DEVICE_AT``, where ``top`` reads the copy's lag)
    that a refresh began at ``at`` with ``inserted`` rows inserted; ``at`` 0 (a copy closing): no
    copy now, unless another refreshed since."""
    counters = src.block.counters
    if not counters.flags.writeable:
        return
    if at:
        counters[_DEVICE_ROWS], counters[_DEVICE_AT] = inserted, at
    elif int(counters[_DEVICE_ROWS]) == inserted:
        counters[_DEVICE_AT] = 0


def lag(src: Source, state: np.ndarray) -> tuple[int, float]:
    """How far a copy is behind: rows inserted since its last refresh began, seconds since it began."""
    inserted = int(src.block.counters[_INSERTED])
    return inserted - int(state[INSERTED]), (time.monotonic_ns() - int(state[AT])) / 1e9


def behind(src: Source, state: np.ndarray, bases: np.ndarray, rows_bound: int | None, seconds_bound: float | None,
           share: float) -> bool:
    """Whether a copy is more than ``share`` of a bound behind (``DeviceReplay._behind`` says when;
    ``native/learner.c``'s ``behind`` is the same in C)."""
    counters = src.block.counters
    if not np.array_equal(src.ring.cursors[:, _BASE], bases):
        return True
    rows, seconds = lag(src, state)
    edited = int(counters[_UPDATES]) != state[UPDATES] or int(counters[_DELETES]) != state[DELETES]
    if rows_bound is not None and (rows > share * rows_bound or edited):
        return True
    changed = rows > 0 or edited
    if changed and seconds_bound is not None and seconds > share * seconds_bound:
        return True
    return changed and rows_bound is None and seconds_bound is None and share < 1


def read_run(src: Source, columns: tuple[np.ndarray, ...], first: int, n0: int, outs: tuple[np.ndarray, ...],
             ok: np.ndarray) -> None:
    """Rows ``n0 ..`` of one lane from slot ``first`` into ``outs`` by the reader's rule; ``ok``:
    which came intact (``gather.gather_run``)."""
    gather_run(src.block.stamp, columns, first, n0, outs, ok)


def read_rows(src: Source, ids: np.ndarray, out: dict[str, np.ndarray]) -> tuple[Rows, np.ndarray]:
    """The rows ``ids`` as stored, by the stamped gather, into ``out``; and the slots of those intact."""
    rows = gather(src.block, src.ring, ids, out=out, stored=True)
    return rows, src.ring.slots(ids[rows.ok])


def steps(src: Source, copy: Any) -> int:
    """One refresh of ``copy`` in Python steps (``native/refresh.c`` does the same in one call);
    the rows it took in."""
    ring, counters, state = src.ring, src.block.counters, copy.state
    lanes = ring.lanes
    inserted = int(counters[_INSERTED])  # before the lanes: the lag is never under-counted
    updates, deletes = int(counters[_UPDATES]), int(counters[_DELETES])  # for the lag question
    edits = int(counters[_EDITS])  # before the stamps: an edit logged later is seen after the copies
    cursors = ring.cursors[:, _CURSOR].copy()
    bases = ring.cursors[:, _BASE].copy()
    lc = ring.lane_capacity
    start = np.minimum(np.maximum(bases, cursors - lc), cursors)
    seen = int(state[EDITS])
    full = seen < 0 or edits - seen > EDIT_LOG or not np.array_equal(bases, copy.bases)
    if not full and edits != seen:
        full = not _take_edits(src, copy, seen, edits, start, cursors)
    taken, spoiled = 0, False
    if full:
        with copy.lock:
            slots = np.flatnonzero(copy.held)
            copy.drop(slots[number_of_stamp(copy.held[slots]) < start[slots // lc]])
            state[PENDING] = 0
    else:
        taken, spoiled = _retry_pending(src, copy, start, cursors, edits)
    first = start if full else np.maximum(copy.next, start)
    for s0, n0, k in ([] if spoiled else _runs(lc, copy.chunk, first, cursors)):
        slots = np.arange(s0, s0 + k)
        with copy.lock:
            copy.drop(slots)
        ok = copy.copy_run(s0, n0, k)
        edited = _edited(src, edits, slots)
        if edited is None:  # more edits during the copies than the log holds: every row next time
            spoiled = True
            break
        ok &= ~edited  # an edit's row is read again once it is done (the stamps cannot tell)
        with copy.lock:
            copy.hold(slots[ok], committed(np.arange(n0, n0 + k)[ok]))
            copy.add_pending(row_id(np.arange(n0, n0 + k)[~ok], s0 // lc, lanes))
        taken += int(np.count_nonzero(ok))
    copy.next[:], copy.bases[:] = cursors, bases
    state[EDITS] = -1 if spoiled else edits  # the edits logged during the copies: next time
    state[UPDATES], state[DELETES], state[INSERTED] = updates, deletes, inserted
    return taken


def _take_edits(src: Source, copy: Any, seen: int, edits: int, start: np.ndarray, stop: np.ndarray) -> bool:
    """The rows changed in place since the last refresh (the log's entries ``seen`` to
    ``edits``): their slots dropped, and the row each slot holds now (committed or being
    written, within its lane's rows, and older than the rows this refresh copies anyway:
    never pending twice) pending, to be copied once committed. ``False`` when the log's
    entries were overwritten as they were read (the caller copies every row)."""
    block, ring = src.block, src.ring
    lanes, lc = ring.lanes, ring.lane_capacity
    slots = block.edits[np.arange(seen, edits) % EDIT_LOG]
    if _overwritten(src, seen) or not ((slots >= 0) & (slots < ring.capacity)).all():
        return False
    _forget_lapped(copy, lanes, start, stop)
    slots = np.unique(slots)
    with copy.lock:
        copy.drop(slots)
    stamps, lane = ring.stamp[slots], slots // lc
    n = number_of_stamp(stamps)
    first = np.minimum(np.maximum(copy.next, start), stop)  # the rows from there are copied below
    now = (stamps != 0) & (n >= start[lane]) & (n < first[lane])
    ids = row_id(n[now], lane[now], lanes)
    copy.add_pending(ids[~np.isin(ids, copy.pending)])
    return True


def _edited(src: Source, edits: int, slots: np.ndarray) -> np.ndarray | None:
    """Which of ``slots`` (just copied) an edit logged since ``edits`` names, or ``None``
    when more were logged than the log holds."""
    block = src.block
    now = int(block.counters[_EDITS])
    if now == edits:
        return np.zeros(slots.shape, bool)
    logged = block.edits[np.arange(edits, now) % EDIT_LOG] if now - edits <= EDIT_LOG else None
    if logged is None or _overwritten(src, edits):
        return None
    return np.isin(slots, logged)


def _overwritten(src: Source, first: int) -> bool:
    """Whether the log's entries from ``first`` may have been overwritten by now (read after
    them): a writer stores ``Counter.EDITS_BEGUN`` before its entries, ``EDITS`` after."""
    counters = src.block.counters
    return max(int(counters[_EDITS_BEGUN]), int(counters[_EDITS])) - first > EDIT_LOG


def _retry_pending(src: Source, copy: Any, start: np.ndarray, stop: np.ndarray, edits: int) -> tuple[int, bool]:
    """The pending rows: those that left their lane forgotten, those now committed copied
    (dropped first), the others kept; the rows held, and whether more edits than the log
    holds came during the copy."""
    ring = src.ring
    lanes = ring.lanes
    _forget_lapped(copy, lanes, start, stop)
    ids = copy.pending
    ready = ring.stamp[ring.slots(ids)] == committed_of_id(ids, lanes)
    again, keep = ids[ready], ids[~ready]
    copy.state[PENDING] = 0
    copy.add_pending(keep)
    if not again.size:
        return 0, False
    with copy.lock:
        copy.drop(ring.slots(again))
    got = copy.copy_rows(again)
    edited = _edited(src, edits, ring.slots(again))
    if edited is None:
        return 0, True
    got &= ~edited
    with copy.lock:
        copy.hold(ring.slots(again[got]), committed_of_id(again[got], lanes))
        copy.add_pending(again[~got])
    return int(np.count_nonzero(got)), False


def _forget_lapped(copy: Any, lanes: int, start: np.ndarray, stop: np.ndarray) -> None:
    """The pending rows that left their lane are forgotten: lapped, or above its cursor (a
    push undone under them: the refresh that copies the lane from there copies them)."""
    ids = copy.pending
    n, lane = number_of(ids, lanes), lane_of(ids, lanes)
    copy.state[PENDING] = 0
    copy.add_pending(ids[(n >= start[lane]) & (n < stop[lane])])


def _runs(lc: int, chunk: int, first: np.ndarray, stop: np.ndarray) -> list[tuple[int, int, int]]:
    """Each lane's rows ``[first, stop)`` as runs of consecutive slots (``rows.pieces``: split where
    the lane wraps, and into pieces of ``chunk`` rows): ``(first slot, first row number, rows)``."""
    return [(sl.start, n0, n1 - n0) for lane in np.flatnonzero(stop > first)
            for n0, n1, sl in pieces(int(lane), int(first[lane]), int(stop[lane]), lc, chunk)]
