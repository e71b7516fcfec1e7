"""A push: check, lay out (frames), reserve, copy, commit; the whole of it, and its C fast path.

``ReplayBuffer.push`` (and ``check``) come here. The steps, in order:

1. **check** (``check``): every field against the schema (``Copier.fast_check`` first: arrays of
   exactly the fields' dtypes and shapes pass as they are; the rest goes through
   ``Schema.validate``), the lane(s), the episode ids, the priorities. Nothing is touched yet.
2. **lay out** (``Pusher.expand``, buffers with ``next_of``/``stack`` only): the rows as stored,
   end rows and lead rows included, checked against this process's previous rows in each lane.
3. **prepare** (``Copier.prepare``): every cast and broadcast, so nothing after the reservation
   can fail for the data's sake.
4. **reserve** (``Ring.reserve``): under the lock, the slots' stamps turn odd (``rows.writing``),
   new rows take their priorities, signal handlers wait until the commit.
5. **copy** (``Copier.copy``): all or nothing, one C call, else numpy putting back what it wrote
   over if an assignment raises.
6. **commit** (``Ring.commit``): the stamps turn even (``rows.committed``); a push that fails
   between reserve and commit is undone (``Ring.undo``: never a hole where it can be helped).

**The fast path** (``fast_push``): where a push needs nothing but the ring and the columns
(uniform, no rate limiter that blocks writers, no frames), steps 1 and 3-6 are one C call
(``_native.push``), which returns ``None`` wherever the steps above must decide or explain.

Pushes (``Pusher``)
-------------------
A pushed row either continues its lane (this process wrote the lane's previous row and it did not
end its episode) or starts an episode. A continuing row's source must equal the previous row's
pushed next observation, and its stack's older frames the previous stack's newer ones; a starting
row's stack must be padding plus its newest frame. Anything else is refused before the buffer is
touched (``FieldError``). After the reservation the pusher checks that the rows really follow its
previous row (no other writer took the lane meanwhile), else it gives the rows back and raises. A
row that continues an episode in a lane cleared since (``clear()``) starts the lane again: its
stack's older frames go into lead rows, as with ``resume``, so no read reaches the cleared rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .. import native
from ..errors import FieldError, ReadOnlyError
from ..frames import END, KIND, LEAD, START, ZERO, Frames, Stack, frames_of
from ..schema import Schema, stack_rows
from ..shm.lock import resume_signals
from .layout import Block, Counter, Options, check_lanes
from .priorities import check_priorities
from .reader import Source
from .ring import Reservation, Ring

FastPush = Callable[[Any, Any, Any], "np.ndarray | None"]
"""``push(data, lane, episode) -> ids | None``: a whole push as one C call (``fast_push``)."""


class Copier:
    """A push as C calls (``native``), planned once per buffer: ``c_push`` is
    ``_native.push(plan, data, lane, episode)``, a whole push (checks, lanes, reservation, copies,
    commit) in one call for the usual case, returning the ids, or ``None`` where the Python steps
    must decide or explain (``push``). ``fast_check`` is the fast path of the schema's checks for
    those steps: a dict of exactly the fields, each a C-contiguous array of the field's dtype and
    shape (one row) or ``(k, *shape)``, needs no cast nor reshape; anything else is left to
    ``Schema.validate``. ``copy`` copies each field's rows into the reserved slots of its column
    (the packed record at the field's offset, or its own column) and the episode ids with them;
    the caller then calls ``Ring.commit``. ``lib`` is ``None`` without the extension (or when a
    column is not C-contiguous, or a dtype cannot be passed as a buffer): the caller copies with
    numpy."""

    def __init__(self, block: Block, ring: Ring, envs: int | None) -> None:
        targets: dict[str, tuple[np.ndarray, int, np.dtype]] = {}
        if block.packed is not None:
            for name, offset in block.stored_record.offsets.items():
                targets[name] = (block.packed, offset, block.fields[name].dtype)
        for name, col in block.large.items():
            targets[name] = (col, 0, col.dtype)
        self.targets = targets
        self.fields = block.fields
        self.episode = block.episode
        self.stamp = block.stamp
        self.names = tuple(targets)
        self.columns = tuple(targets[n][0] for n in self.names)
        self.offsets = tuple(targets[n][1] for n in self.names)
        self.shapes = tuple(tuple(int(d) for d in self.fields[n].shape[1:]) for n in self.names)
        self.items = tuple(math.prod(s) for s in self.shapes)
        columns = [*self.columns, self.stamp]
        if self.episode is not None:
            columns.append(self.episode)
        formats = [_format(np.dtype(targets[n][2])) for n in self.names]
        usable = all(c.flags.c_contiguous for c in columns) and all(f is not None for f in formats)
        self.formats = tuple(f or b"" for f in formats)
        self.lib = native.lib if usable else None
        self.plan = None
        if self.lib is not None and ring.native_view is not None and 0 < len(self.names) <= 64 and all(len(s) <= 16 for s in self.shapes):
            widths = tuple(int(np.dtype(targets[n][2]).itemsize * math.prod(s)) for n, s in zip(self.names, self.shapes, strict=True))
            self.plan = self.lib.plan(
                (ring.lock.memory, ring.cursors, ring.stats_array, ring.stamp, ring.owner, ring.writers, ring.me),
                tuple(zip(self.names, self.formats, self.shapes, widths, self.columns, self.offsets, strict=True)),
                self.episode, envs or 0)

    def c_push(self) -> FastPush | None:
        """``push(data, lane, episode) -> ids | None``: the whole push as one C call (see the class),
        or ``None`` without the extension."""
        return None if self.plan is None else partial(self.lib.push, self.plan)  # type: ignore[union-attr]

    def close(self) -> None:
        """Release the plan's views of the block (``ReplayBuffer.close``): a push callable still held
        somewhere then leaves every push to Python, which says the buffer is closed."""
        if self.plan is not None:
            self.lib.plan_close(self.plan)  # type: ignore[union-attr]

    def fast_check(self, data: object) -> tuple[int, dict[str, np.ndarray]] | None:
        """``(k, rows)`` when ``data`` passes the fast checks (one row's arrays keep their shape,
        without a leading dimension), else ``None``."""
        if self.plan is None or type(data) is not dict:
            return None
        got = self.lib.check(self.plan, data)  # type: ignore[union-attr]
        return None if got is None else (got[0], data)

    def prepare(self, arrays: dict[str, np.ndarray], episodes: np.ndarray | None, k: int,
                exact: bool = False) -> tuple[np.ndarray, ...]:
        """The sources of a push's copies, made before its reservation so that nothing between the
        reservation and the commit can fail: each field's ``k`` rows (``arrays``, checked by the
        schema, or ``exact``: by ``check``, taken as they are) cast, broadcast, C-contiguous and
        aligned as its column takes them (numpy's assignment rules), then the episode ids when
        the block keeps them."""
        if exact and (episodes is None or self.episode is None):
            return tuple([arrays[name] for name in self.names])
        out = []
        for name, items in zip(self.names, self.items, strict=True):
            a, dtype = arrays[name], self.targets[name][2]
            if isinstance(a, np.generic) and k == 1 and items == 1 and a.dtype == dtype:
                pass  # a numpy scalar of the field's dtype: one aligned item
            elif not (type(a) is np.ndarray and a.dtype == dtype and a.size == k * items
                      and a.flags.c_contiguous and a.flags.aligned):
                b = np.empty((k, *self.fields[name].shape[1:]), dtype)
                b[...] = a  # numpy's assignment: the cast and the broadcast of one row
                a = b
            out.append(a)
        if episodes is not None and self.episode is not None:
            e = np.empty(k, np.int64)
            e[...] = episodes
            out.append(e)
        return tuple(out)

    def copy(self, res: Reservation, sources: tuple[np.ndarray, ...]) -> None:
        """Copy ``sources`` (``prepare``'s) into ``res``'s slots, all or nothing: one C call (it
        checks everything before it copies), else numpy into ``numpy_targets``, keeping the rows
        it writes over and putting them back if an assignment raises."""
        where = res.where
        lib = self.lib
        if lib is not None:
            at, k = (where.start, where.stop - where.start) if isinstance(where, slice) else (where, where.shape[0])
            cols, offsets, formats = self.columns, self.offsets, self.formats
            if len(sources) > len(self.names) and self.episode is not None:
                cols, offsets, formats = (*cols, self.episode), (*offsets, 0), (*formats, _format(np.dtype(np.int64)) or b"")
            if lib.put(at, k, self.stamp, cols, offsets, formats, sources, False):
                return
        targets = self.numpy_targets()[:len(sources)]
        kept = [t[where].copy() for t in targets]
        done = 0
        res.dirty = True  # from here bytes may differ from the rows the slots held
        try:
            for t, a in zip(targets, sources, strict=True):
                t[where] = a
                done += 1
        except BaseException:
            for t, old in zip(targets[:done + 1], kept, strict=False):
                t[where] = old
            res.dirty = False  # put back (a restore that raised leaves it set: undo then abandons)
            raise

    def numpy_targets(self) -> list[np.ndarray]:
        """The columns a numpy copy writes, field by field, then the episode ids when the block
        keeps them (the seam where a test stops a copy midway)."""
        out = [self.fields[name] for name in self.names]
        if self.episode is not None:
            out.append(self.episode)
        return out


def _format(dtype: np.dtype) -> bytes | None:
    """The buffer-protocol format of ``dtype``, or ``None`` when it has none (datetimes)."""
    try:
        return memoryview(np.empty(0, dtype)).format.encode()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def fast_push(src: Source, copier: Copier, pusher: Pusher | None) -> FastPush | None:
    """The whole push as one C call (``Copier.c_push``), where a push needs nothing but the
    ring and the columns: uniform (no priorities to set), no rate limiter that blocks writers, no
    frames (``pusher``). ``None`` elsewhere, or without the extension."""
    limiter = src.options.limiter
    if pusher is not None or src.priorities is not None or (limiter is not None and limiter.gates_writers):
        return None
    return copier.c_push()


class _Cleared(FieldError):
    """A lane was cleared between a frames push's checks and its reservation (``Pusher.confirm``)."""


def push(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, timeout: float | None,
    fields: dict[str, Any], pusher: Pusher | None = None, resume: bool = False, fast: FastPush | None = None,
    flush: Any = False,
) -> np.ndarray:
    """``_push_once``; a frames push that a ``clear()`` overtook (undone, nothing stored) is checked and
    laid out again against the cleared lane, up to three times."""
    for _ in range(2):
        try:
            return _push_once(src, copier, data, lane=lane, episode=episode, priority=priority, timeout=timeout,
                         fields=fields, pusher=pusher, resume=resume, fast=fast, flush=flush)
        except _Cleared:
            pass  # checked again, against the lane as the clear left it
    return _push_once(src, copier, data, lane=lane, episode=episode, priority=priority, timeout=timeout,
                 fields=fields, pusher=pusher, resume=resume, fast=fast, flush=flush)


def _push_once(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, timeout: float | None,
    fields: dict[str, Any], pusher: Pusher | None = None, resume: bool = False, fast: FastPush | None = None,
    flush: Any = False,
) -> np.ndarray:
    """``ReplayBuffer.push``, whose usual case ``fast`` took first where it could: check
    everything (``check``); with ``fast`` the checked rows (cast, reshaped) take it; else reserve (marking the rows
    odd, their priorities set, under the lock; signals deferred until the commit), copy (one C
    call through ``copier``, else numpy; every cast made before the reservation), commit; a push
    that fails after its reservation leaves no hole where that can be helped (``Ring.undo``). With
    ``next_of``/``stack`` the ``pusher`` (``frames.py``) checks the rows against this process's
    previous ones in each lane and lays them out as stored, end rows included."""
    ring = src.ring
    given = lane is not None
    k, arrays, lane, episodes, priority, exact = _checked(src, copier, data, lane=lane, episode=episode,
                                                         priority=priority, fields=fields)
    prios = src.priorities
    if k == 0:
        return np.empty(0, np.int64)
    ex = None
    if pusher is not None:
        ex = pusher.expand(arrays, k, lane, episodes, ring.bounds(), resume, flush)
        arrays, episodes = ex.arrays, ex.episodes
        k = ex.lanes.shape[0]
        lane = int(ex.lanes[0]) if (ex.lanes == ex.lanes[0]).all() else ex.lanes
        ring.check_push(k, lane)
    # new rows take their priority (and no uses) inside the reservation's critical section:
    # while they are being written a draw that lands on them sees an odd stamp and re-draws
    kept: list[Callable[[], None]] = []  # what puts the priorities back if the push is undone
    also = None
    if prios is not None:
        def also(slots: np.ndarray) -> None:  # under the reservation's lock
            kept.append(prios.set_new_rows(slots, priority))
    rows = k  # the transitions this push inserts (a rate limiter's and stats' "inserted")
    if ex is not None and ex.rows.size < k:
        rows = int(ex.rows.size)
        ends = np.setdiff1d(np.arange(k), ex.rows)
        if prios is not None and priority is not None:
            given_ = np.zeros(k)
            given_[ex.rows] = np.broadcast_to(priority, (ex.rows.size,))
            priority = given_

        def also(slots: np.ndarray) -> None:  # under the reservation's lock
            if prios is not None:  # an end row is never drawn
                kept.append(prios.set_new_rows(slots, priority))
                prios.tree.update(slots[ends], 0.0)
            src.block.counters[Counter.INSERTED] -= k - rows  # an end row is not an insert
    limiter = src.options.limiter
    gated = limiter is not None and limiter.gates_writers
    if fast is not None:
        ring.writer_id()  # registers this process (the C push refuses one it does not name)
        ids = fast(arrays, lane, episodes)
        if ids is not None:
            note_interleaving(src, ids, episodes, given)
            return ids
    sources = copier.prepare(arrays, episodes, k, exact and ex is None)  # every cast before the reservation

    def restore() -> None:
        for put_back in kept:
            put_back()

    res = None
    copied = False
    try:
        if gated:
            assert limiter is not None
            res = ring.reserve(k, lane, gate=lambda i, s, size: limiter.can_insert(i, s, size, rows),
                               why=lambda: limiter.state(ring), also=also, restore=restore, deferring=True,
                               timeout=limiter.timeout if timeout is None else timeout)
        else:
            res = ring.reserve(k, lane, also=also, restore=restore, deferring=True)
        if pusher is not None and ex is not None:
            refused = pusher.confirm(ex, res.n, ring.base(np.arange(ring.lanes)))
            if refused is not None:  # the reservation is undone below
                raise (_Cleared if refused[1] else FieldError)(refused[0])
        # from here to the commit, signal handlers wait (lock.py): a Ctrl-C cannot leave the
        # rows odd under this live process; it is raised once they are committed
        copier.copy(res, sources)  # all or nothing
        copied = True
        ring.commit(res)
    except BaseException:
        # never a hole: rows copied whole are committed; else, while nobody reserved since, the
        # ring is put back as it was; else the rows read as empty, never as committed
        if res is not None:
            ring.undo(res, copied=copied, restore=restore,
                      lost=None if prios is None else (lambda slots: prios.tree.update(slots, 0.0)))
            if copied and pusher is not None and ex is not None:
                pusher.done(ex, res.n)  # committed by undo: the lane goes on from them
        raise
    finally:
        if res is not None:
            resume_signals()  # a signal that came meanwhile is raised here
    if pusher is not None and ex is not None:
        pusher.done(ex, res.n)
        return res.ids[ex.rows]
    note_interleaving(src, res.ids, episodes, given)
    return res.ids


def check(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, fields: dict[str, Any],
) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``ReplayBuffer.check``: everything a push checks, without touching the buffer."""
    return _checked(src, copier, data, lane=lane, episode=episode, priority=priority, fields=fields)[:5]


def _checked(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, fields: dict[str, Any],
) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """``check``, and whether the rows passed the fast checks (``Copier.fast_check``: the fields'
    dtypes and shapes, C-contiguous; the copy takes them as they are): ``normalise`` with this
    buffer's fast checks, then what only the ring can refuse (frozen)."""
    prios = src.priorities
    got = normalise(src.block.schema, src.options, data, lane=lane, episode=episode, priority=priority, fields=fields,
                    fast=copier.fast_check, check_priority=prios.check if prios is not None else None)
    if src.ring.frozen:
        raise ReadOnlyError(f"buffer {src.name!r} is frozen (read-only): it takes no more rows")
    return got


def normalise(
    schema: Schema, options: Options, data: Any, *, lane: Any, episode: Any, priority: Any, fields: dict[str, Any],
    fast: Callable[[Mapping[str, Any]], tuple[int, dict[str, np.ndarray]] | None] | None = None,
    check_priority: Callable[[Any, int], np.ndarray] | None = None,
) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """A push's arguments checked and normalised with nothing but the buffer's schema and options,
    as every writer takes them (``ReplayBuffer.push``, Ray's ``RemoteWriter``): the rows ``k``, the
    arrays (``fast``'s when it takes them as they are, else ``Schema.validate``'s), the lane(s), the
    episode ids, the priorities (``check_priority``, else ``check_priorities`` with the sampler's
    leaf bound), and whether ``fast`` took them. ``data`` is a mapping or a list of row mappings;
    a ``"priority"`` key that is not a field is the rows' priority (Ape-X)."""
    if data is not None:
        if fields:
            raise TypeError("push() takes a mapping or keyword fields, not both")
        fields = data if isinstance(data, Mapping) else stack_rows(data, schema)  # type: ignore[assignment]
    if "priority" in fields and "priority" not in schema.names:  # Ape-X: inside the row
        if priority is not None:
            raise TypeError("push() got a priority both in the row and as priority=; give one")
        fields = dict(fields)
        priority = fields.pop("priority")
    quick = fast(fields) if fast is not None else None  # arrays of the fields' dtypes and shapes
    k, arrays = quick if quick is not None else schema.validate(fields)
    if lane is None:
        lane = options.default_lane(k)
    if type(lane) is not int or not 0 <= lane < options.lanes or k > options.lane_capacity:  # the usual case is cheap
        given = np.asarray(lane)
        lane = int(given) if given.ndim == 0 and given.dtype.kind in "iu" else np.asarray(lane, dtype=np.int64)
        check_lanes(k, lane, options.lanes, options.lane_capacity)
    episodes = options.check_episode(episode, k)
    if priority is not None:
        if not options.sampler.prioritized:
            raise FieldError("priority: this buffer samples uniformly; create it with sampler=Prioritized(...)")
        priority = check_priority(priority, k) if check_priority is not None else \
            check_priorities(priority, k, sampler=options.sampler)
    return k, arrays, lane, episodes, priority, quick is not None


def note_interleaving(src: Source, ids: np.ndarray, episodes: np.ndarray | None, given: bool) -> None:
    """Mark the buffer when a push without ``lane=`` (``given``) shows one episode's rows apart in
    the lane (with the row before it): a vector env's steps pushed into one lane, whose consecutive
    rows are not one env's steps, so windows would silently shrink to one step (``sequences.py``
    refuses them from then on). One env's chunk of steps (``[7, 7, 8]``) is fine."""
    block = src.block
    if given or ids.size < 2 or episodes is None or not episodes.ndim or src.options.envs is not None:
        return
    if block.interleaved or block.episode is None or not (episodes != episodes[0]).any():
        return
    seq = episodes
    before = ids[:1] - 1
    if before[0] >= src.ring.bounds()[0][0]:
        seq = np.concatenate([block.episode[src.ring.slots(before)], episodes])
    runs = seq[np.r_[True, seq[1:] != seq[:-1]]]
    if np.unique(runs).size < runs.size:
        block.mark_interleaved()


# -- frames: the rows as stored ---------------------------------------------------------------------------------------
def _at(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]``, a view when ``rows`` are consecutive (the usual push: one env's steps)."""
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and (rows.size < 3 or (np.diff(rows) == 1).all()):
        return a[int(rows[0]):int(rows[-1]) + 1]
    return a[rows]


def _older(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The older ``k - 1`` frames of each stack, in the field's layout (a view)."""
    at = [slice(None)] * stacks.ndim
    at[1 + s.axis] = slice(0, (s.k - 1) * s.width)
    return stacks[tuple(at)]


def _newer(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The newer ``k - 1`` frames of each stack, in the field's layout (a view)."""
    at = [slice(None)] * stacks.ndim
    at[1 + s.axis] = slice(s.width, None)
    return stacks[tuple(at)]


def last_of_lanes(lanes: np.ndarray) -> np.ndarray:
    """Which rows of a push with these lane numbers (one a row) are their lane's last."""
    k = lanes.shape[0]
    out = np.zeros(k, bool)
    _, last = np.unique(lanes[::-1], return_index=True)
    out[k - 1 - last] = True
    return out


def _flushed(flush: Any, lanes: np.ndarray) -> np.ndarray:
    """The rows ``flush`` names (``Pusher.expand``): ``True``, each lane's last row; else one flag a row."""
    k = lanes.shape[0]
    if flush is True:
        return last_of_lanes(lanes)
    flags = np.asarray(flush)
    if flags.dtype != bool or flags.shape != (k,):
        raise FieldError(f"flush: expected True or one bool a row ({k}), got {flags.dtype} of shape {flags.shape}")
    return flags


def _first_unequal(a: np.ndarray, b: np.ndarray, rows: np.ndarray) -> int | None:
    """The first of ``rows`` whose ``a`` and ``b`` rows differ (bit for bit), or ``None``."""
    if not rows.size:
        return None
    same = (_bits(a) == _bits(b)).reshape(rows.size, -1).all(axis=1)
    if same.all():
        return None
    return int(rows[np.flatnonzero(~same)[0]])


def _bits(a: np.ndarray) -> np.ndarray:
    """Floats as unsigned ints of their size: compared bit for bit (what a read gives back), so
    ``-0.0`` is not ``0.0`` and a NaN equals itself."""
    if a.dtype.kind == "f" and a.dtype.itemsize in (2, 4, 8):
        return a.view(np.dtype(f"u{a.dtype.itemsize}"))
    return a


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(_bits(a), _bits(b)))


def _lane(lanes: dict[int, int], row: int) -> str:
    return f" (lane {lanes[row]})" if row in lanes else ""

def end_rows(spec: Frames, stored: Schema, nexts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stored fields of end rows (``frames.py``), ``_kind`` included: each ``next_of`` source
    holds the next observation of the step before (``nexts``: the next fields, one row per end
    row; the newest frame when stacked), every other field zeros."""
    m = next(iter(nexts.values())).shape[0]
    sources = {src: nxt for nxt, src in spec.next_of}
    out: dict[str, np.ndarray] = {}
    for f in stored:
        if f.name in sources:
            b, s = nexts[sources[f.name]], spec.stacked(f.name)
            out[f.name] = np.asarray(frames_of(s, b)[:, -1] if s is not None else b, f.dtype)
        else:
            out[f.name] = np.zeros((m, *f.shape), f.dtype)
    out[KIND] = np.full(m, END, np.uint8)
    return out


@dataclass
class Last:
    """What this process pushed last into a lane."""

    row: int
    final: bool
    episode: int | None
    values: dict[str, np.ndarray]
    """the last row's pushed stacks and next observations, to check the row that follows"""


@dataclass
class Expanded:
    """A push as stored: ``arrays`` of the stored schema plus ``_kind``, ``lanes`` one per stored
    row, ``episodes`` (or ``None``), ``rows`` the positions of the pushed transitions among them,
    and per lane the first stored position and whether it continues this process's last row;
    ``restarted`` the lanes it starts again after a ``clear()`` (lead rows)."""

    arrays: dict[str, np.ndarray]
    lanes: np.ndarray
    episodes: np.ndarray | None
    rows: np.ndarray
    firsts: dict[int, tuple[int, bool]]
    lasts: dict[int, Last]
    restarted: frozenset[int] = frozenset()


class Pusher:
    """One process's memory of the rows it pushed last into each lane (the module docstring)."""

    def __init__(self, spec: Frames, schema: Schema, stored: Schema) -> None:
        self.spec, self.schema, self.stored = spec, schema, stored
        self.last: dict[int, Last] = {}
        self.pid = os.getpid()
        self.compared = {s.name for s in spec.stack} | {n for pair in spec.next_of for n in pair}
        """the fields the continuity checks compare"""

    def expand(self, arrays: dict[str, np.ndarray], k: int, lane: int | np.ndarray, episodes: np.ndarray | None,
               bounds: tuple[np.ndarray, np.ndarray], resume: bool = False, flush: Any = False) -> Expanded:
        """Check a push of ``k`` checked rows and lay it out as stored rows (nothing is touched).
        The walk over the rows decides which continue which; the data checks then run on all the
        rows at once. With ``resume`` a row that starts an episode may hold real older frames:
        they go into lead rows before it (the module docstring). With ``next_of``, ``flush``
        (``True``: each lane's last row of the push; or one flag per row) stores those rows' next
        observations now, in an end row after each, as after an episode's last step: the lane's
        next row starts an episode, and the flushed rows are transitions at once."""
        spec = self.spec
        if self.pid != os.getpid():  # a forked child: the parent's rows are not this process's
            self.last, self.pid = {}, os.getpid()
        lanes = np.full(k, lane, np.int64) if not isinstance(lane, np.ndarray) else lane
        eps = None if episodes is None else np.broadcast_to(episodes, (k,))
        full = {n: np.broadcast_to(a, (k, *self.schema[n].shape)) for n, a in arrays.items()}
        for n in self.compared:  # compared as stored: a float64 0.1 pushed as next_obs is float32's 0.1
            if full[n].dtype != self.schema[n].dtype:
                full[n] = full[n].astype(self.schema[n].dtype)
        final = np.zeros(k, bool)
        for name in spec.ends:
            final |= full[name].reshape(k) != 0
        nexts = bool(spec.next_of)
        if nexts and flush is not False:
            final |= _flushed(flush, lanes)
        start_, stop_ = bounds
        kinds = np.zeros(k, np.uint8)
        firsts: dict[int, tuple[int, bool]] = {}
        prev_of: dict[int, int] = {}
        inside: list[tuple[int, int]] = []  # (row, the row of this push it continues)
        remembered: list[tuple[int, int, Last]] = []  # (row, lane, this process's last row it continues)
        starts: list[tuple[int, int]] = []  # (row, lane) that start an episode, or a lane again
        cleared: set[int] = set()  # rows that continue an episode in a lane cleared since
        lane_list, final_list = lanes.tolist(), final.tolist()
        eps_list = None if eps is None else eps.tolist()
        for i in range(k):
            ln = lane_list[i]
            p = prev_of.get(ln)
            if p is None:
                last = self.last.get(ln)
                # the lane's newest row is this process's last; a clear() since then moves the
                # lane's cursor up to a lane boundary and the lane reads as empty until the next
                # push, which starts the lane again: its older frames go into lead rows (as with
                # resume), so its stacks never reach the cleared rows
                cont = (last is not None and not last.final
                        and (last.row == stop_[ln] - 1 or (start_[ln] == stop_[ln] and last.row < stop_[ln]))
                        and (eps_list is None or last.episode == eps_list[i]))
                if cont and last is not None:
                    remembered.append((i, ln, last))
                    if start_[ln] == stop_[ln]:
                        cleared.add(i)
                firsts[ln] = (i, cont)
            else:
                cont = not final_list[p] and (eps_list is None or eps_list[p] == eps_list[i])
                if cont:
                    inside.append((i, p))
            if not cont or i in cleared:
                starts.append((i, ln))
            prev_of[ln] = i
        self._checked(full, inside, remembered)
        depth = max((st.k for st in spec.stack), default=1) - 1
        lead = np.zeros(k, np.int64)  # lead rows before each row (resume)
        for i, ln in starts:
            try:
                kinds[i] = START | self._padding(full, i, ln)
            except FieldError:
                if not resume and i not in cleared:
                    raise
                lead[i] = depth  # an episode resumed: its older frames go into lead rows
        # stored rows per pushed row i: its lead rows, the row, the end row after it (next_of)
        ends_after = final & nexts
        count = lead + 1 + ends_after
        begin = np.concatenate([[0], np.cumsum(count)[:-1]])
        src_row = np.repeat(np.arange(k), count)
        offset = np.arange(int(count.sum())) - begin[src_row]  # position in the row's group
        is_lead = offset < lead[src_row]
        is_end = offset > lead[src_row]
        at = begin + lead  # the pushed rows' stored positions
        firsts = {ln: (int(begin[i]), cont) for ln, (i, cont) in firsts.items()}
        lasts = {ln: Last(-1, final_list[i], None if eps_list is None else eps_list[i],  # copies: the caller
                          {n: a.copy() for n, a in self._values(full, i).items()})  # may reuse its arrays
                 for ln, i in prev_of.items()}
        ends = end_rows(spec, self.stored, {n: full[n][src_row[is_end]] for n, _ in spec.next_of}) \
            if is_end.any() else None
        out: dict[str, np.ndarray] = {}
        for f in self.stored:
            a = full[f.name]
            s = spec.stacked(f.name)
            if s is not None:
                a = frames_of(s, a)[:, -1]  # the newest frame
            col = np.ascontiguousarray(a[src_row])
            if ends is not None:
                col[is_end] = ends[f.name]
            if is_lead.any():
                if s is not None:  # lead row j of a group holds frame j - (depth - (k - 1)), the oldest at least
                    pick = np.maximum(offset[is_lead] - (depth - (s.k - 1)), 0)
                    col[is_lead] = frames_of(s, full[f.name][src_row[is_lead]])[np.arange(pick.size), pick]
                else:
                    col[is_lead] = 0
            out[f.name] = col
        kind = kinds[src_row]
        kind[is_end] = END
        kind[is_lead] = LEAD
        kind[begin[lead > 0]] |= START
        out[KIND] = kind
        return Expanded(out, lanes[src_row], None if eps is None else np.ascontiguousarray(eps[src_row]),
                        at, firsts, lasts, frozenset(lane_list[i] for i in cleared))

    def _values(self, full: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
        keep = {s.name for s in self.spec.stack} | {n for n, _ in self.spec.next_of}
        return {n: full[n][i] for n in keep}

    def _checked(self, full: dict[str, np.ndarray], inside: list[tuple[int, int]],
               remembered: list[tuple[int, int, Last]]) -> None:
        """Refuse the push unless each continuing row continues its previous row (a row of this
        push, ``inside``, or this process's last row of the lane, ``remembered``), and, with a
        stacked next observation, unless every row's next stack is its stack a frame on."""
        spec = self.spec
        sources = {src: nxt for nxt, src in spec.next_of}
        rows = np.array([i for i, _ in inside], np.int64)
        prevs = np.array([p for _, p in inside], np.int64)
        lanes = {i: ln for i, ln, _ in remembered}
        for src, nxt in sources.items():
            bad = _first_unequal(_at(full[src], rows), _at(full[nxt], prevs), rows)
            for i, _, last in remembered:
                if not _same(full[src][i], last.values[nxt]):
                    bad = i if bad is None else min(bad, i)
            if bad is not None:
                raise FieldError(
                    f"field {src!r}: row {bad}{_lane(lanes, bad)} does not continue the lane's previous row: its "
                    f"{src} differs from that row's {nxt} (next_of={src!r} stores it once). Push each env's "
                    "steps in order into its own lane, and mark an episode's last step with done/terminated/truncated")
        for s in spec.stack:
            if s.name in sources:
                nxt = sources[s.name]
                every = np.arange(full[s.name].shape[0])
                bad = _first_unequal(_older(s, full[nxt]), _newer(s, full[s.name]), every)
                if bad is not None:
                    raise FieldError(
                        f"field {nxt!r}: row {bad}: its older frames differ from the newer frames of its "
                        f"{s.name}; the next observation must be the stack after the step")
                continue  # the stacks themselves were checked whole above
            bad = _first_unequal(_older(s, _at(full[s.name], rows)), _newer(s, _at(full[s.name], prevs)), rows)
            for i, _, last in remembered:
                if not _same(_older(s, full[s.name][i][None]), _newer(s, last.values[s.name][None])):
                    bad = i if bad is None else min(bad, i)
            if bad is not None:
                raise FieldError(
                    f"field {s.name!r}: row {bad}{_lane(lanes, bad)}: its older {s.k - 1} frames differ from the "
                    "lane's previous rows (stack= stores one frame a row). Push each env's steps in order into its "
                    "own lane, and mark an episode's last step with done/terminated/truncated")

    def _padding(self, full: dict[str, np.ndarray], i: int, lane: int) -> int:
        """``ZERO`` or 0 for a row that starts an episode, from how its stacks are padded."""
        zero = None
        for s in self.spec.stack:
            fr = frames_of(s, full[s.name][i][None])[0]
            older, newest = fr[:-1], fr[-1]
            if not newest.any() and not older.any():
                continue  # zeros padded with zeros or with copies of itself: either reads the same
            if all(np.array_equal(o, newest) for o in older):
                got = False
            elif not older.any():
                got = True
            else:
                raise FieldError(
                    f"field {s.name!r}: row {i} starts an episode in lane {lane} (this process has no earlier row "
                    "of it there, or the previous one ended its episode), but its older frames are neither copies "
                    "of its newest frame (Gymnasium's FrameStackObservation) nor zeros (SB3's VecFrameStack). "
                    "Push an episode's steps in order from its first, each env into its own lane")
            if zero is not None and got != zero:
                raise FieldError(f"field {s.name!r}: row {i}: stacked fields are padded differently")
            zero = got if zero is None else zero
        return ZERO if zero else 0

    def confirm(self, ex: Expanded, n: np.ndarray, base: np.ndarray) -> tuple[str, bool] | None:
        """After the reservation (``n``: the stored rows' row numbers): ``None`` when every lane's
        first row continues what this process expected, else why not, and whether the push may
        simply be checked again (a lane cleared since ``expand`` looked); the caller gives the rows
        back, then checks again or raises."""
        for ln, (at, cont) in ex.firsts.items():
            last = self.last.get(ln)
            # the row after this process's last, or the lane's first after a clear() that came since
            first = int(n[at]) == int(base[ln])
            follows = last is not None and (int(n[at]) == last.row + 1 or (first and last.row < int(n[at])))
            if cont and not follows:
                return (f"lane {ln}: another writer pushed into it between this process's rows; with next_of/stack "
                        "each lane must be written by one process at a time"), False
            if cont and first and ln not in ex.restarted:  # cleared after expand looked: no lead rows
                return (f"lane {ln} was cleared (clear()) each time this push was being checked; nothing was "
                        "stored: push the same rows again"), True
        return None

    def done(self, ex: Expanded, n: np.ndarray) -> None:
        """After the commit: remember each lane's last row."""
        for ln, last in ex.lasts.items():
            at = np.flatnonzero(ex.lanes == ln)
            last.row = int(n[at[-1]])
            self.last[ln] = last
