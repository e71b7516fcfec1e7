"""Observations stored once: next observations and frame stacks read from the lane.

Each env writes its own lane, in order (``ring.py``), so the observation after row ``n`` is the
observation of row ``n + 1`` of the same lane, and the older frames of a stacked observation are
the newest frames of the rows before it. A buffer made with ``next_of`` and/or ``stack``
(``ReplayBuffer(..., next_of="obs", stack="obs")``; cpprb's ``next_of`` and ``stack_compress``,
Stable-Baselines3's ``optimize_memory_usage``) stores them once. The user pushes and samples the
same fields, shapes and dtypes as without it; only the storage changes.

Storage (``Frames.stored``, ``layout.columns``)
-----------------------------------------------
* a ``next_of`` field (``next_obs``) has no storage: ``next_obs`` of row ``n`` is read from the
  source field (``obs``) of row ``n + 1``. An episode's last step (any of the ``ends`` fields —
  ``done``, ``terminated``, ``truncated``, ... — nonzero) is followed in its lane by an **end
  row** (kind ``END``) that holds its final observation (terminated or truncated alike, so
  timeouts bootstrap correctly). An end row takes a slot but is not a transition: it is never
  drawn (priority 0, and readers refuse it), ``len`` leaves it out, push returns no id for it.
* a ``stack`` field of ``k`` frames along ``axis`` stores one frame per row (its newest). A read
  rebuilds the stack from the rows before it in the lane back to the episode's first row (kind
  ``START``); older positions are padded as the env padded them, found from the pushed stack at
  the episode's first row: copies of the first frame (Gymnasium's ``FrameStackObservation``,
  ``padding_type="reset"``) or zeros (kind ``ZERO``; Stable-Baselines3's ``VecFrameStack``).
* ``_kind`` (``(capacity,)`` uint8) holds those bits, read with the row under its stamp check.
* a push with ``resume=True`` (``import_rows`` and ``from_arrays`` use it) may start a lane with a
  row whose stacks hold real older frames, not padding: an episode whose earlier steps this buffer
  does not hold (cut by lapping in the buffer it was exported from, or a collector restarted
  mid-episode). The older frames go into **lead rows** (kind ``LEAD``, the first also ``START``)
  before it: like end rows they take slots, are never drawn and are not counted.

Pushes (``Pusher``)
-------------------
A pushed row either continues its lane (this process wrote the lane's previous row and it did not
end its episode) or starts an episode. A continuing row's source must equal the previous row's
pushed next observation, and its stack's older frames the previous stack's newer ones; a starting
row's stack must be padding plus its newest frame. Anything else is refused before the buffer is
touched (``FieldError``). After the reservation the pusher checks that the rows really follow its
previous row (no other writer took the lane meanwhile), else it gives the rows back and raises. A
row that continues an episode in a lane cleared since (``clear()``) starts the lane again: its
stack's older frames go into lead rows, as with ``resume``, so no read reaches the cleared rows.

Reads (``window``, ``center``, ``stack_plan``)
----------------------------
A transition read for row ``n`` uses the rows ``n - k + 1 .. n + 1`` of its lane, each under its
own stamp check (``reader.gather``): row ``n`` intact and not an end row; row ``n + 1`` intact
and not the start of another episode; every row a stack uses intact, inside the lane's rows and
of the episode (no end row before the episode's start). A row that fails any of these is not
intact for the reader, which re-draws it — a transition is never assembled from mixed rows. The
newest row of a lane is not a transition yet (its next observation has not been pushed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FieldError, SchemaError
from .schema import Record, Schema

KIND = "_kind"
END = 1
"""the row holds an episode's final observation (``next_of``), not a transition"""
START = 2
"""the row is its episode's first"""
ZERO = 4
"""with ``START``: the episode's stacks are padded with zeros, not with its first frame"""
LEAD = 8
"""the row holds an older frame of a resumed episode's first pushed stack (``push(resume=True)``),
not a transition"""

ENDS = ("done", "dones", "terminated", "terminal", "terminals", "truncated", "truncation", "timeout", "timeouts")
"""Fields that mark an episode's last step when nonzero."""


@dataclass(frozen=True)
class Stack:
    """A field stored as single frames and rebuilt as a stack of ``k`` of them along ``axis`` on read."""
    name: str
    k: int
    axis: int
    """axis of the field's shape (not counting the row dimension), normalised to >= 0"""
    width: int
    """one frame's extent along ``axis``"""


@dataclass(frozen=True)
class Frames:
    """Which fields are stored once (see the module docstring)."""

    next_of: tuple[tuple[str, str], ...] = ()
    """``(next field, source field)`` pairs"""
    stack: tuple[Stack, ...] = ()
    ends: tuple[str, ...] = ()

    @classmethod
    def make(cls, schema: Schema, next_of: Any, stack: Any) -> Frames | None:
        """Check ``next_of`` (``"obs"`` for ``next_obs``, or ``{"next_obs": "obs"}``) and ``stack``
        (``"obs"``: its first axis holds the frames, or ``{"obs": k}``, ``{"obs": (k, axis)}``)
        against ``schema``; ``None`` when neither is given."""
        if next_of is None and stack is None:
            return None
        pairs: list[tuple[str, str]] = []
        if next_of is not None:
            items = [(f"next_{next_of}", next_of)] if isinstance(next_of, str) else (
                list(next_of.items()) if isinstance(next_of, Mapping) else None)
            if not items:
                raise SchemaError(f"next_of: expected a field name or {{next field: field}}, got {next_of!r}")
            for nxt, src in items:
                for name in (nxt, src):
                    if name not in schema:
                        raise SchemaError(f"next_of: no field {name!r}; the schema has {', '.join(schema.names)}")
                if schema[nxt].shape != schema[src].shape or schema[nxt].dtype != schema[src].dtype:
                    raise SchemaError(
                        f"next_of: field {nxt!r} is {schema[nxt].describe()} but {src!r} is {schema[src].describe()}; "
                        "the next observation must have the observation's shape and dtype")
                pairs.append((nxt, src))
            if len({n for n, _ in pairs} | {s for _, s in pairs}) < 2 * len(pairs):
                raise SchemaError(f"next_of: each field may appear once, got {next_of!r}")
        stacks: list[Stack] = []
        if stack is not None:
            spec = {stack: None} if isinstance(stack, str) else dict(stack) if isinstance(stack, Mapping) else None
            if not spec:
                raise SchemaError(f"stack: expected a field name or {{field: frames}}, got {stack!r}")
            for name, how in spec.items():
                stacks.append(_stack(schema, name, how))
            for nxt, _ in pairs:
                if any(s.name == nxt for s in stacks):
                    raise SchemaError(f"stack: {nxt!r} is read from the lane (next_of); stack its source instead")
        ends = tuple(n for n in ENDS if n in schema)
        if not ends:
            raise SchemaError(
                f"next_of/stack need a field that marks an episode's last step ({', '.join(ENDS[:6])}, ...); "
                f"the schema has {', '.join(schema.names)}")
        for name in ends:
            f = schema[name]
            if f.shape not in ((), (1,)):
                raise SchemaError(f"field {name!r} marks episode ends: expected shape () or (1,), got {f.shape}")
        return cls(tuple(pairs), tuple(stacks), ends)

    @property
    def depth(self) -> int:
        """Rows before a transition's own that a read may use."""
        return max([s.k for s in self.stack] + [1]) - 1

    @property
    def ahead(self) -> int:
        """Rows a lane keeps ahead of its newest transition: 1 with ``next_of`` (its next row holds ``next_obs``),
        else 0."""
        return 1 if self.next_of else 0

    def stacked(self, name: str) -> Stack | None:
        """The ``Stack`` of field ``name``, or ``None`` if it is not stacked."""
        return next((s for s in self.stack if s.name == name), None)

    @property
    def rebuilt(self) -> tuple[str, ...]:
        """The user's fields a read builds from several rows."""
        return tuple(s.name for s in self.stack) + tuple(n for n, _ in self.next_of)

    def stored(self, schema: Schema) -> Schema:
        """The schema of what a row stores: stacked fields one frame wide, next fields gone."""
        gone = {n for n, _ in self.next_of}
        out: dict[str, tuple[tuple[int, ...], Any]] = {}
        for f in schema:
            if f.name in gone:
                continue
            s = self.stacked(f.name)
            shape = f.shape if s is None else (*f.shape[:s.axis], s.width, *f.shape[s.axis + 1:])
            out[f.name] = (shape, f.dtype)
        return Schema(**out)

    def served(self, record: Record) -> Record:
        """``record`` without the stacked fields: what a read takes from the row's own record."""
        names = [n for n in record.offsets if self.stacked(n) is None]
        fields: dict[str, Any] = dict(record.dtype.fields or {})
        dtype = np.dtype({"names": names, "formats": [fields[n][0] for n in names],
                          "offsets": [record.offsets[n] for n in names], "itemsize": record.dtype.itemsize})
        return Record(record.itemsize, {n: record.offsets[n] for n in names}, dtype)

    def to_json(self) -> dict[str, Any]:
        """As JSON, for the block's metadata and saves."""
        return {"next_of": [list(p) for p in self.next_of],
                "stack": [[s.name, s.k, s.axis, s.width] for s in self.stack], "ends": list(self.ends)}

    def arguments(self) -> dict[str, Any]:
        """The ``ReplayBuffer`` arguments that make this."""
        return {"next_of": dict(self.next_of) or None,
                "stack": {s.name: (s.k, s.axis) for s in self.stack} or None}

    def check(self, schema: Schema) -> None:
        """Refuse (``SchemaError``) a spec read back from a block or a save that ``schema`` would not give."""
        if Frames.make(schema, **self.arguments()) != self:
            raise SchemaError(f"frames {self.to_json()} do not fit the schema {schema}")

    @classmethod
    def from_json(cls, spec: dict[str, Any] | None) -> Frames | None:
        """The ``Frames`` that ``to_json`` gave (``None`` for none)."""
        if not spec:
            return None
        return cls(tuple((str(a), str(b)) for a, b in spec["next_of"]),
                   tuple(Stack(str(n), int(k), int(ax), int(w)) for n, k, ax, w in spec["stack"]),
                   tuple(str(e) for e in spec["ends"]))


def _stack(schema: Schema, name: str, how: Any) -> Stack:
    if name not in schema:
        raise SchemaError(f"stack: no field {name!r}; the schema has {', '.join(schema.names)}")
    shape = schema[name].shape
    if not shape:
        raise SchemaError(f"stack: field {name!r} is a scalar; a stack needs an axis of frames")
    if how is None:
        k, axis = shape[0], 0
    elif isinstance(how, (int, np.integer)) and not isinstance(how, bool):
        k, axis = int(how), 0
    elif isinstance(how, tuple) and len(how) == 2:
        k, axis = int(how[0]), int(how[1])
    else:
        raise SchemaError(f"stack: field {name!r}: expected frames k or (k, axis), got {how!r}")
    if not -len(shape) <= axis < len(shape):
        raise SchemaError(f"stack: field {name!r} has shape {shape}: no axis {axis}")
    axis %= len(shape)
    if k < 2 or shape[axis] % k:
        raise SchemaError(
            f"stack: field {name!r} has {shape[axis]} along axis {axis}: expected 2 or more frames that divide it, got {k}")
    return Stack(name, k, axis, shape[axis] // k)


# -- reads ----------------------------------------------------------------------------------------
def window(spec: Frames, anchors: np.ndarray, lanes: int, start: np.ndarray, stop: np.ndarray,
           invalid: int) -> np.ndarray:
    """Ids of the rows ``anchor - depth .. anchor + ahead`` of each anchor's lane, ``(m, W)``;
    ``invalid`` where a row is outside its lane's rows now (or the anchor is ``invalid``)."""
    offsets = np.arange(-spec.depth, spec.ahead + 1)
    bad = anchors == invalid
    anchors = np.where(bad, 0, anchors)
    lane = anchors % lanes
    rows = (anchors // lanes)[:, None] + offsets[None, :]
    inside = (rows >= start[lane][:, None]) & (rows < stop[lane][:, None])
    ids = rows * lanes + lane[:, None]
    ids[~inside | bad[:, None]] = invalid
    return ids


def center(spec: Frames, ok: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """Which transitions can be read as far as their own rows go, from the window rows' stamp
    checks ``ok`` and kinds ``kind`` (both ``(m, W)``): row ``n`` intact and not an end or lead row, row
    ``n + 1`` (with ``next_of``) intact and not another episode's start. Each stack adds its own
    conditions (``stack_plan``)."""
    c = spec.depth
    valid = ok[:, c] & (kind[:, c] & (END | LEAD) == 0)
    if spec.ahead:
        valid &= ok[:, c + 1] & (kind[:, c + 1] & START == 0)
    return valid


def stack_columns(spec: Frames, s: Stack) -> dict[str, int]:
    """The window column of the newest frame of each stack a read of ``s`` builds: ``s.name``
    for the observation, ``"next:" + s.name`` for the next one (with ``next_of``)."""
    c = spec.depth
    sources = {src for _, src in spec.next_of}
    return {s.name: c, **({"next:" + s.name: c + 1} if s.name in sources else {})}


def stack_plan(ok: np.ndarray, kind: np.ndarray, last: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window columns of the ``k`` frames of a stack whose newest frame is column ``last``
    (chronological), which of them are zeros, and whether the real ones can be read. Going back
    from ``last``, frames are real up to and including the first row that starts an episode;
    older ones are padding, copies of that first row's frame (or zeros where it says so)."""
    back = np.arange(last, last - k, -1)  # column of the frame j back from the newest
    kinds = kind[:, back]
    begins = kinds & START != 0
    started = np.zeros_like(begins)  # an episode began at a newer frame than j
    np.logical_or.accumulate(begins[:, :-1], axis=1, out=started[:, 1:])
    real = ~started
    first = back[np.argmax(begins, axis=1)]  # the episode's first row (used only where one began)
    fine = (started | (ok[:, back] & (kinds & END == 0)))[:, 1:].all(axis=1)
    cols = np.where(real, back, first[:, None])[:, ::-1]
    firsts_zero = kind[np.arange(kind.shape[0]), first] & ZERO != 0
    zero = (started & firsts_zero[:, None])[:, ::-1]
    return np.ascontiguousarray(cols), np.ascontiguousarray(zero), fine


def assemble(s: Stack, frames: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Stacks from frames ``(m, k, *frame)`` (chronological), in the field's layout."""
    m = frames.shape[0]
    if s.axis == 0:  # the frames are the stack's rows already: a view
        stacked = frames.reshape(m, s.k * s.width, *frames.shape[3:])
        if out is None:
            return stacked
        out.reshape(stacked.shape)[...] = stacked
        return out
    moved = np.moveaxis(frames, 1, 1 + s.axis)  # (m, ..., k, width, ...)
    shape = moved.shape
    full = (*shape[:1 + s.axis], s.k * s.width, *shape[3 + s.axis:])
    if out is None:
        return moved.reshape(full) if s.axis == 0 else np.ascontiguousarray(moved).reshape(full)
    out.reshape(m, *full[1:])[...] = moved.reshape(full)
    return out


def frames_of(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The frames ``(m, k, *frame)`` of stacks in the field's layout (the inverse of ``assemble``)."""
    m = stacks.shape[0]
    shape = stacks.shape[1:]
    split = (*shape[:s.axis], s.k, s.width, *shape[s.axis + 1:])
    return np.moveaxis(stacks.reshape(m, *split), 1 + s.axis, 1)


# -- pushes ---------------------------------------------------------------------------------------
def _at(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]``, a view when ``rows`` are consecutive (the usual push: one env's steps)."""
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and (rows.size < 3 or (np.diff(rows) == 1).all()):
        return a[int(rows[0]):int(rows[-1]) + 1]
    return a[rows]


def _older(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The older ``k - 1`` frames of each stack, in the field's layout (a view)."""
    at = [slice(None)] * stacks.ndim
    at[1 + s.axis] = slice(0, (s.k - 1) * s.width)
    return stacks[tuple(at)]


def _newer(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The newer ``k - 1`` frames of each stack, in the field's layout (a view)."""
    at = [slice(None)] * stacks.ndim
    at[1 + s.axis] = slice(s.width, None)
    return stacks[tuple(at)]


def _first_unequal(a: np.ndarray, b: np.ndarray, rows: np.ndarray) -> int | None:
    """The first of ``rows`` whose ``a`` and ``b`` rows differ (bit for bit), or ``None``."""
    if not rows.size:
        return None
    same = (_bits(a) == _bits(b)).reshape(rows.size, -1).all(axis=1)
    if same.all():
        return None
    return int(rows[np.flatnonzero(~same)[0]])


def _bits(a: np.ndarray) -> np.ndarray:
    """Floats as unsigned ints of their size: compared bit for bit (what a read gives back), so
    ``-0.0`` is not ``0.0`` and a NaN equals itself."""
    if a.dtype.kind == "f" and a.dtype.itemsize in (2, 4, 8):
        return a.view(np.dtype(f"u{a.dtype.itemsize}"))
    return a


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(_bits(a), _bits(b)))


def _lane(lanes: dict[int, int], row: int) -> str:
    return f" (lane {lanes[row]})" if row in lanes else ""

@dataclass
class Last:
    """What this process pushed last into a lane."""

    row: int
    final: bool
    episode: int | None
    values: dict[str, np.ndarray]
    """the last row's pushed stacks and next observations, to check the row that follows"""


@dataclass
class Expanded:
    """A push as stored: ``arrays`` of the stored schema plus ``_kind``, ``lanes`` one per stored
    row, ``episodes`` (or ``None``), ``rows`` the positions of the pushed transitions among them,
    and per lane the first stored position and whether it continues this process's last row;
    ``restarted`` the lanes it starts again after a ``clear()`` (lead rows)."""

    arrays: dict[str, np.ndarray]
    lanes: np.ndarray
    episodes: np.ndarray | None
    rows: np.ndarray
    firsts: dict[int, tuple[int, bool]]
    lasts: dict[int, Last]
    restarted: frozenset[int] = frozenset()


class Pusher:
    """One process's memory of the rows it pushed last into each lane (the module docstring)."""

    def __init__(self, spec: Frames, schema: Schema, stored: Schema) -> None:
        self.spec, self.schema, self.stored = spec, schema, stored
        self.last: dict[int, Last] = {}
        self.pid = os.getpid()

    def expand(self, arrays: dict[str, np.ndarray], k: int, lane: int | np.ndarray, episodes: np.ndarray | None,
               bounds: tuple[np.ndarray, np.ndarray], resume: bool = False) -> Expanded:
        """Check a push of ``k`` checked rows and lay it out as stored rows (nothing is touched).
        The walk over the rows decides which continue which; the data checks then run on all the
        rows at once. With ``resume`` a row that starts an episode may hold real older frames:
        they go into lead rows before it (the module docstring)."""
        spec = self.spec
        if self.pid != os.getpid():  # a forked child: the parent's rows are not this process's
            self.last, self.pid = {}, os.getpid()
        lanes = np.full(k, lane, np.int64) if not isinstance(lane, np.ndarray) else lane
        eps = None if episodes is None else np.broadcast_to(episodes, (k,))
        full = {n: np.broadcast_to(a, (k, *self.schema[n].shape)) for n, a in arrays.items()}
        final = np.zeros(k, bool)
        for name in spec.ends:
            final |= full[name].reshape(k) != 0
        nexts = bool(spec.next_of)
        start_, stop_ = bounds
        kinds = np.zeros(k, np.uint8)
        firsts: dict[int, tuple[int, bool]] = {}
        prev_of: dict[int, int] = {}
        inside: list[tuple[int, int]] = []  # (row, the row of this push it continues)
        remembered: list[tuple[int, int, Last]] = []  # (row, lane, this process's last row it continues)
        starts: list[tuple[int, int]] = []  # (row, lane) that start an episode, or a lane again
        cleared: set[int] = set()  # rows that continue an episode in a lane cleared since
        lane_list, final_list = lanes.tolist(), final.tolist()
        eps_list = None if eps is None else eps.tolist()
        for i in range(k):
            ln = lane_list[i]
            p = prev_of.get(ln)
            if p is None:
                last = self.last.get(ln)
                # the lane's newest row is this process's last; a clear() since then moves the
                # lane's cursor up to a lane boundary and the lane reads as empty until the next
                # push, which starts the lane again: its older frames go into lead rows (as with
                # resume), so its stacks never reach the cleared rows
                cont = (last is not None and not last.final
                        and (last.row == stop_[ln] - 1 or (start_[ln] == stop_[ln] and last.row < stop_[ln]))
                        and (eps_list is None or last.episode == eps_list[i]))
                if cont and last is not None:
                    remembered.append((i, ln, last))
                    if start_[ln] == stop_[ln]:
                        cleared.add(i)
                firsts[ln] = (i, cont)
            else:
                cont = not final_list[p] and (eps_list is None or eps_list[p] == eps_list[i])
                if cont:
                    inside.append((i, p))
            if not cont or i in cleared:
                starts.append((i, ln))
            prev_of[ln] = i
        self._check(full, inside, remembered)
        depth = max((st.k for st in spec.stack), default=1) - 1
        lead = np.zeros(k, np.int64)  # lead rows before each row (resume)
        for i, ln in starts:
            try:
                kinds[i] = START | self._padding(full, i, ln)
            except FieldError:
                if not resume and i not in cleared:
                    raise
                lead[i] = depth  # an episode resumed: its older frames go into lead rows
        # stored rows per pushed row i: its lead rows, the row, the end row after it (next_of)
        ends_after = final & nexts
        count = lead + 1 + ends_after
        begin = np.concatenate([[0], np.cumsum(count)[:-1]])
        src_row = np.repeat(np.arange(k), count)
        offset = np.arange(int(count.sum())) - begin[src_row]  # position in the row's group
        is_lead = offset < lead[src_row]
        is_end = offset > lead[src_row]
        at = begin + lead  # the pushed rows' stored positions
        firsts = {ln: (int(begin[i]), cont) for ln, (i, cont) in firsts.items()}
        lasts = {ln: Last(-1, final_list[i], None if eps_list is None else eps_list[i],  # copies: the caller
                          {n: a.copy() for n, a in self._values(full, i).items()})  # may reuse its arrays
                 for ln, i in prev_of.items()}
        sources = {src: nxt for nxt, src in spec.next_of}
        out: dict[str, np.ndarray] = {}
        for f in self.stored:
            a = full[f.name]
            s = spec.stacked(f.name)
            if s is not None:
                a = frames_of(s, a)[:, -1]  # the newest frame
            col = np.ascontiguousarray(a[src_row])
            if is_end.any():
                if f.name in sources:
                    b = full[sources[f.name]][src_row[is_end]]
                    col[is_end] = frames_of(s, b)[:, -1] if s is not None else b
                else:
                    col[is_end] = 0
            if is_lead.any():
                if s is not None:  # lead row j of a group holds frame j - (depth - (k - 1)), the oldest at least
                    pick = np.maximum(offset[is_lead] - (depth - (s.k - 1)), 0)
                    col[is_lead] = frames_of(s, full[f.name][src_row[is_lead]])[np.arange(pick.size), pick]
                else:
                    col[is_lead] = 0
            out[f.name] = col
        kind = kinds[src_row]
        kind[is_end] = END
        kind[is_lead] = LEAD
        kind[begin[lead > 0]] |= START
        out[KIND] = kind
        return Expanded(out, lanes[src_row], None if eps is None else np.ascontiguousarray(eps[src_row]),
                        at, firsts, lasts, frozenset(lane_list[i] for i in cleared))

    def _values(self, full: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
        keep = {s.name for s in self.spec.stack} | {n for n, _ in self.spec.next_of}
        return {n: full[n][i] for n in keep}

    def _check(self, full: dict[str, np.ndarray], inside: list[tuple[int, int]],
               remembered: list[tuple[int, int, Last]]) -> None:
        """Refuse the push unless each continuing row continues its previous row (a row of this
        push, ``inside``, or this process's last row of the lane, ``remembered``), and, with a
        stacked next observation, unless every row's next stack is its stack a frame on."""
        spec = self.spec
        sources = {src: nxt for nxt, src in spec.next_of}
        rows = np.array([i for i, _ in inside], np.int64)
        prevs = np.array([p for _, p in inside], np.int64)
        lanes = {i: ln for i, ln, _ in remembered}
        for src, nxt in sources.items():
            bad = _first_unequal(_at(full[src], rows), _at(full[nxt], prevs), rows)
            for i, _, last in remembered:
                if not _same(full[src][i], last.values[nxt]):
                    bad = i if bad is None else min(bad, i)
            if bad is not None:
                raise FieldError(
                    f"field {src!r}: row {bad}{_lane(lanes, bad)} does not continue the lane's previous row: its "
                    f"{src} differs from that row's {nxt} (next_of={src!r} stores it once). Push each env's "
                    "steps in order into its own lane, and mark an episode's last step with done/terminated/truncated")
        for s in spec.stack:
            if s.name in sources:
                nxt = sources[s.name]
                every = np.arange(full[s.name].shape[0])
                bad = _first_unequal(_older(s, full[nxt]), _newer(s, full[s.name]), every)
                if bad is not None:
                    raise FieldError(
                        f"field {nxt!r}: row {bad}: its older frames differ from the newer frames of its "
                        f"{s.name}; the next observation must be the stack after the step")
                continue  # the stacks themselves were checked whole above
            bad = _first_unequal(_older(s, _at(full[s.name], rows)), _newer(s, _at(full[s.name], prevs)), rows)
            for i, _, last in remembered:
                if not _same(_older(s, full[s.name][i][None]), _newer(s, last.values[s.name][None])):
                    bad = i if bad is None else min(bad, i)
            if bad is not None:
                raise FieldError(
                    f"field {s.name!r}: row {bad}{_lane(lanes, bad)}: its older {s.k - 1} frames differ from the "
                    "lane's previous rows (stack= stores one frame a row). Push each env's steps in order into its "
                    "own lane, and mark an episode's last step with done/terminated/truncated")

    def _padding(self, full: dict[str, np.ndarray], i: int, lane: int) -> int:
        """``ZERO`` or 0 for a row that starts an episode, from how its stacks are padded."""
        zero = None
        for s in self.spec.stack:
            fr = frames_of(s, full[s.name][i][None])[0]
            older, newest = fr[:-1], fr[-1]
            if not newest.any() and not older.any():
                continue  # zeros padded with zeros or with copies of itself: either reads the same
            if all(np.array_equal(o, newest) for o in older):
                got = False
            elif not older.any():
                got = True
            else:
                raise FieldError(
                    f"field {s.name!r}: row {i} starts an episode in lane {lane} (this process has no earlier row "
                    "of it there, or the previous one ended its episode), but its older frames are neither copies "
                    "of its newest frame (Gymnasium's FrameStackObservation) nor zeros (SB3's VecFrameStack). "
                    "Push an episode's steps in order from its first, each env into its own lane")
            if zero is not None and got != zero:
                raise FieldError(f"field {s.name!r}: row {i}: stacked fields are padded differently")
            zero = got if zero is None else zero
        return ZERO if zero else 0

    def confirm(self, ex: Expanded, n: np.ndarray, base: np.ndarray) -> tuple[str, bool] | None:
        """After the reservation (``n``: the stored rows' row numbers): ``None`` when every lane's
        first row continues what this process expected, else why not, and whether the push may
        simply be checked again (a lane cleared since ``expand`` looked); the caller gives the rows
        back, then checks again or raises."""
        for ln, (at, cont) in ex.firsts.items():
            last = self.last.get(ln)
            # the row after this process's last, or the lane's first after a clear() that came since
            first = int(n[at]) == int(base[ln])
            follows = last is not None and (int(n[at]) == last.row + 1 or (first and last.row < int(n[at])))
            if cont and not follows:
                return (f"lane {ln}: another writer pushed into it between this process's rows; with next_of/stack "
                        "each lane must be written by one process at a time"), False
            if cont and first and ln not in ex.restarted:  # cleared after expand looked: no lead rows
                return (f"lane {ln} was cleared (clear()) each time this push was being checked; nothing was "
                        "stored: push the same rows again"), True
        return None

    def done(self, ex: Expanded, n: np.ndarray) -> None:
        """After the commit: remember each lane's last row."""
        for ln, last in ex.lasts.items():
            at = np.flatnonzero(ex.lanes == ln)
            last.row = int(n[at[-1]])
            self.last[ln] = last
