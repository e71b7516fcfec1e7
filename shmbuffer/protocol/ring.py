"""The ring: slot reservation, per-row commit stamps, lanes, length and clearing.

This module owns the commit protocol and the internal columns it uses.

Rows, lanes, ids and stamps: their arithmetic is ``rows.py``'s, and this module uses it. The
readers' side of the ring (bounds, ids of slots and positions, checks of ids) is ``lanes.Lanes``,
which ``Ring`` extends.

Columns (the table is ``layout.py``'s)
-------------------------------------
``_mutex`` the ``RobustLock`` (``lock.py``); ``_lanes`` each lane's cursor and base
(``layout.Lane``); ``_stats`` shared counters (``layout.Counter``), all updated under the lock and
never wrapping; ``_writer_pid``, ``_writer_start`` the processes that have pushed or sampled (pid
and start time, so a reused pid is not mistaken for a live writer; 0 marks a free entry; an entry
is shared by every buffer object of its process and freed only once the process is dead, when the
table is full, never while it may still be writing); ``_sampled`` rows sampled outside the lock
(``count_sampled``) by the processes that held each writer entry, in turn: only the entry's live
process changes it (its threads one at a time), so counting a sample needs no lock, and a stopped
lock holder does not hold the learner up (a reclaimed entry keeps its count; rows sampled in all
are ``Counter.SAMPLED`` plus the sum of ``_sampled``); ``_stamp`` each slot's commit stamp;
``_owner`` the writer entry that last reserved each slot.

Commit protocol (a seqlock per row)
-----------------------------------
Stamp 0 means empty. A writer of row number ``n`` sets its slot's stamp to ``2n + 1`` (odd: being
written) and ``_owner`` to its entry *inside* the reservation's critical section, advances the
cursor, releases the lock, copies the data, then sets the stamp to ``2n + 2`` (even: committed).
A reader that wants row ``n`` reads the stamp, gathers the row, reads the stamp again, and keeps
the row only if both reads equal ``2n + 2``; otherwise it re-draws. So no reader ever keeps a torn,
half-written or overwritten row, whatever the writers do.

Lapping: on a small ring, or when a writer is descheduled mid-copy, another writer can come round
to a slot still being written. A reservation therefore never takes a slot whose stamp is odd while
its owner is alive: it releases the lock and waits (``WaitTimeout`` after ``stall_timeout``). If
the owner is dead (SIGKILL; a zombie counts as dead) the slot is reclaimed. ``reap()`` marks the
rows of dead writers empty, so nobody looks at them again.

Interrupts: nothing raises inside a critical section, nor between marking rows odd and the
caller's commit when it asks for that (``reserve(deferring=True)``): signal handlers wait
(``lock.py``), so a live process that survives its Ctrl-C leaves neither the lock held nor rows
odd. Every prefix of a critical section leaves a repairable state, because the lock is robust and a
holder may die anywhere: stamps are marked odd before the cursor moves (a dead holder leaves odd
slots of a dead owner, which the next reservation reclaims), and ``clear()`` moves the base before
the cursor (reservations start at ``max(cursor, base)``).

Failures: a push that raises between its reservation and its commit (``undo``) commits its rows
if they were copied whole; else, since the copy is all or nothing, it puts the ring back as it was
(the reservation keeps the slots' stamps and the lanes' cursors), while nobody has reserved or
cleared since; only otherwise are its rows left empty. A restore counts itself in
``Counter.UPDATES`` (the old stamp comes back, as after an ``update``), and puts the cursors back
before the stamps, so a holder that dies midway leaves odd rows above the cursor, reclaimed as any
dead writer's.

Memory ordering
---------------
The protocol needs a writer's data stores to become visible before its commit stamp, and a reader's
first stamp load to happen before its data loads and those before its second stamp load. With the
C extension (``native``) these are real atomics, in the orders ``native/module.c`` states. On the
Python path x86-64 guarantees both (stores are not reordered with stores, loads not with loads),
and each step is a separate numpy call, so no compiler reorders them. Weakly ordered CPUs (ARM, POWER) would need those fences on
every path, and the Python fallback (and the rest of the protocol's numpy stores: ``abandon``,
``reap``, ``clear``) has none, so ``check_platform`` still refuses them with a clear error.

The C path (``Copier``, ``_try_reserve``'s fast cases, ``commit``) keeps the lock-based
reservation: the C reservation marks slots only when none of them is odd, and leaves lapping,
dead writers, ``clear`` and the rate limiter to the code below, under the same lock.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np

from .. import native
from ..errors import (
    ReadOnlyError,
    ShmBufferError,
    UnsupportedPlatform,
    WaitTimeout,
)
from ..sampling.samplers import INVALID
from ..shm.lock import RobustLock, defer_signals
from ..shm.segment import process_alive, start_time
from . import rows
from .lanes import Lanes
from .layout import EDIT_LOG, LANE_WORDS, WRITERS, Counter, Lane

_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
_SAMPLED, _RECLAIMED, _RECOVERIES = int(Counter.SAMPLED), int(Counter.RECLAIMED), int(Counter.LOCK_RECOVERIES)
_REMOVED = int(Counter.REMOVED)
"""Set once a slot of the lanes' rows is left empty (a dead writer's, an abandoned push's): ``len`` and
``get``'s positions then leave such slots out, as deleted rows (``reader.held``)."""
_INSERTED, _FROZEN, _UPDATES = int(Counter.INSERTED), int(Counter.FROZEN), int(Counter.UPDATES)
_EDITS, _EDITS_BEGUN = int(Counter.EDITS), int(Counter.EDITS_BEGUN)
Gate = Callable[[int, int, int], bool]
"""``gate(inserted, sampled, size) -> allowed``: a rate limiter's test (``limiter.py``)."""
_X86 = {"x86_64", "amd64"}  # 64-bit only: a 32-bit CPU stores an int64 stamp in two halves
_counting = threading.Lock()  # this process's threads, one at a time on its ``_sampled`` entry


def _forked() -> None:
    global _counting
    _counting = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forked)


def check_platform() -> None:
    """Raise ``UnsupportedPlatform`` unless the CPU is x86-64 (the commit protocol relies on its memory ordering)."""
    machine = platform.machine().lower()
    if machine not in _X86:
        raise UnsupportedPlatform(
            f"shmbuffer's commit protocol relies on x86's store and load ordering; this CPU is "
            f"{machine!r}, which needs memory fences that Python cannot issue (see ring.py)"
        )


class Reservation:
    """Rows a writer holds between ``reserve`` and ``commit``: ``where`` indexes their slots (a
    slice when they are contiguous), ``n`` their row numbers, ``lane`` their lane(s). ``before``
    is what ``undo`` puts back: the slots' stamps, every lane's cursor and the insert count
    before the reservation, and every lane's cursor and base right after it. ``dirty``: bytes
    in the slots may differ from the rows they held (a copy that could not put them back)."""

    __slots__ = ("before", "dirty", "lane", "lanes", "n", "where")

    def __init__(self, where: slice | np.ndarray, n: np.ndarray, lane: int | np.ndarray, lanes: int,
                 before: tuple[np.ndarray, np.ndarray, int, np.ndarray]) -> None:
        self.where, self.n, self.lane, self.lanes, self.before = where, n, lane, lanes, before
        self.dirty = False

    @property
    def ids(self) -> np.ndarray:
        """The row ids reserved, one per row."""
        return rows.row_id(self.n, self.lane, self.lanes) if self.lanes > 1 else self.n

    @property
    def stamps(self) -> np.ndarray:
        """The stamps of these rows once committed."""
        return rows.committed(self.n)


class Ring(Lanes):
    """Reservation, commit and bookkeeping over a block's internal columns (the readers' side: ``Lanes``)."""

    stall_timeout = 30.0

    def __init__(self, arrays: dict[str, np.ndarray], *, initialise: bool = False) -> None:
        super().__init__(arrays)
        self._stats = arrays["_stats"]
        self._wpid = arrays["_writer_pid"]
        # memoryviews read and write single int64s several times faster than numpy indexing:
        # the hot path of a push (cursors, counters, the writer check) goes through them
        self._count = self._stats.data
        self._pids = self._wpid.data
        self._wstart = arrays["_writer_start"]
        self._sampled = arrays["_sampled"]
        self._mine = self._sampled.data
        self.owner = arrays["_owner"]
        self._edits = arrays["_edits"]
        stats = self._stats
        self.repairs: list[Callable[[], None]] = []
        repairs = self.repairs

        def recovered() -> None:  # called holding the lock, so the count is shared and exact
            stats[_RECOVERIES] += 1
            for repair in repairs:  # what a dead holder may have left half-updated
                repair()

        # a closure over the counters, not a bound method: no cycle keeps the mapping alive
        self.lock = RobustLock(arrays["_mutex"], initialise=initialise, on_recover=recovered)
        self._wid = -1
        self._wid_pid = -1
        self.cursors, self.stats_array, self.writers = self._lanes, self._stats, self._wpid
        """The columns of the lanes' cursors, the counters and the writer table (for ``Copier``'s plan)."""
        self.me = np.array([-1, -1], np.int64)
        """This process's ``[pid, writer entry]`` once ``writer_id`` registered it: the one-call
        push (``Copier``) reads it, and leaves a process it does not name (a forked child) to the
        Python steps, which register it."""

    # -- writers -------------------------------------------------------------------------------
    def writer_id(self) -> int:
        """This process's entry in the writer table, registered on first use."""
        pid = os.getpid()
        if self._wid_pid == pid and self._pids[self._wid] == pid:
            return self._wid
        started = start_time()
        with self.lock:
            mine = [int(w) for w in np.flatnonzero(self._wpid == pid) if abs(self._wstart[w] - started) < 0.01]
            if mine:
                w = mine[0]
            else:
                free = np.flatnonzero(self._wpid == 0)
                w = int(free[0]) if free.size else self._reclaim_writer()
                self._wstart[w] = started
                self._wpid[w] = pid
        self._wid, self._wid_pid = w, pid
        self.me[:] = (pid, w)
        return w

    def _reclaim_writer(self) -> int:
        for w in range(WRITERS):
            if not process_alive(int(self._wpid[w]), float(self._wstart[w])):
                lost = np.flatnonzero((self.owner == w) & rows.is_writing(self.stamp))
                if lost.size:
                    # their tree leaves were set inside the reservation: zero them as reap() does,
                    # or draws keep landing on empty slots (and a tree of nothing else never
                    # reads as empty); the repairs scan every slot, which this rare path can afford
                    self._lose(lost)
                    self._stats[_RECLAIMED] += lost.size
                    for repair in self.repairs:
                        repair()
                self._wpid[w] = 0
                return w
        raise ShmBufferError(f"{WRITERS} live processes have pushed to or sampled from this buffer; no writer entry is free")

    def _alive(self, w: int) -> bool:
        return (w == self._wid and self._wid_pid == os.getpid()) or process_alive(
            int(self._wpid[w]), float(self._wstart[w])
        )

    def reserve(
        self, k: int, lane: int | np.ndarray = 0, *, gate: Gate | None = None, timeout: float = 0.0,
        why: Callable[[], str] | None = None, also: Callable[[np.ndarray], None] | None = None,
        restore: Callable[[], None] | None = None, deferring: bool = False,
    ) -> Reservation:
        """Reserve ``k`` rows in ``lane`` (an int), or one row in each of ``lane`` (an array of
        ``k`` lane numbers), marking them odd; the caller copies, then calls ``commit``.

        ``gate(inserted, sampled, size)`` (a rate limiter) is checked inside the same critical
        section, so concurrent writers cannot overshoot it; while it says no, wait up to
        ``timeout``. ``also(slots)`` runs inside it once the rows are reserved (their priorities);
        if it raises, the reservation is undone (``undo``; ``restore()`` puts back what it changed).
        With ``deferring``, signal handlers still wait when it returns (``lock.defer_signals``):
        the caller commits or abandons, then calls ``lock.resume_signals()``, so no interrupt can
        come between the rows turning odd and their commit."""
        w = self.writer_id()
        stalled = gated = None
        pause = 0.0001
        while True:
            with self.lock:
                if self._count[_FROZEN]:
                    raise ReadOnlyError("this buffer is frozen (read-only): it takes no more rows")
                shut = gate is not None and not gate(self._count[_INSERTED], self.sampled, len(self))
                res = None if shut else self._try_reserve(k, lane, w)
                if res is not None and also is not None:
                    try:
                        also(self.slots(res.ids))
                    except BaseException:  # the rows must not stay odd under a live owner
                        self._undo(res, copied=False, restore=restore)
                        raise
                if res is not None and deferring:
                    defer_signals()  # once more: outlasts the lock, until the caller resumes
            if res is not None:
                return res
            now = time.monotonic()
            if shut:
                gated = gated or now + timeout
                if now > gated:
                    raise WaitTimeout(f"push of {k} rows waited {timeout:g} s for the rate limiter: {why() if why else ''}")
            else:
                stalled = stalled or now + self.stall_timeout
                if now > stalled:
                    raise WaitTimeout(
                        f"waited {self.stall_timeout:.0f} s for a writer that is still alive to finish "
                        "rows this push must overwrite (is it stopped? a larger capacity avoids lapping)"
                    )
            time.sleep(pause)
            pause = min(pause * 2, 0.002)

    def admit(self, gate: Gate, rows: int) -> bool:
        """Count ``rows`` as sampled if ``gate(inserted, sampled, size)`` allows it, atomically."""
        with self.lock:
            if not gate(int(self._stats[_INSERTED]), self.sampled, len(self)):
                return False
            self._stats[_SAMPLED] += rows
            return True

    def _try_reserve(self, k: int, lane: int | np.ndarray, w: int) -> Reservation | None:
        lc = self.lane_capacity
        cursors = self._lanes
        old = np.empty(k, np.int64)  # the slots' stamps before (undo)
        was = cursors[:, _CURSOR].copy(), int(self._count[_INSERTED])
        if isinstance(lane, np.ndarray):
            lib = native.lib
            if lib is not None and lane.dtype == np.int64 and lane.flags.c_contiguous:
                n, slots = np.empty(k, np.int64), np.empty(k, np.int64)
                # no slot odd: owners, odd stamps, then the cursors, in one C call
                if lib.reserve_lanes(cursors, self.stamp, self.owner, lane, w, n, slots, old):
                    self._count[_INSERTED] += k
                    return Reservation(slots, n, lane, self.lanes, (old, *was, cursors.copy()))
            counts = np.bincount(lane, minlength=self.lanes)
            order = np.argsort(lane, kind="stable")
            first = np.cumsum(counts) - counts
            rank = np.empty(k, np.int64)
            rank[order] = np.arange(k) - np.repeat(first, counts)
            n = np.maximum(cursors[:, _CURSOR], cursors[:, _BASE])[lane] + rank
            where: slice | np.ndarray = rows.slot(lane, n, lc)
        else:
            cur = self._cur
            n0 = max(cur[LANE_WORDS * lane + _CURSOR], cur[LANE_WORDS * lane + _BASE])
            n = np.arange(n0, n0 + k)
            s0 = n0 % lc
            lib = native.lib
            first = rows.slot(lane, n0, lc)
            if lib is not None and s0 + k <= lc and lib.reserve(self.stamp, self.owner, first, k, n0, w, old):
                # no slot odd: owners, then odd stamps, in one C call (the lapping rules below otherwise)
                cur[LANE_WORDS * lane + _CURSOR] = n0 + k
                self._count[_INSERTED] += k
                return Reservation(slice(first, first + k), n, lane, self.lanes,
                                   (old, *was, cursors.copy()))
            where = slice(first, first + k) if s0 + k <= lc else rows.slot(lane, n, lc)
        stamps = self.stamp[where]
        if rows.is_writing(stamps[0] if k == 1 else np.bitwise_or.reduce(stamps)):  # some slot's row is being written
            busy = rows.is_writing(stamps)
            held = np.unique(self.owner[where][busy])
            if any(self._alive(int(o)) for o in held):
                return None
            self._stats[_RECLAIMED] += int(busy.sum())
        old[:] = stamps
        self.owner[where] = w  # the owner first: an odd stamp always names its live or dead writer
        self.stamp[where] = rows.writing(n)  # then the stamps, then the cursors ("every prefix")
        if isinstance(lane, np.ndarray):
            cursors[:, _CURSOR] = np.maximum(cursors[:, _CURSOR], cursors[:, _BASE]) + counts
        else:
            self._cur[LANE_WORDS * lane + _CURSOR] = n0 + k
        self._count[_INSERTED] += k
        return Reservation(where, n, lane, self.lanes, (old, *was, cursors.copy()))

    def commit(self, res: Reservation) -> None:
        """Odd to even: the rows are committed (nobody else touches a live writer's odd stamps).
        With the extension each stamp is a release store, so the copies before it are visible
        first on any CPU."""
        lib = native.lib
        if lib is not None and self.stamp.flags.c_contiguous:
            w = res.where
            first, k = (w.start, w.stop - w.start) if isinstance(w, slice) else (w, w.shape[0])
            lib.put(first, k, self.stamp, (), (), None, (), True)
        else:
            self.stamp[res.where] += 1

    def undo(self, res: Reservation, *, copied: bool, restore: Callable[[], None] | None = None,
             lost: Callable[[np.ndarray], None] | None = None) -> None:
        """A push failed between ``reserve`` and ``commit``: never leave a hole where that can be
        helped. With every row ``copied`` the rows are whole: they are committed. Else (the copy
        is all or nothing: ``push.Copier.copy``) the rows the slots held are intact, and while nobody
        has reserved since (every lane's cursor where this reservation left it, its rows still
        odd) the ring is put back as it was: cursors, the slots' stamps (their rows readable
        again), the insert count, and ``restore()`` (the priorities ``also`` set); the undo counts
        itself as an update (``Counter.UPDATES``), so a reader whose copy spans it reads again.
        Only when another writer reserved or cleared since, a slot held a dead writer's odd row
        (reclaimed: there is nothing to put back), or a copy could not put its bytes back
        (``res.dirty``), are the rows given back as empty (``abandon``, with ``lost(slots)``): a
        hole, which readers report as a lost row."""
        with self.lock:
            self._undo(res, copied=copied, restore=restore, lost=lost)

    def _undo(self, res: Reservation, *, copied: bool, restore: Callable[[], None] | None,
              lost: Callable[[np.ndarray], None] | None = None) -> None:
        slots = self.slots(res.ids)
        mine = self.stamp[slots] == res.stamps - 1
        if copied:
            self.stamp[slots[mine]] = res.stamps[mine]
            return
        old, cursors, inserted, after = res.before
        # put back only while nobody reserved or cleared since, no byte differs from the rows the
        # slots held, and no slot held a dead writer's odd row (reclaimed: its owner is gone)
        if (mine.all() and np.array_equal(self._lanes, after) and not res.dirty
                and not rows.is_writing(old).any()):
            # a reader whose copy spans the reservation and this undo sees the same stamp before and
            # after: the count (and the log, for a device copy) makes it read again, as for update()
            self._stats[_UPDATES] += 1
            self.log_edits(slots)
            self._lanes[:, _CURSOR] = cursors  # the cursors first: see "every prefix" in the module docstring
            self.stamp[slots] = old
            self.log_edits(slots)  # after them: a refresh that read the first entry (odd rows) holds the old rows again
            self._stats[_INSERTED] = inserted
            if restore is not None:
                restore()
            return
        self._abandon(res, lost)

    def abandon(self, res: Reservation, also: Callable[[np.ndarray], None] | None = None) -> None:
        """Give rows back unwritten (the copy failed): they read as empty, never as committed.

        Only slots that still hold this reservation's odd stamps are touched, and ``also(slots)``
        (their priorities to 0) runs first, in the same critical section: nobody else can have
        taken them meanwhile, and nobody sees an empty slot with a live priority."""
        with self.lock:
            self._abandon(res, also)

    def _abandon(self, res: Reservation, also: Callable[[np.ndarray], None] | None) -> None:
        slots = self.slots(res.ids)
        self._lose(slots[self.stamp[slots] == res.stamps - 1], also)

    def _lose(self, slots: np.ndarray, also: Callable[[np.ndarray], None] | None = None) -> None:
        # rows lost (a dead writer's, an abandoned push's), under the lock: REMOVED first (len never
        # over-counts), then also(slots) (nobody sees an empty slot with a live priority), the stamps last
        if slots.size:
            self._stats[_REMOVED] = 1
            if also is not None:
                also(slots)
            self.stamp[slots] = 0

    # -- readers' bookkeeping ---------------------------------------------------------------------
    def reap(self, also: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Mark rows whose writer died mid-copy as empty; return their slots. ``also`` runs on
        them inside the same critical section."""
        odd = np.flatnonzero(rows.is_writing(self.stamp))
        if not odd.size:
            return odd
        dead = [int(o) for o in np.unique(self.owner[odd]) if not self._alive(int(o))]
        if not dead:
            return odd[:0]
        with self.lock:
            odd = np.flatnonzero(rows.is_writing(self.stamp))
            lost = odd[np.isin(self.owner[odd], dead)]
            self._lose(lost, also)
            self._stats[_RECLAIMED] += lost.size
        return lost

    def log_edits(self, slots: np.ndarray) -> None:
        """Log that the rows in ``slots`` change in place (an update, a delete, a push put back):
        ``Counter.EDITS_BEGUN`` first, then ``_edits`` gets the slots, then ``Counter.EDITS``
        counts them (x86-64 keeps the stores in order): a device copy re-reads those slots, or every
        row once ``EDIT_LOG`` were passed or overwritten as it read them. The caller holds the lock
        and logs once the stamps changed, before the bytes do (``Counter.EDITS``)."""
        n, k = int(self._stats[_EDITS]), int(slots.size)
        self._stats[_EDITS_BEGUN] = max(int(self._stats[_EDITS_BEGUN]), n + k)  # before the entries
        if k <= EDIT_LOG:
            self._edits[(n + np.arange(k)) % EDIT_LOG] = slots
        self._stats[_EDITS] = n + k

    def count_sampled(self, rows: int) -> None:
        """Count ``rows`` as sampled (negative: given back) in this process's ``_sampled``
        entry, without the lock (the module docstring)."""
        w = self.writer_id()
        with _counting:
            self._mine[w] += rows

    @property
    def frozen(self) -> bool:
        """Whether the buffer is read-only (``freeze``)."""
        return bool(self._count[_FROZEN])

    def freeze(self) -> None:
        """Make the buffer read-only for every process attached to it."""
        with self.lock:
            self._stats[_FROZEN] = 1

    @property
    def sampled(self) -> int:
        """Rows ever handed out by samples, all processes (never wraps)."""
        return int(self._stats[_SAMPLED]) + int(self._sampled.sum())

    # -- size ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        start, stop = self.bounds()
        return int((stop - start).sum())

    @property
    def inserted(self) -> int:
        """Rows ever reserved, all lanes, across clears (never wraps)."""
        return int(self._count[_INSERTED])

    @property
    def stats(self) -> dict[str, int]:
        """The counters: rows inserted, sampled, reclaimed, lock recoveries and the others, as
        ``ReplayBuffer.stats``."""
        return {
            "inserted": self.inserted,
            "sampled": self.sampled,
            "reclaimed": int(self._stats[_RECLAIMED]),
            "lock_recoveries": int(self._stats[_RECOVERIES]),
        }

    def clear(self, also: Callable[[], None] | None = None) -> None:
        """Forget every row. Row numbers keep growing (rounded up to a lane boundary so the next
        row lands in the lane's first slot); rows still being written stay invisible. ``also``
        runs inside the same critical section."""
        lc = self.lane_capacity
        with self.lock:
            if self._stats[_FROZEN]:
                raise ReadOnlyError("this buffer is frozen (read-only): it cannot be cleared")
            cur = np.maximum(self._lanes[:, _CURSOR], self._lanes[:, _BASE])
            new = -(-cur // lc) * lc
            self._lanes[:, _BASE] = new  # base first: see "every prefix" in the module docstring
            self._lanes[:, _CURSOR] = new
            if also is not None:
                also()

    def place(self, lane: int, base: int, cursor: int) -> None:
        """Set ``lane``'s base and cursor in a buffer no process writes to yet (a load, an import
        that keeps ids): under the lock, the base first and the cursor last, so the lane reads as
        empty until its rows count (the clear's order, "every prefix" in the module docstring)."""
        with self.lock:
            self._lanes[lane, _BASE] = base
            self._lanes[lane, _CURSOR] = cursor

    def write_free(self, slots: np.ndarray, column: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` into ``column`` at those of ``slots`` that hold no row and are not being
        written (SB3's arrays written where no row is, ``sb3/buffers.py``): under the lock, so no
        reservation takes such a slot while it is written."""
        with self.lock:
            idle = ~rows.is_writing(self.stamp[slots]) & (self.ids_of_slots(slots) == INVALID)
            column[slots[idle]] = values[idle]
