"""The checkpoint format: a folder that ``checkpoint.py`` writes a checkpoint at a time (only
what changed since the last one) and ``resume.py`` reads back. The rows are written in the save
format's tensors (``format.py``); this docstring is the spec of the folder, byte by byte where
it is not a save's, and ``read_manifest`` / ``open_chunk`` check what it says.

The folder
----------
``manifest.json`` (the checkpoint: which rows are where) and chunk files
``chunk-NNNNNNNN.safetensors`` (``NNNNNNNN`` the decimal sequence number of the checkpoint that
wrote it, 8 digits). The folder is created with mode 0700 as ``save`` creates its own
(``saving.open_folder``); every file is created afresh (``O_EXCL | O_NOFOLLOW``, mode 0600) under a
temporary name ``.NAME.<id>.tmp``. ``.lock`` (empty) is held with ``flock`` while a checkpoint
runs: one checkpoint at a time writes a folder.

A checkpoint, in this order: its chunk and then the new manifest are written to their temporary
files and both ``fsync``-ed; the chunk is renamed into place and the folder ``fsync``-ed (the
chunk's name is on the disk before a manifest names it, even across a power cut), then the
manifest is renamed over ``manifest.json`` and the folder ``fsync``-ed again; then the chunks the
new manifest no longer names,
and temporary files left by a checkpoint that was killed, are removed. The manifest names only
chunks complete before it was renamed, so a process killed at any instant leaves the previous
complete checkpoint (or the new one) loadable, never a half one.

``manifest.json``
-----------------
A save's ``meta.json`` (``format.py``: ``format``, ``format_version``, ``shmbuffer_version``,
``save_id``, ``name``, ``schema``, ``options``, ``rows``, ``lanes``, ``sampler_state``, ``stats``,
``counters``, ``tensors``), describing the buffer as at this checkpoint (``counters`` adds
``interleaved``, ``layout.Counter.INTERLEAVED``), plus ``checkpoint``, an object:

* ``version`` 1 (``CHECKPOINT_VERSION``); ``sequence`` S, this checkpoint's number (1, 2, ...);
* ``buffer`` the name of the buffer checkpointed, ``inserted`` its rows ever inserted and ``edits``
  its ``Counter.EDITS`` when the checkpoint read it: the next checkpoint of the same buffer re-reads
  the rows the log of edits names from there (``Ring.log_edits``);
* ``chunks``: ``[{"file", "id", "bytes", "rows"}, ...]``, each chunk the manifest needs: its file
  name, the random token in its header (``save_id``), its size in bytes and its rows (all blocks);
  the last one is this checkpoint's own, which also holds the state tensors below;
* ``segments``: one list per lane of ``[n0, n1, c, b, at]``: the lane's rows ``n0 .. n1 - 1`` are
  the rows ``at .. at + n1 - n0 - 1`` of block ``b`` of chunk ``c`` (an index into ``chunks``). A
  lane's segments are sorted and tile its rows ``[first, stop)`` exactly;
* ``pending``: ``[{"lane", "row", "final", "episode"}, ...]``, with ``next_of``/``stack`` the last
  row the checkpointing process pushed into each lane (``frames_push.Last``), when it is the
  lane's newest row: a resumed buffer's next push continues it as the original's would;
* ``generator``: the checkpointing process's sampling generator
  (``numpy.random.Generator.bit_generator.state``), or null;
* ``ranks``: ``{"world_size", "seed", "step", "epochs"}`` when a rank (``attach(rank=, world_size=,
  seed=)``, ``sampling/ranks.py``) wrote the checkpoint: its step and epochs, on which the ranks'
  draws are keyed (the ranks sample in lockstep, one global batch a step, so one rank's step is
  every rank's), or null;
* ``device_generator``: the state of a device copy's draws (``DeviceReplay.generator_state``: an
  object) given to the checkpoint (``checkpoint(path, device=...)``), or null.

A chunk
-------
A safetensors file laid out as ``rows.safetensors`` is (``format.py``: header length, JSON header
padded with spaces to a multiple of 64, tensors tiling the data section), ``__metadata__``
``{"format": "shmbuffer", "format_version": V, "save_id": ID, "checkpoint": "1"}``. Its tensors:

* three blocks of rows, ``BLOCKS`` = ``new`` (rows pushed since the previous checkpoint, lane by
  lane, as a save lays them out), ``edited`` (rows the log of edits named: updated or deleted) and
  ``kept`` (rows copied from older chunks by compaction, below); block ``b``'s tensors are named
  ``b/NAME`` for each tensor of a save except ``_leaf`` and ``_uses`` (the fields, ``_kind``,
  ``_episode``, ``_present``), each ``(rows of the block, ...)`` as in a save (a hole's bytes zeros);
* ``_leaf`` F64 and ``_uses`` U32 ``(rows,)`` (where the buffer has them): every row of the
  checkpoint, lane by lane from ``first`` to ``stop`` (the manifest's ``lanes``; 0 for a hole);
  samplers change them without a log, so each checkpoint writes all of them (12 bytes a row);
* ``_last/NAME`` ``(len(pending), ...)``: the values of ``pending``'s rows that the next push is
  checked against (``frames_push.Last.values``: the stacks and next observations).

Only the manifest's last chunk's ``_leaf``, ``_uses`` and ``_last/`` are read.

What a checkpoint writes
------------------------
The first checkpoint to a folder, a checkpoint of another buffer than the manifest's (another
name, or counters that went back), and one that finds the log of edits overrun (more than
``layout.EDIT_LOG`` rows edited since the previous checkpoint: it cannot tell which) write every
row (block ``new``), as a save does. Otherwise block ``new`` holds each lane's rows after the
previous checkpoint's ``stop``, and the rows the previous checkpoint has stay where they are,
less those that writers overwrote since (a lane's rows up to the newest one overwritten go, as
in a save). The log of edits is read under the ring's lock once the new rows are copied, with
the stamps, leaves and use counts of every row: rows it names since the previous checkpoint
(or, in a full one, since this one began), and rows found empty, are read again (block
``edited``: a deleted row becomes a hole); if more than the log holds were edited meanwhile, the
checkpoint starts again as a full one (three tries).

Compaction: every older chunk less than half of whose rows the new manifest still uses has those
rows copied into block ``kept`` (read from the chunk), and is removed with the chunks no row uses.
So every chunk kept is at least half used, and the folder holds at most about twice the rows of
the buffer, plus a checkpoint being written.

A resumed buffer (``resume.py``) holds the rows, ids, lanes, priorities, uses, counters and pending
steps of the checkpoint; a process that restores its generator (``ReplayBuffer.resume``, or
``resume_sampling`` in another process: a rank's step and epochs, a device copy's generator too)
draws what the checkpointing process drew after the checkpoint.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LayoutError
from ..protocol.layout import ROW_COLUMNS, SAMPLER
from ..schema import Schema
from .format import FORMAT, FORMAT_VERSION_3, Tensor, tensors, version_of
from .loading import open_regular, read_header, read_json, read_meta

__all__ = ["BLOCKS", "CHECKPOINT_VERSION", "LOCK", "MANIFEST", "ChunkFile", "Manifest", "chunk_name", "open_chunk",
           "read_manifest", "row_tensors"]

MANIFEST = "manifest.json"
"""The checkpoint's description, replaced atomically by each checkpoint."""
CHECKPOINT_VERSION = 1
"""``checkpoint.version`` in the manifest."""
BLOCKS = ("new", "edited", "kept")
"""The blocks of rows of a chunk (the module docstring)."""
LOCK = ".lock"
"""The file a checkpoint holds with ``flock`` while it writes the folder."""
CHUNK = re.compile(r"chunk-(\d{8})\.safetensors")
"""A chunk's file name."""
SAMPLER_STATE = {c.name for c in ROW_COLUMNS if c.saved == SAMPLER}
"""The tensors a chunk holds for every row, not per block: the sampler's state (``_leaf``, ``_uses``)."""
_KEYS = {"version", "sequence", "buffer", "inserted", "edits", "chunks", "segments", "pending", "generator", "ranks",
         "device_generator"}
_RANKS = ("world_size", "seed", "step", "epochs")
_INT = 2**63 - 1


def chunk_name(sequence: int) -> str:
    """The file name of the chunk the checkpoint ``sequence`` writes."""
    return f"chunk-{sequence:08d}.safetensors"


def row_tensors(schema: Schema, opts: Any) -> list[Tensor]:
    """A chunk block's tensors: a save's (``format.tensors``) without the sampler's (``SAMPLER_STATE``)."""
    return [t for t in tensors(schema, opts) if t.name not in SAMPLER_STATE]


@dataclass
class Manifest:
    """A manifest, checked (``read_manifest``): the save meta (``meta``), what ``load`` reads of
    it (``saved``: ``loading.read_meta``'s) and the ``checkpoint`` object's entries."""

    file: Path
    meta: dict[str, Any]
    saved: Any
    version: int
    sequence: int
    buffer: str
    inserted: int
    edits: int
    chunks: list[dict[str, Any]]
    segments: list[list[list[int]]]
    pending: list[dict[str, Any]]
    generator: dict[str, Any] | None
    ranks: dict[str, int] | None
    device_generator: dict[str, Any] | None

    @property
    def lanes(self) -> list[tuple[int, int, int]]:
        """Each lane's ``(first, stop, base)``."""
        return list(self.saved.lanes)


def _bad(file: Path, where: str, value: Any, expected: str) -> LayoutError:
    shown = value if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
    return LayoutError(f"{file}: malformed entry: checkpoint.{where} is {shown!r}, expected {expected}; the manifest is "
                       "damaged or was not written by shmbuffer's checkpoint: resume from another folder")


def _int(file: Path, obj: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = _INT) -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(file, where + key, value, f"an int in [{lo}, {hi}]")
    return value


def read_manifest(folder: Path, *, missing_ok: bool = False) -> Manifest | None:
    """The checked manifest of the checkpoint folder ``folder`` (``None`` when it has none and
    ``missing_ok``): every entry of the save meta as ``load`` checks it, and every entry of
    ``checkpoint`` (types, ranges, segments that tile each lane's rows, pending rows that are
    their lane's newest); ``LayoutError`` naming the first one that is wrong."""
    file = folder / MANIFEST
    try:
        meta, version = read_json(file, f"resume: {file} does not exist; expected a folder written by checkpoint()",
                                  "checkpoint()", "; the manifest is damaged (truncated or altered): resume from "
                                  "another folder", "resume")
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    saved = read_meta(file, meta, version)
    expected = sorted((t.name, t.code, tuple(t.file_shape(saved.rows)), t.dtype.str)
                      for t in tensors(saved.schema, saved.opts))
    if sorted(saved.tensors) != expected:
        raise LayoutError(f"{file}: tensors {str(saved.tensors)[:1000]}, expected {expected} for its schema and options")
    c = meta.get("checkpoint")
    if not isinstance(c, dict) or set(c) != _KEYS:
        raise LayoutError(f"{file}: checkpoint is {type(c).__name__}, expected an object with the keys {sorted(_KEYS)}: "
                          "not written by checkpoint()")
    if c["version"] != CHECKPOINT_VERSION:
        raise _bad(file, "version", c["version"], f"{CHECKPOINT_VERSION}: resume with a newer shmbuffer")
    sequence = _int(file, c, "sequence", "", 1)
    inserted, edits = _int(file, c, "inserted", ""), _int(file, c, "edits", "")
    if not isinstance(c["buffer"], str):
        raise _bad(file, "buffer", c["buffer"], "a string")
    chunks = c["chunks"]
    if not isinstance(chunks, list) or not chunks:
        raise _bad(file, "chunks", chunks, "a non-empty array")
    for i, ch in enumerate(chunks):
        if not isinstance(ch, dict) or set(ch) != {"file", "id", "bytes", "rows"}:
            raise _bad(file, f"chunks[{i}]", ch, "an object with the keys ['bytes', 'file', 'id', 'rows']")
        if not isinstance(ch["file"], str) or not CHUNK.fullmatch(ch["file"]) or not isinstance(ch["id"], str):
            raise _bad(file, f"chunks[{i}].file", ch["file"], "a name chunk-NNNNNNNN.safetensors and a string id")
        _int(file, ch, "bytes", f"chunks[{i}].")
        _int(file, ch, "rows", f"chunks[{i}].")
    if len({ch["file"] for ch in chunks}) != len(chunks):
        raise _bad(file, "chunks", "a chunk named twice", "each chunk once")
    segments = c["segments"]
    if not isinstance(segments, list) or len(segments) != len(saved.lanes):
        raise _bad(file, "segments", segments, f"one array per lane ({len(saved.lanes)})")
    for lane, ((first, stop, _), segs) in enumerate(zip(saved.lanes, segments, strict=True)):
        at = first
        if not isinstance(segs, list):
            raise _bad(file, f"segments[{lane}]", segs, "an array")
        for j, s in enumerate(segs):
            where = f"segments[{lane}][{j}]"
            if not isinstance(s, list) or len(s) != 5 or not all(type(x) is int and 0 <= x <= _INT for x in s):
                raise _bad(file, where, s, "[n0, n1, chunk, block, at], ints >= 0")
            n0, n1, ch_, b, row = s
            if n0 != at or n1 <= n0 or ch_ >= len(chunks) or b >= len(BLOCKS) or row + n1 - n0 > chunks[ch_]["rows"]:
                raise LayoutError(
                    f"{file}: checkpoint.{where} is {s}: expected rows from {at} (the segments of a lane tile its rows "
                    f"[{first}, {stop}) in order), a chunk below {len(chunks)}, a block below {len(BLOCKS)} and rows "
                    "within the chunk; the manifest is damaged: resume from another folder")
            at = n1
        if at != stop:
            raise LayoutError(f"{file}: checkpoint.segments[{lane}] end at row {at}, the lane's rows at {stop}; the "
                              "manifest is damaged: resume from another folder")
    pending = c["pending"]
    if not isinstance(pending, list):
        raise _bad(file, "pending", pending, "an array")
    seen = set()
    for i, p in enumerate(pending):
        if not isinstance(p, dict) or set(p) != {"lane", "row", "final", "episode"}:
            raise _bad(file, f"pending[{i}]", p, "an object with the keys ['episode', 'final', 'lane', 'row']")
        lane = _int(file, p, "lane", f"pending[{i}].", 0, len(saved.lanes) - 1)
        first, stop, _ = saved.lanes[lane]
        _int(file, p, "row", f"pending[{i}].", max(first, stop - 1), stop - 1)
        if lane in seen or type(p["final"]) is not bool or not (p["episode"] is None or type(p["episode"]) is int):
            raise _bad(file, f"pending[{i}]", p["lane"], "each lane once, final true or false, episode an int or null")
        seen.add(lane)
    if pending and version_of(saved.opts, True) < FORMAT_VERSION_3:  # pending lanes came with version 3
        raise _bad(file, "pending", pending, "[] for a buffer without next_of/stack")
    for key in ("generator", "device_generator"):
        if c[key] is not None and not isinstance(c[key], dict):
            raise _bad(file, key, c[key], "an object (a generator's state) or null")
    ranks = c["ranks"]
    if ranks is not None:
        if not isinstance(ranks, dict) or set(ranks) != set(_RANKS):
            raise _bad(file, "ranks", ranks, f"an object with the keys {sorted(_RANKS)} or null")
        for key in _RANKS:
            _int(file, ranks, key, "ranks.", 1 if key == "world_size" else 0)
    return Manifest(file, meta, saved, version, sequence, c["buffer"], inserted, edits, chunks, segments, pending,
                    c["generator"], ranks, c["device_generator"])


class ChunkFile:
    """A chunk opened for reading, its header checked (``open_chunk``)."""

    def __init__(self, fd: int, file: Path, data_start: int, entries: dict[str, Any], rows: dict[str, int]) -> None:
        self.fd, self.file, self.data_start, self.entries, self.rows = fd, file, data_start, entries, rows

    def offset(self, name: str, row: int, row_bytes: int) -> int:
        """The file offset of row ``row`` of tensor ``name``."""
        return self.data_start + int(self.entries[name].begin) + row * row_bytes

    def close(self) -> None:
        """Close the file."""
        os.close(self.fd)


def open_chunk(folder: Path, entry: dict[str, Any], schema: Schema, opts: Any) -> ChunkFile:
    """The chunk ``entry`` (of a manifest's ``chunks``) of ``folder``, opened and checked: a
    regular file of the size the manifest says, a safetensors header that tiles it, the token the
    manifest names, and the tensors of a chunk (the module docstring) for this schema and options;
    ``rows`` each block's rows. ``LayoutError`` naming the file otherwise."""
    file = folder / entry["file"]
    fd = open_regular(file, f"resume: {file} does not exist, though {folder / MANIFEST} names it: the folder is damaged")
    try:
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            raise LayoutError(f"{file}: {size} bytes, the manifest says {entry['bytes']}: the chunk is truncated or "
                              "altered; resume from another folder")
        data_start, head, entries = read_header(file, fd)
        want = {"format": FORMAT, "format_version": str(version_of(opts)), "save_id": entry["id"], "checkpoint": "1"}
        if head != want:
            raise LayoutError(f"{file}: __metadata__ {str(head)[:300]}, expected {want}: the chunk is not the one "
                              f"{MANIFEST} names (or was altered)")
        rows: dict[str, int] = {}
        allowed = SAMPLER_STATE | {f"_last/{n}" for n in schema.names}
        files = row_tensors(schema, opts)
        for b in BLOCKS:
            e = entries.get(f"{b}/_present")
            rows[b] = int(e.shape[0]) if e is not None and e.shape else -1
            for t in files:
                got = entries.get(f"{b}/{t.name}")
                if got is None or got.code != t.code or list(got.shape) != t.file_shape(rows[b]):
                    raise LayoutError(f"{file}: tensor {b}/{t.name} is {None if got is None else (got.code, got.shape)}, "
                                      f"expected {(t.code, t.file_shape(max(rows[b], 0)))}: the chunk is altered")
                allowed.add(f"{b}/{t.name}")
        odd = sorted(set(entries) - allowed)
        if odd:
            raise LayoutError(f"{file}: tensors {odd[:5]} are not a chunk's: the chunk is altered")
        if sum(rows.values()) != entry["rows"]:
            raise LayoutError(f"{file}: {sum(rows.values())} rows, the manifest says {entry['rows']}: the chunk is altered")
    except BaseException:
        os.close(fd)
        raise
    return ChunkFile(fd, file, data_start, entries, rows)
