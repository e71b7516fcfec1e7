"""Saving and loading buffers, and plain numpy export/import.

``save(buf, path)`` writes the directory ``path/`` with two files; ``load(path)`` makes a new buffer
in shared memory with the same schema, options, rows, row ids, priorities and use counts.
Nothing is pickled. ``export(buf)`` and ``from_arrays(schema, arrays)`` trade all rows as a dict of
numpy arrays (cpprb's ``get_all_transitions``, DI-engine's ``export_data`` / ``import_data``).

Format version 1
----------------
``rows.safetensors`` is a safetensors file (https://github.com/huggingface/safetensors; the
``safetensors`` package reads it, e.g. ``safetensors.numpy.load_file``). All integers are
little-endian::

    offset   size  content
    0        8     N, the length of the header, uint64
    8        N     UTF-8 JSON header, padded with spaces so that 8 + N is a multiple of 64:
                   {"__metadata__": {"format": "shmbuffer", "format_version": "1", "save_id": S},
                    NAME: {"dtype": CODE, "shape": [rows, ...], "data_offsets": [BEGIN, END]}, ...}
    8 + N    ...   the tensors, C order, little-endian; tensor NAME is the bytes [8+N+BEGIN, 8+N+END).
                   They tile this section exactly, larger itemsizes first (so each tensor is aligned
                   to its element size); nothing follows the last one.

Every tensor has one row per row number of the saved runs (see ``lanes`` below), in the order of
``get``: lane 0's rows oldest first, then lane 1's, and so on; a *hole* (a row number whose row
was empty, see ``_present``) has a row too, so that every other row keeps its row number. The
tensors:

* one per field of the schema, named as the field, ``(rows, *shape)``, CODE from its dtype
  (F64 F32 F16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL). complex64 / complex128 fields are stored as
  F32 / F64 with a trailing dimension of 2 (real, imaginary), dtypes safetensors has no code for
  (longdouble) as U8 with a trailing dimension of their itemsize: the bytes are the buffer's.
* ``_episode`` I64 ``(rows,)``: the rows' episode ids, when the buffer keeps episodes.
* ``_leaf`` F64 ``(rows,)``: the rows' leaves in the priority tree (``samplers.py``:
  ``(p + eps) ** alpha``, 1 for a uniform row under ``max_use``, 0 once used up), when the buffer
  has a tree (``Prioritized`` or ``max_use``).
* ``_uses`` U32 ``(rows,)``: times each row was drawn, with ``max_use``.
* ``_present`` BOOL ``(rows,)``, always: 1 for a saved row, 0 for a hole, a row number whose slot
  was empty when the save ran (stamp 0, ``ring.py``: its writer died mid-push and the row was
  reaped, or its push was interrupted and abandoned). A hole's bytes are zeros in every tensor. A
  load leaves a hole's slot empty (stamp 0, leaf 0): it is never drawn, ``get`` raises on it as on
  the original, and the other rows keep their row numbers, ids and order.

``meta.json`` is a UTF-8 JSON object:

``format`` ``"shmbuffer"``; ``format_version`` 1; ``shmbuffer_version`` the writer's release;
``save_id`` the same random token as the header's, so two files of different saves never pair up;
``name`` the buffer's name; ``schema`` ``Schema.to_json()``; ``options`` ``Options.to_json()``
(capacity, lanes, sampler, max_use, episodes); ``rows`` the rows of every tensor (holes
included); ``lanes`` one ``{"first": F, "stop": S, "base": B}`` per lane: its saved rows and holes
are the row numbers ``[F, S)`` (``ring.py``: row ``n`` of lane ``l`` has the id ``n * lanes + l``),
``B <= F`` its base (first row number since its last ``clear()``); ``sampler_state``
``{"max_priority": P}`` (the largest priority given so far) or null without a tree; ``stats`` the
buffer's counters (``Buffer.stats``); ``counters`` ``{"sample_calls": C, "removed": R}`` (the
sample calls ``beta`` is annealed over and whether rows were deleted or used up, ``layout.Counter``;
older saves have none: 0); ``tensors`` the tensors of ``rows.safetensors`` in
file order, each ``{"name", "dtype" (CODE), "shape", "numpy" (the buffer's numpy dtype)}``.

A later format version adds a reader to ``READERS`` and keeps the older ones.

Files, and what a load checks
-----------------------------
``save`` creates ``path`` with mode 0700 when it does not exist; an existing ``path`` must be a
directory (not a symbolic link) of the saving user, and may hold a save only with
``overwrite=True``. Both files are written under fresh names (``.NAME.<save_id>.tmp``) opened
with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the opened directory, made mode 0600 whatever
the umask, and renamed into place (rows first, ``meta.json`` last): nothing is ever written
through a link someone planted, and nobody else can read a save.

``load`` opens both files with ``O_NOFOLLOW | O_NONBLOCK`` and reads only regular files (a link,
a FIFO or a directory raises ``LayoutError``; a FIFO never blocks it). Before it makes any shared
memory it checks every entry of ``meta.json``: its type, its range and its agreement with the
others (``0 <= base <= first <= stop <= first +`` the lane's capacity, ``stop * lanes <=
MAX_ROW`` so that ids and stamps fit an int64, ``rows`` the sum of the lanes', ``max_priority``
finite, ``>= 0`` and with a leaf of at most ``samplers.MAX_LEAF``, capacity times a row's bytes
at most ``MAX_BLOCK``, the tensors those of the schema and options); and every entry of the
safetensors header (object, dtype code, shape, offsets that tile the data section, metadata
strings). As it reads the rows it checks ``_present`` (0 or 1), ``_leaf`` (in ``[0,
MAX_LEAF]``) and ``_uses`` (at most ``max_use``). Whatever is malformed raises ``LayoutError``
naming the file and the entry; JSON nested too deep to parse is malformed too.

A save while writers run
------------------------
``save`` first reaps the rows of writers that died mid-push (``ring.py``: they read as empty from
then on), reads each lane's bounds ``[first, stop)`` once, and copies rows in pieces with the
reader's half of the commit protocol (``ring.py``): read the stamps, copy, read the stamps again;
a row counts only when both reads equal its committed stamp. What it saves is, per lane, the row
numbers ``[F, S)`` where

* ``S`` is ``stop``, or the first row of ``[first, stop)`` that a live writer was still writing
  ``wait`` seconds after the start: the run stops before it, and the committed rows after it are
  not saved (they count as dropped). Rows of writers found dead by then are reaped and become
  holes. Rows reserved after the start (row numbers ``>= stop``) are never saved.
* ``F >= first`` is one past the last row of ``[first, S)`` that was found overwritten, at the
  start or when its piece was copied: every row before it goes too, intact or not (writers
  lapping the ring take a lane's slots in row-number order, so those are overwritten next). A
  hole counts as overwritten once its slot is no longer empty.
* every row of ``[F, S)`` that the scan at the start found empty (stamp 0; dead writers' rows are
  by then) is a hole (``_present`` 0); every other one is saved.

So every saved row was committed when the save started (or within ``wait`` of it) and was copied
intact (episode ids with it: they are part of the row), and each lane's saved rows and holes are
consecutive row numbers: the snapshot of a moment, less a lane's rows up to the newest one that
writers overwrote while the save ran, and less the rows from the first one a live writer was
still writing. Tree leaves and use counts are read with their piece under the ring's lock: each
as of that moment, not of the start (samplers change them without touching the rows).

Pieces are at most ``CHUNK_BYTES`` of rows, taken from the lanes in turn. The first piece of every
lane is held in memory until all lanes have one, so the file's layout (every lane's row count) is
known before anything is written; if writers still overwrite rows after that (they outran the
save), the tensors are moved down over the dropped rows at the end: one more pass over the file
from the first gap on. Memory: about two pieces, whatever the buffer's size. ``export`` runs the
same copy into one array of bytes (its result) instead of a file, then moves the rows down over
the holes (an export has no holes: ``index`` names each row); ``pieces`` yields the pieces without
keeping them, holes left out (``shmbuffer inspect``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CapacityError, FieldError, LayoutError, closed
from ..frames import ENDS, KIND, Frames, frames_of
from ..progress import Progress as Line
from ..protocol import reader
from ..protocol.layout import Counter, Lane, Options
from ..protocol.priorities import MAX_LEAF
from ..protocol.rows import intact
from ..sampling.samplers import Prioritized
from ..schema import Schema
from ..shm.segment import human

FORMAT = "shmbuffer"
VERSION = 1
META = "meta.json"
ROWS = "rows.safetensors"
CHUNK_BYTES = 64 << 20
"""Bytes of rows copied (or read) at a time."""
ALIGN = 64
MAX_HEADER = 100 << 20
"""The largest header safetensors accepts; also the largest ``meta.json`` a load reads."""
MAX_ROW = 2**61
"""Every saved lane's ``stop * lanes`` is at most this: ids (``n * lanes + l``) and stamps
(``2n + 2``) of its rows, and of the rows pushed after a load for ages to come, fit an int64."""
_UPDATE_TRIES = 2000
"""At most this many copies of a piece while rows of it are being updated (see ``_UNLOCKED_TRIES``)."""
_UNLOCKED_TRIES = 8
"""Copies of a piece without the lock; the next one holds it, so that no update can begin (it
waits up to a second for the updates under way, whose copies need no lock, to end)."""
MAX_BLOCK = 2**48
"""A save whose buffer would need more bytes of rows than this (256 TiB) is damaged."""
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_CODES = {"f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
          "u8": "U64", "u4": "U32", "u2": "U16", "u1": "U8", "b1": "BOOL"}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
          "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
"""Element sizes of every safetensors dtype code (for checking a header we did not write)."""

_STATS = {"sampled": Counter.SAMPLED, "reclaimed": Counter.RECLAIMED, "inserted": Counter.INSERTED,
          "sample_calls": Counter.SAMPLE_CALLS, "removed": Counter.REMOVED}
"""The counters a load restores (lock recoveries belong to the old lock): ``sample_calls`` carries
the annealing of ``Prioritized.beta`` on, ``removed`` says rows were deleted or used up."""

Buffer = Any
"""A ``Buffer`` (``buffer.py``, above this module: it is never imported here): what is saved
is read through its public ``ring``, ``block``, ``priorities``, ``reap``, ``schema`` and ``options``;
a load makes one with the ``factory`` it is given (``Buffer`` itself)."""

Progress = bool | Callable[[int, int], None] | None


# -- tensors ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """A tensor of the file: ``shape`` and ``dtype`` of one row as the buffer holds it, stored
    as ``code`` with the trailing dimensions ``extra``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    code: str
    extra: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def file_shape(self, rows: int) -> list[int]:
        return [rows, *self.shape, *self.extra]

    def to_json(self, rows: int) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.code, "shape": self.file_shape(rows), "numpy": self.dtype.str}


def _tensor(name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> _Tensor:
    key = f"{dtype.kind}{dtype.itemsize}"
    if key in _CODES:
        return _Tensor(name, shape, dtype, _CODES[key], ())
    if key in ("c8", "c16"):
        return _Tensor(name, shape, dtype, _CODES[f"f{dtype.itemsize // 2}"], (2,))
    return _Tensor(name, shape, dtype, "U8", (dtype.itemsize,))


def _tensors(schema: Schema, opts: Options) -> list[_Tensor]:
    """The file's tensors in file order (larger itemsizes first, then fields, then internals).
    With ``next_of``/``stack`` (format version 2) the fields are the stored ones and ``_kind``
    comes along (``frames.py``)."""
    frames = opts.frames
    out = [_tensor(f.name, f.shape, f.dtype) for f in (schema if frames is None else frames.stored(schema))]
    if frames is not None:
        out.append(_tensor(KIND, (), np.dtype(np.uint8)))
    if opts.episodes:
        out.append(_tensor("_episode", (), np.dtype(np.int64)))
    if opts.tree:
        out.append(_tensor("_leaf", (), np.dtype(np.float64)))
    if opts.max_use is not None:
        out.append(_tensor("_uses", (), np.dtype(np.uint32)))
    out.append(_tensor("_present", (), np.dtype(np.bool_)))
    return sorted(out, key=lambda t: -t.dtype.itemsize)


# -- reading a consistent set of rows from a live buffer ---------------------------------------------
@dataclass
class _Run:
    """One lane's rows: bounds at the start, the run ``[keep, end)`` kept so far, the next row,
    and the holes (row numbers of empty rows, sorted) of ``[first, end)``."""

    lane: int
    first: int
    stop: int
    base: int
    end: int
    keep: int
    at: int
    holes: np.ndarray

    def hole_count(self) -> int:
        return int(self.holes.size - np.searchsorted(self.holes, self.keep))

    def hole_mask(self, n0: int, n1: int) -> np.ndarray:
        """Which rows of ``[n0, n1)`` are holes."""
        h = self.holes[np.searchsorted(self.holes, n0):np.searchsorted(self.holes, n1)]
        mask = np.zeros(n1 - n0, bool)
        mask[h - n0] = True
        return mask


@dataclass
class _Piece:
    lane: int
    start: int
    arrays: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return int(next(iter(self.arrays.values())).shape[0])


def _arrays(buf: Buffer) -> dict[str, np.ndarray]:
    if buf.closed:
        raise closed(buf.name)
    arrays: dict[str, np.ndarray] = buf.block.arrays
    return arrays


class _Snapshot:
    """The rows of ``buf`` as of now, read piece by piece (see "A save while writers run")."""

    def __init__(self, buf: Buffer, wait: float) -> None:
        ring = buf.ring
        self.buf = buf
        self.arrays = _arrays(buf)
        self.lc = ring.lane_capacity
        buf.reap()  # rows of writers that died mid-push read as empty from now on: holes, not waited for
        self._reaped = False
        first, stop = ring.bounds()
        base = ring.base(np.arange(ring.lanes)).copy()
        self.stats = ring.stats
        counters = _arrays(buf)["_stats"]
        self.counters = {"sample_calls": int(counters[Counter.SAMPLE_CALLS]), "removed": int(counters[Counter.REMOVED])}
        prios = buf.priorities
        self.max_priority = prios.max_priority if prios is not None else None
        deadline = time.monotonic() + wait
        self.runs = [self._scan(lane, int(first[lane]), int(stop[lane]), min(int(base[lane]), int(first[lane])), deadline)
                     for lane in range(ring.lanes)]

    def _scan(self, lane: int, first: int, stop: int, base: int, deadline: float) -> _Run:
        """Find the run's end (the first row a live writer is still writing after the wait), the
        overwritten rows before it and the holes (empty rows) among them."""
        stamp = self.buf.ring.stamp
        keep, n0 = first, first
        holes: list[np.ndarray] = []
        step = CHUNK_BYTES // 8
        end = stop
        while n0 < stop:
            n1 = min(stop, n0 + step, (n0 // self.lc + 1) * self.lc)
            sl = self._slots(lane, n0, n1)
            expect = 2 * np.arange(n0, n1, dtype=np.int64) + 2
            s = stamp[sl].copy()
            while True:
                writing = s == expect - 1
                if not writing.any() or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
                s[writing] = stamp[sl][writing]
            if writing.any() and not self._reaped:  # writers that died while we waited
                self._reaped = True
                self.buf.reap()
                s[writing] = stamp[sl][writing]
                writing = s == expect - 1
            stuck = np.flatnonzero(writing)
            cut = int(stuck[0]) if stuck.size else n1 - n0
            over = np.flatnonzero(s[:cut] > expect[:cut])
            if over.size:
                keep = n0 + int(over[-1]) + 1
            holes.append(n0 + np.flatnonzero(s[:cut] < expect[:cut]))
            if stuck.size:
                end = n0 + cut
                break
            n0 = n1
        found = np.concatenate(holes) if holes else np.empty(0, np.int64)
        return _Run(lane, first, stop, base, end, keep, keep, found[found >= keep])

    def _slots(self, lane: int, n0: int, n1: int) -> slice:
        s0 = lane * self.lc + n0 % self.lc
        return slice(s0, s0 + n1 - n0)

    def copy(self, run: _Run, rows: int) -> _Piece | None:
        """Copy the next ``rows`` rows of ``run`` (fewer at the lane's end or where its slots
        wrap); drop the overwritten ones and those before them. ``None`` when none is left."""
        buf, ring = self.buf, self.buf.ring
        n0 = run.at
        n1 = min(run.end, n0 + rows, (n0 // self.lc + 1) * self.lc)
        sl = self._slots(run.lane, n0, n1)
        hole = run.hole_mask(n0, n1)
        expect = 2 * np.arange(n0, n1, dtype=np.int64) + 2
        expect[hole] = 0  # a hole must still be empty: a stamp there means a writer lapped it
        counters = buf.block.counters
        for attempt in range(_UPDATE_TRIES):
            # rows being updated (buffer.update: odd with their own row number) are copied again
            # once done, and so is a piece that an update spanned (it ends with the stamp it had);
            # an update anywhere moves the count, so after a few tries the copy holds the lock (no
            # update can begin) once the updates under way have ended (their copies need no lock)
            locked = attempt >= _UNLOCKED_TRIES
            if locked:
                ring.lock.acquire()
            try:
                if locked:
                    until = time.monotonic() + 1.0
                    while (ring.stamp[sl] == expect - 1).any() and time.monotonic() < until:
                        time.sleep(0.0001)
                updates = int(counters[Counter.UPDATES])
                before = ring.stamp[sl].copy()
                packed = buf.block.packed
                block = packed[sl].copy() if packed is not None else None
                out = {name: col[sl].copy() for name, col in buf.block.large.items()}
                if "_episode" in self.arrays:
                    out["_episode"] = self.arrays["_episode"][sl].copy()
                prios = buf.priorities
                if prios is not None:
                    with contextlib.nullcontext() if locked else ring.lock:
                        out["_leaf"] = prios.tree.leaves[sl].copy()
                        if prios.uses is not None:
                            out["_uses"] = prios.uses[sl].copy()
                after = ring.stamp[sl].copy()
                moved = int(counters[Counter.UPDATES]) != updates
            finally:
                if locked:
                    ring.lock.release()
            if locked or (not moved and not ((before == expect - 1) | (after == expect - 1)).any()):
                break
            time.sleep(0.0005)
        bad = ~intact(before, after, expect)
        # a row deleted (or reaped) since the scan is a hole, not a sign of lapping writers
        gone = (after == 0) & ((before == expect) | (before == 0)) & ~hole
        if gone.any():
            hole = hole | gone
            bad &= ~gone
        if moved:
            bad[:] = True
        run.at = n1
        if bad.any():
            run.keep = max(run.keep, n0 + int(np.flatnonzero(bad)[-1]) + 1)
        lo = max(run.keep, n0) - n0
        if lo >= n1 - n0:
            return None
        if hole.any():  # a hole's bytes are zeros in every tensor (see the format)
            for a in out.values():
                a[hole] = 0
            if block is not None:
                block[hole] = 0
        if block is not None:
            for name, view in buf.block.stored_record.views(block).items():
                out[name] = np.ascontiguousarray(view)
        out["_present"] = ~hole
        return _Piece(run.lane, n0 + lo, {name: a[lo:] for name, a in out.items()})

    def piece_rows(self, row_bytes: int) -> int:
        return max(1, CHUNK_BYTES // max(1, row_bytes) // len(self.runs))


# -- the file's layout --------------------------------------------------------------------------------
class _Layout:
    """Where each lane's rows of each tensor go, for runs ``[keep, end)``."""

    def __init__(self, tensors: list[_Tensor], runs: list[_Run]) -> None:
        self.keep = [r.keep for r in runs]
        self.counts = [r.end - r.keep for r in runs]
        self.rows = sum(self.counts)
        self.lane_at = [sum(self.counts[:i]) for i in range(len(runs))]
        self.offsets: dict[str, int] = {}
        at = 0
        for t in tensors:
            self.offsets[t.name] = at
            at += self.rows * t.row_bytes
        self.data_bytes = at

    def at(self, t: _Tensor, lane: int, n: int) -> int:
        """Byte offset (in the data section) of row ``n`` of ``lane`` in tensor ``t``."""
        return self.offsets[t.name] + (self.lane_at[lane] + n - self.keep[lane]) * t.row_bytes

    def header(self, tensors: list[_Tensor], save_id: str) -> bytes:
        version = 2 if any(t.name == KIND for t in tensors) else VERSION
        head: dict[str, Any] = {"__metadata__": {"format": FORMAT, "format_version": str(version), "save_id": save_id}}
        for t in tensors:
            begin = self.offsets[t.name]
            head[t.name] = {"dtype": t.code, "shape": t.file_shape(self.rows),
                            "data_offsets": [begin, begin + self.rows * t.row_bytes]}
        return json.dumps(head, separators=(",", ":")).encode()


def _pwrite(fd: int, a: np.ndarray | bytes | memoryview, offset: int) -> None:
    view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data if isinstance(a, np.ndarray) else memoryview(a)
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_into(fd: int, a: np.ndarray, offset: int, file: Path) -> None:
    view = a.reshape(-1).view(np.uint8).data
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise LayoutError(f"{file} is truncated: it ends at byte {offset}, before the rows it describes")
        view, offset = view[n:], offset + n


class _Bar:
    """Progress through a callback ``(done_bytes, total_bytes)``, or as a line on stderr
    (``progress.Progress``: ``True`` always, ``None`` on a terminal once it runs long)."""

    def __init__(self, progress: Progress, what: str, total: int) -> None:
        self.call = progress if callable(progress) else None
        self.line = Line(what, total, "bytes", show=None if progress is None else progress is True)
        self.done = 0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.call is not None:
            self.call(self.done, self.line.total)
        self.line.update(self.done)

    def close(self) -> None:
        self.line.close()


# -- writing the rows: to the file, or to memory ---------------------------------------------------------
class _FileSink:
    """The rows go to ``rows.safetensors`` through ``fd``, after a header of the planned size."""

    def __init__(self, fd: int, tensors: list[_Tensor], save_id: str) -> None:
        self.fd, self.tensors, self.save_id = fd, tensors, save_id
        self.data_start = 0

    def start(self, plan: _Layout) -> None:
        # the final header is never longer: its numbers only shrink when rows are dropped
        self.data_start = -(-(8 + len(plan.header(self.tensors, self.save_id))) // ALIGN) * ALIGN
        os.ftruncate(self.fd, self.data_start + plan.data_bytes)

    def write(self, offset: int, a: np.ndarray) -> None:
        _pwrite(self.fd, a, self.data_start + offset)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        for done in range(0, nbytes, CHUNK_BYTES):
            k = min(CHUNK_BYTES, nbytes - done)
            _pwrite(self.fd, os.pread(self.fd, k, self.data_start + src + done), self.data_start + dst + done)

    def finish(self, final: _Layout) -> None:
        os.ftruncate(self.fd, self.data_start + final.data_bytes)
        head = final.header(self.tensors, self.save_id)
        _pwrite(self.fd, struct.pack("<Q", self.data_start - 8) + head + b" " * (self.data_start - 8 - len(head)), 0)


class _MemorySink:
    """The rows go to one array of bytes; the tensors are views of it (``export``)."""

    data = np.empty(0, np.uint8)

    def start(self, plan: _Layout) -> None:
        self.data = np.empty(plan.data_bytes, np.uint8)

    def write(self, offset: int, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        self.data[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        for done in range(0, nbytes, CHUNK_BYTES):
            k = min(CHUNK_BYTES, nbytes - done)
            self.data[dst + done:dst + done + k] = self.data[src + done:src + done + k]

    def finish(self, final: _Layout) -> None:
        pass


def _copy_rows(snap: _Snapshot, tensors: list[_Tensor], sink: _FileSink | _MemorySink, bar: _Bar | None) -> tuple[_Layout, bool]:
    """Copy every run into ``sink`` (see "A save while writers run"); return the final layout and
    whether the tensors had to be moved over rows dropped after the layout was planned."""
    runs = snap.runs
    row_bytes = sum(t.row_bytes for t in tensors)
    step = snap.piece_rows(row_bytes)
    held: list[_Piece] = []
    for run in runs:  # the first piece of every lane fixes the layout before anything is written
        while run.at < run.end:
            piece = snap.copy(run, step)
            if piece is not None:
                held.append(piece)
                break
    plan = _Layout(tensors, runs)
    sink.start(plan)

    def write(piece: _Piece) -> None:
        for t in tensors:
            sink.write(plan.at(t, piece.lane, piece.start), piece.arrays[t.name])
        if bar is not None:
            bar.add(piece.rows * row_bytes)

    while held:  # popped, so that each piece is freed once written: memory stays at about one piece
        write(held.pop())
    while any(r.at < r.end for r in runs):
        for run in runs:
            if run.at < run.end:
                got = snap.copy(run, step)
                if got is not None:
                    write(got)
                    got = None
    final = _Layout(tensors, runs)
    moved = final.keep != plan.keep
    if moved:  # writers overwrote rows after the layout was planned: close the gaps, front to back
        for t in tensors:
            for lane, count in enumerate(final.counts):
                src, dst = plan.at(t, lane, final.keep[lane]), final.at(t, lane, final.keep[lane])
                if src != dst:
                    sink.move(src, dst, count * t.row_bytes)
    sink.finish(final)
    return final, moved


# -- save ----------------------------------------------------------------------------------------------
def save(buf: Buffer, path: str | os.PathLike[str], *, progress: Progress = None, wait: float = 1.0,
         overwrite: bool = False) -> dict[str, Any]:
    """Write ``buf``'s rows to the directory ``path`` as ``meta.json`` and ``rows.safetensors`` (see
    the module docstring), while writers may go on pushing. ``path`` is created (mode 0700) if it
    does not exist; an existing one must be a directory of this user, not a symbolic link, and may
    hold a save only with ``overwrite=True`` (it is replaced). The files are created afresh (never
    through a link), mode 0600 whatever the umask, and renamed into place. ``progress``: True for a
    progress line on stderr, False for none, or a callable ``(done_bytes, total_bytes)`` called after
    each piece; by default a line on a terminal once the save has run for two seconds.
    ``wait``: seconds to wait for rows being written when the save starts. Returns a summary: path,
    rows (saved), holes (empty rows kept as holes), bytes, seconds, dropped (rows within the bounds
    at the start that were neither saved nor holes), moved (whether the tensors had to be moved
    over rows dropped late)."""
    t0 = time.perf_counter()
    folder = Path(path)
    dfd, made = _open_folder(folder)
    save_id = secrets.token_hex(8)
    tmp, meta_tmp = f".{ROWS}.{save_id}.tmp", f".{META}.{save_id}.tmp"
    try:
        if not overwrite:
            _refuse_a_save(folder, dfd)
        snap = _Snapshot(buf, wait)
        tensors = _tensors(buf.schema, buf.options)
        bar = _Bar(progress, f"saving {buf.name!r}", sum(r.end - r.keep for r in snap.runs) * sum(t.row_bytes for t in tensors))
        fd = _create(tmp, dfd)
        try:
            sink = _FileSink(fd, tensors, save_id)
            final, moved = _copy_rows(snap, tensors, sink, bar)
        finally:
            os.close(fd)
            bar.close()
        fd = _create(meta_tmp, dfd)
        try:
            _pwrite(fd, (json.dumps(_meta(buf, snap, tensors, final, save_id), indent=1) + "\n").encode(), 0)
        finally:
            os.close(fd)
        if not overwrite:
            _refuse_a_save(folder, dfd)  # one made while this one ran
        os.replace(tmp, ROWS, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.replace(meta_tmp, META, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        for name in (tmp, meta_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only while empty
        raise
    finally:
        os.close(dfd)
    holes = sum(r.hole_count() for r in snap.runs)
    return {
        "path": str(folder), "rows": final.rows - holes, "holes": holes, "bytes": sink.data_start + final.data_bytes,
        "seconds": time.perf_counter() - t0, "dropped": sum(r.stop - r.first for r in snap.runs) - final.rows,
        "moved": moved,
    }


def _open_folder(folder: Path) -> tuple[int, bool]:
    """The save directory opened (created with mode 0700 when it does not exist), and whether it
    was created here. An existing one must be a real directory (not a link) of this user: another
    user's directory, or a link they could point elsewhere, would let them read or swap the save."""
    made = False
    if not os.path.lexists(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # someone else made it meanwhile: checked below
            os.mkdir(folder, 0o700)
            made = True
    expected = f"expected a directory of yours (or a path that does not exist) for {META} and {ROWS}"
    if os.path.islink(folder):
        raise FileExistsError(f"save: {folder} is a symbolic link; {expected}: pass the directory it points to")
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (NotADirectoryError, FileNotFoundError):  # a file, a link or nothing (it was swapped meanwhile)
        raise FileExistsError(f"save: {folder} exists and is not a directory; {expected}") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"save: {folder} belongs to user {st.st_uid}, not to you (user {os.geteuid()}): its owner could "
                f"read or replace the save; {expected}"
            )
        if made:
            os.fchmod(dfd, 0o700)  # whatever the umask
    except BaseException:
        os.close(dfd)
        raise
    return dfd, made


def _refuse_a_save(folder: Path, dfd: int) -> None:
    there = []
    for name in (META, ROWS):
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            there.append(name)
    if there:
        raise FileExistsError(
            f"save: {folder} already holds a save ({' and '.join(there)}); pass overwrite=True to replace "
            "it, or choose another path"
        )


def _create(name: str, dfd: int) -> int:
    """A new file ``name`` in the directory ``dfd``, mode 0600 whatever the umask: never an
    existing file, never through a link."""
    fd = os.open(name, _CREATE, 0o600, dir_fd=dfd)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _version() -> str:
    """This release's version, for a save's ``shmbuffer_version``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shmbuffer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _meta(buf: Buffer, snap: _Snapshot, tensors: list[_Tensor], layout: _Layout, save_id: str) -> dict[str, Any]:

    return {
        "format": FORMAT,
        "format_version": VERSION if buf.options.frames is None else 2,
        "shmbuffer_version": _version(),
        "save_id": save_id,
        "name": buf.name,
        "schema": buf.schema.to_json(),
        "options": buf.options.to_json(),
        "rows": layout.rows,
        "lanes": [{"first": r.keep, "stop": r.end, "base": r.base} for r in snap.runs],
        "sampler_state": None if snap.max_priority is None else {"max_priority": snap.max_priority},
        "stats": snap.stats,
        "counters": snap.counters,
        "tensors": [t.to_json(layout.rows) for t in tensors],
    }


# -- load ------------------------------------------------------------------------------------------------
def load(
    path: str | os.PathLike[str],
    factory: Callable[..., Buffer],
    *,
    name: str | None = None,
    capacity: int | None = None,
    seed: int | np.random.Generator | None = None,
) -> Buffer:
    """A new buffer (made by ``factory``, ``ReplayBuffer``; this process its creator) holding what
    ``save`` wrote to ``path``: the same
    schema and options, the same rows at the same row numbers (so the same ids and ``get`` order),
    priorities, use counts and counters. ``capacity`` may differ from the saved one as long as every
    lane still holds its saved rows. Files that are damaged, truncated, do not match, are not
    regular files (a link, a FIFO) or describe a buffer no machine could hold raise ``LayoutError``
    naming the file, before any shared memory is made; a missing file raises ``FileNotFoundError``;
    a buffer larger than ``/dev/shm`` has room for raises ``OutOfSharedMemory``, as creating it would."""
    folder = Path(path)
    meta_file = folder / META
    fd = _open_regular(meta_file, f"load: {meta_file} does not exist; expected a directory written by shmbuffer.save")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            raise LayoutError(f"{meta_file}: {size} bytes, expected at most {MAX_HEADER}: not written by shmbuffer.save")
        text = os.pread(fd, MAX_HEADER, 0)
    finally:
        os.close(fd)
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise LayoutError(f"{meta_file}: not valid JSON ({type(exc).__name__}: {_clip(str(exc))})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise LayoutError(f"{meta_file}: format {_show(found)}, expected {FORMAT!r}: not written by shmbuffer.save")
    version = meta.get("format_version")
    read = READERS.get(version) if type(version) is int else None
    if read is None:
        raise LayoutError(
            f"{meta_file}: format version {_show(version)}; this shmbuffer reads versions "
            f"{', '.join(map(str, READERS))}: load it with a newer shmbuffer"
        )
    return read(folder, meta, factory, name=name, capacity=capacity, seed=seed)


def _open_regular(file: Path, missing: str) -> int:
    """``file`` opened for reading, never through a link and without blocking (a FIFO would
    block), or ``LayoutError`` when it is not a regular file."""
    try:
        fd = os.open(file, _READ)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: the path is a file
        raise FileNotFoundError(missing) from None
    except OSError:
        if os.path.islink(file):  # ELOOP
            raise LayoutError(
                f"{file} is a symbolic link; expected the regular file shmbuffer.save wrote (copy the "
                "file itself, a link could point anywhere)"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "special file"
        raise LayoutError(f"{file} is a {kind}; expected the regular file shmbuffer.save wrote")
    return fd


def _show(value: Any) -> str:
    """A short description of a JSON value for an error message (never a deep or long repr)."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return f"a JSON array of {len(value)}"
    return _clip(repr(value))


def _clip(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[:most] + "..."


class _Meta:
    """Reads the entries of a ``meta.json`` object, each checked, or ``LayoutError`` naming it."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def bad(self, where: str, value: Any, expected: str) -> LayoutError:
        return LayoutError(
            f"{self.file}: malformed entry: {where} is {_show(value)}, expected {expected}; the file is damaged or was not "
            "written by shmbuffer.save: save the buffer again"
        )

    def get(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if key not in obj:
            raise LayoutError(
                f"{self.file}: missing or malformed entry: {where}{key} is missing; the file is damaged or was "
                "not written by shmbuffer.save: save the buffer again"
            )
        return obj[key]

    def obj(self, obj: dict[str, Any], key: str, where: str = "", keys: set[str] | None = None) -> dict[str, Any]:
        value = self.get(obj, key, where)
        if not isinstance(value, dict) or (keys is not None and set(value) != keys):
            raise self.bad(where + key, value, "an object" + (f" with the keys {sorted(keys)}" if keys else ""))
        return value

    def array(self, obj: dict[str, Any], key: str, where: str = "") -> list[Any]:
        value = self.get(obj, key, where)
        if not isinstance(value, list):
            raise self.bad(where + key, value, "an array")
        return value

    def text(self, obj: dict[str, Any], key: str, where: str = "") -> str:
        value = self.get(obj, key, where)
        if not isinstance(value, str):
            raise self.bad(where + key, value, "a string")
        return value

    def integer(self, obj: dict[str, Any], key: str, where: str = "", lo: int = 0, hi: int = 2**63 - 1) -> int:
        value = self.get(obj, key, where)
        if type(value) is not int or not lo <= value <= hi:
            raise self.bad(where + key, value, f"an int in [{lo}, {hi}]")
        return value

    def number(self, obj: dict[str, Any], key: str, where: str = "", lo: float = 0.0) -> float:
        value = self.get(obj, key, where)
        ok = type(value) is float or (type(value) is int and abs(value) < 2**1000)  # float() of a larger int overflows
        if not ok or not lo <= float(value) < math.inf:
            raise self.bad(where + key, value, f"a finite number >= {lo:g}")
        return float(value)

    def shape(self, value: Any, where: str, lo: int) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(type(d) is int and lo <= d < 2**48 for d in value):
            raise self.bad(where, value, f"a list of ints in [{lo}, 2**48)")
        return tuple(value)


@dataclass(frozen=True)
class _Saved:
    """What a version-1 ``meta.json`` says, checked."""

    schema: Schema
    opts: Options
    lanes: list[tuple[int, int, int]]
    max_priority: float | None
    stats: dict[str, int]
    tensors: list[tuple[str, str, tuple[int, ...], str]]
    rows: int
    save_id: str


def _read_meta_v1(meta_file: Path, meta: dict[str, Any]) -> _Saved:
    """Check every entry of a version-1 ``meta.json``: its type, its range and its agreement with
    the others (see the module docstring); ``LayoutError`` naming the first one that is wrong."""
    m = _Meta(meta_file)
    save_id = m.text(meta, "save_id")
    m.text(meta, "name")
    m.text(meta, "shmbuffer_version")
    fields = m.array(meta, "schema")
    spec: dict[str, Any] = {}
    row_bytes = 0
    for i, f in enumerate(fields):
        if not isinstance(f, dict) or set(f) != {"name", "shape", "dtype"}:
            raise m.bad(f"schema[{i}]", f, "an object with the keys ['dtype', 'name', 'shape']")
        name, dtype = m.text(f, "name", f"schema[{i}]."), m.text(f, "dtype", f"schema[{i}].")
        shape = m.shape(f["shape"], f"schema[{i}].shape", 1)
        try:
            itemsize = np.dtype(dtype).itemsize
        except (TypeError, ValueError, SyntaxError):
            raise m.bad(f"schema[{i}].dtype", dtype, "a numpy dtype") from None
        row_bytes += math.prod(shape) * itemsize
        spec[name] = (shape, dtype)
    o = m.obj(meta, "options")
    capacity = m.integer(o, "capacity", "options.", 1, MAX_BLOCK)
    lanes_n = m.integer(o, "lanes", "options.", 1, capacity)
    if capacity % lanes_n:
        raise m.bad("options.lanes", lanes_n, f"a divisor of options.capacity {capacity}")
    if capacity * max(row_bytes, 1) > MAX_BLOCK:
        raise LayoutError(
            f"{meta_file}: {capacity} rows of {row_bytes} bytes (options.capacity, schema) need more than "
            f"{human(MAX_BLOCK)}; the file is damaged: save the buffer again"
        )
    sampler = m.obj(o, "sampler", "options.")
    kind = m.text(sampler, "kind", "options.sampler.")
    if kind == "prioritized":
        for key in ("alpha", "beta", "eps"):
            m.number(sampler, key, "options.sampler.")
        if m.get(sampler, "beta_steps", "options.sampler.") is not None:
            m.integer(sampler, "beta_steps", "options.sampler.", 1)
    if o.get("max_use") is not None:
        m.integer(o, "max_use", "options.", 1, 2**32 - 1)
    if type(m.get(o, "episodes", "options.")) is not bool:
        raise m.bad("options.episodes", o["episodes"], "true or false")
    if o.get("limiter") is not None:  # a NaN timeout would make every wait endless
        limiter = m.obj(o, "limiter", "options.", {"samples_per_insert", "min_size", "error", "block_writers", "timeout"})
        for key in ("samples_per_insert", "error", "timeout"):
            if key == "timeout" or limiter[key] is not None:
                m.number(limiter, key, "options.limiter.")
        m.integer(limiter, "min_size", "options.limiter.", 1)
        if type(limiter["block_writers"]) is not bool:
            raise m.bad("options.limiter.block_writers", limiter["block_writers"], "true or false")
    if (o.get("frames") is not None) != (meta.get("format_version") == 2):
        raise m.bad("options.frames", o.get("frames"), "frames in a version-2 save only")
    try:
        schema = Schema(**spec) if len(spec) == len(fields) else None
        opts = Options.from_json(o)
        if schema is not None and opts.frames is not None:
            opts.frames.check(schema)
    except (KeyError, TypeError, ValueError) as exc:  # SchemaError is a ValueError
        raise LayoutError(f"{meta_file}: schema or options malformed ({type(exc).__name__}: {_clip(str(exc))})") from None
    if schema is None:
        raise LayoutError(f"{meta_file}: schema names a field twice; the file is damaged: save the buffer again")
    lc = capacity // lanes_n
    lanes = []
    listed = m.array(meta, "lanes")
    if len(listed) != lanes_n:
        raise LayoutError(f"{meta_file}: {len(listed)} lanes listed, expected {lanes_n} (options.lanes)")
    for i, ln in enumerate(listed):
        if not isinstance(ln, dict) or set(ln) != {"first", "stop", "base"}:
            raise m.bad(f"lanes[{i}]", ln, "an object with the keys ['base', 'first', 'stop']")
        base, first, stop = (m.integer(ln, k, f"lanes[{i}].", 0, MAX_ROW // lanes_n) for k in ("base", "first", "stop"))
        if not base <= first <= stop <= first + lc:
            raise LayoutError(
                f"{meta_file}: lane {i} has base {base} and rows [{first}, {stop}); expected "
                f"base <= first <= stop <= first + {lc} (the lane's capacity)"
            )
        lanes.append((first, stop, base))
    rows = m.integer(meta, "rows")
    if rows != sum(stop - first for first, stop, _ in lanes):
        raise LayoutError(f"{meta_file}: rows is {rows}, the lanes hold {sum(s - f for f, s, _ in lanes)}")
    state = m.get(meta, "sampler_state", "")
    max_priority = None
    if opts.tree != (state is not None):
        expected = "the largest priority (the buffer has a tree)" if opts.tree else "null (the buffer has no tree)"
        raise m.bad("sampler_state", state, expected)
    if state is not None:
        if not isinstance(state, dict) or set(state) != {"max_priority"}:
            raise m.bad("sampler_state", state, "an object with the key 'max_priority'")
        max_priority = m.number(state, "max_priority", "sampler_state.")
        s = opts.sampler
        if isinstance(s, Prioritized):
            with np.errstate(over="ignore"):
                leaf = float(np.power(max_priority + s.eps, s.alpha))
            if not leaf <= MAX_LEAF:
                raise m.bad("sampler_state.max_priority", max_priority, f"a priority whose leaf (p + eps) ** alpha is <= {MAX_LEAF:g}")
    stats_in = m.obj(meta, "stats")
    stats = {key: m.integer(stats_in, key, "stats.") for key in stats_in}
    if "counters" in meta:  # saves before issue 14 have none
        counters = m.obj(meta, "counters")
        stats.update({key: m.integer(counters, key, "counters.") for key in counters})
    tensors = []
    for i, t in enumerate(m.array(meta, "tensors")):
        if not isinstance(t, dict) or set(t) != {"name", "dtype", "shape", "numpy"}:
            raise m.bad(f"tensors[{i}]", t, "an object with the keys ['dtype', 'name', 'numpy', 'shape']")
        where = f"tensors[{i}]."
        tensors.append((m.text(t, "name", where), m.text(t, "dtype", where), m.shape(t["shape"], where + "shape", 0),
                        m.text(t, "numpy", where)))
    return _Saved(schema, opts, lanes, max_priority, stats, tensors, rows, save_id)


@dataclass(frozen=True)
class _Entry:
    code: str
    shape: list[int]
    begin: int
    end: int


def _header_entry(e: Any) -> bool:
    """Whether ``e`` is a safetensors header entry (dtype, shape, data_offsets) of a known dtype."""
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        return False
    code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    return (isinstance(code, str) and code in _SIZES and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets))


def _read_header(file: Path, fd: int) -> tuple[int, dict[str, str], dict[str, _Entry]]:
    """Check a safetensors file's header against the file; return the data section's offset,
    the ``__metadata__`` and the tensors."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise LayoutError(f"{file}: {size} bytes, expected at least 8 (a safetensors header length)")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > size - 8:
        raise LayoutError(f"{file} is truncated: its header length says {n} bytes follow the first 8, the file has {size - 8}")
    if n > MAX_HEADER:
        raise LayoutError(f"{file}: header length {n} bytes, expected at most {MAX_HEADER}")
    raw = os.pread(fd, n, 8)
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise LayoutError(f"{file}: its header is not valid JSON ({type(exc).__name__}: {_clip(str(exc))})") from None
    if not isinstance(head, dict):
        raise LayoutError(f"{file}: its header is a JSON {type(head).__name__}, expected an object")
    meta = head.pop("__metadata__", {})
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise LayoutError(f"{file}: __metadata__ format {_show(found)}, expected {FORMAT!r}: not written by shmbuffer.save")
    if not all(isinstance(v, str) for v in meta.values()):
        raise LayoutError(f"{file}: __metadata__ holds values that are not strings; safetensors allows only strings")
    data = size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, e in head.items():
        if not _header_entry(e):
            raise LayoutError(f"{file}: tensor {_clip(repr(name))} has a malformed header entry {_show(e)}: expected "
                              "{'dtype': CODE, 'shape': [ints >= 0], 'data_offsets': [begin, end]}")
        code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        begin, end = offsets
        need = math.prod(shape) * _SIZES[code]
        if not 0 <= begin <= end or end - begin != need:
            raise LayoutError(
                f"{file}: tensor {_clip(repr(name))} ({code} {_clip(str(shape))}) needs {need} bytes, its data_offsets "
                f"[{begin}, {end}] are out of range"
            )
        entries[name] = _Entry(code, shape, begin, end)
    at = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != at:
            raise LayoutError(
                f"{file}: tensor {_clip(repr(name))} starts at data offset {e.begin}, expected {at} (tensors must "
                "tile the data section): its data_offsets are out of range"
            )
        at = e.end
    if at > data:
        raise LayoutError(f"{file} is truncated: its header says the data runs to byte {8 + n + at}, the file has {size} bytes")
    if at < data:
        raise LayoutError(f"{file}: {data - at} bytes follow the last tensor, expected none")
    return 8 + n, meta, entries


def _v1(folder: Path, meta: dict[str, Any], factory: Callable[..., Buffer], *, name: str | None,
        capacity: int | None, seed: Any) -> Buffer:
    meta_file, rows_file = folder / META, folder / ROWS
    saved = _read_meta_v1(meta_file, meta)
    schema, opts, lanes, rows = saved.schema, saved.opts, saved.lanes, saved.rows
    tensors = _tensors(schema, opts)
    expected = [(t.name, t.code, tuple(t.file_shape(rows)), t.dtype.str) for t in tensors]
    if sorted(saved.tensors) != sorted(expected):
        raise LayoutError(f"{meta_file}: tensors {_clip(str(saved.tensors), 1000)}, expected {expected} for its schema and options")
    most = max(stop - first for first, stop, _ in lanes)
    cap = opts.capacity if capacity is None else capacity
    if not isinstance(cap, (int, np.integer)) or isinstance(cap, bool) or cap <= 0 or cap % opts.lanes:
        raise CapacityError(f"load: capacity must be a positive multiple of the {opts.lanes} lanes, got {capacity!r}")
    if cap // opts.lanes < most:
        raise CapacityError(
            f"load: capacity {cap} gives lanes of {cap // opts.lanes} rows, but a lane of {folder} holds "
            f"{most} rows: expected capacity >= {most * opts.lanes}"
        )
    fd = _open_regular(rows_file, f"load: {rows_file} does not exist ({meta_file} does)")
    try:
        data_start, head_meta, entries = _read_header(rows_file, fd)
        if head_meta.get("save_id") != saved.save_id:
            raise LayoutError(
                f"{rows_file} and {meta_file} come from different saves (save_id "
                f"{_show(head_meta.get('save_id'))} vs {saved.save_id!r})"
            )
        if head_meta.get("format_version") != str(meta["format_version"]):
            raise LayoutError(f"{rows_file}: __metadata__ format_version {_show(head_meta.get('format_version'))}, "
                              f"expected '{meta['format_version']}'")
        found = {n: (e.code, e.shape) for n, e in entries.items()}
        want = {n: (c, list(s)) for n, c, s, _ in expected}
        if found != want:
            raise LayoutError(f"{rows_file} holds tensors {_clip(str(found), 1000)}; {meta_file} says {want}")
        kwargs = {f.name: getattr(opts, f.name) for f in fields(opts) if f.name not in ("capacity", "frames")}
        if opts.frames is not None:
            kwargs.update(opts.frames.arguments())
        buf = factory(schema, cap, **kwargs, name=name, seed=seed)
        try:
            with Line(f"loading {folder}", sum(stop - first for first, stop, _ in lanes)) as line:
                _fill(buf, fd, rows_file, data_start, entries, tensors, lanes, line)
            arrays = _arrays(buf)
            if saved.max_priority is not None:
                arrays["_prio"][0] = saved.max_priority
            for key, at in _STATS.items():
                arrays["_stats"][at] = saved.stats.get(key, 0)
            new_lc = buf.lane_capacity
            for lane, (first, stop, base) in enumerate(lanes):
                # the saved base reproduces the bounds unless the lanes grew or rows were dropped
                arrays["_lanes"][lane, Lane.BASE] = base if max(base, stop - new_lc) == first else first
                arrays["_lanes"][lane, Lane.CURSOR] = stop  # last: until now the buffer reads as empty
        except BaseException:
            buf.__exit__(None, None, None)  # unlink; unmap once the traceback's views are gone
            raise
    finally:
        os.close(fd)
    return buf


def _fill(buf: Buffer, fd: int, file: Path, data_start: int, entries: dict[str, _Entry],
          tensors: list[_Tensor], lanes: list[tuple[int, int, int]], line: Line) -> None:
    """Read the rows into the new buffer's slots, with their stamps, a chunk at a time; a hole's
    slot stays empty (stamp 0, leaf 0)."""
    arrays = _arrays(buf)
    lc = buf.lane_capacity
    targets: dict[str, np.ndarray] = dict(buf.block.fields)
    for internal in ("_episode", "_uses"):
        if internal in arrays:
            targets[internal] = arrays[internal]
    prios = buf.priorities
    max_use = buf.options.max_use
    step = max(1, CHUNK_BYTES // max(1, sum(t.row_bytes for t in tensors)))
    pos = 0
    for lane, (first, stop, _) in enumerate(lanes):
        n0 = first
        while n0 < stop:
            n1 = min(stop, n0 + step, (n0 // lc + 1) * lc)
            s0 = lane * lc + n0 % lc
            sl = slice(s0, s0 + n1 - n0)
            flags = np.empty(n1 - n0, np.uint8)
            _pread_into(fd, flags, data_start + entries["_present"].begin + pos + n0 - first, file)
            if flags.size and flags.max() > 1:
                raise LayoutError(f"{file}: tensor '_present' holds {int(flags.max())}, expected 0 or 1")
            present = flags.astype(bool)
            for t in tensors:
                if t.name == "_present":
                    continue
                offset = data_start + entries[t.name].begin + (pos + n0 - first) * t.row_bytes
                target = targets[t.name][sl] if t.name != "_leaf" else None
                if target is not None and target.flags.c_contiguous:
                    _pread_into(fd, target, offset, file)
                    staged = target
                else:
                    staged = np.empty((n1 - n0, *t.shape), t.dtype)
                    _pread_into(fd, staged, offset, file)
                if t.name == "_leaf":
                    staged[~present] = 0.0  # a hole is never drawn
                    assert prios is not None
                    if not np.all((staged >= 0) & (staged <= MAX_LEAF)) or not prios.leaves_valid(staged):
                        raise LayoutError(
                            f"{file}: tensor '_leaf' holds negative or non-finite priorities, or leaves "
                            f"above {MAX_LEAF:g} or of no finite priority: expected tree leaves (p + eps) ** alpha "
                            f"in [0, {MAX_LEAF:g}] of finite priorities p; the file was altered or is not a save"
                        )
                    prios.tree.update(np.arange(sl.start, sl.stop), staged)
                elif t.name == "_uses" and max_use is not None and staged.size and int(staged.max()) > max_use:
                    raise LayoutError(f"{file}: tensor '_uses' holds {int(staged.max())}, more than max_use={max_use}")
                elif target is not None and staged is not target:
                    target[...] = staged
            stamps = 2 * np.arange(n0, n1, dtype=np.int64) + 2
            stamps[~present] = 0
            arrays["_stamp"][sl] = stamps
            line.update(pos + n1 - first)
            n0 = n1
        pos += stop - first


READERS: dict[int, Callable[..., Buffer]] = {1: _v1, 2: _v1}
"""Version 2 is version 1 with ``options.frames`` (``frames.py``): the stored fields and ``_kind``."""
"""Format version -> reader. A later version adds its reader here and keeps the older ones."""


def pieces(buf: Buffer, *, wait: float = 1.0) -> Iterator[dict[str, np.ndarray]]:
    """The rows ``save`` would save, a piece at a time (lanes in turn, oldest first; holes left
    out), each piece copied intact (its fields, and ``_episode`` / ``_leaf`` / ``_uses`` where the
    buffer has them): for statistics over a buffer too large to copy at once. Unlike ``export``, a
    piece already given stays given when writers overwrite its rows later."""
    snap = _Snapshot(buf, wait)
    step = snap.piece_rows(buf.schema.row_bytes)
    while any(r.at < r.end for r in snap.runs):
        for run in snap.runs:
            if run.at < run.end:
                got = snap.copy(run, step)
                if got is None:
                    continue
                present = got.arrays.pop("_present")
                if present.all():
                    yield got.arrays
                elif present.any():
                    yield {name: a[present] for name, a in got.arrays.items()}


# -- plain numpy ------------------------------------------------------------------------------------------
def export(buf: Buffer) -> dict[str, np.ndarray]:
    """The rows ``save`` would save, as one copy in ``get`` order (lane by lane, oldest first):
    every field, ``index`` (the row ids) and, when the buffer keeps episodes, ``episode``. Holes
    (empty rows) are left out: ``index`` says which rows are there. Consistent as ``save`` is
    while writers run (see "A save while writers run"); the arrays are views of one allocation,
    made once. A prioritized buffer adds ``priority`` (each row's, as ``update_priorities`` set
    it; 0 once used up) and a ``max_use`` buffer ``uses``: ``from_arrays`` and ``import_rows``
    take all of them back. With ``next_of``/``stack``: the transitions that can be read now
    (``reader.gather``; not an episode's end row, not a lane's newest row still waiting for its
    next observation), rebuilt."""
    if buf.options.frames is not None:
        return _export_transitions(buf)
    snap = _Snapshot(buf, 1.0)
    keep = ("_episode", "_present", "_leaf", "_uses")
    tensors = [t for t in _tensors(buf.schema, buf.options) if t.name in buf.schema or t.name in keep]
    sink = _MemorySink()
    final, _ = _copy_rows(snap, tensors, sink, None)
    lanes = len(snap.runs)
    ids = np.concatenate([np.arange(r.keep, r.end, dtype=np.int64) * lanes + r.lane for r in snap.runs])
    at = final.offsets["_present"]
    present = sink.data[at:at + final.rows].astype(bool)
    rows = final.rows
    if not present.all():  # move every tensor's rows down over the holes, in place, front to back
        there = np.flatnonzero(present)
        breaks = np.flatnonzero(np.diff(there) != 1) + 1
        parts = np.split(there, breaks) if there.size else []
        for t in tensors:
            dst = final.offsets[t.name]
            for part in parts:
                src, nbytes = final.offsets[t.name] + int(part[0]) * t.row_bytes, part.size * t.row_bytes
                if src != dst:
                    sink.move(src, dst, nbytes)
                dst += nbytes
        ids, rows = ids[there], int(there.size)
    out: dict[str, np.ndarray] = {}
    order = {n: i for i, n in enumerate(buf.schema.names)}
    for t in sorted(tensors, key=lambda t: order.get(t.name, len(order))):
        if t.name == "_present":
            continue
        at = final.offsets[t.name]
        raw = sink.data[at:at + rows * t.row_bytes]
        out[t.name.lstrip("_")] = raw.view(t.dtype).reshape(rows, *t.shape)
    leaf = out.pop("leaf", None)
    prios = buf.priorities
    if leaf is not None and prios is not None and prios.prioritized:
        out["priority"] = prios.priorities_of(leaf)
    if "uses" in out:
        out["uses"] = out["uses"].astype(np.int64)
    out["index"] = ids
    return out


def _export_transitions(buf: Buffer) -> dict[str, np.ndarray]:
    """``export`` of a buffer with ``next_of``/``stack``: its readable transitions, rebuilt."""
    ring = buf.ring
    held = ring.held_ids()
    parts: list[dict[str, np.ndarray]] = []
    step = max(1, CHUNK_BYTES // max(1, buf.schema.row_bytes))
    for at in range(0, held.size, step):
        ids = held[at:at + step]
        rows = reader.gather(buf.block, ring, ids)
        reader.settle(buf.block, ring, ids, rows)
        keep = np.flatnonzero(rows.ok)
        batch = reader.assemble(buf.block, ids[keep], rows.subset(keep))
        part = {n: np.ascontiguousarray(batch.fields[n]) for n in buf.schema.names}
        part["index"] = batch.index
        if "episode" in batch.extras:
            part["episode"] = batch.extras["episode"]
        prios = buf.priorities
        if prios is not None and prios.prioritized:
            part["priority"] = prios.priorities_of(prios.tree.leaves[ring.slots(batch.index)])
        parts.append(part)
    if not parts:
        out = {f.name: np.empty((0, *f.shape), f.dtype) for f in buf.schema}
        out["index"] = np.empty(0, np.int64)
        return out
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def from_arrays(
    schema: Schema,
    arrays: Mapping[str, Any],
    factory: Callable[..., Buffer],
    capacity: int | None = None,
    **options: Any,
) -> Buffer:
    """A new buffer holding the rows of ``arrays`` (a dict of ``(k, *shape)`` arrays, one per
    field, as ``export`` gives), pushed in order. ``episode`` (required when ``episodes=True``),
    ``priority``, ``uses`` (with ``max_use``) and ``lane`` may come along, one per row.
    ``priority`` and ``uses`` are dropped when the new buffer has no use for them (a uniform
    sampler, no ``max_use``).

    Ids: with ``index`` (as ``export`` gives) and no ``lane``, the rows keep their ids when the new
    buffer's lanes allow it (in each lane ``id % lanes``, the row numbers ``id // lanes``
    increase): each lane starts at its first row number, the numbers in between that have no row
    are left empty (deleted), so ``take``, ``update_priorities`` and ``update`` with the old ids
    go on working. Otherwise the rows are numbered from 0: with ``envs=N`` they are whole steps of
    the N envs, env-major (row ``i`` into lane ``i % N``, as a push without ``lane=``; a row count
    that is not a multiple of N is refused), else they go into lane 0. ``capacity`` defaults to
    what the rows need (per lane, times lanes); with fewer slots only the newest rows stay.
    ``options`` are ``Buffer``'s (lanes, envs, sampler, max_use, episodes, name, seed)."""
    data = dict(arrays)
    index = data.pop("index", None)
    extra: dict[str, Any] = {key: data.pop(key) for key in ("episode", "priority", "lane", "uses") if key in data}
    k, _ = schema.validate(data)
    lanes = int(options.get("envs") or options.get("lanes") or 1)
    lane = np.asarray(extra["lane"], dtype=np.int64).reshape(-1) if "lane" in extra else None
    if lane is not None and lane.shape != (k,):
        raise CapacityError(f"from_arrays: lane: expected {k} lane numbers (one per row), got {lane.size}")
    # next_of/stack: an episode's last row is followed by an end row, so ids cannot be kept and a
    # push of c rows stores up to 2 c
    stored_once = options.get("next_of") is not None or options.get("stack") is not None
    keep = _kept_rows(index, k, lanes) if lane is None and not stored_once else None
    envs = options.get("envs")
    envs = envs if isinstance(envs, int) else 1  # a bad envs= is the factory's to refuse
    spread = lane is None and keep is None and envs > 1  # as a push without lane=
    if spread and k % envs:
        raise FieldError(
            f"from_arrays: envs={envs} spreads rows as whole steps of every env, env-major (row i into lane "
            f"i % {envs}), so it needs a multiple of {envs} rows, got {k}; pass lane= (one lane number per row)"
        )
    if capacity is None:
        if keep is not None:
            per_lane = max((int(r[-1] - r[0] + 1) for r in keep.values()), default=1)
        else:
            per_lane = int(np.bincount(lane).max()) if lane is not None and k else k // envs if spread else k
        if stored_once:
            per_lane += _episode_ends(schema, data)  # at most one end row each (all in one lane at worst)
            per_lane += _lead_rows(schema, data, options.get("next_of"), options.get("stack"), lane)
            spec = Frames.make(schema, options.get("next_of"), options.get("stack"))
            if spec is not None:  # the least a lane of such a buffer may hold (layout.Options)
                per_lane = max(per_lane, 2 * (spec.depth + spec.ahead + 1))
        capacity = max(per_lane, 1) * lanes
    buf = factory(schema, capacity, **options)
    try:
        prios = buf.priorities
        if prios is None or not prios.prioritized:
            extra.pop("priority", None)
        uses = extra.pop("uses", None)
        if keep is not None:
            _push_keeping_ids(buf, data, extra, keep, np.asarray(index, dtype=np.int64).reshape(-1), k)
            if uses is not None and k:
                set_uses(buf, np.asarray(index, dtype=np.int64).reshape(-1), uses)
            return buf
        per = buf.lane_capacity if buf.options.frames is None else max(1, buf.lane_capacity // 2)
        step = per * (envs if spread else 1)  # with envs: whole steps, a lane's capacity each
        single = k == 1 and all(np.ndim(a) == len(schema[n].shape) for n, a in data.items())
        line = Line(f"from_arrays into {buf.name!r}", k)
        for i in range(0, k, step):
            line.update(i)
            part = slice(i, i + step)
            both: dict[str, Any] = {**data, **extra}
            cut = {key: v if single or np.ndim(v) == 0 else np.asarray(v)[part] for key, v in both.items()}
            # resume: rows exported from a buffer that lapped an episode's first steps (lead rows)
            ids = buf.push({n: cut[n] for n in data}, lane=None if spread else 0 if lane is None else lane[part],
                           episode=cut.get("episode"), priority=cut.get("priority"), resume=True)
            if uses is not None:
                set_uses(buf, ids, np.asarray(uses).reshape(-1)[part] if np.ndim(uses) else uses)
        line.update(k)
        line.close()
    except BaseException:
        buf.__exit__(None, None, None)
        raise
    return buf


def _episode_ends(schema: Schema, data: dict[str, Any]) -> int:
    """Rows of ``data`` that end an episode (``frames.ENDS``): each takes an end row with next_of."""
    final = None
    for name in ENDS:
        if name in data:
            f = np.asarray(data[name]).reshape(-1) != 0
            final = f if final is None else final | f
    return 0 if final is None else int(final.sum())


def _lead_rows(schema: Schema, data: dict[str, Any], next_of: Any, stack: Any, lane: np.ndarray | None) -> int:
    """At most how many lead rows the rows of ``data`` take with ``stack`` (``frames.py``): an
    episode start (the first row, one after an episode's last, a lane's first) whose stacks are
    not padding resumes an episode cut before it, and its older frames take ``k - 1`` rows."""
    spec = Frames.make(schema, next_of, stack)
    if spec is None or not spec.stack:
        return 0
    k = int(np.asarray(data[spec.stack[0].name]).shape[0])
    final = np.zeros(k, bool)
    for name in spec.ends:
        if name in data:
            final |= np.broadcast_to(np.asarray(data[name]).reshape(-1) != 0, (k,))
    starts = np.concatenate([[True], final[:-1]]) if k else final
    if lane is not None and k:
        order = np.argsort(lane, kind="stable")  # a lane's first row starts too
        firsts = order[np.concatenate([[True], lane[order][1:] != lane[order][:-1]])]
        starts[firsts] = True
    at = np.flatnonzero(starts)
    cut = np.zeros(at.size, bool)
    for st in spec.stack:
        fr = frames_of(st, np.asarray(data[st.name])[at])
        older, newest = fr[:, :-1].reshape(at.size, st.k - 1, -1), fr[:, -1:].reshape(at.size, 1, -1)
        cut |= ~((older == newest).all(axis=(1, 2)) | (older == 0).all(axis=(1, 2)))
    return int(cut.sum()) * (max(st.k for st in spec.stack) - 1)


def _kept_rows(index: Any, k: int, lanes: int) -> dict[int, np.ndarray] | None:
    """Per lane of a new buffer with ``lanes`` lanes, the row numbers ``index`` names, when
    every lane's increase (the ids can be kept); else ``None``."""
    if index is None:
        return None
    ids = np.asarray(index)
    if ids.dtype.kind not in "iu" or ids.shape != (k,) or not k or ids.min() < 0:
        return None
    ids = ids.astype(np.int64)
    out = {}
    for lane in np.unique(ids % lanes):
        rows = ids[ids % lanes == lane] // lanes
        if (np.diff(rows) <= 0).any():
            return None
        out[int(lane)] = rows
    return out


def _push_keeping_ids(buf: Buffer, data: dict[str, Any], extra: dict[str, Any], keep: dict[int, np.ndarray],
                      index: np.ndarray, k: int) -> None:
    """Push each lane's rows at their own row numbers (see ``from_arrays``); the numbers between
    them get a copy of the row before, deleted once pushed."""
    lanes = buf.lanes
    cursors = _arrays(buf)["_lanes"]
    with buf.ring.lock:  # a new buffer nobody else has pushed to yet: each lane starts at its first row
        for lane, rows in keep.items():
            cursors[lane, Lane.BASE] = int(rows[0])
            cursors[lane, Lane.CURSOR] = int(rows[0])
    single = k == 1 and all(np.ndim(a) == len(buf.schema[n].shape) for n, a in data.items())
    rows_of = {n: np.asarray(a)[np.newaxis] if single else np.asarray(a) for n, a in data.items()}
    more = {key: np.broadcast_to(np.asarray(v), (k,)) if np.ndim(v) == 0 else np.asarray(v).reshape(k)
            for key, v in extra.items()}
    for lane, rows in keep.items():
        at = np.flatnonzero(index % lanes == lane)  # this lane's rows in the arrays, in order
        span = int(rows[-1] - rows[0] + 1)
        pos = rows - rows[0]
        have = np.zeros(span, bool)
        have[pos] = True
        # each row number's source: its own row, or for a hole the row before it
        src = at[np.searchsorted(pos, np.arange(span), side="right") - 1]
        step = buf.lane_capacity
        for i in range(0, span, step):
            part = src[i:i + step]
            got = buf.push({n: a[part] for n, a in rows_of.items()}, lane=lane,
                           episode=more["episode"][part] if "episode" in more else None,
                           priority=more["priority"][part] if "priority" in more else None)
            holes = got[~have[i:i + step]]
            if holes.size:
                buf.delete(holes)


def set_uses(buf: Buffer, ids: np.ndarray, uses: Any) -> None:
    """Give the rows ``ids`` these use counts (``max_use`` buffers; ignored otherwise); rows that
    reach ``max_use`` leave the sampling set. Rows gone meanwhile are skipped."""
    prios = buf.priorities
    if prios is None or prios.uses is None:
        return
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    u = np.broadcast_to(np.asarray(uses, dtype=np.int64).reshape(-1) if np.ndim(uses) else np.asarray(uses), ids.shape)
    if u.size and (u < 0).any():
        raise CapacityError(f"uses: expected counts >= 0, got {u[u < 0][:3].tolist()}")
    ring = buf.ring
    with ring.lock:
        live = ring.current(ids)
        prios.set_uses(ring.slots(ids[live]), u[live])


def import_rows(buf: Buffer, arrays: Mapping[str, Any]) -> np.ndarray:
    """Push the rows of ``arrays`` (as ``export`` gives them, from any buffer of the same schema)
    into the existing buffer ``buf`` (DI-engine's ``import_data``), with their ``episode``,
    ``priority``, ``uses`` and ``lane`` when given (``priority`` and ``uses`` dropped where ``buf``
    has no use for them). The rows get new ids, in order (``index`` is ignored: ids never repeat
    in a buffer); returns them."""
    data = dict(arrays)
    data.pop("index", None)
    extra: dict[str, Any] = {key: data.pop(key) for key in ("episode", "priority", "lane", "uses") if key in data}
    prios = buf.priorities
    if prios is None or not prios.prioritized:
        extra.pop("priority", None)
    uses = extra.pop("uses", None)
    k, _ = buf.schema.validate(data)
    # the pushes go in pieces: check what a later piece could refuse first, so an error changes nothing
    buf.options.check_episode(extra.get("episode"), k)
    if extra.get("priority") is not None and prios is not None:
        prios.check(extra["priority"], k, "import_rows: priority")
    if uses is not None and prios is not None and prios.uses is not None and (np.asarray(uses) < 0).any():
        raise CapacityError(f"uses: expected counts >= 0, got {np.asarray(uses)[np.asarray(uses) < 0][:3].tolist()}")
    lane = np.asarray(extra.get("lane", 0))
    if lane.size and lane.dtype.kind in "iuf" and (lane.min() < 0 or lane.max() >= buf.lanes):
        raise CapacityError(f"lane: expected lane numbers in [0, {buf.lanes}), got {lane.min()}..{lane.max()}")
    step = buf.lane_capacity if buf.options.frames is None else max(1, buf.lane_capacity // 2)  # + end rows
    if "lane" not in extra and buf.options.envs:
        step *= buf.options.envs  # env-major steps of every env: lane_capacity rows in each lane
    single = k == 1 and all(np.ndim(a) == len(buf.schema[n].shape) for n, a in data.items())
    out = []
    for i in range(0, k, max(step, 1)):
        part = slice(i, i + step)
        both: dict[str, Any] = {**data, **extra}
        cut = {key: v if single or np.ndim(v) == 0 else np.asarray(v)[part] for key, v in both.items()}
        opts = {key: cut[key] for key in ("lane", "episode", "priority") if key in cut}
        # rows exported from a buffer that lapped an episode's first steps resume it (lead rows)
        ids = buf.push({n: cut[n] for n in data}, resume=True, **opts)
        if uses is not None:
            set_uses(buf, ids, np.asarray(uses).reshape(-1)[part] if np.ndim(uses) else uses)
        out.append(ids)
    return np.concatenate(out) if out else np.empty(0, np.int64)
