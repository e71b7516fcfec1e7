"""Writing a checkpoint: ``checkpoint(buf, path)``, the first time every row (as ``save``), then
what changed since the last checkpoint to the same folder (``manifest.py``'s docstring is the
format and says which rows each checkpoint writes). The rows are read as a save reads them
(``protocol/snapshot.py``: consistent while writers run); the log of edits (``Ring.log_edits``)
says which older rows changed in place, and a checkpoint that cannot tell (the log overran)
writes every row again.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import mmap
import os
import secrets
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FieldError, LayoutError
from ..protocol.frames_push import Last
from ..protocol.layout import EDIT_LOG, Counter
from ..protocol.rows import pieces
from ..protocol.snapshot import at_one_moment
from .format import ALIGN, FORMAT, Layout, Tensor, tensor_of, tensors, version_of
from .loading import pread_into
from .manifest import (
    BLOCKS,
    CHECKPOINT_VERSION,
    CHUNK,
    LOCK,
    MANIFEST,
    SAMPLER_STATE,
    Manifest,
    chunk_name,
    open_chunk,
    read_manifest,
    row_tensors,
)
from .saving import create_file, open_folder, pwrite, release
from .snapshot import CHUNK_BYTES, Buffer, Piece, Run, Snapshot, copy_rows

__all__ = ["checkpoint"]

_TRIES = 3
_BIG = 10**16
"""More than any number a header holds (``format.MAX_BLOCK``): sizes the room reserved for it."""
_EDITS, _EDITS_BEGUN = int(Counter.EDITS), int(Counter.EDITS_BEGUN)
_SYNC_FILE_RANGE_WRITE = 2
"""``sync_file_range``'s flag to start writing the pages out, without waiting (``<linux/fs.h>``)."""


# -- the segments of a lane --------------------------------------------------------------------------
def _clip(segs: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """The segments' rows within ``[lo, hi)``."""
    out = []
    for n0, n1, c, b, at in segs:
        a, z = max(n0, lo), min(n1, hi)
        if a < z:
            out.append([a, z, c, b, at + a - n0])
    return out


def _overlay(segs: list[list[int]], new: list[list[int]]) -> list[list[int]]:
    """``segs`` with the rows of ``new`` (sorted, disjoint) taken from ``new``; sorted, merged."""
    cuts = [(s[0], s[1]) for s in new]
    out: list[list[int]] = []
    i = 0
    for n0, n1, c, b, at in segs:
        while i < len(cuts) and cuts[i][1] <= n0:
            i += 1
        cur, k = n0, i
        while cur < n1:
            if k < len(cuts) and cuts[k][0] < n1:
                a, z = cuts[k]
                if a > cur:
                    out.append([cur, a, c, b, at + cur - n0])
                cur = max(cur, z)
                k += 1
            else:
                out.append([cur, n1, c, b, at + cur - n0])
                cur = n1
    merged: list[list[int]] = []
    for s in sorted(out + [list(s) for s in new], key=lambda s: s[0]):
        last = merged[-1] if merged else None
        if last is not None and last[1] == s[0] and last[2:4] == s[2:4] and last[4] + last[1] - last[0] == s[4]:
            last[1] = s[1]
        else:
            merged.append(s)
    return merged


def _ranges(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique row numbers as ``[n0, n1)`` ranges of consecutive ones."""
    if not rows.size:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(p[0]), int(p[-1]) + 1) for p in np.split(rows, breaks)]


# -- a chunk file --------------------------------------------------------------------------------------
@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def _start_writeback(fd: int, at: int = 0, nbytes: int = 0) -> None:
    """Start writing bytes ``[at, at + nbytes)`` of ``fd`` to the disk, without waiting
    (``sync_file_range``): they go while the rest is written, and the ``fsync`` waits for what is
    left. Only whole pages of the range (those cut by its ends would be written again with their
    other part); ``nbytes`` 0: every page from ``at`` on (the file is complete). Only a head start:
    without the call (not Linux), or where it fails (a file system without it), the ``fsync``
    writes them all."""
    call = _sync_file_range()
    a = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE
    z = (at + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE if nbytes else a
    if call is not None and (a < z or not nbytes):
        call(fd, a, z - a, _SYNC_FILE_RANGE_WRITE)


class _Chunk:
    """A chunk being written: tensors appended to the data section; the header written last into
    the room reserved for it (an upper bound: every number in it at most ``_BIG``). ``sync``: its
    pages start to the disk as they are written (``_start_writeback``); the caller waits for them
    (``fsync``)."""

    def __init__(self, dfd: int, tmp: str, chunk_id: str, version: int, planned: dict[str, Tensor],
                 sync: bool) -> None:
        self.fd, self.sync = create_file(tmp, dfd), sync
        self.meta = {"format": FORMAT, "format_version": str(version), "save_id": chunk_id, "checkpoint": "1"}
        most: dict[str, Any] = {"__metadata__": self.meta}
        for n, t in planned.items():
            most[n] = {"dtype": t.code, "shape": t.file_shape(_BIG), "data_offsets": [_BIG, _BIG]}
        self.data_start = -(-(8 + len(json.dumps(most, separators=(",", ":")))) // ALIGN) * ALIGN
        self.at = 0
        self.entries: dict[str, tuple[str, list[int], int, int]] = {}

    def add(self, name: str, t: Tensor, rows: int, begin: int | None = None) -> int:
        """Enter ``rows`` rows of ``t`` as tensor ``name`` at ``begin`` (default: the end); returns
        the tensor's data offset."""
        begin = self.at if begin is None else begin
        end = begin + rows * t.row_bytes
        self.entries[name] = (t.code, t.file_shape(rows), begin, end)
        self.at = max(self.at, end)
        return begin

    def write(self, offset: int, a: np.ndarray) -> None:
        """The bytes of ``a`` at data offset ``offset``."""
        pwrite(self.fd, a, self.data_start + offset)
        if self.sync:
            _start_writeback(self.fd, self.data_start + offset, a.nbytes)

    def finish(self) -> int:
        """Write the header (tensors in data order); returns the file's size."""
        head: dict[str, Any] = {"__metadata__": self.meta}
        for name, (code, shape, begin, end) in sorted(self.entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            head[name] = {"dtype": code, "shape": shape, "data_offsets": [begin, end]}
        text = json.dumps(head, separators=(",", ":")).encode()
        assert len(text) + 8 <= self.data_start, "the reserved room is an upper bound"
        size = self.data_start + self.at
        os.ftruncate(self.fd, size)
        pwrite(self.fd, struct.pack("<Q", self.data_start - 8) + text + b" " * (self.data_start - 8 - len(text)), 0)
        if self.sync:
            _start_writeback(self.fd)
        return size

    def rows(self) -> int:
        """The rows of the chunk's blocks."""
        return sum(self.entries[f"{b}/_present"][1][0] for b in BLOCKS)

    def close(self) -> None:
        """Close the file (written or not)."""
        os.close(self.fd)


class _BlockSink:
    """``copy_rows``' sink for block ``new``: its rows at the chunk's data offsets from 0."""

    def __init__(self, chunk: _Chunk, files: list[Tensor]) -> None:
        self.chunk, self.files = chunk, files

    def start(self, plan: Layout) -> None:
        """Nothing to reserve: the chunk grows as it is written."""

    def write(self, offset: int, a: np.ndarray) -> None:
        """The bytes of ``a`` at ``offset``."""
        self.chunk.write(offset, a)

    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Move ``nbytes`` from ``src`` down to ``dst``."""
        fd, start = self.chunk.fd, self.chunk.data_start
        for done in range(0, nbytes, CHUNK_BYTES):
            k = min(CHUNK_BYTES, nbytes - done)
            pwrite(fd, os.pread(fd, k, start + src + done), start + dst + done)

    def finish(self, final: Layout) -> None:
        """Enter the block's tensors as laid out by ``final``."""
        for t in self.files:
            self.chunk.add(f"new/{t.name}", t, final.rows, final.offsets[t.name])


# -- the checkpoint ----------------------------------------------------------------------------------------
def checkpoint(buf: Buffer, path: str | os.PathLike[str], *, wait: float = 1.0, sync: bool = True,
               pending: dict[int, Last] | None = None, generator: dict[str, Any] | None = None,
               ranks: dict[str, int] | None = None, device_generator: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a checkpoint of ``buf`` to the folder ``path`` (``manifest.py``): every row the first
    time, then what changed since the last one. ``wait``: as ``save``'s. ``sync``: ``fsync`` the
    chunk, the manifest and the folder (so that a checkpoint outlives a power cut, not only a
    killed process). ``pending``: this process's last rows per lane (``frames_push.Pusher.last``);
    ``generator``: the sampling generator's state; ``ranks``: a rank's step and epochs (with its
    world size and seed); ``device_generator``: a device copy's generator state. Returns a
    summary: path, sequence, full (whether every row was written), rows (of the checkpoint), new,
    edited and kept (rows written to each block), bytes (of the chunk), folder_bytes (every
    chunk), seconds."""
    t0 = time.perf_counter()
    folder = Path(path)
    dfd, _ = open_folder(folder)
    try:
        lock = os.open(LOCK, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            old = read_manifest(folder, missing_ok=True)
            prev = old if _same_buffer(buf, old) else None
            for _ in range(_TRIES):
                got = _write(buf, folder, dfd, prev, old, wait, sync, pending or {},
                             {"generator": generator, "ranks": ranks, "device_generator": device_generator})
                if got is not None:
                    got["seconds"] = time.perf_counter() - t0
                    return got
                prev = None  # the log of edits overran: every row
            raise LayoutError(
                f"checkpoint: more than {EDIT_LOG} rows of {buf.name!r} were updated or deleted while each of "
                f"{_TRIES} checkpoints ran, so none could tell which rows changed; checkpoint again when the "
                "updates pause")
        finally:
            os.close(lock)
    finally:
        os.close(dfd)


def _same_buffer(buf: Buffer, prev: Manifest | None) -> bool:
    """Whether ``prev`` is a checkpoint of ``buf`` that this one may add to (``manifest.py``)."""
    if prev is None:
        return False
    if prev.meta["schema"] != buf.schema.to_json() or prev.meta["options"] != buf.options.to_json():
        raise FieldError(
            f"checkpoint: {prev.file} is a checkpoint of a buffer with another schema or options than "
            f"{buf.name!r}; checkpoint it to another folder, or remove that one first")
    edits = int(buf.block.counters[_EDITS])
    return prev.buffer == buf.name and prev.inserted <= buf.ring.inserted and prev.edits <= edits


@dataclass
class _Lane:
    """One lane's rows in the new checkpoint: ``[keep, run.end)``, ``segs`` where they are."""

    run: Run
    keep: int
    start: int
    segs: list[list[int]]
    present: Any = None
    sampler: Any = None
    at_lock: int = 0


def _write(buf: Buffer, folder: Path, dfd: int, prev: Manifest | None, old: Manifest | None, wait: float,
           sync: bool, pending: dict[int, Last], sampling: dict[str, Any]) -> dict[str, Any] | None:
    """One try at a checkpoint; ``None`` when the log of edits overran (the caller writes every row)."""
    counters = buf.block.counters
    since = prev.edits if prev is not None else int(counters[_EDITS])
    if max(int(counters[_EDITS_BEGUN]), int(counters[_EDITS])) - since > EDIT_LOG:
        return None
    files = row_tensors(buf.schema, buf.options)
    everything = tensors(buf.schema, buf.options)
    sequence = (old.sequence if old is not None else 0) + 1
    chunks = list(prev.chunks) if prev is not None else []
    me = len(chunks)  # this chunk's index until compaction renumbers them
    chunk_id = secrets.token_hex(8)
    tmp = f".{chunk_name(sequence)}.{chunk_id}.tmp"
    planned = {f"{b}/{t.name}": t for b in BLOCKS for t in files}
    planned |= {t.name: t for t in everything if t.name in SAMPLER_STATE}
    planned |= {f"_last/{f.name}": tensor_of(f.name, f.shape, f.dtype) for f in buf.schema}
    mtmp, mfd, written = f".{MANIFEST}.{chunk_id}.tmp", -1, False
    chunk = _Chunk(dfd, tmp, chunk_id, version_of(buf.options), planned, sync)
    try:
        snap, lanes, new_rows = _copy_new(buf, chunk, files, prev, wait, me)
        edits, state = _locked(buf, lanes, prev is None or buf.priorities is not None)
        if max(state["begun"], edits) - since > EDIT_LOG:
            return None
        edited = _read_again(snap, lanes, _again(buf, lanes, since, edits))
        block1: dict[int, list[list[int]]] = {}
        at = 0
        for piece in edited:
            block1.setdefault(piece.lane, []).append([piece.start, piece.start + piece.rows, me, 1, at])
            at += piece.rows
        _write_block(chunk, files, "edited", edited, at)
        for ln in lanes:
            ln.segs = _overlay(_clip(ln.segs, ln.keep, ln.run.end), block1.get(ln.run.lane, []))
            for piece in edited:
                a = max(piece.start, ln.at_lock)  # the rows of it whose stamps _locked read
                if piece.lane == ln.run.lane and a < piece.start + piece.rows:
                    ln.present[a - ln.at_lock:piece.start + piece.rows - ln.at_lock] = piece.arrays["_present"][a - piece.start:]
        kept, keep_chunks = _compact(folder, buf, chunk, files, chunks, lanes, me)
        rows = sum(ln.run.end - ln.keep for ln in lanes)
        for t in (t for t in everything if t.name in SAMPLER_STATE):
            vals = np.concatenate([ln.sampler[t.name][ln.keep - ln.at_lock:] * ln.present[ln.keep - ln.at_lock:]
                                   for ln in lanes])
            chunk.write(chunk.add(t.name, t, rows), vals.astype(t.dtype))  # a hole's 0
        lasts = _pending(lanes, pending)
        for n in buf.schema.names:
            if lasts and all(n in last.values for _, last in lasts):
                f = buf.schema[n]
                t = tensor_of(n, f.shape, f.dtype)
                chunk.write(chunk.add(f"_last/{n}", t, len(lasts)), np.stack([np.asarray(last.values[n], f.dtype)
                                                                              for _, last in lasts]))
        size = chunk.finish()
        listed = [chunks[c] for c in keep_chunks[:-1]] + [
            {"file": chunk_name(sequence), "id": chunk_id, "bytes": size, "rows": chunk.rows()}]
        manifest = _manifest(buf, lanes, rows, state, sequence, listed, lasts, sampling, edits)
        mfd = create_file(mtmp, dfd)
        pwrite(mfd, (json.dumps(manifest, indent=1) + "\n").encode(), 0)
        if sync:  # the manifest's pages go with the chunk's last ones, then both are waited for
            _start_writeback(mfd)
            os.fsync(chunk.fd)
            os.fsync(mfd)
        os.replace(tmp, chunk_name(sequence), src_dir_fd=dfd, dst_dir_fd=dfd)
        if sync:  # the chunk's name durable before a manifest names it (a power cut, not just a kill)
            os.fsync(dfd)
        os.replace(mtmp, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
        written = True
    finally:
        chunk.close()
        if mfd >= 0:
            os.close(mfd)
        # a renamed chunk stays (no manifest names it: the next checkpoint's _tidy removes it)
        for name in () if written else (tmp, mtmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
    if sync:
        os.fsync(dfd)
    _tidy(dfd, {c["file"] for c in listed})
    return {"path": str(folder), "sequence": sequence, "full": prev is None, "rows": rows, "new": new_rows,
            "edited": at, "kept": kept, "bytes": size, "folder_bytes": sum(c["bytes"] for c in listed)}


def _copy_new(buf: Buffer, chunk: _Chunk, files: list[Tensor], prev: Manifest | None, wait: float,
              me: int) -> tuple[Snapshot, list[_Lane], int]:
    """Block ``new``: each lane's rows after the previous checkpoint's (every row without one),
    written straight from the shared columns (``_direct``), or read as a save reads them where
    that fails; each lane's rows and segments so far."""
    snap = Snapshot(buf, wait, None if prev is None else [stop for _, stop, _ in prev.lanes])  # the new rows
    lanes: list[_Lane] = []
    for run in snap.runs:
        keep = start = run.keep
        if prev is not None:
            first, stop, _ = prev.lanes[run.lane]
            start = min(max(run.keep, stop), run.end)
            if run.keep == min(max(run.first, stop), run.stop):  # no new row found overwritten: the rows before
                keep = max(run.first, min(first, start))  # start are the previous checkpoint's (_locked checks them)
        run.keep = run.at = start
        lanes.append(_Lane(run, keep, start, []))
    final = _direct(snap, chunk, files)
    if final is None:
        final, _ = copy_rows(snap, files, _BlockSink(chunk, files))
    for ln in lanes:
        run = ln.run
        if run.keep > ln.start:  # writers overwrote rows while they were copied: the older ones went too
            ln.keep = run.keep
        older = _clip(prev.segments[run.lane], ln.keep, run.keep) if prev is not None else []
        new = [[run.keep, run.end, me, 0, final.lane_at[run.lane]]] if run.end > run.keep else []
        ln.segs = _overlay(older, new)
    return snap, lanes, final.rows


def _direct(snap: Snapshot, chunk: _Chunk, files: list[Tensor]) -> Layout | None:
    """Write each lane's rows ``[keep, end)`` of ``snap`` into block ``new`` straight from the
    shared columns (no copy in between: a lane's rows are consecutive slots but where the ring
    wraps), then check them by the reader's rule (``protocol/rows.py``): each row's stamp said
    committed at the scan and says the same once every byte is written, and it was not cleared.
    A row updated in place meanwhile keeps its stamp, but the log of edits names it, so ``_again``
    reads it again into block ``edited``, which takes its place. The layout of the block, or
    ``None`` (nothing entered) when a lane has holes (a hole's bytes are zeros) or a row fails the
    rule: the caller then reads the rows as a save does, into the same offsets."""
    block, lc = snap.buf.block, snap.lc
    runs = snap.runs
    if any(run.hole_count() for run in runs):
        return None
    # (lane, n0, n1, first slot): rows whose slots do not wrap
    spans = [(run.lane, n0, n1, sl.start) for run in runs for n0, n1, sl in pieces(run.lane, run.keep, run.end, lc)]
    columns: dict[str, Any] = {**block.fields, **block.row}
    if any(t.name != "_present" and columns.get(t.name) is None for t in files):
        return None
    plan = Layout(files, [(run.keep, run.end) for run in runs])
    for t in files:
        column = columns.get(t.name)
        for lane, n0, n1, s0 in spans:
            rows = np.ones(n1 - n0, bool) if column is None else column[s0:s0 + n1 - n0]  # None: _present, no holes
            chunk.write(plan.at(t, lane, n0), rows)
    if not all(snap.unchanged(lane, n0, n1) for lane, n0, n1, _ in spans):
        return None
    for run in runs:
        run.at = run.end
    _BlockSink(chunk, files).finish(plan)
    return plan


def _locked(buf: Buffer, lanes: list[_Lane], every: bool) -> tuple[int, dict[str, Any]]:
    """At one moment (``protocol.snapshot.at_one_moment``): the log of edits' count, each lane's
    rows that are there (as ``present``, the empty ones not), leaves and use counts, the counters
    and the largest priority, of each lane's rows ``[keep, end)`` when ``every`` (leaves and use
    counts are wanted, or there is no previous checkpoint), else of its new rows only (the older
    ones deleted since are in the log of edits). Then each lane's rows up to the newest one
    overwritten by then go, and those before the lane's first row then (writers take a lane's
    slots in row order, so those are overwritten, or cleared)."""
    now = at_one_moment(buf, [(ln.run.lane, ln.keep if every else max(ln.keep, ln.start), ln.run.end) for ln in lanes])
    for i, ln in enumerate(lanes):
        lo = ln.keep if every else max(ln.keep, ln.start)
        ln.sampler, ln.at_lock = now.sampler[i], lo
        lapped = np.flatnonzero(~now.there[i] & ~now.empty[i])
        if lapped.size:
            ln.keep = lo + int(lapped[-1]) + 1
        ln.keep = min(max(ln.keep, int(now.counters["first"][ln.run.lane])), ln.run.end)
        ln.present = ~now.empty[i]
    c = now.counters
    state = {"begun": c["edits_begun"], "stats": c["stats"], "inserted": c["inserted"], "max_priority": c["max_priority"],
             "counters": {k: c[k] for k in ("sample_calls", "removed", "interleaved")}}
    return c["edits"], state


def _again(buf: Buffer, lanes: list[_Lane], since: int, edits: int) -> list[tuple[int, int, int]]:
    """``(lane, n0, n1)``: the rows to read again, those the log of edits names since ``since``
    (updated or deleted; in the log until ``edits``) and those found empty."""
    lc = buf.ring.lane_capacity
    logged = buf.block.edits[np.arange(since, edits) % EDIT_LOG] if edits > since else np.empty(0, np.int64)
    logged = np.unique(logged)
    out = []
    for ln in lanes:
        run = ln.run
        mine = logged[(logged // lc) == run.lane] - run.lane * lc
        rows = ln.keep + (mine - ln.keep % lc) % lc
        rows = rows[rows < run.end]
        empty = ln.at_lock + np.flatnonzero(~ln.present)
        empty = empty[empty >= ln.keep]
        out += [(run.lane, a, z) for a, z in _ranges(np.union1d(rows, empty))]
    return out


def _read_again(snap: Snapshot, lanes: list[_Lane], again: list[tuple[int, int, int]]) -> list[Piece]:
    """The rows ``again`` names, read as a save reads them; a row overwritten meanwhile drops its
    lane's rows up to it (``_Lane.keep``), and the pieces of rows dropped."""
    out: list[Piece] = []
    for lane, n0, n1 in again:
        ln = lanes[lane]
        n0 = max(n0, ln.keep)
        if n1 <= n0:
            continue
        run = Run(lane, ln.run.first, ln.run.stop, ln.run.base, n1, n0, n0, np.empty(0, np.int64))
        while run.at < run.end:
            piece = snap.copy(run, n1 - n0)
            if piece is not None:
                out.append(piece)
        ln.keep = max(ln.keep, min(run.keep, n1) if run.keep > n0 else ln.keep)
    return [p for p in out if p.start >= lanes[p.lane].keep]


def _write_block(chunk: _Chunk, files: list[Tensor], block: str, pieces: list[Piece], rows: int) -> None:
    """Append block ``block``: the rows of ``pieces``, in order."""
    for t in files:
        at = chunk.add(f"{block}/{t.name}", t, rows)
        for piece in pieces:
            chunk.write(at, piece.arrays[t.name])
            at += piece.rows * t.row_bytes


def _compact(folder: Path, buf: Buffer, chunk: _Chunk, files: list[Tensor], chunks: list[dict[str, Any]],
             lanes: list[_Lane], me: int) -> tuple[int, list[int]]:
    """Block ``kept``: the rows the lanes take from older chunks less than half of whose rows they
    use, copied from those chunks; the segments renumbered for the chunks kept (``me`` last).
    Returns the rows copied and the chunks kept (old indexes)."""
    used = np.zeros(me + 1, np.int64)
    for ln in lanes:
        for s in ln.segs:
            used[s[2]] += s[1] - s[0]
    squeeze = [c for c in range(me) if 0 < used[c] and 2 * used[c] < chunks[c]["rows"]]
    moved = [(ln, s) for ln in lanes for s in ln.segs if s[2] in squeeze]
    rows = sum(s[1] - s[0] for _, s in moved)
    opened = {c: open_chunk(folder, chunks[c], buf.schema, buf.options) for c in squeeze}
    try:
        for t in files:
            dst = chunk.add(f"kept/{t.name}", t, rows)
            for _, (n0, n1, c, b, src_at) in moved:
                src = opened[c]
                begin = src.offset(f"{BLOCKS[b]}/{t.name}", src_at, t.row_bytes)
                nbytes = (n1 - n0) * t.row_bytes
                for done in range(0, nbytes, CHUNK_BYTES):
                    staged = np.empty(min(CHUNK_BYTES, nbytes - done), np.uint8)
                    pread_into(src.fd, staged, begin + done, src.file)
                    chunk.write(dst + done, staged)
                dst += nbytes
    finally:
        for src in opened.values():
            src.close()
    at = 0
    for _, s in moved:  # in place: the segment now names its rows in block kept
        s[2], s[3], s[4] = me, 2, at
        at += s[1] - s[0]
    keep = [c for c in range(me) if used[c] > 0 and c not in squeeze] + [me]
    number = {c: i for i, c in enumerate(keep)}
    for ln in lanes:
        ln.segs = _overlay(ln.segs, [])  # merges what block kept made consecutive
        for s in ln.segs:
            s[2] = number[s[2]]
    return rows, keep


def _pending(lanes: list[_Lane], pending: dict[int, Last]) -> list[tuple[int, Last]]:
    """The pending rows kept: each lane's last row this process pushed, when it is the lane's newest."""
    return [(lane, last) for lane, last in sorted(pending.items())
            if 0 <= lane < len(lanes) and lanes[lane].keep <= last.row == lanes[lane].run.end - 1]


def _manifest(buf: Buffer, lanes: list[_Lane], rows: int, state: dict[str, Any], sequence: int,
              chunks: list[dict[str, Any]], lasts: list[tuple[int, Last]], sampling: dict[str, Any],
              edits: int) -> dict[str, Any]:
    """The manifest's object (``manifest.py``); ``sampling``: its ``generator``, ``ranks`` and
    ``device_generator``."""
    return {
        "format": FORMAT,
        "format_version": version_of(buf.options),
        "shmbuffer_version": release(),
        "save_id": chunks[-1]["id"],
        "name": buf.name,
        "schema": buf.schema.to_json(),
        "options": buf.options.to_json(),
        "rows": rows,
        "lanes": [{"first": ln.keep, "stop": ln.run.end, "base": min(ln.run.base, ln.keep)} for ln in lanes],
        "sampler_state": None if state["max_priority"] is None else {"max_priority": state["max_priority"]},
        "stats": state["stats"],
        "counters": state["counters"],
        "tensors": [t.to_json(rows) for t in tensors(buf.schema, buf.options)],
        "checkpoint": {
            "version": CHECKPOINT_VERSION, "sequence": sequence, "buffer": buf.name, "inserted": state["inserted"],
            "edits": edits, "chunks": chunks, "segments": [ln.segs for ln in lanes],
            "pending": [{"lane": lane, "row": last.row, "final": bool(last.final),
                         "episode": None if last.episode is None else int(last.episode)} for lane, last in lasts],
            **sampling,
        },
    }


def _tidy(dfd: int, listed: set[str]) -> None:
    """Remove the chunks the manifest does not name and temporary files of killed checkpoints."""
    for entry in os.listdir(dfd):
        if (CHUNK.fullmatch(entry) and entry not in listed) or (entry.startswith(".") and entry.endswith(".tmp")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=dfd)
