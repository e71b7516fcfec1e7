"""Hindsight experience replay (HER, Andrychowicz et al. 2017): goals relabelled at sample time.

::

    spec = Hindsight(env.compute_reward, strategy="future", n_sampled_goal=4)
    batch = buf.sample(256, hindsight=spec)        # or buf.loader(256, hindsight=spec)

A buffer made with ``episodes=True`` holds each env's steps in order in its lane (``protocol/ring.py``),
one episode id a step. A transition of an episode is the row ``t`` of its lane; the rows of its
episode are the run ``[first, stop)`` of that lane with its episode id (``sequences.py``). A
sample with a ``Hindsight`` spec:

1. draws ``n`` rows with the buffer's sampler, read intact (``reader.fetch``), and keeps only
   rows of *complete* episodes, as SB3 does: an episode is complete once its last row is marked
   done (a nonzero ``done`` field) or a committed row of another episode follows it in the lane
   (with ``next_of``, once its end row is there). A row of an episode still running is drawn
   again (the transitions of an episode still running are not drawn, so only its completed
   steps are ever goals, and ``final`` is its real last step). ``stop`` is found from the
   episode column (``WINDOW`` rows after ``t`` in one read, then a galloping search), and confirmed under the stamp rule: the row ``stop - 1`` is read
   committed before and after its episode id and done flags are read, and must show the
   transition's episode; the row ``stop`` (when that decides) must be committed and of another.
   Each process remembers the episodes it found complete (``Memo``, one entry a slot): a lane is
   overwritten oldest row first, so while a row reads intact its episode's end is where it was
   found, and the next draw of any row of that episode skips the search;
2. picks ``round_down(ratio * n)`` positions to relabel (SB3's ``int(her_ratio * batch_size)``;
   ``ratio = 1 - 1 / (n_sampled_goal + 1)``), a block of consecutive positions from a random one
   on (wrapping round), so each position is relabelled with the chance ``k / n`` also when a
   prioritized draw orders the batch by stratum, and a goal row
   ``g`` for each in the transition's episode: ``future`` uniform over ``[t, last]`` (``t``
   included, as SB3 does), ``final`` the ``last`` row, ``episode`` uniform over ``[first, last]``,
   where ``last`` is the episode's last transition. The goal is the ``achieved`` field of row
   ``g`` (by default ``next_achieved_goal``: the goal reached by the step, SB3's
   ``next_observations["achieved_goal"]``);
3. reads the goal rows with ``gather.gather`` (the stamp check: committed before and after the
   copy) and keeps a goal only when its row is intact and shows the transition's episode as read
   with the transition. A goal row being written, or overwritten since the transition was read,
   fails; the transition is then drawn again (step 1), so a goal never comes from another
   episode, a row being written or a row overwritten since;
4. writes the goal into every ``desired`` field of the relabelled positions and their reward
   ``compute_reward(achieved, goal, info)``, called once for the batch (SB3's vectorised
   ``GoalEnv.compute_reward`` signature), ``achieved`` the transition's own ``achieved`` field.

Goals stored once (``next_of``, ``frames.py``) are read as every read of such a buffer reads a
transition: a goal row must be a whole transition, and an episode's end row marks it complete.

The batch has the extras of any sample (``index``, ``episode``, ``weight`` for a prioritized
buffer) and ``relabelled`` (bool) and ``goal`` (the goal row's id, -1 where not relabelled).

**Priorities.** The sampler draws rows; relabelling does not change which row was drawn nor its
probability, so ``batch.weight`` is the row's importance weight whether its goal was relabelled or
not, and ``update_priorities(batch, ...)`` sets the priority of the row (one priority a row,
shared by its real and relabelled uses). ``max_use`` counts a use of every row read, including
the few drawn again in step 3.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch import Batch
from .errors import EmptyBufferError, FieldError, WaitTimeout
from .frames import END, KIND
from .protocol import reader
from .protocol.gather import Rows, assemble, gather
from .protocol.layout import Counter
from .protocol.reader import GIVE_UP, Source
from .protocol.ring import INVALID, Ring
from .protocol.rows import lane_of, number_of, row_id, slot
from .sampling import ranks
from .sampling.samplers import Draw, drawn_by

__all__ = ["STRATEGIES", "Hindsight", "sample"]

STRATEGIES = ("future", "final", "episode")
"""The goal selection strategies (SB3's ``GoalSelectionStrategy``, cpprb's ``strategy``)."""

DONE = ("done", "terminated", "truncated", "timeouts", "dones", "terminal")
"""Fields that mark an episode's last row, when the spec does not name them."""

_NO_INFO: dict[str, Any] = {}
"""What ``compute_reward`` gets as each row's info without ``Hindsight(info=...)``: one empty dict."""

WINDOW = 64
"""Rows after a transition whose episode ids are read in one take before the galloping search."""


@dataclass(frozen=True)
class Hindsight:
    """How a sample relabels goals (see the module docstring).

    :param compute_reward: ``compute_reward(achieved, desired, info) -> rewards``, vectorised over
        the relabelled rows (``GoalEnv.compute_reward``), called once a batch.
    :param strategy: ``"future"`` (default), ``"final"`` or ``"episode"``.
    :param n_sampled_goal: relabelled transitions per real one (SB3's; default 4, a ratio of 0.8).
    :param ratio: the fraction of the batch relabelled, instead of ``n_sampled_goal``.
    :param achieved: the field whose value at a row is the goal that row's step reached.
    :param desired: the fields the new goal replaces (the observation's and the next
        observation's desired goal).
    :param reward: the field the new reward replaces (a scalar a row).
    :param done: fields marking an episode's last row (default: those of ``DONE`` in the schema).
    :param info: ``info(batch, positions)`` gives ``compute_reward``'s third argument for the
        relabelled positions; by default a list of empty dicts (SB3 without ``copy_info_dict``;
        one shared dict, read-only by contract).
    """

    compute_reward: Callable[[np.ndarray, np.ndarray, Any], Any]
    strategy: str = "future"
    n_sampled_goal: int | None = None
    ratio: float | None = None
    achieved: str = "next_achieved_goal"
    desired: tuple[str, ...] | str = ("desired_goal", "next_desired_goal")
    reward: str = "reward"
    done: tuple[str, ...] | str | None = None
    info: Callable[[Batch, np.ndarray], Any] | None = None

    def __post_init__(self) -> None:
        if not callable(self.compute_reward):
            raise TypeError(f"Hindsight: compute_reward must be callable (achieved, desired, info) -> rewards, "
                            f"got {type(self.compute_reward).__name__}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Hindsight: strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.n_sampled_goal is not None and self.ratio is not None:
            raise ValueError("Hindsight: give n_sampled_goal or ratio, not both (ratio = 1 - 1 / (n_sampled_goal + 1))")
        n = self.n_sampled_goal
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0):
            raise ValueError(f"Hindsight: n_sampled_goal must be an int >= 0, got {n!r}")
        r = self.ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0):
            raise ValueError(f"Hindsight: ratio must be a number in [0, 1], got {r!r}")
        if self.info is not None and not callable(self.info):
            raise TypeError(f"Hindsight: info must be callable (batch, positions) -> info, got {type(self.info).__name__}")

    @property
    def her_ratio(self) -> float:
        """The fraction of a batch relabelled (SB3's ``her_ratio``)."""
        if self.ratio is not None:
            return float(self.ratio)
        n = 4 if self.n_sampled_goal is None else int(self.n_sampled_goal)
        return 1.0 - 1.0 / (n + 1)

    def plan(self, src: Source) -> Plan:
        """The spec checked against ``src``'s schema and options (``FieldError`` naming what is
        missing or wrong, before anything is drawn)."""
        block = src.block
        schema = block.schema
        names = schema.names
        if block.episode is None:
            raise FieldError("hindsight: relabelling needs episode ids: create the buffer with episodes=True and "
                             "push(..., episode=id)")
        if block.interleaved:
            raise FieldError(f"hindsight: buffer {src.name!r} holds rows of several episodes interleaved in one lane "
                             "(a push of several envs' rows without lane=); give each env a lane (envs=N or lane=)")

        def need(name: str, what: str) -> str:
            if name not in names:
                raise FieldError(f"hindsight: {what} field {name!r} is not in the schema ({', '.join(names)}); "
                                 f"name it with Hindsight({what}=...)")
            return name

        achieved = need(self.achieved, "achieved")
        desired = (self.desired,) if isinstance(self.desired, str) else tuple(self.desired)
        if not desired:
            raise FieldError("hindsight: desired names no field; give the desired goal fields")
        a = schema[achieved]
        for d in desired:
            f = schema[need(d, "desired")]
            if f.shape != a.shape:
                raise FieldError(f"hindsight: desired field {d!r} has shape {f.shape}, the achieved field "
                                 f"{achieved!r} {a.shape}: a goal must fit both")
        reward = need(self.reward, "reward")
        if reward not in block.record.offsets or schema[reward].shape not in ((), (1,)):
            raise FieldError(f"hindsight: reward field {reward!r} must be a small scalar field (a number a row)")
        if self.done is None:
            done = tuple(n for n in DONE if n in names)
        else:
            done = (self.done,) if isinstance(self.done, str) else tuple(self.done)
            for d in done:
                need(d, "done")
        for d in done:
            if d not in block.stored_record.offsets:
                raise FieldError(f"hindsight: done field {d!r} must be a small field (a flag a row)")
        return Plan(self, achieved, desired, reward, done, block.rows.last_apart)


@dataclass(frozen=True)
class Plan:
    """A ``Hindsight`` spec resolved against one buffer's schema."""

    spec: Hindsight
    achieved: str
    desired: tuple[str, ...]
    reward: str
    done: tuple[str, ...]
    end_rows: bool
    """``next_of``: an episode's last row is its end row (``frames.py``), not a transition."""


# -- episode extents --------------------------------------------------------------------------------

def _same(episode: np.ndarray, ring: Ring, lane: np.ndarray, r: np.ndarray, own: np.ndarray,
          lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether row ``r`` of each ``lane`` lies in ``[lo, hi)`` and shows episode ``own`` (a read
    without the stamp check: callers confirm what they use)."""
    inside = (r >= lo) & (r < hi)
    at = np.clip(r, lo, np.maximum(hi - 1, lo))
    return inside & (episode.take(slot(lane, at, ring.lane_capacity)) == own)


def edge(episode: np.ndarray, ring: Ring, ids: np.ndarray, own: np.ndarray, direction: int) -> np.ndarray:
    """The first row from each id's row, going ``direction`` (+1 or -1), that is not of episode
    ``own`` or lies outside its lane's rows: the episode's ``stop`` forwards, ``first - 1``
    backwards. The rows ``t ± 1 .. t ± WINDOW`` are read in one take; beyond that a galloping
    search (``t ± 2W, 4W, ...`` until a row is not the episode's), then a binary search."""
    lane, row = lane_of(ids, ring.lanes), number_of(ids, ring.lanes)
    start, stop = ring.bounds()
    lo, hi = start[lane], stop[lane]
    span = np.arange(1, WINDOW + 1) * direction
    probe = row[:, None] + span
    near = _same(episode, ring, lane[:, None], probe, own[:, None], lo[:, None], hi[:, None])
    out = row + (np.argmin(near, axis=1) + 1) * direction
    todo = np.flatnonzero(near[:, -1])
    if not todo.size:
        return out
    lane, row, own, lo, hi = lane[todo], row[todo], own[todo], lo[todo], hi[todo]
    inner = row + WINDOW * direction
    outer = inner.copy()
    pending = np.ones(todo.size, bool)
    step = 2 * WINDOW
    while pending.any():
        p = row + step * direction
        s = _same(episode, ring, lane, p, own, lo, hi)
        inner = np.where(pending & s, p, inner)
        outer = np.where(pending & ~s, p, outer)
        pending &= s
        step *= 2
    while True:
        gap = np.abs(outer - inner) > 1
        if not gap.any():
            break
        mid = (inner + outer) // 2
        s = _same(episode, ring, lane, mid, own, lo, hi)
        inner = np.where(gap & s, mid, inner)
        outer = np.where(gap & ~s, mid, outer)
    out[todo] = np.clip(outer, lo - 1, hi)  # a probe past the lane's rows stands for its end
    return out


def ends(src: Source, plan: Plan, ids: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows ``ids`` read intact with episode ids ``own``: one past the last transition of
    each one's episode, and whether that episode is complete (the module docstring, step 1).
    What decides is read between two stamp checks (``Ring.current``) and the update count."""
    ring, block = src.ring, src.block
    episode = block.episode
    assert episode is not None
    lanes = ring.lanes
    lane = lane_of(ids, lanes)
    stop = edge(episode, ring, ids, own, +1)
    last = row_id(stop - 1, lane, lanes)
    after = np.where(stop < ring.bounds()[1][lane], row_id(stop, lane, lanes), INVALID)
    both = np.concatenate([last, after])
    updates = int(block.counters[Counter.UPDATES])
    before = ring.current(both)
    slots = ring.slots(np.where(both == INVALID, 0, both))
    ep = episode[slots]
    m = ids.shape[0]
    if plan.end_rows:
        flag = (block.arrays[KIND][slots[:m]] & END) != 0
    else:
        flag = np.zeros(m, bool)
        fields = block.fields
        for name in plan.done:
            flag |= np.asarray(fields[name][slots[:m]]).reshape(m, -1).any(axis=1)
    ok = before & ring.current(both)
    if int(block.counters[Counter.UPDATES]) != updates:
        ok[:] = False  # an update (a done set by hand) may have come and gone during the reads
    mine = ok[:m] & (ep[:m] == own)
    complete = mine & (flag | (ok[m:] & (ep[m:] != own)))
    if plan.end_rows:
        complete = mine & flag
        stop = stop - 1  # the end row holds the final observation; the transitions stop before it
    return stop, complete & (stop > number_of(ids, lanes))


class Memo:
    """This process's memory of one buffer's complete episodes: for a row id found in a complete
    episode, one past the episode's last transition (and its first row, once looked for), kept
    in the row's slot with the id. A lane is overwritten oldest row first, so while a row is
    read intact every row after it is the one that was there when the episode was confirmed
    complete: the stop stays right for as long as the row's id is in its slot. Rows before it
    may have been overwritten since (``first`` is clipped to the lane's rows, and every goal
    row is read under its own stamp check). An ``update`` (a done flag set by hand) forgets
    everything. It takes 24 bytes a slot of the buffer (24 MB for 1,000,000 rows), in each
    process that samples with ``hindsight=``, from its first such sample."""

    def __init__(self, capacity: int) -> None:
        self.table = np.full((capacity, 3), INVALID, np.int64)
        """Per slot: the row id it was found for, the stop, the first row (``INVALID``: unknown);
        one row of the table, so a lookup is one cache line."""
        self.updates = -1
        self.plans: dict[Hindsight, Plan] = {}

    def fresh(self, updates: int) -> None:
        """Forget every episode when the buffer's update count moved."""
        if updates != self.updates:
            self.table.fill(INVALID)
            self.updates = updates

    def put(self, ring: Ring, ids: np.ndarray, stop: np.ndarray, first: np.ndarray | None) -> None:
        """Remember ``stop`` (and ``first``) for ``ids`` and for every later row of each one's episode."""
        lanes = ring.lanes
        row = number_of(ids, lanes)
        length = np.maximum(stop - row, 0)
        which = np.repeat(np.arange(ids.size), length)
        offset = np.arange(which.size) - np.repeat(np.cumsum(length) - length, length)
        rows = row[which] + offset
        every = row_id(rows, lane_of(ids, lanes)[which], lanes)
        slots = ring.slots(every)
        self.table[slots, 1] = stop[which]
        self.table[slots, 2] = INVALID if first is None else first[which]
        self.table[slots, 0] = every  # last: a reader in another thread that finds the id finds its stop

    def lookup(self, slots: np.ndarray) -> np.ndarray:
        """The table's rows of ``slots``, ``(k, 3)``: id, stop, first."""
        return self.table.take(slots, axis=0)


_MEMOS: weakref.WeakKeyDictionary[Any, Memo] = weakref.WeakKeyDictionary()


def memo(src: Source) -> Memo:
    """This process's ``Memo`` of ``src``'s block."""
    block = src.block
    m = _MEMOS.get(block)
    if m is None:
        m = _MEMOS[block] = Memo(src.ring.capacity)
    m.fresh(int(block.counters[Counter.UPDATES]))
    return m


def plan_for(src: Source, spec: Hindsight) -> Plan:
    """``spec.plan(src)``, checked once per spec and buffer in this process."""
    m = memo(src)
    got = m.plans.get(spec)
    if got is None:
        got = m.plans[spec] = spec.plan(src)
    return got


def _any_complete(src: Source, plan: Plan) -> bool:
    """Whether the buffer holds a row of a complete episode now (a scan; the slow path only)."""
    ring = src.ring
    held = ring.held_ids()
    if not held.size:
        return False
    episode = src.block.episode
    assert episode is not None
    live = held[ring.current(held)]
    for at in range(0, live.size, 4096):  # in pieces: a window of reads a row
        part = live[at:at + 4096]
        if ends(src, plan, part, episode[ring.slots(part)])[1].any():
            return True
    return False


# -- the sample ---------------------------------------------------------------------------------------

def sample(src: Source, spec: Hindsight, n: int, *, out: dict[str, np.ndarray] | None = None, calls: int = 0,
           first: Draw | None = None) -> Batch:
    """``n`` transitions of complete episodes, a ``spec.her_ratio`` part of them relabelled (the
    module docstring). ``out``, ``calls`` and ``first`` as for ``reader.draw``; a rank's relabelled
    positions and goals are its part of the global batch's (``ranks.relabelled``, ``goal_numbers``)."""
    known = memo(src)
    plan = known.plans.get(spec) or plan_for(src, spec)
    ring, prios, sampler, block = src.ring, src.priorities, src.options.sampler, src.block
    tree = prios.tree if prios is not None else None
    counting = prios is not None and prios.uses is not None
    episode_col = block.episode
    assert episode_col is not None  # plan() refused a buffer without episode ids
    by = drawn_by(sampler)
    what = f"sample({n}, hindsight=...) of buffer {src.name!r}" + (f" (drawn by {by})" if by else "")

    def accept(ids: np.ndarray, rows: Rows) -> np.ndarray:
        ok = rows.ok.copy()
        slots = ring.slots(ids)
        miss = np.flatnonzero(ok & (known.lookup(slots)[:, 0] != ids))
        if miss.size:
            assert rows.episode is not None
            own = rows.episode[miss]
            stop, complete = ends(src, plan, ids[miss], own)
            ok[miss] = complete
            done = ids[miss][complete]
            if done.size:  # the whole episode at once: its first row found too
                first = edge(episode_col, ring, done, own[complete], -1) + 1
                known.put(ring, row_id(first, lane_of(done, ring.lanes), ring.lanes), stop[complete], first)
        return ok

    def redraw(k: int, taken: np.ndarray, slow: bool) -> tuple[np.ndarray, np.ndarray | None]:
        if slow and not _any_complete(src, plan):
            raise EmptyBufferError(
                f"{what}: no episode is complete yet (an episode counts once its last row is marked done or the next "
                "one has started in its lane); push whole episodes first (SB3: learning_starts above the longest "
                "episode)")
        more = sampler.draw(ring, tree, src.rng, k, retry=True, taken=taken, from_scan=slow)
        if more.ids.size < k and len(ring) == 0:
            raise EmptyBufferError(f"{what}: the buffer was emptied (cleared) while sampling")
        return more.ids, more.leaves

    def draw(k: int, first: Draw | None = None) -> tuple[np.ndarray, Rows, np.ndarray | None]:
        first = first if first is not None else sampler.draw(ring, tree, src.rng, k)
        if first.ids.size < k:
            if len(ring) == 0:
                raise EmptyBufferError(f"{what}: the buffer is empty; push whole episodes first")
            first = sampler.draw(ring, tree, src.rng, k, retry=True, from_scan=True)
            if first.ids.size < k:
                why = f"the draw gave {first.ids.size} ids for the {k} asked" if by else "every row has priority 0 or is used up"
                raise EmptyBufferError(f"{what}: no row can be drawn ({why})")
        try:
            return reader.fetch(block, ring, first.ids, redraw, reap=src.reap, values=first.leaves, accept=accept,
                                claim=reader.Uses(src) if counting else None,
                                out=out if k == n else None, what=what)
        except WaitTimeout:
            if not _any_complete(src, plan):
                raise EmptyBufferError(f"{what}: no episode is complete yet; push whole episodes first") from None
            raise

    ids, rows, leaves = draw(n, first)
    # which positions are relabelled: a block of k at a random place (cyclic), so each position
    # has the chance k / n also when a prioritized draw orders its rows by stratum
    at, k = ranks.relabelled(src.ranked, src.rng, n, spec.her_ratio)
    numbers = ranks.goal_numbers(src.ranked, n)
    pos = (at + np.arange(k)) % n
    cut = (slice(at, min(at + k, n)), slice(0, max(at + k - n, 0)))  # pos as slices
    goal_ids = np.full(n, -1, np.int64)
    goals = None
    todo = pos
    deadline = time.monotonic() + GIVE_UP
    while todo.size:
        assert rows.episode is not None
        g, fine, values = _goals(src, plan, known, ids[todo], rows.episode[todo],
                                 None if numbers is None else numbers[todo])
        numbers = None  # a goal drawn again (its row was being written) is the rank's own
        if goals is None and fine.all():  # the usual case: every goal row read intact at once
            goal_ids[todo] = g
            goals = values
            break
        if goals is None:
            goals = np.empty((n, *values.shape[1:]), values.dtype)
            goal_ids[pos] = -1
        goal_ids[todo[fine]] = g[fine]
        goals[todo[fine]] = values[fine]
        todo = todo[~fine]
        if not todo.size:
            goals = goals[pos]
            break
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{what}: goal rows kept being overwritten or written for {GIVE_UP:g} s")
        new_ids, new_rows, new_leaves = draw(todo.size)
        ids[todo] = new_ids
        rows.put(todo, new_rows)
        if leaves is not None and new_leaves is not None:
            leaves[todo] = new_leaves
    extras: dict[str, np.ndarray] = {}
    if leaves is not None:
        weight = sampler.weights(tree, leaves, calls)
        if weight is not None:
            extras["weight"] = weight
    extras["relabelled"] = goal_ids >= 0
    extras["goal"] = goal_ids
    batch = assemble(block, ids, rows, extras)
    if goals is not None:
        _relabel(spec, plan, batch, pos, cut, goals, what)
    return batch


def _goals(src: Source, plan: Plan, known: Memo, ids: np.ndarray, own: np.ndarray, numbers: np.ndarray | None,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Goal rows for transitions ``ids`` (accepted: ``known`` has their episodes' stops) of
    episodes ``own``, read under the stamp check: their ids, which are fine, and their goals;
    ``numbers`` in ``[0, 1)`` pick them (``None``: the buffer's generator draws them)."""
    ring, rng = src.ring, src.rng
    lanes = ring.lanes
    lane, row = lane_of(ids, lanes), number_of(ids, lanes)
    slots = ring.slots(ids)
    entry = known.lookup(slots)
    stop = np.maximum(entry[:, 1], row + 1)
    strategy = plan.spec.strategy
    if strategy == "future":
        g = row + ((rng.random(row.shape[0]) if numbers is None else numbers) * (stop - row)).astype(np.int64)
    elif strategy == "final":
        g = stop - 1
    else:
        first = entry[:, 2].copy()
        unknown = np.flatnonzero((first == INVALID) | (entry[:, 0] != ids))
        if unknown.size:
            assert src.block.episode is not None
            found = edge(src.block.episode, ring, ids[unknown], own[unknown], -1) + 1
            first[unknown] = found
            known.put(ring, ids[unknown], stop[unknown], np.full(unknown.size, 0, np.int64) + found)
        first = np.maximum(first, ring.bounds()[0][lane])
        g = first + ((rng.random(row.shape[0]) if numbers is None else numbers) * (stop - first)).astype(np.int64)
    gid = row_id(g, lane, lanes)
    got = gather(src.block, ring, gid, large=(plan.achieved,))  # the one field a goal row gives
    assert got.episode is not None
    fine = got.ok & (got.episode == own)
    if plan.achieved in got.large:
        values = got.large[plan.achieved]
    else:
        assert got.packed is not None
        record = src.block.record
        values = got.packed.view(record.dtype).reshape(got.packed.shape[0])[plan.achieved]
    return gid, fine, values


def _relabel(spec: Hindsight, plan: Plan, batch: Batch, pos: np.ndarray, cut: tuple[slice, slice],
             goals: np.ndarray, what: str) -> None:
    """Write the goals into the desired fields at ``pos`` (the slices ``cut``) and their rewards
    (one call of ``compute_reward``)."""
    fields = batch.fields
    k = pos.size
    own = fields[plan.achieved]
    achieved = np.concatenate([own[cut[0]], own[cut[1]]]) if cut[1].stop else own[cut[0]]
    info = spec.info(batch, pos) if spec.info is not None else [_NO_INFO] * k
    reward = np.asarray(spec.compute_reward(achieved, goals, info))
    if reward.size != k:
        raise FieldError(f"{what}: compute_reward returned {reward.shape} for {k} relabelled rows; expected "
                         f"one reward a row (a vectorised compute_reward(achieved, desired, info))")
    target = fields[plan.reward]
    reward = reward.reshape(k, *target.shape[1:])
    split = cut[0].stop - cut[0].start
    for name in plan.desired:
        fields[name][cut[0]] = goals[:split]
        fields[name][cut[1]] = goals[split:]
    target[cut[0]] = reward[:split]
    target[cut[1]] = reward[split:]
