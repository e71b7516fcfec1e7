"""What a buffer's block holds: its options, its column table and named views of the columns.

This module is the one owner of the layout inside a block (``segment.py`` owns the bytes around
it: header, metadata, alignment). The same table creates a block, checks it at attach, tells
persistence what to save and the CLI where to read; nothing else names an internal column.

Columns, in block order
-----------------------
``_mutex``        64 bytes, the ``RobustLock`` (``lock.py``)
``_lanes``        ``(lanes, 8)`` int64, one cache line a lane: ``[l, CURSOR]`` rows ever reserved in
                  lane ``l``, ``[l, BASE]`` the first row number that counts after a ``clear()``
``_stats``        ``(16,)`` int64, shared counters, never wrapping; index ``Counter``
``_writer_pid``, ``_writer_start``  ``(WRITERS,)`` the processes that have pushed or sampled (``ring.py``)
``_sampled``      ``(WRITERS,)`` int64, rows each writer entry's processes sampled without the lock
``_stamp``, ``_owner``, the first two per-row columns (``ROW_COLUMNS``)
``_edits``        ``(EDIT_LOG,)`` int64, the slots of the latest in-place changes, a ring (``Counter.EDITS``)
``_tree_sum``, ``_tree_min``, ``_prio``  the priority tree, the largest priority; with ``Options.tree``
the other per-row columns, ``(capacity,)`` each: ``ROW_COLUMNS``, the one list of them
``_record``       ``(capacity, itemsize)`` uint8, the packed small fields (``schema.Record``)
one column per large field, named as the field, ``(capacity, *shape)`` in its dtype

With ``next_of`` or ``stack`` (``Options.rows``) the record and the large columns are those of the
*stored* schema (``frames.Frames.stored``: stacked fields one frame wide, next fields gone); the
block's ``schema`` stays the user's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

import numpy as np

from .. import native
from ..errors import CapacityError, FieldError, LayoutError, UnknownSampler
from ..frames import KIND, PLAIN, Frames
from ..sampling.limiter import RateLimiter
from ..sampling.samplers import Sampler, Uniform, sampler_from_json
from ..sampling.sumtree import SumTree
from ..schema import Record, Schema
from ..shm.lock import SIZE as MUTEX_SIZE
from ..shm.segment import MALFORMED, ColumnSpec, Segment

WRITERS = 1024
UNIFORM = Uniform()
"""Entries in the writer table: processes that may push to one buffer at once."""


class Counter(IntEnum):
    """Where each shared counter lives in ``_stats`` (readers' and writers' on separate lines)."""

    SAMPLED = 0
    """rows handed out by samples counted under the lock (a rate limiter's admissions, a loaded
    buffer's count); the others are in ``_sampled`` (``Ring.sampled`` adds them up)"""
    SAMPLE_CALLS = 1
    """sample calls made, all processes (the annealing of ``Prioritized.beta``); counted without
    the lock, so two processes sampling at the same instant may count once (approximate then)"""
    UPDATES = 2
    """updates of stored rows begun (``ReplayBuffer.update``, under the lock, after their rows
    turned odd): a reader whose copy this count moved across discards it (``gather.gather``)"""
    DELETES = 3
    """deletes of stored rows (``ReplayBuffer.delete``, under the lock, after their stamps went to
    0): a device copy's lag question (``device/replay.py``) counts them as a change"""
    DEVICE_ROWS = 4
    """``INSERTED`` as the newest refresh of a device copy of this buffer read it (0: none yet);
    ``INSERTED - DEVICE_ROWS`` is how many rows the copy is behind (``top``)"""
    DEVICE_AT = 5
    """when that refresh read the lanes, ``time.monotonic_ns()`` (one clock for every process of
    the host), 0 once the copy closed; with several device copies, the newest refresh's"""
    RECLAIMED = 8
    """rows of dead writers reclaimed or reaped"""
    LOCK_RECOVERIES = 9
    """times a locker found the lock's holder dead"""
    INSERTED = 10
    """rows ever reserved, all lanes; a clear does not move it"""
    REMOVED = 13
    """1 once a row was deleted or used up (``max_use``): ``len`` then leaves such rows out"""
    FROZEN = 11
    """1 once the buffer is read-only"""
    INTERLEAVED = 12
    """1 once a push without ``lane=`` put rows of several episodes into one lane (a vector env's
    step): windows (n-step, sequences, groups, episodes) are refused from then on"""
    EDITS = 14
    """slots of rows changed in place ever logged in ``_edits`` (an ``update``, a ``delete``, a
    failed push put back), each logged once its stamp changed (odd, or 0) and before its bytes
    change (a push put back: before and after its stamps go back): a device copy re-reads exactly
    those (``device/rows.py``), or every row when more than ``EDIT_LOG`` came since it looked"""
    EDITS_BEGUN = 15
    """``EDITS`` as the log will read once the edit being logged is counted, stored before its
    entries: a reader that finds it more than ``EDIT_LOG`` past the first entry it read knows
    that entry may have been overwritten as it read it (``Ring.log_edits``)"""


LANE_WORDS = 8
"""Words (int64) of each lane's row of ``_lanes``: one cache line a lane (``native/layout.h`` too)."""
EDIT_LOG = 1024
"""Entries of ``_edits``: the in-place changes a device copy can follow without copying every row."""


class Lane(IntEnum):
    """Where each lane's numbers live in its row of ``_lanes``."""

    CURSOR = 0
    BASE = 1


ROW, SAMPLER, FIELD = "row", "sampler", "field"
"""How a save holds a per-row column and a load restores it (``RowColumn.saved``)."""


@dataclass(frozen=True)
class RowColumn:
    """A protocol column with one entry a row: a block has it when ``when(options)``; ``gathered``:
    copied with each row under the stamp check (``Block.row``, ``Rows.row``; ``extra`` its key in a
    batch and in ``export``); ``saved``: ``ROW`` from those copies, loaded back into its column;
    ``SAMPLER``, the sampler's state, copied under the lock, loaded through the sampler's checks;
    ``FIELD``, with the stored fields (``Block.large``); ``None``, not saved (a load leaves it as a
    new block has it). ``block``: it has a column of its own (``_leaf`` is the tree's)."""

    name: str
    dtype: np.dtype[Any]
    when: Callable[[Options], bool]
    gathered: bool
    saved: str | None
    extra: str | None = None
    block: bool = True


ROW_COLUMNS = (
    RowColumn("_stamp", np.dtype(np.int64), lambda o: True, False, None),  # each slot's commit stamp (ring.py)
    RowColumn("_owner", np.dtype(np.uint16), lambda o: True, False, None),  # the writer entry that last reserved it
    RowColumn("_uses", np.dtype(np.uint32), lambda o: o.max_use is not None, False, SAMPLER, "uses"),  # draws so far
    RowColumn("_episode", np.dtype(np.int64), lambda o: o.episodes, True, ROW, "episode"),  # episodes=True
    RowColumn("_leaf", np.dtype(np.float64), lambda o: o.tree, False, SAMPLER, "leaf", block=False),  # priorities.py
    RowColumn(KIND, np.dtype(np.uint8), lambda o: o.rows.once, False, FIELD),  # frames.py: start, end rows
)
"""The per-row columns in block order (a save sorts its tensors by itemsize, stably); to add
one: ``docs/design.md``, the memory layout."""


EXTRA = {c.name: c.extra for c in ROW_COLUMNS if c.extra}
"""Each per-row column's key in a batch's extras and in ``export`` (``RowColumn.extra``)."""


def row_columns(opts: Options) -> list[RowColumn]:
    """The per-row columns (``ROW_COLUMNS``) a block of ``opts`` has."""
    return [c for c in ROW_COLUMNS if c.when(opts)]


@dataclass(frozen=True)
class Options:
    """What shapes a block besides its schema; stored in its metadata, read back on attach."""

    capacity: int
    lanes: int = 1
    sampler: Sampler = UNIFORM
    max_use: int | None = None
    episodes: bool = False
    limiter: RateLimiter | None = None
    envs: int | None = None
    """one lane per env: a push without ``lane=`` of ``k`` rows (a multiple of ``envs``, env-major
    per step) puts row ``i`` into lane ``i % envs``"""
    rows: Frames = PLAIN
    """how a row is stored and read: the fields stored once and read from the lane (``frames.py``:
    ``next_of``, ``stack``), ``PLAIN`` for none"""

    def __post_init__(self) -> None:
        cap, lanes, max_use = self.capacity, self.lanes, self.max_use
        if not _count(cap):
            raise ValueError(f"capacity: expected a positive int, got {cap!r}")
        if not _count(lanes) or cap % lanes:
            raise ValueError(f"lanes: expected a positive divisor of capacity {cap}, got {lanes!r}")
        if max_use is not None and not _count(max_use):
            raise ValueError(f"max_use: expected a positive int or None, got {max_use!r}")
        if not isinstance(self.sampler, Sampler):
            raise ValueError(f"sampler: expected a Sampler (Uniform(), Prioritized(...) or a subclass of "
                             f"shmbuffer.Sampler, docs/samplers.md), got {self.sampler!r}")
        if self.limiter is not None and not isinstance(self.limiter, RateLimiter):
            raise ValueError(f"limiter: expected a RateLimiter, got {self.limiter!r}")
        if self.envs is not None and (not _count(self.envs) or self.envs != lanes):
            raise ValueError(f"envs: expected a positive int equal to lanes ({lanes!r}), got {self.envs!r}")
        need = 2 * (self.rows.depth + self.rows.ahead + 1)
        if self.rows.once and cap // lanes < need:
            raise ValueError(f"capacity: a transition of this buffer reads {need // 2} rows of its lane (next_of/stack): "
                             f"expected lanes of {need} rows or more, got {cap // lanes}; raise capacity")

    @property
    def ordered(self) -> bool:
        """Whether each lane must hold one env's steps in order: the buffer keeps episodes, or reads
        next observations and older frames from the lane (``frames.py``)."""
        return self.episodes or self.rows.once

    @classmethod
    def make(cls, schema: Schema, capacity: int, *, sampler: Sampler, max_use: int | None, lanes: int | None,
             envs: int | None, episodes: bool, limiter: RateLimiter | None, next_of: Any, stack: Any) -> Options:
        """The options ``ReplayBuffer(schema, capacity, ...)`` is given, checked (``envs`` sets
        ``lanes``: one lane per env)."""
        if lanes is None:
            lanes = envs if envs is not None else 1
        elif envs is not None and lanes != envs:
            raise ValueError(f"lanes={lanes!r} and envs={envs!r}: envs means one lane per env; give one of them")
        return cls(capacity, lanes, sampler, max_use, episodes, limiter, envs, Frames.make(schema, next_of, stack))

    def arguments(self) -> dict[str, Any]:
        """The ``ReplayBuffer`` keyword arguments (all but ``capacity``) that make these options."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("capacity", "rows")},
                **self.rows.arguments()}

    @property
    def lane_capacity(self) -> int:
        """The slots of each lane."""
        return int(self.capacity) // int(self.lanes)

    @property
    def tree(self) -> bool:
        """Whether draws go through the priority tree (prioritized, or any sampler with max_use)."""
        return self.sampler.prioritized or self.max_use is not None

    def default_lane(self, k: int) -> int | np.ndarray:
        """The lanes of a push of ``k`` rows that names none (see ``envs`` and ``lanes``)."""
        envs = self.envs
        if envs is not None:
            if k % envs:
                raise FieldError(
                    f"lane: this buffer has one lane per env (envs={envs}): a push without lane= takes "
                    f"whole steps of every env, env-major ({envs}, {2 * envs}, ... rows), got {k} rows; "
                    "or name the lanes with lane="
                )
            return 0 if envs == 1 else np.tile(np.arange(envs, dtype=np.int64), k // envs)
        if self.lanes > 1:
            raise FieldError(
                f"lane: this buffer has {self.lanes} lanes and a push without lane= would fill only "
                f"lane 0 (1/{self.lanes} of the capacity): pass lane= (one per row or one for all), "
                "or create the buffer with envs=N to spread a vector env's rows one lane per env"
            )
        return 0

    def check_episode(self, episode: Any, k: int) -> np.ndarray | None:
        """The episode ids of a push of ``k`` rows as int64 (one, or one per row), ``None`` for a
        buffer that keeps none; ``FieldError`` when they are missing, unwanted or malformed."""
        if not self.episodes:
            if episode is not None:
                raise FieldError("episode: this buffer does not keep episodes; create it with episodes=True")
            return None
        if episode is None:
            raise FieldError("episode: this buffer keeps episodes (episodes=True); push(..., episode=id) is required")
        e = np.asarray(episode)
        if e.dtype.kind not in "iu" or e.shape not in ((), (k,)):
            raise FieldError(f"episode: expected an int or {k} ints, got {e.dtype} of shape {e.shape}")
        return e.astype(np.int64, copy=False)

    def to_json(self) -> dict[str, Any]:
        """The options as JSON, kept in the block's metadata."""
        return {"capacity": int(self.capacity), "lanes": int(self.lanes), "sampler": self.sampler.to_json(),
                "max_use": None if self.max_use is None else int(self.max_use), "episodes": bool(self.episodes),
                "limiter": None if self.limiter is None else self.limiter.to_json(),
                **({} if self.envs is None else {"envs": int(self.envs)}),
                **({"frames": self.rows.to_json()} if self.rows.once else {})}

    @classmethod
    def from_json(cls, spec: dict[str, Any], sampler: Any = None) -> Options:
        """The options that ``to_json`` gave; ``sampler`` as ``sampler_from_json``'s ``using``."""
        return cls(spec["capacity"], spec["lanes"], sampler_from_json(spec["sampler"], sampler), spec["max_use"],
                   spec["episodes"], RateLimiter.from_json(spec.get("limiter")), spec.get("envs"),
                   Frames.from_json(spec.get("frames")))


def check_lanes(k: int, lane: int | np.ndarray, lanes: int, lane_capacity: int) -> None:
    """Refuse, before anything is touched, a push of ``k`` rows into ``lane`` (one, or one a row)
    that a ring of ``lanes`` lanes of ``lane_capacity`` slots can never hold (``CapacityError``)."""
    lc = lane_capacity
    if isinstance(lane, np.ndarray):
        lib = native.lib
        if lib is not None and lane.shape == (k,) and lane.dtype == np.int64 and lane.flags.c_contiguous:
            if 0 <= lib.lanes_worst(lane, lanes) <= lc:
                return  # the usual case, in one C call; the checks below say what is wrong
        if lane.shape != (k,):
            raise CapacityError(f"lane: expected one lane per row ({k}), got shape {lane.shape}")
        if lane.dtype.kind not in "iu":
            raise CapacityError(f"lane: expected integer lane numbers, got {lane.dtype}")
        if lane.size and (lane.min() < 0 or lane.max() >= lanes):
            raise CapacityError(f"lane: expected lane numbers in [0, {lanes}), got {lane.min()}..{lane.max()}")
        worst = int(np.bincount(lane).max()) if lane.size else 0
    else:
        if not 0 <= lane < lanes:
            raise CapacityError(f"lane: expected a lane in [0, {lanes}), got {lane}")
        worst = k
    if worst > lc:
        where = "the buffer's capacity" if lanes == 1 else f"a lane's capacity ({lanes} lanes)"
        raise CapacityError(
            f"a push of {worst} rows into one lane is larger than {where} of {lc} rows; "
            "push in smaller batches or raise capacity"
        )


def _count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value > 0)


def columns(schema: Schema, opts: Options) -> list[ColumnSpec]:
    """The block's columns, in order (the module docstring says what each holds)."""
    capacity, lanes = int(opts.capacity), int(opts.lanes)
    i8, u1 = np.dtype(np.int64), np.dtype(np.uint8)
    per_row = [ColumnSpec(c.name, (capacity,), c.dtype) for c in row_columns(opts) if c.block]
    cols = [
        ColumnSpec("_mutex", (MUTEX_SIZE,), u1),
        ColumnSpec("_lanes", (lanes, LANE_WORDS), i8),
        ColumnSpec("_stats", (16,), i8),
        ColumnSpec("_writer_pid", (WRITERS,), i8),
        ColumnSpec("_writer_start", (WRITERS,), np.dtype(np.float64)),
        ColumnSpec("_sampled", (WRITERS,), i8),
        *per_row[:2],  # _stamp, _owner before _edits: sample(256) of 1M rows measured 6-9% slower after it
        ColumnSpec("_edits", (EDIT_LOG,), i8),
    ]
    if opts.tree:
        size = SumTree.size(capacity)
        cols += [ColumnSpec("_tree_sum", (size,), np.dtype(np.float64)),
                 ColumnSpec("_tree_min", (size,), np.dtype(np.float64)),
                 ColumnSpec("_prio", (8,), np.dtype(np.float64))]
    cols += per_row[2:]
    schema = opts.rows.stored(schema)
    if schema.record.itemsize:
        cols.append(ColumnSpec("_record", (capacity, schema.record.itemsize), u1))
    cols += [ColumnSpec(f.name, (capacity, *f.shape), f.dtype) for f in schema.columns]
    return cols


def create(name: str | None, schema: Schema, opts: Options) -> Segment:
    """A new block for ``schema`` and ``opts``: their metadata and the columns (``columns``)."""
    meta = {"schema": schema.to_json(), "options": opts.to_json(), "record": opts.rows.stored(schema).record.itemsize}
    return Segment.create(name, meta, columns(schema, opts), schema.fingerprint)


def read(name: str, meta: dict[str, Any], fingerprint: str, sampler: Any = None) -> tuple[Schema, Options]:
    """The schema and options of a block from its metadata, checked: readable, the schema's
    fingerprint the header's, and the column table the one this release builds for them (another
    release made the block, or it is damaged: ``LayoutError``). ``sampler``: as
    ``sampler_from_json``'s ``using``; a sampler class this process lacks is ``UnknownSampler``,
    not damage."""
    try:
        schema = Schema.from_json(meta["schema"])
        opts = Options.from_json(meta["options"], sampler)
        opts.rows.check(schema)
        expected = [(c.name, list(c.shape), c.dtype.str) for c in columns(schema, opts)]
        stored = [(c["name"], list(c["shape"]), c["dtype"]) for c in meta["columns"]]
    except UnknownSampler as exc:  # a healthy buffer: this process lacks its sampler's class
        raise UnknownSampler(f"buffer {name!r}: {exc}") from None
    except MALFORMED as exc:
        raise LayoutError(
            f"buffer {name!r} is damaged: its schema or options cannot be read "
            f"({type(exc).__name__}: {str(exc)[:200]}); remove it (`shmbuffer gc --force {name}`)"
        ) from None
    if schema.fingerprint != fingerprint:
        raise LayoutError(f"buffer {name!r} is damaged: its schema does not match its fingerprint")
    if stored != expected:
        raise LayoutError(
            f"buffer {name!r} was written with another column layout than this shmbuffer uses; "
            "use the release that created it"
        )
    return schema, opts


class Block:
    """Named views of one block's columns (a segment's)."""

    def __init__(self, schema: Schema, opts: Options, arrays: dict[str, np.ndarray]) -> None:
        self.schema = schema
        """The user's fields (what is pushed and read)."""
        self.options = opts
        self.arrays = arrays
        self.rows = opts.rows
        """How a row is stored and read (``frames.Frames``)."""
        self.stored = self.rows.stored(schema)
        """What a row stores (``frames.py``); the user's schema without ``next_of``/``stack``."""
        self.stored_record: Record = self.stored.record
        """Where pushes write the small stored fields."""
        self.record: Record = self.rows.served(self.stored_record)
        """The small fields a read takes from a row's own record (not the stacked ones)."""
        self.stamp = arrays["_stamp"]
        self.counters = arrays["_stats"]
        """The shared counters, ``Counter`` indexes them (the ring keeps most of them)."""
        self.edits = arrays["_edits"]
        """The log of in-place changes (``Counter.EDITS``, ``Ring.log_edits``): slots, a ring."""
        self.episode: np.ndarray | None = arrays.get("_episode")
        self.row = {c.name: arrays[c.name] for c in row_columns(opts) if c.gathered}
        """The per-row columns gathered with each row (``RowColumn.gathered``), block order."""
        self.packed: np.ndarray | None = arrays.get("_record")
        """The packed small fields, ``(capacity, itemsize)`` uint8, or ``None``."""
        self.large = {f.name: arrays[f.name] for f in self.stored.columns}
        """The stored fields that have a column of their own (and ``_kind`` with ``frames``)."""
        small = self.stored_record.views(self.packed) if self.packed is not None else {}
        self.fields = {name: small[name] if name in small else self.large[name] for name in self.stored.names}
        """Every stored field as a ``(capacity, *shape)`` view, in schema order (and ``_kind``)."""
        self.kinds: np.ndarray | None = arrays.get(KIND)
        """Each row's kind (``frames.KIND``) where fields are stored once: a read assembles a transition
        from rows of its lane; ``None``: each row is a whole transition."""
        if self.kinds is not None:
            self.large[KIND] = self.fields[KIND] = self.kinds

    @property
    def interleaved(self) -> bool:
        """Whether a push without ``lane=`` put rows of several episodes into one lane."""
        return bool(self.counters[Counter.INTERLEAVED])

    def mark_interleaved(self) -> None:
        """Note in the block that one lane has received rows of several envs (windows then refuse it)."""
        self.counters[Counter.INTERLEAVED] = 1
