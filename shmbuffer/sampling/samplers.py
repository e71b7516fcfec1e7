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
  in shared memory, ``priorities.py``); only ``Prioritized`` and its subclasses are.
* ``leaf(priorities)``: the tree leaf of each priority (``Prioritized``: ``(p + eps) ** alpha``;
  any other sampler: 1, a row under ``max_use``), and ``priority_of(leaves)`` its inverse. The
  tree, updates, pushes, exports and loads use them; a subclass of ``Prioritized`` may give its
  own (with both), and is then still served by the tree's draw (``formula`` says whether the
  shortcuts that rely on the built-in formula apply).
* ``served``: which built-in draw the C one-call sample (``draw_gather.DrawGather``) and the device copy
  (``device/replay.py``) may run in its place: ``"uniform"`` (uniform over the lanes' rows), ``"tree"``
  (from the priority tree), or ``None`` (only its own ``draw``, in Python: the C path leaves such
  a sampler to the reader, never substituting another draw). Derived, never declared: a subclass
  serves only while its ``draw`` and ``weights`` are ``Uniform``'s or ``Prioritized``'s own, so a
  subclass of either that writes its own ``draw`` is drawn by it on every path.
* ``draw(ring, tree, rng, k, ...) -> Draw`` gives row ids (and, from a tree, their leaves);
  ``weights`` turns leaves into importance weights (``None``: the batch has none). A draw of a
  class outside this module is checked as it returns (``check_draw``: a 1-D integer array of at
  most ``k`` ids of rows pushed so far; ``SamplerError`` naming the draw), on every path; the
  built-in draws are not (they are tested here).
* ``to_json`` also says where a user's class is (module, name), so a process without it names it
  (``UnknownSampler``) or reads the rows through a stand-in (``Unimported``).

A sampler reads the ring (bounds, ids of slots; ``ring.py``) and the ``SumTree``
(``sumtree.py``), never data: the reader (``reader.py``) reads the rows and asks for more where
they were not intact. ``docs/samplers.md`` writes a sampler of the newest rows this way. The
shared state ``Prioritized`` and ``max_use`` draw from is ``priorities.py``.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import numpy as np

from ..errors import SamplerError, UnknownSampler
from .sumtree import SumTree

_NONE = np.empty(0, np.int64)


class Draw(NamedTuple):
    """What a sampler drew: row ``ids`` (``INVALID`` for a draw to throw away) and, from the
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

INVALID = -(2**62)
"""An id no slot ever holds (its expected stamp is negative, and stamps never are): a draw's
way to throw a position away (``ring.py``)."""


class Sampler:
    """What every sampler is (see "The interface" in the module docstring). Subclass it as a frozen
    dataclass of the sampler's settings, set ``kind`` (and ``prioritized`` where it applies) and
    write ``draw``; ``weights`` defaults to none."""

    kind: ClassVar[str] = ""
    """The sampler's name in metadata and saves; unique among the subclasses."""
    prioritized: ClassVar[bool] = False
    """Draws in proportion to the priorities ``update_priorities`` sets (the shared sum tree), by
    ``Prioritized``'s formulas: only ``Prioritized`` and its subclasses set it."""
    weighted: ClassVar[bool] = False
    """Its batches carry importance weights (``weights`` gives them)."""
    served: ClassVar[str | None] = None
    """The built-in draw that runs in its place: ``"uniform"``, ``"tree"`` or ``None``. Derived,
    never declared: a class serves while its ``draw`` and ``weights`` are ``Uniform``'s or
    ``Prioritized``'s own; a class that writes either is drawn by its own ``draw`` on every path."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.kind:
            raise TypeError(f"{cls.__name__}: a Sampler subclass sets kind, its name in metadata and saves")
        if cls.prioritized and not any(c.__name__ == "Prioritized" and c.__module__ == __name__ for c in cls.__mro__):
            raise TypeError(f"{cls.__name__}: prioritized samplers follow Prioritized's formulas: subclass Prioritized")
        if cls.__module__ != __name__:  # a user's class: what it serves follows from its methods
            if "leaf" in cls.__dict__ and (not cls.prioritized or "priority_of" not in cls.__dict__):
                raise TypeError(f"{cls.__name__}: a class with its own leaf subclasses Prioritized and also writes "
                                "priority_of, the leaf's inverse (exports write priorities)")
            if "served" in cls.__dict__:
                raise TypeError(f"{cls.__name__}: served is not set by hand: a built-in path serves a sampler only "
                                "while its draw and weights are Uniform's or Prioritized's own (then it is derived)")
            if "draw" in cls.__dict__:
                cls.draw = _checked(cls.__dict__["draw"])  # type: ignore[method-assign]
            cls.served = next((name for name, (draw, weights) in _BUILT_IN.items()
                               if cls.draw is draw and cls.weights is weights), None)
        known = SAMPLERS.get(cls.kind)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise TypeError(f"{cls.__name__}: kind {cls.kind!r} is already {known.__module__}.{known.__qualname__}'s")
        SAMPLERS[cls.kind] = cls

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False,
    ) -> Draw:
        """``k`` ids of rows to read (``INVALID`` for a draw to throw away; fewer when there are
        not enough rows). ``tree`` is the priority tree when the buffer has one (``prioritized``, or
        ``max_use``: leaf 0 once a row is used up, so draw from it then); ``replace=False`` wants
        distinct ids, none of ``taken``; ``retry``: the reader re-draws rows that were not intact;
        ``from_scan``: they kept failing (draw from ``ring.committed_ids()``). A subclass's own ``draw``
        is checked as it returns (``check_draw``)."""
        raise NotImplementedError(f"{type(self).__name__}.draw")

    def weights(self, tree: SumTree | None, leaves: np.ndarray | None, calls: int) -> np.ndarray | None:
        """Importance weights for drawn ``leaves`` after ``calls`` samples; ``None``: no weights."""
        return None

    def leaf(self, priorities: np.ndarray) -> np.ndarray:
        """The tree leaf of a row of each priority: 1 for a sampler that is not ``prioritized``
        (a row under ``max_use`` counts while it has uses left); ``Prioritized``'s formula for it."""
        return np.ones_like(priorities)

    def priority_of(self, leaves: np.ndarray) -> np.ndarray:
        """A priority whose leaf each of ``leaves`` is (``leaf``'s inverse: what an export writes);
        1 for a sampler that is not ``prioritized``."""
        return np.ones_like(leaves)

    def to_json(self) -> dict[str, Any]:
        """As JSON, for the block's metadata and saves: the kind and the settings, and for a class
        defined outside shmbuffer where it is (``"class"``: its module, name and whether it is
        prioritized), so a process without it can name it and stand in for it (``Unimported``)."""
        out: dict[str, Any] = {"kind": self.kind}
        cls = type(self)
        if cls.__module__ != __name__:
            out["class"] = {"module": cls.__module__, "name": cls.__qualname__, "prioritized": cls.prioritized}
        return {**out, **(asdict(self) if is_dataclass(self) else {})}

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> Sampler:
        """The sampler ``to_json`` gave (the kind and the class already taken out of ``spec``)."""
        return cls(**spec)


def drawn_by(sampler: Sampler) -> str | None:
    """``"module.Class.draw"`` when ``sampler`` draws by a draw of its own (not a built-in one):
    what errors about its draws name; ``None`` for a built-in draw."""
    draw = type(sampler).draw
    if not getattr(draw, "checked", False):
        return None
    return f"{draw.__module__}.{draw.__qualname__}"


def _checked(draw: Any) -> Any:
    """``draw`` (a subclass's own), its result checked by ``check_draw``."""

    @functools.wraps(draw)
    def checked_draw(self: Sampler, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int,
                     **kwargs: Any) -> Draw:
        return check_draw(self, draw(self, ring, tree, rng, k, **kwargs), ring, k)

    checked_draw.checked = True  # type: ignore[attr-defined]
    return checked_draw


def _who(sampler: Sampler) -> str:
    return drawn_by(sampler) or f"{type(sampler).__qualname__}.draw"


def check_draw(sampler: Sampler, got: Any, ring: RingView, k: int) -> Draw:
    """What a user's ``draw`` of ``k`` returned, checked once for every path: a ``Draw`` of at
    most ``k`` ids in a 1-D integer array (as int64), each ``INVALID`` or of a row pushed so far
    (``>= 0``, below its lane's cursor), and for a ``weighted`` sampler a leaf per id; else
    ``SamplerError`` naming the draw. Fewer ids than ``k`` is the draw's way to say it has no more
    rows to draw from (the reader says so)."""
    ids = getattr(got, "ids", None) if isinstance(got, tuple) else None
    leaves = got.leaves if ids is not None else None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] > k:
        what = (f"{type(got).__name__}" if ids is None else f"ids {type(ids).__name__}" if not isinstance(ids, np.ndarray)
                else f"ids of dtype {ids.dtype} and shape {ids.shape}")
        raise SamplerError(f"{_who(sampler)} returned {what} for a draw of {k}: expected Draw(ids) with a 1-D integer array of "
                           f"at most {k} row ids (fewer only when it has no more rows to draw from); fix the draw")
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)  # uint64 past int64's range turns negative: refused below
    if sampler.weighted or leaves is not None:
        if not isinstance(leaves, np.ndarray) or leaves.shape != ids.shape or leaves.dtype.kind != "f":
            shape = getattr(leaves, "shape", None)
            raise SamplerError(f"{_who(sampler)} returned leaves {type(leaves).__name__} of shape {shape} for {ids.shape[0]} "
                               "ids: expected one float leaf per id (the tree's, tree.leaves[ring.slots(ids)]), "
                               f"{'which its importance weights are made of' if sampler.weighted else 'or None'}")
        if leaves.dtype != np.float64:
            leaves = leaves.astype(np.float64)
    lanes = ring.lanes
    below = ring.span()[1] if lanes == 1 else None
    if below is None:
        stop = ring.bounds()[1]
        below = int(stop.min()) * lanes  # an id below it is a row pushed so far, whatever its lane
    if ids.size and not int(np.maximum.reduce(ids.view(np.uint64))) < below:  # negative ids are huge as uint64
        stop = ring.bounds()[1]
        bad = ids < 0
        ok = ~bad
        bad[ok] = ids[ok] // lanes >= stop[ids[ok] % lanes]
        bad &= ids != INVALID
        if bad.any():
            raise SamplerError(
                f"{_who(sampler)} returned ids that never named a row: {ids[bad][:5].tolist()} (at positions "
                f"{np.flatnonzero(bad)[:5].tolist()} of {ids.shape[0]}): expected row ids (number * lanes + lane, "
                f"each number below its lane's rows pushed so far, ring.bounds()), or INVALID for a draw to "
                "throw away; fix the draw")
    return tuple.__new__(Draw, (ids, leaves))


@dataclass(frozen=True)
class Uniform(Sampler):
    """Every committed row equally likely (``sample(n, replace=False)`` for distinct rows); under
    ``max_use`` every row with uses left (leaf 1 in the tree)."""

    kind: ClassVar[str] = "uniform"
    served: ClassVar[str | None] = "uniform"

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False,
    ) -> Draw:
        """``k`` ids (fewer when there are not enough rows): from the tree when there is one, else
        from the lanes' bounds; ``from_scan`` (rows kept failing the reader's check): from a scan of the
        committed rows. ``taken`` are left out when drawing distinct rows."""
        if tree is not None:
            return tree_draw(ring, tree, rng, k, stratified=not retry)
        if from_scan:
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

    def leaf(self, priorities: np.ndarray) -> np.ndarray:
        """The tree leaf of each priority, ``(p + eps) ** alpha`` (``inf`` where one overflows:
        the caller checks leaves against ``MAX_LEAF``). A subclass may give another leaf (clipped
        priorities, ``np.minimum(p, c) ** self.alpha``; a larger priority never a smaller leaf),
        with ``priority_of`` its inverse: the tree then holds its leaves, which every path draws
        and weights by."""
        return (priorities + self.eps) ** self.alpha

    def priority_of(self, leaves: np.ndarray) -> np.ndarray:
        """The priorities whose leaves these are, ``leaf ** (1 / alpha) - eps`` (0 for a leaf of 0,
        at most the largest float); all ones at ``alpha`` 0, where every leaf is 1."""
        leaves = np.asarray(leaves, dtype=np.float64)
        if self.alpha == 0:
            return np.ones_like(leaves)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            p = np.power(leaves, 1.0 / self.alpha) - self.eps
        # a leaf of the largest priorities may round back just past the largest float
        return np.where(leaves > 0, np.clip(p, 0.0, np.finfo(np.float64).max), 0.0)

    def beta_at(self, calls: int) -> float:
        """``beta`` after ``calls`` sample calls: linear from ``beta`` to 1 over ``beta_steps``."""
        if not self.beta_steps:
            return self.beta
        return self.beta + (1.0 - self.beta) * min(1.0, calls / self.beta_steps)

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False,
    ) -> Draw:
        """``k`` rows in proportion to their leaves, stratified on a first draw, plainly ``retry``
        (the reader re-draws a few rows); distinct rows are the reader's business."""
        assert tree is not None, "a prioritized buffer has a tree"
        return tree_draw(ring, tree, rng, k, stratified=not retry)

    def weights(self, tree: SumTree | None, leaves: np.ndarray | None, calls: int) -> np.ndarray | None:
        """Importance weights ``(leaf / min leaf) ** -beta`` with ``beta`` after ``calls`` samples."""
        assert tree is not None and leaves is not None
        lib = tree.lib
        if lib is not None and leaves.dtype == np.float64 and leaves.flags.c_contiguous and leaves.ndim == 1:
            out = np.empty(leaves.shape[0], np.float32)  # one C call; its pow agrees to 1 ulp of float32
            lib.weights(tree.mins, tree.plan, tree.capacity, leaves, self.beta_at(calls), out)
            return out
        return importance_weights(leaves, tree.min, self.beta_at(calls))



_BUILT_IN = {"uniform": (Uniform.draw, Sampler.weights), "tree": (Prioritized.draw, Prioritized.weights)}
"""``served``'s names and the draw and weights that a built-in path runs for them."""


def formula(sampler: Sampler) -> Prioritized | None:
    """``sampler`` when its leaves are ``Prioritized``'s own formula ``(p + eps) ** alpha`` (the
    shortcuts that rely on it: its overflow bound, the C update), else ``None``."""
    return cast(Prioritized, sampler) if sampler.prioritized and type(sampler).leaf is Prioritized.leaf else None


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


def sampler_from_json(spec: dict[str, Any], using: Any = None) -> Sampler:
    """The sampler that a sampler's ``to_json`` gave, by its kind (``SAMPLERS``). ``using``: the
    class the caller says it is (``ReplayBuffer.attach(..., sampler=)``; another kind raises
    ``UnknownSampler``), a module (imported: defining its classes registered their kinds), or
    ``Unimported``: a stand-in where no class of that kind is defined here (the command line reads
    such buffers). Without one, a kind no class of this process defines raises ``UnknownSampler``
    naming the class and its module."""
    spec = dict(spec)
    kind = spec.pop("kind", None)
    where = spec.pop("class", None)
    cls = SAMPLERS.get(kind) if isinstance(kind, str) else None
    if isinstance(using, type) and issubclass(using, Sampler) and not issubclass(using, Unimported):
        if cls is not using:
            raise UnknownSampler(f"the sampler is kind {kind!r}{_of(where)}, not {using.__qualname__}'s "
                                 f"({using.kind!r}): pass the class that defines kind {kind!r}")
    elif using is not None and not isinstance(using, types.ModuleType) and using is not Unimported:
        raise TypeError(f"sampler: expected the Sampler subclass of the buffer's sampler or the module that defines "
                        f"it, got {using!r}")
    if cls is None:
        if using is Unimported:
            return Unimported.of(kind, where, spec)
        if isinstance(using, types.ModuleType):
            raise UnknownSampler(f"module {using.__name__} defines no sampler of kind {kind!r}{_of(where)}; pass the "
                                 "module (or the class) that defines it")
        module = f"import {where['module']}" if _class_info(where) else "import the module that defines that Sampler subclass"
        raise UnknownSampler(
            f"sampler kind {kind!r} is not known in this process{_of(where)} (known: {sorted(SAMPLERS)}): {module} "
            "first (defining the class registers its kind), or pass it: ReplayBuffer.attach(name, sampler=TheClass)")
    return cls.from_json(spec)


def _class_info(where: Any) -> bool:
    return isinstance(where, dict) and isinstance(where.get("module"), str) and isinstance(where.get("name"), str)


def _of(where: Any) -> str:
    return f" (class {where['name']} of module {where['module']})" if _class_info(where) else ""


@dataclass(frozen=True)
class Unimported(Sampler):
    """A stand-in for a sampler whose class this process has not imported, so the buffer's rows
    can be read (the command line's ``inspect``, ``top`` and ``save``: the rows do not depend on
    the sampler): ``to_json`` gives the sampler's own JSON back, and a draw raises
    ``UnknownSampler`` naming its class and module. ``attach(name, sampler=Unimported)`` asks for it."""

    kind: ClassVar[str] = "(not imported)"

    spec: dict[str, Any] = field(default_factory=dict)
    """The sampler's JSON (``to_json``), kind and class included."""

    @staticmethod
    def of(kind: Any, where: Any, settings: dict[str, Any]) -> Sampler:
        """The stand-in for kind ``kind`` (class ``where``) with these settings: a prioritized
        one (``Prioritized``'s formulas over its alpha, beta and eps) when its class is."""
        spec = {"kind": kind, **({} if where is None else {"class": where}), **settings}
        if _class_info(where) and where.get("prioritized") is True:
            keep = {k: settings[k] for k in ("alpha", "beta", "beta_steps", "eps") if k in settings}
            return UnimportedPrioritized(**keep, spec=spec)
        return Unimported(spec)

    def to_json(self) -> dict[str, Any]:
        """The sampler's own JSON, as its process wrote it."""
        return dict(self.spec)

    def draw(
        self, ring: RingView, tree: SumTree | None, rng: np.random.Generator, k: int, *, replace: bool = True,
        taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False,
    ) -> Draw:
        """Refused: this process does not have the sampler's class."""
        where = self.spec.get("class")
        raise UnknownSampler(f"this buffer's sampler is kind {self.spec.get('kind')!r}{_of(where)}, not imported in "
                             "this process (attached with sampler=Unimported, to read its rows): import it, "
                             "or attach with sampler=TheClass, to sample")


@dataclass(frozen=True)
class UnimportedPrioritized(Prioritized):
    """``Unimported`` for a prioritized sampler: the tree is kept (and saved) as its process keeps it."""

    kind: ClassVar[str] = "(not imported, prioritized)"
    served: ClassVar[str | None] = None

    spec: dict[str, Any] = field(default_factory=dict)
    """The sampler's JSON (``to_json``), kind and class included."""

    to_json = Unimported.to_json
    draw = Unimported.draw


for _stand_in in (Unimported, UnimportedPrioritized):  # never built from a block's kind
    del SAMPLERS[_stand_in.kind]


def not_imported(sampler: Sampler) -> str | None:
    """For a stand-in (``Unimported``): which sampler it stands in for and what sampling it needs
    (what ``shmbuffer inspect`` says); ``None`` for any other sampler."""
    if not isinstance(sampler, (Unimported, UnimportedPrioritized)):
        return None
    where: Any = sampler.spec.get("class")
    module = where["module"] if _class_info(where) else "the module that defines it"
    return (f"kind {sampler.spec.get('kind')!r}{_of(where)}, not imported by this process: its rows read, inspect "
            f"and save as any buffer's; to sample it, import {module} (or attach(name, sampler=TheClass))")


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
