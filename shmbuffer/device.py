"""A device-resident copy of a buffer, kept in step with its writers: the learner samples on its GPU.

``DeviceReplay(buf, device="cuda")`` holds every field's column in device memory in the ring's
slot layout (``protocol/rows.py``; the packed small fields as one block, as the shared
memory holds them, so a batch's small fields are views of one gathered block), and beside it, on the host, the stamp of the row each device
slot holds (``held``; 0: nothing usable). ``sync()`` brings it up to date:

1. the slots to copy are those whose shared stamp differs from ``held`` (new rows, rows
   overwritten, rows being written); after an ``update()`` anywhere (``Counter.UPDATES`` moved)
   every slot is copied again, since an update puts back the stamp it found;
2. in chunks, the reader's rule (``protocol/reader.py``): stamps read, rows copied into reused
   staging memory (pinned for CUDA), stamps read again; a row counts when both reads show it
   committed (``rows.intact``) and no update ran meanwhile; else its slot is marked unusable and
   copied again at the next sync. So a torn, half-written or overwritten row is never marked
   usable on the device;
3. the rows that count go to the device (on a side stream for CUDA, then waited for), and their
   stamps into ``held``; slots whose row left the lanes' bounds (lapped, ``clear()``) turn
   unusable.

Between syncs the device copy lags the shared buffer: the rows committed since the last sync are
not drawn yet, and a row overwritten or deleted since (or during the sync) is still drawn from the
device copy (whole: the row as it was committed). ``max_lag_rows`` and ``max_lag_s`` bound that lag: a ``sample`` syncs
first when more rows were inserted since the last sync, or more time went by (``lag()`` measures
both), or, under a row bound, when an ``update()`` ran (a full refresh: an update does not say
which rows). A ``clear()`` always makes the next sample sync: a cleared row is never drawn.

``sample(n)`` draws on the device: uniformly over the usable slots (``torch.randint``), or, with a
prioritized sampler, from the shared sum tree (the same draw and importance weights as
``ReplayBuffer.sample``), keeping the drawn rows the device holds as committed and drawing again
for the others. ``update_priorities`` writes the shared tree, so every process sees it. A batch
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

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .batch import Batch, torch_dtype, torch_views
from .errors import CapacityError, ClosedError, EmptyBufferError, FieldError, LayoutError
from .frames import KIND, Stack, stack_columns, stack_plan
from .frames import center as frames_center
from .protocol.layout import Counter, Lane
from .protocol.reader import Source
from .protocol.rows import (
    bounds,
    committed,
    committed_of_id,
    intact,
    is_committed,
    number_of_stamp,
    row_id,
    slot,
    slot_of_id,
    window,
)
from .sequences import check_n_step, check_windows, n_step_fields, window_mask

_UPDATES, _INSERTED = int(Counter.UPDATES), int(Counter.INSERTED)
_CURSOR, _BASE = int(Lane.CURSOR), int(Lane.BASE)
_ROUNDS = 8
"""Rounds of drawing again (prioritized) for rows the device copy does not hold, before a sync."""


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


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
    :param max_lag_rows: sync before a sample once more rows than this were inserted since the
        last sync (``None``: no bound by rows).
    :param max_lag_s: sync before a sample once this many seconds went by since the last sync
        (``None``: no bound by time). With both ``None`` only ``sync()`` refreshes.
    :param chunk: rows per staging copy.
    :param seed: the device generator's seed (uniform draws).
    """

    def __init__(self, buf: Source, device: Any = "cuda", *, max_lag_rows: int | None = 0,
                 max_lag_s: float | None = None, chunk: int = 16384, seed: int | None = None) -> None:
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
        self.seen = np.zeros(self.capacity, np.int64)
        """The stamp each slot showed when a sync last copied it: a slot is copied again only once
        its stamp differs (a row cleared or lapped is not copied over and over)."""
        self.usable = np.zeros(self.capacity, bool)
        """Which device slots hold a row that may be drawn (``held`` and inside its lane's bounds)."""
        self._count = 0  # usable slots
        self._slots: Any = None  # the usable slots as a device tensor, made when drawing needs it
        self._held_dev = torch.from_numpy(self.held) if self.device.type == "cpu" else \
            torch.zeros(self.capacity, dtype=torch.int64, device=self.device)  # what n-step windows read
        self._updates = -1
        self._inserted = 0
        self._bases = np.zeros(self.lanes, np.int64)
        self._synced_at = 0.0
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
        self._lock = threading.Lock()  # one sync at a time (a background thread and the learner)
        self.closed = False
        """Whether ``close()`` was called."""
        self.sync()

    # -- refresh --------------------------------------------------------------------------------
    def sync(self) -> int:
        """Bring the device copy up to date now; returns the rows copied."""
        with self._lock:
            return self._sync()

    def _sync(self) -> int:
        if self.closed:
            raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
        ring, counters = self.buf.ring, self.buf.block.counters
        inserted = int(counters[_INSERTED])
        updates = int(counters[_UPDATES])
        cursors = ring.cursors[:, _CURSOR].copy()  # rows lapped during the copy still count (lag)
        bases = ring.cursors[:, _BASE].copy()  # a clear() after this read: the next sync checks all again
        everything = updates != self._updates or not np.array_equal(bases, self._bases)
        if updates != self._updates:
            self.held[:] = 0  # an update puts back the stamp it found: copy every row again
            self.seen[:] = 0
        todo = np.flatnonzero(ring.stamp != self.seen)
        copied = 0
        for at in range(0, todo.size, self.chunk):
            copied += self._copy(todo[at:at + self.chunk])
        self._updates = updates if int(counters[_UPDATES]) == updates else -1
        self._refresh_usable(cursors, None if everything else todo)
        self._bases = bases
        self._inserted, self._synced_at = inserted, time.monotonic()
        return copied

    def _copy(self, slots: np.ndarray) -> int:
        """Copy ``slots`` by the reader's rule; mark the intact ones held, the others not."""
        torch = _torch()
        ring, counters = self.buf.ring, self.buf.block.counters
        k = slots.shape[0]
        run = int(slots[0]) if slots[-1] - slots[0] == k - 1 else None  # consecutive slots: plain copies
        updates = int(counters[_UPDATES])
        first = ring.stamp[slots] if run is None else ring.stamp[run:run + k].copy()
        for name, col in self.columns.items():
            out = self._staging[name][:k].numpy()
            if run is None:
                np.take(col, slots, axis=0, out=out)
            else:
                np.copyto(out, col[run:run + k])
        second = ring.stamp[slots]
        ok = is_committed(first) & intact(first, second, first)
        if int(counters[_UPDATES]) != updates:
            ok[:] = False  # an update ran meanwhile: copied again at the next sync
        self.held[slots] = np.where(ok, first, 0)
        if self.spec is not None:
            self.kinds[slots] = self._staging[KIND][:k].numpy()
        if self.episodes.size:
            self.episodes[slots] = self._staging["_episode"][:k].numpy()
        self.seen[slots] = first  # copied again once the stamp moves on (a row being written commits)
        good = np.flatnonzero(ok)
        if good.size == 0:
            return 0
        whole = run is not None and good.size == k
        where = None if whole else torch.from_numpy(slots[good]).to(self.device)
        pick = None if whole else torch.from_numpy(good)
        if self._stream is not None:  # gathers of earlier samples queued on the learner's stream read first
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream) if self._stream is not None else _nothing():
            for name, dev in self.rows.items():
                staged = self._staging[name]
                if whole:
                    dev[run:run + k].copy_(staged[:k], non_blocking=True)
                else:
                    dev[where] = staged[pick].to(self.device, non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()  # the staging is reused by the next chunk
        return int(good.size)

    def _refresh_usable(self, cursors: np.ndarray, changed: np.ndarray | None) -> None:
        """Which slots hold a committed row inside its lane's bounds as they were when the sync
        began (``cursors``), or since (a ``clear()``: its base): the ``changed`` slots, or all.
        Only a slot whose stamp changed can leave the bounds, but by a ``clear()`` (all then):
        a lane laps a slot by reserving it, which changes its stamp."""
        torch = _torch()
        ring = self.buf.ring
        lc = self.lane_capacity
        start, stop = bounds(ring.cursors, lc)
        start = np.maximum(ring.cursors[:, _BASE], np.minimum(start, cursors - lc))
        region = np.arange(self.capacity) if changed is None else changed
        held = self.held[region]
        n = number_of_stamp(held)
        lane = region // lc
        ok = (held > 0) & (n >= start[lane]) & (n < stop[lane])
        self.held[region[~ok]] = 0
        self._count += int(ok.sum()) - int(self.usable[region].sum())
        self.usable[region] = ok
        self._slots = None
        if self.device.type != "cpu":  # on the CPU it is a view of ``held``
            if changed is None:
                self._held_dev.copy_(torch.from_numpy(self.held))
            elif region.size:
                self._held_dev[torch.from_numpy(region).to(self.device)] = torch.from_numpy(self.held[region]).to(self.device)

    def _ids_of(self, slots: Any) -> Any:
        """The ids of the rows the device copy holds in ``slots`` (a device tensor)."""
        n = number_of_stamp(self._held_dev.index_select(0, slots))
        return row_id(n, slots // self.lane_capacity, self.lanes)

    def close(self) -> None:
        """Drop the views of the shared columns (so that ``buf.close()`` can unmap them) and the
        device memory. Idempotent; the copy cannot sync or sample afterwards."""
        with self._lock:
            self.columns = {}
            self.rows = {}
            self._staging = {}
            self._slots = None
            self._count = 0
            self.usable[:] = False
            self.closed = True

    def __enter__(self) -> DeviceReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lag(self) -> tuple[int, float]:
        """How far the device copy is behind: rows inserted since the last sync, seconds since it."""
        inserted = int(self.buf.block.counters[_INSERTED])
        return inserted - self._inserted, time.monotonic() - self._synced_at

    def _maybe_sync(self) -> None:
        rows, seconds = self.lag()
        cleared = not np.array_equal(self.buf.ring.cursors[:, _BASE], self._bases)
        updated = self.max_lag_rows is not None and int(self.buf.block.counters[_UPDATES]) != self._updates
        if cleared or updated or (self.max_lag_rows is not None and rows > self.max_lag_rows) or (
                self.max_lag_s is not None and seconds > self.max_lag_s):
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
        prios = self.buf.priorities
        with self._lock:
            if self.closed:
                raise ClosedError(f"DeviceReplay of buffer {self.buf.name!r} is closed")
            if prios is not None and prios.prioritized:
                batch = self._prioritized(int(n))
            else:
                batch = self._uniform(int(n))
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

    def _prioritized(self, n: int) -> Batch:
        torch = _torch()
        buf = self.buf
        prios = buf.priorities
        assert prios is not None
        sampler, ring, tree = buf.options.sampler, buf.ring, prios.tree
        calls = prios.next_call()
        ids = np.empty(n, np.int64)
        leaves = np.empty(n, np.float64)
        todo = np.arange(n)
        for round_ in range(2 * _ROUNDS):
            if round_ == _ROUNDS:
                buf.reap()  # a dead writer's odd rows keep the leaves they took until reaped
                self._sync()  # rows drawn from the tree that the device copy does not hold yet
                done = np.setdiff1d(np.arange(n), todo)  # the sync may have copied newer rows over them
                stale = done[self.held[ring.slots(ids[done])] != committed_of_id(ids[done], self.lanes)]
                todo = np.union1d(todo, stale)
            d = sampler.draw(ring, tree, buf.rng, todo.size, again=round_ > 0)
            got = d.ids
            if d.leaves is None or got.shape[0] != todo.size:
                break
            ok = got >= 0
            slots = ring.slots(np.where(ok, got, 0))
            ok &= self.held[slots] == committed_of_id(np.where(ok, got, 0), self.lanes)
            if self.spec is not None:
                ok &= self._transitions(np.where(ok, got, 0))[0]
            ids[todo[ok]], leaves[todo[ok]] = got[ok], d.leaves[ok]
            todo = todo[~ok]
            if todo.size == 0:
                break
        if todo.size:
            raise EmptyBufferError(f"sample({n}): the device copy of buffer {buf.name!r} holds none of the rows the "
                                   "priorities draw (nothing pushed yet, or every row being written)")
        weights = sampler.weights(tree, leaves, calls)
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
        """The usable slots as a device tensor (made once per sync, when a draw needs it)."""
        if self._slots is None:
            self._slots = _torch().from_numpy(np.flatnonzero(self.usable)).to(self.device)
        return self._slots

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
