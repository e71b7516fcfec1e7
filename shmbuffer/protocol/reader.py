"""The reader's half of the commit protocol (``ring.py``) on a buffer: which rows to read, and
what to do with those that are not intact.

``gather.gather`` copies rows under the stamp check. ``fetch`` is the one re-draw loop: rows (or
windows of rows) that are not accepted are drawn again, a bounded number of rounds before dead
writers' rows are reaped, and for at most ``GIVE_UP`` seconds; with ``unique`` a row appears
once, with a ``claim`` (``Uses``, ``max_use``) each row's use is counted under the lock once it is
read, and given back when the read raises. On them: ``draw`` (the sampler's draw, read),
``epoch``, ``take`` and ``get``; ``counted_ids`` says which rows ``len`` counts, ``get``'s positions.
``draw_gather.py`` makes ``draw`` one C call where it serves.

Everything here works through a ``Source`` (``ReplayBuffer`` is one): its block, ring, options,
priorities and generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from .. import frames
from ..batch import Batch
from ..errors import EmptyBufferError, WaitTimeout
from ..sampling import limiter, ranks
from ..sampling.ranks import EPOCH, Rank
from ..sampling.samplers import Draw, drawn_by
from .gather import REDRAW_ROUNDS, Rows, assemble, gather, regather
from .layout import Block, Counter, Options
from .priorities import Priorities
from .ring import Ring
from .rows import is_writing, lane_of, number_of, positions, slot

NONE = np.empty(0, np.int64)
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
    ranked: Rank | None
    """This process's rank of several learners (``ranks.py``), or ``None``: it draws alone."""

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
        """Mark the rows of writers that died mid-push empty (out of the tree); return their slots."""

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
    frames_ = block.rows.once and ids.ndim == 1
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
    except BaseException as e:
        if claim is not None:  # the positions not in `unclaimed` now have counted a use: give it back
            counted = np.setdiff1d(np.arange(ids.shape[0]), unclaimed)
            if counted.size:
                claim.give_back(ids, counted, values)
                if isinstance(e, EmptyBufferError):
                    short_of_uses(claim.src, ids.shape[0])
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


def _too_few(name: str, n: int, held: int) -> str:
    return (f"sample({n}, replace=False): buffer {name!r} holds only {held} row{'' if held == 1 else 's'}; "
            f"sample at most {held} distinct rows, draw with repeats (replace=True, the default), "
            "or wait until writers have pushed more")


# -- reads a buffer serves with these ------------------------------------------------------------
def draw(src: Source, n: int, *, replace: bool = True, out: dict[str, np.ndarray] | None = None, calls: int = 0,
         first: Draw | None = None) -> Batch:
    """``n`` rows drawn by ``src``'s sampler and read intact; what the reader refuses is drawn
    again (``fetch``). A prioritized batch has ``weight``, annealed for the ``calls``-th sample.
    ``first``: the rows drawn already (a rank's part of a global draw, ``ranks.draw``)."""
    ring, prios, sampler = src.ring, src.priorities, src.options.sampler
    tree = prios.tree if prios is not None else None
    if not replace and n > len(ring):
        raise EmptyBufferError(_too_few(src.name, n, len(ring)))
    counting = prios is not None and prios.uses is not None
    block = src.block
    # a few rows of a frames buffer are not transitions (end rows, a lane's newest): draw a few
    # spares with the rest and keep the first n that are, instead of a second round for those.
    # Keeping the first n valid of independent draws is rejection sampling: the same distribution
    spares = (max(8, n // 32) if block.rows.once and replace and out is None and not counting
              and first is None else 0)
    # uniform draws are independent: the spares come in the same call; a prioritized draw is
    # stratified over its n, so its spares are drawn apart (``retry``: unstratified)
    if first is None:
        first = sampler.draw(ring, tree, src.rng, n + (spares if tree is None else 0), replace=replace)
    if first.ids.size < n:
        nothing_to_draw(src, n, final=True, got=first.ids.size, replace=replace)
    ids, leaves = first
    if spares and tree is not None:
        more = sampler.draw(ring, tree, src.rng, spares, replace=True, taken=ids, retry=True)
        ids = np.concatenate([ids, more.ids])
        leaves = None if leaves is None or more.leaves is None else np.concatenate([leaves, more.leaves])

    redraw = redrawer(src, n, replace)
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
                                  claim=Uses(src) if counting else None, out=out, what=sampling(src, n), rows=rows)
    if leaves is None:  # drawn without a tree: no weights
        return assemble(block, ids, rows)
    weight = sampler.weights(tree, leaves, calls)
    return assemble(block, ids, rows, {"weight": weight} if weight is not None else None)

def count(src: Source, rows: int, timeout: float | None, draw: Callable[[], Any]) -> Any:
    """Run a sample, counting its ``rows`` as sampled (through the rate limiter, if any)."""
    if src.options.limiter is None:  # the usual case, without the limiter's plumbing
        result = draw()
        src.ring.count_sampled(rows)
        return result
    return limiter.draw_admitted(src.options.limiter, src.ring, rows, timeout, draw)


def draw_ids(src: Source, k: int, retry: bool) -> Draw:
    """``k`` ids drawn by ``src``'s sampler (from the tree where it has one), for a reader that
    reads them elsewhere (the device copy); ``retry``: a re-draw. A rank's first draw is its part
    of the step's keyed global draw (``ranks.draw``); its re-draws are its own generator's."""
    prios = src.priorities
    tree = prios.tree if prios is not None else None
    if src.ranked is not None and not retry:
        return ranks.draw(src.options.sampler, src.ring, tree, src.ranked, k, True)
    return src.options.sampler.draw(src.ring, tree, src.rng, k, retry=retry)


def redrawer(src: Source, n: int, replace: bool) -> Redraw:
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
                nothing_to_draw(src, n, final=True)
            if left < n and not replace:
                raise EmptyBufferError(
                    f"sample({n}, replace=False): only {left} rows of buffer {src.name!r} can be drawn; "
                    "the others were deleted or are empty")
        more = sampler.draw(ring, tree, src.rng, k, replace=replace, taken=taken, retry=True, from_scan=slow)
        if more.ids.size < k:
            nothing_to_draw(src, n, final=False)
        return more.ids, more.leaves

    return redraw


def sampling(src: Source, n: int) -> Callable[[], str]:
    """What a sample of ``n`` is, for ``fetch``'s errors: the buffer, and a user's draw by name
    (rows it keeps drawing that are not there are its own to explain)."""
    by = drawn_by(src.options.sampler)
    return lambda: f"sample({n}) of buffer {src.name!r}" + (f" (drawn by {by})" if by else "")


def nothing_to_draw(src: Source, n: int, *, final: bool, got: int = 0, replace: bool = True) -> None:
    """Raise when no row can be drawn now or ever, saying why; return to let the reader wait a
    moment. ``got``: the ids a first draw gave (a user's draw that gave fewer is named)."""
    by = drawn_by(src.options.sampler)
    if by is not None and final and len(src.ring):
        distinct = "" if replace else " distinct"
        raise EmptyBufferError(
            f"sample({n}{'' if replace else ', replace=False'}): {by} gave {got}{distinct} ids for the {n} asked, "
            f"from buffer {src.name!r} of {len(src.ring)} rows: a draw gives fewer only when it has no more rows to "
            f"draw from; sample fewer rows, or wait until writers have pushed more")
    if len(src.ring) == 0:
        why = "is empty; push rows first" if final else "was emptied (cleared) while sampling"
        raise EmptyBufferError(f"sample({n}): buffer {src.name!r} {why}")
    prios = src.priorities
    if (prios is not None and prios.tree.total <= 0) or (final and src.block.counters[Counter.REMOVED]):
        raise EmptyBufferError(f"sample({n}): buffer {src.name!r} {_why_none(src)}")
    if final:
        raise EmptyBufferError(_too_few(src.name, n, len(src.ring)))


def short_of_uses(src: Source, n: int) -> None:
    """After a ``max_use`` sample found no row left (and gave back the uses it had counted): raise
    saying so when the rows still have uses, fewer than ``n``: the batch itself used them up, and
    ``_why_none``, asked while its uses were counted, blamed rows drawn ``max_use`` times."""
    ring, prios = src.ring, src.priorities
    if prios is None or prios.uses is None or prios.max_use is None:
        return
    slots = ring.slots(ring.held_ids())
    slots = slots[ring.stamp[slots] != 0]
    left = int(np.maximum(prios.max_use - prios.uses[slots].astype(np.int64), 0).sum())
    if 0 < left < n:
        raise EmptyBufferError(
            f"sample({n}): buffer {src.name!r} has {left} draw{'' if left == 1 else 's'} left (max_use="
            f"{prios.max_use}, {slots.size} rows), fewer than the batch's {n} rows: sample fewer rows, or wait "
            "until writers have pushed more") from None


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
    rank = src.ranked
    if shuffle:  # a rank: the epoch's permutation keyed on (seed, epoch), the same on every rank
        ids = src.rng.permutation(ids) if rank is None else rank.generator(EPOCH, rank.epochs).permutation(ids)
    if rank is not None:
        rank.epochs += 1
    whole = batch_size * (1 if rank is None else rank.world_size)  # the global batch, split in rank order
    stop = ids.size - ids.size % whole if drop_last else ids.size
    for at in range(0, stop, whole):
        chunk = ids[at:at + whole]
        chunk = (chunk if rank is None else chunk[rank.part(chunk.size)]).copy()
        if not chunk.size:
            continue
        rows = gather(src.block, ring, chunk)
        if not rows.ok.all():
            regather(src.block, ring, chunk, rows)
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
        regather(src.block, ring, ids, rows)
    if not rows.ok.all():
        gone = ids[~rows.ok]
        # a slot left empty inside its lane's rows lost its row (deleted, a dead or failed push):
        # said as such, not as overwritten
        first, stop = ring.bounds()
        lane, n = lane_of(gone, ring.lanes), number_of(gone, ring.lanes)
        lost = (n >= first[lane]) & (n < stop[lane]) & (ring.stamp[ring.slots(gone)] == 0)
        why = "overwritten, cleared or being written" if not lost.all() else ""
        if lost.any():
            why += ("; ids " + str(gone[lost][:5].tolist()) + ": " if why else "") + _LOST
        if src.block.rows.once:
            why += f"; or {_NOT_A_TRANSITION}"
        raise EmptyBufferError(
            f"take: {gone.size} of {ids.size} rows are no longer in buffer {src.name!r} "
            f"(ids {gone[:5].tolist()}{' ...' if gone.size > 5 else ''}: {why})"
        )
    return assemble(src.block, ids, rows)


_LOST = ("a row was lost: its writer died mid-push, its push failed after another writer had reserved rows "
         "after it, or it was deleted")


def lost_rows(src: Source, slots: Any) -> np.ndarray:
    """Which held ``slots`` lost their row: deleted or lost (stamp 0: ``edits.delete``, a dead
    writer's reaped row) or used up (``max_use``). ``len`` leaves them out, and ``get``'s positions."""
    out = src.ring.stamp[slots] == 0
    prios = src.priorities
    if prios is not None and prios.uses is not None and prios.max_use is not None:
        out |= prios.uses[slots] >= prios.max_use
    return out


def counted_ids(src: Source) -> np.ndarray:
    """The ids of the rows ``len`` counts, lane by lane, oldest first: ``get``'s positions (and
    the order of ``export``, which also keeps used-up rows with their uses). Rows being written
    count (a read waits for them); rows that are gone (``lost_rows``, once the buffer has lost one:
    ``Counter.REMOVED``) do not; with ``next_of``/``stack`` only transitions count (``frames.transitions``: not end or
    lead rows, not a lane's newest row with ``next_of``, not a stack reaching rows lapped).
    O(rows held) a call."""
    ring = src.ring
    ids = ring.held_ids()
    keep = np.ones(ids.size, bool)
    if src.block.counters[Counter.REMOVED]:
        keep &= ~lost_rows(src, ring.slots(ids))
    spec = src.block.rows
    if spec.once:  # held_ids lists each lane's rows oldest first, lane after lane
        kind = src.block.arrays[frames.KIND][ring.slots(ids)]
        first, stop = ring.bounds()
        at = 0
        for a, b in zip(first.tolist(), stop.tolist(), strict=True):
            keep[at:at + b - a] &= frames.transitions(spec, kind[at:at + b - a])
            at += b - a
    return ids[keep]


def held(src: Source) -> int:
    """``len(buf)``: how many rows ``counted_ids`` lists, counted lane by lane without listing them: the
    ring's rows, less those gone (once a row was deleted or used up) and, with frames, those that
    are not transitions (``frames.transitions``)."""
    n = len(src.ring)
    spec, lost = src.block.rows, bool(src.block.counters[Counter.REMOVED])
    if not n or not (lost or spec.once):
        return n
    ring = src.ring
    first, stop = ring.bounds()
    lc = ring.lane_capacity
    for lane in range(ring.lanes):
        a, b = int(first[lane]), int(stop[lane])
        if b <= a:
            continue
        # oldest first: a row's neighbours decide whether it is a transition; a full lane's gone rows are its slots'
        slots = slot(lane, np.arange(a, b), lc) if spec.once or b - a < lc else slice(lane * lc, (lane + 1) * lc)
        if spec.once:
            out = ~frames.transitions(spec, src.block.arrays[frames.KIND][slots])
            if lost:
                out |= lost_rows(src, slots)
        else:
            out = lost_rows(src, slots)
        n -= int(np.count_nonzero(out))
    return n


def check_transitions(src: Source, n: int, replace: bool) -> None:
    """With ``next_of``/``stack``: refuse a sample of more whole transitions than the buffer
    holds (``frames.transitions``: an episode's final observation, each lane's newest row with
    ``next_of``, a row whose stack reaches rows lapped are not)."""
    spec = src.block.rows
    ring = src.ring
    if spec.once and (not replace or (spec.next_of and len(ring) <= 2 * ring.lanes)):
        # len scans the lanes (O(capacity)): only where it can say no (few rows, or distinct ones)
        whole = held(src)  # rows that are whole transitions (frames.py)
        if whole == 0 or (not replace and n > whole):
            raise EmptyBufferError(
                f"sample({n}{'' if replace else ', replace=False'}): buffer {src.name!r} holds {whole} whole "
                "transitions (an episode's final observation, each lane's newest row with next_of, which "
                "waits for its next, and a row whose stack reaches rows lapped are not)")


def get(src: Source, index: Any) -> Batch:
    """Rows by logical index, waiting (up to a second) for rows being written (``ReplayBuffer.get``)."""
    ring = src.ring
    deadline = time.monotonic() + 1.0
    while True:
        if not src.block.rows.once and not src.block.counters[Counter.REMOVED]:
            ids = ring.ids_at(index)  # every held row counts: positions are arithmetic
        else:
            held = counted_ids(src)
            ids = np.asarray(held[positions(index, held.size)])
        flat = ids.reshape(-1)
        rows = gather(src.block, ring, flat)
        if not rows.ok.all():
            regather(src.block, ring, flat, rows)
        if rows.ok.all():
            break
        expect = ring.expected(flat)
        now = ring.stamp.take(ring.slots(flat))
        if src.block.rows.once and (now == expect).all():
            raise EmptyBufferError(f"get({index!r}): {_NOT_A_TRANSITION}")
        if np.any(now < expect) and not np.any(is_writing(now[now < expect])):
            raise EmptyBufferError(f"get({index!r}): {_LOST}")
        if time.monotonic() > deadline:
            if src.reap().size:
                raise EmptyBufferError(f"get({index!r}): {_LOST}")
            raise WaitTimeout(f"get({index!r}): a row is still being written after 1 s")
        if np.any(is_writing(now)):
            time.sleep(0.0005)  # being written: wait; overwritten: look the index up again
    batch = assemble(src.block, flat, rows)
    if ids.ndim == 0:
        return Batch({k: v[0] for k, v in batch.fields.items()}, {k: v[0] for k, v in batch.extras.items()})
    return batch
