"""The push of a buffer that stores observations once (``next_of``/``stack``, ``frames.py``):
the rows as stored (``Pusher.expand``: end rows, lead rows, episode starts and padding) and the
check that each row continues its lane; ``push.py`` runs the rest of the push.

A pushed row either continues its lane (this process wrote the lane's previous row and it did not
end its episode) or starts an episode. A continuing row's source must equal the previous row's
pushed next observation, and its stack's older frames the previous stack's newer ones; a starting
row's stack must be padding plus its newest frame. Anything else is refused before the buffer is
touched (``FieldError``). After the reservation the pusher checks that the rows really follow its
previous row (no other writer took the lane meanwhile), else it gives the rows back and raises. A
row that continues an episode in a lane cleared since (``clear()``) starts the lane again: its
stack's older frames go into lead rows, as with ``resume``, so no read reaches the cleared rows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FieldError
from ..frames import END, KIND, LEAD, START, ZERO, Frames, Stack, frames_of
from ..schema import Schema

__all__ = ["Expanded", "Last", "Pusher", "end_rows", "last_of_lanes"]


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


def last_of_lanes(lanes: np.ndarray) -> np.ndarray:
    """Which rows of a push with these lane numbers (one a row) are their lane's last."""
    k = lanes.shape[0]
    out = np.zeros(k, bool)
    _, last = np.unique(lanes[::-1], return_index=True)
    out[k - 1 - last] = True
    return out


def _flushed(flush: Any, lanes: np.ndarray) -> np.ndarray:
    """The rows ``flush`` names (``Pusher.expand``): ``True``, each lane's last row; else one flag a row."""
    k = lanes.shape[0]
    if flush is True:
        return last_of_lanes(lanes)
    flags = np.asarray(flush)
    if flags.dtype != bool or flags.shape != (k,):
        raise FieldError(f"flush: expected True or one bool a row ({k}), got {flags.dtype} of shape {flags.shape}")
    return flags


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

def end_rows(spec: Frames, stored: Schema, nexts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stored fields of end rows (``frames.py``), ``_kind`` included: each ``next_of`` source
    holds the next observation of the step before (``nexts``: the next fields, one row per end
    row; the newest frame when stacked), every other field zeros."""
    m = next(iter(nexts.values())).shape[0]
    sources = {src: nxt for nxt, src in spec.next_of}
    out: dict[str, np.ndarray] = {}
    for f in stored:
        if f.name in sources:
            b, s = nexts[sources[f.name]], spec.stacked(f.name)
            out[f.name] = np.asarray(frames_of(s, b)[:, -1] if s is not None else b, f.dtype)
        else:
            out[f.name] = np.zeros((m, *f.shape), f.dtype)
    out[KIND] = np.full(m, END, np.uint8)
    return out


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
        self.compared = {s.name for s in spec.stack} | {n for pair in spec.next_of for n in pair}
        """the fields the continuity checks compare"""

    @classmethod
    def of(cls, spec: Frames, schema: Schema, stored: Schema) -> Pusher | None:
        """The pusher of a buffer whose rows are ``spec``; ``None`` for ``PLAIN``: a push stores the rows as given."""
        return cls(spec, schema, stored) if spec.once else None

    def expand(self, arrays: dict[str, np.ndarray], k: int, lane: int | np.ndarray, episodes: np.ndarray | None,
               bounds: tuple[np.ndarray, np.ndarray], resume: bool = False, flush: Any = False) -> Expanded:
        """Check a push of ``k`` checked rows and lay it out as stored rows (nothing is touched).
        The walk over the rows decides which continue which; the data checks then run on all the
        rows at once. With ``resume`` a row that starts an episode may hold real older frames:
        they go into lead rows before it (the module docstring). With ``next_of``, ``flush``
        (``True``: each lane's last row of the push; or one flag per row) stores those rows' next
        observations now, in an end row after each, as after an episode's last step: the lane's
        next row starts an episode, and the flushed rows are transitions at once."""
        spec = self.spec
        if self.pid != os.getpid():  # a forked child: the parent's rows are not this process's
            self.last, self.pid = {}, os.getpid()
        lanes = np.full(k, lane, np.int64) if not isinstance(lane, np.ndarray) else lane
        eps = None if episodes is None else np.broadcast_to(episodes, (k,))
        full = {n: np.broadcast_to(a, (k, *self.schema[n].shape)) for n, a in arrays.items()}
        for n in self.compared:  # compared as stored: a float64 0.1 pushed as next_obs is float32's 0.1
            if full[n].dtype != self.schema[n].dtype:
                full[n] = full[n].astype(self.schema[n].dtype)
        final = np.zeros(k, bool)
        for name in spec.ends:
            final |= full[name].reshape(k) != 0
        nexts = bool(spec.next_of)
        if nexts and flush is not False:
            final |= _flushed(flush, lanes)
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
        self._checked(full, inside, remembered)
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
        ends = end_rows(spec, self.stored, {n: full[n][src_row[is_end]] for n, _ in spec.next_of}) \
            if is_end.any() else None
        out: dict[str, np.ndarray] = {}
        for f in self.stored:
            a = full[f.name]
            s = spec.stacked(f.name)
            if s is not None:
                a = frames_of(s, a)[:, -1]  # the newest frame
            col = np.ascontiguousarray(a[src_row])
            if ends is not None:
                col[is_end] = ends[f.name]
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
        return {n: full[n][i] for n in self.spec.rebuilt}

    def _checked(self, full: dict[str, np.ndarray], inside: list[tuple[int, int]],
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
