"""Windows of consecutive steps: sequences (R2D2), n-step returns, groups and whole episodes.

An env's consecutive steps are consecutive rows of one lane (``ring.py``) carrying one episode id
(a buffer made with ``episodes=True``; the pusher names the episode). A *window* around an anchor
row is the rows ``anchor + offset`` of the anchor's lane for a range of offsets. Its positions
count (``mask``) while they are inside the lane's rows, intact (``reader.py``: committed before
and after the copy, episode id included) and of the anchor's episode as read with the anchor —
and only up to the first position that does not: a window never crosses an episode's end, the
write head, a row being written or the oldest row.

The functions at the top are index arithmetic on plain arrays; the samplers below take any
``reader.Source`` (a ``ReplayBuffer``) and read rows only through ``reader.py``.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

import numpy as np

from . import arguments
from .batch import Batch
from .errors import CapacityError, EmptyBufferError, FieldError
from .frames import LEAD, START
from .protocol import reader
from .protocol.gather import Rows, assemble, gather
from .protocol.reader import GIVE_UP, Source
from .protocol.ring import INVALID, Ring
from .protocol.rows import lane_of, number_of, row_id, slot, window
from .sampling import ranks
from .sampling.samplers import check_batch_size, uniform_ids


def window_ids(ring: Ring, anchors: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rows ``anchor + offset`` of each anchor's lane, ``(n, len(offsets))``, and
    whether each lies inside its lane's rows now (outside: ``INVALID``)."""
    ids, inside = window(anchors, offsets, ring.lanes, *ring.bounds())
    ids[~inside] = INVALID
    return ids, inside


def window_mask(valid: np.ndarray, anchor: int) -> np.ndarray:
    """Keep each row's positions from column ``anchor`` outwards while they stay ``valid``:
    forwards for the columns after it, backwards for those before (burn-in)."""
    mask = np.zeros_like(valid)
    mask[:, anchor:] = np.logical_and.accumulate(valid[:, anchor:], axis=1)
    if anchor:
        back = valid[:, :anchor][:, ::-1] & valid[:, anchor:anchor + 1]
        mask[:, :anchor] = np.logical_and.accumulate(back, axis=1)[:, ::-1]
    return mask


def n_step_return(reward: Any, done: Any, mask: Any, gamma: float) -> tuple[Any, Any, Any]:
    """Discounted returns over windows ``(n, k)`` starting at their anchor (column 0): numpy
    arrays, or torch tensors on any device (the device copy's n-step sample), ``reward`` float64.

    A window stops at its first masked position and after its first ``done`` row. Returns the
    return, the number of steps used (>= 1), and whether the last step used was ``done``.
    """
    xp = np if isinstance(reward, np.ndarray) else sys.modules["torch"]
    done = done != 0
    used = mask & ~(done.cumsum(1) > done)  # a done before the position ends the window
    steps = used.sum(1)
    discount = gamma ** xp.arange(reward.shape[1], dtype=xp.float64, device=reward.device)
    ret = (xp.where(used, reward, 0.0) * discount).sum(1)
    return ret, steps, done[xp.arange(done.shape[0], device=reward.device), (steps - 1).clip(0)]


def episode_extent(ring: Ring, episode: np.ndarray, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row numbers ``[first, stop)`` of each anchor's episode within its lane's rows now.

    An episode's rows are one run of its lane (ids are unique), so each end is found by binary
    search on "row r belongs to the anchor's episode"."""
    lanes, lc = ring.lanes, ring.lane_capacity
    lane = lane_of(anchors, lanes)
    row = number_of(anchors, lanes)
    start, stop = ring.bounds()
    lo_bound, hi_bound = start[lane], stop[lane]
    own = episode[slot(lane, row, lc)]

    def same(r: np.ndarray) -> np.ndarray:
        return episode[slot(lane, r, lc)] == own

    # first: the smallest r in [lo_bound, row] with same(r); same() is False below it, True above
    lo, hi = lo_bound.copy(), row.copy()
    while (lo < hi).any():
        mid = (lo + hi) // 2
        ok = same(mid)
        hi = np.where(ok & (lo < hi), mid, hi)
        lo = np.where(~ok & (lo < hi), mid + 1, lo)
    first = lo
    # stop: the smallest r in (row, hi_bound] with not same(r) (hi_bound when none)
    lo, hi = row + 1, hi_bound.copy()
    while (lo < hi).any():
        mid = (lo + hi) // 2
        ok = same(np.minimum(mid, hi_bound - 1))
        lo = np.where(ok & (lo < hi), mid + 1, lo)
        hi = np.where(~ok & (lo < hi), mid, hi)
    return first, lo


# -- sampling windows from a buffer -------------------------------------------------------------

REWARD = ("reward", "rew", "rewards")
NEXT_OBS = ("next_obs", "next_observation", "next_state", "next_obs_")
DONE = ("done", "terminated", "dones", "terminal")


def _field(src: Source, given: str | None, choices: tuple[str, ...], what: str) -> str:
    names = src.block.schema.names
    if given is not None:
        if given not in names:
            raise FieldError(f"{what}: no field {given!r}; the schema has {', '.join(names)}")
        return given
    for name in choices:
        if name in names:
            return name
    raise FieldError(
        f"n-step returns need a {what} field (one of {', '.join(choices)}); the schema has "
        f"{', '.join(names)}: name it with fields={{{what!r}: ...}}"
    )


def _anchors(src: Source, k: int) -> np.ndarray:
    """``k`` rows drawn uniformly (fewer when the buffer is empty)."""
    start, stop = src.ring.bounds()
    return uniform_ids(src.rng, k, start, stop)


def _windows(src: Source, n: int, offsets: np.ndarray, anchor: int, *, full: bool, what: str) -> tuple[np.ndarray, Rows, np.ndarray]:
    """``n`` windows around uniformly drawn anchors: ids, rows and mask. A window whose anchor
    is not intact (or, with ``full``, that is not valid everywhere) is re-drawn (``reader.fetch``)."""
    ring = src.ring
    width = offsets.size

    def valid(ids: np.ndarray, rows: Rows) -> np.ndarray:
        assert rows.episode is not None
        return rows.ok & (rows.episode == rows.episode[:, anchor:anchor + 1])

    def accept(ids: np.ndarray, rows: Rows) -> np.ndarray:
        v = valid(ids, rows)
        return np.asarray(v.all(axis=1) if full else v[:, anchor])

    def redraw(k: int, ids: np.ndarray, slow: bool) -> tuple[np.ndarray, None]:
        fresh = _anchors(src, k)
        if fresh.size < k:
            raise EmptyBufferError(f"{what}: buffer {src.name!r} was cleared")
        return window_ids(ring, fresh, offsets)[0], None

    def fits(ids: np.ndarray) -> np.ndarray:  # by the episode column as it is: fetch confirms
        win, inside = window_ids(ring, ids, offsets)
        ep = src.block.episode[ring.slots(np.where(inside, win, 0))]  # type: ignore[index]
        return np.asarray((inside & (ep == ep[:, anchor:anchor + 1])).all(axis=1))

    # a rank: its part of the step's global draw, whole windows found by keyed re-draws
    anchors = _anchors(src, n) if src.ranked is None else ranks.uniform_ids(
        src.ranked, n, *ring.bounds(), fits=fits if full else None)
    if anchors.size < n:
        raise EmptyBufferError(f"{what}: buffer {src.name!r} is empty; push rows first")
    ids = window_ids(ring, anchors, offsets)[0]
    try:
        ids, rows, _ = reader.fetch(src.block, ring, ids, redraw, reap=src.reap, accept=accept, what=what)
    except TimeoutError:
        if not full:
            raise
        raise EmptyBufferError(f"{what}: no episode has {width} rows in a row in buffer {src.name!r}") from None
    return ids, rows, window_mask(valid(ids, rows), anchor)


def _assemble(src: Source, ids: np.ndarray, rows: Rows, mask: np.ndarray | None, time_major: bool) -> Batch:
    """Fields ``(n, T, ...)`` (or ``(T, n, ...)``) with rows outside ``mask`` zeroed (their index
    -1); ``batch.mask`` unless ``mask`` is None."""
    if mask is not None:
        hole = ~mask
        if hole.any():
            if rows.packed is not None:
                rows.packed[hole] = 0
            for col in rows.large.values():
                col[hole] = 0
        ids = np.where(mask, ids, -1)
    if time_major:
        ids = ids.T.copy()
        mask = mask.T.copy() if mask is not None else None
        rows = rows.map(lambda a: a.swapaxes(0, 1).copy())
    rows.row = {}  # the extras of a window are its index and mask
    return assemble(src.block, ids, rows, {"mask": mask} if mask is not None else None)


def sample_sequences(src: Source, n: int, length: int, *, burn_in: int = 0, time_major: bool = False) -> Batch:
    """``n`` windows of ``length`` consecutive steps of one lane and episode (plus ``burn_in`` steps before), with
    a mask; ``ReplayBuffer.sample_sequences`` documents it."""
    what = f"sample_sequences({n}, {length})"
    check_windows(src, what, n, length, burn_in)
    ids, rows, mask = _windows(src, n, np.arange(-burn_in, length), burn_in, full=False, what=what)
    return _assemble(src, ids, rows, mask, time_major)


def sample_groups(src: Source, groups: int, size: int, *, ordered: bool = True, replace: bool = True,
                  short: bool = False) -> Batch:
    """``groups`` groups of ``size`` rows of one episode each; ``ReplayBuffer.sample_groups`` documents it."""
    what = f"sample_groups({groups}, {size})"
    check_windows(src, what, groups, size, 0)
    if short or not replace:
        return _episode_groups(src, groups, size, ordered=ordered, replace=replace, short=short, what=what)
    if ordered:
        ids, rows, _ = _windows(src, groups, np.arange(size), 0, full=True, what=what)
        return _assemble(src, ids, rows, None, False)
    return _shuffled_groups(src, groups, size, what)


def _shuffled_groups(src: Source, groups: int, size: int, what: str) -> Batch:
    """``size`` distinct rows of one episode per group, in random order."""
    ring = src.ring
    episodes = _need_episodes(src, what)

    def draw(k: int, rng: np.random.Generator, rounds: int = 1) -> np.ndarray:
        anchors = uniform_ids(rng, k, *ring.bounds())
        if anchors.size < k:
            raise EmptyBufferError(f"{what}: buffer {src.name!r} is empty; push rows first")
        first, stop = episode_extent(ring, episodes, anchors)
        for _ in range(rounds - 1):  # a rank's: a group of a shorter episode drawn again by the keyed generator
            short = np.flatnonzero(stop - first < size)
            if not short.size:
                break
            anchors[short] = uniform_ids(rng, short.size, *ring.bounds())
            first[short], stop[short] = episode_extent(ring, episodes, anchors[short])
        lanes = anchors % ring.lanes
        rows = np.full((k, size), INVALID, np.int64)
        for g, (lo, hi, lane) in enumerate(zip(first, stop, lanes, strict=True)):
            if hi - lo >= size:
                rows[g] = row_id(lo + rng.choice(hi - lo, size=size, replace=False), lane, ring.lanes)
        return rows

    def accept(ids: np.ndarray, rows: Rows) -> np.ndarray:
        assert rows.episode is not None
        return rows.ok.all(axis=1) & (rows.episode == rows.episode[:, :1]).all(axis=1)

    try:
        ids, rows, _ = reader.fetch(src.block, ring, ranks.sliced(src.ranked, src.rng, groups, lambda k, rng: draw(
                                        k, rng, 1 if src.ranked is None else ranks.ROUNDS)),
                                    lambda k, ids, slow: (draw(k, src.rng), None),
                                    reap=src.reap, accept=accept, what=what)
    except TimeoutError:
        raise EmptyBufferError(f"{what}: no episode in buffer {src.name!r} has {size} rows") from None
    return _assemble(src, ids, rows, None, False)


def episode_runs(src: Source, *, complete: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every episode's rows in the buffer now, as ``(lane, first, stop)`` row numbers (a scan of
    the episode column, O(rows held)). With ``complete`` only episodes whose first row is in the
    buffer (the lane's first since a clear, or after another episode's) and after whose last row
    a committed row of another episode follows: the episode still being written in each lane is
    left out. Without it every run counts, the open episode with the rows it has so far and the
    oldest one with the rows not yet overwritten. Rows being written may still show the episode
    of the row they replace: readers check every row they copy (``gather.gather``)."""
    ring = src.ring
    episodes = _need_episodes(src, "episode_runs")
    kinds = src.block.kinds
    start, end = ring.bounds()
    lc = ring.lane_capacity
    lanes_, firsts, stops = [], [], []
    for lane in range(ring.lanes):
        a, b = int(start[lane]), int(end[lane])
        if b <= a:
            continue
        rows = np.arange(a, b)
        ep = episodes[slot(lane, rows, lc)]
        cut = np.flatnonzero(ep[1:] != ep[:-1]) + 1
        first = np.concatenate([[0], cut]) + a
        stop = np.concatenate([cut, [b - a]]) + a
        if complete:
            ok = np.ones(first.size, bool)
            ok[0] = a == int(ring.base(np.array([lane]))[0])
            ok[-1] = False  # nothing follows the newest run yet
            if ok.any():
                ok[ok] = ring.current(row_id(stop[ok], lane, ring.lanes))
            first, stop = first[ok], stop[ok]
        frames = src.block.rows
        if kinds is not None and first.size and not kinds[slot(lane, first[0], lc)] & START:
            first[0] += frames.depth  # a run cut by lapping or a clear(): its first stacks reach outside
        if kinds is not None and first.size:
            for _ in range(frames.depth):  # a resumed episode's lead rows (push(resume=True)) are not steps
                first += (kinds[slot(lane, np.minimum(first, stop - 1), lc)] & LEAD != 0) & (first < stop)
        if src.block.rows.last_apart:  # an episode's last row is its end row, or has no next row yet
            stop = stop - 1
        first, stop = first[stop > first], stop[stop > first]
        lanes_.append(np.full(first.size, lane, np.int64))
        firsts.append(first)
        stops.append(stop)
    if not lanes_:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    return np.concatenate(lanes_), np.concatenate(firsts), np.concatenate(stops)


def _pick_runs(src: Source, lengths: np.ndarray, n: int, replace: bool) -> np.ndarray:
    """``n`` runs drawn in proportion to their length, distinct unless ``replace``; a rank's its
    slice of the global draw's."""
    p = lengths / lengths.sum()
    return ranks.sliced(src.ranked, src.rng, n, lambda k, rng: rng.choice(lengths.size, size=k, replace=replace, p=p))


def _episode_groups(src: Source, groups: int, size: int, *, ordered: bool, replace: bool, short: bool,
                    what: str) -> Batch:
    """Groups drawn episode first: each group one episode (distinct ones unless ``replace``),
    episodes in proportion to their rows, ``size`` consecutive (``ordered``) or distinct steps of
    it; with ``short`` an episode of fewer rows gives all of them, padded (``batch.mask``)."""
    ring = src.ring
    deadline = time.monotonic() + GIVE_UP
    while True:
        lane, first, stop = episode_runs(src, complete=False)
        length = stop - first
        if not short:
            fits = length >= size
            lane, first, stop, length = lane[fits], first[fits], stop[fits], length[fits]
        if not length.size:
            raise EmptyBufferError(f"{what}: no episode in buffer {src.name!r} has {size} rows"
                                   if len(ring) else f"{what}: buffer {src.name!r} is empty; push rows first")
        whole = groups * (1 if src.ranked is None else src.ranked.world_size)  # a rank: the global draw's
        if not replace and length.size < whole:
            raise EmptyBufferError(
                f"{what}: buffer {src.name!r} holds {length.size} episodes{'' if short else f' of {size} rows or more'}, "
                f"fewer than the {whole} distinct ones asked for{' (groups x world_size)' if whole > groups else ''} "
                "(replace=True repeats them)"
            )
        rows = ranks.sliced(src.ranked, src.rng, groups, partial(  # a rank: its slice of the global groups
            _run_groups, ring, (lane, first, length), size=size, ordered=ordered, replace=replace))
        real = rows != INVALID
        got = gather(src.block, ring, rows)
        assert got.episode is not None
        valid = got.ok & (got.episode == got.episode[:, :1]) & real
        if (valid == real).all():
            return _assemble(src, rows, got, valid if short else None, False)
        if time.monotonic() > deadline:
            raise EmptyBufferError(f"{what}: rows of buffer {src.name!r} kept changing while they were read")
        src.reap()


def _run_groups(ring: Ring, runs: tuple[np.ndarray, np.ndarray, np.ndarray], k: int, rng: np.random.Generator,
                size: int, *, ordered: bool, replace: bool) -> np.ndarray:
    """Ids ``(k, size)`` of groups of the episode runs ``(lane, first, length)`` (``_episode_groups``),
    ``INVALID`` past a short episode's rows."""
    lane, first, length = runs
    rows = np.full((k, size), INVALID, np.int64)
    for g, r in enumerate(rng.choice(length.size, size=k, replace=replace, p=length / length.sum())):
        lo, m = int(first[r]), int(min(size, length[r]))
        if ordered:
            at = lo + int(rng.integers(0, length[r] - m + 1)) + np.arange(m)
        else:
            at = lo + rng.choice(int(length[r]), size=m, replace=False)
        rows[g, :m] = row_id(at, lane[r], ring.lanes)
    return rows


def sample_episodes(src: Source, n: int, *, replace: bool = False) -> list[Batch]:
    """``n`` complete episodes (their first and last rows both in the buffer), drawn with
    probability proportional to their length, each a batch of its rows in order; distinct ones
    unless ``replace`` (``EmptyBufferError`` when fewer are complete). A rank draws from the
    complete episodes found by a scan (``episode_runs``), in proportion to their transitions: its
    slice of the global draw."""
    if not replace or src.ranked is not None:
        return _distinct_episodes(src, n, replace)
    ring = src.ring
    what = f"sample_episodes({n})"
    episodes = _need_episodes(src, what)
    out: list[Batch] = []
    deadline = time.monotonic() + GIVE_UP
    while len(out) < n:
        if time.monotonic() > deadline:
            raise EmptyBufferError(f"{what}: buffer {src.name!r} holds no complete episode to draw (found {len(out)})")
        anchors = _anchors(src, n - len(out))
        if anchors.size == 0:
            raise EmptyBufferError(f"{what}: buffer {src.name!r} is empty; push rows first")
        first, stop = episode_extent(ring, episodes, anchors)
        start, end = ring.bounds()
        lanes = anchors % ring.lanes
        # complete: its first row is the lane's first ever (since a clear) or follows another
        # episode's, and a committed row of another episode follows its last
        before = (first > start[lanes]) | (start[lanes] == ring.base(lanes))
        after = stop < end[lanes]
        after[after] = ring.current(row_id(stop[after], lanes[after], ring.lanes))
        if src.block.rows.last_apart:  # the row after the last transition is the episode's end row
            stop = stop - 1
            after &= stop > first
        for lo, hi, lane in zip(first[before & after], stop[before & after], lanes[before & after], strict=True):
            ids = row_id(np.arange(lo, hi), lane, ring.lanes)
            rows = gather(src.block, ring, ids)
            assert rows.episode is not None
            if rows.ok.all() and (rows.episode == rows.episode[0]).all():
                out.append(assemble(src.block, ids, rows))
    ring.count_sampled(sum(len(b) for b in out))
    return out


def _distinct_episodes(src: Source, n: int, replace: bool = False) -> list[Batch]:
    ring = src.ring
    what = f"sample_episodes({n}, replace={replace})"
    whole = n * (1 if src.ranked is None else src.ranked.world_size)  # a rank: the global draw's
    deadline = time.monotonic() + GIVE_UP
    while True:
        lane, first, stop = episode_runs(src, complete=True)
        if lane.size < (1 if replace else whole):
            asked = "one" if replace else f"the {whole} distinct ones asked for" + (" (n x world_size)" if whole > n else "")
            raise EmptyBufferError(
                f"{what}: buffer {src.name!r} holds {lane.size} complete episodes, fewer than {asked} (the episode "
                "still being written in each lane is not complete; replace=True repeats them)"
            )
        out = []
        for r in _pick_runs(src, (stop - first).astype(np.float64), n, replace):
            ids = row_id(np.arange(first[r], stop[r]), lane[r], ring.lanes)
            rows = gather(src.block, ring, ids)
            assert rows.episode is not None
            if not (rows.ok.all() and (rows.episode == rows.episode[0]).all()):
                break
            out.append(assemble(src.block, ids, rows))
        if len(out) == n:
            ring.count_sampled(sum(len(b) for b in out))
            return out
        if time.monotonic() > deadline:
            raise EmptyBufferError(f"{what}: rows of buffer {src.name!r} kept changing while they were read")
        src.reap()


def add_n_step(src: Source, batch: Batch, n_step: int, gamma: float, names: dict[str, str] | None) -> None:
    """Turn a sampled batch into n-step transitions, in place: ``reward`` becomes the discounted
    return over up to ``n_step`` steps of the row's episode, ``next_obs`` the observation after the
    last step used, ``done`` whether that step ended the episode; ``steps`` says how many steps
    were used (bootstrap with ``gamma ** steps``).

    The batch's rows and their episode ids (``batch.episode``) were read under one stamp check
    when it was gathered; the rows after each one are read here under their own: a following
    row counts only while it is intact, of the row's lane and of the row's episode *as read
    with the row* (its slot may hold another row by now). A window whose last row's large
    ``next_obs`` changed before it was read is read again (it is shorter then). The request was
    checked before the draw (``check_sample``: episodes kept, ``reward`` and ``done`` small fields)."""
    reward, next_obs, done = n_step_fields(src, names)
    record = src.block.record
    packed = record.offsets
    n = len(batch)
    own_episode = batch.extras["episode"]
    own_reward = batch.fields[reward].reshape(n)
    own_done = batch.fields[done].reshape(n)
    ret = np.empty(n)
    steps = np.ones(n, np.int64)
    last_done = own_done.astype(bool)
    following = batch.fields[next_obs].copy()
    todo = np.arange(n)
    while todo.size:
        m = todo.size
        ids, _ = window_ids(src.ring, batch.index[todo], np.arange(1, n_step))
        rows = gather(src.block, src.ring, ids, large=())
        valid = np.ones((m, n_step), bool)
        valid[:, 1:] = rows.ok & (rows.episode == own_episode[todo, None])
        mask = window_mask(valid, 0)
        rewards = np.empty((m, n_step))
        dones = np.empty((m, n_step), bool)
        rewards[:, 0], dones[:, 0] = own_reward[todo], own_done[todo]
        views = record.views(rows.packed.reshape(m * (n_step - 1), -1)) if rows.packed is not None else {}
        if n_step > 1:
            rewards[:, 1:] = views[reward].reshape(m, n_step - 1)
            dones[:, 1:] = views[done].reshape(m, n_step - 1)
        r, k, d = n_step_return(rewards, dones, mask, gamma)
        ret[todo], steps[todo], last_done[todo] = r, k, d
        more = np.flatnonzero(k > 1)
        if not more.size:
            break
        if next_obs in packed:
            got = views[next_obs].reshape(m, n_step - 1, *following.shape[1:])
            following[todo[more]] = got[more, k[more] - 2]
            break
        # a large field: read for the last rows only, under its own stamp check
        last = gather(src.block, src.ring, ids[more, k[more] - 2], large=(next_obs,))
        fine = last.ok & (last.episode == own_episode[todo[more]])
        following[todo[more[fine]]] = last.large[next_obs][fine]
        todo = todo[more[~fine]]
    batch.fields[next_obs][...] = following
    batch.fields[reward][...] = ret.reshape(batch.fields[reward].shape)
    batch.fields[done][...] = last_done.reshape(batch.fields[done].shape)
    batch.extras["steps"] = steps


def n_step_fields(src: Source, names: dict[str, str] | None) -> tuple[str, str, str]:
    """The reward, next observation and done fields of n-step returns (``fields=`` renames them)."""
    names = names or {}
    return (_field(src, names.get("reward"), REWARD, "reward"), _field(src, names.get("next_obs"), NEXT_OBS, "next_obs"),
            _field(src, names.get("done"), DONE, "done"))


def check_sample(src: Source, n: Any, n_step: Any, gamma: float, names: dict[str, str] | None,
                 timeout: float | None) -> tuple[int, float | None]:
    """The checks of a sample call's arguments (``ReplayBuffer.sample``, ``DeviceReplay.sample``),
    before anything is drawn: ``n`` and ``timeout`` as they are used."""
    n = check_batch_size(n)
    if timeout is not None:
        timeout = arguments.timeout(timeout, "sample: timeout")
    if n_step != 1:
        if not isinstance(n_step, (int, np.integer)) or isinstance(n_step, bool) or n_step < 1:
            raise ValueError(f"sample: n_step must be an int >= 1, got {n_step!r}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"sample: gamma must be in [0, 1], got {gamma!r}")
        what = f"n_step={n_step}"  # and one the buffer can serve
        _need_episodes(src, what)
        reward, _, done = n_step_fields(src, names)
        for name in (reward, done):  # add_n_step reads one value a row of each, from the packed record
            field = src.block.schema[name]
            if name not in src.block.record.offsets or int(np.prod(field.shape)) != 1:
                raise FieldError(f"{what}: field {name!r} must be a scalar per row (a small field of shape () or "
                                 f"(1,)), got {field.describe()}: name another with fields={{'reward': ..., 'done': ...}}")
        if n_step > src.ring.lane_capacity:
            raise CapacityError(f"{what}: longer than a lane ({src.ring.lane_capacity} rows)")
    return n, timeout


def _need_episodes(src: Source, what: str) -> np.ndarray:
    """The episode column, or a clear error when the buffer keeps none."""
    if src.block.episode is None:
        raise FieldError(
            f"{what} needs episode ids: create the buffer with episodes=True and push(..., episode=id)"
        )
    if src.block.interleaved:
        raise FieldError(
            f"{what}: buffer {src.name!r} holds rows of several episodes interleaved in one lane (a push "
            "of several envs' rows without lane=), so a lane's consecutive rows are not one env's "
            "steps and every window would be 1 step long; create the buffer with envs=N (one lane "
            "per env, a vector env's step pushed as is) or push each env's rows with lane="
        )
    return src.block.episode


def check_windows(src: Source, what: str, n: int, length: int, burn_in: int) -> None:
    """Refuse windows the buffer cannot serve (no episodes, bad sizes, longer than a lane)."""
    _need_episodes(src, what)
    for name, value, low in (("n", n, 1), ("length", length, 1), ("burn_in", burn_in, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}: {name} must be an int >= {low}, got {value!r}")
    if length + burn_in > src.ring.lane_capacity:
        raise CapacityError(
            f"{what}: windows of {length + burn_in} rows are longer than a lane ({src.ring.lane_capacity} rows)"
        )
