"""The buffer's rows on the learner's device, and their refresh from shared memory.

``DeviceRows`` holds every field's column in device memory in the ring's slot layout
(``protocol/rows.py``; the packed small fields as one block, as the shared memory holds them), and
beside it, on the host, the stamp of the row each device slot holds (``held``; 0: nothing usable)
and the usable slots as a dense list (``dense``: its first ``len()`` entries, in no order;
``where``: each slot's place there, -1 when not usable; a slot leaving takes the last one's place,
so each change costs the slot it changes, never the capacity). A refresh (``sync()``) brings it up
to date: a reader of the ring like every other, in ``protocol/refresh.py`` (its steps).

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
host ``mirrors``); the background refresher there is a C thread that never takes the GIL
(``native_refresher``). The Python steps (``refresh.steps``) are the reference, the fallback, and
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
from ..protocol import refresh
from ..protocol.layout import EXTRA
from ..protocol.reader import Source
from ..protocol.refresh import AT, COUNT, DONE, DROPS, EDITS, INSERTED, PENDING, SPENT, STATE_WORDS, TAKEN
from ..protocol.rows import id_of_slot, lane_capacity

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
        block = buf.block
        self.capacity, self.lanes = buf.options.capacity, buf.options.lanes
        self.lane_capacity = lane_capacity(self.capacity, self.lanes)
        self.chunk = min(chunk, self.capacity)
        """Rows per piece of a refresh (the staging memory holds that many rows)."""
        self.record = block.record if block.packed is not None else None
        self.columns: dict[str, np.ndarray] = {}
        if block.packed is not None:  # copied and selected as its widest whole words: one copy per row
            width = block.packed.shape[1]
            word = next(w for w in (8, 4, 2, 1) if width % w == 0 and block.packed.ctypes.data % w == 0)
            self.columns["_record"] = block.packed.view(np.dtype(f"<i{word}") if word > 1 else np.uint8)
        self.columns.update(block.large)  # the packed small fields travel as one block, as in a gather
        self.columns.update(block.row)  # and the per-row columns gathered with each row (layout.ROW_COLUMNS)
        self.extras = {name: EXTRA[name] for name in block.row if name in EXTRA}
        """The gathered per-row columns a batch carries: each one's key in its extras (``layout.EXTRA``)."""
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
        self.kinds = host_zeros(cap if block.kinds is not None else 0, np.uint8)
        """With frames: each held row's kind (``frames.KIND``), as copied with it (host memory)."""
        self.mirrors = {**({KIND: self.kinds} if self.kinds.size else {}),
                        **{name: host_zeros(cap, col.dtype) for name, col in block.row.items()}}
        """Host copies of the held rows' kinds and gathered per-row columns (``Block.row``), which host plans read."""
        self.episodes = self.mirrors.get("_episode", host_zeros(0, np.int64))
        """With episodes: each held row's episode id (``mirrors``)."""
        lib = native.lib
        self._one_call: tuple[Any, ...] | None = None  # the C refresh's arguments but the piece
        self._draw_call: tuple[Any, ...] | None = None  # the C uniform sample's (replay.py)
        if cpu and lib is not None and all(c.flags.c_contiguous for c in self.columns.values()):
            sources = (*self.columns.values(), *(self.columns[name] for name in self.mirrors))
            outs = (*(dev.numpy() for dev in self.rows.values()), *self.mirrors.values())
            self.lock: Any = NativeLock(lib)
            self._one_call = (lib, (self.lock.mutex, *refresh.sources(buf), sources,
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
        if self._one_call is not None:
            lib, args = self._one_call
            return int(lib.refresh(*args, self.chunk, self.buf.block.counters.flags.writeable, seen))
        at = time.monotonic_ns()
        taken = refresh.steps(self.buf, self)
        state = self.state
        state[AT], state[DONE], state[TAKEN] = at, state[DONE] + 1, state[TAKEN] + taken
        state[SPENT] += time.monotonic_ns() - at
        refresh.publish(self.buf, int(state[INSERTED]), at)  # where top reads the lag
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

    def add_pending(self, ids: np.ndarray) -> None:
        """Add ``ids`` to the pending rows (``refresh.steps``)."""
        n = int(self.state[PENDING])
        self.pending_ids[n:n + ids.size] = ids
        self.state[PENDING] = n + ids.size

    def copy_run(self, slot0: int, n0: int, k: int) -> np.ndarray:
        """Copy rows ``n0 ..`` of the run from ``slot0`` (``k <= chunk``, slots dropped) by the
        reader's rule (``gather_run``): on the CPU straight into the device columns, on CUDA into
        the pinned staging, then one copy to the device; which rows were intact."""
        torch = _torch()
        cols = tuple(self.columns.values())
        ok = np.zeros(k, bool)
        if self._stream is None:
            outs = tuple(dev[slot0:slot0 + k].numpy() for dev in self.rows.values())
            refresh.read_run(self.buf, cols, slot0, n0, outs, ok)
            self._mirror(slot0, dict(zip(self.rows, outs, strict=True)))
            return ok
        staged = {name: s[:k] for name, s in self._staging.items()}
        refresh.read_run(self.buf, cols, slot0, n0, tuple(s.numpy() for s in staged.values()), ok)
        self._mirror(slot0, {name: s.numpy() for name, s in staged.items()})
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # earlier samples' gathers read first
        with torch.cuda.stream(self._stream):
            for name, dev in self.rows.items():
                dev[slot0:slot0 + k].copy_(staged[name], non_blocking=True)
        self._stream.synchronize()  # the staging is reused by the next piece
        return ok

    def copy_rows(self, ids: np.ndarray) -> np.ndarray:
        """Copy the rows ``ids`` (pending rows now committed; slots dropped) by the stamped gather,
        through the staging, into their device slots; which were intact."""
        torch = _torch()
        ok = np.zeros(ids.size, bool)
        block = self.buf.block
        for a in range(0, ids.size, self.chunk):
            part = ids[a:a + self.chunk]
            m = part.size
            staged = ({name: s[:m] for name, s in self._staging.items()} if self._staging else
                      {name: torch.empty((m, *dev.shape[1:]), dtype=dev.dtype) for name, dev in self.rows.items()})
            out = {name: staged[name].numpy() for name in block.large}
            if "_record" in staged:
                out["_block"] = staged["_record"].numpy().view(np.uint8)
            rows, slots = refresh.read_rows(self.buf, part, out)
            for name, col in rows.row.items():
                staged[name].numpy()[:] = col
            ok[a:a + m] = rows.ok
            keep = np.flatnonzero(rows.ok)
            self._mirror(slots, {name: s.numpy()[keep] for name, s in staged.items()})
            where, pick = torch.from_numpy(slots).to(self.device), torch.from_numpy(keep)
            for name, dev in self.rows.items():
                dev.index_copy_(0, where, staged[name].index_select(0, pick).to(self.device))
        return ok

    def _mirror(self, slots: int | np.ndarray, copied: dict[str, np.ndarray]) -> None:
        """The ``mirrors`` of rows just copied into ``slots`` (a first slot or an array): they count once held."""
        for name, mirror in self.mirrors.items():
            got = copied[name]
            mirror[slice(slots, slots + got.shape[0]) if isinstance(slots, int) else slots] = got

    # -- the held and usable slots (under lock): each change costs the slots it touches -----------
    def drop(self, slots: np.ndarray) -> None:
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

    def hold(self, slots: np.ndarray, stamps: np.ndarray) -> None:
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
        return id_of_slot(slots, self._held_dev.index_select(0, slots), self.lanes, self.lane_capacity)

    def _usable_slots(self) -> Any:
        """The usable slots as a device tensor, in no order (kept by each refresh)."""
        return self._dense_dev[:len(self)]

    def lag(self) -> tuple[int, float]:
        """How far the device copy is behind: rows inserted since the last refresh began, seconds since it began."""
        return refresh.lag(self.buf, self.state)

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
