"""The shared state behind ``Prioritized`` and ``max_use``: the tree, the largest priority, uses.

Columns in the block (``layout.py``):

``_tree_sum``, ``_tree_min``  the ``SumTree`` over slots: ``(p + eps)^alpha`` for a prioritized row,
                             1 for a uniform row under ``max_use``, 0 for an empty, cleared or
                             used-up slot; every leaf is at most ``MAX_LEAF``
``_prio``     ``(8,)`` float64: ``[0]`` the largest priority given so far (new rows get it when
              the writer gives none), 1.0 at creation
``_uses``     ``(capacity,)`` uint32, times each row was drawn (only with ``max_use``)

Two shared counters live in ``_stats`` (``layout.Counter``): ``SAMPLE_CALLS``, the sample calls
made so far by every process (``beta`` is annealed over them, so a buffer attached, saved and
loaded continues its annealing where it was), and ``REMOVED``, set once a row was deleted or used
up (``ReplayBuffer.__len__`` then leaves such rows out). ``SAMPLE_CALLS`` is counted without the
lock by the sampling process: one learner counts exactly; two processes sampling at the same
instant may count one call for two (the annealing is then slightly slower, never faster).

Every change of these happens under the ring's lock: a committing writer setting its rows'
priorities, ``update_priorities``, ``claim`` (counting uses) and ``clear``. An update names rows
by id; a row overwritten since it was sampled has another id in its slot, so the update is
dropped, never applied to the new row. An id that never named a row (negative, or not reserved
yet) is a caller's bug, not a race: ``Ring.check_ids`` refuses it.

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

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FieldError
from ..sampling.samplers import Sampler, formula
from ..sampling.sumtree import SumTree
from . import rows
from .layout import Counter
from .ring import Ring

MAX_LEAF = 1e280
"""The largest leaf the tree takes (see the module docstring): its total stays finite."""
_REPAIR_CHUNK = 1 << 20
"""Slots a repair looks at in one numpy call (bounds its temporary memory)."""


def check_priorities(values: Any, k: int, what: str = "priority", *, sampler: Sampler | None = None) -> np.ndarray:
    """``k`` finite priorities >= 0 as float64 (a scalar is broadcast), and with a prioritized
    ``sampler`` each tree leaf at most ``MAX_LEAF`` (``bound``), or ``FieldError``."""
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
    if sampler is not None and sampler.prioritized:
        with np.errstate(over="ignore"):
            bound(sampler, p, sampler.leaf(p), what)
    return p


def bound(s: Sampler, priorities: np.ndarray, leaves: np.ndarray, what: str) -> None:
    """``FieldError`` unless every leaf is at most ``MAX_LEAF`` (the tree's total must stay finite)."""
    if not leaves.size or leaves.max() <= MAX_LEAF:
        return
    bad = ~(leaves <= MAX_LEAF)
    most = float(s.priority_of(np.array([MAX_LEAF]))[0])
    built_in = formula(s)
    how = (f"(p + {built_in.eps:g}) ** {built_in.alpha:g}" if built_in is not None
           else f"({type(s).__qualname__}.leaf)")
    raise FieldError(
        f"{what}: got {priorities[bad][:3].tolist()} at positions {np.flatnonzero(bad)[:3].tolist()}, "
        f"whose tree leaves {how} exceed {MAX_LEAF:g} (the tree's total must "
        f"stay finite); expected priorities <= {most:.6g}: scale them down; nothing was changed"
    )


class Priorities:
    """The shared-memory side of ``Prioritized`` and ``max_use`` (see the module docstring)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], sampler: Sampler, max_use: int | None, *, initialise: bool
    ) -> None:
        self.sampler = sampler
        self.max_use = max_use
        self.prioritized = sampler.prioritized
        capacity = arrays["_stamp"].shape[0]
        self.tree = SumTree(capacity, arrays["_tree_sum"], arrays["_tree_min"])
        self._prio = arrays["_prio"]
        self.uses = arrays.get("_uses")
        self._stamp = arrays["_stamp"]
        self._lanes = arrays["_lanes"]
        self._stats = arrays["_stats"]
        self._safe = np.inf
        """Priorities up to this have a leaf of at most ``MAX_LEAF``: no overflow to guard against
        (known for ``Prioritized``'s own formula; -1 for a leaf of a subclass's: always guarded)."""
        built_in = formula(sampler)
        if built_in is not None and built_in.alpha > 0:
            with np.errstate(over="ignore"):
                self._safe = float(np.power(MAX_LEAF, 1.0 / built_in.alpha)) - built_in.eps
        elif sampler.prioritized and built_in is None:
            self._safe = -1.0
        self._sure = self._safe * (1 - 1e-9)
        """Priorities up to this certainly have a leaf of at most ``MAX_LEAF`` whatever the rounding
        of the power: the bound check is skipped (it would pass); above it the leaves are checked.
        Verified here with a margin (else -1: the checks always run). The shortcuts that skip the
        checks (one C pass, the C update) run only for ``Prioritized``'s own formula."""
        if built_in is not None and np.isfinite(self._sure):
            with np.errstate(over="ignore"):
                top = float(built_in.leaf(np.array([self._sure]))[0])
            if not (self._sure >= 0 and top <= MAX_LEAF * (1 - 1e-12)):
                self._sure = -1.0
        self._lib = self.tree.lib
        if initialise:
            self.tree.reset()
            self._prio[0] = 1.0

    @property
    def max_priority(self) -> float:
        """The largest priority given so far: a push without ``priority=`` gets it."""
        return float(self._prio[0])

    @property
    def calls(self) -> int:
        """Sample calls made so far, all processes (see the module docstring)."""
        return int(self._stats[Counter.SAMPLE_CALLS])

    def next_call(self) -> int:
        """Count one sample call; return the number of calls before it (annealing's step)."""
        stats = self._stats
        calls = int(stats[Counter.SAMPLE_CALLS])
        stats[Counter.SAMPLE_CALLS] = calls + 1
        return calls

    def mark_removed(self) -> None:
        """A row was deleted or used up: from now on ``len`` leaves such rows out."""
        self._stats[Counter.REMOVED] = 1

    def remove(self, slots: np.ndarray) -> None:
        """Under the lock: deleted rows leave the tree (never drawn again)."""
        self.tree.update(slots, 0.0)
        self.mark_removed()

    def set_uses(self, slots: np.ndarray, uses: np.ndarray) -> None:
        """Under the lock: give ``slots`` these use counts (an import); used-up rows leave the tree."""
        if self.uses is None or self.max_use is None:
            return
        u = np.minimum(np.asarray(uses, dtype=np.int64), self.max_use).astype(np.uint32)
        self.uses[slots] = u
        done = slots[u >= self.max_use]
        if done.size:
            self.tree.update(done, 0.0)
            self.mark_removed()

    def priorities_of(self, leaves: np.ndarray) -> np.ndarray:
        """The priorities whose leaves these are (the sampler's ``priority_of``, the inverse of
        its ``leaf``; 0 for a leaf of 0); a uniform buffer's are 1."""
        return self.sampler.priority_of(np.asarray(leaves, dtype=np.float64))

    def leaves_valid(self, leaves: np.ndarray) -> bool:
        """Whether every leaf is one of a finite priority: at most the leaf of the largest float
        (a loaded file's leaves are checked with it; ``priorities_of`` then gives finite values)."""
        s = self.sampler
        if not s.prioritized:
            return True
        with np.errstate(over="ignore"):
            top = float(s.leaf(np.array([np.finfo(np.float64).max]))[0])
        return bool((np.asarray(leaves) <= top).all())

    def leaf(self, priorities: np.ndarray) -> np.ndarray:
        """The leaves of these priorities, by the sampler's ``leaf`` (``inf`` where one overflows)."""
        if not priorities.size or priorities.max() <= self._safe:  # the usual case: nothing overflows
            return self.sampler.leaf(priorities)
        with np.errstate(over="ignore"):
            return self.sampler.leaf(priorities)

    def _scan(self, p: np.ndarray) -> float:
        """The largest of ``p`` (float64) when all are finite and >= 0, in one C call; -1.0 when
        one is not, or when there is no C path for ``p``: the numpy checks then run."""
        lib = self._lib
        if lib is None or type(p) is not np.ndarray or p.dtype != np.float64 or not p.flags.c_contiguous:
            return -1.0
        return float(lib.scan(p))

    def check(self, values: Any, k: int, what: str = "priority") -> np.ndarray:
        """``check_priorities``, and every leaf at most ``MAX_LEAF``, or ``FieldError``."""
        if type(values) is np.ndarray and values.shape == (k,) and 0 <= self._scan(values) <= self._sure:
            return values  # finite, >= 0, every leaf below MAX_LEAF: what the checks below would return
        return check_priorities(values, k, what, sampler=self.sampler)

    def set_new_rows(self, slots: np.ndarray, priorities: np.ndarray | None) -> Callable[[], None]:
        """Under the reservation's lock: ``set_rows`` for a push's new rows; returns what puts back
        their slots' leaves and uses as they were (a push undone, ``Ring.undo``), and the largest
        priority unless another process has raised it since."""
        leaves, top = self.tree.leaves[slots].copy(), float(self._prio[0])
        uses = None if self.uses is None else self.uses[slots].copy()
        self.set_rows(slots, priorities, fresh=True)
        mine = float(self._prio[0])

        def put_back() -> None:
            self.tree.update(slots, leaves)
            if float(self._prio[0]) == mine:
                self._prio[0] = top
            if uses is not None and self.uses is not None:
                self.uses[slots] = uses

        return put_back

    def set_rows(self, slots: np.ndarray, priorities: np.ndarray | None, fresh: bool) -> None:
        """Under the lock: give ``slots`` their priorities (``None``: the largest so far); fresh
        rows also start with zero uses. Priorities whose leaves exceed ``MAX_LEAF`` raise
        ``FieldError`` before anything changes (callers check them first with ``check``)."""
        if priorities is None:
            leaves = self.leaf(np.full(slots.shape[0], self._prio[0]))
        elif priorities.size and 0 <= (most := self._scan(priorities)) <= self._sure:
            # one C pass gave the largest and showed every leaf is below MAX_LEAF (no bound check)
            leaves = self.sampler.leaf(priorities)
            self._prio[0] = max(float(self._prio[0]), most)
        else:
            leaves = self.leaf(priorities)
            if self.prioritized:
                bound(self.sampler, priorities, leaves, "priority")
            if priorities.size:
                self._prio[0] = max(float(self._prio[0]), float(priorities.max()))
        if self.uses is not None:
            if fresh:
                self.uses[slots] = 0
            leaves = np.where(self.uses[slots] >= self.max_use, 0.0, leaves) if not fresh else leaves
        self.tree.update(slots, leaves)

    def try_update(self, ring: Ring, ids: Any, values: Any) -> int | None:
        """``ReplayBuffer.update_priorities`` in one C call (``_native.update_priorities``) when
        that call can decide alone: ``ids`` int64 and ``values`` floats (float32 widened to float64: the
        same numbers, as the Python steps' check makes them), one-dimensional arrays
        of one priority per id, every priority finite, >= 0 and below the bound of ``check``, no
        ``max_use``. The call refuses (``None``, nothing changed: the caller takes the Python
        steps, which raise or wait) an unknown id, a busy lock and a lock whose repairs are owed.
        Otherwise it returns how many rows were current, and set them, as the Python steps do."""
        lib = self._lib
        view = ring.native_view
        if hasattr(values, "detach"):  # a torch tensor, maybe on a device (as check_priorities takes it)
            values = values.detach().cpu().numpy()
        if type(values) is np.ndarray and values.dtype.kind == "f" and values.dtype != np.float64:
            values = values.astype(np.float64)  # a learner's float32 TD errors: the same values, exactly
        if (lib is None or view is None or self.uses is not None or type(ids) is not np.ndarray
                or type(values) is not np.ndarray or ids.dtype != np.int64 or values.dtype != np.float64
                or ids.ndim != 1 or values.shape != ids.shape or not (ids.flags.c_contiguous and values.flags.c_contiguous)
                or not 0 <= lib.scan(values) <= self._sure):
            return None
        leaves = self.sampler.leaf(values)  # as set_rows: the same leaves to the bit
        tree = self.tree
        done: int | None = lib.update_priorities(ring.lock.memory, ids, values, leaves, view[0], view[1], tree.sums,
                                                 tree.mins, tree.plan, tree.capacity, self._prio)
        return done

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
            self._stats[Counter.REMOVED] = 1
        return ok

    def give_back(self, slots: np.ndarray, leaves: np.ndarray) -> None:
        """Under the lock: one use less for each slot (a read counted them, then raised before it
        returned their rows: ``reader.fetch``); a slot that left the tree at ``max_use`` gets
        its leaf back (``leaves``: theirs when they were drawn)."""
        assert self.uses is not None and self.max_use is not None
        full = self.uses[slots] >= self.max_use
        np.subtract.at(self.uses, slots, 1)
        back = full & (self.uses[slots] < self.max_use) & (self.tree.leaves[slots] == 0)
        if back.any():
            self.tree.update(slots[back], leaves[back])

    def repair(self) -> None:
        """Under the lock, once a holder of it died (``Ring.repairs``): zero the leaves of slots
        that hold no row that counts, or a used-up one, and recompute the tree (see the module
        docstring). A slot counts while its stamp's row number (``2n + 2`` committed, ``2n + 1``
        being written) lies within its lane's bounds, as ``Ring.bounds`` computes them."""
        stamp, cursors, leaves, uses = self._stamp, self._lanes, self.tree.leaves, self.uses
        lanes = cursors.shape[0]
        lc = rows.lane_capacity(stamp.shape[0], lanes)
        first, stop = rows.bounds(cursors, lc)
        for lane in range(lanes):
            start, cur = int(first[lane]), int(stop[lane])
            for a in range(lane * lc, (lane + 1) * lc, _REPAIR_CHUNK):
                b = min(a + _REPAIR_CHUNK, (lane + 1) * lc)
                s = stamp[a:b]
                n = rows.number_of_stamp(s)
                stale = (s <= 0) | (n < start) | (n >= cur)
                if uses is not None and self.max_use is not None:
                    stale |= uses[a:b] >= self.max_use
                leaves[a:b][stale] = 0.0
        self.tree.rebuild()

    @staticmethod
    def leaves_of(prios: Priorities | None, slots: np.ndarray) -> np.ndarray:
        """The tree leaves of ``slots`` (``ReplayBuffer.priority``), or ``FieldError`` without a tree."""
        if prios is None:
            raise FieldError("priority: this buffer keeps no priority tree (create it with Prioritized(...) or max_use)")
        return prios.tree.leaves[slots].copy()

    @staticmethod
    def uses_of(prios: Priorities | None, slots: np.ndarray) -> np.ndarray:
        """The use counts of ``slots`` (``ReplayBuffer.uses``), or ``FieldError`` without ``max_use``."""
        if prios is None or prios.uses is None:
            raise FieldError("uses: this buffer counts no uses; create it with max_use=N")
        return prios.uses[slots].astype(np.int64)

    def clear(self) -> None:
        """Reset the tree, the largest priority (to 1.0) and the use counts, as ``ReplayBuffer.clear`` does."""
        self.tree.reset()
        self._prio[0] = 1.0
        if self.uses is not None:
            self.uses[:] = 0
