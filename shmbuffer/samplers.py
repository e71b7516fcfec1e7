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
                             used-up slot
``_prio``     ``(8,)`` float64: ``[0]`` the largest priority given so far (new rows get it when
              the writer gives none), 1.0 at creation
``_uses``     ``(capacity,)`` uint32, times each row was drawn (only with ``max_use``)

Every change of these happens under the ring's lock: a committing writer setting its rows'
priorities, ``update_priorities``, ``claim`` (counting uses) and ``clear``. An update names rows
by id; a row overwritten since it was sampled has another id in its slot, so the update is
dropped, never applied to the new row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import FieldError
from .segment import ColumnSpec
from .sumtree import SumTree


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
        if isinstance(self.sampler, Prioritized):
            s = self.sampler
            return (priorities + s.eps) ** s.alpha
        return np.ones_like(priorities)

    def set_rows(self, slots: np.ndarray, priorities: np.ndarray | None, fresh: bool) -> None:
        """Under the lock: give ``slots`` their priorities (``None``: the largest so far); fresh
        rows also start with zero uses."""
        if priorities is None:
            priorities = np.full(slots.shape[0], self._prio[0])
        elif priorities.size:
            self._prio[0] = max(float(self._prio[0]), float(priorities.max()))
        leaves = self.leaf(priorities)
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

    def clear(self) -> None:
        self.tree.reset()
        self._prio[0] = 1.0
        if self.uses is not None:
            self.uses[:] = 0
