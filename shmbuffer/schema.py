"""Schemas: the named, fixed-shape, fixed-dtype fields of a buffer's rows.

A schema is what a user declares and what every attaching process checks::

    Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"))
    Schema({"obs": {"shape": 4}, "rew": {}})          # a cpprb env_dict

It owns three things:

* **Validation** of pushed data (``Schema.validate``): every field present and no other, shapes
  ``shape`` (one row) or ``(k, *shape)`` (k rows) with the same ``k`` everywhere, and dtypes that
  cast safely (see ``_check_cast`` for the exact rule). It never copies and never touches shared
  state, so a failed push leaves the buffer as it was.
* **The packed record.** Fields of at most ``PACK_LIMIT`` bytes a row share one record of
  ``Record.itemsize`` bytes: a batch of them is gathered with one ``np.take`` and moved to a device
  with one copy, instead of one per field (``benchmarks/README.md`` measures the difference). Fields are placed by descending itemsize, then by name, so every field is
  naturally aligned; the record is padded to a multiple of 8 bytes (16 with complex128 fields), so
  that a field is also a strided view of the record reinterpreted as the field's dtype. Larger fields (images) keep a
  column of their own. The user always sees named fields.
* **The fingerprint**: blake2b-128 over the canonical JSON of the fields sorted by name, so two
  schemas with the same fields in another order are equal and share a layout.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import keyword
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FieldError, SchemaError

PACK_LIMIT = 1024
"""Fields whose row is at most this many bytes share the packed record."""

RESERVED = frozenset(
    {"index", "weight", "mask", "source", "steps", "lane", "keys", "values", "items", "to",
     "numpy", "size", "fields", "extras", "get", "as_dict", "episode", "priority", "timeout", "resume",
     "to_tensordict"}
)
"""Names a field cannot take: ``Batch`` uses them for its attributes and methods, ``push`` for
its keyword options."""


MAX_ROW_BYTES = 2**48
"""The most bytes one row of a field may take: more than any machine's shared memory, and far
from the 64-bit sizes that the block's layout computes with."""


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (int(value),)
    try:
        shape = tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise SchemaError(f"field {name!r}: shape must be a tuple of ints, got {value!r}") from None
    if any(d <= 0 for d in shape):
        raise SchemaError(f"field {name!r}: every dimension must be positive, got {shape}")
    return shape


def _dtype(value: Any, name: str) -> np.dtype[Any]:
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise SchemaError(f"field {name!r}: {value!r} is not a numpy dtype") from None
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None:
        raise SchemaError(
            f"field {name!r}: expected a numeric or bool dtype, got {dtype}; "
            "store text or objects elsewhere and keep an integer id here"
        )
    if not dtype.isnative:
        raise SchemaError(f"field {name!r}: dtype {dtype.str} is not in the native byte order")
    return dtype


@dataclass(frozen=True)
class Field:
    """One named column: every row holds an array of ``shape`` and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def row_bytes(self) -> int:
        """The bytes one row of this field takes."""
        return math.prod(self.shape) * self.dtype.itemsize  # Python ints: no wrap-around for a huge shape

    def describe(self) -> str:
        """``shape dtype``, as error messages show a field."""
        return f"{self.shape} {self.dtype}"

    def to_json(self) -> dict[str, Any]:
        """The field as JSON: name, shape, dtype string."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.str}


@dataclass(frozen=True)
class Record:
    """Where each small field sits inside the packed record (byte offsets into a row)."""

    itemsize: int
    offsets: dict[str, int]
    dtype: np.dtype[Any]
    """A structured dtype over the record, for numpy views of its fields."""

    def views(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """Views of each field of ``block``, an ``(n, itemsize)`` uint8 array; no copy."""
        rows = block.view(self.dtype).reshape(block.shape[0])
        return {name: rows[name] for name in self.offsets}


class Schema:
    """The fields of a buffer's rows, in the order they were declared.

    ``Schema(name=(shape, dtype), ...)``, ``Schema({name: {"shape": ..., "dtype": ...}})`` (a
    cpprb ``env_dict``: a missing shape means ``(1,)`` and a missing dtype float32, as in cpprb) or
    ``Schema(name=Field(...))``. Field names are identifiers, not starting with ``_``, not a Python
    keyword and not one of ``RESERVED``.
    """

    def __init__(self, env_dict: Mapping[str, Any] | None = None, /, **fields: Any) -> None:
        spec: dict[str, Any] = {}
        for name, value in (env_dict or {}).items():
            if not isinstance(value, Mapping):
                raise SchemaError(
                    f"field {name!r}: an env_dict entry must be a dict like "
                    f"{{'shape': (4,), 'dtype': 'float32'}}, got {value!r}"
                )
            unknown = set(value) - {"shape", "dtype"}
            if unknown:
                raise SchemaError(f"field {name!r}: unknown keys {sorted(unknown)}; use shape and dtype")
            spec[name] = (value.get("shape", 1), value.get("dtype", np.float32))
        for name, value in fields.items():
            if name in spec:
                raise SchemaError(f"field {name!r} is given twice")
            spec[name] = value
        if not spec:
            raise SchemaError("a schema needs at least one field")
        self._fields: dict[str, Field] = {}
        for name, value in spec.items():
            self._fields[name] = self._field(name, value)
        self._names = tuple(self._fields)
        self._keys = frozenset(self._fields)
        self._specs = tuple((f.name, f.shape, len(f.shape), f.dtype, f.shape == (1,)) for f in self._fields.values())
        self._record, self._columns = self._plan()
        canonical = json.dumps([self._fields[n].to_json() for n in sorted(self._fields)], sort_keys=True)
        self.fingerprint = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

    @staticmethod
    def _field(name: str, value: Any) -> Field:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise SchemaError(f"field name {name!r} must be a Python identifier")
        if name.startswith("_"):
            raise SchemaError(f"field name {name!r}: names starting with '_' are kept for internal columns")
        if name in RESERVED:
            raise SchemaError(f"field name {name!r} is reserved (a Batch attribute); rename it")
        if isinstance(value, Field):
            value = (value.shape, value.dtype)
        elif isinstance(value, Mapping):
            value = (value.get("shape", ()), value.get("dtype", np.float32))
        if not isinstance(value, tuple) or len(value) != 2:
            raise SchemaError(f"field {name!r}: expected (shape, dtype), got {value!r}")
        field = Field(name, _shape(value[0], name), _dtype(value[1], name))
        if field.row_bytes > MAX_ROW_BYTES:
            raise SchemaError(f"field {name!r}: one row of {field.describe()} takes {field.row_bytes} bytes, expected at "
                              f"most 2**48 (more than any machine's shared memory); check the shape")
        return field

    def _plan(self) -> tuple[Record, tuple[Field, ...]]:
        small = [f for f in self._fields.values() if f.row_bytes <= PACK_LIMIT]
        small.sort(key=lambda f: (-f.dtype.itemsize, f.name))
        offsets: dict[str, int] = {}
        at = 0
        for f in small:
            offsets[f.name] = at
            at += f.row_bytes
        align = max([8] + [f.dtype.itemsize for f in small])  # complex128 needs 16
        itemsize = -(-at // align) * align
        dtype = np.dtype(
            {
                "names": [f.name for f in small],
                "formats": [(f.dtype, f.shape) if f.shape else f.dtype for f in small],
                "offsets": [offsets[f.name] for f in small],
                "itemsize": max(itemsize, 1),
            }
        )
        big = tuple(f for f in self._fields.values() if f.row_bytes > PACK_LIMIT)
        return Record(itemsize, offsets, dtype), big

    # -- reading the schema ------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """The fields' names, in order."""
        return self._names

    @property
    def record(self) -> Record:
        """The packed record of the small fields (``itemsize`` 0 when every field is large)."""
        return self._record

    @property
    def columns(self) -> tuple[Field, ...]:
        """The large fields, each stored in a column of its own."""
        return self._columns

    @property
    def row_bytes(self) -> int:
        """The bytes one row of all fields takes (without the buffer's own columns)."""
        return sum(f.row_bytes for f in self._fields.values())

    def __getitem__(self, name: str) -> Field:
        try:
            return self._fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}: the schema has {', '.join(self._names)}") from None

    def __iter__(self) -> Iterator[Field]:
        return iter(self._fields.values())

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}=({f.shape}, {str(f.dtype)!r})" for f in self)
        return f"Schema({inner})"

    def to_json(self) -> list[dict[str, Any]]:
        """The schema as JSON: a list of its fields' ``to_json``."""
        return [f.to_json() for f in self]

    @classmethod
    def from_json(cls, fields: list[dict[str, Any]]) -> Schema:
        """The schema that ``to_json`` gave."""
        return cls(**{f["name"]: (tuple(f["shape"]), f["dtype"]) for f in fields})

    # -- validating pushed data ----------------------------------------------------------------
    def validate(self, data: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
        """Check ``data`` against the schema; return the row count and ``(k, *shape)`` arrays.

        Nothing is copied or cast here (the copy into shared memory casts); every check runs
        before the caller touches shared state. Raises ``FieldError`` naming the field.
        """
        if data.keys() != self._keys:
            self._missing_or_unknown(data)
        rows = -1
        single = False
        first = ""
        out: dict[str, np.ndarray] = {}
        for name, shape, ndim, dtype, cpprb in self._specs:
            value = data[name]
            a = value if type(value) is np.ndarray else _as_array(name, value)
            if cpprb and a.ndim < 2 and a.shape != (1,):
                # cpprb's default shape (1,): a scalar is one row, (k,) is k rows
                a = a.reshape(1) if a.ndim == 0 else a.reshape(-1, 1)
            got = a.shape
            if len(got) == ndim and got == shape:
                one, k = True, 1
                a = a[np.newaxis]
            elif len(got) == ndim + 1 and got[1:] == shape:
                one, k = False, got[0]
            else:
                raise FieldError(
                    f"field {name!r}: expected shape {shape} (one row) or "
                    f"({', '.join(map(str, ('k', *shape)))}{',' if not shape else ''}) (k rows) of "
                    f"{dtype}, got {a.shape} {a.dtype}"
                )
            if rows < 0:
                single, rows, first = one, k, name
            elif one != single or k != rows:
                mine = "one row" if one else f"{k} rows"
                theirs = "one row" if single else f"{rows} rows"
                raise FieldError(
                    f"ragged batch: field {first!r} has {theirs}, field {name!r} has {mine}; "
                    "every field needs the same number of rows"
                )
            if a.dtype != dtype:
                _check_cast(self._fields[name], a)
            out[name] = a
        return rows, out

    def _missing_or_unknown(self, data: Mapping[str, Any]) -> None:
        unknown = [n for n in data if n not in self._fields]
        if unknown:
            hint = difflib.get_close_matches(str(unknown[0]), self._names, n=1)
            near = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise FieldError(
                f"unknown field {unknown[0]!r}{near}: the schema has {', '.join(self._names)}"
            )
        missing = [n for n in self._names if n not in data]
        raise FieldError(
            f"missing field {missing[0]!r} ({self._fields[missing[0]].describe()}): every push needs "
            f"all of {', '.join(self._names)}"
        )


def _as_array(name: str, value: Any) -> np.ndarray:
    """``value`` as an array, or a ``FieldError`` naming the field and what to do."""
    if hasattr(value, "detach") and hasattr(value, "requires_grad"):  # a torch tensor
        if value.requires_grad:
            raise FieldError(
                f"field {name!r}: got a tensor that requires grad; push value.detach() (and .cpu())"
            )
        if value.device.type != "cpu":
            raise FieldError(f"field {name!r}: got a tensor on {value.device}; push value.cpu() (or .numpy())")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        raise FieldError(
            f"field {name!r}: got a tuple of an array and a dict, which looks like env.reset()'s or "
            f"a step's (obs, info); push the observation alone: obs, info = env.reset()"
        )
    try:
        return np.asarray(value)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise FieldError(
            f"field {name!r}: cannot be made an array ({type(value).__name__}: {str(exc)[:200]}); "
            "push a numpy array, a number or a list of equal-length rows"
        ) from None


def _largest(dtype: np.dtype[Any]) -> float:
    """The largest magnitude a value of ``dtype`` can have."""
    if dtype.kind in "iu":
        return float(max(abs(np.iinfo(dtype).min), np.iinfo(dtype).max))
    return float(np.finfo(dtype).max)


def _check_cast(f: Field, a: np.ndarray) -> None:
    """Allow a cast that loses nothing a user would miss; refuse the rest before any write.

    Allowed: numpy's ``safe`` casts; bools, integers and floats into any float field (float64
    observations into float32, what every peer does; finite values must fit, else they would
    silently become inf); integers to a narrower integer or to bool when every value fits (checked);
    ints equal to 0 or 1 into bool. Refused: float to integer or to bool, complex to real, anything non-numeric.
    """
    src, dst = a.dtype, f.dtype
    if np.can_cast(src, dst, casting="safe"):
        return
    if src.kind in "iufc" and dst.kind in "fc" and a.size and float(np.finfo(dst).max) < _largest(src):
        big = np.finfo(dst).max  # of a complex dtype: of its real and imaginary parts
        parts = np.abs(a) if src.kind != "c" else np.maximum(np.abs(a.real), np.abs(a.imag))
        finite = parts
        if not parts.max() <= big:  # an inf, a value too large, or a NaN (which hides the largest) looks further
            finite = parts[np.isfinite(parts)]
        if finite.size and finite.max() > big:
            raise FieldError(
                f"field {f.name!r}: expected {dst} values within +-{big:.3g}, got {src} values up to "
                f"{finite.max():.3g}, which would become inf"
            )
        if src.kind != "c" or dst.kind == "c":
            return
    if src.kind in "biuf" and dst.kind in "fc":
        return
    if src.kind in "iub" and dst.kind in "iu" and a.size:
        info = np.iinfo(dst)
        lo, hi = a.min(), a.max()
        if lo >= info.min and hi <= info.max:
            return
        raise FieldError(
            f"field {f.name!r}: expected {dst} values in [{info.min}, {info.max}], got {src} "
            f"values in [{lo}, {hi}]"
        )
    if dst.kind == "b" and src.kind == "f":
        raise FieldError(
            f"field {f.name!r}: expected bool, got {src}: a float flag is refused (is it 1 - done, or a "
            "field pushed in the wrong place?); push a bool (terminated), or .astype(bool) if you mean it"
        )
    if dst.kind == "b" and src.kind in "iu" and a.size:
        if np.all((a == 0) | (a == 1)):
            return
        raise FieldError(f"field {f.name!r}: expected bool, got {src} with values other than 0 and 1")
    if a.size == 0 and src.kind in "iuf":
        return
    raise FieldError(
        f"field {f.name!r}: expected {dst}, got {src}, which does not cast safely; "
        f"convert it first (e.g. .astype({str(dst)!r}))"
    )


def stack_rows(rows: Any, schema: Schema) -> dict[str, Any]:
    """A list of row mappings (what collectors and pipelines hand over) as one mapping of ``k``
    rows; every row must have the same keys. ``FieldError`` saying which row differs."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, (list, tuple)):
        raise TypeError(
            f"push() expected a mapping of fields or a list of them, got {type(rows).__name__}: "
            f"a row is a dict of the schema's fields ({', '.join(schema.names)})"
        )
    if not rows:
        raise FieldError("push() got an empty list of rows")
    keys = None
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(
                f"push(): row {i} of the list is a {type(row).__name__}, expected a mapping of fields "
                f"({', '.join(schema.names)})"
            )
        if keys is None:
            keys = list(row.keys())
        elif set(row.keys()) != set(keys):
            raise FieldError(f"push(): row {i} has fields {sorted(row)}, row 0 has {sorted(keys)}; every row needs the same")
    assert keys is not None
    out: dict[str, Any] = {}
    for key in keys:
        try:
            out[key] = np.stack([as_numpy(row[key]) for row in rows])
        except ValueError as exc:
            raise FieldError(f"push(): field {key!r} differs in shape between rows ({exc})") from None
    return out


def as_numpy(value: Any) -> np.ndarray:
    """A numpy array of ``value`` (a torch tensor is moved to the host first)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def as_schema(schema: Schema | Mapping[str, Any]) -> Schema:
    """A ``Schema``, or a cpprb-style ``env_dict`` made into one."""
    if isinstance(schema, Schema):
        return schema
    if isinstance(schema, Mapping):
        return Schema(schema)
    hint = " (the schema comes first: ReplayBuffer(schema, capacity))" if isinstance(schema, int) else ""
    raise SchemaError(f"expected a Schema or a cpprb-style env_dict, got {type(schema).__name__}{hint}")
