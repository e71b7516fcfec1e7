"""Samplers: which rows a batch takes. They return row ids (``ring.py``), never data; the buffer
gathers and checks the rows, so every sampler here is tested on plain arrays.

* ``Uniform()`` — every row that counts equally likely, with or without replacement.
* ``Prioritized(alpha, beta, beta_steps, eps)`` — proportional prioritized replay (Schaul et al.
  2016): row ``i`` is drawn with probability ``p_i^alpha / sum_k p_k^alpha`` by stratified
  sampling over a ``SumTree`` in shared memory; the batch carries importance-sampling weights
  ``w_i = (p_i^alpha / min_k p_k^alpha)^-beta`` (``(N P(i))^-beta`` normalised by its maximum, as in
  the paper), with ``beta`` annealed linearly to 1 over ``beta_steps`` sample calls.
* ``max_use`` (a buffer option, for both): a row drawn ``max_use`` times leaves the sampling set.

The interface (``Sampler``)
---------------------------
A sampler is a subclass of ``Sampler`` (a frozen dataclass of its settings). It says what it is,
and every path asks it instead of checking its class:

* ``kind``: its name in the block's metadata and in saves (``to_json``/``sampler_from_json``);
  defining the subclass registers it (``SAMPLERS``), so another process that imports the same
  module attaches to, loads and saves buffers that use it.
* ``prioritized``: it draws in proportion to the priorities ``update_priorities`` sets (a sum tree
  in shared memory, ``priorities.py``); only ``Prioritized`` is, and the tree's leaf formula is
  its own (``leaf``).
* ``served``: which built-in draw the C one-call sample (``one_call.OneCall``) and the device copy
  (``device/replay.py``) may run in its place: ``"uniform"`` (uniform over the lanes' rows), ``"tree"``
  (from the priority tree), or ``None`` (only its own ``draw``, in Python: the C path leaves such
  a sampler to the reader, never substituting another draw).
* ``draw(ring, tree, rng, k, ...) -> Draw`` gives row ids (and, from a tree, their leaves);
  ``weights`` turns leaves into importance weights (``None``: the batch has none).

A sampler reads the ring (bounds, ids of slots; ``ring.py``) and the ``SumTree``
(``sumtree.py``), never data: the reader (``reader.py``) reads the rows and asks for more where
they were not intact. ``docs/samplers.md`` writes a sampler of the newest rows this way. The
shared state ``Prioritized`` and ``max_use`` draw from is ``priorities.py``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from .sumtree import SumTree

_NONE = np.empty(0, np.int64)


class Draw(NamedTuple):
    """What a sampler drew: row ``ids`` (``ring.INVALID`` for a draw to throw away) and, from the
    tree, their ``leaves`` (what importance weights are made of)."""

    ids: np.ndarray
    leaves: np.ndarray | None = None


class RingView(Protocol):
    """What samplers read of the ring (``ring.Ring``)."""

    lanes: int

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Each lane's first and stop row number."""

    def span(self) -> tuple[int, int]:
        """The smallest first and the largest stop row number over the lanes."""

    def ids_of_slots(self, slots: np.ndarray, live: np.ndarray | None = None) -> np.ndarray:
        """The ids of the rows in ``slots`` (only those marked in ``live``, if given)."""

    def committed_ids(self) -> np.ndarray:
        """The ids of every committed row."""

    # optional: ``native_view``, ``(stamp, cursors)`` arrays the C draw reads ids from (``ring.Ring``);
    # without it (or without the extension) ``tree_draw`` runs the numpy code and ``ids_of_slots``


SAMPLERS: dict[str, type[Sampler]] = {}
"""Every ``Sampler`` subclass by its ``kind``: what ``sampler_from_json`` builds."""


class Sampler:
    """What every sampler is (see "The interface" in the module docstring). Subclass it as a frozen
    dataclass of the sampler's settings, set ``kind`` (and ``served``, ``prioritized`` where they
    apply) and write ``draw``; ``weights`` defaults to none."""

    kind: ClassVar[str] = ""
    """The sampler's name in metadata and saves; unique among the subclasses."""
    prioritized: ClassVar[bool] = False
    """Draws in proportion to the priorities ``update_priorities`` sets (the shared sum tree), by
    ``Prioritized``'s formulas: only ``Prioritized`` and its subclasses set it."""
    weighted: ClassVar[bool] = False
    """Its batches carry importance weights (``weights`` gives them)."""
    served: ClassVar[str | None] = None
    """The built-in draw that may run in its place: ``"uniform"``, ``"tree"`` or ``None``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.kind:
            raise TypeError(f"{cls.__name__}: a Sampler subclass sets kind, its name in metadata and saves")
        if cls.prioritized and not any(c.__name__ == "Prioritized" and c.__module__ == __name__ for c in cls.__mro__):
            raise TypeError(f"{cls.__name__}: prioritized samplers follow Prioritized's formulas: subclass Prioritized")
        if cls.served not in (None, "uniform", "tree") or (cls.served == "tree") != cls.prioritized:
            raise TypeError(f"{cls.__name__}: served must be None, 'uniform' or, for a prioritized sampler, 'tree'; "
                            f"got {cls.served!r}")
        known = SAMPLERS.get(cls.kind)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise TypeError(f"{cls.__name__}: kind {cls.kind!r} is already {known.__module__}.{known.__qualname__}'s")
        SAMPLERS[cls.kind] = cls

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, again: bool = False, slow: bool = False,
    ) -> Draw:
        """``k`` ids of rows to read (``ring.INVALID`` for a draw to throw away; fewer when there are
        not enough rows). ``tree`` is the priority tree when the buffer has one (``prioritized``, or
        ``max_use``: leaf 0 once a row is used up, so draw from it then); ``replace=False`` wants
        distinct ids, none of ``taken``; ``again``: the reader re-draws rows that were not intact;
        ``slow``: they kept failing (draw from ``ring.committed_ids()``)."""
        raise NotImplementedError(f"{type(self).__name__}.draw")

    def weights(self, tree: SumTree | None, leaves: np.ndarray | None, calls: int) -> np.ndarray | None:
        """Importance weights for drawn ``leaves`` after ``calls`` samples; ``None``: no weights."""
        return None

    def to_json(self) -> dict[str, Any]:
        """As JSON, for the block's metadata and saves: the kind and the settings."""
        return {"kind": self.kind, **(asdict(self) if is_dataclass(self) else {})}

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> Sampler:
        """The sampler ``to_json`` gave (the kind already taken out of ``spec``)."""
        return cls(**spec)


@dataclass(frozen=True)
class Uniform(Sampler):
    """Every committed row equally likely (``sample(n, replace=False)`` for distinct rows); under
    ``max_use`` every row with uses left (leaf 1 in the tree)."""

    kind: ClassVar[str] = "uniform"
    served: ClassVar[str | None] = "uniform"

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, again: bool = False, slow: bool = False,
    ) -> Draw:
        """``k`` ids (fewer when there are not enough rows): from the tree when there is one, else
        from the lanes' bounds; ``slow`` (rows kept failing the reader's check): from a scan of the
        committed rows. ``taken`` are left out when drawing distinct rows."""
        if tree is not None:
            return tree_draw(ring, tree, rng, k, stratified=not again)
        if slow:
            ok = ring.committed_ids()
            if not replace and taken is not None:
                ok = ok[~np.isin(ok, taken)]
            if ok.size < (1 if replace else k):
                return Draw(_NONE)
            return Draw(rng.choice(ok, size=k, replace=replace))
        if replace and ring.lanes == 1:  # the hot path, without arrays of bounds
            start, stop = ring.span()
            if stop <= start:
                return Draw(_NONE)
            ids = start + (rng.random(k) * (stop - start)).astype(np.int64)
            return tuple.__new__(Draw, (ids, None))  # Draw(ids) without its Python-level __new__
        first, last = ring.bounds()
        return Draw(uniform_ids(rng, k, first, last, replace=replace, taken=taken))



@dataclass(frozen=True)
class Prioritized(Sampler):
    """Proportional prioritized replay; see the module docstring for the formulas."""

    kind: ClassVar[str] = "prioritized"
    prioritized: ClassVar[bool] = True
    weighted: ClassVar[bool] = True
    served: ClassVar[str | None] = "tree"

    alpha: float = 0.6
    beta: float = 0.4
    beta_steps: int | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name, value in (("alpha", self.alpha), ("beta", self.beta), ("eps", self.eps)):
            if not _finite(value) or value < 0:
                raise ValueError(f"Prioritized: {name} must be a finite number >= 0, got {value!r}")
        if self.beta > 1:
            raise ValueError(f"Prioritized: beta must be in [0, 1], got {self.beta}")
        if self.beta_steps is not None and (not isinstance(self.beta_steps, (int, np.integer)) or self.beta_steps < 0):
            raise ValueError(f"Prioritized: beta_steps must be an int >= 0 (0 or None: no annealing), got {self.beta_steps!r}")

    def beta_at(self, calls: int) -> float:
        """``beta`` after ``calls`` sample calls: linear from ``beta`` to 1 over ``beta_steps``."""
        if not self.beta_steps:
            return self.beta
        return self.beta + (1.0 - self.beta) * min(1.0, calls / self.beta_steps)

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, again: bool = False, slow: bool = False,
    ) -> Draw:
        """``k`` rows in proportion to their leaves, stratified on a first draw, plainly ``again``
        (the reader re-draws a few rows); distinct rows are the reader's business."""
        assert tree is not None, "a prioritized buffer has a tree"
        return tree_draw(ring, tree, rng, k, stratified=not again)

    def weights(self, tree: SumTree | None, leaves: np.ndarray | None, calls: int) -> np.ndarray | None:
        """Importance weights ``(leaf / min leaf) ** -beta`` with ``beta`` after ``calls`` samples."""
        assert tree is not None and leaves is not None
        lib = tree.lib
        if lib is not None and leaves.dtype == np.float64 and leaves.flags.c_contiguous and leaves.ndim == 1:
            out = np.empty(leaves.shape[0], np.float32)  # one C call; its pow agrees to 1 ulp of float32
            lib.weights(tree.mins, tree.plan, tree.capacity, leaves, self.beta_at(calls), out)
            return out
        return importance_weights(leaves, tree.min, self.beta_at(calls))



def _finite(value: Any) -> bool:
    """``value`` is a real number (not a bool) that a float holds finitely."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def importance_weights(leaves: np.ndarray, low: float, beta: float) -> np.ndarray:
    """Importance weights ``(leaf / low) ** -beta`` as float32, ``low`` the smallest leaf of the
    rows that can be drawn (a leaf below it counts as ``low``); all ones when ``low`` is not a
    positive finite number. The one formula: ``Prioritized.weights`` (without the extension) and
    ``shmbuffer.ray`` (``low`` over every shard) use it; the extension's ``weights`` states it in C."""
    if not np.isfinite(low) or low <= 0:
        return np.ones(leaves.shape[0], np.float32)
    if low >= 1e-27:  # leaves are at most MAX_LEAF (1e280): no ratio can overflow
        return _weights(leaves, low, beta)
    with np.errstate(over="ignore"):  # a ratio past float64's range: its weight is 0 (or 1 at beta 0)
        return _weights(leaves, low, beta)


def _weights(leaves: np.ndarray, low: float, beta: float) -> np.ndarray:
    return np.power(np.maximum(leaves, low) / low, -beta).astype(np.float32)


def check_batch_size(n: Any, what: str = "sample") -> int:
    """``n`` as an int when it is a positive int (a numpy integer too; ``True`` is not one), else
    ``ValueError`` naming ``what``: the check of ``sample(n)``'s row count."""
    if (type(n) is not int and (not isinstance(n, np.integer) or isinstance(n, bool))) or n <= 0:
        raise ValueError(f"{what}: expected a positive number of rows, got {n!r}")
    return int(n)


def sampler_from_json(spec: dict[str, Any]) -> Sampler:
    """The sampler that a sampler's ``to_json`` gave, by its kind (``SAMPLERS``); ``ValueError``
    naming the kind when no class of that kind is defined in this process."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    cls = SAMPLERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"sampler kind {kind!r} is not known in this process (known: {sorted(SAMPLERS)}): import "
                         "the module that defines that Sampler subclass first (defining it registers its kind)")
    return cls.from_json(spec)


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
    ids = ids_at(pos, start, stop)
    if not replace and taken is not None and taken.size:
        ids = ids[~np.isin(ids, taken)]
    return ids[:k]


def ids_at(pos: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """The ids at positions ``pos`` (in ``[0, m)``) among the ``m`` rows ``[start[l], stop[l])`` of
    the lanes, lane after lane (``uniform_ids``' positions)."""
    lanes = start.shape[0]
    if lanes == 1:
        return start[0] + pos
    sizes = stop - start
    ends = np.cumsum(sizes)
    lane = np.searchsorted(ends, pos, side="right")
    return (start[lane] + pos - (ends[lane] - sizes[lane])) * lanes + lane


def tree_draw(ring: RingView, tree: SumTree, rng: np.random.Generator, k: int, *, stratified: bool) -> Draw:
    """``k`` rows in proportion to their leaves; stratified: one point in each of ``k`` equal
    segments of the total mass. A draw that raced an update onto a leaf of 0 gets an invalid id.
    With the extension and a ring that has a ``native_view`` the masses, the walk, the leaves and
    the ids are one C call (``_native.tree_draw``) on the same random numbers: the same ids as
    below (``tests/test_native.py``)."""
    total = tree.total
    if total <= 0:
        return Draw(_NONE, np.empty(0))
    lib, view = tree.lib, getattr(ring, "native_view", None)
    if lib is not None and view is not None and k > 0:
        # the same numbers in one C call: the masses, the walk, the leaves, the ids
        u = rng.random(k)
        slots, leaves, ids = np.empty(k, np.int64), np.empty(k), np.empty(k, np.int64)
        lib.tree_draw(tree.sums, tree.plan, tree.capacity, total, u, stratified, view[0], view[1], slots, leaves, ids)
        return tuple.__new__(Draw, (ids, leaves))  # Draw(ids, leaves) without its Python-level __new__
    u = rng.random(k)
    if stratified:
        u += np.arange(k)
        u *= total / k
    else:
        u *= total
    slots = tree.find(u)
    leaves = tree.leaves[slots]
    return Draw(ring.ids_of_slots(slots, leaves > 0), leaves)
