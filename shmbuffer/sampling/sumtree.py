"""A sum tree and a min tree over row priorities, vectorized with numpy, on any float64 arrays.

Prioritized replay needs three things fast: draw rows with probability proportional to their
priority, know the smallest priority (the bound of the importance-sampling weights), and change
many priorities at once. With numpy the cost is the number of calls, not the arithmetic, so the
tree is shallow: ``FANOUT``-ary (16) levels above the leaves until a level has at most ``TOP``
(4096) nodes, and over that top level a plain prefix sum, recomputed whole on every update (4096
additions cost less than the calls of the levels they replace). A million rows are two 16-ary
levels and a prefix sum: a draw of n rows is one ``searchsorted`` and, per level, one ``take`` of
an ``(n, 16)`` block, one ``cumsum`` and one comparison.

Layout (``sums`` and ``mins``, each ``SumTree.size(capacity)`` float64): the levels one after
another, leaves first, each but the top padded to a multiple of ``FANOUT``; ``sums`` then holds the
prefix sum of the top level. Unused slots hold 0 in ``sums`` and +inf in ``mins``.

Every node is recomputed from its children (never adjusted by a difference), so a tree's state is
a function of its leaves alone: a batched update equals the same updates one at a time (where a
slot repeats in one batch its last value wins, as it would one at a time), and no rounding error
accumulates over millions of updates, and ``rebuild`` repairs a tree whose updater died half-way.
Readers do not lock: a draw that races an update may land on a leaf that is 0 by then (or, in a
level being rewritten, on the wrong slot), so callers check the leaves they get (``Prioritized``
re-draws them); ``find`` never returns a slot outside the tree.

With the C extension (``native``) ``find`` and ``update`` are one C call each on the same
arrays: ``find`` walks every point down in lockstep, level by level; ``update`` sets the leaves in
order (the last value of a repeated slot wins) and recomputes their ancestors and the prefix sum
(a min is carried up, and recomputed from the 16 children only where the smallest one grew, or
for a run of consecutive slots: the same exact mins, with fewer reads of the cold ``mins`` array).
The layout is the same, so a tree written by either is read by the other. Sums of 16 children are
added in order in C and by BLAS in numpy, so inner sums may differ in the last bit between the
two; leaves, mins and the walk's rule are identical.
"""

from __future__ import annotations

import numpy as np

from .. import native

FANOUT = 16
TOP = 4096
_ONES = np.ones(FANOUT)
_WORDS = np.ones(FANOUT // 8, np.int64)
_BEFORE = np.triu(np.ones((FANOUT, FANOUT)), k=1)
"""``children @ _BEFORE`` is the mass before each child along each row, ``children @ _ONES`` the
row's total: one BLAS call each, several times faster than ``cumsum``/``sum`` along rows of 16."""


def _count_true(rows: np.ndarray) -> np.ndarray:
    """How many of each row of a ``(n, FANOUT)`` bool array are true, as int64."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2: a popcount of the bools, 8 at a time
        bits = np.bitwise_count(rows.view(np.uint64))
        return bits @ _WORDS
    return rows.sum(axis=1)


def _plan(capacity: int) -> list[int]:
    """Lengths of the levels, leaves first; all but the last are multiples of FANOUT."""
    lengths = [capacity]
    while lengths[-1] > TOP:
        lengths[-1] = -(-lengths[-1] // FANOUT) * FANOUT
        lengths.append(lengths[-1] // FANOUT)
    return lengths


class SumTree:
    """Priorities of ``capacity`` slots; ``sums`` and ``mins`` are ``size(capacity)`` float64
    arrays (in shared memory, or allocated here when not given)."""

    def __init__(self, capacity: int, sums: np.ndarray | None = None, mins: np.ndarray | None = None) -> None:
        self.capacity = capacity
        size = self.size(capacity)
        self.sums = np.zeros(size) if sums is None else sums
        self.mins = np.full(size, np.inf) if mins is None else mins
        if self.sums.shape != (size,) or self.mins.shape != (size,):
            raise ValueError(f"a SumTree of {capacity} slots needs two arrays of {size} floats")
        self._sums: list[np.ndarray] = []
        self._mins: list[np.ndarray] = []
        at = 0
        for n in _plan(capacity):
            self._sums.append(self.sums[at:at + n])
            self._mins.append(self.mins[at:at + n])
            at += n
        self._cum = self.sums[at:]
        # each level below the top as (nodes of the level above, FANOUT): a node's children are a row
        self._blocks = [(s.reshape(-1, FANOUT), m.reshape(-1, FANOUT)) for s, m in zip(self._sums[:-1], self._mins[:-1], strict=True)]
        self.leaves = self._sums[0][:capacity]
        self.plan = tuple(_plan(capacity))
        """The level lengths, leaves first (the C kernels take them)."""
        # the C kernels take whole C-contiguous float64 arrays
        contiguous = all(a.dtype == np.float64 and a.flags.c_contiguous for a in (self.sums, self.mins))
        self.lib = native.lib if contiguous else None
        """The C extension when the arrays suit its kernels, else ``None`` (numpy)."""

    @staticmethod
    def size(capacity: int) -> int:
        """The number of float64 entries a tree over ``capacity`` leaves takes (its column's length)."""
        lengths = _plan(capacity)
        return sum(lengths) + lengths[-1]

    def reset(self) -> None:
        """Every slot to priority 0."""
        self.sums[:] = 0
        self.mins[:] = np.inf

    @property
    def total(self) -> float:
        """The sum of all leaves (the root)."""
        return float(self._cum[-1])

    @property
    def min(self) -> float:
        """The smallest positive leaf (+inf when every leaf is 0)."""
        return float(self._mins[-1].min())

    def update(self, slots: np.ndarray, values: np.ndarray | float) -> None:
        """Set the leaves ``slots`` to ``values`` (>= 0, finite) and recompute their ancestors."""
        slots = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        lib = self.lib
        if lib is not None:
            # the kernel checks every slot before it writes anything: one outside [0, capacity)
            # (numpy wraps a negative one) leaves the tree as it was, for the numpy code below
            try:
                if isinstance(values, float) or (isinstance(values, np.ndarray) and values.ndim == 0):
                    lib.tree_update(self.sums, self.mins, self.plan, self.capacity, slots, float(values))
                else:
                    v = np.ascontiguousarray(values, dtype=np.float64)
                    if v.shape != slots.shape:
                        v = np.ascontiguousarray(np.broadcast_to(v, slots.shape))
                    lib.tree_update(self.sums, self.mins, self.plan, self.capacity, slots, v)
                return
            except IndexError:
                pass
        values = np.asarray(values, dtype=np.float64)
        if values.shape != slots.shape:
            values = np.full(slots.shape, values)
        if not slots.size:
            return
        # numpy assigns a repeated index in order, so the last value wins, as one at a time
        # (tests/test_sumtree.py checks it); a parent listed twice is recomputed twice, harmlessly
        self._sums[0][slots] = values
        self._mins[0][slots] = np.where(values > 0, values, np.inf)
        for (child_sums, child_mins), sums, mins in zip(self._blocks, self._sums[1:], self._mins[1:], strict=True):
            slots = slots // FANOUT
            sums[slots] = child_sums.take(slots, axis=0) @ _ONES
            # a min along rows of 16 is slow in numpy; down the columns of the transpose it is not
            mins[slots] = np.ascontiguousarray(child_mins.take(slots, axis=0).T).min(axis=0)
        np.cumsum(self._sums[-1], out=self._cum)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """The slot holding each point of ``mass`` (in ``[0, total)``; a point at or past the total
        counts as just below it): for uniform ``mass``, slot ``i`` comes with probability
        ``leaf_i / total``. Rounding can push a point to the very
        end of a node's range, onto a child of 0 there; callers check the leaves they get."""
        lib = self.lib
        if lib is not None:
            out = np.empty(np.size(mass), np.int64)
            lib.tree_find(self.sums, self.plan, self.capacity, np.ascontiguousarray(mass, dtype=np.float64).reshape(-1), out)
            return out
        u = np.array(mass, dtype=np.float64).reshape(-1)
        n = u.shape[0]
        cum = self._cum
        # a point rounded up to the total (tiny totals: 0.99 * 5e-324 is 5e-324) would land past the
        # last leaf of mass: keep it below the total, so it lands in the last top node that has mass
        np.minimum(u, np.nextafter(cum[-1], 0.0), out=u)
        node = np.searchsorted(cum, u, side="right")
        np.minimum(node, cum.shape[0] - 1, out=node)
        u -= np.where(node > 0, cum[node - 1], 0.0)
        np.maximum(u, 0.0, out=u)
        starts = np.arange(0, n * FANOUT, FANOUT)
        bound = u[:, None]
        for sums, _ in reversed(self._blocks):
            # a reader racing an update (readers do not lock) may see a parent whose children
            # were just zeroed and walk past the end of a level: stay inside; callers check leaves
            np.minimum(node, sums.shape[0] - 1, out=node)
            before = sums.take(node, axis=0) @ _BEFORE
            # children whose mass starts at or below u, counted 8 bytes (8 bools) at a time
            counts = _count_true(before <= bound)
            counts -= 1  # the last child whose mass starts at or below u
            np.maximum(counts, 0, out=counts)
            u -= before.ravel().take(starts + counts)
            node *= FANOUT
            node += counts
        return np.minimum(node, self.capacity - 1, out=node)

    def rebuild(self) -> None:
        """Recompute every level from the leaves (after a writer died in the middle of an update
        or a reset: the tree is a function of its leaves, so this repairs whatever it left), the
        leaves' own entries in ``mins`` and the padding included."""
        leaves = self._sums[0]
        leaves[self.capacity:] = 0
        np.copyto(self._mins[0], np.where(leaves > 0, leaves, np.inf))
        for (child_sums, child_mins), sums, mins in zip(self._blocks, self._sums[1:], self._mins[1:], strict=True):
            n = child_sums.shape[0]
            sums[:n] = child_sums @ _ONES
            mins[:n] = np.ascontiguousarray(child_mins.T).min(axis=0)
            sums[n:], mins[n:] = 0, np.inf  # the padding of a level
        np.cumsum(self._sums[-1], out=self._cum)
