"""Windows of consecutive steps: sequences (R2D2), n-step returns, groups and whole episodes.

An env's consecutive steps are consecutive rows of one lane (``ring.py``) carrying one episode id
(a buffer made with ``episodes=True``; the pusher names the episode). A *window* around an anchor
row is the rows ``anchor + offset`` of the anchor's lane for a range of offsets. Its positions
count (``mask``) while they are inside the lane's rows, committed before and after the gather
(``ring.py``), and of the anchor's episode — and only up to the first position that does not:
a window never crosses an episode's end, the write head, a row being written or the oldest row.

Everything here is index arithmetic on plain arrays; ``buffer.py`` draws anchors, gathers rows
and calls these.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .batch import Batch
from .errors import CapacityError, EmptyBufferError, FieldError, WaitTimeout
from .ring import INVALID, Ring

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

_NONE = np.empty(0, np.int64)


def window_ids(ring: Ring, anchors: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rows ``anchor + offset`` of each anchor's lane, ``(n, len(offsets))``, and
    whether each lies inside its lane's rows now (outside: ``INVALID``)."""
    lanes = ring.lanes
    lane = anchors % lanes
    rows = (anchors // lanes)[:, None] + offsets[None, :]
    start, stop = ring.bounds()
    inside = (rows >= start[lane][:, None]) & (rows < stop[lane][:, None])
    ids = rows * lanes + lane[:, None]
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


def n_step_return(
    reward: np.ndarray, done: np.ndarray, mask: np.ndarray, gamma: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Discounted returns over windows ``(n, k)`` starting at their anchor (column 0).

    A window stops at its first masked position and after its first ``done`` row. Returns the
    return, the number of steps used (>= 1), and whether the last step used was ``done``.
    """
    done = done.astype(bool)
    after_done = np.zeros_like(mask)
    after_done[:, 1:] = np.logical_or.accumulate(done[:, :-1], axis=1)
    used = mask & ~after_done
    steps = used.sum(axis=1)
    discount = gamma ** np.arange(reward.shape[1], dtype=np.float64)
    ret = (np.where(used, reward, 0).astype(np.float64) * discount).sum(axis=1)
    last = np.maximum(steps - 1, 0)
    return ret, steps, done[np.arange(done.shape[0]), last]


def episode_extent(ring: Ring, episode: np.ndarray, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row numbers ``[first, stop)`` of each anchor's episode within its lane's rows now.

    An episode's rows are one run of its lane (ids are unique), so each end is found by binary
    search on "row r belongs to the anchor's episode"."""
    lanes, lc = ring.lanes, ring.lane_capacity
    lane = anchors % lanes
    row = anchors // lanes
    start, stop = ring.bounds()
    lo_bound, hi_bound = start[lane], stop[lane]
    own = episode[lane * lc + row % lc]

    def same(r: np.ndarray) -> np.ndarray:
        return episode[lane * lc + r % lc] == own

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


# -- the buffer's structured sampling (``ReplayBuffer`` delegates here) --------------------------

REWARD = ("reward", "rew", "rewards")
NEXT_OBS = ("next_obs", "next_observation", "next_state", "next_obs_")
DONE = ("done", "terminated", "dones", "terminal")


def _field(buf: ReplayBuffer, given: str | None, choices: tuple[str, ...], what: str) -> str:
    names = buf.schema.names
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


def gather_windows(
    buf: ReplayBuffer, ids: np.ndarray, fields: tuple[str, ...] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """Gather the rows ``ids`` (any shape, ``INVALID`` allowed): whether each was committed
    before and after, its episode, the packed block and the large ``fields`` (all by default)."""
    ring = buf.ring
    flat = ids.reshape(-1)
    slots = ring.slots(flat)
    stamp = ring.stamp
    first = stamp.take(slots)
    episode = _need_episodes(buf, "a window").take(slots)
    block = buf._block.take(slots, axis=0) if buf._block is not None else None
    big = {n: c.take(slots, axis=0) for n, c in buf._big.items() if fields is None or n in fields}
    second = stamp.take(slots)
    expect = ring.expected(flat)
    ok = (first == expect) & (second == expect)
    return ok.reshape(ids.shape), episode.reshape(ids.shape), block, big


def _windows(
    buf: ReplayBuffer, n: int, offsets: np.ndarray, anchor: int, *, full: bool, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """``n`` windows around uniformly drawn anchors: ids, mask, block, large fields.

    A window whose anchor was not committed (or, with ``full``, that is not valid everywhere) is
    re-drawn, for up to ``GIVE_UP`` seconds."""
    from .buffer import GIVE_UP, REDRAW_ROUNDS

    width = offsets.size
    anchors = buf._uniform(n, True, _NONE)
    if anchors.size < n:
        raise EmptyBufferError(f"{what}: buffer {buf.name!r} is empty; push rows first")
    ids, inside = window_ids(buf.ring, anchors, offsets)
    ok, episode, block, big = gather_windows(buf, ids)
    valid = inside & ok & (episode == episode[:, anchor:anchor + 1])
    redo = np.flatnonzero(~(valid.all(axis=1) if full else valid[:, anchor]))
    rounds, deadline = 0, 0.0
    while redo.size:
        rounds += 1
        if rounds == REDRAW_ROUNDS + 1:
            deadline = time.monotonic() + GIVE_UP
            buf._reap()
        elif rounds > REDRAW_ROUNDS and time.monotonic() > deadline:
            why = f"no episode has {width} rows in a row" if full else "rows are being written"
            raise (EmptyBufferError if full else WaitTimeout)(
                f"{what}: {redo.size} of {n} windows could not be drawn in {GIVE_UP:.0f} s: {why}"
            )
        fresh = buf._uniform(redo.size, True, _NONE)
        if fresh.size < redo.size:
            raise EmptyBufferError(f"{what}: buffer {buf.name!r} was cleared")
        sub_ids, sub_inside = window_ids(buf.ring, fresh, offsets)
        sub_ok, sub_ep, sub_block, sub_big = gather_windows(buf, sub_ids)
        ids[redo] = sub_ids
        valid[redo] = sub_inside & sub_ok & (sub_ep == sub_ep[:, anchor:anchor + 1])
        if block is not None and sub_block is not None:
            block.reshape(n, width, -1)[redo] = sub_block.reshape(redo.size, width, -1)
        for name, col in sub_big.items():
            big[name].reshape(n, width, *col.shape[1:])[redo] = col.reshape(redo.size, width, *col.shape[1:])
        redo = redo[~(valid[redo].all(axis=1) if full else valid[redo, anchor])]
    mask = window_mask(valid, anchor)
    return ids, mask, block, big


def _assemble(
    buf: ReplayBuffer, ids: np.ndarray, mask: np.ndarray, block: np.ndarray | None,
    big: dict[str, np.ndarray], time_major: bool,
) -> Batch:
    """Fields ``(n, T, ...)`` (or ``(T, n, ...)``) with rows outside the mask zeroed."""
    n, width = ids.shape
    hole = ~mask.reshape(-1)
    if hole.any():
        if block is not None:
            block[hole] = 0
        for col in big.values():
            col[hole] = 0
    ids = np.where(mask, ids, -1)
    if time_major:
        ids, mask = ids.T.copy(), mask.T.copy()
        if block is not None:
            block = block.reshape(n, width, -1).transpose(1, 0, 2).reshape(n * width, -1).copy()
        big = {k: v.reshape(n, width, *v.shape[1:]).swapaxes(0, 1).reshape(v.shape).copy() for k, v in big.items()}
    lead = ids.shape
    fields = buf._record.views(block) if block is not None else {}
    fields.update(big)
    ordered = {name: fields[name].reshape(*lead, *fields[name].shape[1:]) for name in buf.schema.names}
    record = buf._record if block is not None else None
    return Batch(ordered, {"index": ids, "mask": mask}, block=block, record=record, lead=lead)


def sample_sequences(
    buf: ReplayBuffer, n: int, length: int, *, burn_in: int = 0, time_major: bool = False
) -> Batch:
    what = f"sample_sequences({n}, {length})"
    _check_windows(buf, what, n, length, burn_in)
    offsets = np.arange(-burn_in, length)
    ids, mask, block, big = _windows(buf, n, offsets, burn_in, full=False, what=what)
    return _assemble(buf, ids, mask, block, big, time_major)


def sample_groups(buf: ReplayBuffer, groups: int, size: int, *, ordered: bool = True) -> Batch:
    what = f"sample_groups({groups}, {size})"
    _check_windows(buf, what, groups, size, 0)
    if ordered:
        ids, mask, block, big = _windows(buf, groups, np.arange(size), 0, full=True, what=what)
        batch = _assemble(buf, ids, mask, block, big, False)
        del batch.extras["mask"]
        return batch
    return _shuffled_groups(buf, groups, size, what)


def _shuffled_groups(buf: ReplayBuffer, groups: int, size: int, what: str) -> Batch:
    """``size`` distinct rows of one episode per group, in random order."""
    from .buffer import GIVE_UP

    ring = buf.ring
    deadline = time.monotonic() + GIVE_UP
    rows = np.empty((groups, size), np.int64)
    todo = np.arange(groups)
    block: np.ndarray | None = None
    big: dict[str, np.ndarray] = {}
    first_round = True  # not ``block is None``: a schema of large fields only has no block
    while todo.size:
        if time.monotonic() > deadline:
            raise EmptyBufferError(f"{what}: no episode in buffer {buf.name!r} has {size} rows")
        anchors = buf._uniform(todo.size, True, _NONE)
        if anchors.size < todo.size:
            raise EmptyBufferError(f"{what}: buffer {buf.name!r} is empty; push rows first")
        first, stop = episode_extent(ring, _need_episodes(buf, what), anchors)
        lanes = anchors % ring.lanes
        for g, lo, hi, lane in zip(todo, first, stop, lanes, strict=True):
            if hi - lo >= size:
                rows[g] = (lo + buf._rng.choice(hi - lo, size=size, replace=False)) * ring.lanes + lane
            else:
                rows[g] = INVALID
        ok, episode, got_block, got_big = gather_windows(buf, rows[todo])
        fine = ok.all(axis=1) & (episode == episode[:, :1]).all(axis=1)
        if first_round:  # it fetched every group
            block, big, first_round = got_block, got_big, False
        else:
            if block is not None and got_block is not None:
                block.reshape(groups, size, -1)[todo] = got_block.reshape(todo.size, size, -1)
            for name, col in got_big.items():
                big[name].reshape(groups, size, *col.shape[1:])[todo] = col.reshape(todo.size, size, *col.shape[1:])
        todo = todo[~fine]
    batch = _assemble(buf, rows, np.ones((groups, size), bool), block, big, False)
    del batch.extras["mask"]
    return batch


def sample_episodes(buf: ReplayBuffer, n: int) -> list[Batch]:
    """``n`` complete episodes (their first and last rows both in the buffer), drawn with
    probability proportional to their length, each a batch of its rows in order."""
    from .buffer import GIVE_UP

    ring = buf.ring
    what = f"sample_episodes({n})"
    episodes = _need_episodes(buf, what)
    out: list[Batch] = []
    deadline = time.monotonic() + GIVE_UP
    while len(out) < n:
        if time.monotonic() > deadline:
            raise EmptyBufferError(f"{what}: buffer {buf.name!r} holds no complete episode to draw (found {len(out)})")
        anchors = buf._uniform(n - len(out), True, _NONE)
        if anchors.size == 0:
            raise EmptyBufferError(f"{what}: buffer {buf.name!r} is empty; push rows first")
        first, stop = episode_extent(ring, episodes, anchors)
        start, end = ring.bounds()
        lanes = anchors % ring.lanes
        # complete: its first row is the lane's first ever (since a clear) or follows another
        # episode's, and a committed row of another episode follows its last
        before = (first > start[lanes]) | (start[lanes] == ring.base(lanes))
        after = stop < end[lanes]
        after[after] = ring.current(stop[after] * ring.lanes + lanes[after])
        for lo, hi, lane in zip(first[before & after], stop[before & after], lanes[before & after], strict=True):
            ids = np.arange(lo, hi) * ring.lanes + lane
            ok, episode, block, big = gather_windows(buf, ids)
            if ok.all() and (episode == episode[0]).all():
                fields = buf._record.views(block) if block is not None else {}
                fields.update(big)
                out.append(Batch({name: fields[name] for name in buf.schema.names}, {"index": ids}))
    buf.ring.count_sampled(sum(len(b) for b in out))
    return out


def add_n_step(
    buf: ReplayBuffer, batch: Batch, n_step: int, gamma: float, names: dict[str, str] | None
) -> None:
    """Turn a sampled batch into n-step transitions, in place: ``reward`` becomes the discounted
    return over up to ``n_step`` steps of the row's episode, ``next_obs`` the observation after the
    last step used, ``done`` whether that step ended the episode; ``steps`` says how many steps
    were used (bootstrap with ``gamma ** steps``).

    The batch's rows and their episode ids (``batch.episode``) were read under one stamp check
    when it was gathered; the rows after each one are gathered here under their own: a following
    row counts only while it is committed, of the row's lane and of the row's episode *as read
    with the row* (its slot may hold another row by now). A window whose last row's large
    ``next_obs`` changed before it was read is gathered again."""
    what = f"n_step={n_step}"
    _need_episodes(buf, what)
    names = names or {}
    reward = _field(buf, names.get("reward"), REWARD, "reward")
    next_obs = _field(buf, names.get("next_obs"), NEXT_OBS, "next_obs")
    done = _field(buf, names.get("done"), DONE, "done")
    packed = buf._record.offsets
    for name in (reward, done):
        if name not in packed:
            raise FieldError(f"{what}: field {name!r} must be a small field (a scalar per row)")
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
        ids, inside = window_ids(buf.ring, batch.index[todo], np.arange(1, n_step))
        ok, episode, block, _ = gather_windows(buf, ids, fields=())
        valid = np.ones((m, n_step), bool)
        valid[:, 1:] = inside & ok & (episode == own_episode[todo, None])
        mask = window_mask(valid, 0)
        rewards = np.empty((m, n_step))
        dones = np.empty((m, n_step), bool)
        rewards[:, 0], dones[:, 0] = own_reward[todo], own_done[todo]
        if block is not None and n_step > 1:
            views = buf._record.views(block)
            rewards[:, 1:] = views[reward].reshape(m, n_step - 1)
            dones[:, 1:] = views[done].reshape(m, n_step - 1)
        r, k, d = n_step_return(rewards, dones, mask, gamma)
        ret[todo], steps[todo], last_done[todo] = r, k, d
        more = np.flatnonzero(k > 1)
        if not more.size:
            break
        last = ids[more, k[more] - 2]
        if next_obs in packed:
            got = buf._record.views(block)[next_obs].reshape(m, n_step - 1, *following.shape[1:])
            following[todo[more]] = got[more, k[more] - 2]
            break
        # a large field: gathered for the last rows only, under its own stamp check; a window
        # whose last row changed meanwhile is gathered again (it is shorter then)
        ok2, episode2, _, got_big = gather_windows(buf, last, fields=(next_obs,))
        fine = ok2 & (episode2 == own_episode[todo[more]])
        following[todo[more[fine]]] = got_big[next_obs][fine]
        todo = todo[more[~fine]]
    batch.fields[next_obs][...] = following
    batch.fields[reward][...] = ret.reshape(batch.fields[reward].shape)
    batch.fields[done][...] = last_done.reshape(batch.fields[done].shape)
    batch.extras["steps"] = steps


def check_n_step(buf: ReplayBuffer, n_step: int, names: dict[str, str] | None) -> None:
    """Refuse an n-step request the buffer cannot serve, before anything is drawn."""
    what = f"n_step={n_step}"
    _need_episodes(buf, what)
    names = names or {}
    for key, choices in (("reward", REWARD), ("next_obs", NEXT_OBS), ("done", DONE)):
        name = _field(buf, names.get(key), choices, key)
        if key != "next_obs" and name not in buf._record.offsets:
            raise FieldError(f"{what}: field {name!r} must be a small field (a scalar per row)")
    if n_step > buf.ring.lane_capacity:
        raise CapacityError(f"{what}: longer than a lane ({buf.ring.lane_capacity} rows)")


def _need_episodes(buf: ReplayBuffer, what: str) -> np.ndarray:
    """The episode column, or a clear error when the buffer keeps none."""
    if buf._episode is None:
        raise FieldError(
            f"{what} needs episode ids: create the buffer with episodes=True and push(..., episode=id)"
        )
    return buf._episode


def _check_windows(buf: ReplayBuffer, what: str, n: int, length: int, burn_in: int) -> None:
    _need_episodes(buf, what)
    for name, value, low in (("n", n, 1), ("length", length, 1), ("burn_in", burn_in, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ValueError(f"{what}: {name} must be an int >= {low}, got {value!r}")
    if length + burn_in > buf.ring.lane_capacity:
        raise CapacityError(
            f"{what}: windows of {length + burn_in} rows are longer than a lane ({buf.ring.lane_capacity} rows)"
        )
