"""The reader's half of the commit protocol (``ring.py``), in one place.

A read of rows by id is: read their stamps, copy the rows (the packed small fields, the large
fields, the episode ids), read the stamps again; a row is *intact* when both reads equal the
stamp its id must show (``Ring.expected``) and it is not older than its lane's last ``clear()``.
``gather`` does that (with ``stored=True`` on the rows as stored, also in a buffer with
``next_of``/``stack``: the copy of the columns that ``persistence.snapshot`` makes); ``rows.intact`` is the rule. ``fetch`` is the one re-draw loop: rows (or windows
of rows) that are not accepted are drawn again, a bounded number of rounds before dead writers'
rows are reaped, and for at most ``GIVE_UP`` seconds; with ``unique`` a row appears once, with a
``claim`` (``max_use``) each row's use is counted under the lock once it is read. ``assemble``
makes the ``Batch``.

With the C extension (``native``) ``gather`` is one C call with real atomics: acquire loads of
the first stamps, the copies (without the GIL above a size), an acquire fence, the second stamps.

Everything here works on a ``layout.Block`` and a ``Ring``: the columns and the commit protocol,
never a ``ReplayBuffer`` (a ``Source`` gives them).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from .. import frames, native
from ..batch import Batch
from ..errors import EmptyBufferError, FieldError, WaitTimeout
from ..sampling.samplers import Prioritized
from .layout import Block, Counter, Options
from .priorities import Priorities
from .ring import INVALID, Ring, positions
from .rows import intact, window

NONE = np.empty(0, np.int64)
REDRAW_ROUNDS = 8
"""Rounds of re-drawing rows that were being written before the slow path (reaping dead
writers' rows, then a scan of the committed rows) starts."""
GIVE_UP = 1.0
"""Seconds a read may keep re-drawing after the slow path started before it raises."""

Redraw = Callable[[int, np.ndarray, bool], tuple[np.ndarray, "np.ndarray | None"]]
"""``redraw(k, ids, slow) -> (k new ids, their values or None)``: ``ids`` are those held now (to
leave out when drawing distinct rows), ``slow`` is true once the slow path started. Fewer than
``k`` ids means nothing can be drawn right now (the reader waits); raise when that is final."""
Accept = Callable[[np.ndarray, "Rows"], np.ndarray]
"""``accept(ids, rows) -> bool per unit``: which rows (or windows) are kept."""


class Source(Protocol):
    """What readers built on this module need of a buffer (``ReplayBuffer`` is one)."""

    name: str
    rng: np.random.Generator

    @property
    def block(self) -> Block:
        """The buffer's columns (``layout.Block``)."""

    @property
    def ring(self) -> Ring:
        """The buffer's ring: lanes, stamps, counters."""

    @property
    def options(self) -> Options:
        """The buffer's options."""

    @property
    def priorities(self) -> Priorities | None:
        """The buffer's priority state, or ``None`` without a prioritized sampler."""

    def reap(self) -> np.ndarray:
        """Ids of the rows whose uses ran out (``max_use``), for the sampler to drop."""


@dataclass
class Rows:
    """Rows copied by ``gather``, shaped like the ids they were read for: ``ok`` marks the intact
    ones (see the module docstring); the others' contents are whatever the slots held."""

    ok: np.ndarray
    packed: np.ndarray | None
    large: dict[str, np.ndarray]
    episode: np.ndarray | None

    def put(self, at: np.ndarray | slice, other: Rows) -> None:
        """Overwrite positions ``at`` (of the leading dimension) with ``other``'s rows."""
        self.ok[at] = other.ok
        if self.packed is not None and other.packed is not None:
            self.packed[at] = other.packed
        if self.episode is not None and other.episode is not None:
            self.episode[at] = other.episode
        for name, col in other.large.items():
            self.large[name][at] = col

    def subset(self, keep: np.ndarray | slice) -> Rows:
        """The rows at positions ``keep`` (a slice gives views)."""
        return Rows(self.ok[keep], self.packed[keep] if self.packed is not None else None,
                    {k: v[keep] for k, v in self.large.items()}, self.episode[keep] if self.episode is not None else None)


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
    if block.frames is not None and not stored:
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
        packed = packed.take(slots, axis=0) if out is None else packed.take(slots, axis=0, out=out["_block"])
    cols = block.large if large is None else {n: c for n, c in block.large.items() if n in large}
    if out is None:
        got = {n: c.take(slots, axis=0) for n, c in cols.items()}
    else:
        got = {n: c.take(slots, axis=0, out=out[n]) for n, c in cols.items()}
    episode = block.episode.take(slots) if block.episode is not None else None
    second = stamp.take(slots)
    ok = intact(first, second, ring.expected(flat))
    cleared = ring.cleared(flat)  # after the copy: a row cleared before it does not count
    if cleared.size:
        ok[cleared] = False
    rows = Rows(ok, packed, got, episode)
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


def settle(block: Block, ring: Ring, ids: np.ndarray, rows: Rows, *, stored: bool = False) -> None:
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
    spec = block.frames
    assert spec is not None
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
        packed = _into(out, "_block", w.packed.reshape(m, width, -1)[:, c])
    episode = w.episode.reshape(m, width)[:, c].copy() if w.episode is not None else None
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
        then = next((n for n, src in spec.next_of if src == s.name), None)
        columns = frames.stack_columns(spec, s)
        names = {s.name: s.name, "next:" + s.name: then}
        keys = [key for key in columns if names[key] in want]
        # the next stack's frames are read from the rows too, in the same pass: measured faster
        # than copying three frames of the stack (0.68x vs 0.62x the uncompressed sample)
        for key, fr in zip(keys, stacks(s, [columns[key] for key in keys]) if keys else [], strict=True):
            name = names[key]
            assert name is not None
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
    rows = Rows(valid, packed, got, episode)
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
    packed, got, episode = rows.packed, rows.large, rows.episode
    packed = packed.reshape(*shape, -1) if packed is not None else None
    got = {n: a.reshape(*shape, *a.shape[1:]) for n, a in got.items()}
    episode = episode.reshape(shape) if episode is not None else None
    return Rows(rows.ok.reshape(shape), packed, got, episode)


_ARENA_BYTES = 1 << 20
"""Large fields' outputs of at least this many bytes in all share one allocation."""


Out = tuple[str, tuple[int, ...], np.dtype]
"""An array a gather fills, ``(name, row shape, dtype)``."""


def _large_outs(cols: list[Out], n: int, out: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
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
    got = _large_outs([(name, col.shape[1:], col.dtype) for name, col in cols], n, out)
    if got is None:
        return None
    sources += [col for _, col in cols]
    outs += got.values()
    episode = None
    if block.episode is not None:
        episode = np.empty(n, np.int64)
        sources.append(block.episode)
        outs.append(episode)
    ok = np.empty(n, np.bool_)
    try:
        lowest = lib.gather(flat, ring.lanes, block.stamp, tuple(sources), tuple(outs), ok)
    except (TypeError, ValueError):
        return None
    cleared = ring.cleared(flat, lowest)  # after the copy: a row cleared before it does not count
    if cleared.size:
        ok[cleared] = False
    return Rows(ok, outs[0] if packed is not None else None, got, episode)


def fetch(
    block: Block, ring: Ring, ids: np.ndarray, redraw: Redraw, *, reap: Callable[[], object],
    values: np.ndarray | None = None, accept: Accept | None = None, unique: bool = False,
    claim: Uses | None = None, out: dict[str, np.ndarray] | None = None, what: str | Callable[[], str] = "sample",
    rows: Rows | None = None, unclaimed: np.ndarray | None = None,
) -> tuple[np.ndarray, Rows, np.ndarray | None]:
    """Read ``ids`` (``(n,)`` rows or ``(n, width)`` windows) and re-draw every unit that is not
    accepted (default: every row intact) until all are; returns the final ids, rows and values
    (``values`` are the draw's per-unit numbers, e.g. tree leaves, re-drawn along). ``rows``: what
    a gather of ``ids`` already read; ``unclaimed``: the positions whose use is not counted yet
    (default: all of them, with a ``claim``). When it raises, every use counted for ``ids``
    (before it or in it) is given back: the rows stay as they were."""
    if rows is None:
        rows = gather(block, ring, ids, out=out)

    def rejected(ids: np.ndarray, rows: Rows) -> np.ndarray:
        keep = accept(ids, rows) if accept is not None else rows.ok
        return ~keep

    bad = np.flatnonzero(rejected(ids, rows))
    if claim is None:
        unclaimed = NONE
    elif unclaimed is None:
        unclaimed = np.arange(ids.shape[0])
    rounds, deadline, calm = 0, 0.0, 0.0
    frames_ = block.frames is not None and ids.ndim == 1
    try:
        while True:
            while bad.size:
                if frames_ and ring.current(ids[bad]).all():
                    # committed rows that are not whole transitions (frames.py: end rows, a lane's newest
                    # row): nothing to wait for or reap, so no slow path; bounded by time alone
                    calm = calm or time.monotonic() + GIVE_UP
                    if time.monotonic() > calm:
                        raise WaitTimeout(
                            f"{what() if callable(what) else what}: {bad.size} of {ids.shape[0]} could not be drawn in "
                            f"{GIVE_UP:.0f} s: the rows drawn are not whole transitions ({_NOT_A_TRANSITION})")
                    rounds = min(rounds, REDRAW_ROUNDS - 1)
                rounds += 1
                if rounds == REDRAW_ROUNDS + 1:
                    deadline = time.monotonic() + GIVE_UP
                    with ring.lock:  # a dead holder's half-done work is repaired by the next locker
                        pass
                    reap()
                elif rounds > REDRAW_ROUNDS and time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"{what() if callable(what) else what}: {bad.size} of {ids.shape[0]} could not be drawn in {GIVE_UP:.0f} s "
                        f"({rounds} rounds): rows are being written or used up"
                    )
                new, more = redraw(bad.size, ids, rounds > REDRAW_ROUNDS)
                if new.shape[0] < bad.size:  # nothing to draw from right now
                    time.sleep(0.0005)
                    continue
                ids[bad] = new
                if values is not None and more is not None:
                    values[bad] = more
                got = gather(block, ring, new)
                rows.put(bad, got)
                bad = bad[rejected(new, got)]
            if unique:
                bad = repeats(ids, unclaimed if claim is not None else None)
                if bad.size:
                    continue
            if claim is not None and unclaimed.size:
                bad = unclaimed = claim.claim(ids, unclaimed)
                if bad.size:
                    continue
            return ids, rows, values
    except BaseException:
        if claim is not None:  # the positions not in `unclaimed` now have counted a use: give it back
            counted = np.setdiff1d(np.arange(ids.shape[0]), unclaimed)
            if counted.size:
                claim.give_back(ids, counted, values)
        raise


def repeats(ids: np.ndarray, fresh: np.ndarray | None) -> np.ndarray:
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
    if rows.episode is not None:
        more["episode"] = rows.episode
    if extras:
        more.update(extras)
    return Batch(fields, more, block=packed, record=block.record if packed is not None else None,
                 lead=lead if windows else None)


def _too_few(name: str, n: int, held: int) -> str:
    return (f"sample({n}, replace=False): buffer {name!r} holds only {held} row{'' if held == 1 else 's'}; "
            f"sample at most {held} distinct rows, draw with repeats (replace=True, the default), "
            "or wait until writers have pushed more")


# -- reads a buffer serves with these ------------------------------------------------------------
def draw(src: Source, n: int, *, replace: bool = True, out: dict[str, np.ndarray] | None = None, calls: int = 0) -> Batch:
    """``n`` rows drawn by ``src``'s sampler and read intact; what the reader refuses is drawn
    again (``fetch``). A prioritized batch has ``weight``, annealed for the ``calls``-th sample."""
    ring, prios, sampler = src.ring, src.priorities, src.options.sampler
    tree = prios.tree if prios is not None else None
    if not replace and n > len(ring):
        raise EmptyBufferError(_too_few(src.name, n, len(ring)))
    counting = prios is not None and prios.uses is not None
    block = src.block
    # a few rows of a frames buffer are not transitions (end rows, a lane's newest): draw a few
    # spares with the rest and keep the first n that are, instead of a second round for those.
    # Keeping the first n valid of independent draws is rejection sampling: the same distribution
    spares = max(8, n // 32) if block.frames is not None and replace and out is None and not counting else 0
    # uniform draws are independent: the spares come in the same call; a prioritized draw is
    # stratified over its n, so its spares are drawn apart (``again``: unstratified)
    first = sampler.draw(ring, tree, src.rng, n + (spares if tree is None else 0), replace=replace)
    if first.ids.size < n:
        _nothing_to_draw(src, n, final=True)
    ids, leaves = first
    if spares and tree is not None:
        more = sampler.draw(ring, tree, src.rng, spares, replace=True, taken=ids, again=True)
        ids = np.concatenate([ids, more.ids])
        leaves = None if leaves is None or more.leaves is None else np.concatenate([leaves, more.leaves])

    redraw = _redrawer(src, n, replace)
    if spares:
        rows = gather(block, ring, ids)
        bad = np.flatnonzero(~rows.ok[:n])
        spare = n + np.flatnonzero(rows.ok[n:])[:bad.size]
        if bad.size and spare.size == bad.size:  # the first n positions' failures take spare rows' places
            rows.put(bad, rows.subset(spare))
            ids[bad] = ids[spare]
            if leaves is not None:
                leaves[bad] = leaves[spare]
        ids, rows = ids[:n], rows.subset(slice(0, n))  # views; too few spares: re-drawn below
        leaves = leaves[:n] if leaves is not None else None
    else:
        rows = gather(block, ring, ids, out=out)
    if counting or not replace or not rows.ok.all():  # else the usual case: every row intact at once
        ids, rows, leaves = fetch(block, ring, ids, redraw, reap=src.reap, values=leaves, unique=not replace,
                                  claim=Uses(src) if counting else None, out=out,
                                  what=lambda: f"sample({n}) of buffer {src.name!r}", rows=rows)
    if leaves is None:  # drawn without a tree: no weights
        return assemble(block, ids, rows)
    weight = sampler.weights(tree, leaves, calls)
    return assemble(block, ids, rows, {"weight": weight} if weight is not None else None)


MAX_COLUMNS = 64
"""Columns (the packed record, each large field, the episode ids) the C gather copies in one call
(``native.h``'s ``MAX_COLS``); a buffer with more samples through ``draw`` (numpy past them)."""


class _Thread(threading.local):
    nogil = False


_THREAD = _Thread()


def sample_for_another(on: bool = True) -> None:
    """Whether this thread samples for another thread (the loader's does): its one-call samples
    then release the GIL for the whole gather, however small, so the thread it serves runs its
    Python meanwhile. Otherwise only big gathers release it: a release while another thread
    runs Python costs the sampling thread the wait to get the GIL back."""
    _THREAD.nogil = on


class OneCall:
    """``draw`` with replacement as one C call (``_native.sample``, ``native/sample.c``): the draw
    (uniform, or prioritized from the tree, stratified), the stamped gather of every column (with
    ``next_of``/``stack``: of each transition's window of rows, ``frames.py``'s rules in C), a few
    rounds of re-draws of rows not intact, and the importance weights, the GIL released around big
    copies; then the batch of the packed record's views. The draw's random numbers come from a
    xoshiro256** generator in C seeded from the buffer's ``rng`` (made again when ``rng`` is
    replaced): another stream than numpy's, the same distribution (``tests/test_one_call.py``).
    What the call does not serve it says: an empty buffer, an update during the gather
    (``_unless_updated``) and a closed plan go to ``draw`` (which raises or reads again), and rows
    still not intact after its rounds to ``fetch``.

    Served (``OneCall.serves``): every buffer of at most ``MAX_COLUMNS`` columns (and a frames
    window of at most 64 rows), ``max_use`` included (each row returned counts its use in C, under
    the lock tried once); ``replace=False`` and hindsight take ``draw``."""

    def __init__(self, lib: Any, src: Source) -> None:
        block, ring, prios = src.block, src.ring, src.priorities
        self.lib = lib
        self.sample = lib.sample
        self.rng = src.rng
        cols = [] if block.packed is None else [block.packed]
        large = {name: col for name, col in block.large.items() if name != frames.KIND}
        cols += large.values()
        self.episode = block.episode is not None
        if block.episode is not None:
            cols.append(block.episode)
        spec = block.frames
        self.stacks: dict[str, frames.Stack] = {}
        """the outs that hold stacks' frames ``(n, k, *frame)``, for ``frames.assemble``"""
        if spec is None:
            self.large: list[Out] = [(name, col.shape[1:], col.dtype) for name, col in large.items()]
            frames_plan = None
        else:
            self.large, parts = self._frames(block, large)
            frames_plan = (block.arrays[frames.KIND], spec.depth, spec.ahead, tuple(parts))
        tree = None if prios is None else (prios.tree.sums, prios.tree.mins, prios.tree.plan)
        counting = prios is not None and prios.uses is not None
        claim = (ring.lock.memory, prios.uses, prios.max_use) if counting else None  # type: ignore[union-attr]
        seed = src.rng.integers(0, 1 << 64, size=4, dtype=np.uint64)
        view = ring.native_view
        assert view is not None, "serves() checked it"
        self.plan = lib.read_plan(view[0], view[1], block.counters, tuple(cols), seed, tree, claim, frames_plan)
        self.record = block.record if block.packed is not None else None
        self.names = block.schema.names
        self.tree = tree is not None
        self.counting = counting

    def _frames(self, block: Block, large: dict[str, np.ndarray]) -> tuple[list[Out], list[tuple[int, ...]]]:
        """The outs after the record's (in order) and the C parts that fill them, the record's and
        the episode's included, of a buffer with ``next_of``/``stack``: what ``_transitions`` reads
        (``Part`` in ``native/sample.c``: column, offset, bytes, window column, frames)."""
        spec = block.frames
        assert spec is not None
        stored, record = block.stored, block.stored_record
        index = {name: at + (block.packed is not None) for at, name in enumerate(large)}
        c = spec.depth

        def source(name: str) -> tuple[int, int, int]:
            f = stored[name]
            if name in record.offsets:
                return 0, record.offsets[name], f.row_bytes
            return index[name], 0, f.row_bytes

        outs: list[Out] = []
        parts: list[tuple[int, ...]] = []
        if block.packed is not None:
            parts.append((0, 0, record.itemsize, c, 0))
        for nxt, src in spec.next_of:  # a source stored whole: the next row's
            if spec.stacked(src) is None:
                parts.append((*source(src), c + 1, 0))
                outs.append((nxt, stored[src].shape, stored[src].dtype))
        for s in spec.stack:
            then = next((n for n, src in spec.next_of if src == s.name), None)
            for key, last in frames.stack_columns(spec, s).items():
                name = s.name if key == s.name else then
                assert name is not None
                parts.append((*source(s.name), last, s.k))
                outs.append((name, (s.k, *stored[s.name].shape), stored[s.name].dtype))
                self.stacks[name] = s
        for name, col in large.items():  # the rest, the row's own
            if spec.stacked(name) is None:
                parts.append((index[name], 0, col[0].nbytes, c, 0))
                outs.append((name, col.shape[1:], col.dtype))
        if block.episode is not None:
            parts.append((len(index) + (block.packed is not None), 0, 8, c, 0))
        return outs, parts

    @staticmethod
    def serves(src: Source) -> bool:
        """Whether ``src``'s samples with replacement can be one call: its sampler's draw is one
        the C call makes (``Sampler.served``), and the columns fit a plan."""
        if src.options.sampler.served is None:
            return False  # only its own draw: never a built-in one in its place
        block = src.block
        spec = block.frames
        columns = (block.packed is not None) + len(block.large) + (block.episode is not None)
        if spec is not None:  # the parts: at most the columns, and a second stack of each
            columns += len(spec.stack)
            if spec.depth + spec.ahead + 1 > MAX_COLUMNS:
                return False
        return native.lib is not None and getattr(src.ring, "native_view", None) is not None and columns <= MAX_COLUMNS

    def close(self) -> None:
        """Release the plan's views of the block (``ReplayBuffer.close``)."""
        self.lib.read_close(self.plan)

    def __call__(self, src: Source, n: int, out: dict[str, np.ndarray] | None, calls: int) -> Batch | None:
        """``draw(src, n, out=out, calls=calls)`` in one call, or ``None``: ``draw`` must run."""
        if out is not None and any(s.axis and name in out for name, s in self.stacks.items()):
            return None  # the C call writes a stack's frames in a row; the field interleaves them
        record = self.record
        rec = None
        outs: list[np.ndarray] = []
        if record is not None:  # the packed record, gathered as a structured array: its fields are views
            if out is None:
                rec = np.empty(n, record.dtype)
            else:
                block = out.get("_block")  # none given: the reader's path (a frames buffer's makes one)
                if block is None or not (
                        block.flags.c_contiguous and block.dtype == np.uint8 and block.shape == (n, record.itemsize)):
                    return None  # the reader's numpy gather takes it
                rec = block.view(record.dtype).reshape(n)
            outs.append(rec)
        large = _large_outs(self.large, n, out) if self.large else {}
        if large is None:
            return None  # an out the C copies do not take: the reader's path
        outs += large.values()
        episode = None
        if self.episode:
            episode = np.empty(n, np.int64)
            outs.append(episode)
        ids, ok = np.empty(n, np.int64), np.empty(n, np.bool_)
        leaves: np.ndarray | None = None
        weight: np.ndarray | None = None
        if self.tree:  # prioritized, or uniform under max_use (leaf 1 for each row with uses left)
            sampler = src.options.sampler
            leaves = np.empty(n)
            beta = 0.0
            if sampler.prioritized:  # served "tree": Prioritized's weights
                weight = np.empty(n, np.float32)
                beta = cast(Prioritized, sampler).beta_at(calls)
            bad = self.sample(self.plan, tuple(outs), ids, ok, _THREAD.nogil, leaves, weight, beta)
        else:
            bad = self.sample(self.plan, tuple(outs), ids, ok, _THREAD.nogil)
        if bad < 0:
            return None
        for name, s in self.stacks.items():  # frames (n, k, *frame) in the field's layout
            if out is None or name not in out:
                large[name] = frames.assemble(s, large[name])
            else:
                large[name] = out[name]
        if bad:  # rows still not intact after the C rounds: the reader's loop (waits, reaps, gives up)
            rows = Rows(ok, None if rec is None else rec.view(np.uint8).reshape(n, -1), large, episode)
            # under max_use the positions that are ok have counted their use, the others not
            ids, rows, leaves = fetch(src.block, src.ring, ids, _redrawer(src, n, True), reap=src.reap, values=leaves,
                                      out=out, what=lambda: f"sample({n}) of buffer {src.name!r}", rows=rows,
                                      claim=Uses(src) if self.counting else None,
                                      unclaimed=np.flatnonzero(~ok) if self.counting else None)
            if weight is not None:
                prios = src.priorities
                assert prios is not None
                weight = src.options.sampler.weights(prios.tree, leaves, calls)
        extras = {"index": ids}
        if episode is not None:
            extras["episode"] = episode
        if weight is not None:
            extras["weight"] = weight
        if large:
            fields = {name: large[name] if name in large else rec[name] for name in self.names}  # type: ignore[index]
        else:
            fields = {name: rec[name] for name in self.names}  # type: ignore[index]
        return Batch(fields, extras, block=rec, record=record)  # the block's bytes when asked (Batch.block)


def _redrawer(src: Source, n: int, replace: bool) -> Redraw:
    """The re-draw of ``draw``'s sample of ``n``: ``src``'s sampler again, for ``fetch``."""
    ring, prios, sampler = src.ring, src.priorities, src.options.sampler
    tree = prios.tree if prios is not None else None

    def redraw(k: int, taken: np.ndarray, slow: bool) -> tuple[np.ndarray, np.ndarray | None]:
        if slow and tree is not None and not replace and np.count_nonzero(tree.leaves) < n:
            raise EmptyBufferError(
                f"sample({n}, replace=False): only {np.count_nonzero(tree.leaves)} rows of buffer "
                f"{src.name!r} can be drawn; the others are used up (max_use={src.options.max_use}) or empty")
        if slow and tree is None and src.block.counters[Counter.REMOVED]:
            held = ring.held_ids()  # deleted rows (stamp 0) still count in len(ring): n may exceed the rest
            left = np.count_nonzero(ring.stamp.take(ring.slots(held)))
            if left == 0:
                _nothing_to_draw(src, n, final=True)
            if left < n and not replace:
                raise EmptyBufferError(
                    f"sample({n}, replace=False): only {left} rows of buffer {src.name!r} can be drawn; "
                    "the others were deleted or are empty")
        more = sampler.draw(ring, tree, src.rng, k, replace=replace, taken=taken, again=True, slow=slow)
        if more.ids.size < k:
            _nothing_to_draw(src, n, final=False)
        return more.ids, more.leaves

    return redraw


def _nothing_to_draw(src: Source, n: int, *, final: bool) -> None:
    """Raise when no row can be drawn now or ever, saying why; return to let the reader wait a moment."""
    if len(src.ring) == 0:
        why = "is empty; push rows first" if final else "was emptied (cleared) while sampling"
        raise EmptyBufferError(f"sample({n}): buffer {src.name!r} {why}")
    prios = src.priorities
    if (prios is not None and prios.tree.total <= 0) or (final and src.block.counters[Counter.REMOVED]):
        raise EmptyBufferError(f"sample({n}): buffer {src.name!r} {_why_none(src)}")
    if final:
        raise EmptyBufferError(_too_few(src.name, n, len(src.ring)))


def _why_none(src: Source) -> str:
    """Why no held row of ``src`` can be drawn: deleted, used up, or of priority 0."""
    ring, prios = src.ring, src.priorities
    slots = ring.slots(ring.held_ids())
    there = ring.stamp[slots] != 0
    deleted = int(slots.size - np.count_nonzero(there))
    used = 0
    if prios is not None and prios.uses is not None and prios.max_use is not None:
        used = int(np.count_nonzero(prios.uses[slots][there] >= prios.max_use))
    if deleted == slots.size:
        return ("holds no row: every row was deleted (delete()) or lost (a writer died mid-push); "
                "push rows first")
    parts = [f"{used} have been drawn max_use={src.options.max_use} times"] if used else []
    if deleted:
        parts.append(f"{deleted} were deleted (delete()) or lost")
    rest = slots.size - deleted - used
    if rest:
        parts.append(f"{rest} have priority 0 (a prioritized buffer with eps=0 draws no row of priority 0)")
    return f"has no row that can be drawn: of its {slots.size} rows, " + ", ".join(parts)


class Uses:
    """``max_use``'s count of a read's rows (``fetch``): each row read counts a use, under the
    lock; a read that raises gives back the uses it counted (nothing is lost to it)."""

    def __init__(self, src: Source) -> None:
        self.src = src

    def claim(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Count a use for the rows at ``positions`` that are still current; return the positions
        to re-draw (used up meanwhile, or gone)."""
        ring, prios = self.src.ring, self.src.priorities
        assert prios is not None
        with ring.lock:
            mine = ids[positions]
            live = ring.current(mine)
            ok = np.zeros(positions.size, bool)
            ok[live] = prios.claim(ring.slots(mine[live]))
        return positions[~ok]

    def give_back(self, ids: np.ndarray, positions: np.ndarray, leaves: np.ndarray | None) -> None:
        """Undo the count of the rows at ``positions`` (``leaves``: every position's, from the
        draw) that are still current."""
        ring, prios = self.src.ring, self.src.priorities
        assert prios is not None
        leaves = np.ones(ids.shape[0]) if leaves is None else leaves
        with ring.lock:
            mine = ids[positions]
            live = ring.current(mine)
            prios.give_back(ring.slots(mine[live]), leaves[positions][live])


def epoch(src: Source, batch_size: int, *, shuffle: bool, drop_last: bool) -> Iterator[Batch]:
    """Every row held now, once, in batches (``ReplayBuffer.epoch``)."""
    if (type(batch_size) is not int and not isinstance(batch_size, np.integer)) or batch_size <= 0:
        raise ValueError(f"epoch: expected a positive batch size, got {batch_size!r}")
    ring, prios = src.ring, src.priorities
    counting = prios is not None and prios.uses is not None
    ids = ring.held_ids()
    if not ids.size:  # a loop over nothing would look like a learner that learns nothing
        raise EmptyBufferError(f"epoch({batch_size}): buffer {src.name!r} is empty; push rows first "
                               "(with collectors, collector.warm(rows) waits for them)")
    if counting:
        assert prios is not None
        ids = ids[prios.tree.leaves[ring.slots(ids)] > 0]
    if shuffle:
        ids = src.rng.permutation(ids)
    stop = ids.size - ids.size % batch_size if drop_last else ids.size
    for at in range(0, stop, batch_size):
        chunk = ids[at:at + batch_size].copy()
        rows = gather(src.block, ring, chunk)
        if not rows.ok.all():
            settle(src.block, ring, chunk, rows)
        keep = np.flatnonzero(rows.ok)
        if counting:
            keep = np.setdiff1d(keep, Uses(src).claim(chunk, keep), assume_unique=True)
        if keep.size < chunk.size:
            chunk, rows = chunk[keep], rows.subset(keep)
        if chunk.size:
            ring.count_sampled(int(chunk.size))
            yield assemble(src.block, chunk, rows)


_NOT_A_TRANSITION = ("the row is not a whole transition now (next_of/stack, frames.py): it holds an episode's "
                     "final observation, waits for the next row of its lane, or its stack reaches rows "
                     "overwritten or cleared")


def take(src: Source, ids: Any) -> Batch:
    """The rows ``ids``, all intact, or an error naming those that are not (``ReplayBuffer.take``)."""
    ring = src.ring
    ids = ring.check_ids(ids, "take")
    if not ids.size:
        raise ValueError("take: expected at least one id")
    rows = gather(src.block, ring, ids)
    if not rows.ok.all():
        settle(src.block, ring, ids, rows)
    if not rows.ok.all():
        gone = ids[~rows.ok]
        why = "overwritten, cleared or being written"
        if src.block.frames is not None:
            why += f"; or {_NOT_A_TRANSITION}"
        raise EmptyBufferError(
            f"take: {gone.size} of {ids.size} rows are no longer in buffer {src.name!r} "
            f"(ids {gone[:5].tolist()}{' ...' if gone.size > 5 else ''}: {why})"
        )
    return assemble(src.block, ids, rows)


_LOST = ("a row was lost: its writer died mid-push, its push failed after another writer had reserved rows "
         "after it, or it was deleted")


def gone(src: Source, slots: Any) -> np.ndarray:
    """Which held ``slots`` lost their row: deleted or lost (stamp 0: ``edits.delete``, a dead
    writer's reaped row) or used up (``max_use``). ``len`` leaves them out, and ``get``'s positions."""
    out = src.ring.stamp[slots] == 0
    prios = src.priorities
    if prios is not None and prios.uses is not None and prios.max_use is not None:
        out |= prios.uses[slots] >= prios.max_use
    return out


def counted(src: Source) -> np.ndarray:
    """The ids of the rows ``len`` counts, lane by lane, oldest first: ``get``'s positions (and
    the order of ``export``, which also keeps used-up rows with their uses). Rows being written
    count (a read waits for them); rows that are gone (``gone``, once the buffer has lost one:
    ``Counter.REMOVED``) do not; with ``next_of``/``stack`` only transitions count: not end or
    lead rows, and with ``next_of`` not a lane's newest row (its next observation is not pushed).
    O(rows held) a call."""
    ring = src.ring
    ids = ring.held_ids()
    keep = np.ones(ids.size, bool)
    if src.block.counters[Counter.REMOVED]:
        keep &= ~gone(src, ring.slots(ids))
    spec = src.block.frames
    if spec is not None:
        keep &= (src.block.arrays[frames.KIND][ring.slots(ids)] & (frames.END | frames.LEAD)) == 0
        if spec.next_of:
            first, stop = ring.bounds()
            lanes = np.flatnonzero(stop > first)
            keep &= ~np.isin(ids, (stop[lanes] - 1) * ring.lanes + lanes)
    return ids[keep]


def get(src: Source, index: Any) -> Batch:
    """Rows by logical index, waiting (up to a second) for rows being written (``ReplayBuffer.get``)."""
    ring = src.ring
    deadline = time.monotonic() + 1.0
    while True:
        if src.block.frames is None and not src.block.counters[Counter.REMOVED]:
            ids = ring.ids_at(index)  # every held row counts: positions are arithmetic
        else:
            held = counted(src)
            ids = np.asarray(held[positions(index, held.size)])
        flat = ids.reshape(-1)
        rows = gather(src.block, ring, flat)
        if not rows.ok.all():
            settle(src.block, ring, flat, rows)
        if rows.ok.all():
            break
        expect = ring.expected(flat)
        now = ring.stamp.take(ring.slots(flat))
        if src.block.frames is not None and (now == expect).all():
            raise EmptyBufferError(f"get({index!r}): {_NOT_A_TRANSITION}")
        if np.any(now < expect) and not np.any(now[now < expect] & 1):
            raise EmptyBufferError(f"get({index!r}): {_LOST}")
        if time.monotonic() > deadline:
            if src.reap().size:
                raise EmptyBufferError(f"get({index!r}): {_LOST}")
            raise WaitTimeout(f"get({index!r}): a row is still being written after 1 s")
        if np.any(now & 1):
            time.sleep(0.0005)  # being written: wait; overwritten: look the index up again
    batch = assemble(src.block, flat, rows)
    if ids.ndim == 0:
        return Batch({k: v[0] for k, v in batch.fields.items()}, {k: v[0] for k, v in batch.extras.items()})
    return batch
