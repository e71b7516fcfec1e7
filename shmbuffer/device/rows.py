"""The buffer's rows on the learner's device, and their refresh from shared memory.

``DeviceRows`` holds every field's column in device memory in the ring's slot layout
(``protocol/rows.py``; the packed small fields as one block, as the shared memory holds them), and
beside it, on the host, the stamp of the row each device slot holds (``held``; 0: nothing usable)
and the usable slots as a dense list (``dense``: its first ``len()`` entries, in no order;
``where``: each slot's place there, -1 when not usable; a slot leaving takes the last one's place,
so each change costs the slot it changes, never the capacity). A refresh (``sync()``) brings it up
to date:

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

The slot lists change only under the copy's lock (``lock``), which a sample holds while it draws
and gathers; the copies run outside it, into slots dropped first. So a sample waits for a refresh
only while it changes the lists (microseconds), never while it copies. Each change that drops
slots counts itself (``state[DROPS]``) and stores the count in their ``dropped`` before anything
is copied into them: by that the C uniform sample (``native/learner.c``'s ``device_sample``)
gathers outside the lock too, holding it only to draw, and draws again the rows whose slot was
dropped after its draw (``state[REDRAWN]``), so the refresh seldom waits for a sample either.

On the CPU with the C extension the whole refresh is one call without the GIL
(``native/refresh.c``: the lists in the arrays here, the lock a pthread mutex in ``lock``, a second
one letting one refresh run at a time), the rows copied straight into the device columns (and the
host mirrors of their kinds and episodes); the background refresher there is a C thread that never
takes the GIL (``native_refresher``). The Python steps below are the reference, the fallback, and
the CUDA path: each piece copied into reused pinned staging (``gather.gather_run``, one C call) and
then one copy to the device on a side stream; pending rows go through the stamped ``gather``.

On the CPU the columns and the slot lists live in private anonymous mappings of their own
(``host_zeros``): huge pages where the kernel allows, and zeros in a forked child rather than
pages shared copy-on-write, so that a fork (a worker started after the copy) does not make every
later write of the parent's refresh a page fault and a page copy (it made a refresh 5-8 times
slower, ``benchmarks/HISTORY.md``). The child's copy forgets its rows at the fork and copies them
all again at its first refresh.

Each refresh records in ``state`` when it began (``AT``, ``time.monotonic_ns()``) and ``INSERTED``
as it began (``lag()``), counts itself (``DONE``), and adds its time and rows to ``SPENT`` and
``TAKEN``; it publishes ``INSERTED`` and ``AT`` in the block (``Counter.DEVICE_ROWS``/
``DEVICE_AT``), which ``shmbuffer top`` shows as the copy's lag.

"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from typing import Any

import numpy as np

from .. import native
from ..batch import torch_dtype
from ..errors import CapacityError, ClosedError
from ..frames import KIND
from ..protocol.gather import gather, gather_run
from ..protocol.layout import EDIT_LOG, Counter, Lane
from ..protocol.reader import Source
from ..protocol.rows import committed, committed_of_id, lane_of, number_of, number_of_stamp, row_id

_UPDATES, _DELETES, _INSERTED = int(Counter.UPDATES), int(Counter.DELETES), int(Counter.INSERTED)
_EDITS, _EDITS_BEGUN = int(Counter.EDITS), int(Counter.EDITS_BEGUN)
_DEVICE_ROWS, _DEVICE_AT = int(Counter.DEVICE_ROWS), int(Counter.DEVICE_AT)
_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
COUNT, PENDING, UPDATES, DELETES, INSERTED, AT, DONE, ERROR, SPENT, TAKEN, WAITED, CPU, EDITS, REDRAWN, DROPS = range(15)
"""The words of ``DeviceRows.state`` (``native/refresh.c``'s ``ST_*``): usable slots, pending ids,
``Counter.UPDATES`` and ``DELETES`` as of the last refresh (the lag question's), ``Counter.INSERTED``
and ``time.monotonic_ns()`` as it began, refreshes done, 1 once the C refresher stopped on an
error, and all told the ns spent in refreshes, the rows they took in, and the ns of those spent
waiting for the lock while a sample held it, and the ns of CPU time the refreshing thread spent in
them (the last two: the C refresh); then ``Counter.EDITS`` as the last refresh began (-1: copy
every row again), the rows the C uniform sample drew again, all told (a refresh dropped their
slot while the sample copied them), and the changes of the lists that dropped slots, all told
(``dropped``)."""


STATE_WORDS = 16
"""The length of ``DeviceRows.state`` (``native.h``'s ``ST_WORDS``): room for a few more words."""

_MADV_WIPEONFORK = getattr(mmap, "MADV_WIPEONFORK", 18)  # Linux's number, where Python's mmap lacks the name
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def host_zeros(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros in a private anonymous mapping of their own, asked for huge pages (fewer TLB misses
    for a sample's random rows) and to be zeros in a forked child (``MADV_WIPEONFORK``) instead of
    shared copy-on-write: else, after every fork (a worker started after the copy), each page the
    refresh writes faults and is copied first, which made a refresh several times slower than its
    copies. A child's copy forgets its rows (``DeviceRows.forget_rows``) and copies them again. Where
    the kernel refuses either advice the mapping works without it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    for advice in (_MADV_HUGEPAGE, _MADV_WIPEONFORK):
        with contextlib.suppress(OSError):
            memory.madvise(advice)
    return np.frombuffer(memory, np.uint8, nbytes).view(dtype).reshape(shape)


def _torch() -> Any:
    import torch

    return torch


class NativeLock:
    """The lock of the slot lists that the C refresh takes without the GIL: a pthread mutex in a
    numpy array (``native/learner.c``); ``with``, ``acquire`` and ``release`` as a ``threading.Lock``."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.mutex = np.zeros(16, np.int64)
        """The mutexes' 128 bytes: this lock's, then the one that lets one refresh run at a time."""
        lib.mutex_init(self.mutex)

    def acquire(self) -> bool:
        """Take the lock (the GIL is released while another thread holds it)."""
        self.lib.mutex_lock(self.mutex)
        return True

    def release(self) -> None:
        """Release the lock."""
        self.lib.mutex_unlock(self.mutex)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class DeviceRows:
    """``buf``'s rows on ``device`` and their refresh (see the module docstring).

    :param buf: the buffer (any process's handle to it: writers elsewhere keep pushing).
    :param device: a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    :param chunk: rows per piece of a refresh (and of the staging memory on CUDA).
    """

    def __init__(self, buf: Source, device: Any, chunk: int) -> None:
        torch = _torch()
        self.buf = buf
        self.device = torch.device(device)
        block, ring = buf.block, buf.ring
        self.capacity, self.lanes, self.lane_capacity = ring.capacity, ring.lanes, ring.lane_capacity
        self.chunk = min(chunk, self.capacity)
        """Rows per piece of a refresh (the staging memory holds that many rows)."""
        self.record = block.record if block.packed is not None else None
        self.columns: dict[str, np.ndarray] = {}
        if block.packed is not None:  # copied and selected as its widest whole words: one copy per row
            width = block.packed.shape[1]
            word = next(w for w in (8, 4, 2, 1) if width % w == 0 and block.packed.ctypes.data % w == 0)
            self.columns["_record"] = block.packed.view(np.dtype(f"<i{word}") if word > 1 else np.uint8)
        self.columns.update(block.large)  # the packed small fields travel as one block, as in a gather
        if block.episode is not None:
            self.columns["_episode"] = block.episode
        need = sum(int(c.nbytes) for c in self.columns.values())
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if need > free:
                raise CapacityError(
                    f"DeviceReplay: buffer {buf.name!r} needs {need:,} bytes on {self.device}, which has {free:,} "
                    f"free of {total:,}: sample on the host (Loader(buf, ...), pinned) or use a smaller buffer")
        self.bytes = need
        """Device memory the copy takes."""
        cpu = self.device.type == "cpu"
        self.rows = {name: torch.from_numpy(host_zeros(col.shape, col.dtype)) if cpu else
                     torch.zeros(col.shape, dtype=torch_dtype(col.dtype), device=self.device)
                     for name, col in self.columns.items()}
        cap = self.capacity
        self.held = host_zeros(cap, np.int64)
        """The stamp of the row each device slot holds, 0 where it holds none usable (host memory)."""
        self.dropped = host_zeros(cap, np.int64)
        """Each slot's last drop, as ``state[DROPS]`` then: every change of the lists that drops
        slots counts itself there first, and stores the count here before anything is copied into
        them (the C uniform sample, which copies outside the lock, checks its rows by it)."""
        self.dense = host_zeros(cap, np.int64)
        """The usable slots: the first ``len()`` entries, in no order."""
        self.where = host_zeros(cap, np.int64)
        self.where[:] = -1
        """Each slot's place in ``dense``, -1 where it is not usable."""
        self.state = np.zeros(STATE_WORDS, np.int64)
        """The refresh's counts and times (``COUNT``, ``PENDING``, ``UPDATES``, ...: see ``COUNT``)."""
        self.state[EDITS] = -1  # the first refresh copies every row
        self.pending_ids = host_zeros(cap, np.int64)
        """Ids of rows a refresh found being written or torn: the first ``state[PENDING]``."""
        self.next = np.zeros(self.lanes, np.int64)
        """Per lane, the rows below were copied (or are pending)."""
        self.bases = np.full(self.lanes, -1, np.int64)
        """The lanes' bases as of the last refresh (a clear() moves them)."""
        self.kinds = host_zeros(cap if buf.options.rows.once else 0, np.uint8)
        """With frames: each held row's kind (``frames.KIND``), as copied with it (host memory)."""
        self.episodes = host_zeros(cap if block.episode is not None else 0, np.int64)
        """With episodes: each held row's episode id, as copied with it (host memory)."""
        lib = native.lib
        self._one_call: tuple[Any, ...] | None = None  # the C refresh's arguments but the piece
        self._draw_call: tuple[Any, ...] | None = None  # the C uniform sample's (replay.py)
        if cpu and lib is not None and all(c.flags.c_contiguous for c in self.columns.values()):
            mirrors: list[tuple[np.ndarray, np.ndarray]] = [(self.columns[KIND], self.kinds)] if self.kinds.size else []
            mirrors += [(self.columns["_episode"], self.episodes)] if self.episodes.size else []
            sources = (*self.columns.values(), *(m[0] for m in mirrors))
            outs = (*(dev.numpy() for dev in self.rows.values()), *(m[1] for m in mirrors))
            self.lock: Any = NativeLock(lib)
            self._one_call = (lib, (self.lock.mutex, block.stamp, ring.cursors, block.counters, block.edits, sources,
                                    outs, self.held, self.dropped, self.dense, self.where, self.next, self.bases,
                                    self.pending_ids, self.state))
            self._draw_call = (lib, self.lock.mutex, self.held, self.dropped, self.dense, self.state, outs[:len(self.rows)])
        else:
            self.lock = threading.Lock()
        """The slot lists' lock: a sample holds it while it draws and gathers (the C uniform sample
        only while it draws), a refresh while it changes the lists (never while it copies)."""
        self._staging = {} if cpu else {
            name: torch.empty((self.chunk, *col.shape[1:]), dtype=torch_dtype(col.dtype), pin_memory=True)
            for name, col in self.columns.items()}
        self._stream = None if cpu else torch.cuda.Stream(self.device)
        self._dense_dev = torch.from_numpy(self.dense) if cpu else torch.zeros(cap, dtype=torch.int64, device=self.device)
        self._held_dev = torch.from_numpy(self.held) if cpu else \
            torch.zeros(cap, dtype=torch.int64, device=self.device)  # what n-step windows read
        self._refreshing = threading.Lock()  # one refresh at a time; taken before lock, never inside it
        self.closed = False
        """Whether ``close()`` was called."""
        _host_copies.add(self)  # its lists are host_zeros memory whatever the device

    def forget_rows(self) -> None:
        """Hold no row: the next refresh copies every row again, with new locks. A forked child's
        copy does this at the fork (there its ``host_zeros`` memory reads as zeros, and a thread of
        the parent may have held its locks); the copy's own threads must not run meanwhile."""
        self.held[:] = 0
        self.where[:] = -1
        self.state[[COUNT, PENDING]] = 0
        self.state[EDITS] = -1
        self.bases[:] = -1
        self.next[:] = 0
        if isinstance(self.lock, NativeLock):
            self.lock.lib.mutex_init(self.lock.mutex)
        else:
            self.lock = threading.Lock()
        self._refreshing = threading.Lock()

    def __len__(self) -> int:
        """Rows the device copy can draw now."""
        return int(self.state[COUNT])

    @property
    def usable(self) -> np.ndarray:
        """Which device slots hold a row that may be drawn (a new array)."""
        return self.where >= 0

    @property
    def pending(self) -> np.ndarray:
        """Ids of rows a refresh found being written or torn (a copy): each refresh tries them again."""
        return self.pending_ids[:int(self.state[PENDING])].copy()

    @property
    def one_call(self) -> bool:
        """Whether a refresh is one C call without the GIL (on the CPU, with the C extension)."""
        return self._one_call is not None

    # -- refresh --------------------------------------------------------------------------------
    def sync(self) -> int:
        """Bring the device copy up to date now; returns the rows it took in (newly held)."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self, seen: int = -1) -> int:
        """One refresh (the module docstring); the caller holds ``_refreshing``. With ``seen`` (a
        ``state[DONE]`` the caller read) none, and -1 returned, when another refresh was done
        since (the C refresher's: the caller waited for it)."""
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        counters = self.buf.block.counters
        if self._one_call is not None:
            lib, args = self._one_call
            return int(lib.refresh(*args, self.chunk, counters.flags.writeable, seen))
        at = time.monotonic_ns()
        taken = self._refresh_steps()
        state = self.state
        state[AT], state[DONE], state[TAKEN] = at, state[DONE] + 1, state[TAKEN] + taken
        state[SPENT] += time.monotonic_ns() - at
        if counters.flags.writeable:  # where top reads the lag (Counter.DEVICE_ROWS)
            counters[_DEVICE_ROWS], counters[_DEVICE_AT] = state[INSERTED], at
        return taken

    def native_refresher(self, pace_s: float, rows_bound: float, seconds_bound: float) -> Any:
        """A background refresher thread in C that never takes the GIL (``native/refresh.c``):
        every ``pace_s`` it refreshes when more than ``rows_bound`` rows came in or the last
        refresh began more than ``seconds_bound`` ago (< 0: no such bound; both: whenever rows
        came in). ``None`` where a refresh is not one C call; else the extension and the thread's
        capsule, which ``lib.refresher_stop(capsule)`` ends."""
        if self._one_call is None:
            return None
        lib, args = self._one_call
        return lib, lib.refresher_start(*args, self.chunk, self.buf.block.counters.flags.writeable, pace_s,
                                        float(rows_bound), float(seconds_bound))

    def _refresh_steps(self) -> int:
        """The refresh in Python steps (``native/refresh.c`` does the same in one call)."""
        ring, counters, state = self.buf.ring, self.buf.block.counters, self.state
        inserted = int(counters[_INSERTED])  # before the lanes: the lag is never under-counted
        updates, deletes = int(counters[_UPDATES]), int(counters[_DELETES])  # for the lag question (replay.py)
        edits = int(counters[_EDITS])  # before the stamps: an edit logged later is seen after the copies
        cursors = ring.cursors[:, _CURSOR].copy()
        bases = ring.cursors[:, _BASE].copy()
        lc = self.lane_capacity
        start = np.minimum(np.maximum(bases, cursors - lc), cursors)
        seen = int(state[EDITS])
        full = seen < 0 or edits - seen > EDIT_LOG or not np.array_equal(bases, self.bases)
        if not full and edits != seen:
            full = not self._take_edits(seen, edits, start, cursors)
        taken, spoiled = 0, False
        if full:
            with self.lock:
                slots = np.flatnonzero(self.held)
                self._drop(slots[number_of_stamp(self.held[slots]) < start[slots // lc]])
                state[PENDING] = 0
        else:
            taken, spoiled = self._retry_pending(start, cursors, edits)
        first = start if full else np.maximum(self.next, start)
        for s0, n0, k in ([] if spoiled else self._runs(first, cursors)):
            slots = np.arange(s0, s0 + k)
            with self.lock:
                self._drop(slots)
            ok = self._copy_run(s0, n0, k)
            edited = self._edited(edits, slots)
            if edited is None:  # more edits during the copies than the log holds: every row next time
                spoiled = True
                break
            ok &= ~edited  # an edit's row is read again once it is done (the stamps cannot tell)
            with self.lock:
                self._hold(slots[ok], committed(np.arange(n0, n0 + k)[ok]))
                self._add_pending(row_id(np.arange(n0, n0 + k)[~ok], s0 // lc, self.lanes))
            taken += int(np.count_nonzero(ok))
        self.next[:], self.bases[:] = cursors, bases
        state[EDITS] = -1 if spoiled else edits  # the edits logged during the copies: next time
        state[UPDATES], state[DELETES], state[INSERTED] = updates, deletes, inserted
        return taken

    def _take_edits(self, seen: int, edits: int, start: np.ndarray, stop: np.ndarray) -> bool:
        """The rows changed in place since the last refresh (the log's entries ``seen`` to
        ``edits``): their slots dropped, and the row each slot holds now (committed or being
        written, within its lane's rows, and older than the rows this refresh copies anyway:
        never pending twice) pending, to be copied once committed. ``False`` when the log's
        entries were overwritten as they were read (the caller copies every row)."""
        block, ring, lanes, lc = self.buf.block, self.buf.ring, self.lanes, self.lane_capacity
        slots = block.edits[np.arange(seen, edits) % EDIT_LOG]
        if self._overwritten(seen) or not ((slots >= 0) & (slots < self.capacity)).all():
            return False
        self._forget_lapped(start, stop)
        slots = np.unique(slots)
        with self.lock:
            self._drop(slots)
        stamps, lane = ring.stamp[slots], slots // lc
        n = number_of_stamp(stamps)
        first = np.minimum(np.maximum(self.next, start), stop)  # the rows from there are copied below
        now = (stamps != 0) & (n >= start[lane]) & (n < first[lane])
        ids = row_id(n[now], lane[now], lanes)
        self._add_pending(ids[~np.isin(ids, self.pending)])
        return True

    def _edited(self, edits: int, slots: np.ndarray) -> np.ndarray | None:
        """Which of ``slots`` (just copied) an edit logged since ``edits`` names, or ``None``
        when more were logged than the log holds."""
        block = self.buf.block
        now = int(block.counters[_EDITS])
        if now == edits:
            return np.zeros(slots.shape, bool)
        logged = block.edits[np.arange(edits, now) % EDIT_LOG] if now - edits <= EDIT_LOG else None
        if logged is None or self._overwritten(edits):
            return None
        return np.isin(slots, logged)

    def _overwritten(self, first: int) -> bool:
        """Whether the log's entries from ``first`` may have been overwritten by now (read after
        them): a writer stores ``Counter.EDITS_BEGUN`` before its entries, ``EDITS`` after."""
        counters = self.buf.block.counters
        return max(int(counters[_EDITS_BEGUN]), int(counters[_EDITS])) - first > EDIT_LOG

    def _retry_pending(self, start: np.ndarray, stop: np.ndarray, edits: int) -> tuple[int, bool]:
        """The pending rows: those that left their lane forgotten, those now committed copied
        (dropped first), the others kept; the rows held, and whether more edits than the log
        holds came during the copy."""
        ring, lanes = self.buf.ring, self.lanes
        self._forget_lapped(start, stop)
        ids = self.pending
        ready = ring.stamp[ring.slots(ids)] == committed_of_id(ids, lanes)
        again, keep = ids[ready], ids[~ready]
        self.state[PENDING] = 0
        self._add_pending(keep)
        if not again.size:
            return 0, False
        with self.lock:
            self._drop(ring.slots(again))
        got = self._copy_rows(again)
        edited = self._edited(edits, ring.slots(again))
        if edited is None:
            return 0, True
        got &= ~edited
        with self.lock:
            self._hold(ring.slots(again[got]), committed_of_id(again[got], lanes))
            self._add_pending(again[~got])
        return int(np.count_nonzero(got)), False

    def _forget_lapped(self, start: np.ndarray, stop: np.ndarray) -> None:
        """The pending rows that left their lane are forgotten: lapped, or above its cursor (a
        push undone under them: the refresh that copies the lane from there copies them)."""
        ids, lanes = self.pending, self.lanes
        n, lane = number_of(ids, lanes), lane_of(ids, lanes)
        self.state[PENDING] = 0
        self._add_pending(ids[(n >= start[lane]) & (n < stop[lane])])

    def _add_pending(self, ids: np.ndarray) -> None:
        n = int(self.state[PENDING])
        self.pending_ids[n:n + ids.size] = ids
        self.state[PENDING] = n + ids.size

    def _runs(self, first: np.ndarray, stop: np.ndarray) -> list[tuple[int, int, int]]:
        """Each lane's rows ``[first, stop)`` as runs of consecutive slots (split where the lane
        wraps, and into pieces of ``chunk`` rows): ``(first slot, first row number, rows)``."""
        lc = self.lane_capacity
        out = []
        for lane in np.flatnonzero(stop > first):
            n, end = int(first[lane]), int(stop[lane])
            while n < end:
                at = n % lc
                k = min(end - n, lc - at, self.chunk)
                out.append((int(lane) * lc + at, n, k))
                n += k
        return out

    def _copy_run(self, slot0: int, n0: int, k: int) -> np.ndarray:
        """Copy rows ``n0 ..`` of the run from ``slot0`` (``k <= chunk``, slots dropped) by the
        reader's rule (``gather_run``): on the CPU straight into the device columns, on CUDA into
        the pinned staging, then one copy to the device; which rows were intact."""
        torch = _torch()
        stamp, cols = self.buf.block.stamp, tuple(self.columns.values())
        ok = np.zeros(k, bool)
        if self._stream is None:
            outs = tuple(dev[slot0:slot0 + k].numpy() for dev in self.rows.values())
            gather_run(stamp, cols, slot0, n0, outs, ok)
            self._mirror(slot0, dict(zip(self.rows, outs, strict=True)))
            return ok
        staged = {name: s[:k] for name, s in self._staging.items()}
        gather_run(stamp, cols, slot0, n0, tuple(s.numpy() for s in staged.values()), ok)
        self._mirror(slot0, {name: s.numpy() for name, s in staged.items()})
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier samples' gathers read first
        with torch.cuda.stream(self._stream):
            for name, dev in self.rows.items():
                dev[slot0:slot0 + k].copy_(staged[name], non_blocking=True)
        self._stream.synchronize()  # the staging is reused by the next piece
        return ok

    def _copy_rows(self, ids: np.ndarray) -> np.ndarray:
        """Copy the rows ``ids`` (pending rows now committed; slots dropped) by the stamped gather,
        through the staging, into their device slots; which were intact."""
        torch = _torch()
        ok = np.zeros(ids.size, bool)
        block, ring = self.buf.block, self.buf.ring
        for a in range(0, ids.size, self.chunk):
            part = ids[a:a + self.chunk]
            m = part.size
            staged = ({name: s[:m] for name, s in self._staging.items()} if self._staging else
                      {name: torch.empty((m, *dev.shape[1:]), dtype=dev.dtype) for name, dev in self.rows.items()})
            out = {name: staged[name].numpy() for name in block.large}
            if "_record" in staged:
                out["_block"] = staged["_record"].numpy().view(np.uint8)
            rows = gather(block, ring, part, out=out, stored=True)
            if rows.episode is not None:
                staged["_episode"].numpy()[:] = rows.episode
            ok[a:a + m] = rows.ok
            keep = np.flatnonzero(rows.ok)
            slots = ring.slots(part[keep])
            self._mirror(slots, {name: s.numpy()[keep] for name, s in staged.items()})
            where, pick = torch.from_numpy(slots).to(self.device), torch.from_numpy(keep)
            for name, dev in self.rows.items():
                dev.index_copy_(0, where, staged[name].index_select(0, pick).to(self.device))
        return ok

    def _mirror(self, slots: int | np.ndarray, copied: dict[str, np.ndarray]) -> None:
        """The host mirrors (kinds, episodes) of rows just copied into ``slots`` (a first slot or
        an array); they count once the rows are held."""
        for mirror, name in ((self.kinds, KIND), (self.episodes, "_episode")):
            if mirror.size:
                got = copied[name]
                at = slice(slots, slots + got.shape[0]) if isinstance(slots, int) else slots
                mirror[at] = got

    # -- the held and usable slots (under lock): each change costs the slots it touches -----------
    def _drop(self, slots: np.ndarray) -> None:
        """``slots`` (distinct) hold nothing usable: out of ``held`` and of the usable slots, whose
        last entries fill the places they leave; ``dropped`` says when."""
        self.held[slots] = 0
        self.state[DROPS] += 1
        self.dropped[slots] = self.state[DROPS]
        if self.device.type != "cpu":  # on the CPU it is a view of ``held``
            self._held_dev[_torch().from_numpy(slots).to(self.device)] = 0
        places = self.where[slots]
        slots, places = slots[places >= 0], places[places >= 0]
        if not slots.size:
            return
        old = int(self.state[COUNT])
        count = old - slots.size
        self.where[slots] = -1
        tail = self.dense[count:old]
        movers = tail[self.where[tail] >= 0]  # the tail's slots that stay: into the places left below count
        holes = places[places < count]
        self.dense[holes] = movers
        self.where[movers] = holes
        self.state[COUNT] = count
        if self.device.type != "cpu" and holes.size:
            torch = _torch()
            self._dense_dev[torch.from_numpy(holes).to(self.device)] = torch.from_numpy(movers).to(self.device)

    def _hold(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """``slots`` (distinct, not usable) hold the rows of ``stamps`` (committed): usable."""
        if not slots.size:
            return
        torch = _torch()
        self.held[slots] = stamps
        if self.device.type != "cpu":
            self._held_dev[torch.from_numpy(slots).to(self.device)] = torch.from_numpy(stamps).to(self.device)
        old = int(self.state[COUNT])
        count = old + slots.size
        self.dense[old:count] = slots
        self.where[slots] = np.arange(old, count)
        if self.device.type != "cpu":
            self._dense_dev[old:count].copy_(torch.from_numpy(slots))
        self.state[COUNT] = count

    def _ids_of(self, slots: Any) -> Any:
        """The ids of the rows the device copy holds in ``slots`` (a device tensor)."""
        n = number_of_stamp(self._held_dev.index_select(0, slots))
        return row_id(n, slots // self.lane_capacity, self.lanes)

    def _usable_slots(self) -> Any:
        """The usable slots as a device tensor, in no order (kept by each refresh)."""
        return self._dense_dev[:len(self)]

    def lag(self) -> tuple[int, float]:
        """How far the device copy is behind: rows inserted since the last refresh began, seconds since it began."""
        inserted = int(self.buf.block.counters[_INSERTED])
        return inserted - int(self.state[INSERTED]), (time.monotonic_ns() - int(self.state[AT])) / 1e9

    def _release_rows(self) -> None:
        """Drop the views of the shared columns and the device memory (under both locks)."""
        self.columns = {}
        self.rows = {}
        self._staging = {}
        self._one_call = self._draw_call = None
        self.state[COUNT] = 0
        self.where[:] = -1
        self.closed = True


_host_copies: weakref.WeakSet[DeviceRows] = weakref.WeakSet()
"""This process's copies (their lists, and on the CPU their rows, are ``host_zeros`` memory)."""


def _forget_in_child() -> None:
    for dev in list(_host_copies):
        if not dev.closed:
            dev.forget_rows()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
