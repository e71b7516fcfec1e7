"""Loading a save: ``load(path, factory)`` makes a new buffer in shared memory with the saved
schema, options, rows, row ids, priorities and use counts, through the reader of the save's format
version (``READERS``: ``read_v1``, ``read_v2``, ``read_v3``; the format is ``format.py``).

What a load checks
------------------
``load`` opens both files with ``O_NOFOLLOW | O_NONBLOCK`` and reads only regular files (a link,
a FIFO or a directory raises ``LayoutError``; a FIFO never blocks it). Before it makes any shared
memory it checks every entry of ``meta.json``: its type, its range and its agreement with the
others (``0 <= base <= first <= stop <= first +`` the lane's capacity, ``stop * lanes <=
MAX_ROW`` so that ids and stamps fit an int64, ``rows`` the sum of the lanes', ``max_priority``
finite, ``>= 0`` and with a leaf of at most ``priorities.MAX_LEAF``, capacity times a row's bytes
at most ``MAX_BLOCK``, ``options.frames`` set exactly in a version-2 or -3 save, ``pushed`` only
in a version-3 one (each entry's lane once, its row the lane's newest, its values base64 of the
fields' sizes), the tensors those of
the schema and options); and every entry of the safetensors header (object, dtype code, shape,
offsets that tile the data section, metadata strings, the same ``save_id`` and format version as
``meta.json``). As it reads the rows it checks ``_present`` (0 or 1), ``_leaf`` (in ``[0,
MAX_LEAF]``), ``_uses`` (at most ``max_use``), the two together (``check_leaves``: a used-up row's
leaf 0, another's the leaf its sampler gives) and that a hole's bytes are zeros in every tensor;
once they are read, a version-2 save's ``_kind`` (``check_kinds``: defined kinds only, end rows
where episodes end unless another episode starts there, episodes starting after them), and each
``pushed`` row (``pushed.check``: a step whose episode goes on, its episode id and its stored frames
those of its values). Whatever is malformed raises ``LayoutError``
naming the file and the entry; JSON nested too deep to parse is malformed too.

The rows go into their slots a chunk at a time, each with its committed stamp
(``protocol.snapshot.restore``); a hole's slot stays empty (stamp 0, leaf 0). Whether rows were
removed (``Counter.REMOVED``: ``len`` and ``get``'s positions then leave holes and used-up rows
out) comes from the rows read, not only from ``counters``, which older saves lack. The lanes'
cursors are set last: until then the new buffer reads as empty. A version-3 save's ``pushed``
becomes the loading process's memory of its last rows (``ReplayBuffer.pusher``): its next push into
such a lane continues the episode, as the saving process's would have.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CapacityError, LayoutError
from ..frames import END, KIND, LEAD, misplaced
from ..progress import Progress as Line
from ..protocol import snapshot
from ..protocol.frames_push import Last
from ..protocol.layout import Counter, Options, row_columns
from ..protocol.priorities import MAX_LEAF
from ..protocol.rows import lane_capacity, pieces, slot
from ..protocol.snapshot import CHUNK_BYTES, Buffer, columns
from ..sampling.samplers import sampler_from_json
from ..schema import Schema
from ..shm.segment import human
from . import pushed
from .format import (
    FORMAT,
    FORMAT_VERSION_1,
    FORMAT_VERSION_2,
    FORMAT_VERSION_3,
    MAX_BLOCK,
    MAX_HEADER,
    MAX_ROW,
    META,
    ROWS,
    SIZES,
    Tensor,
    tensors,
)

__all__ = ["READERS", "STATS", "check_kinds", "check_leaves", "load", "open_regular", "pread_into", "read_header",
           "read_json", "read_meta", "read_piece", "read_v1", "read_v2", "read_v3"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
STATS = {"sampled": Counter.SAMPLED, "reclaimed": Counter.RECLAIMED, "inserted": Counter.INSERTED,
          "sample_calls": Counter.SAMPLE_CALLS, "removed": Counter.REMOVED}
"""The counters a load restores (lock recoveries belong to the old lock): ``sample_calls`` carries
the annealing of ``Prioritized.beta`` on, ``removed`` says rows were deleted or used up."""


def pread_into(fd: int, a: np.ndarray, offset: int, file: Path) -> None:
    """Fill ``a`` from ``fd`` at ``offset`` (``os.preadv`` again until it is full); ``LayoutError`` naming ``file`` when the file ends first."""
    view = a.reshape(-1).view(np.uint8).data
    while view.nbytes:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise LayoutError(f"{file} is truncated: it ends at byte {offset}, before the rows it describes")
        view, offset = view[n:], offset + n


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
    missing = f"load: {meta_file} does not exist; expected a directory written by shmbuffer.save"
    meta, version = read_json(meta_file, missing, "shmbuffer.save", "", "load it")
    return READERS[version](folder, meta, factory, name=name, capacity=capacity, seed=seed)


def read_json(file: Path, missing: str, writer: str, damaged: str, then: str) -> tuple[dict[str, Any], int]:
    """The JSON object ``file`` holds (a save's meta, a checkpoint's manifest: ``writer`` wrote
    it) and its format version, one ``READERS`` reads: ``FileNotFoundError(missing)`` when there is
    no file, ``LayoutError`` naming it when it is too long, not JSON (``damaged`` says what to do),
    not shmbuffer's ``FORMAT`` or of another version (``then`` with a newer shmbuffer)."""
    fd = open_regular(file, missing)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER:
            raise LayoutError(f"{file}: {size} bytes, expected at most {MAX_HEADER}: not written by {writer}")
        text = os.pread(fd, MAX_HEADER, 0)
    finally:
        os.close(fd)
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise LayoutError(f"{file}: not valid JSON ({type(exc).__name__}: {_clip(str(exc))}){damaged}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise LayoutError(f"{file}: format {_show(found)}, expected {FORMAT!r}: not written by {writer}")
    version = meta.get("format_version")
    if type(version) is not int or version not in READERS:
        raise LayoutError(f"{file}: format version {_show(version)}; this shmbuffer reads versions "
                          f"{', '.join(map(str, READERS))}: {then} with a newer shmbuffer")
    return meta, version


def open_regular(file: Path, missing: str) -> int:
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
    """What a ``meta.json`` says, checked."""

    schema: Schema
    opts: Options
    lanes: list[tuple[int, int, int]]
    max_priority: float | None
    stats: dict[str, int]
    tensors: list[tuple[str, str, tuple[int, ...], str]]
    rows: int
    save_id: str
    pushed: dict[int, Last]


def read_meta(meta_file: Path, meta: dict[str, Any], version: int) -> _Saved:
    """Check every entry of a ``meta.json`` of format ``version``: its type, its range and its
    agreement with the others (see the module docstring); ``LayoutError`` naming the first one that
    is wrong."""
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
    m.text(m.obj(o, "sampler", "options."), "kind", "options.sampler.")
    try:  # the sampler checks its own settings
        sampler_from_json(o["sampler"])
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{meta_file}: options.sampler: {_clip(str(exc))}") from None
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
    if (o.get("frames") is not None) != (version in (FORMAT_VERSION_2, FORMAT_VERSION_3)):
        raise m.bad("options.frames", o.get("frames"), "frames in a version-2 or -3 save only")
    try:
        schema = Schema(**spec) if len(spec) == len(fields) else None
        opts = Options.from_json(o)
        if schema is not None:
            opts.rows.check(schema)
    except (KeyError, TypeError, ValueError) as exc:  # SchemaError is a ValueError
        raise LayoutError(f"{meta_file}: schema or options malformed ({type(exc).__name__}: {_clip(str(exc))})") from None
    if schema is None:
        raise LayoutError(f"{meta_file}: schema names a field twice; the file is damaged: save the buffer again")
    lc = lane_capacity(capacity, lanes_n)
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
        if opts.sampler.prioritized:
            with np.errstate(over="ignore"):
                leaf = float(opts.sampler.leaf(np.array([max_priority], np.float64))[0])
            if not leaf <= MAX_LEAF:
                raise m.bad("sampler_state.max_priority", max_priority, f"a priority whose leaf (sampler.leaf) is <= {MAX_LEAF:g}")
    stats_in = m.obj(meta, "stats")
    stats = {key: m.integer(stats_in, key, "stats.") for key in stats_in}
    if "counters" in meta:  # saves written before the counters existed have none (format.py)
        counters = m.obj(meta, "counters")
        stats.update({key: m.integer(counters, key, "counters.") for key in counters})
    listed = []
    for i, t in enumerate(m.array(meta, "tensors")):
        if not isinstance(t, dict) or set(t) != {"name", "dtype", "shape", "numpy"}:
            raise m.bad(f"tensors[{i}]", t, "an object with the keys ['dtype', 'name', 'numpy', 'shape']")
        where = f"tensors[{i}]."
        listed.append((m.text(t, "name", where), m.text(t, "dtype", where), m.shape(t["shape"], where + "shape", 0),
                        m.text(t, "numpy", where)))
    if ("pushed" in meta) != (version == FORMAT_VERSION_3):
        raise m.bad("pushed", meta.get("pushed"), "an array in a version-3 save only")
    lasts = _read_pushed(m, meta, schema, opts, lanes) if version == FORMAT_VERSION_3 else {}
    return _Saved(schema, opts, lanes, max_priority, stats, listed, rows, save_id, lasts)


def _read_pushed(m: _Meta, meta: dict[str, Any], schema: Schema, opts: Options,
                 lanes: list[tuple[int, int, int]]) -> dict[int, Last]:
    """A version-3 save's ``pushed`` (``format.py``): per lane, the saving process's last row there."""
    spec = opts.rows  # version 3 has frames (checked before)
    out: dict[int, Last] = {}
    for i, entry in enumerate(m.array(meta, "pushed")):
        where = f"pushed[{i}]."
        if not isinstance(entry, dict) or set(entry) != {"lane", "row", "episode", "values"}:
            raise m.bad(f"pushed[{i}]", entry, "an object with the keys ['episode', 'lane', 'row', 'values']")
        lane = m.integer(entry, "lane", where, 0, len(lanes) - 1)
        first, stop, _ = lanes[lane]
        if lane in out:
            raise m.bad(where + "lane", lane, "each lane once")
        row = m.integer(entry, "row", where)
        if not first <= row == stop - 1:
            raise m.bad(where + "row", row, f"lane {lane}'s newest row, {stop - 1} (lanes[{lane}] is [{first}, {stop}))")
        episode = None if entry["episode"] is None else m.integer(entry, "episode", where, -(2**63))
        values = m.obj(entry, "values", where, set(spec.rebuilt))
        got = {}
        for name in spec.rebuilt:
            text, f = m.text(values, name, where + "values."), schema[name]
            try:
                got[name] = pushed.value(text, f.shape, f.dtype)
            except ValueError as exc:
                raise m.bad(f"{where}values.{name}", _clip(text), f"{exc} ({f.describe()})") from None
        out[lane] = Last(row, False, episode, got)
    return out


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
    return (isinstance(code, str) and code in SIZES and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets))


def read_header(file: Path, fd: int) -> tuple[int, dict[str, str], dict[str, _Entry]]:
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
        need = math.prod(shape) * SIZES[code]
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


def read_v1(folder: Path, meta: dict[str, Any], factory: Callable[..., Buffer], *, name: str | None,
            capacity: int | None, seed: Any) -> Buffer:
    """The reader of format version 1: a buffer without ``next_of``/``stack``. ``meta`` is the
    parsed ``meta.json``; the other arguments are ``load``'s."""
    return _read(folder, meta, FORMAT_VERSION_1, factory, name=name, capacity=capacity, seed=seed)


def read_v3(folder: Path, meta: dict[str, Any], factory: Callable[..., Buffer], *, name: str | None,
            capacity: int | None, seed: Any) -> Buffer:
    """The reader of format version 3: version 2 with ``pushed``, the saving process's last rows,
    which the loading process's next pushes continue (``format.py``)."""
    return _read(folder, meta, FORMAT_VERSION_3, factory, name=name, capacity=capacity, seed=seed)


def read_v2(folder: Path, meta: dict[str, Any], factory: Callable[..., Buffer], *, name: str | None,
            capacity: int | None, seed: Any) -> Buffer:
    """The reader of format version 2: version 1 with ``options.frames`` (the stored fields and
    ``_kind``, ``format.py``). ``meta`` is the parsed ``meta.json``; the other arguments are ``load``'s."""
    return _read(folder, meta, FORMAT_VERSION_2, factory, name=name, capacity=capacity, seed=seed)


def _read(folder: Path, meta: dict[str, Any], version: int, factory: Callable[..., Buffer], *, name: str | None,
          capacity: int | None, seed: Any) -> Buffer:
    """A new buffer holding the save in ``folder`` of format ``version`` (whose ``meta.json`` is ``meta``)."""
    meta_file, rows_file = folder / META, folder / ROWS
    saved = read_meta(meta_file, meta, version)
    schema, opts, lanes, rows = saved.schema, saved.opts, saved.lanes, saved.rows
    files = tensors(schema, opts)
    expected = [(t.name, t.code, tuple(t.file_shape(rows)), t.dtype.str) for t in files]
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
    fd = open_regular(rows_file, f"load: {rows_file} does not exist ({meta_file} does)")
    try:
        data_start, head_meta, entries = read_header(rows_file, fd)
        if head_meta.get("save_id") != saved.save_id:
            raise LayoutError(
                f"{rows_file} and {meta_file} come from different saves (save_id "
                f"{_show(head_meta.get('save_id'))} vs {saved.save_id!r})"
            )
        if head_meta.get("format_version") != str(version):
            raise LayoutError(f"{rows_file}: __metadata__ format_version {_show(head_meta.get('format_version'))}, "
                              f"expected '{version}'")
        found = {n: (e.code, e.shape) for n, e in entries.items()}
        want = {n: (c, list(s)) for n, c, s, _ in expected}
        if found != want:
            raise LayoutError(f"{rows_file} holds tensors {_clip(str(found), 1000)}; {meta_file} says {want}")
        buf = factory(schema, cap, **opts.arguments(), name=name, seed=seed)
        try:
            with Line(f"loading {folder}", sum(stop - first for first, stop, _ in lanes)) as line:
                removed = _fill(buf, fd, rows_file, data_start, entries, files, lanes, line)
            check_kinds(buf, lanes, rows_file)
            pushed.check(buf, saved.pushed, rows_file)
            arrays = columns(buf)
            if saved.max_priority is not None:
                arrays["_prio"][0] = saved.max_priority
            # removed from the rows, not the counters (saves older than them have none)
            snapshot.restore_counters(buf, {at: saved.stats.get(key, 0) for key, at in STATS.items()}, removed)
            new_lc = buf.lane_capacity
            for lane, (first, stop, base) in enumerate(lanes):
                # the saved base reproduces the bounds unless the lanes grew or rows were dropped
                buf.ring.place(lane, base if max(base, stop - new_lc) == first else first, stop)
            if saved.pushed:
                buf.pusher.last.update(saved.pushed)
        except BaseException:
            buf.__exit__(None, None, None)  # unlink; unmap once the traceback's views are gone
            raise
    finally:
        os.close(fd)
    return buf


def _fill(buf: Buffer, fd: int, file: Path, data_start: int, entries: dict[str, _Entry],
          files: list[Tensor], lanes: list[tuple[int, int, int]], line: Line) -> bool:
    """Read the rows into the new buffer's slots, with their stamps, a chunk at a time; a hole's
    slot stays empty (stamp 0, leaf 0). Returns whether a row is a hole or used up (``len`` then
    leaves them out: ``Counter.REMOVED``)."""
    arrays = columns(buf)
    lc = buf.lane_capacity
    targets = {**buf.block.fields, **{c.name: arrays[c.name] for c in row_columns(buf.options) if c.saved and c.block}}
    prios = buf.priorities
    max_use = buf.options.max_use
    step = max(1, CHUNK_BYTES // max(1, sum(t.row_bytes for t in files)))
    pos = 0
    removed = False
    tensors = [t for t in files if t.name != "_present"]

    def offset(name: str, row: int, row_bytes: int) -> int:
        return data_start + entries[name].begin + row * row_bytes

    for lane, (first, stop, _) in enumerate(lanes):
        for n0, n1, sl in pieces(lane, first, stop, lc, step):
            present, got = read_piece(fd, file, offset, "", pos + n0 - first, tensors, targets, lane, n0, sl)
            removed |= not present.all()
            leaf, uses = got.get("_leaf"), got.get("_uses")
            if uses is not None and max_use is not None and uses.size and int(uses.max()) > max_use:
                raise LayoutError(f"{file}: tensor '_uses' holds {int(uses.max())}, more than max_use={max_use}")
            if leaf is not None:
                assert prios is not None
                if not np.all((leaf >= 0) & (leaf <= MAX_LEAF)) or not prios.leaves_valid(leaf):
                    raise LayoutError(
                        f"{file}: tensor '_leaf' holds negative or non-finite priorities, or leaves "
                        f"above {MAX_LEAF:g} or of no finite priority: expected tree leaves (sampler.leaf(p)) "
                        f"in [0, {MAX_LEAF:g}] of finite priorities p; the file was altered or is not a save"
                    )
                prios.tree.update(np.arange(sl.start, sl.stop), leaf)
                # end and lead rows are never drawn: their leaves are 0
                rows = present if KIND not in got else present & (got[KIND] & (END | LEAD) == 0)
                removed |= check_leaves(buf, leaf, uses, rows, file, lane, n0)
            snapshot.restore(buf, sl, n0, present)
            line.update(pos + n1 - first)
        pos += stop - first
    return removed


def read_piece(fd: int, file: Path, offset: Callable[[str, int, int], int], prefix: str, row: int,
               tensors: list[Tensor], targets: dict[str, np.ndarray], lane: int, n0: int,
               sl: slice) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Rows ``n0 ..`` of ``lane`` in its slots ``sl`` (a piece, ``rows.pieces``) from a save or a
    checkpoint's chunk: their ``_present`` flags and each of ``tensors`` (tensor ``prefix + name``'s
    row ``row`` lies at ``offset(prefix + name, row, row bytes)`` of ``fd``), each read straight into
    its slots of ``targets`` where it has them (the tree's leaves have none); the flags as bools and
    the tensors read. ``LayoutError`` naming ``file`` for a flag other than 0 or 1, or a hole whose
    bytes are not zeros (a save writes zeros in every tensor of a hole)."""
    k = sl.stop - sl.start
    flags = np.empty(k, np.uint8)
    pread_into(fd, flags, offset(prefix + "_present", row, 1), file)
    if flags.size and flags.max() > 1:
        raise LayoutError(f"{file}: tensor '{prefix}_present' holds {int(flags.max())}, expected 0 or 1")
    present = flags.astype(bool)
    got: dict[str, np.ndarray] = {}
    for t in tensors:
        target = targets[t.name][sl] if t.name in targets else None
        staged = target if target is not None and target.flags.c_contiguous else np.empty((k, *t.shape), t.dtype)
        pread_into(fd, staged, offset(prefix + t.name, row, t.row_bytes), file)
        if not present.all() and staged[~present].any():
            raise LayoutError(
                f"{file}: tensor '{prefix}_present' marks row {n0 + int(np.flatnonzero(~present)[0])} of lane {lane} a "
                f"hole, but its {t.name!r} is not zeros (a save writes zeros in every tensor of a hole): the file was altered")
        if target is not None and staged is not target:
            target[...] = staged
        got[t.name] = staged
    return present, got


def check_leaves(buf: Buffer, leaf: np.ndarray, uses: np.ndarray | None, rows: np.ndarray, file: Path,
                  lane: int, n0: int) -> bool:
    """A chunk's ``_leaf`` against its ``_uses``, as the sampler keeps them (under the lock,
    together): a row used up (``max_use``) has the leaf 0, any other the leaf its sampler gives a
    row (1 without priorities; more than 0 with them unless ``eps`` is 0, which lets a priority of
    0 have the leaf 0). A row with a leaf of 0 is never drawn though ``len`` counts it, and a
    uniform row with another leaf is drawn more or less often than the others. Returns whether
    a row of the chunk (of ``rows``: those saved, not end or lead rows) is used up."""
    prios = buf.priorities
    assert prios is not None
    max_use = buf.options.max_use
    up = np.zeros(leaf.shape, bool) if uses is None or max_use is None else uses.astype(np.int64) >= max_use
    s = buf.options.sampler
    if not s.prioritized:
        bad = np.where(up, leaf != 0, leaf != 1)
    else:
        zero = float(s.leaf(np.zeros(1))[0]) == 0  # whether a priority of 0 has the leaf 0 (eps 0)
        bad = (up & (leaf != 0)) | (~up & (leaf == 0) & (not zero))
    bad &= rows
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise LayoutError(
            f"{file}: tensor '_leaf' holds {float(leaf[at])!r} for row {n0 + at} of lane {lane}, whose use count is "
            f"{'max_use' if up[at] else 'below max_use' if max_use is not None else 'not kept'}: expected "
            f"{'0' if up[at] else '1' if not s.prioritized else 'a leaf above 0'} (the sampler keeps the two together); "
            "the file was altered")
    return bool((up & rows).any())


def check_kinds(buf: Buffer, lanes: list[tuple[int, int, int]], file: Path) -> None:
    """The ``_kind`` of a loaded frames save against its rows (``frames.misplaced``), which every
    reader trusts. Checked in the new buffer's slots, lane by lane."""
    if buf.block.kinds is None:  # rows without kinds: each is a whole transition
        return
    for lane, (first, stop, _) in enumerate(lanes):
        if stop <= first:
            continue
        slots = slot(lane, np.arange(first, stop, dtype=np.int64), buf.lane_capacity)
        found = misplaced(buf.options.rows, slots, snapshot.restored(buf, slots), buf.block.fields)
        if found is not None:
            at = first + found[0]
            raise LayoutError(f"{file}: tensor '_kind' {found[1].format(lane=lane, row=at, next=at + 1)} "
                              "(frames.py); the file was altered")


READERS: dict[int, Callable[..., Buffer]] = {FORMAT_VERSION_1: read_v1, FORMAT_VERSION_2: read_v2,
                                             FORMAT_VERSION_3: read_v3}
"""Format version -> its reader. A later version adds its reader here and keeps the older ones."""
