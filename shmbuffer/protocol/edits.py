"""Writing rows: a push (checks, reserve, copy, commit), and update and delete of committed rows.

A push checks everything before it touches the buffer, reserves its rows under the lock (``ring.py``:
marked odd, priorities set, signals deferred until the commit), copies every field (one C call
through ``ring.Copier``, else numpy), and commits; a push without ``lane=`` that shows one
episode's rows apart in a lane marks the buffer interleaved (``note_interleaving``; windows refuse
it from then on).


``update`` rewrites fields of current rows in place: under the lock each row's stamp turns odd
again with its own row number (this process its owner), ``Counter.UPDATES`` counts the update,
and signal handlers wait; the fields are copied; the stamp turns even again. A reader that meets
the row meanwhile re-draws it, and since the stamp ends where it began, a reader whose copy spans
the whole update sees ``UPDATES`` move and reads those rows again (``reader.gather``: no ABA). A copy
that fails leaves the rows empty (never torn). ``delete`` sets the stamps and tree leaves of
current rows to 0 under the lock: never sampled, taken, exported or saved again (a save keeps a
hole). Once a buffer has lost a row this way or by ``max_use`` (``Counter.REMOVED``), ``len``
scans the held slots (``removed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import FieldError, ReadOnlyError
from ..frames import END, KIND, LEAD, Pusher
from ..schema import as_numpy, stack_rows
from ..shm.lock import defer_signals, resume_signals
from .layout import Counter
from .reader import Source
from .ring import Copier
from .rows import slot

OneCall = Callable[[Any, Any, Any], "np.ndarray | None"]


def update(src: Source, ids: np.ndarray, fields: dict[str, Any], priority: Any = None) -> int:
    """``ReplayBuffer.update``: overwrite ``fields`` of the rows ``ids`` (checked ids) that are
    still current, under the commit protocol (the module docstring); returns how many."""
    ring = src.ring
    schema = src.block.schema
    fields = dict(fields)
    if "priority" in fields and "priority" not in schema.names:
        if priority is not None:
            raise TypeError("update() got a priority both in the row and as priority=; give one")
        priority = fields.pop("priority")
    unknown = [n for n in fields if n not in schema.names]
    if unknown:
        raise FieldError(f"update: no field {unknown[0]!r}; the schema has {', '.join(schema.names)}")
    spec = src.block.frames
    shared = [n for n in fields if spec is not None and n in spec.rebuilt + tuple(s for _, s in spec.next_of)]
    if shared:
        raise FieldError(f"update: field {shared[0]!r} is stored once for several rows (next_of/stack): "
                         "it cannot be rewritten in place; update the other fields")
    if ring.frozen:
        raise ReadOnlyError(f"buffer {src.name!r} is frozen (read-only): its rows cannot be updated")
    k = int(ids.size)
    prios = src.priorities
    if priority is not None:
        if prios is None or not prios.prioritized:
            raise FieldError("priority: this buffer samples uniformly; create it with sampler=Prioritized(...)")
        priority = prios.check(priority, k, "update: priority")
    arrays: dict[str, np.ndarray] = {}
    if fields:
        full: dict[str, Any] = {}
        for f in schema:
            if f.name in fields:
                a = as_numpy(fields[f.name])
                full[f.name] = np.broadcast_to(a, (k, *a.shape)) if a.shape == f.shape else a
            else:
                full[f.name] = np.zeros((k, *f.shape), f.dtype)
        got, checked = schema.validate(full)
        if got != k:
            raise FieldError(f"update: {k} ids but {got} rows of fields")
        arrays = {n: checked[n] for n in fields}
    if not k:
        return 0
    w = ring.writer_id()
    with ring.lock:
        live = ring.current(ids)
        idx = ids[live]
        slots = ring.slots(idx)
        ring.owner[slots] = w  # the owner first: an odd stamp always names its writer
        ring.stamp[slots] = ring.expected(idx) - 1
        src.block.counters[Counter.UPDATES] += 1  # after the odd stamps (reader._unless_updated)
        if priority is not None and prios is not None:
            prios.set_rows(slots, priority[live], fresh=False)
        defer_signals()  # outlasts the lock: nothing interrupts until the stamps are even again
    try:
        try:
            for name, a in arrays.items():
                src.block.fields[name][slots] = a[live]
        except BaseException:
            with ring.lock:  # a half-updated row must not be read: it leaves the buffer
                ring.stamp[slots] = 0
                if prios is not None:
                    prios.remove(slots)
                else:
                    src.block.arrays["_stats"][Counter.REMOVED] = 1
            raise
        ring.stamp[slots] = ring.expected(idx)
    finally:
        resume_signals()
    return int(live.sum())


def delete(src: Source, ids: np.ndarray) -> int:
    """``ReplayBuffer.delete``: remove the rows ``ids`` (checked ids) that are still current;
    returns how many."""
    ring = src.ring
    if ring.frozen:
        raise ReadOnlyError(f"buffer {src.name!r} is frozen (read-only): its rows cannot be deleted")
    if src.block.frames is not None:
        raise FieldError(
            f"delete: buffer {src.name!r} stores observations once for several rows (next_of/stack): a deleted "
            "row would take its neighbours' next observations and frames with it; lower the rows' priorities "
            "(update_priorities) or use max_use instead")
    prios = src.priorities
    with ring.lock:
        live = ring.current(ids)
        slots = np.unique(ring.slots(ids[live]))
        if not slots.size:
            return 0
        src.block.arrays["_stats"][Counter.REMOVED] = 1  # before the rows go: len never over-counts
        ring.stamp[slots] = 0
        if prios is not None:
            prios.remove(slots)
    return int(slots.size)


def end_rows(src: Source) -> int:
    """Held slots that are not transitions (``next_of``, ``stack``): end rows holding an episode's
    final observation, lead rows (``push(resume=True)``, a lane started again after ``clear()``),
    and with ``next_of`` each lane's newest row while it waits for its next one."""
    kind = src.block.arrays[KIND]
    ring = src.ring
    nexts = src.block.frames is not None and bool(src.block.frames.next_of)
    first, stop = ring.bounds()
    lc = ring.lane_capacity
    count = 0
    for lane in range(ring.lanes):
        a, b = int(first[lane]), int(stop[lane])
        if b - a >= lc:
            count += int(np.count_nonzero(kind[lane * lc:(lane + 1) * lc] & (END | LEAD)))
        elif b > a:
            count += int(np.count_nonzero(kind[slot(lane, np.arange(a, b), lc)] & (END | LEAD)))
        if nexts and b > a and not kind[slot(lane, (b - 1), lc)] & (END | LEAD):
            count += 1  # the newest row: its next observation is not pushed yet
    return count


def removed(src: Source) -> int:
    """Held slots (within the lanes' bounds) that are empty or hold a used-up row."""
    ring = src.ring
    first, stop = ring.bounds()
    lc = ring.lane_capacity
    gone = 0
    prios = src.priorities
    for lane in range(ring.lanes):
        a, b = int(first[lane]), int(stop[lane])
        if b <= a:
            continue
        if b - a >= lc:
            slots: slice | np.ndarray = slice(lane * lc, (lane + 1) * lc)
        else:
            slots = slot(lane, np.arange(a, b), lc)
        stamp = ring.stamp[slots]
        empty = stamp == 0
        gone += int(empty.sum())
        if prios is not None and prios.uses is not None and prios.max_use is not None:
            gone += int(((prios.uses[slots] >= prios.max_use) & ~empty).sum())
    return gone


def one_call(src: Source, copier: Copier, pusher: Pusher | None) -> OneCall | None:
    """The whole push as one C call (``ring.Copier.one_call``), where a push needs nothing but the
    ring and the columns: uniform (no priorities to set), no rate limiter that blocks writers, no
    frames (``pusher``). ``None`` elsewhere, or without the extension."""
    limiter = src.options.limiter
    if pusher is not None or src.priorities is not None or (limiter is not None and limiter.gates_writers):
        return None
    return copier.one_call()


class _Cleared(FieldError):
    """A lane was cleared between a frames push's checks and its reservation (``Pusher.confirm``)."""


def push(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, timeout: float | None,
    fields: dict[str, Any], pusher: Pusher | None = None, resume: bool = False, one_call: OneCall | None = None,
) -> np.ndarray:
    """``_push``; a frames push that a ``clear()`` overtook (undone, nothing stored) is checked and
    laid out again against the cleared lane, up to three times."""
    for _ in range(2):
        try:
            return _push(src, copier, data, lane=lane, episode=episode, priority=priority, timeout=timeout,
                         fields=fields, pusher=pusher, resume=resume, one_call=one_call)
        except _Cleared:
            pass  # checked again, against the lane as the clear left it
    return _push(src, copier, data, lane=lane, episode=episode, priority=priority, timeout=timeout,
                 fields=fields, pusher=pusher, resume=resume, one_call=one_call)


def _push(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, timeout: float | None,
    fields: dict[str, Any], pusher: Pusher | None = None, resume: bool = False, one_call: OneCall | None = None,
) -> np.ndarray:
    """``ReplayBuffer.push``, whose usual case ``one_call`` took first where it could: check
    everything (``check``); with ``one_call`` the checked rows (cast, reshaped) take it; else reserve (marking the rows
    odd, their priorities set, under the lock; signals deferred until the commit), copy (one C
    call through ``copier``, else numpy; every cast made before the reservation), commit; a push
    that fails after its reservation leaves no hole where that can be helped (``Ring.undo``). With
    ``next_of``/``stack`` the ``pusher`` (``frames.py``) checks the rows against this process's
    previous ones in each lane and lays them out as stored, end rows included."""
    ring = src.ring
    given = lane is not None
    k, arrays, lane, episodes, priority, exact = _check(src, copier, data, lane=lane, episode=episode,
                                                         priority=priority, fields=fields)
    prios = src.priorities
    if k == 0:
        return np.empty(0, np.int64)
    ex = None
    if pusher is not None:
        ex = pusher.expand(arrays, k, lane, episodes, ring.bounds(), resume)
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
    if one_call is not None:
        ring.writer_id()  # registers this process (the one call refuses one it does not name)
        ids = one_call(arrays, lane, episodes)
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
        copier.put(res, sources, src.block.fields)  # all or nothing
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
    return _check(src, copier, data, lane=lane, episode=episode, priority=priority, fields=fields)[:5]


def _check(
    src: Source, copier: Copier, data: Any, *, lane: Any, episode: Any, priority: Any, fields: dict[str, Any],
) -> tuple[int, dict[str, np.ndarray], int | np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """``check``, and whether the rows passed the fast checks (``Copier.check``: the fields'
    dtypes and shapes, C-contiguous; the copy takes them as they are)."""
    schema = src.block.schema
    if data is not None:
        if fields:
            raise TypeError("push() takes a mapping or keyword fields, not both")
        fields = data if isinstance(data, Mapping) else stack_rows(data, schema)  # type: ignore[assignment]
    if "priority" in fields and "priority" not in schema.names:  # Ape-X: inside the row
        if priority is not None:
            raise TypeError("push() got a priority both in the row and as priority=; give one")
        fields = dict(fields)
        priority = fields.pop("priority")
    ring = src.ring
    fast = copier.check(fields)  # arrays of the fields' dtypes and shapes (ring.Copier)
    k, arrays = fast if fast is not None else schema.validate(fields)
    given = lane is not None
    if not given:
        lane = src.options.default_lane(k)
    if type(lane) is not int or not 0 <= lane < ring.lanes or k > ring.lane_capacity:  # the usual case is cheap
        lane = int(lane) if isinstance(lane, (int, np.integer)) else np.asarray(lane, dtype=np.int64)
        ring.check_push(k, lane)
    if ring.frozen:
        raise ReadOnlyError(f"buffer {src.name!r} is frozen (read-only): it takes no more rows")
    episodes = src.options.check_episode(episode, k)
    if priority is not None:
        if src.priorities is None or not src.priorities.prioritized:
            raise FieldError("priority: this buffer samples uniformly; create it with sampler=Prioritized(...)")
        priority = src.priorities.check(priority, k)
    return k, arrays, lane, episodes, priority, fast is not None


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
