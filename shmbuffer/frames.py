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

Pushes: ``protocol/frames_push.py`` checks frames pushes and lays them out as stored (``Pusher``).

Reads (``center``, ``stack_plan``; the window's ids are ``protocol/rows.window``'s)
----------------------------
A transition read for row ``n`` uses the rows ``n - k + 1 .. n + 1`` of its lane, each under its
own stamp check (``gather.gather``): row ``n`` intact and not an end row; row ``n + 1`` intact
and not the start of another episode; every row a stack uses intact, inside the lane's rows and
of the episode (no end row before the episode's start). A row that fails any of these is not
intact for the reader, which re-draws it — a transition is never assembled from mixed rows. The
newest row of a lane is not a transition yet (its next observation has not been pushed).
"""

from __future__ import annotations

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
    """How a row is stored and read: which fields are stored once (see the module docstring). The
    empty one (``PLAIN``, ``Frames()``) is the rows variant of a buffer without ``next_of``/``stack``:
    each row stores all its fields, ``stored`` and ``served`` give back what they get. Every buffer
    has one (``Options.rows``); callers ask it rather than whether there is one."""

    next_of: tuple[tuple[str, str], ...] = ()
    """``(next field, source field)`` pairs"""
    stack: tuple[Stack, ...] = ()
    ends: tuple[str, ...] = ()

    @classmethod
    def make(cls, schema: Schema, next_of: Any, stack: Any) -> Frames:
        """Check ``next_of`` (``"obs"`` for ``next_obs``, or ``{"next_obs": "obs"}``) and ``stack``
        (``"obs"``: its first axis holds the frames, or ``{"obs": k}``, ``{"obs": (k, axis)}``)
        against ``schema``; ``PLAIN`` when neither is given."""
        if next_of is None and stack is None:
            return PLAIN
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
    def once(self) -> bool:
        """Whether some field is stored once (read from the lane): the rows are not whole in memory, a read
        assembles transitions, a row has a kind (``KIND``) and a lane holds rows that are not transitions."""
        return bool(self.next_of or self.stack)

    @property
    def depth(self) -> int:
        """Rows before a transition's own that a read may use."""
        return max([s.k for s in self.stack] + [1]) - 1

    @property
    def ahead(self) -> int:
        """Rows a lane keeps ahead of its newest transition: 1 with ``next_of`` (its next row holds ``next_obs``),
        else 0."""
        return 1 if self.next_of else 0

    @property
    def last_apart(self) -> bool:
        """Whether an episode run's last row in a lane is not a transition (``next_of``: its end row, or a
        row whose next observation is not pushed yet): sequences and hindsight stop one row before it."""
        return bool(self.next_of)

    def whole(self, what: str, instead: str) -> None:
        """Refuse (``FieldError``) ``what``, which needs rows whole in memory, when fields are stored once."""
        if self.once:
            raise FieldError(f"{what}: the buffer stores {', '.join(self.rebuilt)} once for several rows "
                             f"(next_of/stack), so its rows are not whole in memory; {instead}")

    def steps(self, lane_capacity: int) -> int:
        """The most steps a push into one lane of ``lane_capacity`` slots can always take: half of it
        when fields are stored once (each step may take an end or lead row too)."""
        return max(1, lane_capacity // 2) if self.once else lane_capacity

    def stacked(self, name: str) -> Stack | None:
        """The ``Stack`` of field ``name``, or ``None`` if it is not stacked."""
        return next((s for s in self.stack if s.name == name), None)

    @property
    def rebuilt(self) -> tuple[str, ...]:
        """The user's fields a read builds from several rows."""
        return tuple(s.name for s in self.stack) + tuple(n for n, _ in self.next_of)

    def stored(self, schema: Schema) -> Schema:
        """The schema of what a row stores: stacked fields one frame wide, next fields gone."""
        if not self.once:
            return schema
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
        if not self.once:
            return record
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
    def from_json(cls, spec: dict[str, Any] | None) -> Frames:
        """The ``Frames`` that ``to_json`` gave (``PLAIN`` for none)."""
        if not spec:
            return PLAIN
        return cls(tuple((str(a), str(b)) for a, b in spec["next_of"]),
                   tuple(Stack(str(n), int(k), int(ax), int(w)) for n, k, ax, w in spec["stack"]),
                   tuple(str(e) for e in spec["ends"]))


PLAIN = Frames()
"""The rows variant of a buffer without ``next_of``/``stack``."""


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


def transitions(spec: Frames, kind: np.ndarray) -> np.ndarray:
    """Which of a lane's rows are transitions as far as their kinds and the lane's bounds go:
    ``kind`` holds the kinds of the lane's held rows, oldest first. What ``center`` and
    ``stack_plan`` say of a read whose rows are all intact: not an end or lead row; with
    ``next_of`` not the lane's newest row, nor a row followed by another episode's start (its
    episode stopped without its end row: it has no next observation); with ``stack`` no stack that
    reaches back past the lane's oldest row (its episode's start lapped or cleared). ``len`` and
    ``get``'s positions count these (``reader.counted_ids``, ``reader.held``)."""
    ok = kind & (END | LEAD) == 0
    if spec.ahead and kind.size:
        ok[-1] = False
        ok[:-1] &= kind[1:] & START == 0
    if spec.depth:
        at = np.arange(kind.size)
        start = np.where(kind & START != 0, at, -1)
        np.maximum.accumulate(start, out=start)  # the latest episode start at or before each row
        ok &= (start >= 0) | (at >= spec.depth)
    return ok


KINDS = (0, START, START | ZERO, END, LEAD, LEAD | START)
"""The kinds a row can have: a step, an episode's first step (padded with copies or with zeros), an end
row, a lead row (the first of a resumed episode's)."""


def misplaced(spec: Frames, slots: np.ndarray, there: np.ndarray, fields: Mapping[str, np.ndarray]
              ) -> tuple[int, str] | None:
    """The first of a lane's rows (its ``slots``, oldest first; ``there``: held; ``fields``: the stored
    columns, ``KIND`` included) whose kind breaks a rule every reader trusts, and the rule (``{row}``,
    ``{next}``, ``{lane}`` to fill in); ``None`` if all hold. The rules: only ``KINDS``; with
    ``next_of`` an episode's last step is followed by its end row (or by another episode's start:
    then it is no transition), and an end row follows a step; the row after an episode's end (its
    end row, or its last step without ``next_of``) starts an episode."""
    kind = fields[KIND][slots]
    if (odd := ~np.isin(kind, KINDS)).any():
        at = int(np.flatnonzero(odd)[0])
        return at, f"holds {int(kind[at])} at row {{row}} of lane {{lane}}, expected one of {sorted(KINDS)}"
    step = there & ((kind & (END | LEAD)) == 0)
    final = np.zeros(kind.size, bool)
    for name in spec.ends:
        if name in fields:
            final |= fields[name][slots].reshape(kind.size) != 0
    final &= step
    pair = there[:-1] & there[1:]  # two rows in a row, both held
    end = there & ((kind & END) != 0)
    ended = end if spec.next_of else final
    begins = (kind & START) != 0
    # a last step followed by another episode's start is no transition (it has no next
    # observation, ``transitions``): a lane's waiting step ended by update, SB3's truncation
    if spec.next_of and (bad := pair & final[:-1] & ~end[1:] & ~begins[1:]).any():
        why = "an episode's last step is not followed by its end row"
    elif spec.next_of and (bad := pair & end[1:] & ~step[:-1]).any():
        why = "an end row does not follow a step"
    elif (bad := pair & ended[:-1] & ~begins[1:]).any():
        why = "the row after an episode's end does not start an episode"
    else:
        return None
    at = int(np.flatnonzero(bad)[0])
    return at, f"at rows {{row}}-{{next}} of lane {{lane}}: {why}"


def stack_columns(spec: Frames, s: Stack) -> dict[str, int]:
    """The window column of the newest frame of each stack a read of ``s`` builds, by the field it
    fills: ``s.name`` for the observation, its ``next_of`` field for the next one."""
    c = spec.depth
    return {s.name: c, **{nxt: c + 1 for nxt, src in spec.next_of if src == s.name}}


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


def assemble(s: Stack, frames: Any, out: np.ndarray | None = None) -> Any:
    """Stacks from frames ``(m, k, *frame)`` (chronological), in the field's layout: numpy arrays,
    or torch tensors (the device copy's reads; without ``out``)."""
    m = frames.shape[0]
    if s.axis == 0:  # the frames are the stack's rows already: a view
        stacked = frames.reshape(m, s.k * s.width, *frames.shape[3:])
        if out is None:
            return stacked
        out.reshape(stacked.shape)[...] = stacked
        return out
    moved = np.moveaxis(frames, 1, 1 + s.axis) if isinstance(frames, np.ndarray) else frames.movedim(1, 1 + s.axis)
    shape = moved.shape  # (m, ..., k, width, ...)
    full = (*shape[:1 + s.axis], s.k * s.width, *shape[3 + s.axis:])
    if out is None:  # numpy: a contiguous array (a reshape alone can give a strided view: width 1)
        return (np.ascontiguousarray(moved) if isinstance(moved, np.ndarray) else moved).reshape(full)
    out.reshape(m, *full[1:])[...] = moved.reshape(full)
    return out


def frames_of(s: Stack, stacks: np.ndarray) -> np.ndarray:
    """The frames ``(m, k, *frame)`` of stacks in the field's layout (the inverse of ``assemble``)."""
    m = stacks.shape[0]
    shape = stacks.shape[1:]
    split = (*shape[:s.axis], s.k, s.width, *shape[s.axis + 1:])
    return np.moveaxis(stacks.reshape(m, *split), 1 + s.axis, 1)
