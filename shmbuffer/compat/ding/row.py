"""The row of ``shmbuffer.compat.ding``: which values of a push get a column of their own, and the
object and meta slots (fixed-size ``uint8`` fields, their bytes as ``codec`` specifies) that take
the rest (``Layout``). The package's docstring describes the row.
"""

from __future__ import annotations

import keyword
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from ...buffer import ReplayBuffer
from ...errors import UnsafePickle
from ...protocol import by_position
from ...schema import RESERVED, Schema
from . import codec
from .codec import BufferedData

DATA, OBJECT, META = "ding_data", "ding_object", "ding_meta"
"""The row's own fields: a bare ``data``'s column, the object slot, the meta slot."""
OBJECT_BYTES, META_BYTES = 1024, 256
"""The slots' least default sizes."""
DERIVED = ("priority_idx", "priority_IS")
"""Meta keys computed at every read (the row's slot, its IS weight), never stored."""


class Column(NamedTuple):
    """A value that has a column: its Python kind, shape and numpy dtype."""

    kind: str  # "int", "float", "bool", "scalar" (a numpy number), "array", "tensor"
    shape: tuple[int, ...]
    dtype: str


def _column_of(value: Any) -> Column | None:
    """The column that holds ``value`` as it is, or ``None`` (it goes to the object slot)."""
    kind = type(value)
    if kind is bool:
        return Column("bool", (), "|b1")
    if kind is int:
        return Column("int", (), "<i8") if -(1 << 63) <= value < (1 << 63) else None
    if kind is float:
        return Column("float", (), "<f8")
    if isinstance(value, np.generic):
        return Column("scalar", (), value.dtype.str) if value.dtype.kind in "biufc" else None
    if kind is np.ndarray:
        a = value
        name = "array"
    else:
        torch = sys.modules.get("torch")  # not imported: data cannot be a tensor
        if torch is None or kind is not torch.Tensor or value.device.type != "cpu" or value.requires_grad:
            return None
        try:
            a = value.numpy()
        except (TypeError, RuntimeError):  # bfloat16, sparse, ...: no numpy view
            return None
        name = "tensor"
    if a.dtype.kind not in "biufc" or 0 in a.shape:
        return None
    return Column(name, tuple(a.shape), a.dtype.str)


def _fits(value: Any, col: Column) -> bool:
    """``_column_of(value) == col``, without building a ``Column`` for the usual kinds (every push)."""
    kind, t = col.kind, type(value)
    if kind == "float":
        return t is float
    if kind == "int":
        return t is int and -(1 << 63) <= value < (1 << 63)
    if kind == "array":
        return t is np.ndarray and value.shape == col.shape and value.dtype.str == col.dtype
    if kind == "bool":
        return t is bool
    return _column_of(value) == col


def _values(col: Column, a: np.ndarray) -> list[Any]:
    """A column's rows (a gathered copy) as the kind that was pushed, each row its own memory."""
    if col.kind in ("int", "float", "bool"):
        return a.tolist()  # int64, float64, bool: Python's int, float, bool
    if col.kind == "scalar":
        return [a[i] for i in range(len(a))]
    rows = [a[i].copy() for i in range(len(a))]  # a row's view would keep the whole batch alive
    if col.kind == "tensor":
        import torch

        return [torch.from_numpy(r) for r in rows]
    return rows


def _nameable(key: Any) -> bool:
    """``key`` can name a field of the schema (and is not one of the row's own)."""
    return (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key) and not key.startswith("_")
            and key not in RESERVED and not key.startswith("ding_"))


def _slot(payload: Any, size: int, what: str, trusted: bool) -> np.ndarray:
    """``payload`` encoded into a slot of ``size`` bytes (zeros for ``None``, see ``codec``), or
    ``UnsafePickle``, ``TypeError`` or ``ValueError`` saying why it cannot be stored."""
    out = np.zeros(size, np.uint8)
    if payload is None:
        return out
    raw = _encode(payload, what, trusted)
    if len(raw) > size:
        option = "object_bytes" if what == "data" else "meta_bytes"
        raise ValueError(
            f"DequeBuffer: the {what} takes {len(raw)} bytes, more than its slot of {size} bytes in each row "
            f"(set at the first push); create the buffer with DequeBuffer(size, {option}={len(raw)} or more), or "
            "push arrays as values of a dict (they get columns of their own); nothing was stored")
    out[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _encode(payload: Any, what: str, trusted: bool) -> bytes:
    """``payload``'s bytes for the slot of ``what`` (``codec.encode``), or the error saying why not."""
    try:
        return codec.encode(payload, trusted)
    except UnsafePickle as e:
        refused = e
    except TypeError as e:  # pickle's refusal
        raise _unpicklable(what, e) from None
    except ValueError as e:
        raise ValueError(f"DequeBuffer: the {what} cannot be stored: {e}; nothing was stored") from None
    try:  # trusted_pickles=True would not store what pickle cannot: say that instead
        codec.encode(payload, True)
    except TypeError as e:
        raise _unpicklable(what, e) from None
    raise UnsafePickle(f"DequeBuffer: the {what} cannot be stored: {refused}; nothing was stored") from None


def _unpicklable(what: str, e: TypeError) -> TypeError:
    return TypeError(f"DequeBuffer: the {what} cannot be pickled into the row ({e}); push picklable objects "
                     "(numbers, arrays, tensors, str, lists and dicts of them, dataclasses); nothing was stored")


def _unslots(slots: np.ndarray, trusted: bool, ids: np.ndarray, what: str) -> list[Any]:
    """Each slot's object (``None`` when empty, see ``codec``); bytes another process wrote that
    are not what this buffer writes raise ``UnsafePickle`` naming the row."""
    full = (slots[:, 0] != 0).tolist()
    out: list[Any] = []
    for j in range(len(full)):
        if not full[j]:
            out.append(None)
            continue
        try:
            out.append(codec.decode(slots[j].tobytes(), trusted))
        except UnsafePickle as e:
            raise UnsafePickle(f"DequeBuffer: row {int(ids[j])}'s {what}: {e}") from None
        except Exception as e:  # bytes no writer of this buffer wrote, whatever they make the reader raise
            raise UnsafePickle(f"DequeBuffer: row {int(ids[j])}'s {what} slot does not hold what this buffer "
                               f"writes ({type(e).__name__}: {e}); another process wrote bytes into it directly, "
                               "or a save_data file was altered. Delete the row (buffer.delete) or clear the "
                               "buffer") from None
    return out


class Layout:
    """How ``data`` and ``meta`` map onto a row (see the docstring of ``shmbuffer.compat.ding``): ``columns`` (field name
    to ``Column``), ``bare`` (the data itself is the column ``ding_data``), the slots' sizes."""

    def __init__(self, columns: Mapping[str, Column], bare: bool, object_bytes: int, meta_bytes: int) -> None:
        self.columns = dict(columns)
        self.bare = bare
        self.object_bytes = object_bytes
        self.meta_bytes = meta_bytes

    @classmethod
    def first(cls, data: Any, meta: Mapping[str, Any], object_bytes: int | None, meta_bytes: int | None,
              trusted: bool) -> Layout:
        """The layout the first push gives (the slots 4 times its own, at least the defaults)."""
        columns: dict[str, Column] = {}
        bare = False
        if type(data) is dict:
            for key, value in data.items():
                col = _column_of(value) if _nameable(key) else None
                if col is not None:
                    columns[key] = col
        else:
            col = _column_of(data)
            if col is not None:
                columns, bare = {DATA: col}, True
        layout = cls(columns, bare, 0, 0)
        if object_bytes is None:
            _, rest = layout.split(data)
            object_bytes = max(OBJECT_BYTES, 4 * len(_encode(rest, "data", trusted)) if rest is not None else 0)
        if meta_bytes is None:
            meta_bytes = max(META_BYTES, 4 * len(_encode(dict(meta), "meta", trusted)) if meta else 0)
        layout.object_bytes, layout.meta_bytes = -(-object_bytes // 8) * 8, -(-meta_bytes // 8) * 8
        if not layout.columns and not layout.object_bytes:
            raise ValueError("DequeBuffer: with object_bytes=0 the first push must be numbers or arrays "
                             f"(a dict of them, or one), got a {type(data).__name__}")
        return layout

    def schema(self) -> Schema:
        """The shared buffer's schema: the columns, then the object and meta slots (bytes)."""
        fields: dict[str, Any] = {name: (c.shape, c.dtype) for name, c in self.columns.items()}
        if self.object_bytes:
            fields[OBJECT] = ((self.object_bytes,), "uint8")
        if self.meta_bytes:
            fields[META] = ((self.meta_bytes,), "uint8")
        return Schema(**fields)

    def split(self, data: Any) -> tuple[dict[str, Any], Any]:
        """``data`` as column values and what goes to the object slot (``None``: nothing)."""
        whole: tuple[dict[str, Any], Any] = {}, ("whole", data)
        if self.bare:
            return ({DATA: _numpy(data)}, None) if _fits(data, self.columns[DATA]) else whole
        if type(data) is not dict:
            return whole
        cols = {}
        for k, c in self.columns.items():
            value = data.get(k, _MISSING)
            if not _fits(value, c):
                return whole
            cols[k] = _numpy(value)
        rest = {k: v for k, v in data.items() if k not in self.columns}
        natural = list(self.columns) + list(rest)
        if not rest and list(data) == natural:
            return cols, None
        return cols, ("rest", rest, None if list(data) == natural else list(data))

    def data_fields(self, data: Any, trusted: bool) -> dict[str, np.ndarray]:
        """The fields that store ``data`` (an update writes these); ``ValueError`` when too big."""
        cols, payload = self.split(data)
        if payload is not None and not self.object_bytes:
            raise ValueError(f"DequeBuffer: this buffer has no object slot (object_bytes=0), so its data must fit "
                             f"the columns {self.describe()}; got {type(data).__name__}")
        if self.object_bytes:
            cols[OBJECT] = _slot(payload, self.object_bytes, "data", trusted)
        return cols

    def meta_fields(self, meta: Mapping[str, Any], trusted: bool) -> dict[str, np.ndarray]:
        """The meta slot's field for ``meta`` (``codec``); ``ValueError`` when it does not fit."""
        if not self.meta_bytes:
            if meta:
                raise ValueError(f"DequeBuffer: this buffer has no meta slot (meta_bytes=0); got meta keys {list(meta)}")
            return {}
        return {META: _slot(dict(meta) if meta else None, self.meta_bytes, "meta", trusted)}

    def row(self, data: Any, meta: Mapping[str, Any], trusted: bool) -> dict[str, Any]:
        """A whole row to push: a row whose data went to the object slot has zeros in the columns."""
        out = self.data_fields(data, trusted)
        for name, c in self.columns.items():
            if name not in out:
                out[name] = np.zeros(c.shape, c.dtype)
        out.update(self.meta_fields(meta, trusted))
        return out

    def datas(self, fields: Mapping[str, np.ndarray], rows: list[int], ids: np.ndarray, trusted: bool) -> list[Any]:
        """Rows ``rows`` of gathered ``fields`` (``ids`` theirs), each as it was pushed; ``trusted``:
        pickles are loaded too, else only plain data (``codec``)."""
        payloads = _unslots(fields[OBJECT][rows], trusted, ids, "data") if self.object_bytes else [None] * len(rows)
        columns = {name: _values(c, fields[name][rows]) for name, c in self.columns.items()}
        out = []
        for j, payload in enumerate(payloads):
            if payload is not None and payload[0] == "whole":
                out.append(payload[1])
                continue
            values = {name: column[j] for name, column in columns.items()}
            if self.bare:
                out.append(values[DATA])
            elif payload is None:
                out.append(values)
            else:
                _, rest, order = payload
                values.update(rest)
                out.append(values if order is None else {k: values[k] for k in order})
        return out

    def metas(self, fields: Mapping[str, np.ndarray], rows: list[int], ids: np.ndarray,
              trusted: bool) -> list[dict[str, Any]]:
        """The meta of rows ``rows`` of gathered ``fields`` (``ids`` theirs), each as it was pushed."""
        if not self.meta_bytes:
            return [{} for _ in rows]
        return [{} if m is None else m for m in _unslots(fields[META][rows], trusted, ids, "meta")]

    def check_slots(self, arrays: Mapping[str, Any], trusted: bool, source: str) -> None:
        """Refuse slots in ``arrays`` (a file's rows, ``source``) that are not this layout's, or
        (``trusted`` off) that this buffer would not read back: ``UnsafePickle`` naming the row
        (its place in the file)."""
        for name, size, what in ((OBJECT, self.object_bytes, "data"), (META, self.meta_bytes, "meta")):
            if not size:
                continue
            slots = np.asarray(arrays.get(name, np.zeros((0, 0), np.uint8)))
            if slots.dtype != np.uint8 or slots.ndim != 2 or slots.shape[1] != size:
                raise ValueError(f"{source}: the {what} slots ({name}): expected rows of {size} bytes (uint8), "
                                 f"got {slots.shape} {slots.dtype}")
            if not trusted:
                _unslots(slots, trusted, np.arange(len(slots)), what)

    def describe(self) -> str:
        """The columns, for error messages."""
        return "{" + ", ".join(f"{k!r}: {c.kind} {c.shape} {np.dtype(c.dtype).name}" for k, c in self.columns.items()) + "}"

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON (``save_data``)."""
        return {"columns": {k: [c.kind, list(c.shape), c.dtype] for k, c in self.columns.items()}, "bare": self.bare,
                "object_bytes": self.object_bytes, "meta_bytes": self.meta_bytes}

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> Layout:
        """The layout ``to_json`` gave."""
        columns = {k: Column(kind, tuple(shape), dtype) for k, (kind, shape, dtype) in j["columns"].items()}
        return cls(columns, bool(j["bare"]), int(j["object_bytes"]), int(j["meta_bytes"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]


_MISSING = object()


def _numpy(value: Any) -> Any:
    """A column's value as the core takes it (a tensor as its numpy view)."""
    return value.numpy() if type(value).__module__ == "torch" else value



def flat(sampled: Any) -> Iterator[BufferedData]:
    """The rows of a sample, whether a list of rows or (grouped) a list of lists of them."""
    for item in sampled or ():
        if isinstance(item, list):
            yield from item
        elif isinstance(item, BufferedData):
            yield item



def live(buf: ReplayBuffer) -> np.ndarray:
    """The ids of the rows of ``buf`` held and committed now, oldest first (deleted rows left out)."""
    return by_position.live(buf)

