"""Ranks: several learners (data-parallel ranks) drawing one global batch from one buffer.

A rank attaches with ``ReplayBuffer.attach(name, rank=r, world_size=w, seed=s)``; its ``Rank``
holds those and its step, the count of its sample calls. At its step ``t`` the ranks together draw
one global batch of ``n * w`` rows and rank ``r`` takes points ``r * n .. (r + 1) * n`` of it,
without talking to the other ranks: every random number of the global draw is a function of
``(seed, t, point)`` alone (``uniforms``: splitmix64's finaliser over a counter, ``keyed_double``
in ``native/native.h`` is the same arithmetic in C), so each rank computes only its own points, and
the ranks' batches at step ``t``, joined in rank order, are the batch one process attached with
``world_size=1`` and the same seed draws at its step ``t`` with ``n * w`` rows (on the same
rows). The rows themselves:

* uniform with replacement: point ``i``'s position ``floor(u_i * m)`` among the ``m`` rows held
  (``samplers.ids_at``: lane by lane);
* from the tree (``Prioritized``, or uniform under ``max_use``): one stratified draw of ``n * w``
  points, point ``i`` at ``(u_i + i) * total / (n * w)``, so rank ``r`` takes strata ``r * n ..``;
* anything else (``replace=False``, a sampler with its own ``draw``): the sampler's draw of the whole
  global batch from a generator keyed on ``(seed, t)`` (``generator``), rank ``r`` its slice: every
  rank draws the global batch, the ranks' slices are disjoint parts of one draw (distinct rows
  stay distinct over the ranks);
* an epoch (``ReplayBuffer.epoch``): the ``e``-th epoch's permutation comes from a generator keyed
  on ``(seed, e)``; its global batches of ``batch_size * w`` rows are split in rank order
  (``part``), so the ranks cover every row exactly once.

The same rules serve the draws beyond rows (``docs/several-learners.md`` has the table):

* window anchors (``sequences.py``: sequences, ordered groups) and the device copy's uniform draw
  (``device/replay.py``, positions among the copy's usable slots) as uniform rows
  (``uniform_ids``, ``positions``); an anchor whose window does not fit is drawn again in rounds
  keyed on ``(seed, step, round)``;
* groups drawn episode first, shuffled groups and episodes: the whole global draw from the keyed
  generator, rank ``r`` its slice (``sliced``);
* hindsight (``hindsight.py``): the transitions as rows; the relabelled positions are the rank's
  part of the global batch's one cyclic block (``relabelled``), each goal picked by its global
  point's number (``goal_numbers``).

Rows re-drawn because they were not intact (being written, or not whole transitions) come from
the process's own generator (``ReplayBuffer.rng``): the invariance holds for the rows drawn intact
(so do a hindsight transition drawn in a running episode, a goal row found overwritten, a row the
device copy does not hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .samplers import Draw, RingView, Sampler, ids_at
from .sumtree import SumTree

__all__ = ["EPOCH", "GOALS", "ROUNDS", "SAMPLE", "Rank", "draw", "goal_numbers", "next_call", "positions", "relabelled", "sliced",
           "uniform_ids", "uniforms"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
SAMPLE = 1
"""The stream of sample calls' draws (``Rank.key``)."""
ROUNDS = 64
"""Keyed re-draws of a window that does not fit (``uniform_ids``) before the reader's own."""
EPOCH = 2
"""The stream of epochs' permutations (``Rank.key``)."""
GOALS = 3
"""The stream of hindsight's relabelling: the block's start (point 0), each goal's number (point
``1 + i`` for the global batch's position ``i``)."""


def _mix(z: int) -> int:
    """splitmix64's finaliser on a Python int (64 bits)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_G, _C1, _C2 = np.uint64(_GOLDEN), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def uniforms(key: int, start: int, k: int) -> np.ndarray:
    """Points ``start .. start + k`` of the stream ``key`` as doubles in ``[0, 1)``: splitmix64's
    finaliser of ``point * golden + key``, its top 53 bits (``keyed_double`` in C, bit for bit)."""
    z = np.arange(start, start + k, dtype=np.uint64)
    z *= _G
    z += np.uint64(key)
    z ^= z >> _S30
    z *= _C1
    z ^= z >> _S27
    z *= _C2
    z ^= z >> _S31
    z >>= _S11
    return z.astype(np.float64) * (1.0 / 9007199254740992.0)


@dataclass
class Rank:
    """One rank of ``world_size`` (an attach's ``rank=``, ``world_size=``, ``seed=``), and its step:
    its sample calls so far (each returned batch counts one; set it to resume a run's draws)."""

    rank: int
    world_size: int
    seed: int
    step: int = 0
    epochs: int = 0
    """Epochs started so far (``ReplayBuffer.epoch``): the next one's permutation is keyed on it."""
    _streams: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def make(cls, rank: Any, world_size: Any, seed: Any) -> Rank | None:
        """The rank an attach asked for, or ``None`` when it gave neither ``rank`` nor
        ``world_size``; ``ValueError`` naming the argument when one is wrong."""
        if rank is None and world_size is None:
            return None
        if world_size is None:
            world_size = 1 if rank == 0 else None
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"attach: world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
        if rank is None or not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"attach: rank must be an int in [0, {world_size}) (this process's rank of world_size="
                             f"{world_size}), got {rank!r}")
        if not _is_int(seed) or seed < 0:
            raise ValueError(f"attach: a rank's draws are keyed on its seed: pass the same int seed >= 0 on every "
                             f"rank (seed=...), got {seed!r}")
        return cls(int(rank), int(world_size), int(seed))

    def key(self, stream: int, count: int) -> int:
        """The 64-bit key of draw ``count`` of ``stream`` (``SAMPLE``: the step; ``EPOCH``: the epoch)."""
        base = self._streams.get(stream)
        if base is None:  # the seed's part, once a stream: a sample call mixes only its step in
            base = self._streams[stream] = _mix(_mix(self.seed) + stream)
        return _mix(base + count * _GOLDEN)

    def keyed(self, n: int) -> tuple[int, int, int]:
        """This step's draw of ``n`` rows a rank: ``(key, first point, points in the global batch)``."""
        return self.key(SAMPLE, self.step), self.rank * n, n * self.world_size

    def generator(self, stream: int, count: int) -> np.random.Generator:
        """A generator keyed on ``(seed, stream, count)``: the same numbers on every rank."""
        return np.random.Generator(np.random.Philox(key=self.key(stream, count)))

    def part(self, size: int) -> slice:
        """This rank's part of ``size`` items split in rank order (``size * r // w`` on)."""
        w, r = self.world_size, self.rank
        return slice(size * r // w, size * (r + 1) // w)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def draw(sampler: Sampler, ring: RingView, tree: SumTree | None, rank: Rank, n: int, replace: bool) -> Draw:
    """This rank's ``n`` rows of this step's global draw (the module docstring's rules), in numpy:
    the same ids as the one-call sample's keyed draw (``native/sample.c``) where that serves."""
    key, start, of = rank.keyed(n)
    if replace and sampler.served == "uniform" and tree is None:
        return Draw(uniform_ids(rank, n, *ring.bounds()))
    if replace and sampler.served is not None and tree is not None:  # Uniform under max_use too
        total = tree.total
        if total <= 0:
            return Draw(np.empty(0, np.int64), np.empty(0))
        at = np.arange(start, start + n, dtype=np.float64)
        slots = tree.find((uniforms(key, start, n) + at) * (total / of))
        leaves = tree.leaves[slots]
        return Draw(ring.ids_of_slots(slots, leaves > 0), leaves)
    whole = sampler.draw(ring, tree, rank.generator(SAMPLE, rank.step), of, replace=replace)
    if whole.ids.size < of:
        return Draw(whole.ids[:0], None if whole.leaves is None else whole.leaves[:0])
    part = slice(start, start + n)
    return Draw(whole.ids[part], None if whole.leaves is None else whole.leaves[part])


def positions(rank: Rank, n: int, m: int) -> np.ndarray:
    """This rank's ``n`` positions in ``[0, m)`` of this step's uniform global draw (``floor(u * m)``)."""
    key, start, _ = rank.keyed(n)
    pos = (uniforms(key, start, n) * m).astype(np.int64)
    np.minimum(pos, m - 1, out=pos)
    return pos


def uniform_ids(rank: Rank, n: int, start: np.ndarray, stop: np.ndarray,
                fits: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """This rank's ``n`` ids of this step's uniform global draw over the rows ``[start[l], stop[l])``
    of the lanes (``samplers.uniform_ids``' positions); none when no row is held. Window
    anchors (``sequences.py``) are drawn so too: a rank's windows are its part of the global ones.
    With ``fits`` (which ids' windows fit), a point whose id does not is drawn again, round ``j``
    keyed on ``(seed, step, j)``, up to ``ROUNDS`` rounds (the rest is left to the reader)."""
    m = int((stop - start).sum())
    if m <= 0:
        return np.empty(0, np.int64)
    ids = ids_at(positions(rank, n, m), start, stop)
    todo = np.arange(0) if fits is None else np.flatnonzero(~fits(ids))
    key, first, _ = rank.keyed(n)
    for j in range(1, ROUNDS):
        if not todo.size:
            break
        pos = (uniforms(_mix(key + j * _GOLDEN), first, n)[todo] * m).astype(np.int64)
        new = ids_at(np.minimum(pos, m - 1), start, stop)
        ok = fits(new)  # type: ignore[misc]
        ids[todo[ok]] = new[ok]
        todo = todo[~ok]
    return ids


def sliced(rank: Rank | None, rng: np.random.Generator, n: int,
           draw: Callable[[int, np.random.Generator], np.ndarray]) -> np.ndarray:
    """``draw(n, rng)`` alone; a rank: its slice of ``draw(n * world_size, g)``, ``g`` keyed on
    ``(seed, step)`` (the draws whose numbers are not one a point: groups, episodes)."""
    if rank is None:
        return draw(n, rng)
    start = rank.rank * n
    return draw(n * rank.world_size, rank.generator(SAMPLE, rank.step))[start:start + n]


def relabelled(rank: Rank | None, rng: np.random.Generator, n: int, ratio: float) -> tuple[int, int]:
    """Hindsight's relabelled positions of a batch of ``n`` as a block ``(at, k)``, cyclic:
    ``int(ratio * n)`` from a random one on; a rank: its part of the global batch's block (that
    block from a number keyed on ``(seed, step)``), which is a cyclic block of its batch too."""
    if rank is None:
        return int(rng.integers(n)), int(ratio * n)
    whole = n * rank.world_size
    at = min(int(uniforms(rank.key(GOALS, rank.step), 0, 1)[0] * whole), whole - 1)
    mine = np.flatnonzero((np.arange(rank.rank * n, (rank.rank + 1) * n) - at) % whole < int(ratio * whole))
    if mine.size in (0, n):
        return 0, int(mine.size)
    gap = np.flatnonzero(np.diff(mine) > 1)  # [x, n) and [0, y): the block starts at x
    return int(mine[gap[0] + 1] if gap.size else mine[0]), int(mine.size)


def goal_numbers(rank: Rank | None, n: int) -> np.ndarray | None:
    """The numbers in ``[0, 1)`` that pick the goal rows of a rank's ``n`` positions (the global
    batch's points ``r * n ..``); ``None`` alone (the buffer's generator draws them)."""
    if rank is None:
        return None
    return uniforms(rank.key(GOALS, rank.step), 1 + rank.rank * n, n)


def next_call(rank: Rank | None, prios: Any) -> int:
    """The sample call whose ``beta`` a batch's weights take (``Prioritized.beta_at``), counted:
    alone, the calls of every process (``prios.next_call()``: ``Counter.SAMPLE_CALLS``, shared:
    attach and load continue it); a rank, its own step, the global batch's (every rank's at once),
    while rank 0 alone counts the shared calls, one per global batch."""
    if rank is None:
        return prios.next_call() if prios is not None else 0
    if prios is not None and rank.rank == 0:
        prios.next_call()
    return rank.step
