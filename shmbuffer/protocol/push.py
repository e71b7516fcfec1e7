"""A push: check, lay out (frames), reserve, copy, commit; the whole of it, and its C fast path.

``ReplayBuffer.push`` (and ``check``) come here. The steps, in order:

1. **check** (``check``): every field against the schema (``Copier.fast_check`` first: arrays of
   exactly the fields' dtypes and shapes pass as they are; the rest goes through
   ``Schema.validate``), the lane(s), the episode ids, the priorities. Nothing is touched yet.
2. **lay out** (``frames_push.Pusher.expand``, buffers with ``next_of``/``stack`` only): the rows as stored,
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from .. import arguments, native
from ..errors import FieldError, ReadOnlyError
from ..schema import Schema, stack_rows
from ..shm.lock import resume_signals
from .frames_push import Pusher
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
    (the packed record at the field's offset, or its own column) and the block's per-row columns'
    values (``Block.row``: the episode ids ...); the caller then calls ``Ring.commit``. ``lib`` is
    ``None`` without the extension (or a column not C-contiguous, a dtype not passed as a buffer):
    the caller copies with numpy."""

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
        self.row = block.row
        self.stamp = block.stamp
        self.names = tuple(targets)
        self.columns = tuple(targets[n][0] for n in self.names)
        self.offsets = tuple(targets[n][1] for n in self.names)
        self.shapes = tuple(tuple(int(d) for d in self.fields[n].shape[1:]) for n in self.names)
        self.items = tuple(math.prod(s) for s in self.shapes)
        columns = [*self.columns, self.stamp, *self.row.values()]
        formats = [_format(np.dtype(targets[n][2])) for n in self.names]
        usable = all(c.flags.c_contiguous for c in columns) and all(f is not None for f in formats)
        self.formats = tuple(f or b"" for f in formats)
        self.lib = native.lib if usable else None
        self.plan = None
        if (self.lib is not None and ring.native_view is not None and 0 < len(self.names) <= 64
                and all(len(s) <= 16 for s in self.shapes) and len(self.row) == (self.episode is not None)):
            # the whole push in C writes the episode ids and no other per-row column (docs/design.md)
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

    def prepare(self, arrays: dict[str, np.ndarray], row: dict[str, Any], k: int,
                exact: bool = False) -> tuple[np.ndarray, ...]:
        """The sources of a push's copies, made before its reservation so that nothing between the
        reservation and the commit can fail: each field's ``k`` rows (``arrays``, checked by the
        schema, or ``exact``: by ``check``, taken as they are) cast, broadcast, C-contiguous and
        aligned as its column takes them (numpy's assignment rules), then the values (``row``, by
        column name) of each of the block's per-row columns (``Block.row``)."""
        if exact and not self.row:
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
        for name, col in self.row.items():
            out.append(np.empty(k, col.dtype))
            out[-1][...] = row[name]
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
            if self.row:
                more = self.row.values()
                cols, offsets = (*cols, *more), (*offsets, *(0 for _ in more))
                formats = (*formats, *(_format(c.dtype) or b"" for c in more))
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
        """The columns a numpy copy writes, field by field, then the block's per-row columns
        (``Block.row``; the seam where a test stops a copy midway)."""
        return [*(self.fields[name] for name in self.names), *self.row.values()]


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
    if timeout is not None:
        timeout = arguments.timeout(timeout, "push: timeout")
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
    sources = copier.prepare(arrays, {"_episode": episodes}, k, exact and ex is None)  # every cast before the reservation

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


class NativePush:
    """``push(...)`` in C for its usual calls (``_native.PushMethod``, ``native/method.c``) on the
    class ``cls``: a bound method like any other, seated on each buffer (``seat``) so that
    ``buf.push`` is a plain attribute read; where the buffer has a C push plan its usual calls
    skip the Python method. Without the extension nothing changes (``method`` is ``None``)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.method: Any = None if native.lib is None else native.lib.PushMethod(vars(cls)["push"])
        if self.method is None:
            return
        cls.push = self.method  # type: ignore[attr-defined]
        unseat = self.method.unseat

        def __del__(buf: Any) -> None:
            unseat(buf)  # a push read from this buffer and held elsewhere keeps it alive (method.c)

        cls.__del__ = __del__  # type: ignore[attr-defined]

    def seat(self, buf: Any, plan: Any) -> None:
        """Seat ``buf.push`` with the C push's ``plan`` (``None``: the Python method takes every
        call), unless ``buf``'s class has a push of its own (overridden, or patched on the class)."""
        m = self.method
        if m is not None and next(vars(k)["push"] for k in type(buf).__mro__ if "push" in vars(k)) is m:
            m.unseat(buf)  # a push held elsewhere keeps this buffer, and its plan (method.c)
            buf.push = m.seat(buf, plan)

    def unseat(self, buf: Any) -> None:
        """Take ``buf``'s seated push out (``close``): ``push`` is the method again, which says closed."""
        if self.method is not None:
            self.method.unseat(buf)
