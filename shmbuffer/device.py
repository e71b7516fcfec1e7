"""A device-resident copy of a buffer, kept in step with its writers: the learner samples on its GPU.

``DeviceReplay(buf, device="cuda")`` holds every field's column in device memory in the ring's
slot layout (``protocol/rows.py``; the packed small fields as one block, as the shared
memory holds them, so a batch's small fields are views of one gathered block), and beside it, on the host, the stamp of the row each device
slot holds (``held``; 0: nothing usable). A refresh (``sync()``, the background refresher, or a
sample whose bound would break) brings it up to date:

1. the rows to copy are found from the lanes' cursors: each lane's rows since the last refresh
   (at most two runs of consecutive slots, the lane's end between them), and the ``pending``
   rows of earlier refreshes whose stamps now say committed. No slot is scanned: a refresh costs
   the rows that came in. A ``clear()``, an ``update()`` or a ``delete()`` since the last refresh
   (``Counter.UPDATES``/``DELETES``, the lanes' bases) makes it a full one: every row of the
   lanes copied again (an update puts back the stamp it found, so only a full copy sees it);
2. the slots of a run stop being drawn, then the run is copied by the reader's rule
   (``gather.gather_run``, one C call: stamps read, one copy a column, stamps read again), on the
   CPU straight into the device columns, on CUDA into reused pinned staging and then one copy to
   the device on a side stream; pending rows go through the stamped ``gather``. A row counts when
   both reads show it committed (``rows.intact``) and no update ran meanwhile; the others stay
   ``pending`` and are tried again by the next refresh until they leave their lane. So a torn,
   half-written or overwritten row is never marked usable on the device;
3. the rows that count become usable: ``held`` keeps their stamps, and the usable slots are a
   dense list changed per slot (a slot leaving takes the last one's place), so the uniform draw
   (``torch.randint`` over that list) and each refresh cost what changed, never the capacity.

A background thread (``refresher=True``, the default) looks at the lag every millisecond and
refreshes once it reaches half a bound; the copies run without the GIL (C, above 256 KiB), and a
sample takes the copy's lock only to draw and gather, so it waits for a refresh only while that
refresh marks slots. The thread is stopped by ``close()``, joined before every ``os.fork()`` (and
started again in the parent; a forked child's copy refreshes only when its samples need it) and at
exit; a copy nobody holds ends it too. Each refresh publishes ``INSERTED`` and the time it began in
the block (``Counter.DEVICE_ROWS``/``DEVICE_AT``), which ``shmbuffer top`` shows as the copy's lag.

Between refreshes the device copy lags the shared buffer: the rows committed since the last one
are not drawn yet, and a row overwritten, updated or deleted since (or during it) is still drawn
from the device copy (whole: the row as it was committed). ``max_lag_rows`` and ``max_lag_s``
bound that lag: a ``sample`` refreshes first (the rows behind only) when more rows were inserted
since the last refresh began than ``max_lag_rows``, or when rows came in and it began more than
``max_lag_s`` ago (``lag()`` measures both), or, under a row bound, when an ``update()`` ran. The
default is ``max_lag_s=0.01`` and no row bound: the refresher keeps the lag near 5 ms, which a
training loop cannot tell from none (measured in ``benchmarks/README.md``), and a sample waits only
when the refresher fell behind. ``max_lag_rows=0`` makes every sample see every row committed
before it (each sample then refreshes while writers push). A ``clear()`` always makes the next
sample refresh: a cleared row is never drawn.

``sample(n)`` asks the buffer's sampler what may draw in its place (``Sampler.served``): a
uniform sampler's rows are drawn on the device, uniformly over the usable slots
(``torch.randint``); any other sampler draws on the host, by its own ``draw`` (a prioritized one
from the shared sum tree, with ``ReplayBuffer.sample``'s importance weights; a user's sampler as
it draws), keeping the drawn rows the device holds as committed and drawing again for the others. ``update_priorities`` writes the shared tree, so every process sees it. A batch
has the fields, shapes and dtypes of ``ReplayBuffer.sample``'s, as tensors on the device, with
``index`` (ids), ``episode`` and ``weight`` as there.

With frames stored once (``next_of``/``stack``) the device copy holds the stored rows and a host
mirror of their kinds; a draw plans each transition on the host by ``frames.py``'s read rules
(``center``, ``stack_plan``: a window row counts when the copy holds that exact row) and rebuilds
it on the device (one gather of the planned frames, stacks assembled there); rows that are not
transitions (end, lead, a lane's newest with ``next_of``) are drawn again. ``len`` counts rows
held, not transitions.

``sample_sequences`` serves windows of one lane and episode (burn-in, mask, time major) from the
rows the copy holds, planned on the host from a mirror of their episode ids.

Not done on the device yet, and refused with the alternative named: n-step returns and sequences
over frames stored once, ``max_use``, a rate limiter; groups and whole episodes stay
``ReplayBuffer``'s. The device
must hold the copy: on CUDA the bytes needed are checked against ``torch.cuda.mem_get_info``
before anything is allocated.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .batch import Batch, torch_dtype, torch_views
from .errors import CapacityError, ClosedError, EmptyBufferError, FieldError, LayoutError
from .frames import KIND, Stack, stack_columns, stack_plan
from .frames import center as frames_center
from .protocol.gather import gather, gather_run
from .protocol.layout import Counter, Lane
from .protocol.reader import Source
from .protocol.rows import (
    committed,
    committed_of_id,
    lane_of,
    number_of,
    number_of_stamp,
    row_id,
    slot,
    slot_of_id,
    window,
)
from .sequences import check_n_step, check_windows, n_step_fields, window_mask

_UPDATES, _DELETES, _INSERTED = int(Counter.UPDATES), int(Counter.DELETES), int(Counter.INSERTED)
_DEVICE_ROWS, _DEVICE_AT = int(Counter.DEVICE_ROWS), int(Counter.DEVICE_AT)
_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
_ROUNDS = 8
"""Rounds of drawing again (prioritized) for rows the device copy does not hold, before a sync."""
DEFAULT_MAX_LAG_S = 0.01
"""``max_lag_s`` by default: a sample refreshes first when the last refresh began longer ago."""
DEFAULT_PACE_S = 0.001
"""Seconds the background refresher waits between looks at the lag."""
REFRESH_AT = 0.5
"""The background refresher refreshes once the lag reaches this share of a bound (of ``max_lag_s``:
a refresh every 5 ms at most by default, each copying the rows of those 5 ms in a few copies), so
that a sample seldom finds a bound broken; without bounds, whenever rows came in."""

_live: weakref.WeakSet[DeviceReplay] = weakref.WeakSet()
"""The device copies of this process whose refresher may run (stopped before a fork, at exit)."""


def _refresher(ref: weakref.ref[DeviceReplay], stop: threading.Event, failed: list[BaseException]) -> None:
    """The background refresher's loop; it holds its copy only while refreshing (a copy nobody
    holds is collected, and the loop ends). An error ends it and is raised by the next sample."""
    while not stop.wait(DEFAULT_PACE_S):
        dev = ref()
        if dev is None or dev.closed:
            return
        try:
            dev.refresh_if_behind(stop)
        except Exception as exc:  # handed to the learner's next sample
            failed.append(exc)
            return
        del dev


_paused: list[DeviceReplay] = []


def _pause_all() -> None:
    _paused[:] = [dev for dev in list(_live) if dev.refreshing]
    for dev in _paused:
        dev.stop_refresher()


def _resume_all() -> None:
    for dev in _paused:
        dev.start_refresher()
    _paused.clear()


def _forget_all() -> None:
    _paused.clear()  # a forked child has no refresher: its samples refresh by the bounds
    _live.clear()


def _close_all() -> None:
    for dev in list(_live):
        dev.stop_refresher()


if hasattr(os, "register_at_fork"):
    # joined before every fork, so that a process forks without a thread of ours (Python 3.12
    # warns about forking with threads); the parent's start again, the child's do not
    os.register_at_fork(before=_pause_all, after_in_parent=_resume_all, after_in_child=_forget_all)
atexit.register(_close_all)  # before the buffers' finalizers (registered earlier, run later)


def _assemble(s: Stack, got: Any) -> Any:
    """Stacks from frames ``(m, k, *frame)`` in the field's layout (``frames.assemble``, in torch)."""
    m = got.shape[0]
    if s.axis == 0:
        return got.reshape(m, s.k * s.width, *got.shape[3:])
    moved = got.movedim(1, 1 + s.axis)  # (m, ..., k, width, ...)
    shape = moved.shape
    return moved.reshape(*shape[:1 + s.axis], s.k * s.width, *shape[3 + s.axis:])


def _torch() -> Any:
    import torch

    return torch


class DeviceReplay:
    """A copy of ``buf``'s rows on ``device``, refreshed from shared memory (see the module docstring).

    :param buf: the buffer (any process's handle to it: writers elsewhere keep pushing).
    :param device: a torch device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    :param max_lag_rows: a sample refreshes first when more rows than this were inserted since the
        last refresh began (``None``: no bound by rows; ``0``: every sample sees every row
        committed before it).
    :param max_lag_s: a sample refreshes first when the last refresh began longer ago than this
        (``None``: no bound by time). The default, 10 ms, is a few training steps: with the
        background refresher the lag stays near its pace (1 ms) and a sample waits only when
        the refresher falls behind (a loaded machine). With both bounds ``None`` only the
        refresher and ``sync()`` refresh.
    :param chunk: rows per staging copy.
    :param seed: the device generator's seed (uniform draws).
    :param refresher: refresh in a background thread (``DEFAULT_PACE_S`` apart), stopped by
        ``close()``, before a fork (started again in the parent, not in the child) and at exit.
    """

    def __init__(self, buf: Source, device: Any = "cuda", *, max_lag_rows: int | None = None,
                 max_lag_s: float | None = DEFAULT_MAX_LAG_S, chunk: int = 16384, seed: int | None = None,
                 refresher: bool = True) -> None:
        torch = _torch()
        opts = buf.options
        refused = [what for what, on in (("max_use", opts.max_use is not None),
                                        ("a rate limiter", opts.limiter is not None)) if on]
        if refused:
            raise LayoutError(f"DeviceReplay: buffer {buf.name!r} has {', '.join(refused)}, which the device copy "
                              "does not do yet: sample with buf.sample(...) or a Loader(buf, ...)")
        for name, value in (("max_lag_rows", max_lag_rows), ("chunk", chunk)):
            if value is not None and (type(value) is not int or value < (1 if name == "chunk" else 0)):
                raise ValueError(f"DeviceReplay: {name} must be an int >= {1 if name == 'chunk' else 0}, got {value!r}")
        if max_lag_s is not None and not max_lag_s >= 0:
            raise ValueError(f"DeviceReplay: max_lag_s must be a number >= 0, got {max_lag_s!r}")
        self.buf = buf
        self.device = torch.device(device)
        self.max_lag_rows, self.max_lag_s = max_lag_rows, max_lag_s
        block, ring = buf.block, buf.ring
        self.capacity, self.lanes, self.lane_capacity = ring.capacity, ring.lanes, ring.lane_capacity
        self.chunk = min(chunk, self.capacity)
        """Rows per staging copy (the staging memory holds that many rows)."""
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
        self.rows = {name: torch.zeros(col.shape, dtype=torch_dtype(col.dtype), device=self.device)
                     for name, col in self.columns.items()}
        pin = self.device.type == "cuda"
        self._staging = {name: torch.empty((self.chunk, *col.shape[1:]), dtype=torch_dtype(col.dtype), pin_memory=pin)
                         for name, col in self.columns.items()}
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self.held = np.zeros(self.capacity, np.int64)
        """The stamp of the row each device slot holds, 0 where it holds none usable (host memory)."""
        self.spec = opts.frames
        """The buffer's frames stored once (``next_of``/``stack``), or ``None``."""
        self.kinds = np.zeros(self.capacity if self.spec is not None else 0, np.uint8)
        """With frames: each held row's kind (``frames.KIND``), as copied with it (host memory)."""
        self.episodes = np.zeros(self.capacity if block.episode is not None else 0, np.int64)
        """With episodes: each held row's episode id, as copied with it (host memory)."""
        self.pending = np.zeros(0, np.int64)
        """Ids of rows a refresh found being written or torn (or overwritten while it copied): each
        refresh tries them again (their stamps first), until they are held or leave the lanes."""
        self.usable = np.zeros(self.capacity, bool)
        """Which device slots hold a row that may be drawn (``held`` and inside its lane's bounds)."""
        self._count = 0  # usable slots: the first _count of _dense, in no order
        self._dense = np.zeros(self.capacity, np.int64)
        self._where = np.full(self.capacity, -1, np.int64)  # each slot's place in _dense, -1: not usable
        self._dense_dev = torch.from_numpy(self._dense) if self.device.type == "cpu" else \
            torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self._held_dev = torch.from_numpy(self.held) if self.device.type == "cpu" else \
            torch.zeros(self.capacity, dtype=torch.int64, device=self.device)  # what n-step windows read
        self._updates = self._deletes = -1  # the first refresh copies every row
        self._inserted = 0
        self._bases = np.zeros(self.lanes, np.int64)
        self._next = np.zeros(self.lanes, np.int64)  # per lane, the rows below were copied (or are pending)
        self._synced_at = 0.0
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
        self._refreshing = threading.Lock()  # one refresh at a time; taken before _lock, never inside it
        self._lock = threading.Lock()  # the held and usable slots, the device rows drawn: samples and refreshes
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failures: list[BaseException] = []  # the refresher's error, raised by the next sample
        self.closed = False
        """Whether ``close()`` was called."""
        self.sync()
        if refresher:
            self.start_refresher()

    # -- refresh --------------------------------------------------------------------------------
    def sync(self) -> int:
        """Bring the device copy up to date now; returns the rows it took in (newly held)."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> int:
        """One refresh (the module docstring); the caller holds ``_refreshing``."""
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        ring, counters = self.buf.ring, self.buf.block.counters
        inserted = int(counters[_INSERTED])  # before the lanes: the lag is never under-counted
        at = time.monotonic_ns()
        updates, deletes = int(counters[_UPDATES]), int(counters[_DELETES])
        cursors = ring.cursors[:, _CURSOR].copy()
        bases = ring.cursors[:, _BASE].copy()
        lanes, lc = self.lanes, self.lane_capacity
        start = np.minimum(np.maximum(bases, cursors - lc), cursors)
        full = updates != self._updates or deletes != self._deletes or not np.array_equal(bases, self._bases)
        with self._lock:
            if full:  # a clear, an update or a delete: no row held counts, every row is copied again
                self._forget()
                self._next = start.copy()
                self.pending = self.pending[:0]
            runs = self._runs(np.maximum(self._next, start), cursors)
            slots = np.concatenate([np.arange(s0, s0 + k) for s0, _, k in runs]) if runs else self.pending[:0]
            self._drop(slots)  # rows lapped: their slots are not drawn while they are copied into
            retry = self.pending
            if retry.size:
                retry = retry[number_of(retry, lanes) >= start[lane_of(retry, lanes)]]
        ok = np.concatenate([self._copy_run(s0, n0, k) for s0, n0, k in runs]) if runs else np.zeros(0, bool)
        numbers = np.concatenate([np.arange(n0, n0 + k) for _, n0, k in runs]) if runs else slots
        again = retry
        if retry.size:
            ready = ring.stamp[ring.slots(retry)] == committed_of_id(retry, lanes)
            again, retry = retry[ready], retry[~ready]
        got = self._copy_rows(again) if again.size else np.zeros(0, bool)
        with self._lock:
            bad = ~ok
            self.pending = np.concatenate([row_id(numbers[bad], slots[bad] // lc, lanes), again[~got], retry])
            copied = 0
            if int(counters[_UPDATES]) != updates:  # an update spanned the copies (no ABA): all again next time
                self._updates = -1
            else:
                self._updates, self._deletes = updates, deletes
                self._hold(slots[ok], committed(numbers[ok]))
                if again.size:
                    self._hold(ring.slots(again[got]), committed_of_id(again[got], lanes))
                copied = int(np.count_nonzero(ok)) + int(np.count_nonzero(got))
            self._next = cursors
            self._bases = bases
            self._inserted, self._synced_at = inserted, at / 1e9
        if counters.flags.writeable:  # where top reads the lag (Counter.DEVICE_ROWS)
            counters[_DEVICE_ROWS], counters[_DEVICE_AT] = inserted, at
        return copied

    def _runs(self, first: np.ndarray, stop: np.ndarray) -> list[tuple[int, int, int]]:
        """Each lane's rows ``[first, stop)`` as runs of consecutive slots (two where the lane
        wraps): ``(first slot, first row number, rows)``."""
        lc = self.lane_capacity
        out = []
        for lane in np.flatnonzero(stop > first):
            n, end = int(first[lane]), int(stop[lane])
            while n < end:
                at = n % lc
                k = min(end - n, lc - at)
                out.append((int(lane) * lc + at, n, k))
                n += k
        return out

    def _copy_run(self, slot0: int, n0: int, k: int) -> np.ndarray:
        """Copy rows ``n0 ..`` of the run from ``slot0`` by the reader's rule (``gather_run``):
        on the CPU straight into the device columns, on CUDA into the pinned staging, a chunk at
        a time, then one copy to the device; which rows were intact. Their slots are not drawn
        meanwhile (``_drop``)."""
        torch = _torch()
        stamp, cols = self.buf.block.stamp, tuple(self.columns.values())
        ok = np.zeros(k, bool)
        if self._stream is None:
            outs = tuple(dev[slot0:slot0 + k].numpy() for dev in self.rows.values())
            gather_run(stamp, cols, slot0, n0, outs, ok)
            self._mirror(slot0, dict(zip(self.rows, outs, strict=True)))
            return ok
        for a in range(0, k, self.chunk):
            m = min(self.chunk, k - a)
            staged = {name: s[:m] for name, s in self._staging.items()}
            gather_run(stamp, cols, slot0 + a, n0 + a, tuple(s.numpy() for s in staged.values()), ok[a:a + m])
            self._mirror(slot0 + a, {name: s.numpy() for name, s in staged.items()})
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier samples' gathers read first
            with torch.cuda.stream(self._stream):
                for name, dev in self.rows.items():
                    dev[slot0 + a:slot0 + a + m].copy_(staged[name], non_blocking=True)
            self._stream.synchronize()  # the staging is reused by the next chunk
        return ok

    def _copy_rows(self, ids: np.ndarray) -> np.ndarray:
        """Copy the rows ``ids`` (pending rows now committed; not drawn) by the stamped gather,
        through the staging, into their device slots; which were intact."""
        torch = _torch()
        ok = np.zeros(ids.size, bool)
        block, ring = self.buf.block, self.buf.ring
        for a in range(0, ids.size, self.chunk):
            part = ids[a:a + self.chunk]
            m = part.size
            staged = {name: s[:m] for name, s in self._staging.items()}
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

    # -- the held and usable slots (under _lock): each change costs the slots it touches ----------
    def _forget(self) -> None:
        """No slot held or usable (a full refresh follows)."""
        self.held[:] = 0
        if self.device.type != "cpu":  # on the CPU it is a view of ``held``
            self._held_dev.zero_()
        self.usable[:] = False
        self._where[:] = -1
        self._count = 0

    def _drop(self, slots: np.ndarray) -> None:
        """``slots`` (distinct) hold nothing usable: out of ``held`` and of the usable slots, whose
        last entries fill the places they leave."""
        self.held[slots] = 0
        if self.device.type != "cpu":
            self._held_dev[_torch().from_numpy(slots).to(self.device)] = 0
        places = self._where[slots]
        slots, places = slots[places >= 0], places[places >= 0]
        if not slots.size:
            return
        count = self._count - slots.size
        self._where[slots] = -1
        self.usable[slots] = False
        tail = self._dense[count:self._count]
        movers = tail[self._where[tail] >= 0]  # the tail's slots that stay: into the places left below count
        holes = places[places < count]
        self._dense[holes] = movers
        self._where[movers] = holes
        self._count = count
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
        count = self._count + slots.size
        self._dense[self._count:count] = slots
        self._where[slots] = np.arange(self._count, count)
        self.usable[slots] = True
        if self.device.type != "cpu":
            self._dense_dev[self._count:count].copy_(torch.from_numpy(slots))
        self._count = count

    def _ids_of(self, slots: Any) -> Any:
        """The ids of the rows the device copy holds in ``slots`` (a device tensor)."""
        n = number_of_stamp(self._held_dev.index_select(0, slots))
        return row_id(n, slots // self.lane_capacity, self.lanes)

    # -- the background refresher ---------------------------------------------------------------
    def refresh_if_behind(self, stop: threading.Event | None = None) -> bool:
        """Refresh now if the copy is half a bound behind (``REFRESH_AT``; without bounds, if
        anything changed): what the background refresher does every ``DEFAULT_PACE_S``. Returns
        whether it refreshed (not once ``stop`` is set or the copy closed)."""
        if not self._behind(REFRESH_AT):
            return False
        with self._refreshing:
            if (stop is not None and stop.is_set()) or self.closed:
                return False
            self._refresh()
        return True

    def start_refresher(self) -> None:
        """Start the background refresher (``refresher=True`` does at construction; a fork starts
        the parent's again). Nothing happens when it runs or the copy is closed."""
        if self.closed or self._thread is not None:
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_refresher, args=(weakref.ref(self), self._stop, self._failures),
                                        name="shmbuffer-refresher", daemon=True)
        self._thread.start()
        _live.add(self)

    def stop_refresher(self) -> None:
        """End the background refresher (joined: a refresh under way ends first); samples then
        refresh by the bounds alone. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    @property
    def refreshing(self) -> bool:
        """Whether the background refresher runs now."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop the refresher and drop the views of the shared columns (so that ``buf.close()`` can
        unmap them) and the device memory. Idempotent; the copy cannot sync or sample afterwards."""
        self.stop_refresher()
        _live.discard(self)
        with self._refreshing, self._lock:
            if self.closed:
                return
            self.columns = {}
            self.rows = {}
            self._staging = {}
            self._count = 0
            self.usable[:] = False
            self.closed = True
            counters = self.buf.block.counters
            if counters.flags.writeable and int(counters[_DEVICE_ROWS]) == self._inserted:
                counters[_DEVICE_AT] = 0  # top: no device copy now (unless another refreshed since)

    def __enter__(self) -> DeviceReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lag(self) -> tuple[int, float]:
        """How far the device copy is behind: rows inserted since the last refresh began, seconds since it began."""
        inserted = int(self.buf.block.counters[_INSERTED])
        return inserted - self._inserted, time.monotonic() - self._synced_at

    def _behind(self, share: float) -> bool:
        """Whether the copy is more than ``share`` of a bound behind: rows came in (or rows were
        updated or deleted) and the last refresh began longer ago than ``share * max_lag_s``, or
        more than ``share * max_lag_rows`` rows came in, or (under a row bound) an ``update()``
        ran; or a ``clear()`` happened since. Without bounds (``share < 1``: the refresher's
        question) whenever something changed."""
        counters = self.buf.block.counters
        if not np.array_equal(self.buf.ring.cursors[:, _BASE], self._bases):
            return True
        rows, seconds = self.lag()
        edited = int(counters[_UPDATES]) != self._updates or int(counters[_DELETES]) != self._deletes
        rows_bound, seconds_bound = self.max_lag_rows, self.max_lag_s
        if rows_bound is not None and (rows > share * rows_bound or int(counters[_UPDATES]) != self._updates):
            return True
        changed = rows > 0 or edited
        if changed and seconds_bound is not None and seconds > share * seconds_bound:
            return True
        return changed and rows_bound is None and seconds_bound is None and share < 1

    def _maybe_sync(self) -> None:
        """Refresh before a sample where a bound would break (the rows then are those behind)."""
        if self._failures:
            raise self._failures.pop()
        if self._behind(1.0):
            self.sync()

    def __len__(self) -> int:
        """Rows the device copy can draw now."""
        return self._count

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, n: int, *, n_step: int = 1, gamma: float = 0.99, fields: dict[str, str] | None = None) -> Batch:
        """``n`` rows drawn on the device (with replacement), as ``ReplayBuffer.sample`` draws them;
        ``n_step > 1`` turns them into n-step transitions on the device, as ``ReplayBuffer.sample``
        does (``sequences.add_n_step``: the following rows of the row's lane and episode that the
        device copy holds as committed; ``batch.steps``)."""
        if (type(n) is not int and (not isinstance(n, np.integer) or isinstance(n, bool))) or n <= 0:
            raise ValueError(f"sample: expected a positive number of rows, got {n!r}")
        if n_step != 1:
            if not isinstance(n_step, (int, np.integer)) or isinstance(n_step, bool) or n_step < 1:
                raise ValueError(f"sample: n_step must be an int >= 1, got {n_step!r}")
            if not 0 <= gamma <= 1:
                raise ValueError(f"sample: gamma must be in [0, 1], got {gamma!r}")
            check_n_step(self.buf, int(n_step), fields)
            if self.spec is not None:
                raise FieldError(f"sample(n_step={n_step}): the device copy does not rebuild n-step returns over "
                                 "frames stored once (next_of/stack) yet: buf.sample(n, n_step=...) does")
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        self._maybe_sync()
        served = self.buf.options.sampler.served  # what the sampler lets the device draw in its place
        with self._lock:
            if self.closed:
                raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
            if served == "uniform":
                batch = self._uniform(int(n))
            else:  # the tree's draw, or a sampler's own: drawn on the host, read from the device copy
                batch = self._host_drawn(int(n))
            if n_step > 1:
                self._n_step(batch, int(n_step), float(gamma), fields)
        self.buf.ring.count_sampled(int(n))
        return batch

    def _uniform(self, n: int) -> Batch:
        torch = _torch()
        if self.spec is not None:
            return self._uniform_transitions(n)
        m = self._count
        if m == 0:
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {self.buf.name!r} holds no rows yet "
                                   "(push, then sync() or sample again)")
        pick = torch.randint(m, (n,), device=self.device, generator=self._gen)
        if m < self.capacity:  # else every slot is usable: the draw is the slot
            pick = self._usable_slots().index_select(0, pick)
        return self._batch(pick, self._ids_of(pick), None)

    def _host_drawn(self, n: int) -> Batch:
        """``n`` rows the buffer's sampler draws on the host (from the shared tree, or its own
        ``draw``), those the device copy does not hold drawn again; its weights, if any."""
        torch = _torch()
        buf = self.buf
        prios = buf.priorities
        sampler, ring = buf.options.sampler, buf.ring
        tree = prios.tree if prios is not None else None
        calls = prios.next_call() if prios is not None else 0
        ids = np.empty(n, np.int64)
        leaves = np.empty(n, np.float64)
        todo = np.arange(n)
        for round_ in range(2 * _ROUNDS):
            if round_ == _ROUNDS:
                buf.reap()  # a dead writer's odd rows keep the leaves they took until reaped
                self._lock.release()  # a refresh takes _refreshing first (the refresher's order)
                try:
                    self.sync()  # rows drawn from the tree that the device copy does not hold yet
                finally:
                    self._lock.acquire()
                done = np.setdiff1d(np.arange(n), todo)  # the sync may have copied newer rows over them
                stale = done[self.held[ring.slots(ids[done])] != committed_of_id(ids[done], self.lanes)]
                todo = np.union1d(todo, stale)
            d = sampler.draw(ring, tree, buf.rng, todo.size, again=round_ > 0)
            got = d.ids
            if got.shape[0] != todo.size:
                break
            ok = got >= 0
            slots = ring.slots(np.where(ok, got, 0))
            ok &= self.held[slots] == committed_of_id(np.where(ok, got, 0), self.lanes)
            if self.spec is not None:
                ok &= self._transitions(np.where(ok, got, 0))[0]
            ids[todo[ok]] = got[ok]
            if d.leaves is not None:
                leaves[todo[ok]] = d.leaves[ok]
            todo = todo[~ok]
            if todo.size == 0:
                break
        if todo.size:
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {buf.name!r} holds none of the rows the "
                                   "sampler draws (nothing pushed yet, or every row being written)")
        weights = sampler.weights(tree, leaves, calls) if sampler.weighted else None
        w = None if weights is None else torch.from_numpy(np.ascontiguousarray(weights)).to(self.device)
        if self.spec is not None:
            return self._frames_batch(ids, w)
        slots_dev = torch.from_numpy(ring.slots(ids)).to(self.device)
        return self._batch(slots_dev, torch.from_numpy(ids).to(self.device), w)

    def _batch(self, slots: Any, ids: Any, weight: Any) -> Batch:
        got = {name: dev.index_select(0, slots) for name, dev in self.rows.items()}
        packed = got.pop("_record", None)
        if packed is not None:
            packed = packed.view(_torch().uint8)
        small = torch_views(packed, self.record) if packed is not None and self.record is not None else {}
        extras: dict[str, Any] = {"index": ids}
        if "_episode" in got:
            extras["episode"] = got.pop("_episode")
        if weight is not None:
            extras["weight"] = weight
        fields = {name: got[name] if name in got else small[name] for name in self.buf.block.schema.names}
        return Batch(fields, extras, block=packed, record=self.record)

    def _n_step(self, batch: Batch, n_step: int, gamma: float, names: dict[str, str] | None) -> None:
        """``sequences.add_n_step`` on the device, in place: a following row counts while the
        device copy holds it committed (``held``) in the row's lane and episode."""
        torch = _torch()
        reward, next_obs, done = n_step_fields(self.buf, names)
        cols = self._full_columns(torch)
        ids = batch.index
        m, lanes, lc = ids.shape[0], self.lanes, self.lane_capacity
        nums = (ids // lanes)[:, None] + torch.arange(1, n_step, device=self.device)[None, :]
        lane = (ids % lanes)[:, None]
        slots = slot(lane, nums, lc)
        ok = (self._held_dev[slots] == committed(nums)) & (cols["_episode"][slots] == batch.episode[:, None])
        mask = torch.cat([torch.ones((m, 1), dtype=torch.bool, device=self.device), ok], 1).cumprod(1).bool()
        rewards = torch.cat([batch.fields[reward].reshape(m, 1), cols[reward][slots]], 1).double()
        dones = torch.cat([batch.fields[done].reshape(m, 1), cols[done][slots]], 1).bool()
        after = torch.zeros_like(mask)
        after[:, 1:] = dones[:, :-1].cummax(1).values
        used = mask & ~after
        steps = used.sum(1)
        ret = (torch.where(used, rewards, 0.0) * gamma ** torch.arange(n_step, device=self.device,
                                                                       dtype=torch.float64)).sum(1)
        last = (steps - 1).clamp(min=0)
        more = steps > 1
        at = slots[torch.arange(m, device=self.device), (steps - 2).clamp(min=0)]
        following = torch.where(more.reshape(m, *[1] * (batch.fields[next_obs].dim() - 1)), cols[next_obs][at],
                                batch.fields[next_obs])
        batch.fields[next_obs].copy_(following)
        batch.fields[reward].copy_(ret.reshape(batch.fields[reward].shape))
        batch.fields[done].copy_(dones[torch.arange(m, device=self.device), last].reshape(batch.fields[done].shape))
        batch.extras["steps"] = steps

    def _full_columns(self, torch: Any) -> dict[str, Any]:
        """Every field's whole device column (the small ones views of the packed block), and the episodes."""
        out: dict[str, Any] = {}
        if "_record" in self.rows and self.record is not None:
            out.update(torch_views(self.rows["_record"].view(torch.uint8), self.record))
        out.update({name: dev for name, dev in self.rows.items() if name != "_record"})
        return out

    def _usable_slots(self) -> Any:
        """The usable slots as a device tensor, in no order (kept by each refresh, ``_hold``/``_drop``)."""
        return self._dense_dev[:self._count]

    def _draw_held(self, n: int, accept: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
        """``n`` ids of usable rows drawn uniformly on the device, those ``accept`` refuses drawn
        again (a bounded number of rounds); ``None`` when they could not all be drawn."""
        torch = _torch()
        ids = np.empty(n, np.int64)
        todo = np.arange(n)
        for _ in range(4 * _ROUNDS):
            if self._count == 0:
                return None
            pick = torch.randint(self._count, (todo.size,), device=self.device, generator=self._gen)
            got = self._ids_of(self._usable_slots().index_select(0, pick)).cpu().numpy()
            ok = accept(got)
            ids[todo[ok]] = got[ok]
            todo = todo[~ok]
            if todo.size == 0:
                return ids
        return None

    def _window_ids(self, anchors: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Ids of the rows ``anchor + offset`` of each anchor's lane (the copy's ``held`` says which
        it holds: no bounds here)."""
        lanes = self.lanes
        return window(anchors, offsets, lanes, np.zeros(lanes, np.int64), np.full(lanes, np.iinfo(np.int64).max))[0]

    # -- frames stored once: transitions rebuilt on the device (frames.py's read rules) ------------
    def _transitions(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """Which of ``ids`` the device copy can serve as transitions, by ``frames.center`` and
        ``frames.stack_plan`` over their windows (a window row counts when the copy holds that
        exact row, as a stamp check would pass it); the windows' ids and each stack's plan."""
        spec = self.spec
        assert spec is not None
        lanes = self.lanes
        win = self._window_ids(ids, np.arange(-spec.depth, spec.ahead + 1))
        there = win >= 0
        safe = np.where(there, win, 0)
        slots = slot_of_id(safe, lanes, self.lane_capacity)
        ok = there & (self.held[slots] == committed_of_id(safe, lanes))
        kind = self.kinds[slots]
        valid = frames_center(spec, ok, kind)
        plans = {}
        for s in spec.stack:
            for key, last in stack_columns(spec, s).items():
                cols, zero, fine = stack_plan(ok, kind, last, s.k)
                valid &= fine
                plans[key] = (cols, zero)
        return valid, win, plans

    def _uniform_transitions(self, n: int) -> Batch:
        """``n`` transitions drawn uniformly over the usable rows that are transitions (end and
        lead rows, and each lane's newest row with ``next_of``, are drawn again)."""
        ids = self._draw_held(n, lambda got: self._transitions(got)[0])
        if ids is not None:
            return self._frames_batch(ids, None)
        raise EmptyBufferError(f"sample({n}): the device copy of buffer {self.buf.name!r} holds no whole "
                               "transitions yet (an episode's final observation and each lane's newest row, "
                               "which waits for its next, are not): push, then sync() or sample again")

    def _frames_batch(self, ids: np.ndarray, weight: Any) -> Batch:
        """The transitions ``ids`` (each servable: ``_transitions``) rebuilt on the device."""
        torch = _torch()
        spec = self.spec
        assert spec is not None
        block = self.buf.block
        valid, win, plans = self._transitions(ids)
        assert valid.all()
        m, c, lanes, lc = ids.shape[0], spec.depth, self.lanes, self.lane_capacity
        cols = self._stored_columns(torch)

        def at(column: int) -> Any:
            return torch.from_numpy(slot_of_id(win[:, column], lanes, lc)).to(self.device)

        center = at(c)
        packed = self.rows["_record"].view(torch.uint8).index_select(0, center) if "_record" in self.rows else None
        small = torch_views(packed, self.record) if packed is not None and self.record is not None else {}
        nexts = {nxt: src for nxt, src in spec.next_of}
        fields: dict[str, Any] = {}
        for name in block.schema.names:
            stack = spec.stacked(name) or (spec.stacked(nexts[name]) if name in nexts else None)
            if stack is not None:
                key = stack.name if name == stack.name else "next:" + stack.name
                chosen, zero = plans[key]
                where = torch.from_numpy(slot_of_id(win[np.arange(m)[:, None], chosen].reshape(-1), lanes, lc))
                got = cols[stack.name].index_select(0, where.to(self.device))
                got = got.reshape(m, stack.k, *got.shape[1:])
                if zero.any():
                    got[torch.from_numpy(zero).to(self.device)] = 0
                fields[name] = _assemble(stack, got)
            elif name in nexts:
                fields[name] = cols[nexts[name]].index_select(0, at(c + 1))
            else:
                fields[name] = small[name] if name in small else cols[name].index_select(0, center)
        extras: dict[str, Any] = {"index": torch.from_numpy(ids).to(self.device)}
        if "_episode" in self.rows:
            extras["episode"] = self.rows["_episode"].index_select(0, center)
        if weight is not None:
            extras["weight"] = weight
        return Batch(fields, extras, block=packed, record=self.record)

    def _stored_columns(self, torch: Any) -> dict[str, Any]:
        """Every stored field's whole device column (the small ones views of the packed block)."""
        out: dict[str, Any] = {}
        if "_record" in self.rows:
            out.update(torch_views(self.rows["_record"].view(torch.uint8), self.buf.block.stored_record))
        out.update({name: dev for name, dev in self.rows.items() if name != "_record"})
        return out

    def sample_sequences(self, n: int, length: int, *, burn_in: int = 0, time_major: bool = False) -> Batch:
        """``n`` windows of ``length`` consecutive steps of one lane and episode (plus ``burn_in``
        before) gathered on the device, as ``ReplayBuffer.sample_sequences`` serves them: fields
        ``(n, burn_in + length, ...)`` (or time major), ``batch.mask`` the steps that exist (the
        copy holds them, of the anchor's episode, contiguous from the anchor), zeros elsewhere,
        ``batch.index`` -1 there. Anchors are drawn uniformly over the rows the copy holds."""
        what = f"sample_sequences({n}, {length})"
        check_windows(self.buf, what, n, length, burn_in)
        if self.spec is not None:
            raise FieldError(f"{what}: the device copy does not serve windows over frames stored once "
                             "(next_of/stack) yet: buf.sample_sequences(...) does")
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        self._maybe_sync()
        offsets = np.arange(-burn_in, length)
        with self._lock:
            anchors = self._draw_held(n, lambda got: self._window(got)[0])
            if anchors is None:
                raise EmptyBufferError(f"{what}: the device copy of buffer {self.buf.name!r} holds no rows yet")
            ids = self._window_ids(anchors, offsets)
            held, slots = self._window(ids)
            own = self.episodes[slot_of_id(anchors, self.lanes, self.lane_capacity)]
            mask = window_mask(held & (self.episodes[slots] == own[:, None]), burn_in)
            batch = self._window_batch(np.where(mask, ids, -1), np.where(mask, slots, 0), mask, time_major)
        self.buf.ring.count_sampled(n * (length + burn_in))
        return batch

    def _window(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` (any shape) the copy holds as committed, and their slots."""
        there = ids >= 0
        safe = np.where(there, ids, 0)
        slots = slot_of_id(safe, self.lanes, self.lane_capacity)
        return there & (self.held[slots] == committed_of_id(safe, self.lanes)), slots

    def _window_batch(self, ids: np.ndarray, slots: np.ndarray, mask: np.ndarray, time_major: bool) -> Batch:
        torch = _torch()
        order = slots.T if time_major else slots
        lead = order.shape
        where = torch.from_numpy(np.ascontiguousarray(order).reshape(-1)).to(self.device)
        hole = torch.from_numpy(~np.ascontiguousarray(mask.T if time_major else mask).reshape(-1)).to(self.device)
        got = {name: dev.index_select(0, where) for name, dev in self.rows.items() if name != "_episode"}
        for col in got.values():
            col[hole] = 0
        packed = got.pop("_record", None)
        if packed is not None:
            packed = packed.view(torch.uint8)
        small = torch_views(packed, self.record) if packed is not None and self.record is not None else {}
        flat = {name: got[name] if name in got else small[name] for name in self.buf.block.schema.names}
        fields = {name: a.reshape(*lead, *a.shape[1:]) for name, a in flat.items()}
        index = ids.T if time_major else ids
        keep = mask.T if time_major else mask
        extras = {"index": torch.from_numpy(np.ascontiguousarray(index)).to(self.device),
                  "mask": torch.from_numpy(np.ascontiguousarray(keep)).to(self.device)}
        return Batch(fields, extras, block=packed, record=self.record, lead=lead)

    def update_priorities(self, ids: Any, priorities: Any) -> None:
        """Set the priorities of rows ``ids`` in the shared tree (``ReplayBuffer.update_priorities``:
        every process sees them); device tensors are accepted."""
        def host(a: Any) -> Any:
            return a.detach().cpu().numpy() if hasattr(a, "detach") else a

        self.buf.update_priorities(host(ids), host(priorities))  # type: ignore[attr-defined]
