"""The replay buffer: fields in shared memory, pushed to by any process, sampled by the learner.

::

    buf = ReplayBuffer(Schema(obs=((4,), "float32"), reward=((), "float32")), capacity=100_000)
    buf.push(obs=o, reward=r)                  # one row, or k rows with a leading dimension
    batch = buf.sample(256)                    # batch.obs, batch["obs"], batch.index
    other = ReplayBuffer.attach(buf.handle)    # in any process

Lifecycle: the process that constructs a buffer creates its block and owns it; ``attach`` maps an
existing block by name or handle and never removes it. ``close()`` unmaps this process's view
(``BufferError`` while arrays from ``view()``/``column()`` are alive; call it again after deleting
them); ``unlink()`` removes the name, and happens by itself when the creator exits or drops the
buffer. Both are idempotent. As a context manager the creator closes and unlinks; an attacher only
closes; views still alive at the end of the block keep this process's mapping until they go. A buffer pickles as its handle, so passing it to a spawned worker attaches there.

Reading: ``sample`` and ``get`` return stamped copies (never a torn row, see ``ring.py``);
``view`` and ``column`` return zero-copy, read-only views of live memory, which writers may
overwrite as they come round the ring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ring as ring_mod
from .batch import Batch
from .errors import ClosedError, EmptyBufferError, LayoutError, SchemaError, WaitTimeout
from .ring import Ring
from .schema import Schema
from .segment import ColumnSpec, Segment

_NONE = np.empty(0, np.int64)
REDRAW_ROUNDS = 8
"""Rounds of re-drawing rows that were being written before scanning for committed rows."""


@dataclass(frozen=True)
class BufferHandle:
    """What another process needs to attach: the buffer's name. Small, plain and picklable."""

    name: str


def _columns(schema: Schema, capacity: int, lanes: int) -> list[ColumnSpec]:
    cols = ring_mod.columns(capacity, lanes)
    if schema.record.itemsize:
        cols.append(ColumnSpec("_record", (capacity, schema.record.itemsize), np.dtype(np.uint8)))
    cols += [ColumnSpec(f.name, (capacity, *f.shape), f.dtype) for f in schema.columns]
    return cols


def _as_schema(schema: Schema | Mapping[str, Any]) -> Schema:
    if isinstance(schema, Schema):
        return schema
    if isinstance(schema, Mapping):
        return Schema(schema)
    raise SchemaError(f"expected a Schema or a cpprb-style env_dict, got {type(schema).__name__}")


class ReplayBuffer:
    """A fixed-schema ring of rows in one shared-memory block (see the module docstring).

    ``capacity`` rows in all, split into ``lanes`` equal lanes (a writer that pushes into its own
    lane keeps its consecutive steps consecutive). ``name`` names the block (default: the pid and
    a random token); ``seed`` seeds this process's sampling.
    """

    _ring: Ring | None = None
    _segment: Segment | None = None

    def __init__(
        self,
        schema: Schema | Mapping[str, Any],
        capacity: int,
        *,
        lanes: int = 1,
        name: str | None = None,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        schema = _as_schema(schema)
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        if not isinstance(lanes, (int, np.integer)) or lanes <= 0 or capacity % lanes:
            raise ValueError(f"lanes: expected a positive divisor of capacity {capacity}, got {lanes!r}")
        ring_mod.check_platform()
        capacity, lanes = int(capacity), int(lanes)
        meta = {"schema": schema.to_json(), "capacity": capacity, "lanes": lanes, "record": schema.record.itemsize}
        segment = Segment.create(name, meta, _columns(schema, capacity, lanes), schema.fingerprint)
        try:
            self._setup(segment, schema, seed, initialise=True)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    @classmethod
    def attach(
        cls,
        handle: BufferHandle | str,
        *,
        schema: Schema | Mapping[str, Any] | None = None,
        seed: int | np.random.Generator | None = None,
    ) -> ReplayBuffer:
        """Map an existing buffer by handle or name. With ``schema``, refuse another layout."""
        ring_mod.check_platform()
        name = handle.name if isinstance(handle, BufferHandle) else handle
        segment = Segment.attach(name)
        try:
            found = Schema.from_json(segment.meta["schema"])
            if found.fingerprint != segment.header.fingerprint:
                raise LayoutError(f"buffer {name!r} is damaged: its schema does not match its fingerprint")
            if schema is not None and _as_schema(schema) != found:
                raise SchemaError(f"buffer {name!r} has schema {found}, expected {_as_schema(schema)}")
            capacity, lanes = int(segment.meta["capacity"]), int(segment.meta["lanes"])
            expected = [(c.name, list(c.shape), c.dtype.str) for c in _columns(found, capacity, lanes)]
            stored = [(c["name"], c["shape"], c["dtype"]) for c in segment.meta["columns"]]
            if stored != expected:
                raise LayoutError(
                    f"buffer {name!r} was written with another column layout than this shmbuffer "
                    f"uses; use the release that created it"
                )
            self = cls.__new__(cls)
            self._setup(segment, found, seed, initialise=False)
        except BaseException:
            segment.close()
            raise
        return self

    def _setup(self, segment: Segment, schema: Schema, seed: Any, *, initialise: bool) -> None:
        self._segment = segment
        self.schema = schema
        self.name = segment.name
        arrays = segment.arrays
        self._ring = Ring(arrays, initialise=initialise)
        self._record = schema.record
        self._block = arrays.get("_record")
        self._small = self._record.views(self._block) if self._block is not None else {}
        self._big = {f.name: arrays[f.name] for f in schema.columns}
        self._targets = {**self._small, **self._big}
        self._rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)

    # -- identity and lifecycle ----------------------------------------------------------------
    @property
    def handle(self) -> BufferHandle:
        return BufferHandle(self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_attach_by_handle, (self.handle,))

    @property
    def ring(self) -> Ring:
        if self._ring is None:
            raise ClosedError(f"buffer {self.name!r} is closed in this process")
        return self._ring

    @property
    def owner(self) -> bool:
        return self._segment is not None and self._segment.owner

    @property
    def closed(self) -> bool:
        return self._ring is None

    def close(self) -> None:
        """Unmap this process's view (see the module docstring). Idempotent."""
        self._close(defer=False)

    def _close(self, *, defer: bool) -> None:
        if self._segment is None:
            return
        if self._ring is not None:
            self._ring.forget_writer()
        self._ring = None
        self._block = None
        self._small, self._big, self._targets = {}, {}, {}
        self._segment.close(defer=defer)

    def unlink(self) -> None:
        """Remove the buffer's name from ``/dev/shm``; open views stay valid. Idempotent."""
        if self._segment is not None:
            self._segment.unlink()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        owner = self.owner
        self._close(defer=True)  # views still held keep the mapping alive until they go
        if owner:
            self.unlink()

    def __repr__(self) -> str:
        if self.closed:
            return f"ReplayBuffer({self.name!r}, closed)"
        lanes = f", lanes={self.lanes}" if self.lanes > 1 else ""
        return f"ReplayBuffer({self.name!r}, {len(self)}/{self.capacity} rows{lanes}, {self.schema})"

    # -- size ----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def lanes(self) -> int:
        return self.ring.lanes

    @property
    def lane_capacity(self) -> int:
        return self.ring.lane_capacity

    def __len__(self) -> int:
        """Rows held now, counting rows being written (they are never sampled half-written)."""
        return len(self.ring)

    @property
    def size(self) -> int:
        return len(self.ring)

    @property
    def full(self) -> bool:
        return len(self.ring) == self.ring.capacity

    @property
    def stats(self) -> dict[str, int]:
        """Counters shared by every process: inserted, sampled, reclaimed, lock_recoveries."""
        return self.ring.stats

    def clear(self) -> None:
        """Forget every row (MindSpore's ``reset``). Ids keep growing; see ``Ring.clear``."""
        self.ring.clear()

    reset = clear

    # -- writing -------------------------------------------------------------------------------
    def push(self, data: Mapping[str, Any] | None = None, /, *, lane: int | Any = 0, **fields: Any) -> np.ndarray:
        """Append one row, or ``k`` rows given with a leading dimension; return their ids.

        Fields come as keywords (cpprb's ``add``) or as one mapping (DI-engine's ``push``).
        ``lane`` is a lane number, or one lane per row. Everything is checked before the buffer
        is touched: on any error it is exactly as it was.
        """
        ring = self.ring
        if data is not None:
            if fields:
                raise TypeError("push() takes a mapping or keyword fields, not both")
            if not isinstance(data, Mapping):
                raise TypeError(f"push() expected a mapping of fields, got {type(data).__name__}")
            fields = dict(data)
        k, arrays = self.schema.validate(fields)
        lane = int(lane) if isinstance(lane, (int, np.integer)) else np.asarray(lane, dtype=np.int64)
        ring.check_push(k, lane)
        if k == 0:
            return np.empty(0, np.int64)
        res = ring.reserve(k, lane)
        try:
            targets = self._targets
            for name, a in arrays.items():
                targets[name][res.where] = a
        except BaseException:
            ring.abandon(res)
            raise
        ring.commit(res)
        return res.ids

    add = push

    # -- reading -------------------------------------------------------------------------------
    def sample(self, n: int, *, replace: bool = True) -> Batch:
        """``n`` rows drawn uniformly from the committed rows, as one gathered copy.

        ``replace=False`` draws ``n`` distinct rows. Rows being written are re-drawn, so the batch
        always has ``n`` rows; ``batch.index`` holds their ids.
        """
        ring = self.ring
        if type(n) is not int and (not isinstance(n, np.integer) or isinstance(n, bool)) or n <= 0:
            raise ValueError(f"sample: expected a positive number of rows, got {n!r}")
        ids = self._uniform(n, replace, _NONE)
        if ids.size < n:
            if len(ring) == 0:
                raise EmptyBufferError(f"sample({n}): buffer {self.name!r} is empty; push rows first")
            raise EmptyBufferError(
                f"sample({n}, replace=False): buffer {self.name!r} holds only {len(ring)} rows"
            )
        batch = self._fetch(ids, lambda k, taken: self._uniform(k, replace, taken), unique=not replace)
        ring.count_sampled(n)
        return batch

    def _uniform(self, k: int, replace: bool, taken: np.ndarray) -> np.ndarray:
        """``k`` ids drawn uniformly from the rows that count now, none of ``taken`` when not
        ``replace``; fewer when there are not enough rows."""
        ring = self.ring
        rng = self._rng
        if ring.lanes == 1:
            start, stop = ring.span()
            m = stop - start
            if m <= 0:
                return _NONE
            if replace:
                return start + (rng.random(k) * m).astype(np.int64)
            pick = rng.choice(m, size=min(m, k + taken.size), replace=False) + start
        else:
            first, last = ring.bounds()
            sizes = last - first
            m = int(sizes.sum())
            if m <= 0:
                return _NONE
            if replace:
                return _ids_at((rng.random(k) * m).astype(np.int64), first, sizes)
            pick = _ids_at(rng.choice(m, size=min(m, k + taken.size), replace=False), first, sizes)
        return pick[~np.isin(pick, taken)][:k] if taken.size else pick[:k]

    def _gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
        """Stamps, rows, stamps again: the reader's half of the commit protocol (``ring.py``)."""
        stamp = self.ring.stamp
        first = stamp.take(slots)
        block = self._block.take(slots, axis=0) if self._block is not None else None
        big = {name: col.take(slots, axis=0) for name, col in self._big.items()}
        second = stamp.take(slots)
        return first, second, block, big

    def _batch(self, ids: np.ndarray, block: np.ndarray | None, big: dict[str, np.ndarray]) -> Batch:
        fields = self._record.views(block) if block is not None else {}
        fields.update(big)
        ordered = {name: fields[name] for name in self.schema.names}
        return Batch(ordered, {"index": ids}, block=block, record=self._record if block is not None else None)

    def _fetch(self, ids: np.ndarray, redraw: Callable[[int, np.ndarray], np.ndarray], *, unique: bool) -> Batch:
        """Gather ``ids``; re-draw every row that was not committed before and after the gather.

        After ``REDRAW_ROUNDS`` rounds the remaining rows are drawn from a scan of the committed
        rows (rows of dead writers are reaped first); ``WaitTimeout`` if there are none.
        """
        ring = self.ring
        first, second, block, big = self._gather(ring.slots(ids))
        expect = ring.expected(ids)
        first ^= expect
        second ^= expect
        first |= second
        bad = np.flatnonzero(first) if first.any() else _NONE
        rounds = 0
        while bad.size:
            rounds += 1
            new = redraw(bad.size, ids) if rounds <= REDRAW_ROUNDS else self._scan(bad.size, ids, unique, rounds)
            if new.size < bad.size:  # the buffer was cleared meanwhile: scan from now on
                rounds = REDRAW_ROUNDS
                continue
            ids[bad] = new
            first, second, rows, more = self._gather(ring.slots(new))
            if block is not None and rows is not None:
                block[bad] = rows
            for name, col in more.items():
                big[name][bad] = col
            expect = ring.expected(new)
            bad = bad[(first != expect) | (second != expect)]
        return self._batch(ids, block, big)

    def _scan(self, k: int, taken: np.ndarray, unique: bool, rounds: int) -> np.ndarray:
        ring = self.ring
        deadline = time.monotonic() + 1.0
        while True:
            ring.reap()
            ok = ring.committed_ids()
            if unique:
                ok = ok[~np.isin(ok, taken)]
            if ok.size >= (k if unique else 1):
                return self._rng.choice(ok, size=k, replace=not unique)
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"buffer {self.name!r}: after {rounds} rounds, {ok.size} committed rows are "
                    f"available for {k} more; the others are still being written"
                )
            time.sleep(0.001)

    def get(self, index: int | slice | Any) -> Batch:
        """Rows by logical index: 0 is the oldest, -1 the newest (lane by lane when there are
        several lanes). An int gives single-row fields (no leading dimension); a slice or an
        array of ints gives rows. A row being written is waited for (up to a second); a row whose
        writer died mid-push raises ``EmptyBufferError``."""
        ring = self.ring
        deadline = time.monotonic() + 1.0
        while True:
            start, stop = ring.bounds()
            sizes = stop - start
            total = int(sizes.sum())
            if isinstance(index, slice):
                pos = np.arange(total)[index]
            else:
                pos = np.asarray(index)
                if pos.dtype.kind not in "iu":
                    raise TypeError(f"get: expected an int, a slice or an array of ints, got {pos.dtype}")
                pos = np.where(pos < 0, pos + total, pos)
                if pos.size and (pos.min() < 0 or pos.max() >= total):
                    raise EmptyBufferError(f"get({index!r}): index out of range for {total} rows")
            one = pos.ndim == 0
            ids = _ids_at(pos.reshape(-1).astype(np.int64), start, sizes)
            first, second, block, big = self._gather(ring.slots(ids))
            expect = ring.expected(ids)
            if np.array_equal(first, expect) and np.array_equal(second, expect):
                break
            now = ring.stamp.take(ring.slots(ids))
            if np.any(now < expect) and not np.any(now[now < expect] & 1):
                raise EmptyBufferError(f"get({index!r}): a row was lost: its writer died mid-push")
            if time.monotonic() > deadline:
                if ring.reap():
                    raise EmptyBufferError(f"get({index!r}): a row was lost: its writer died mid-push")
                raise WaitTimeout(f"get({index!r}): a row is still being written after 1 s")
            if np.any(now & 1):
                time.sleep(0.0005)  # being written: wait; overwritten: look the index up again
        batch = self._batch(ids, block, big)
        if one:
            return Batch({k: v[0] for k, v in batch.fields.items()}, {"index": ids[0]})
        return batch

    def view(self, start: int, stop: int, *, lane: int = 0) -> Batch:
        """Zero-copy, read-only views of logical rows ``[start, stop)`` of ``lane``.

        Live memory: writers coming round the ring overwrite it, and rows being written are not
        skipped (use ``get`` for stamped copies). Raises ``ValueError`` when the rows wrap past
        the lane's end (two pieces cannot be one view).
        """
        ring = self.ring
        if not 0 <= lane < ring.lanes:
            raise ValueError(f"lane: expected a lane in [0, {ring.lanes}), got {lane}")
        first, last = ring.bounds()
        held = int(last[lane] - first[lane])
        lo, hi, step = slice(start, stop).indices(held)
        if step != 1 or hi < lo:
            raise ValueError(f"view({start}, {stop}): expected 0 <= start <= stop within {held} rows")
        lc = ring.lane_capacity
        s0 = (int(first[lane]) + lo) % lc
        if s0 + (hi - lo) > lc:
            raise ValueError(
                f"view({start}, {stop}): those rows wrap past the end of the ring (slot {lc}); "
                "take two views, or get() for one copy"
            )
        where = slice(lane * lc + s0, lane * lc + s0 + hi - lo)
        ids = (int(first[lane]) + np.arange(lo, hi)) * ring.lanes + lane
        fields = {name: _readonly(self._targets[name][where]) for name in self.schema.names}
        return Batch(fields, {"index": ids})

    def column(self, name: str) -> np.ndarray:
        """A zero-copy, read-only view of a whole field, ``(capacity, *shape)``, in slot order."""
        self.schema[name]
        return _readonly(self._targets[name])


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _ids_at(pos: np.ndarray, start: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Ids of the rows at logical positions ``pos`` (lane by lane, oldest first)."""
    lanes = start.shape[0]
    if lanes == 1:
        return start[0] + pos
    ends = np.cumsum(sizes)
    lane = np.searchsorted(ends, pos, side="right")
    n = start[lane] + pos - (ends[lane] - sizes[lane])
    return n * lanes + lane


def _attach_by_handle(handle: BufferHandle) -> ReplayBuffer:
    return ReplayBuffer.attach(handle)
