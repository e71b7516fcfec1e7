"""The rows of a live buffer as of one moment, read piece by piece while writers go on: the
reader's half of the commit protocol for a save or an export.

``Snapshot`` chooses each lane's rows from their stamps and reads them in pieces through the
reader's stamped gather (``gather.gather(..., stored=True)``: the rows as stored, each kept only
when intact by the protocol's rule, ``rows.intact``); ``persistence.snapshot.copy_rows`` puts the
pieces into a sink (the save's file, or memory for ``export``). ``restore`` is the other way: the
stamps and bounds of rows a load put into a new buffer.

A save while writers run
------------------------
The snapshot first reaps the rows of writers that died mid-push (``protocol.ring``: they read as
empty from then on), reads each lane's bounds ``[first, stop)`` once (``protocol.rows.bounds``)
and scans their stamps. What it keeps is, per lane, the row numbers ``[F, S)`` where

* ``S`` is ``stop``, or the first row of ``[first, stop)`` that a live writer was still writing
  ``wait`` seconds after the start: the run stops before it, and the committed rows after it are
  not kept (they count as dropped). Rows of writers found dead by then are reaped and become
  holes. Rows reserved after the start (row numbers ``>= stop``) are never kept.
* ``F >= first`` is one past the last row of ``[first, S)`` that was found overwritten, at the
  start or when its piece was read: every row before it goes too, intact or not (writers lapping
  the ring take a lane's slots in row-number order, so those are overwritten next). A hole counts
  as overwritten once its slot is no longer empty. A row that the gather does not read intact
  counts as overwritten, and so does one cleared by a ``clear()`` before its piece was read (a
  cleared row keeps its stamp, and the reader never reads it).
* every row of ``[F, S)`` that the scan at the start found empty (stamp 0; dead writers' rows are
  by then), or that was deleted (or reaped) before its piece was read, is a hole; every other one
  is kept.

So every kept row was committed when the snapshot started (or within ``wait`` of it) and was
read intact (episode ids with it: they are part of the row), and each lane's kept rows and holes
are consecutive row numbers: the snapshot of a moment, less a lane's rows up to the newest one that
writers overwrote while it ran, and less the rows from the first one a live writer was still
writing. Rows that an update (``ReplayBuffer.update``) spanned are gathered again
(``gather.regather``), and once more holding the ring's lock (no update can begin) if updates are
still under way. Tree leaves and use counts are copied under the ring's lock after their piece's
rows: each as of that moment, not of the start (samplers change them without touching the rows);
a row overwritten by then (its stamp names a later row) is not kept.

Pieces are at most ``CHUNK_BYTES`` of rows, taken from the lanes in turn. The first piece of every
lane is held in memory until all lanes have one, so the file's layout (every lane's row count) is
known before anything is written; if writers still overwrite rows after that (they outran the
snapshot), the tensors are moved down over the dropped rows at the end: one more pass over the
sink from the first gap on. Memory: about two pieces, whatever the buffer's size.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import closed
from .gather import Rows, gather, regather
from .layout import ROW, SAMPLER, Counter, row_columns
from .rows import committed, pieces, row_id, run_slots, writing

__all__ = ["CHUNK_BYTES", "Buffer", "Moment", "Piece", "Run", "Snapshot", "at_one_moment", "columns"]

CHUNK_BYTES = 64 << 20
"""Bytes of rows copied (or read) at a time."""
_WAIT_UPDATES = 1.0
"""Seconds a read holding the lock waits for the updates under way to end."""

Buffer = Any
"""A ``ReplayBuffer`` (``buffer.py``, above this package: it is never imported here): what is saved
is read through its public ``ring``, ``block``, ``priorities``, ``reap``, ``schema`` and ``options``;
a load makes one with the ``factory`` it is given (``ReplayBuffer`` itself)."""


def columns(buf: Buffer) -> dict[str, np.ndarray]:
    """The buffer's columns by name (``layout.Block.arrays``); ``closed`` raises on a closed buffer."""
    if buf.closed:
        raise closed(buf.name)
    arrays: dict[str, np.ndarray] = buf.block.arrays
    return arrays


@dataclass
class Run:
    """One lane's rows: bounds at the start, the run ``[keep, end)`` kept so far, the next row,
    and the holes (row numbers of empty rows, sorted) of ``[first, end)``."""

    lane: int
    first: int
    stop: int
    base: int
    end: int
    keep: int
    at: int
    holes: np.ndarray

    def hole_count(self) -> int:
        """Holes in the run ``[keep, end)``."""
        return int(self.holes.size - np.searchsorted(self.holes, self.keep))

    def hole_mask(self, n0: int, n1: int) -> np.ndarray:
        """Which rows of ``[n0, n1)`` are holes."""
        h = self.holes[np.searchsorted(self.holes, n0):np.searchsorted(self.holes, n1)]
        mask = np.zeros(n1 - n0, bool)
        mask[h - n0] = True
        return mask


@dataclass
class Piece:
    """Rows ``[start, start + rows)`` of ``lane``: one array per tensor of the file."""

    lane: int
    start: int
    arrays: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        """How many rows the piece holds."""
        return int(next(iter(self.arrays.values())).shape[0])


class Snapshot:
    """The rows of ``buf`` as of now, read piece by piece (the module docstring): ``runs`` one
    ``Run`` per lane; ``stats``, ``counters`` and ``max_priority`` as of the start. ``since``: per
    lane, the first row scanned (a checkpoint's rows after the previous one's: the rows before
    are not the snapshot's, and their stamps are not read)."""

    def __init__(self, buf: Buffer, wait: float, since: list[int] | None = None) -> None:
        ring = buf.ring
        self.buf = buf
        self.arrays = columns(buf)
        self.lc = ring.lane_capacity
        buf.reap()  # rows of writers that died mid-push read as empty from now on: holes, not waited for
        self._reaped = False
        first, stop = ring.bounds()
        base = ring.base(np.arange(ring.lanes)).copy()
        self.stats = ring.stats
        counters = self.arrays["_stats"]
        self.counters = {"sample_calls": int(counters[Counter.SAMPLE_CALLS]), "removed": int(counters[Counter.REMOVED])}
        prios = buf.priorities
        self.max_priority = prios.max_priority if prios is not None else None
        deadline = time.monotonic() + wait
        self.runs = [self._scan(lane, int(first[lane]), int(stop[lane]), min(int(base[lane]), int(first[lane])), deadline,
                                int(first[lane]) if since is None else min(max(int(first[lane]), since[lane]),
                                                                           int(stop[lane])))
                     for lane in range(ring.lanes)]

    def _scan(self, lane: int, first: int, stop: int, base: int, deadline: float, start: int) -> Run:
        """Find the run's end (the first row a live writer is still writing after the wait), the
        overwritten rows before it and the holes (empty rows) among them, from row ``start``."""
        stamp = self.buf.ring.stamp
        keep = start
        holes: list[np.ndarray] = []
        step = CHUNK_BYTES // 8
        end = stop
        for n0, n1, sl in pieces(lane, start, stop, self.lc, step):
            numbers = np.arange(n0, n1, dtype=np.int64)
            expect, odd = committed(numbers), writing(numbers)
            s = stamp[sl].copy()
            while True:
                being = s == odd
                if not being.any() or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
                s[being] = stamp[sl][being]
            if being.any() and not self._reaped:  # writers that died while we waited
                self._reaped = True
                self.buf.reap()
                s[being] = stamp[sl][being]
                being = s == odd
            stuck = np.flatnonzero(being)
            cut = int(stuck[0]) if stuck.size else n1 - n0
            over = np.flatnonzero(s[:cut] > expect[:cut])
            if over.size:
                keep = n0 + int(over[-1]) + 1
            holes.append(n0 + np.flatnonzero(s[:cut] < expect[:cut]))
            if stuck.size:
                end = n0 + cut
                break
        found = np.concatenate(holes) if holes else np.empty(0, np.int64)
        return Run(lane, first, stop, base, end, keep, keep, found[found >= keep])

    def _read(self, ids: np.ndarray, sl: slice, numbers: np.ndarray, hole: np.ndarray) -> tuple[Rows, dict[str, np.ndarray], np.ndarray]:
        """Gather the rows ``ids`` (slots ``sl``) as stored, their sampler state (``sampler_state``,
        under the ring's lock), and their stamps after all of it. Rows that an update spanned are gathered again; if some are
        still being updated, the whole piece is gathered once more holding the lock."""
        buf, ring = self.buf, self.buf.ring
        block, stamp = buf.block, ring.stamp
        rows = gather(block, ring, ids, stored=True)
        if not rows.ok.all():
            regather(block, ring, ids, rows, stored=True)
        now = stamp[sl].copy()  # one read: the stamps change under us
        pending = ~rows.ok & ~hole & ((now == committed(numbers)) | (now == writing(numbers)))
        locked = bool(pending.any())
        if locked:
            ring.lock.acquire()
        try:
            if locked:  # no update can begin now; wait for those under way (their copies need no lock)
                until = time.monotonic() + _WAIT_UPDATES
                while (stamp[sl] == writing(numbers)).any() and time.monotonic() < until:
                    time.sleep(0.0001)
                rows = gather(block, ring, ids, stored=True)
            state = sampler_state(buf)
            with contextlib.nullcontext() if locked or not state else ring.lock:
                extra = {name: a[sl].copy() for name, a in state.items()}
            now = stamp[sl].copy()
        finally:
            if locked:
                ring.lock.release()
        return rows, extra, now

    def copy(self, run: Run, rows: int) -> Piece | None:
        """Copy the next ``rows`` rows of ``run`` (fewer at the lane's end or where its slots
        wrap); drop the overwritten ones and those before them. ``None`` when none is left."""
        buf = self.buf
        n0 = run.at
        n1 = min(run.end, n0 + rows, (n0 // self.lc + 1) * self.lc)
        sl = run_slots(run.lane, n0, n1, self.lc)
        numbers = np.arange(n0, n1, dtype=np.int64)
        ids = row_id(numbers, run.lane, buf.ring.lanes)
        hole = run.hole_mask(n0, n1)
        got, extra, now = self._read(ids, sl, numbers, hole)
        hole = hole | (now == 0)  # a row deleted (or reaped) since the scan is a hole, not a sign of lapping writers
        # a hole must still be empty (a stamp there means a writer lapped it); a row must have been
        # read intact and still be there (committed, or being updated) once its leaf was copied
        there = (now == committed(numbers)) | (now == writing(numbers))
        bad = np.where(hole, now != 0, ~(got.ok & there))
        run.at = n1
        if bad.any():
            run.keep = max(run.keep, n0 + int(np.flatnonzero(bad)[-1]) + 1)
        lo = max(run.keep, n0) - n0
        if lo >= n1 - n0:
            return None
        out = {**got.large, **{c.name: got.row[c.name] for c in row_columns(buf.options) if c.saved == ROW}, **extra}
        if got.packed is not None:
            out.update({n: np.ascontiguousarray(v) for n, v in buf.block.stored_record.views(got.packed).items()})
        if hole.any():  # a hole's bytes are zeros in every tensor (see the format)
            for a in out.values():
                a[hole] = 0
        out["_present"] = ~hole
        return Piece(run.lane, n0 + lo, {name: a[lo:] for name, a in out.items()})

    def unchanged(self, lane: int, n0: int, n1: int) -> bool:
        """Whether the rows ``[n0, n1)`` of ``lane`` (found committed by the scan; their slots do
        not wrap) still are and were not cleared: the reader's rule for rows copied straight from
        the columns since the scan (``persistence/checkpoint.py``)."""
        ring = self.buf.ring
        numbers = np.arange(n0, n1, dtype=np.int64)
        if not np.array_equal(ring.stamp[run_slots(lane, n0, n1, self.lc)], committed(numbers)):
            return False
        return not ring.cleared(row_id(numbers, lane, ring.lanes)).size

    def piece_rows(self, row_bytes: int) -> int:
        """Rows of a piece: ``CHUNK_BYTES`` over every lane's piece together."""
        return max(1, CHUNK_BYTES // max(1, row_bytes) // len(self.runs))


def restore(buf: Buffer, slots: slice, n0: int, present: np.ndarray) -> None:
    """Stamp the rows ``n0, n0 + 1, ...`` a load put into ``slots`` of a new buffer that no process
    writes to yet: committed where ``present``, empty (0) where the save has a hole. The lanes'
    bounds come after every row is in (``Ring.place``), so no reader sees a row before it counts."""
    stamps = committed(np.arange(n0, n0 + present.size, dtype=np.int64))
    stamps[~present] = 0
    columns(buf)["_stamp"][slots] = stamps


def restored(buf: Buffer, slots: np.ndarray) -> np.ndarray:
    """Which of ``slots`` of a loaded buffer hold a row (``restore`` stamped them committed)."""
    return columns(buf)["_stamp"][slots] != 0


def restore_counters(buf: Buffer, values: dict[Counter, int], removed: bool) -> None:
    """Set the shared counters a load restores (``values``) in a new buffer no process uses yet;
    ``removed``: rows were deleted or used up (``len`` then leaves them out, ``Counter.REMOVED``)."""
    counters = columns(buf)["_stats"]
    for at, value in values.items():
        counters[at] = value
    if removed:
        counters[Counter.REMOVED] = 1


def sampler_state(buf: Buffer) -> dict[str, np.ndarray]:
    """The sampler's per-row columns (``layout.SAMPLER``: the tree's leaves, the use counts) by name."""
    prios = buf.priorities  # None: the options have no such column
    arrays = {**buf.block.arrays, "_leaf": prios.tree.leaves} if prios is not None else {}  # the tree's leaves
    return {c.name: arrays[c.name] for c in row_columns(buf.options) if c.saved == SAMPLER}


@dataclass
class Moment:
    """``at_one_moment``'s answer: per span, which rows are there and which slots empty, their
    sampler state (``sampler_state``); the counters as they were."""

    there: list[np.ndarray]
    empty: list[np.ndarray]
    sampler: list[dict[str, np.ndarray]]
    counters: dict[str, Any]


def _lane_rows(a: np.ndarray, lane: int, n0: int, n1: int, lc: int) -> np.ndarray:
    """A copy of ``a`` at the slots of rows ``[n0, n1)`` of ``lane`` (one or two slices, ``pieces``: no index array)."""
    return np.concatenate([a[:0], *(a[sl] for _, _, sl in pieces(lane, n0, n1, lc))])


def at_one_moment(buf: Buffer, spans: list[tuple[int, int, int]]) -> Moment:
    """Under the ring's lock, for each ``(lane, n0, n1)`` of ``spans``: which of the rows
    ``[n0, n1)`` are still there (their stamps name them, committed or being updated), which slots
    are empty (stamp 0: deleted, reaped, abandoned), their leaves and use counts; and the counters
    (``edits`` and ``edits_begun`` of the log of edits, ``stats``, ``inserted``, ``sample_calls``,
    ``removed``, ``interleaved``, ``max_priority``, ``first``: each lane's first row, ``Ring.bounds``): a checkpoint's rows, leaves and log as of one
    moment (``persistence/checkpoint.py``). The lock is held for the copies only."""
    ring, prios, counters = buf.ring, buf.priorities, buf.block.counters
    lc = ring.lane_capacity
    out = Moment([], [], [], {})
    stamps, state = [], sampler_state(buf)
    with ring.lock:
        for lane, n0, n1 in spans:
            stamps.append(_lane_rows(ring.stamp, lane, n0, n1, lc))
            out.sampler.append({name: _lane_rows(a, lane, n0, n1, lc) for name, a in state.items()})
        out.counters = {
            "edits": int(counters[Counter.EDITS]), "edits_begun": int(counters[Counter.EDITS_BEGUN]),
            "stats": ring.stats, "inserted": ring.inserted, "sample_calls": int(counters[Counter.SAMPLE_CALLS]),
            "removed": int(counters[Counter.REMOVED]), "interleaved": int(counters[Counter.INTERLEAVED]),
            "max_priority": prios.max_priority if prios is not None else None, "first": ring.bounds()[0].copy(),
        }
    for (_, n0, n1), s in zip(spans, stamps, strict=True):
        numbers = np.arange(n0, n1, dtype=np.int64)
        out.there.append((s == committed(numbers)) | (s == writing(numbers)))
        out.empty.append(s == 0)
    return out
