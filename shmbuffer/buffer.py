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
closes; views still alive at the end of the block keep this process's mapping until they go. A
buffer pickles as its handle, so passing it to a spawned worker attaches there.

Reading: ``sample`` and ``get`` return stamped copies (never a torn row, see ``ring.py``);
``view`` and ``column`` return zero-copy, read-only views of live memory, which writers may
overwrite as they come round the ring.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ring as ring_mod
from . import sequences
from .batch import Batch
from .errors import ClosedError, EmptyBufferError, FieldError, LayoutError, ReadOnlyError, SchemaError, WaitTimeout
from .limiter import RateLimiter
from .lock import resume_signals
from .ring import INVALID, Ring
from .samplers import (
    Priorities,
    Prioritized,
    Sampler,
    Uniform,
    check_ids,
    check_priorities,
    sampler_from_json,
    uniform_ids,
)
from .schema import Schema
from .segment import MALFORMED, ColumnSpec, Segment

_NONE = np.empty(0, np.int64)
REDRAW_ROUNDS = 8
"""Rounds of re-drawing rows that were being written before the slow path (a scan, or reaping
dead writers' rows) starts."""
UNIFORM = Uniform()
GIVE_UP = 1.0
"""Seconds a sample may keep re-drawing before it raises."""


@dataclass(frozen=True)
class BufferHandle:
    """What another process needs to attach: the buffer's name. Small, plain and picklable."""

    name: str


@dataclass(frozen=True)
class Options:
    """What shapes a block besides its schema; stored in its metadata, read back on attach."""

    capacity: int
    lanes: int = 1
    sampler: Sampler = UNIFORM
    max_use: int | None = None
    episodes: bool = False
    limiter: RateLimiter | None = None

    def __post_init__(self) -> None:
        cap, lanes, max_use = self.capacity, self.lanes, self.max_use
        if not isinstance(cap, (int, np.integer)) or isinstance(cap, bool) or cap <= 0:
            raise ValueError(f"capacity: expected a positive int, got {cap!r}")
        if not isinstance(lanes, (int, np.integer)) or isinstance(lanes, bool) or lanes <= 0 or cap % lanes:
            raise ValueError(f"lanes: expected a positive divisor of capacity {cap}, got {lanes!r}")
        if max_use is not None and (not isinstance(max_use, (int, np.integer)) or isinstance(max_use, bool) or max_use <= 0):
            raise ValueError(f"max_use: expected a positive int or None, got {max_use!r}")
        if not isinstance(self.sampler, (Uniform, Prioritized)):
            raise ValueError(f"sampler: expected Uniform() or Prioritized(...), got {self.sampler!r}")
        if self.limiter is not None and not isinstance(self.limiter, RateLimiter):
            raise ValueError(f"limiter: expected a RateLimiter, got {self.limiter!r}")

    @property
    def tree(self) -> bool:
        """Whether draws go through the priority tree (prioritized, or any sampler with max_use)."""
        return isinstance(self.sampler, Prioritized) or self.max_use is not None

    def to_json(self) -> dict[str, Any]:
        return {"capacity": int(self.capacity), "lanes": int(self.lanes), "sampler": self.sampler.to_json(),
                "max_use": None if self.max_use is None else int(self.max_use), "episodes": bool(self.episodes),
                "limiter": None if self.limiter is None else self.limiter.to_json()}

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> Options:
        return cls(spec["capacity"], spec["lanes"], sampler_from_json(spec["sampler"]), spec["max_use"],
                   spec["episodes"], RateLimiter.from_json(spec.get("limiter")))


def _columns(schema: Schema, opts: Options) -> list[ColumnSpec]:
    capacity = int(opts.capacity)
    cols = ring_mod.columns(capacity, int(opts.lanes))
    if opts.tree:
        cols += Priorities.columns(capacity, opts.max_use)
    if opts.episodes:
        cols.append(ColumnSpec("_episode", (capacity,), np.dtype(np.int64)))
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
    lane keeps its consecutive steps consecutive; give each env a lane for sequences).
    ``sampler`` is ``Uniform()`` or ``Prioritized(...)``; with ``max_use`` a row leaves the
    sampling set after that many draws; with ``episodes`` every push names the episode of its rows
    (sequences, n-step returns and groups need it); ``limiter`` (a ``RateLimiter``) holds the
    ratio of samples to inserts in a window, for every process. ``name`` names the block (default:
    the pid and a random token); ``seed`` seeds this process's sampling.
    """

    _ring: Ring | None = None
    _segment: Segment | None = None

    def __init__(
        self,
        schema: Schema | Mapping[str, Any],
        capacity: int,
        *,
        sampler: Sampler = UNIFORM,
        max_use: int | None = None,
        lanes: int = 1,
        episodes: bool = False,
        limiter: RateLimiter | None = None,
        name: str | None = None,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        schema = _as_schema(schema)
        opts = Options(capacity, lanes, sampler, max_use, episodes, limiter)
        ring_mod.check_platform()
        meta = {"schema": schema.to_json(), "options": opts.to_json(), "record": schema.record.itemsize}
        segment = Segment.create(name, meta, _columns(schema, opts), schema.fingerprint)
        try:
            self._setup(segment, schema, opts, seed, initialise=True)
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
            try:
                found = Schema.from_json(segment.meta["schema"])
                opts = Options.from_json(segment.meta["options"])
                expected = [(c.name, list(c.shape), c.dtype.str) for c in _columns(found, opts)]
            except MALFORMED as exc:
                raise LayoutError(
                    f"buffer {name!r} is damaged: its schema or options cannot be read "
                    f"({type(exc).__name__}: {str(exc)[:200]}); remove it (`shmbuffer gc --force {name}`)"
                ) from None
            if found.fingerprint != segment.header.fingerprint:
                raise LayoutError(f"buffer {name!r} is damaged: its schema does not match its fingerprint")
            if schema is not None and _as_schema(schema) != found:
                raise SchemaError(f"buffer {name!r} has schema {found}, expected {_as_schema(schema)}")
            stored = [(c["name"], c["shape"], c["dtype"]) for c in segment.meta["columns"]]
            if stored != expected:
                raise LayoutError(
                    f"buffer {name!r} was written with another column layout than this shmbuffer "
                    f"uses; use the release that created it"
                )
            self = cls.__new__(cls)
            self._setup(segment, found, opts, seed, initialise=False)
        except BaseException:
            segment.close()
            raise
        return self

    def _setup(self, segment: Segment, schema: Schema, opts: Options, seed: Any, *, initialise: bool) -> None:
        self._segment = segment
        self.schema = schema
        self.options = opts
        self.name = segment.name
        arrays = segment.arrays
        self._ring = Ring(arrays, initialise=initialise)
        self._prios = Priorities(arrays, opts.sampler, opts.max_use, initialise=initialise) if opts.tree else None
        if self._prios is not None:
            self._ring.repairs.append(self._prios.repair)  # no cycle through the ring: close() stays prompt
        self._episode = arrays.get("_episode")
        self._record = schema.record
        self._block = arrays.get("_record")
        self._small = self._record.views(self._block) if self._block is not None else {}
        self._big = {f.name: arrays[f.name] for f in schema.columns}
        self._targets = {**self._small, **self._big}
        self._rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self._calls = 0

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
        self._ring = None
        self._prios = None
        self._block = self._episode = None
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
        prios = self._prios
        self.ring.clear(also=prios.clear if prios is not None else None)

    reset = clear

    def freeze(self) -> None:
        """Make the buffer read-only for every process (expert data): pushes and clears raise
        ``ReadOnlyError``; sampling and priority updates go on. There is no unfreezing."""
        self.ring.freeze()

    @property
    def frozen(self) -> bool:
        return self.ring.frozen

    # -- writing -------------------------------------------------------------------------------
    def push(
        self,
        data: Mapping[str, Any] | None = None,
        /,
        *,
        lane: int | Any = 0,
        episode: int | Any = None,
        priority: float | Any = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> np.ndarray:
        """Append one row, or ``k`` rows given with a leading dimension; return their ids.

        Fields come as keywords (cpprb's ``add``) or as one mapping (DI-engine's ``push``).
        ``lane``: a lane number, or one per row. ``episode``: the episode id of the rows (one, or
        one per row), required when the buffer keeps episodes. ``priority``: the rows' priority
        (one, or one per row; Ape-X style), else the largest given so far. Everything is checked
        before the buffer is touched: on any error it is exactly as it was.
        """
        ring = self.ring
        k, arrays, lane, episodes, priority = self.check(data, lane=lane, episode=episode, priority=priority, **fields)
        prios = self._prios
        if k == 0:
            return np.empty(0, np.int64)
        # new rows take their priority (and no uses) inside the reservation's critical section:
        # while they are being written a draw that lands on them sees an odd stamp and re-draws
        also = None if prios is None else (lambda slots: prios.set_rows(slots, priority, fresh=True))
        limiter = self.options.limiter
        res = None
        try:
            if limiter is not None and limiter.block_writers and limiter.samples_per_insert is not None:
                res = ring.reserve(k, lane, gate=lambda i, s, size: limiter.can_insert(i, s, size, k),
                                   why=self._rates, timeout=limiter.timeout if timeout is None else timeout,
                                   also=also, deferring=True)
            else:
                res = ring.reserve(k, lane, also=also, deferring=True)
            # from here to the commit, signal handlers wait (lock.py): a Ctrl-C cannot leave the
            # rows odd under this live process; it is raised once they are committed
            targets = self._targets
            for name, a in arrays.items():
                targets[name][res.where] = a
            if episodes is not None and self._episode is not None:
                self._episode[res.where] = episodes
            ring.commit(res)
        except BaseException:
            # the copy failed after the reservation: give the rows back — they read as empty,
            # never as committed, and are never drawn; a live owner must not keep them odd
            if res is not None and not ring.current(res.ids).all():
                ring.abandon(res, None if prios is None else (lambda slots: prios.tree.update(slots, 0.0)))
            raise
        finally:
            if res is not None:
                resume_signals()  # a signal that came meanwhile is raised here
        return res.ids

    add = push

    def check(
        self, data: Mapping[str, Any] | None = None, /, *, lane: int | Any = 0, episode: int | Any = None,
        priority: float | Any = None, **fields: Any,
    ) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Everything ``push`` checks before it touches the buffer, without touching it: raises
        what ``push`` would; returns the row count and the checked rows and options."""
        if data is not None:
            if fields:
                raise TypeError("push() takes a mapping or keyword fields, not both")
            if not isinstance(data, Mapping):
                raise TypeError(f"push() expected a mapping of fields, got {type(data).__name__}")
            fields = data  # type: ignore[assignment]
        ring = self.ring
        k, arrays = self.schema.validate(fields)
        if type(lane) is not int or not 0 <= lane < ring.lanes or k > ring.lane_capacity:  # the usual case is cheap
            lane = int(lane) if isinstance(lane, (int, np.integer)) else np.asarray(lane, dtype=np.int64)
            ring.check_push(k, lane)
        if ring.frozen:
            raise ReadOnlyError(f"buffer {self.name!r} is frozen (read-only): it takes no more rows")
        episodes = None if episode is None and not self.options.episodes else self._check_episode(episode, k)
        if priority is not None:
            if self._prios is None or not self._prios.prioritized:
                raise FieldError("priority: this buffer samples uniformly; create it with sampler=Prioritized(...)")
            priority = check_priorities(priority, k)
        return k, arrays, lane, episodes, priority

    def _check_episode(self, episode: Any, k: int) -> np.ndarray | None:
        if not self.options.episodes:
            if episode is not None:
                raise FieldError("episode: this buffer does not keep episodes; create it with episodes=True")
            return None
        if episode is None:
            raise FieldError("episode: this buffer keeps episodes (episodes=True); push(..., episode=id) is required")
        e = np.asarray(episode)
        if e.dtype.kind not in "iu" or e.shape not in ((), (k,)):
            raise FieldError(f"episode: expected an int or {k} ints, got {e.dtype} of shape {e.shape}")
        return e.astype(np.int64, copy=False)

    def update_priorities(self, rows: Batch | Any, priorities: Any) -> int:
        """Set the priorities of sampled rows (a batch, or its ``index``), from any process.

        Rows overwritten or cleared since they were sampled are skipped; returns how many were
        updated. NaN, infinite or negative priorities, priorities too large for the tree (see
        ``samplers.MAX_LEAF``), ids that are not integers and ids that never named a row
        (``UnknownIdError``) raise ``FieldError`` and change nothing.
        """
        ring = self.ring
        prios = self._prios
        if prios is None or not prios.prioritized:
            raise FieldError("update_priorities: this buffer samples uniformly; create it with sampler=Prioritized(...)")
        ids = check_ids(rows.index if isinstance(rows, Batch) else rows, "update_priorities", ring.bounds()[1])
        p = prios.check(priorities, ids.size, "update_priorities: priority")
        with ring.lock:
            live = ring.current(ids)
            prios.set_rows(ring.slots(ids[live]), p[live], fresh=False)
        return int(live.sum())

    # -- reading -------------------------------------------------------------------------------
    def sample(
        self,
        n: int,
        *,
        replace: bool = True,
        n_step: int = 1,
        gamma: float = 0.99,
        fields: dict[str, str] | None = None,
        out: dict[str, np.ndarray] | None = None,
        timeout: float | None = None,
    ) -> Batch:
        """``n`` rows drawn by the buffer's sampler, as one gathered copy.

        ``replace=False`` draws ``n`` distinct rows. Rows being written are re-drawn, so the batch
        always has ``n`` rows. ``batch.index`` holds their ids; a prioritized buffer adds
        ``batch.weight`` (importance-sampling weights). ``n_step > 1`` turns rows into n-step
        transitions (``sequences.add_n_step``; ``fields`` names the reward, next_obs and done
        fields when they are not called so) and adds ``batch.steps``. ``out`` gathers into given
        arrays (``"_block"`` for the packed record, one per large field; the loader passes its
        pinned staging memory), whose views the batch then holds. ``timeout``: how long a rate
        limiter may hold this sample (default: the limiter's).
        """
        ring = self.ring
        if (type(n) is not int and (not isinstance(n, np.integer) or isinstance(n, bool))) or n <= 0:
            raise ValueError(f"sample: expected a positive number of rows, got {n!r}")
        if n_step != 1:
            if not isinstance(n_step, (int, np.integer)) or n_step < 1:
                raise ValueError(f"sample: n_step must be an int >= 1, got {n_step!r}")
            if not 0 <= gamma <= 1:
                raise ValueError(f"sample: gamma must be in [0, 1], got {gamma!r}")
            sequences.check_n_step(self, n_step, fields)
        def draw() -> Batch:
            if self._prios is not None:
                batch = self._sample_tree(n, replace, out)
            else:
                ids = self._uniform(n, replace, _NONE)
                if ids.size < n:
                    if len(ring) == 0:
                        raise EmptyBufferError(f"sample({n}): buffer {self.name!r} is empty; push rows first")
                    raise EmptyBufferError(
                        f"sample({n}, replace=False): buffer {self.name!r} holds only {len(ring)} rows"
                    )
                batch = self._fetch(ids, lambda k, taken: (self._uniform(k, replace, taken), None),
                                    unique=not replace, out=out)
            if n_step > 1:
                sequences.add_n_step(self, batch, int(n_step), float(gamma), fields)
            return batch

        return self._counted(n, timeout, draw)

    def _counted(self, rows: int, timeout: float | None, draw: Callable[[], Any]) -> Any:
        """Run a sample, counting its ``rows`` as sampled; with a rate limiter, wait for it and
        count atomically before drawing (given back if the draw fails)."""
        ring = self.ring
        limiter = self.options.limiter
        if limiter is None:
            result = draw()
            ring.count_sampled(rows)
            return result
        limiter.check_sample_size(rows)
        limiter.wait(lambda: ring.admit(lambda i, s, size: limiter.can_sample(i, s, size, rows), rows),
                     f"sample of {rows} rows", self._rates, timeout)
        try:
            return draw()
        except BaseException:
            ring.count_sampled(-rows)
            raise

    def _rates(self) -> str:
        ring, limiter = self.ring, self.options.limiter
        assert limiter is not None
        spi = limiter.samples_per_insert
        diff = (spi or 0) * ring.inserted - ring.sampled
        return (f"{ring.inserted} rows inserted, {ring.sampled} sampled, samples_per_insert={spi}, "
                f"min_size={limiter.min_size}: diff {diff:g} vs window {limiter.offset:g} +- {limiter.error:g}")

    def sample_sequences(self, n: int, length: int, *, burn_in: int = 0, time_major: bool = False) -> Batch:
        """``n`` windows of ``length`` consecutive steps of one episode (plus ``burn_in`` steps
        before), fields ``(n, burn_in + length, ...)`` or, ``time_major``, ``(burn_in + length, n,
        ...)``. ``batch.mask`` marks the steps that exist: a window stops at its episode's ends,
        the write head and rows being written; the rest is zeros. See ``sequences.py``."""
        return self._counted(n * (length + burn_in), None, lambda: sequences.sample_sequences(
            self, n, length, burn_in=burn_in, time_major=time_major))

    def sample_groups(self, groups: int, size: int, *, ordered: bool = True) -> Batch:
        """``groups`` groups of ``size`` rows of one episode each, fields ``(groups, size, ...)``:
        consecutive steps when ``ordered``, else distinct steps in random order (DI-engine's
        ``groupby="episode"``). Episodes are drawn in proportion to their rows."""
        return self._counted(groups * size, None, lambda: sequences.sample_groups(self, groups, size, ordered=ordered))

    def sample_episodes(self, n: int) -> list[Batch]:
        """``n`` complete episodes, each a batch of its rows in order (HER relabelling,
        imitation). An episode counts as complete once the next one has started in its lane.
        Its rows count as sampled; a rate limiter does not hold it back."""
        return sequences.sample_episodes(self, n)

    def _uniform(self, k: int, replace: bool, taken: np.ndarray) -> np.ndarray:
        ring = self.ring
        if ring.lanes == 1 and replace:  # the hot path, without building arrays of bounds
            start, stop = ring.span()
            if stop <= start:
                return _NONE
            return start + (self._rng.random(k) * (stop - start)).astype(np.int64)
        first, last = ring.bounds()
        return uniform_ids(self._rng, k, first, last, replace=replace, taken=taken)

    def _sample_tree(self, n: int, replace: bool, out: dict[str, np.ndarray] | None) -> Batch:
        ring = self.ring
        prios = self._prios
        assert prios is not None
        if not replace and n > len(ring):
            raise EmptyBufferError(f"sample({n}, replace=False): buffer {self.name!r} holds only {len(ring)} rows")
        slots, leaves = prios.draw(self._rng, n, stratified=True)
        if slots.size == 0:
            if len(ring) == 0:
                raise EmptyBufferError(f"sample({n}): buffer {self.name!r} is empty; push rows first")
            why = (f"has been drawn max_use={prios.max_use} times" if prios.max_use is not None
                   else "has priority 0 (a prioritized buffer with eps=0 draws no row of priority 0)")
            raise EmptyBufferError(f"sample({n}): every row of buffer {self.name!r} {why}")

        def ids_of(slots: np.ndarray, leaves: np.ndarray) -> np.ndarray:
            ids = ring.ids_of_slots(slots)
            ids[leaves <= 0] = INVALID  # a draw that raced an update onto a used-up slot
            return ids

        def redraw(k: int, taken: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            more, values = prios.draw(self._rng, k, stratified=False)
            return ids_of(more, values), values

        batch = self._fetch(ids_of(slots, leaves), redraw, unique=not replace, extra=leaves, tree=True, out=out)
        if isinstance(prios.sampler, Prioritized):
            beta = prios.sampler.beta_at(self._calls)
            batch.extras["weight"] = prios.weights(batch.extras.pop("_extra"), beta)
        else:
            batch.extras.pop("_extra")
        self._calls += 1
        return batch

    def _gather(
        self, slots: np.ndarray, out: dict[str, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
        """Stamps, rows, stamps again: the reader's half of the commit protocol (``ring.py``)."""
        stamp = self.ring.stamp
        first = stamp.take(slots)
        if out is None:
            block = self._block.take(slots, axis=0) if self._block is not None else None
            big = {name: col.take(slots, axis=0) for name, col in self._big.items()}
        else:
            block = self._block.take(slots, axis=0, out=out["_block"]) if self._block is not None else None
            big = {name: col.take(slots, axis=0, out=out[name]) for name, col in self._big.items()}
        if self._episode is not None:  # part of the row: read between the two stamp reads
            big["_episode"] = self._episode.take(slots)
        second = stamp.take(slots)
        return first, second, block, big

    def _batch(self, ids: np.ndarray, block: np.ndarray | None, big: dict[str, np.ndarray]) -> Batch:
        fields = self._record.views(block) if block is not None else {}
        fields.update(big)
        ordered = {name: fields[name] for name in self.schema.names}
        extras = {"index": ids}
        if "_episode" in big:
            extras["episode"] = big["_episode"]
        return Batch(ordered, extras, block=block, record=self._record if block is not None else None)

    def _fetch(
        self,
        ids: np.ndarray,
        redraw: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray | None]],
        *,
        unique: bool,
        extra: np.ndarray | None = None,
        tree: bool = False,
        out: dict[str, np.ndarray] | None = None,
    ) -> Batch:
        """Gather ``ids``; re-draw every row that was not committed before and after the gather.

        ``redraw(k, ids)`` gives ``k`` new ids (and their ``extra`` values, e.g. tree leaves).
        With ``unique`` a row may appear once; with ``max_use`` every row is claimed (its use
        counted) under the lock once it is gathered, and re-drawn when it has no uses left. After
        ``REDRAW_ROUNDS`` rounds the slow path starts: dead writers' rows are reaped and uniform
        draws come from a scan of the committed rows; after ``GIVE_UP`` seconds, ``WaitTimeout``.
        """
        ring = self.ring
        first, second, block, big = self._gather(ring.slots(ids), out)
        expect = ring.expected(ids)
        first ^= expect
        second ^= expect
        first |= second
        cleared = ring.cleared(ids)  # after the gather: a row cleared before it does not count
        if cleared.size:
            first[cleared] = 1
        bad = np.flatnonzero(first) if first.any() else _NONE
        claiming = tree and self.options.max_use is not None
        unclaimed = np.arange(ids.size) if claiming else _NONE
        rounds = 0
        deadline = 0.0
        while True:
            while bad.size:
                rounds += 1
                if rounds == REDRAW_ROUNDS + 1:
                    deadline = time.monotonic() + GIVE_UP
                    self._reap()
                    if tree and unique and self._prios is not None:
                        drawable = int(np.count_nonzero(self._prios.tree.leaves))
                        if drawable < ids.size:
                            raise EmptyBufferError(
                                f"sample({ids.size}, replace=False): only {drawable} rows of buffer "
                                f"{self.name!r} can be drawn; the others are used up (max_use="
                                f"{self.options.max_use}) or empty"
                            )
                elif rounds > REDRAW_ROUNDS and time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"buffer {self.name!r}: {bad.size} of {ids.size} rows could not be drawn in "
                        f"{GIVE_UP:.0f} s ({rounds} rounds): rows are being written or used up"
                    )
                if rounds > REDRAW_ROUNDS and not tree:
                    new, values = self._scan(bad.size, ids, unique), None
                else:
                    new, values = redraw(bad.size, ids)
                if new.size < bad.size:  # nothing to draw from right now (cleared, or used up)
                    if len(ring) == 0:
                        raise EmptyBufferError(f"buffer {self.name!r} was emptied (cleared) while sampling")
                    if tree and self._prios is not None and self._prios.tree.total <= 0:
                        raise EmptyBufferError(f"buffer {self.name!r}: no rows left to draw")
                    time.sleep(0.0005)
                    continue
                ids[bad] = new
                if extra is not None and values is not None:
                    extra[bad] = values
                first, second, rows, more = self._gather(ring.slots(new))
                if block is not None and rows is not None:
                    block[bad] = rows
                for name, col in more.items():
                    big[name][bad] = col
                expect = ring.expected(new)
                stale = (first != expect) | (second != expect)
                cleared = ring.cleared(new)
                if cleared.size:
                    stale[cleared] = True
                bad = bad[stale]
            if unique and tree:
                bad = _repeats(ids, unclaimed if claiming else None)
                if bad.size:
                    continue
            if claiming and unclaimed.size:
                bad = unclaimed = self._claim(ids, unclaimed)
                if bad.size:
                    continue
            break
        batch = self._batch(ids, block, big)
        if extra is not None:
            batch.extras["_extra"] = extra
        return batch

    def _claim(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Count a use for each of ``positions``; return those that must be re-drawn."""
        ring = self.ring
        prios = self._prios
        assert prios is not None
        with ring.lock:
            mine = ids[positions]
            live = ring.current(mine)
            ok = np.zeros(positions.size, bool)
            ok[live] = prios.claim(ring.slots(mine[live]))
        return positions[~ok]

    def _reap(self) -> np.ndarray:
        prios = self._prios
        if prios is None:
            return self.ring.reap()
        return self.ring.reap(also=lambda slots: prios.tree.update(slots, 0.0))

    def _scan(self, k: int, taken: np.ndarray, unique: bool) -> np.ndarray:
        """``k`` ids drawn uniformly from a scan of the committed rows (the slow path)."""
        ok = self.ring.committed_ids()
        if unique:
            ok = ok[~np.isin(ok, taken)]
        if ok.size < (k if unique else 1):
            return _NONE
        return self._rng.choice(ok, size=k, replace=not unique)

    def epoch(self, batch_size: int, *, shuffle: bool = True, drop_last: bool = False) -> Iterator[Batch]:
        """Every row held now, once, in batches of ``batch_size`` (epoch-style sampling without
        replacement; PPO and PPG iterate a rollout like this). Rows used up (``max_use``) are
        left out, and every row given counts a use; rows overwritten during the epoch are dropped
        from their batch, so a batch can be short; the last one is short unless ``drop_last``."""
        if (type(batch_size) is not int and not isinstance(batch_size, np.integer)) or batch_size <= 0:
            raise ValueError(f"epoch: expected a positive batch size, got {batch_size!r}")
        ring = self.ring
        first, last = ring.bounds()
        ids = np.concatenate([np.arange(a, b) * ring.lanes + lane for lane, (a, b) in enumerate(zip(first, last, strict=True))])
        if self._prios is not None and self.options.max_use is not None:
            ids = ids[self._prios.tree.leaves[ring.slots(ids)] > 0]
        if shuffle:
            ids = self._rng.permutation(ids)
        stop = ids.size - ids.size % batch_size if drop_last else ids.size
        for at in range(0, stop, batch_size):
            chunk = ids[at:at + batch_size].copy()
            first_stamp, second_stamp, block, big = self._gather(ring.slots(chunk))
            expect = ring.expected(chunk)
            fine = (first_stamp == expect) & (second_stamp == expect)
            fine[ring.cleared(chunk)] = False
            keep = np.flatnonzero(fine)
            if self.options.max_use is not None and self._prios is not None:
                keep = np.setdiff1d(keep, self._claim(chunk, keep), assume_unique=True)
            if keep.size < chunk.size:
                chunk = chunk[keep]
                block = block[keep] if block is not None else None
                big = {name: col[keep] for name, col in big.items()}
            if chunk.size:
                ring.count_sampled(int(chunk.size))
                yield self._batch(chunk, block, big)

    def take(self, ids: Any) -> Batch:
        """Rows by id (an earlier ``batch.index``; DI-engine's ``sample(indices=...)``), as a
        stamped copy. Raises ``EmptyBufferError`` naming ids whose rows are gone (overwritten,
        cleared, or being written), ``UnknownIdError`` (a ``FieldError`` and an
        ``EmptyBufferError``) naming ids that never named a row, ``FieldError`` for ids that are
        not integers."""
        ring = self.ring
        ids = check_ids(ids, "take", ring.bounds()[1])
        if not ids.size:
            raise ValueError("take: expected at least one id")
        first, second, block, big = self._gather(ring.slots(ids))
        expect = ring.expected(ids)
        lane = ids % ring.lanes
        ok = (ids >= 0) & (first == expect) & (second == expect) & (ids // ring.lanes >= ring.bounds()[0][lane])
        ok[ring.cleared(ids)] = False
        if not ok.all():
            gone = ids[~ok]
            raise EmptyBufferError(
                f"take: {gone.size} of {ids.size} rows are no longer in buffer {self.name!r} "
                f"(ids {gone[:5].tolist()}{' ...' if gone.size > 5 else ''}: overwritten, cleared or being written)"
            )
        return self._batch(ids, block, big)

    def loader(self, batch_size: int = 256, **kwargs: Any) -> Any:
        """A ``Loader`` over this buffer: batches on a device, sampled ahead (``loader.py``)."""
        from .loader import Loader

        return Loader(self, batch_size, **kwargs)

    # -- persistence (persistence.py) -----------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, progress: bool | Callable[[int, int], None] = False,
             wait: float = 1.0) -> dict[str, Any]:
        """Save to the directory ``path`` (safetensors + JSON) while writers may go on."""
        from .persistence import save

        return save(self, path, progress=progress, wait=wait)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, name: str | None = None, capacity: int | None = None,
             seed: int | np.random.Generator | None = None) -> ReplayBuffer:
        """A new buffer holding a save: the same rows, ids, priorities and uses (Velora's ``load``)."""
        from .persistence import load

        return load(path, name=name, capacity=capacity, seed=seed)

    def export(self) -> dict[str, np.ndarray]:
        """All rows as numpy arrays in ``get`` order, plus ``index`` (and ``episode``)."""
        from .persistence import export

        return export(self)

    get_all_transitions = export  # cpprb
    export_data = export  # DI-engine

    @classmethod
    def from_arrays(cls, schema: Schema | Mapping[str, Any], arrays: Mapping[str, Any],
                    capacity: int | None = None, **options: Any) -> ReplayBuffer:
        """A new buffer of these rows (DI-engine's ``import_data``)."""
        from .persistence import from_arrays

        return from_arrays(schema, arrays, capacity, **options)

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
            if np.array_equal(first, expect) and np.array_equal(second, expect) and not ring.cleared(ids).size:
                break
            now = ring.stamp.take(ring.slots(ids))
            if np.any(now < expect) and not np.any(now[now < expect] & 1):
                raise EmptyBufferError(f"get({index!r}): a row was lost: its writer died mid-push")
            if time.monotonic() > deadline:
                if self._reap().size:
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


def _repeats(ids: np.ndarray, fresh: np.ndarray | None) -> np.ndarray:
    """Positions whose id also appears at an earlier position (or, when ``fresh`` lists the
    positions drawn last, at a position not among them): the ones to re-draw."""
    order = np.argsort(ids, kind="stable")
    if fresh is not None and fresh.size < ids.size:
        # keep the rows already claimed: sort them first among equal ids
        later = np.zeros(ids.size, bool)
        later[fresh] = True
        order = np.lexsort((later, ids))
    same = ids[order][1:] == ids[order][:-1]
    return np.sort(order[1:][same])


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
