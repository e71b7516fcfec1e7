"""Samplers: which rows a batch takes. They return row ids (``ring.py``), never data; the buffer
gathers and checks the rows, so every sampler here is tested on plain arrays.

* ``Uniform()`` — every row that counts equally likely, with or without replacement.
* ``Prioritized(alpha, beta, beta_steps, eps)`` — proportional prioritized replay (Schaul et al.
  2016): row ``i`` is drawn with probability ``p_i^alpha / sum_k p_k^alpha`` by stratified
  sampling over a ``SumTree`` in shared memory; the batch carries importance-sampling weights
  ``w_i = (p_i^alpha / min_k p_k^alpha)^-beta`` (``(N P(i))^-beta`` normalised by its maximum, as in
  the paper), with ``beta`` annealed linearly to 1 over ``beta_steps`` sample calls.
* ``max_use`` (a buffer option, for both): a row drawn ``max_use`` times leaves the sampling set.

Shared state for ``Prioritized`` and ``max_use`` (``Priorities``), columns in the block:

``_tree_sum``, ``_tree_min``  the ``SumTree`` over slots: ``(p + eps)^alpha`` for a prioritized row,
                             1 for a uniform row under ``max_use``, 0 for an empty, cleared or
                             used-up slot; every leaf is at most ``MAX_LEAF``
``_prio``     ``(8,)`` float64: ``[0]`` the largest priority given so far (new rows get it when
              the writer gives none), 1.0 at creation
``_uses``     ``(capacity,)`` uint32, times each row was drawn (only with ``max_use``)

Every change of these happens under the ring's lock: a committing writer setting its rows'
priorities, ``update_priorities``, ``claim`` (counting uses) and ``clear``. An update names rows
by id; a row overwritten since it was sampled has another id in its slot, so the update is
dropped, never applied to the new row. An id that never named a row (negative, or not reserved
yet) is a caller's bug, not a race: ``check_ids`` refuses it.

Leaves stay finite, and so does their total: a priority whose leaf would exceed ``MAX_LEAF`` is
refused (``Priorities.check``), so ``capacity`` leaves (``capacity < 2**63``) sum to less than
``1e299``, far below float64's largest number (``1.8e308``). With ``alpha = 1`` that allows
priorities up to ``1e280``, with ``alpha = 2`` up to ``1e140``, with ``alpha <= 0.9`` any finite one.

A holder of the ring's lock may die anywhere (``lock.py``). The next locker runs ``repair``: it
zeroes the leaf of every slot that holds no row that counts (empty, or a row number outside its
lane's bounds, as a ``clear`` that died before resetting the tree leaves them; a slot being
written keeps its leaf, its live writer will commit it) or that is used up, then recomputes the
tree from its leaves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import EmptyBufferError, FieldError
from .segment import ColumnSpec
from .sumtree import SumTree

MAX_LEAF = 1e280
"""The largest leaf the tree takes (see the module docstring): its total stays finite."""
_INT64_MAX = np.iinfo(np.int64).max
_REPAIR_CHUNK = 1 << 20
"""Slots a repair looks at in one numpy call (bounds its temporary memory)."""


class UnknownIdError(FieldError, EmptyBufferError):
    """Ids that never named a row of the buffer: negative, or beyond every row pushed so far.
    Both a ``FieldError`` (bad input) and an ``EmptyBufferError`` (what ``take`` raised for them
    before); unlike a row overwritten since it was sampled, this is never a race."""


@dataclass(frozen=True)
class Uniform:
    """Every committed row equally likely (``sample(n, replace=False)`` for distinct rows)."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "uniform"}


@dataclass(frozen=True)
class Prioritized:
    """Proportional prioritized replay; see the module docstring for the formulas."""

    alpha: float = 0.6
    beta: float = 0.4
    beta_steps: int | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name, value, lo in (("alpha", self.alpha, 0.0), ("beta", self.beta, 0.0), ("eps", self.eps, 0.0)):
            if not np.isfinite(value) or value < lo:
                raise ValueError(f"Prioritized: {name} must be a finite number >= {lo}, got {value!r}")
        if self.beta > 1:
            raise ValueError(f"Prioritized: beta must be in [0, 1], got {self.beta}")
        if self.beta_steps is not None and self.beta_steps <= 0:
            raise ValueError(f"Prioritized: beta_steps must be positive, got {self.beta_steps}")

    def beta_at(self, calls: int) -> float:
        """``beta`` after ``calls`` sample calls: linear from ``beta`` to 1 over ``beta_steps``."""
        if not self.beta_steps:
            return self.beta
        return self.beta + (1.0 - self.beta) * min(1.0, calls / self.beta_steps)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "prioritized", **asdict(self)}


Sampler = Uniform | Prioritized


def sampler_from_json(spec: dict[str, Any]) -> Sampler:
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "uniform":
        return Uniform()
    if kind == "prioritized":
        return Prioritized(**spec)
    raise ValueError(f"unknown sampler kind {kind!r}")


def uniform_ids(
    rng: np.random.Generator, k: int, start: np.ndarray, stop: np.ndarray, *, replace: bool = True,
    taken: np.ndarray | None = None,
) -> np.ndarray:
    """``k`` ids drawn uniformly from the rows ``[start[l], stop[l])`` of each lane ``l`` (ids as in
    ``ring.py``: ``n * lanes + l``); without ``replace`` distinct and none of ``taken``. Fewer
    than ``k`` when there are not enough rows."""
    sizes = stop - start
    m = int(sizes.sum())
    if m <= 0:
        return np.empty(0, np.int64)
    if replace:
        pos = (rng.random(k) * m).astype(np.int64)
    else:
        extra = 0 if taken is None else taken.size
        pos = rng.choice(m, size=min(m, k + extra), replace=False)
    lanes = start.shape[0]
    if lanes == 1:
        ids = start[0] + pos
    else:
        ends = np.cumsum(sizes)
        lane = np.searchsorted(ends, pos, side="right")
        ids = (start[lane] + pos - (ends[lane] - sizes[lane])) * lanes + lane
    if not replace and taken is not None and taken.size:
        ids = ids[~np.isin(ids, taken)]
    return ids[:k]


def check_priorities(values: Any, k: int, what: str = "priority") -> np.ndarray:
    """``k`` finite priorities >= 0 as float64 (a scalar is broadcast), or ``FieldError``."""
    if hasattr(values, "detach"):  # a torch tensor, maybe on a device
        values = values.detach().cpu().numpy()
    p = np.asarray(values, dtype=np.float64)
    if p.ndim == 0:
        p = np.full(k, float(p))
    elif p.size == k:
        p = p.reshape(k)
    if p.shape != (k,):
        raise FieldError(f"{what}: expected {k} values (one per row), got shape {np.shape(values)}")
    bad = ~np.isfinite(p) | (p < 0)
    if bad.any():
        raise FieldError(
            f"{what}: expected finite values >= 0, got {p[bad][:3].tolist()} at positions "
            f"{np.flatnonzero(bad)[:3].tolist()}; nothing was changed"
        )
    return p


def check_ids(values: Any, what: str, stop: np.ndarray) -> np.ndarray:
    """Row ids (``batch.index``: an integer array-like or tensor) as int64, checked against
    ``stop``, each lane's next row number (``ring.bounds()[1]``). An id is valid when it is
    ``>= 0`` and its row number ``id // lanes`` is below its lane's ``stop``; larger ids were never
    pushed. Raises ``FieldError`` for ids that are not integers and ``UnknownIdError`` for ids that
    were never valid, before any arithmetic on them (a huge id's stamp ``2 n + 2`` would wrap)."""
    if hasattr(values, "detach"):  # a torch tensor, maybe on a device
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if a.size == 0:
        return np.empty(0, np.int64)
    if a.dtype.kind not in "iu":
        raise FieldError(f"{what}: expected integer row ids (batch.index), got dtype {a.dtype}; pass batch.index as it came")
    a = a.reshape(-1)
    lanes = stop.shape[0]
    if a.dtype.kind == "u" and a.max() > _INT64_MAX:
        never = a[a > _INT64_MAX]
    else:
        ids = a.astype(np.int64, copy=False)
        lane = ids % lanes  # in [0, lanes), also for negative ids
        never = ids[(ids < 0) | (ids // lanes >= stop[lane])]
        if not never.size:
            return ids
    below = f"id < {int(stop[0])}" if lanes == 1 else f"id // {lanes} < {stop.tolist()}[id % {lanes}]"
    raise UnknownIdError(
        f"{what}: ids {never[:5].tolist()}{' ...' if never.size > 5 else ''} never named a row of this "
        f"buffer: expected ids from batch.index, >= 0 and below the next row of their lane ({below}); "
        "nothing was changed"
    )


class Priorities:
    """The shared-memory side of ``Prioritized`` and ``max_use`` (see the module docstring)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], sampler: Sampler, max_use: int | None, *, initialise: bool
    ) -> None:
        self.sampler = sampler
        self.max_use = max_use
        self.prioritized = isinstance(sampler, Prioritized)
        capacity = arrays["_stamp"].shape[0]
        self.tree = SumTree(capacity, arrays["_tree_sum"], arrays["_tree_min"])
        self._prio = arrays["_prio"]
        self.uses = arrays.get("_uses")
        self._stamp = arrays["_stamp"]
        self._lanes = arrays["_lanes"]
        if initialise:
            self.tree.reset()
            self._prio[0] = 1.0

    @staticmethod
    def columns(capacity: int, max_use: int | None) -> list[ColumnSpec]:
        size = SumTree.size(capacity)
        cols = [
            ColumnSpec("_tree_sum", (size,), np.dtype(np.float64)),
            ColumnSpec("_tree_min", (size,), np.dtype(np.float64)),
            ColumnSpec("_prio", (8,), np.dtype(np.float64)),
        ]
        if max_use is not None:
            cols.append(ColumnSpec("_uses", (capacity,), np.dtype(np.uint32)))
        return cols

    @property
    def max_priority(self) -> float:
        return float(self._prio[0])

    def leaf(self, priorities: np.ndarray) -> np.ndarray:
        """The leaves of these priorities (``inf`` where one overflows)."""
        if isinstance(self.sampler, Prioritized):
            s = self.sampler
            with np.errstate(over="ignore"):
                return (priorities + s.eps) ** s.alpha
        return np.ones_like(priorities)

    def check(self, values: Any, k: int, what: str = "priority") -> np.ndarray:
        """``check_priorities``, and every leaf at most ``MAX_LEAF``, or ``FieldError``."""
        p = check_priorities(values, k, what)
        self._bound(p, self.leaf(p), what)
        return p

    def _bound(self, priorities: np.ndarray, leaves: np.ndarray, what: str) -> None:
        if not leaves.size or leaves.max() <= MAX_LEAF:
            return
        bad = ~(leaves <= MAX_LEAF)
        s = self.sampler
        assert isinstance(s, Prioritized) and s.alpha > 0  # otherwise every leaf is 1
        with np.errstate(over="ignore"):
            most = float(np.power(MAX_LEAF, 1.0 / s.alpha)) - s.eps
        raise FieldError(
            f"{what}: got {priorities[bad][:3].tolist()} at positions {np.flatnonzero(bad)[:3].tolist()}, "
            f"whose tree leaves (p + {s.eps:g}) ** {s.alpha:g} exceed {MAX_LEAF:g} (the tree's total must "
            f"stay finite); expected priorities <= {most:.6g}: scale them down; nothing was changed"
        )

    def set_rows(self, slots: np.ndarray, priorities: np.ndarray | None, fresh: bool) -> None:
        """Under the lock: give ``slots`` their priorities (``None``: the largest so far); fresh
        rows also start with zero uses. Priorities whose leaves exceed ``MAX_LEAF`` raise
        ``FieldError`` before anything changes (callers check them first with ``check``)."""
        if priorities is None:
            leaves = self.leaf(np.full(slots.shape[0], self._prio[0]))
        else:
            leaves = self.leaf(priorities)
            self._bound(priorities, leaves, "priority")
            if priorities.size:
                self._prio[0] = max(float(self._prio[0]), float(priorities.max()))
        if self.uses is not None:
            if fresh:
                self.uses[slots] = 0
            leaves = np.where(self.uses[slots] >= self.max_use, 0.0, leaves) if not fresh else leaves
        self.tree.update(slots, leaves)

    def draw(self, rng: np.random.Generator, k: int, *, stratified: bool) -> tuple[np.ndarray, np.ndarray]:
        """``k`` slots in proportion to their leaves, and those leaves; stratified: one point in
        each of ``k`` equal segments of the total mass."""
        total = self.tree.total
        if total <= 0:
            return np.empty(0, np.int64), np.empty(0)
        u = rng.random(k)
        if stratified:
            u += np.arange(k)
            u *= total / k
        else:
            u *= total
        slots = self.tree.find(u)
        return slots, self.tree.leaves[slots]

    def weights(self, leaves: np.ndarray, beta: float) -> np.ndarray:
        low = self.tree.min
        if not np.isfinite(low) or low <= 0:
            return np.ones(leaves.shape[0], np.float32)
        with np.errstate(over="ignore"):  # a ratio past float64's range: its weight is 0 (or 1 at beta 0)
            return np.power(np.maximum(leaves, low) / low, -beta).astype(np.float32)

    def claim(self, slots: np.ndarray) -> np.ndarray:
        """Under the lock: count one use for each drawn slot (a slot drawn twice counts twice);
        return which draws fit within ``max_use`` — the rest must be re-drawn. Slots that reach
        ``max_use`` leave the tree."""
        assert self.uses is not None and self.max_use is not None
        uniq, inverse, counts = np.unique(slots, return_inverse=True, return_counts=True)
        room = np.maximum(self.max_use - self.uses[uniq].astype(np.int64), 0)
        order = np.argsort(inverse, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - np.repeat(np.cumsum(counts) - counts, counts)
        ok = rank < room[inverse]
        self.uses[uniq] += np.minimum(counts, room).astype(np.uint32)
        done = uniq[self.uses[uniq] >= self.max_use]
        if done.size:
            self.tree.update(done, 0.0)
        return ok

    def repair(self) -> None:
        """Under the lock, once a holder of it died (``Ring.repairs``): zero the leaves of slots
        that hold no row that counts, or a used-up one, and recompute the tree (see the module
        docstring). A slot counts while its stamp's row number (``2n + 2`` committed, ``2n + 1``
        being written) lies within its lane's bounds, as ``Ring.bounds`` computes them."""
        stamp, cursors, leaves, uses = self._stamp, self._lanes, self.tree.leaves, self.uses
        lanes = cursors.shape[0]
        lc = stamp.shape[0] // lanes
        for lane in range(lanes):
            cur, base = int(cursors[lane, 0]), int(cursors[lane, 1])
            start = min(max(base, cur - lc), cur)
            for a in range(lane * lc, (lane + 1) * lc, _REPAIR_CHUNK):
                b = min(a + _REPAIR_CHUNK, (lane + 1) * lc)
                s = stamp[a:b]
                n = (s - 1) // 2
                stale = (s <= 0) | (n < start) | (n >= cur)
                if uses is not None and self.max_use is not None:
                    stale |= uses[a:b] >= self.max_use
                leaves[a:b][stale] = 0.0
        self.tree.rebuild()

    def clear(self) -> None:
        self.tree.reset()
        self._prio[0] = 1.0
        if self.uses is not None:
            self.uses[:] = 0
