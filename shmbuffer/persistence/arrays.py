"""Rows as plain numpy arrays: ``export`` (all rows, one copy), ``pieces`` (a piece at a time),
``from_arrays`` (a new buffer of such arrays), ``import_rows`` (push them into a buffer),
``set_uses``, and ``pending`` (with ``next_of``, the rows ``export`` cannot give yet): cpprb's
``get_all_transitions``, DI-engine's ``export_data`` / ``import_data``.

``export`` and ``pieces`` read the rows that ``save`` would save (``snapshot.py``, consistent while
writers run): ``export`` copies them into one array of bytes (``snapshot.MemorySink``) and moves
the rows down over the holes (an export has no holes: ``index`` names each row); ``pieces`` yields
the pieces without keeping them, holes left out (``shmbuffer inspect``). A buffer with
``next_of``/``stack`` exports its transitions instead (``gather.gather``), rebuilt.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import CapacityError, FieldError
from ..frames import Frames, frames_of
from ..progress import Progress as Line
from ..protocol import edits, snapshot
from ..protocol.frames_push import Pusher, last_of_lanes
from ..protocol.gather import assemble, gather, regather
from ..protocol.layout import EXTRA
from ..protocol.rows import lane_of, number_of, row_id
from ..schema import Schema
from .format import tensors
from .snapshot import Buffer, MemorySink, Snapshot, copy_rows

__all__ = ["export", "from_arrays", "import_rows", "pending", "pieces", "set_uses"]


def pieces(buf: Buffer, *, wait: float = 1.0) -> Iterator[dict[str, np.ndarray]]:
    """The rows ``save`` would save, a piece at a time (lanes in turn, oldest first; holes left
    out), each piece copied intact (its fields, and ``_episode`` / ``_leaf`` / ``_uses`` where the
    buffer has them): for statistics over a buffer too large to copy at once. Unlike ``export``, a
    piece already given stays given when writers overwrite its rows later."""
    snap = Snapshot(buf, wait)
    step = snap.piece_rows(buf.schema.row_bytes)
    while any(r.at < r.end for r in snap.runs):
        for run in snap.runs:
            if run.at < run.end:
                got = snap.copy(run, step)
                if got is None:
                    continue
                present = got.arrays.pop("_present")
                if present.all():
                    yield got.arrays
                elif present.any():
                    yield {name: a[present] for name, a in got.arrays.items()}


def export(buf: Buffer) -> dict[str, np.ndarray]:
    """The rows ``save`` would save, as one copy in ``get`` order (lane by lane, oldest first):
    every field, ``index`` (the row ids) and, when the buffer keeps episodes, ``episode``. Holes
    (empty rows) are left out: ``index`` says which rows are there. Consistent as ``save`` is
    while writers run (see "A save while writers run"); the arrays are views of one allocation,
    made once. A prioritized buffer adds ``priority`` (each row's, as ``update_priorities`` set
    it; 0 once used up) and a ``max_use`` buffer ``uses``: ``from_arrays`` and ``import_rows``
    take all of them back. With ``next_of``/``stack``: the transitions that can be read now
    (``gather.gather``; not an episode's end row, not a lane's newest row still waiting for its
    next observation), rebuilt, with their ``priority`` and ``uses`` as above."""
    if buf.options.rows.once:
        return _export_transitions(buf)
    snap = Snapshot(buf, 1.0)
    files = tensors(buf.schema, buf.options)
    sink = MemorySink()
    final, _ = copy_rows(snap, files, sink)
    lanes = len(snap.runs)
    ids = np.concatenate([row_id(np.arange(r.keep, r.end, dtype=np.int64), r.lane, lanes) for r in snap.runs])
    at = final.offsets["_present"]
    present = sink.data[at:at + final.rows].astype(bool)
    rows = final.rows
    if not present.all():  # move every tensor's rows down over the holes, in place, front to back
        there = np.flatnonzero(present)
        breaks = np.flatnonzero(np.diff(there) != 1) + 1
        parts = np.split(there, breaks) if there.size else []
        for t in files:
            dst = final.offsets[t.name]
            for part in parts:
                src, nbytes = final.offsets[t.name] + int(part[0]) * t.row_bytes, part.size * t.row_bytes
                if src != dst:
                    sink.move(src, dst, nbytes)
                dst += nbytes
        ids, rows = ids[there], int(there.size)
    out: dict[str, np.ndarray] = {}
    order = {n: i for i, n in enumerate(buf.schema.names)}
    for t in sorted(files, key=lambda t: order.get(t.name, len(order))):
        key = t.name if t.name in order else EXTRA.get(t.name)
        if key:
            at = final.offsets[t.name]
            out[key] = sink.data[at:at + rows * t.row_bytes].view(t.dtype).reshape(rows, *t.shape)
    leaf = out.pop("leaf", None)
    prios = buf.priorities
    if leaf is not None and prios is not None and prios.prioritized:
        out["priority"] = prios.priorities_of(leaf)
    if "uses" in out:
        out["uses"] = out["uses"].astype(np.int64)
    out["index"] = ids
    return out


def _export_transitions(buf: Buffer) -> dict[str, np.ndarray]:
    """``export`` of a buffer with ``next_of``/``stack``: its readable transitions, rebuilt."""
    ring = buf.ring
    held = ring.held_ids()
    parts: list[dict[str, np.ndarray]] = []
    step = max(1, snapshot.CHUNK_BYTES // max(1, buf.schema.row_bytes))
    for at in range(0, max(held.size, 1), step):  # once with no rows when none is held: the keys, empty
        ids = held[at:at + step]
        rows = gather(buf.block, ring, ids)
        regather(buf.block, ring, ids, rows)
        keep = np.flatnonzero(rows.ok)
        batch = assemble(buf.block, ids[keep], rows.subset(keep))
        part = {n: np.ascontiguousarray(batch.fields[n]) for n in buf.schema.names}
        part.update({k: v for k, v in batch.extras.items() if k in ("index", *EXTRA.values())})
        prios = buf.priorities
        if prios is not None and prios.prioritized:
            part["priority"] = prios.priorities_of(prios.tree.leaves[ring.slots(batch.index)])
        if prios is not None and prios.uses is not None:  # as export's: a copy draws no row used up here
            part["uses"] = prios.uses[ring.slots(batch.index)].astype(np.int64)
        parts.append(part)
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def from_arrays(
    schema: Schema,
    arrays: Mapping[str, Any],
    factory: Callable[..., Buffer],
    capacity: int | None = None,
    **options: Any,
) -> Buffer:
    """A new buffer holding the rows of ``arrays`` (a dict of ``(k, *shape)`` arrays, one per
    field, as ``export`` gives), pushed in order. ``episode`` (required when ``episodes=True``),
    ``priority``, ``uses`` (with ``max_use``) and ``lane`` may come along, one per row.
    ``priority`` and ``uses`` are dropped when the new buffer has no use for them (a uniform
    sampler, no ``max_use``).

    Ids: with ``index`` (as ``export`` gives) and no ``lane``, the rows keep their ids when the new
    buffer's lanes allow it (in each lane ``id % lanes``, the row numbers ``id // lanes``
    increase): each lane starts at its first row number, the numbers in between that have no row
    are left empty (deleted), so ``take``, ``update_priorities`` and ``update`` with the old ids
    go on working. With ``next_of``/``stack`` ids cannot be kept (end and lead rows take row
    numbers), but each row goes into its lane (``id % lanes``) and each lane's last transition
    keeps the next observation it came with (``push(flush=)``): an import of an export holds every
    exported transition, in order. Otherwise the rows are numbered from 0: with ``envs=N`` they are whole steps of
    the N envs, env-major (row ``i`` into lane ``i % N``, as a push without ``lane=``; a row count
    that is not a multiple of N is refused), else they go into lane 0. ``capacity`` defaults to
    what the rows need (per lane, times lanes); with fewer slots only the newest rows stay.
    ``options`` are ``Buffer``'s (lanes, envs, sampler, max_use, episodes, name, seed)."""
    data = dict(arrays)
    index = data.pop("index", None)
    extra: dict[str, Any] = {key: data.pop(key) for key in ("episode", "priority", "lane", "uses") if key in data}
    k, _ = schema.validate(data)
    lanes = int(options.get("envs") or options.get("lanes") or 1)
    lane = np.asarray(extra["lane"], dtype=np.int64).reshape(-1) if "lane" in extra else None
    if lane is not None and lane.shape != (k,):
        raise CapacityError(f"from_arrays: lane: expected {k} lane numbers (one per row), got {lane.size}")
    # next_of/stack: an episode's last row is followed by an end row, so ids cannot be kept and a
    # push of c rows stores up to 2 c
    stored_once = options.get("next_of") is not None or options.get("stack") is not None
    if stored_once and lane is None and lanes > 1 and _kept_rows(index, k, lanes) is not None:
        lane = lane_of(np.asarray(index, np.int64), lanes)  # ids cannot be kept, but each row's lane can
    keep = _kept_rows(index, k, lanes) if lane is None and not stored_once else None
    envs = options.get("envs")
    envs = envs if isinstance(envs, int) else 1  # a bad envs= is the factory's to refuse
    spread = lane is None and keep is None and envs > 1  # as a push without lane=
    if spread and k % envs:
        raise FieldError(
            f"from_arrays: envs={envs} spreads rows as whole steps of every env, env-major (row i into lane "
            f"i % {envs}), so it needs a multiple of {envs} rows, got {k}; pass lane= (one lane number per row)"
        )
    if capacity is None:
        if keep is not None:
            per_lane = max((int(r[-1] - r[0] + 1) for r in keep.values()), default=1)
        else:
            per_lane = int(np.bincount(lane).max()) if lane is not None and k else k // envs if spread else k
        if stored_once:
            spec = Frames.make(schema, options.get("next_of"), options.get("stack"))
            final = np.zeros(k, bool)  # the rows that end an episode: each takes an end row with next_of
            for name in spec.ends:
                final |= np.broadcast_to(np.asarray(data[name]).reshape(-1) != 0, (k,))
            # an end row each (all in one lane at worst), the flushed one, the lead rows
            per_lane += int(final.sum()) + 1 + _lead_rows(spec, data, final, lane)
            per_lane = max(per_lane, 2 * (spec.depth + spec.ahead + 1))  # the least a lane may hold (layout.Options)
        capacity = max(per_lane, 1) * lanes
    buf = factory(schema, capacity, **options)
    try:
        prios = buf.priorities
        if prios is None or not prios.prioritized:
            extra.pop("priority", None)
        uses = extra.pop("uses", None)
        if keep is not None:
            _push_keeping_ids(buf, data, extra, keep, np.asarray(index, dtype=np.int64).reshape(-1), k)
            if uses is not None and k:
                set_uses(buf, np.asarray(index, dtype=np.int64).reshape(-1), uses)
            return buf
        if not spread:
            extra["lane"] = 0 if lane is None else lane
        line = Line(f"from_arrays into {buf.name!r}", k)
        _push_pieces(buf, data, extra, uses, k, line)
        line.update(k)
        line.close()
    except BaseException:
        buf.__exit__(None, None, None)
        raise
    return buf


def _push_pieces(buf: Buffer, data: dict[str, Any], extra: dict[str, Any], uses: Any, k: int,
                 line: Line | None = None) -> list[np.ndarray]:
    """Push the ``k`` rows of ``data`` (with ``extra``'s lane, episode and priority) in pieces that
    a lane can always take (``Frames.steps``; with ``envs`` and no lane, whole steps of every env);
    rows exported from a buffer that lapped an episode's first steps resume it (lead rows), and
    with ``next_of``/``stack`` each lane's last row is a whole transition (its next observation
    came with it): flushed (``push(flush=)``). The ids, a piece at a time."""
    envs = None if "lane" in extra else buf.options.envs
    step = buf.options.rows.steps(buf.lane_capacity) * (envs or 1)
    single = k == 1 and all(np.ndim(a) == len(buf.schema[n].shape) for n, a in data.items())
    flush = None
    if buf.options.rows.once and k:
        flush = last_of_lanes(np.broadcast_to(np.asarray(extra["lane"], np.int64), (k,)) if "lane" in extra else
                              np.arange(k) % envs if envs else np.zeros(k, np.int64))
    out = []
    for i in range(0, k, step):
        if line is not None:
            line.update(i)
        part = slice(i, i + step)
        both: dict[str, Any] = {**data, **extra}
        cut = {key: v if single or np.ndim(v) == 0 else np.asarray(v)[part] for key, v in both.items()}
        opts = {key: cut[key] for key in ("lane", "episode", "priority") if key in cut}
        ids = buf.push({n: cut[n] for n in data}, resume=True, flush=False if flush is None else flush[part], **opts)
        if uses is not None:
            set_uses(buf, ids, np.asarray(uses).reshape(-1)[part] if np.ndim(uses) else uses)
        out.append(ids)
    return out


def _lead_rows(spec: Frames, data: dict[str, Any], final: np.ndarray, lane: np.ndarray | None) -> int:
    """At most how many lead rows the rows of ``data`` (``final``: those that end an episode)
    take with ``stack`` (``frames.py``): an episode start (the first row, one after an episode's
    last, a lane's first) whose stacks are not padding resumes an episode cut before it, and its
    older frames take ``k - 1`` rows."""
    if not spec.stack:
        return 0
    k = final.size
    starts = np.concatenate([[True], final[:-1]]) if k else final
    if lane is not None and k:
        order = np.argsort(lane, kind="stable")  # a lane's first row starts too
        firsts = order[np.concatenate([[True], lane[order][1:] != lane[order][:-1]])]
        starts[firsts] = True
    at = np.flatnonzero(starts)
    cut = np.zeros(at.size, bool)
    for st in spec.stack:
        fr = frames_of(st, np.asarray(data[st.name])[at])
        older, newest = fr[:, :-1].reshape(at.size, st.k - 1, -1), fr[:, -1:].reshape(at.size, 1, -1)
        cut |= ~((older == newest).all(axis=(1, 2)) | (older == 0).all(axis=(1, 2)))
    return int(cut.sum()) * (max(st.k for st in spec.stack) - 1)


def _kept_rows(index: Any, k: int, lanes: int) -> dict[int, np.ndarray] | None:
    """Per lane of a new buffer with ``lanes`` lanes, the row numbers ``index`` names, when
    every lane's increase (the ids can be kept); else ``None``."""
    if index is None:
        return None
    ids = np.asarray(index)
    if ids.dtype.kind not in "iu" or ids.shape != (k,) or not k or ids.min() < 0:
        return None
    ids = ids.astype(np.int64)
    out = {}
    for lane in np.unique(lane_of(ids, lanes)):
        rows = number_of(ids[lane_of(ids, lanes) == lane], lanes)
        if (np.diff(rows) <= 0).any():
            return None
        out[int(lane)] = rows
    return out


def _push_keeping_ids(buf: Buffer, data: dict[str, Any], extra: dict[str, Any], keep: dict[int, np.ndarray],
                      index: np.ndarray, k: int) -> None:
    """Push each lane's rows at their own row numbers (see ``from_arrays``); the numbers between
    them get a copy of the row before, deleted once pushed."""
    lanes = buf.lanes
    for lane, rows in keep.items():  # a new buffer nobody else has pushed to yet: each lane starts at its first row
        buf.ring.place(lane, int(rows[0]), int(rows[0]))
    single = k == 1 and all(np.ndim(a) == len(buf.schema[n].shape) for n, a in data.items())
    rows_of = {n: np.asarray(a)[np.newaxis] if single else np.asarray(a) for n, a in data.items()}
    more = {key: np.broadcast_to(np.asarray(v), (k,)) if np.ndim(v) == 0 else np.asarray(v).reshape(k)
            for key, v in extra.items()}
    for lane, rows in keep.items():
        at = np.flatnonzero(lane_of(index, lanes) == lane)  # this lane's rows in the arrays, in order
        span = int(rows[-1] - rows[0] + 1)
        pos = rows - rows[0]
        have = np.zeros(span, bool)
        have[pos] = True
        # each row number's source: its own row, or for a hole the row before it
        src = at[np.searchsorted(pos, np.arange(span), side="right") - 1]
        step = buf.lane_capacity
        for i in range(0, span, step):
            part = src[i:i + step]
            got = buf.push({n: a[part] for n, a in rows_of.items()}, lane=lane,
                           episode=more["episode"][part] if "episode" in more else None,
                           priority=more["priority"][part] if "priority" in more else None)
            holes = got[~have[i:i + step]]
            if holes.size:
                buf.delete(holes)


def set_uses(buf: Buffer, ids: np.ndarray, uses: Any) -> None:
    """Give the rows ``ids`` these use counts (``max_use`` buffers; ignored otherwise); rows that
    reach ``max_use`` leave the sampling set. Rows gone meanwhile are skipped."""
    prios = buf.priorities
    if prios is None or prios.uses is None:
        return
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    u = np.broadcast_to(np.asarray(uses, dtype=np.int64).reshape(-1) if np.ndim(uses) else np.asarray(uses), ids.shape)
    if u.size and (u < 0).any():
        raise CapacityError(f"uses: expected counts >= 0, got {u[u < 0][:3].tolist()}")
    edits.set_uses(buf, ids, u)


def import_rows(buf: Buffer, arrays: Mapping[str, Any], *, replace: bool = False) -> np.ndarray:
    """Push the rows of ``arrays`` (as ``export`` gives them, from any buffer of the same schema)
    into the existing buffer ``buf`` (DI-engine's ``import_data``), with their ``episode``,
    ``priority``, ``uses`` and ``lane`` when given (``priority`` and ``uses`` dropped where ``buf``
    has no use for them). The rows get new ids, in order (ids never repeat in a buffer); returns
    them. Without ``lane``, each row goes into its lane of ``index`` (``id % lanes``, as
    ``from_arrays``) when the ids allow it (increasing in each lane), else as a push without
    ``lane=`` spreads them. With ``replace`` the buffer's rows are cleared first, once the
    rows have passed every check: rows that are refused leave the buffer as it was (a load)."""
    data = dict(arrays)
    index = data.pop("index", None)
    extra: dict[str, Any] = {key: data.pop(key) for key in ("episode", "priority", "lane", "uses") if key in data}
    prios = buf.priorities
    if prios is None or not prios.prioritized:
        extra.pop("priority", None)
    uses = extra.pop("uses", None)
    k, _ = buf.schema.validate(data)
    if "lane" not in extra and buf.lanes > 1 and _kept_rows(index, k, buf.lanes) is not None:
        # an export lists lane after lane: spread over the lanes as a push would, a lane's steps
        # would go into several lanes, and windows (n-step, sequences) would mix envs
        extra["lane"] = np.asarray(index, np.int64) % buf.lanes
    # the pushes go in pieces: check what a later piece could refuse first, so an error changes nothing
    buf.options.check_episode(extra.get("episode"), k)
    if extra.get("priority") is not None and prios is not None:
        prios.check(extra["priority"], k, "import_rows: priority")
    if uses is not None and prios is not None and prios.uses is not None and (np.asarray(uses) < 0).any():
        raise CapacityError(f"uses: expected counts >= 0, got {np.asarray(uses)[np.asarray(uses) < 0][:3].tolist()}")
    lane = np.asarray(extra.get("lane", 0))
    if lane.size and lane.dtype.kind in "iuf" and (lane.min() < 0 or lane.max() >= buf.lanes):
        raise CapacityError(f"lane: expected lane numbers in [0, {buf.lanes}), got {lane.min()}..{lane.max()}")
    if replace:
        buf.clear()
    out = _push_pieces(buf, data, extra, uses, k)
    return np.concatenate(out) if out else np.empty(0, np.int64)


def pending(buf: Buffer, pusher: Pusher | None) -> dict[str, np.ndarray]:
    """``ReplayBuffer.pending``: with ``next_of``, each lane's newest row that waits for its next
    observation, as the transition this process pushed (``pusher`` remembers that observation),
    with ``export``'s keys."""
    ring, spec = buf.ring, buf.options.rows
    names = buf.schema.names
    ids: list[int] = []
    rows: dict[str, list[Any]] = {n: [] for n in names}
    episodes: list[int] = []
    if spec.next_of and pusher is not None and pusher.pid == os.getpid():
        first, stop = ring.bounds()
        for lane, last in sorted(pusher.last.items()):
            row = int(stop[lane]) - 1
            if last.final or row < int(first[lane]) or last.row != row:
                continue
            at = row_id(np.array([row], np.int64), lane, ring.lanes)
            slot = int(ring.slots(at)[0])
            if not ring.current(at)[0]:
                continue  # being written over
            got = {n: last.values[n] if n in last.values else buf.block.fields[n][slot].copy() for n in names}
            if not ring.current(at)[0]:
                continue  # lapped while copied: the row is gone
            ids.append(int(at[0]))
            episodes.append(-1 if last.episode is None else int(last.episode))
            for n in names:
                rows[n].append(got[n])
    out = {n: np.array(rows[n], f.dtype).reshape(len(ids), *f.shape) for n, f in zip(names, buf.schema, strict=True)}
    out["index"] = np.array(ids, np.int64)
    if buf.options.episodes:
        out["episode"] = np.array(episodes, np.int64)
    slots = ring.slots(out["index"])
    prios = buf.priorities
    if prios is not None and prios.prioritized:
        out["priority"] = prios.priorities_of(prios.tree.leaves[slots])
    if prios is not None and prios.uses is not None:
        out["uses"] = prios.uses[slots].astype(np.int64)
    return out
