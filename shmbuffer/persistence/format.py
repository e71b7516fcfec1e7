"""The save format: what ``save`` writes and ``load`` reads, byte by byte.

A save is a directory with two files, ``rows.safetensors`` (the rows) and ``meta.json`` (what
they are). Nothing is pickled. This module holds the format's names and constants, the tensors a
buffer's schema and options give (``tensors``) and the file's layout and header (``Layout``);
``saving.py`` writes the files, ``loading.py`` reads them with one reader per version.

Versions
--------
``FORMAT_VERSION_1`` (1): a buffer without ``next_of``/``stack``. ``FORMAT_VERSION_2`` (2):
version 1 plus ``options.frames`` (``frames.py``) in ``meta.json``: the tensors are the *stored*
fields and ``_kind`` comes along (below). A save writes the lowest version that can hold its buffer
(``version_of``), so a release that reads only version 1 still loads every buffer without frames.
``FORMAT_VERSION_3`` (3): version 2 plus ``pushed`` in ``meta.json`` (below): the lanes whose
newest row the saving process pushed and will continue (``frames_push.Last``), so that a load
gives that state to the loading process and its next push into the lane continues the episode
(with ``next_of``, completing the step that waits for its next observation). A version-2 save
holds no such state (the saving process's waiting steps went in as transitions, an end row after
each, dropping a full lane's oldest row); it loads as it always did.
``load`` keeps a reader for every version (``loading.READERS``). A later format gets a new constant
here, a new reader there, and keeps the older ones; its golden files go beside
``tests/golden/v1/`` and ``v2/``.

``rows.safetensors``
--------------------
A safetensors file (https://github.com/huggingface/safetensors; the ``safetensors`` package reads
it, e.g. ``safetensors.numpy.load_file``). All integers are little-endian::

    offset   size  content
    0        8     N, the length of the header, uint64
    8        N     UTF-8 JSON header, padded with spaces so that 8 + N is a multiple of 64 (ALIGN):
                   {"__metadata__": {"format": "shmbuffer", "format_version": "V", "save_id": S},
                    NAME: {"dtype": CODE, "shape": [rows, ...], "data_offsets": [BEGIN, END]}, ...}
    8 + N    ...   the tensors, C order, little-endian; tensor NAME is the bytes [8+N+BEGIN, 8+N+END).
                   They tile this section exactly, larger itemsizes first (so each tensor is aligned
                   to its element size); nothing follows the last one.

``V`` is the format version as a string (``"1"``, ``"2"`` or ``"3"``), ``S`` the save's random token.
The header is JSON without spaces (``","`` and ``":"`` separators), its keys in this order:
``__metadata__``, then the tensors in file order.

Every tensor has one row per row number of the saved runs (see ``lanes`` below), in the order of
``get``: lane 0's rows oldest first, then lane 1's, and so on; a *hole* (a row number whose row
was empty, see ``_present``) has a row too, so that every other row keeps its row number. The
tensors, in file order (a stable sort by itemsize, largest first, of the list below):

* one per field of the schema, named as the field, ``(rows, *shape)``, CODE from its dtype
  (F64 F32 F16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL). complex64 / complex128 fields are stored as
  F32 / F64 with a trailing dimension of 2 (real, imaginary), dtypes safetensors has no code for
  (longdouble) as U8 with a trailing dimension of their itemsize: the bytes are the buffer's.
  Versions 2 and 3: the *stored* fields (``Frames.stored``: a ``next_of`` field is not stored, a stacked
  field holds its newest frame, ``(rows, *frame)``).
* ``_kind`` U8 ``(rows,)``, version 2 and 3 only: each stored row's kind (``frames.KIND``: a step, an
  episode's end row holding its final observation, a lead row holding older frames).
* ``_episode`` I64 ``(rows,)``: the rows' episode ids, when the buffer keeps episodes.
* ``_leaf`` F64 ``(rows,)``: the rows' leaves in the priority tree (``samplers.py``:
  the sampler's ``leaf(p)``, ``(p + eps) ** alpha`` for ``Prioritized``'s own, 1 for a uniform row
  under ``max_use``, 0 once used up), when the buffer
  has a tree (``Prioritized`` or ``max_use``).
* ``_uses`` U32 ``(rows,)``: times each row was drawn, with ``max_use``.
* ``_present`` BOOL ``(rows,)``, always: 1 for a saved row, 0 for a hole, a row number whose slot
  was empty when the save ran (stamp 0, ``protocol.rows``: its writer died mid-push and the row was
  reaped, or its push was interrupted and abandoned). A hole's bytes are zeros in every tensor. A
  load leaves a hole's slot empty (stamp 0, leaf 0): it is never drawn, ``get`` raises on it as on
  the original, and the other rows keep their row numbers, ids and order.

``meta.json``
-------------
A UTF-8 JSON object (written with ``indent=1``, then a newline):

``format`` ``"shmbuffer"``; ``format_version`` V (an int); ``shmbuffer_version`` the writer's
release; ``save_id`` the same random token as the header's, so two files of different saves never
pair up; ``name`` the buffer's name; ``schema`` ``Schema.to_json()``; ``options``
``Options.to_json()`` (capacity, lanes, sampler, max_use, episodes, limiter; ``envs`` when set;
``frames`` only in versions 2 and 3, where it is required); ``rows`` the rows of every tensor (holes included);
``lanes`` one ``{"first": F, "stop": S, "base": B}`` per lane: its saved rows and holes are the row
numbers ``[F, S)`` (``protocol.rows``: row ``n`` of lane ``l`` has the id ``n * lanes + l``),
``B <= F`` its base (first row number since its last ``clear()``); ``sampler_state``
``{"max_priority": P}`` (the largest priority given so far) or null without a tree; ``stats`` the
buffer's counters (``Buffer.stats``); ``counters`` ``{"sample_calls": C, "removed": R}`` (the
sample calls ``beta`` is annealed over and whether rows were deleted or used up,
``layout.Counter``; saves written before these existed have none: 0); ``tensors`` the tensors of
``rows.safetensors`` in file order, each ``{"name", "dtype" (CODE), "shape", "numpy" (the
buffer's numpy dtype)}``; version 3 only, ``pushed``: a list (empty only when writers dropped those rows while the save
ran), at most one entry a lane,
each ``{"lane": L, "row": N, "episode": E, "values": {NAME: DATA, ...}}``: lane ``L``'s newest saved
row ``N`` (``N = stop - 1``, a step whose episode has not ended) is the saving process's last row
of the lane, pushed with episode id ``E`` (null without one); ``values`` holds, for each field of
``Frames.rebuilt`` (each stacked field's whole stack, each ``next_of`` field), the value that row
was pushed with: its bytes (C order, little-endian, the field's shape and dtype) in base64.

What a load checks is ``loading.py``'s docstring; how a save of a live buffer chooses its rows is
``snapshot.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..frames import KIND
from ..protocol.layout import Options, row_columns
from ..schema import Schema

__all__ = ["ALIGN", "FORMAT", "FORMAT_VERSION_1", "FORMAT_VERSION_2", "FORMAT_VERSION_3", "MAX_BLOCK", "MAX_HEADER",
           "MAX_ROW", "META", "ROWS", "VERSION", "VERSIONS", "Layout", "Tensor", "tensor_of", "tensors", "version_of"]

FORMAT = "shmbuffer"
"""``format`` in ``meta.json`` and in the header's ``__metadata__``."""
FORMAT_VERSION_1 = 1
"""A buffer without ``next_of``/``stack``."""
FORMAT_VERSION_2 = 2
"""Version 1 plus ``options.frames``: the stored fields and ``_kind``."""
FORMAT_VERSION_3 = 3
"""Version 2 plus ``pushed``: the saving process's last rows its next pushes continue."""
VERSIONS = (FORMAT_VERSION_1, FORMAT_VERSION_2, FORMAT_VERSION_3)
"""Every format version this release reads."""
VERSION = FORMAT_VERSION_3
"""The newest format version this release writes (``version_of`` says which one a save gets)."""
META = "meta.json"
"""The save's description."""
ROWS = "rows.safetensors"
"""The save's rows."""
ALIGN = 64
"""``8 + N`` (the header with its length) is padded to a multiple of this."""
MAX_HEADER = 100 << 20
"""The largest header safetensors accepts; also the largest ``meta.json`` a load reads."""
MAX_ROW = 2**61
"""Every saved lane's ``stop * lanes`` is at most this: ids (``n * lanes + l``) and stamps
(``2n + 2``) of its rows, and of the rows pushed after a load for ages to come, fit an int64."""
MAX_BLOCK = 2**48
"""A save whose buffer would need more bytes of rows than this (256 TiB) is damaged."""

CODES = {"f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
         "u8": "U64", "u4": "U32", "u2": "U16", "u1": "U8", "b1": "BOOL"}
"""The safetensors dtype code of each numpy kind and itemsize a save writes."""
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
         "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
"""Element sizes of every safetensors dtype code (for checking a header we did not write)."""


def version_of(opts: Options, pushed: bool = False) -> int:
    """The format version a save of a buffer with these options gets, with (``pushed``) or without
    lanes its saving process continues: the lowest that holds it (version 2 added ``_kind``, 3 the lanes)."""
    if all(c.name != KIND for c in row_columns(opts)):
        return FORMAT_VERSION_1
    return FORMAT_VERSION_3 if pushed else FORMAT_VERSION_2


@dataclass(frozen=True)
class Tensor:
    """A tensor of the file: ``shape`` and ``dtype`` of one row as the buffer holds it, stored
    as ``code`` (safetensors' dtype code) with the trailing dimensions ``extra``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    code: str
    extra: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def file_shape(self, rows: int) -> list[int]:
        """The tensor's shape in the file, for ``rows`` rows."""
        return [rows, *self.shape, *self.extra]

    def to_json(self, rows: int) -> dict[str, Any]:
        """The tensor's entry in ``meta.json``'s ``tensors``."""
        return {"name": self.name, "dtype": self.code, "shape": self.file_shape(rows), "numpy": self.dtype.str}


def tensor_of(name: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
    """The tensor of a field ``name`` of this shape and dtype (its safetensors code, its trailing dimensions)."""
    key = f"{dtype.kind}{dtype.itemsize}"
    if key in CODES:
        return Tensor(name, shape, dtype, CODES[key], ())
    if key in ("c8", "c16"):
        return Tensor(name, shape, dtype, CODES[f"f{dtype.itemsize // 2}"], (2,))
    return Tensor(name, shape, dtype, "U8", (dtype.itemsize,))


def tensors(schema: Schema, opts: Options) -> list[Tensor]:
    """The file's tensors in file order (larger itemsizes first, then fields, then the saved
    per-row columns, ``layout.ROW_COLUMNS``, then ``_present``). With ``next_of``/``stack``
    (format version 2) the fields are the stored ones (``frames.py``)."""
    out = [tensor_of(f.name, f.shape, f.dtype) for f in opts.rows.stored(schema)]
    out += [tensor_of(c.name, (), c.dtype) for c in row_columns(opts) if c.saved]
    out.append(tensor_of("_present", (), np.dtype(np.bool_)))
    return sorted(out, key=lambda t: -t.dtype.itemsize)


class Layout:
    """Where each lane's rows of each tensor go in the data section, for each lane's saved row
    numbers ``[keep, end)`` (``spans``, one per lane)."""

    def __init__(self, tensors: list[Tensor], spans: list[tuple[int, int]]) -> None:
        self.keep = [keep for keep, _ in spans]
        self.counts = [end - keep for keep, end in spans]
        self.rows = sum(self.counts)
        self.lane_at = [sum(self.counts[:i]) for i in range(len(spans))]
        self.offsets: dict[str, int] = {}
        at = 0
        for t in tensors:
            self.offsets[t.name] = at
            at += self.rows * t.row_bytes
        self.data_bytes = at

    def at(self, t: Tensor, lane: int, n: int) -> int:
        """Byte offset (in the data section) of row ``n`` of ``lane`` in tensor ``t``."""
        return self.offsets[t.name] + (self.lane_at[lane] + n - self.keep[lane]) * t.row_bytes

    def header(self, tensors: list[Tensor], save_id: str, version: int) -> bytes:
        """The safetensors header (unpadded JSON) of a file of format ``version`` with this layout."""
        head: dict[str, Any] = {"__metadata__": {"format": FORMAT, "format_version": str(version), "save_id": save_id}}
        for t in tensors:
            begin = self.offsets[t.name]
            head[t.name] = {"dtype": t.code, "shape": t.file_shape(self.rows),
                            "data_offsets": [begin, begin + self.rows * t.row_bytes]}
        return json.dumps(head, separators=(",", ":")).encode()
