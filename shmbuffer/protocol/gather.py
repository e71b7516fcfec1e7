"""The stamped gather: the rows of given ids copied under the commit protocol (``ring.py``).

A read of rows by id is: read their stamps, copy the rows (the packed small fields, the large
fields, the episode ids), read the stamps again; a row is *intact* when both reads equal the
stamp its id must show (``Ring.expected``) and it is not older than its lane's last ``clear()``.
``gather`` does that (``gather_run`` for a lane's consecutive rows; with ``stored=True`` on the rows as stored, also in a buffer with
``next_of``/``stack``: the copy of the columns that ``persistence.snapshot`` makes);
``rows.intact`` is the rule. With ``next_of``/``stack`` a transition is read from its window of
rows (``frames.py``'s read rules). ``assemble`` makes the ``Batch``; ``check_out`` checks the
arrays a caller gathers into (``sample(out=)``).

With the C extension (``native``) ``gather`` is one C call with real atomics: acquire loads of
the first stamps, the copies (without the GIL above a size), an acquire fence, the second stamps.
Everything here works on a ``layout.Block`` and a ``Ring``, never a buffer: which rows to read,
and what to do with those that are not intact, is ``reader.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import frames, native
from ..batch import Batch
from ..errors import FieldError
from .layout import EXTRA, Block, Counter
from .ring import INVALID, Ring
from .rows import committed, intact, window

REDRAW_ROUNDS = 8
"""Rounds of re-drawing rows that were being written before the slow path (reaping dead
writers' rows, then a scan of the committed rows) starts."""


@dataclass
class Rows:
    """Rows copied by ``gather``, shaped like the ids they were read for: ``ok`` marks the intact
    ones (see the module docstring), the others hold whatever the slots held; ``row`` the block's
    per-row columns read with them (``layout.Block.row``: ``_episode`` ...)."""

    ok: np.ndarray
    packed: np.ndarray | None
    large: dict[str, np.ndarray]
    row: dict[str, np.ndarray]

    @property
    def episode(self) -> np.ndarray | None:
        """The rows' episode ids (``_episode``), ``None`` for a buffer that keeps none."""
        return self.row.get("_episode")

    def map(self, f: Callable[[np.ndarray], np.ndarray]) -> Rows:
        """These rows with ``f`` applied to each array (``ok`` included): a subset, a reshape."""
        return Rows(f(self.ok), None if self.packed is None else f(self.packed),
                    {k: f(v) for k, v in self.large.items()}, {k: f(v) for k, v in self.row.items()})

    def put(self, at: np.ndarray | slice, other: Rows) -> None:
        """Overwrite positions ``at`` (of the leading dimension) with ``other``'s rows."""
        self.ok[at] = other.ok
        if self.packed is not None and other.packed is not None:
            self.packed[at] = other.packed
        for mine, theirs in ((self.large, other.large), (self.row, other.row)):
            for name, col in theirs.items():
                mine[name][at] = col

    def subset(self, keep: np.ndarray | slice) -> Rows:
        """The rows at positions ``keep`` (a slice gives views)."""
        return self.map(lambda a: a[keep])


def gather(
    block: Block, ring: Ring, ids: np.ndarray, *, out: dict[str, np.ndarray] | None = None,
    large: tuple[str, ...] | None = None, stored: bool = False,
) -> Rows:
    """Copy the rows ``ids`` (any shape; ``ring.INVALID`` reads as not intact) with the stamp
    check. ``out`` gathers into given arrays (``"_block"`` for the packed record, one per large
    field); ``large`` limits the large fields copied (all by default). A buffer with ``next_of``
    or ``stack`` reads each transition from its rows in the lane (``_transitions``), unless
    ``stored``: then the rows are read as they are stored (the stored record, every large column
    ``frames.KIND`` included), as for a buffer without frames (a copy of the columns: ``persistence``)."""
    if block.kinds is not None and not stored:
        return _transitions(block, ring, ids, out, large)
    return _gather(block, ring, ids, out=out, large=large)


def _gather(
    block: Block, ring: Ring, ids: np.ndarray, *, out: dict[str, np.ndarray] | None = None,
    large: tuple[str, ...] | None = None,
) -> Rows:
    """``gather`` of the rows as stored."""
    shape = ids.shape
    flat = ids if len(shape) == 1 else ids.reshape(-1)
    updates = int(block.counters[_UPDATES])  # before the first stamps (see _unless_updated)
    if native.lib is not None:
        rows = _gather_native(native.lib, block, ring, flat, out, large)
        if rows is not None:
            _unless_updated(block, ring, flat, updates, rows, large)
            return rows if len(shape) == 1 else _shaped(rows, shape)
    slots = ring.slots(flat)
    stamp = block.stamp
    first = stamp.take(slots)
    packed = block.packed
    if packed is not None:
        packed = packed.take(slots, axis=0, out=None if out is None else out["_block"])
    cols = block.large if large is None else {n: c for n, c in block.large.items() if n in large}
    got = {n: c.take(slots, axis=0, out=None if out is None else out[n]) for n, c in cols.items()}
    row = {n: c.take(slots) for n, c in block.row.items()}
    second = stamp.take(slots)
    ok = intact(first, second, ring.expected(flat))
    cleared = ring.cleared(flat)  # after the copy: a row cleared before it does not count
    if cleared.size:
        ok[cleared] = False
    rows = Rows(ok, packed, got, row)
    _unless_updated(block, ring, flat, updates, rows, large)
    return rows if len(shape) == 1 else _shaped(rows, shape)


_UPDATES = Counter.UPDATES
_PIECE_BYTES = 256 * 1024
"""Bytes of rows gathered again at a time after an update began during a gather."""


def _unless_updated(
    block: Block, ring: Ring, flat: np.ndarray, before: int, rows: Rows, large: tuple[str, ...] | None,
) -> None:
    """After the second stamps: an update (``ReplayBuffer.update``) turns a row odd and then
    back to the *same* committed stamp, so a copy that spans a whole update would pass the stamp
    check half old, half new. Every update first counts itself (after its rows turned odd), so
    when the count moved during this gather no row of it counts as read. They are gathered again
    in pieces, each under its own count: an update anywhere begins during most gathers of many
    large rows (a process updating rows without pause), seldom during a small piece's. A piece
    across which the count moved again does not count: the caller re-draws its rows."""
    if int(block.counters[_UPDATES]) == before:
        return
    n = flat.shape[0]
    step = max(1, _PIECE_BYTES // max(1, block.schema.row_bytes))
    if step >= n:
        rows.ok[...] = False
        return
    for a in range(0, n, step):
        at = slice(a, min(a + step, n))
        rows.put(at, _gather(block, ring, flat[at], large=large))  # step rows or fewer: never split again


def gather_run(stamp: np.ndarray, columns: tuple[np.ndarray, ...], first: int, n0: int,
               outs: tuple[np.ndarray, ...], ok: np.ndarray) -> int:
    """Rows ``n0, n0 + 1, ...`` of one lane, in the consecutive slots from ``first`` (a run never
    wraps: split it at the lane's end), copied from ``columns`` (``(capacity, ...)`` each) into
    ``outs`` (``(len(ok), ...)`` each) under the reader's rule: ``ok`` marks the intact rows
    (``rows.intact``: both stamp loads show the row committed). Returns how many. The caller checks
    the lanes' last ``clear()`` and ``Counter.UPDATES`` (``_unless_updated``'s rule) itself.
    With the C extension one call (the GIL released for big runs), one copy per column."""
    k = ok.shape[0]
    if native.lib is not None and stamp.flags.c_contiguous and all(c.flags.c_contiguous for c in columns):
        return int(native.lib.gather_run(first, n0, stamp, columns, outs, ok))
    before = stamp[first:first + k].copy()
    for col, out in zip(columns, outs, strict=True):
        np.copyto(out, col[first:first + k])
    ok[:] = intact(before, stamp[first:first + k], committed(np.arange(n0, n0 + k, dtype=np.int64)))
    return int(np.count_nonzero(ok))


def regather(block: Block, ring: Ring, ids: np.ndarray, rows: Rows, *, stored: bool = False) -> None:
    """Gather again (a few rounds) the rows of ``ids`` (flat) that did not count but are still
    current: an update of *other* rows during the gather (``_unless_updated``) discards every
    row of it, and a read that cannot re-draw (``take``, ``epoch``) must not lose them for that.
    ``stored``: ``rows`` were gathered with ``stored=True``, and are gathered again so."""
    for _ in range(REDRAW_ROUNDS):
        bad = np.flatnonzero(~rows.ok)
        if bad.size:
            bad = bad[ring.current(ids[bad])]
        if not bad.size:
            return
        rows.put(bad, gather(block, ring, ids[bad], stored=stored))


def _transitions(
    block: Block, ring: Ring, ids: np.ndarray, out: dict[str, np.ndarray] | None, large: tuple[str, ...] | None,
) -> Rows:
    """``gather`` for a buffer with ``next_of``/``stack`` (``frames.py``): the rows of each
    transition's window are read with their kinds (each under its own stamp check); ``frames.center``
    and ``frames.stack_plan`` say which transitions hold and which row gives each frame, and those
    are read (under their own checks again) into the user's fields. ``large`` names user fields."""
    spec = block.rows
    shape = ids.shape
    flat = ids.reshape(-1)
    m = flat.shape[0]
    updates = int(block.counters[_UPDATES])  # the reads below are several gathers (see the end)
    start, stop = ring.bounds()
    bad = flat == INVALID
    win, inside = window(np.where(bad, 0, flat), np.arange(-spec.depth, spec.ahead + 1), ring.lanes, start, stop)
    win[~inside | bad[:, None]] = INVALID
    width = win.shape[1]
    c = spec.depth
    w = _gather(block, ring, win.reshape(-1), large=(frames.KIND,))
    ok = w.ok.reshape(m, width)
    kind = w.large[frames.KIND].reshape(m, width)
    valid = frames.center(spec, ok, kind)
    packed = None
    if w.packed is not None:
        packed = _into(out, "_block", w.packed.reshape(m, width, w.packed.shape[-1])[:, c])
    row = {n: a.reshape(m, width)[:, c].copy() for n, a in w.row.items()}
    want = set(block.schema.names) if large is None else set(large)
    got: dict[str, np.ndarray] = {}
    small = block.stored_record.views(w.packed) if w.packed is not None else {}
    rows_at = np.arange(m)[:, None]

    def frames_at(name: str, *chosen: np.ndarray) -> list[np.ndarray]:
        """The stored ``name`` of the window rows ``chosen`` (each ``(m, j)`` columns), checked
        again: one gather for all of them."""
        nonlocal valid
        if name in small:
            col = small[name].reshape(m, width, *small[name].shape[1:])
            return [col[rows_at, c] for c in chosen]
        ids = np.concatenate([win[rows_at, c].reshape(-1) for c in chosen])
        g = _gather(block, ring, ids, large=(name,))
        parts, at = [], 0
        for c in chosen:
            valid = valid & g.ok[at:at + c.size].reshape(c.shape).all(axis=1)
            a = g.large[name][at:at + c.size]
            parts.append(a.reshape(*c.shape, *a.shape[1:]))
            at += c.size
        return parts

    def stacks(s: frames.Stack, lasts: list[int]) -> list[np.ndarray]:
        """The frames ``(m, k, *frame)`` of the stacks of ``s`` whose newest frames are the window
        columns ``lasts``, padded (``frames.stack_plan``); ``valid`` loses the transitions that
        cannot be read. Large frames in one C call where the extension is built."""
        nonlocal valid
        lib = native.lib
        col = block.large.get(s.name)
        if lib is not None and col is not None and m:
            # one allocation for both stacks (see _gather_native's arena)
            arena = np.empty((len(lasts), m, s.k, *col.shape[1:]), col.dtype)
            valid = np.ascontiguousarray(valid)
            lib.stacks(win, ok, kind, ring.lanes, block.stamp, col, s.k, tuple(lasts), tuple(arena), valid)
            return list(arena)
        plans = [frames.stack_plan(ok, kind, last, s.k) for last in lasts]
        for _, _, fine in plans:
            valid = valid & fine
        read = frames_at(s.name, *(cols for cols, _, _ in plans))
        for fr, (_, zero, _) in zip(read, plans, strict=True):
            if zero.any():
                fr[zero] = 0
        return read

    after = np.full((m, 1), c + 1)
    for nxt, src in spec.next_of:  # a source stored whole: the next row's
        if nxt in want and spec.stacked(src) is None:
            got[nxt] = _into(out, nxt, frames_at(src, after)[0][:, 0])
    for s in spec.stack:
        columns = {name: last for name, last in frames.stack_columns(spec, s).items() if name in want}
        # the next stack's frames are read from the rows too, in the same pass: measured faster
        # than copying three frames of the stack (0.68x vs 0.62x the uncompressed sample)
        for name, fr in zip(columns, stacks(s, list(columns.values())) if columns else [], strict=True):
            got[name] = frames.assemble(s, fr, out.get(name) if out is not None else None)
    rest = tuple(n for n in block.large if n != frames.KIND and spec.stacked(n) is None and n in want)
    if rest:
        g = _gather(block, ring, flat, large=rest)
        valid = valid & g.ok
        got.update({n: _into(out, n, a) for n, a in g.large.items()})
    if int(block.counters[_UPDATES]) != updates:
        # an update may have come and gone between two of the gathers (the stamps end where they
        # began): the record and the large fields of one row could be from either side of it
        valid = np.zeros_like(valid)
    rows = Rows(valid, packed, got, row)
    return rows if len(shape) <= 1 else _shaped(rows, shape)


def check_out(block: Block, n: int, out: Any) -> dict[str, np.ndarray]:
    """``sample(n, out=)``'s arrays, checked before anything is read, and completed: any of
    ``"_block"`` (the packed record, ``(n, itemsize)`` uint8, when the buffer packs its small
    fields) and one array per other field, ``(n, *shape)`` in its dtype, each a writable numpy
    array (else ``FieldError`` naming the key, what was expected and what came); the keys not
    given get new arrays."""
    want: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
    rec = block.record
    if rec is not None:
        want["_block"] = ((n, rec.itemsize), np.dtype(np.uint8))
    for f in block.schema:
        if rec is None or f.name not in rec.offsets:
            want[f.name] = ((n, *f.shape), f.dtype)
    if not isinstance(out, dict) or not set(out) <= set(want):
        show = ", ".join(f"{k!r}: {shape} {dtype}" for k, (shape, dtype) in want.items())
        got = sorted(map(str, set(out) - set(want))) if isinstance(out, dict) else f"a {type(out).__name__}"
        raise FieldError(f"sample({n}, out=...): expected a dict of any of {{{show}}} (a batch's block and its "
                         f"large fields), got {got}")
    full = {}
    for key, (shape, dtype) in want.items():
        a = out.get(key)
        if a is None:
            full[key] = np.empty(shape, dtype)
            continue
        if not isinstance(a, np.ndarray):
            raise FieldError(f"sample({n}, out=...): out[{key!r}] must be a numpy array {shape} {dtype}, got a "
                             f"{type(a).__name__} (for a torch tensor pass tensor.numpy())")
        if a.shape != shape or a.dtype != dtype:
            raise FieldError(f"sample({n}, out=...): out[{key!r}]: expected {shape} {dtype}, got {a.shape} {a.dtype}")
        if not a.flags.writeable:
            raise FieldError(f"sample({n}, out=...): out[{key!r}] is read-only; pass writable arrays")
        full[key] = a
    return full


def _into(out: dict[str, np.ndarray] | None, name: str, a: np.ndarray) -> np.ndarray:
    """``a`` copied into ``out[name]`` when given, else ``a`` (contiguous)."""
    if out is None or name not in out:
        return np.ascontiguousarray(a)
    np.copyto(out[name], a)
    return out[name]


def _shaped(rows: Rows, shape: tuple[int, ...]) -> Rows:
    """Rows gathered for flat ids, shaped like the ids."""
    if len(shape) <= 1:
        return rows
    return rows.map(lambda a: a.reshape(*shape, *a.shape[1:]))


_ARENA_BYTES = 1 << 20
"""Large fields' outputs of at least this many bytes in all share one allocation."""


Out = tuple[str, tuple[int, ...], np.dtype]
"""An array a gather fills, ``(name, row shape, dtype)``."""


def large_outs(cols: list[Out], n: int, out: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """The arrays ``n`` rows of ``cols`` are gathered into: ``out``'s, else new ones; ``None``
    when an out has another dtype or size, or is not C-contiguous and writable (the C copies
    take bytes; its shape is the caller's)."""
    got = {}
    if out is not None:
        for name, shape, dtype in cols:
            a = out.get(name)
            if a is None or a.dtype != dtype or a.size != n * math.prod(shape) or not (
                    a.flags.c_contiguous and a.flags.writeable):
                return None
            got[name] = a
        return got
    sizes = [-(-n * math.prod(shape) * dtype.itemsize // 64) * 64 for _, shape, dtype in cols]
    if len(cols) == 1 or sum(sizes) < _ARENA_BYTES:
        return {name: np.empty((n, *shape), dtype) for name, shape, dtype in cols}
    # one allocation for every large field: big blocks freed and allocated again each sample
    # stay in the heap (malloc keeps one block this size), where separate ones are handed
    # back to the kernel and fault their pages in again on every sample
    arena, at = np.empty(sum(sizes), np.uint8), 0
    for (name, shape, dtype), size in zip(cols, sizes, strict=True):
        got[name] = arena[at:at + size].view(dtype)[:n * math.prod(shape)].reshape(n, *shape)
        at += size
    return got


def _gather_native(
    lib: Any, block: Block, ring: Ring, flat: np.ndarray, out: dict[str, np.ndarray] | None,
    large: tuple[str, ...] | None,
) -> Rows | None:
    """``gather`` as one C call (first stamps with acquire loads, the copies, an acquire fence,
    second stamps); ``None`` when an array is not one the kernel takes (not C-contiguous, another
    dtype), before anything is copied: the numpy path then runs."""
    if flat.dtype != np.int64:
        return None
    n = flat.shape[0]
    sources: list[np.ndarray] = []
    outs: list[np.ndarray] = []
    packed = block.packed
    if packed is not None:
        p = np.empty((n, packed.shape[1]), np.uint8) if out is None else out["_block"]
        sources.append(packed)
        outs.append(p)
    cols = [(name, col) for name, col in block.large.items() if large is None or name in large]
    got = large_outs([(name, col.shape[1:], col.dtype) for name, col in cols], n, out)
    if got is None:
        return None
    sources += [col for _, col in cols]
    outs += got.values()
    row = {name: np.empty(n, col.dtype) for name, col in block.row.items()}
    sources += block.row.values()
    outs += row.values()
    ok = np.empty(n, np.bool_)
    try:
        lowest = lib.gather(flat, ring.lanes, block.stamp, tuple(sources), tuple(outs), ok)
    except (TypeError, ValueError):
        return None
    cleared = ring.cleared(flat, lowest)  # after the copy: a row cleared before it does not count
    if cleared.size:
        ok[cleared] = False
    return Rows(ok, outs[0] if packed is not None else None, got, row)


def assemble(block: Block, ids: np.ndarray, rows: Rows, extras: dict[str, np.ndarray] | None = None) -> Batch:
    """The batch of ``rows`` read for ``ids``: fields in schema order (the small ones views of the
    packed block), ``index`` and, with episodes, ``episode``; windows ``(n, T)`` keep that lead."""
    lead = ids.shape
    packed = rows.packed
    windows = len(lead) > 1
    if packed is not None and windows:
        packed = packed.reshape(-1, packed.shape[-1])
    small = block.record.views(packed) if packed is not None else {}
    large = rows.large
    if windows:
        small = {name: a.reshape(*lead, *a.shape[1:]) for name, a in small.items()}
    fields = {name: large[name] if name in large else small[name] for name in block.schema.names}
    more: dict[str, np.ndarray] = {"index": ids}
    more.update({EXTRA[name]: a for name, a in rows.row.items() if name in EXTRA})
    if extras:
        more.update(extras)
    return Batch(fields, more, block=packed, record=block.record if packed is not None else None,
                 lead=lead if windows else None)
