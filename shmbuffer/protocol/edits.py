"""Rewriting committed rows: update, delete and update_priorities (a push of new rows is ``push.py``'s).

``update`` rewrites fields of current rows in place: under the lock each row's stamp turns odd
again with its own row number (this process its owner), ``Counter.UPDATES`` counts the update,
and signal handlers wait; the fields are copied; the stamp turns even again. A reader that meets
the row meanwhile re-draws it, and since the stamp ends where it began, a reader whose copy spans
the whole update sees ``UPDATES`` move and reads those rows again (``gather.gather``: no ABA). A copy
that fails leaves the rows empty (never torn). ``delete`` sets the stamps and tree leaves of
current rows to 0 under the lock: never sampled, taken, exported or saved again (a save keeps a
hole). Once a buffer has lost a row this way or by ``max_use`` (``Counter.REMOVED``), ``len``
scans the held slots (``reader.held``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..batch import Batch
from ..errors import FieldError, ReadOnlyError
from ..schema import as_numpy, stack_rows
from ..shm.lock import defer_signals, resume_signals
from .layout import Counter
from .reader import Source
from .rows import lane_of, number_of


def ids_of(src: Source, rows: Batch | Any, what: str) -> np.ndarray:
    """The checked ids of ``rows``: a batch (its ``index``) or ids (``Ring.check_ids``)."""
    return src.ring.check_ids(rows.index if isinstance(rows, Batch) else rows, what)


def update(src: Source, rows: Batch | Any, data: Any = None, fields: dict[str, Any] | None = None,
           priority: Any = None) -> int:
    """``ReplayBuffer.update``: overwrite the fields given (``data``, a mapping or a list of rows,
    or ``fields``) of ``rows`` (a batch or ids) that are still current, under the commit protocol
    (the module docstring); returns how many."""
    ids = ids_of(src, rows, "update")
    ring = src.ring
    schema = src.block.schema
    if data is not None:
        if fields:
            raise TypeError("update() takes a mapping or keyword fields, not both")
        fields = dict(data if isinstance(data, Mapping) else stack_rows(data, schema))
    fields = dict(fields or {})
    if "priority" in fields and "priority" not in schema.names:
        if priority is not None:
            raise TypeError("update() got a priority both in the row and as priority=; give one")
        priority = fields.pop("priority")
    unknown = [n for n in fields if n not in schema.names]
    if unknown:
        raise FieldError(f"update: no field {unknown[0]!r}; the schema has {', '.join(schema.names)}")
    spec = src.block.rows
    shared = [n for n in fields if n in spec.rebuilt + tuple(s for _, s in spec.next_of)]
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
        _check_ends(src, idx, slots, {n: a[live] for n, a in arrays.items()})  # under the lock: no push moves the lanes
        ring.owner[slots] = w  # the owner first: an odd stamp always names its writer
        ring.stamp[slots] = ring.expected(idx) - 1
        ring.log_edits(slots)  # once odd, before the bytes change: a device copy re-reads these slots
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


def _check_ends(src: Source, ids: np.ndarray, slots: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
    """With ``next_of``: refuse an update that makes a step its episode's last (an end field
    nonzero) while the next row of its lane goes on with the episode. That row holds the step's
    next observation, and an episode's final one belongs in an end row (``frames.py``), which an
    update cannot add: the rows would read as neither. The lane's newest row (its next row not
    pushed yet) and a row that already ends its episode may be changed."""
    spec = src.block.rows
    if not spec.last_apart or not ids.size:
        return
    ends = [n for n in spec.ends if n in arrays]
    if not ends:
        return
    k = ids.size
    fields = src.block.fields
    ending = np.zeros(k, bool)
    ended = np.zeros(k, bool)
    for n in ends:
        ending |= arrays[n].reshape(k) != 0
    for n in spec.ends:
        ended |= fields[n][slots].reshape(k) != 0
    ring = src.ring
    lane = lane_of(ids, ring.lanes)
    newest = number_of(ids, ring.lanes) == ring.bounds()[1][lane] - 1
    bad = ending & ~ended & ~newest
    if bad.any():
        raise FieldError(
            f"update: field {ends[0]!r} of row {int(ids[bad][0])}: it would end the row's episode, which goes on in "
            "the next row of its lane; with next_of that row holds its next observation, and an episode's final "
            "observation an end row of its own, which an update cannot add. Mark an episode's last step when "
            "it is pushed (a lane's newest row may still be marked)")


def update_priorities(src: Source, given: Any, priorities: Any) -> int:
    """``ReplayBuffer.update_priorities``: set the priorities of rows ``given`` by id, skipping
    those overwritten since; returns how many were set."""
    ring, prios = src.ring, src.priorities
    if prios is None or not prios.prioritized:
        raise FieldError("update_priorities: this buffer samples uniformly; create it with sampler=Prioritized(...)")
    done = prios.try_update(ring, given, priorities)  # the usual case, in one C call
    if done is not None:
        return done
    ids = ring.check_ids(given, "update_priorities")
    p = prios.check(priorities, ids.size, "update_priorities: priority")
    with ring.lock:
        live = ring.current(ids)
        prios.set_rows(ring.slots(ids[live]), p[live], fresh=False)
    return int(live.sum())


def delete(src: Source, rows: Batch | Any) -> int:
    """``ReplayBuffer.delete``: remove the rows (a batch or ids) that are still current;
    returns how many."""
    ids = ids_of(src, rows, "delete")
    ring = src.ring
    if ring.frozen:
        raise ReadOnlyError(f"buffer {src.name!r} is frozen (read-only): its rows cannot be deleted")
    src.block.rows.whole(f"delete from buffer {src.name!r}", "a deleted row would take its neighbours' next "
                         "observations and frames with it; lower the rows' priorities (update_priorities) "
                         "or use max_use instead")
    prios = src.priorities
    with ring.lock:
        live = ring.current(ids)
        slots = np.unique(ring.slots(ids[live]))
        if not slots.size:
            return 0
        src.block.arrays["_stats"][Counter.REMOVED] = 1  # before the rows go: len never over-counts
        ring.stamp[slots] = 0
        ring.log_edits(slots)  # once gone: a refresh that reads the entry never finds them committed
        src.block.counters[Counter.DELETES] += 1
        if prios is not None:
            prios.remove(slots)
    return int(slots.size)


def clear(src: Source) -> None:
    """``ReplayBuffer.clear``: forget every row, and their priorities (``Ring.clear``)."""
    prios = src.priorities
    src.ring.clear(also=prios.clear if prios is not None else None)


def reap(src: Source) -> np.ndarray:
    """``ReplayBuffer.reap``: empty the rows of writers that died mid-push, and take them out of
    the priority tree; returns their slots (``Ring.reap``)."""
    prios = src.priorities
    return src.ring.reap(also=None if prios is None else (lambda slots: prios.tree.update(slots, 0.0)))


def set_uses(src: Source, ids: np.ndarray, uses: np.ndarray) -> None:
    """Give the rows ``ids`` that are still current the use counts ``uses`` (one per id), under
    the lock (``persistence.set_uses``: a load, an import); a buffer without ``max_use`` keeps none."""
    prios, ring = src.priorities, src.ring
    if prios is None or prios.uses is None:
        return
    with ring.lock:
        live = ring.current(ids)
        prios.set_uses(ring.slots(ids[live]), uses[live])
