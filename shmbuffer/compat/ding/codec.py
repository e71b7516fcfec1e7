"""The bytes of the object and meta slots of ``shmbuffer.compat.ding`` (a row's ``ding_object`` and
``ding_meta``, fixed-size ``uint8`` fields), and ``BufferedData``, the row as DI-engine returns it.

Any process that can attach to the shared block can write any bytes into a slot, and so can anyone
who edits a ``save_data`` file. So by default a slot holds plain data in this encoding, whose reader
builds only plain values: it runs no code, makes no object that holds a pointer (no object array or
dtype, no class), and allocates nothing larger than the slot. A slot of ``n`` bytes holds one of:

* zeros: no object (``None``);
* ``0x01`` (the encoding's version), one *value*, then zeros to the slot's end (a reader
  ignores what follows the value);
* ``0x80``: a pickle (protocol 5, whose first byte is ``0x80``), then zeros. Only a ``DequeBuffer``
  made with ``trusted_pickles=True`` writes pickles (any class) or reads them; any other reader
  raises ``UnsafePickle`` naming what the pickle names, without loading it.

A value is one tag byte, then its body. In bodies, numbers are little-endian: ``u1``/``u4`` an
unsigned 8/32-bit count or length, ``i8`` a signed 64-bit integer, ``f8`` an IEEE double:

======  ===============================  ==================================================
tag     value                            body
======  ===============================  ==================================================
``N``   ``None``                         --
``T``   ``True``                         --
``F``   ``False``                        --
``q``   ``int`` in int64's range         ``i8``
``I``   any other ``int``                ``u4`` length, that many bytes (two's complement)
``d``   ``float``                        ``f8``
``j``   ``complex``                      ``f8`` real, ``f8`` imaginary
``s``   ``str``                          ``u4`` length, UTF-8 (``surrogatepass``)
``b``   ``bytes``                        ``u4`` length, the bytes
``B``   ``bytearray``                    ``u4`` length, the bytes
``l``   ``list``                         ``u4`` count, the items' values
``t``   ``tuple``                        ``u4`` count, the items' values
``S``   ``set``                          ``u4`` count, the items' values
``f``   ``frozenset``                    ``u4`` count, the items' values
``m``   ``dict``                         ``u4`` count, key and value values in turn
``o``   ``collections.OrderedDict``      as ``m``
``C``   ``collections.Counter``          as ``m``
``u``   ``collections.defaultdict``      ``u1`` factory (``FACTORIES``), then ``m``'s body
``Q``   ``collections.deque``            ``maxlen`` (an ``N`` or ``q`` value), the items (an ``l`` value)
``r``   ``range``                        start, stop, step (three ``q``/``I`` values)
``c``   ``slice``                        start, stop, step (three values)
``a``   ``numpy.ndarray``                dtype, ``u1`` ndim, ndim ``i8`` dims, the bytes
``g``   a numpy scalar                   dtype, the bytes (one item)
``y``   ``numpy.dtype``                  dtype
``x``   ``torch.Tensor``                 ``u1`` torch dtype (``TORCH``), ``u1`` requires_grad,
                                         device (an ``s`` value), ``u1`` ndim, ndim ``i8``
                                         dims, the bytes
``z``   ``torch.Size``                   ``u4`` count, ``i8`` each
``e``   ``torch.dtype``                  ``u1`` torch dtype (``TORCH``)
``D``   ``torch.device``                 its name (an ``s`` value)
``R``   ``BufferedData``                 data, index, meta (three values)
======  ===============================  ==================================================

A numpy dtype is ``u1`` length then its ASCII ``dtype.str``, which must be a kind whose items are
plain bytes: bool, numbers, fixed-width strings, datetimes (``|b1``, ``<i8``, ``>f4``, ``<c16``,
``<U5``, ``|S3``, ``<M8[ns]``: ``[<>|]``, then ``[biufcSU]`` and a size from 1, or ``[mM]8`` and a
unit), as numpy itself writes it. An array's or a tensor's bytes are its items in C order,
``prod(dims) * itemsize`` of them. Anything else (an object or structured array, a subclass, a
user's class) is refused at the push with ``UnsafePickle`` naming it; ``trusted_pickles=True``
stores it as a pickle.

The reader checks every length, count and array size against the bytes left in the slot before it
makes anything, every value takes at least one byte, and values nest at most ``DEPTH`` deep: a slot
of ``n`` bytes reads as at most ``n`` objects, an array, tensor, ``bytes`` or ``int`` of at most
``n`` bytes, a ``str`` of at most ``n`` characters. Bytes it does not read
as this encoding raise ``UnsafePickle``, naming the row. Shared references and cycles are not kept
(a value referenced twice is written twice; a cycle is refused as too deep).
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
import re
import struct
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import UnsafePickle

VERSION, PICKLED = 0x01, 0x80
"""A slot's first byte: this encoding, or a pickle (``trusted_pickles=True`` only)."""
DEPTH = 100
"""How deep values nest at most."""
TORCH = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
         "complex64", "complex128")
"""The torch dtypes stored, by number."""
FACTORIES: tuple[Any, ...] = (None, list, dict, set, int, float, str, tuple)
"""The ``default_factory`` of a ``defaultdict`` stored, by number."""
_PICKLE = 5
_U4, _I8, _F8, _C16 = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<d"), struct.Struct("<dd")
_DTYPE = re.compile(r"[<>|]([biufcSU][1-9][0-9]{0,8}|[mM]8(\[[0-9]{0,9}[a-zA-Z]{1,2}\])?)")
_MAPS: dict[type, bytes] = {dict: b"m", OrderedDict: b"o", Counter: b"C"}
_SEQS: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"S", frozenset: b"f"}


@dataclass
class BufferedData:
    """One row as DI-engine returns it: ``data``, ``index`` (its id) and ``meta``."""

    data: Any
    index: Any
    meta: Any = field(default_factory=dict)


def encode(value: Any, trusted: bool) -> bytes:
    """``value``'s bytes for a slot: this encoding, or with ``trusted`` a pickle. Raises
    ``UnsafePickle`` naming what this encoding does not store, ``TypeError`` what pickle does not."""
    if trusted:
        try:
            return pickle.dumps(value, protocol=_PICKLE)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(str(e)) from None
    out = bytearray((VERSION,))
    _put(out, value, 0)
    return bytes(out)


def decode(raw: bytes, trusted: bool) -> Any:
    """The value of a slot's bytes ``raw`` (``None`` for zeros); ``ValueError`` saying why bytes
    are not a value this module wrote, ``UnsafePickle`` for a pickle unless ``trusted``."""
    first = raw[0] if raw else 0
    if first == VERSION:
        try:
            value, _ = _value(raw, 1, 0)
        except (IndexError, struct.error):
            raise ValueError("the slot ends inside a value") from None
        return value
    if first == PICKLED:
        if trusted:
            return pickle.loads(raw)
        raise UnsafePickle(f"it holds a pickle{_names(raw)}, which DequeBuffer loads only with trusted_pickles=True: "
                           "a process that can write the shared buffer could otherwise run code here. Create the "
                           "buffer with DequeBuffer(size, trusted_pickles=True) if every process that can attach "
                           "to it is trusted")
    if first == 0 and not raw.rstrip(b"\0"):
        return None
    raise ValueError(f"it starts with byte {first:#04x}, expected {VERSION:#04x} (plain data), "
                     f"{PICKLED:#04x} (a pickle) or an empty slot")


def _names(raw: bytes) -> str:
    """What a pickle names (``" naming os.system"``), read without loading it: ``seen`` follows the
    strings it pushes (``None`` for anything else) and memoizes, which ``STACK_GLOBAL`` takes."""
    names: list[str] = []
    seen: list[str | None] = []
    memo: dict[Any, str | None] = {}
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(raw)):
            if op.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(seen) >= 2:
                names.append(f"{seen[-2]}.{seen[-1]}")
            elif op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if op.name == "MEMOIZE" else arg] = seen[-1] if seen else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                seen.append(memo.get(arg))
            elif op.name not in ("PROTO", "FRAME"):
                seen.append(arg if isinstance(arg, str) else None)
    except Exception:  # only for the message: a broken pickle names what it named up to there
        pass
    return f" naming {', '.join(dict.fromkeys(names))}" if names else ""


# -- writing -------------------------------------------------------------------------------------
def _refuse(value: Any, what: str = "") -> UnsafePickle:
    kind = type(value)
    return UnsafePickle(
        f"a stored object is a {kind.__module__}.{kind.__qualname__}{what}, which DequeBuffer does not store by "
        "default (None, bool, int, float, complex, str, bytes, containers of them, numpy arrays, scalars "
        "and dtypes of numbers, bools, strings or datetimes, torch tensors): a process that can write the shared buffer could otherwise make "
        "the reader build any object. Push plain data, or create the buffer with DequeBuffer(size, "
        "trusted_pickles=True) if every process that can attach to it is trusted")


def _u4(out: bytearray, n: int) -> None:
    out += _U4.pack(n)


def _int(out: bytearray, v: int) -> None:
    if -(1 << 63) <= v < (1 << 63):
        out += b"q"
        out += _I8.pack(v)
    else:
        raw = v.to_bytes(v.bit_length() // 8 + 1, "little", signed=True)
        out += b"I"
        _u4(out, len(raw))
        out += raw


def _dtype(out: bytearray, dt: np.dtype[Any], owner: Any) -> None:
    name = _name(dt)
    if name is None:
        raise _refuse(owner, f" of dtype {dt}")
    out += name


@functools.lru_cache(maxsize=256)
def _name(dt: np.dtype[Any]) -> bytes | None:
    """``dt`` as this encoding writes it (``u1`` length, ``dtype.str``), ``None`` if it is not stored."""
    s = dt.str
    return bytes((len(s),)) + s.encode("ascii") if _DTYPE.fullmatch(s) else None


def _dims(out: bytearray, shape: tuple[int, ...]) -> None:
    out += bytes((len(shape),))
    for n in shape:
        out += _I8.pack(n)


def _put(out: bytearray, v: Any, depth: int) -> None:
    if depth > DEPTH:
        raise ValueError(f"it nests more than {DEPTH} deep, or holds itself (a cycle)")
    kind = type(v)
    if kind is str:
        raw = v.encode("utf-8", "surrogatepass")
        out += b"s"
        _u4(out, len(raw))
        out += raw
    elif kind in _MAPS or kind is defaultdict:
        if kind is defaultdict:
            if v.default_factory not in FACTORIES:
                raise _refuse(v, f" whose default_factory is {v.default_factory!r}")
            out += b"u"
            out += bytes((FACTORIES.index(v.default_factory),))
        else:
            out += _MAPS[kind]
        _u4(out, len(v))
        for k, x in v.items():
            _put(out, k, depth + 1)
            _put(out, x, depth + 1)
    elif kind in _SEQS:
        out += _SEQS[kind]
        _u4(out, len(v))
        for x in v:
            _put(out, x, depth + 1)
    elif kind is int:
        _int(out, v)
    elif kind is float:
        out += b"d"
        out += _F8.pack(v)
    elif v is None or kind is bool:
        out += b"N" if v is None else b"T" if v else b"F"
    elif kind is np.ndarray:
        out += b"a"
        _dtype(out, v.dtype, v)
        _dims(out, v.shape)
        out += v.tobytes()
    elif isinstance(v, np.generic):
        out += b"g"
        _dtype(out, v.dtype, v)
        out += v.tobytes()
    elif isinstance(v, np.dtype):
        out += b"y"
        _dtype(out, v, v)
    elif kind in (bytes, bytearray):
        out += b"b" if kind is bytes else b"B"
        _u4(out, len(v))
        out += v
    elif kind is complex:
        out += b"j"
        out += _C16.pack(v.real, v.imag)
    elif kind is deque:
        out += b"Q"
        _put(out, v.maxlen, depth + 1)
        _put(out, list(v), depth)
    elif kind in (range, slice):
        out += b"r" if kind is range else b"c"
        for x in (v.start, v.stop, v.step):
            _put(out, x, depth + 1)
    elif kind is BufferedData:
        out += b"R"
        for x in (v.data, v.index, v.meta):
            _put(out, x, depth + 1)
    elif kind.__module__.startswith("torch"):
        _torch(out, v, depth)
    else:
        raise _refuse(v)


def _torch(out: bytearray, v: Any, depth: int) -> None:
    import torch

    if isinstance(v, torch.dtype) and str(v)[6:] in TORCH:
        out += b"e"
        out += bytes((TORCH.index(str(v)[6:]),))
    elif type(v) is torch.device:
        out += b"D"
        _put(out, str(v), depth + 1)
    elif type(v) is torch.Size:
        out += b"z"
        _u4(out, len(v))
        for n in v:
            out += _I8.pack(n)
    elif type(v) is torch.Tensor and v.layout == torch.strided and str(v.dtype)[6:] in TORCH:
        out += b"x"
        out += bytes((TORCH.index(str(v.dtype)[6:]), v.requires_grad))
        _put(out, str(v.device), depth + 1)
        _dims(out, tuple(v.shape))
        flat = v.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        out += flat.view(torch.uint8).numpy().tobytes()
    else:
        raise _refuse(v, f" ({v.dtype}, {v.layout})" if isinstance(v, torch.Tensor) else "")


# -- reading -------------------------------------------------------------------------------------
def _value(raw: bytes, pos: int, depth: int) -> tuple[Any, int]:
    """The value at ``pos`` and where it ends. Fixed-size reads past the end raise ``IndexError``
    or ``struct.error`` (``decode`` words them); every length is checked before it is used."""
    if depth > DEPTH:
        raise ValueError(f"values nest more than {DEPTH} deep")
    tag = raw[pos:pos + 1]
    pos += 1
    if tag == b"s":
        n, pos = _length(raw, pos)
        return raw[pos:pos + n].decode("utf-8", "surrogatepass"), pos + n
    if tag == b"q":
        return _I8.unpack_from(raw, pos)[0], pos + 8
    if tag == b"d":
        return _F8.unpack_from(raw, pos)[0], pos + 8
    build = _CONTAINERS.get(tag)
    if build is not None:
        n, pos = _length(raw, pos)
        items: list[Any] = []
        append, size = items.append, len(raw)
        for _ in range(2 * n if tag in (b"m", b"o", b"C") else n):
            # the leaves read here, not by a call each: most values are leaves, and the calls
            # would double a read's time
            kind = raw[pos]
            if kind == 0x73:  # "s"
                m = _U4.unpack_from(raw, pos + 1)[0]
                pos += 5
                if m > size - pos:
                    raise ValueError(f"a length of {m} at offset {pos - 4}, the slot has {size - pos} bytes left")
                append(raw[pos:pos + m].decode("utf-8", "surrogatepass"))
                pos += m
            elif kind == 0x71:  # "q"
                append(_I8.unpack_from(raw, pos + 1)[0])
                pos += 9
            elif kind == 0x64:  # "d"
                append(_F8.unpack_from(raw, pos + 1)[0])
                pos += 9
            elif kind == 0x4E:  # "N"
                append(None)
                pos += 1
            else:
                item, pos = _value(raw, pos, depth + 1)
                append(item)
        return build(items), pos
    if tag in (b"N", b"T", b"F"):
        return _CONSTANTS[tag], pos
    read = _READ.get(tag)
    if read is None:
        raise ValueError(f"unknown tag {tag!r} at offset {pos - 1}")
    return read(raw, pos, depth + 1)


def _length(raw: bytes, pos: int) -> tuple[int, int]:
    """A ``u4`` length (of bytes, or of items that take a byte at least) no longer than the slot's rest."""
    n: int = _U4.unpack_from(raw, pos)[0]
    if n > len(raw) - pos - 4:
        raise ValueError(f"a length of {n} at offset {pos}, the slot has {len(raw) - pos - 4} bytes left")
    return n, pos + 4


def _dtype_at(raw: bytes, pos: int) -> tuple[np.dtype[Any], int]:
    n = raw[pos]
    return _checked(raw[pos + 1:pos + 1 + n]), pos + 1 + n


@functools.lru_cache(maxsize=256)
def _checked(name: bytes) -> np.dtype[Any]:
    """The dtype ``name`` (``dtype.str``) names, if it is one this encoding stores."""
    s = name.decode("ascii", "replace")
    if not _DTYPE.fullmatch(s) or np.dtype(s).str != s:
        raise ValueError(f"dtype {s!r}: expected a bool, number, fixed-width string or datetime dtype, "
                         "as numpy writes it")
    return np.dtype(s)


def _data_at(raw: bytes, pos: int, itemsize: int) -> tuple[tuple[int, ...], int, int]:
    """An array's dims, and where its ``prod(dims) * itemsize`` bytes start, checked against the slot's rest."""
    ndim = raw[pos]
    dims = struct.unpack_from(f"<{ndim}q", raw, pos + 1)
    pos += 1 + 8 * ndim
    n = itemsize
    for d in dims:
        if d < 0 or ndim > 32:
            raise ValueError(f"shape {dims}: expected at most 32 sizes >= 0")
        n *= d
    if n > len(raw) - pos:
        raise ValueError(f"an array of {n} bytes at offset {pos}, the slot has {len(raw) - pos} bytes left")
    return dims, pos, pos + n


def _array(raw: bytes, pos: int, depth: int) -> tuple[np.ndarray, int]:
    dt, pos = _dtype_at(raw, pos)
    dims, start, pos = _data_at(raw, pos, dt.itemsize)
    count = (pos - start) // dt.itemsize
    return np.frombuffer(raw, dt, count, start).reshape(dims).copy(), pos  # its own, writable memory


def _scalar(raw: bytes, pos: int, depth: int) -> tuple[Any, int]:
    dt, pos = _dtype_at(raw, pos)
    return np.frombuffer(raw, dt, 1, pos)[0], pos + dt.itemsize  # numpy checks the item is in the slot


def _sized(raw: bytes, pos: int, depth: int) -> tuple[bytes, int]:
    n, pos = _length(raw, pos)
    return raw[pos:pos + n], pos + n


def _table(table: tuple[Any, ...], raw: bytes, pos: int, what: str) -> Any:
    if raw[pos] >= len(table):
        raise ValueError(f"{what} number {raw[pos]} at offset {pos}: expected < {len(table)}")
    return table[raw[pos]]


def _tensor(raw: bytes, pos: int, depth: int) -> tuple[Any, int]:
    import torch

    dt = getattr(torch, _table(TORCH, raw, pos, "torch dtype"))
    grad = raw[pos + 1]
    device, pos = _value(raw, pos + 2, depth)
    dims, start, pos = _data_at(raw, pos, torch.empty((), dtype=dt).element_size())
    out = torch.empty(dims, dtype=dt)
    if pos > start:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, np.uint8, pos - start, start)
    out = out.to(torch.device(device))
    return (out.requires_grad_() if grad else out), pos


def _torch_small(raw: bytes, pos: int, depth: int) -> tuple[Any, int]:
    import torch

    tag = raw[pos - 1:pos]
    if tag == b"e":
        return getattr(torch, _table(TORCH, raw, pos, "torch dtype")), pos + 1
    if tag == b"D":
        name, pos = _value(raw, pos, depth)
        return torch.device(name), pos
    n, pos = _length(raw, pos)
    return torch.Size(struct.unpack_from(f"<{n}q", raw, pos)), pos + 8 * n


def _values(n: int) -> Callable[[bytes, int, int], tuple[list[Any], int]]:
    def read(raw: bytes, pos: int, depth: int) -> tuple[list[Any], int]:
        out = []
        for _ in range(n):
            value, pos = _value(raw, pos, depth)
            out.append(value)
        return out, pos
    return read


def _then(read: Callable[[bytes, int, int], tuple[Any, int]],
          make: Callable[[Any], Any]) -> Callable[[bytes, int, int], tuple[Any, int]]:
    def both(raw: bytes, pos: int, depth: int) -> tuple[Any, int]:
        value, pos = read(raw, pos, depth)
        return make(value), pos
    return both


def _defaultdict(raw: bytes, pos: int, depth: int) -> tuple[defaultdict[Any, Any], int]:
    factory = _table(FACTORIES, raw, pos, "defaultdict factory")
    n, pos = _length(raw, pos + 1)
    items, pos = _values(2 * n)(raw, pos, depth)
    return defaultdict(factory, _pairs(items)), pos


def _deque(raw: bytes, pos: int, depth: int) -> tuple[deque[Any], int]:
    (maxlen, items), pos = _values(2)(raw, pos, depth)
    if (maxlen is not None and (type(maxlen) is not int or maxlen < 0)) or type(items) is not list:
        raise ValueError(f"a deque at offset {pos}: expected its maxlen (None or an int >= 0), then a list")
    return deque(items, maxlen), pos


def _range(values: list[Any]) -> range:
    if any(type(v) is not int for v in values):
        raise ValueError(f"a range of {values}: expected ints")
    return range(*values)


def _pairs(items: list[Any]) -> Any:
    """Keys and values in turn, as pairs (``items`` has an even length)."""
    it = iter(items)
    return zip(it, it, strict=True)


_CONTAINERS: dict[bytes, Callable[[list[Any]], Any]] = {
    b"l": lambda items: items, b"t": tuple, b"m": lambda items: dict(_pairs(items)), b"S": set,
    b"f": frozenset, b"o": lambda items: OrderedDict(_pairs(items)), b"C": lambda items: Counter(dict(_pairs(items))),
}
_CONSTANTS = {b"N": None, b"T": True, b"F": False}
_READ: dict[bytes, Callable[[bytes, int, int], tuple[Any, int]]] = {
    b"I": _then(_sized, lambda raw: int.from_bytes(raw, "little", signed=True)),
    b"j": lambda raw, pos, d: (complex(*_C16.unpack_from(raw, pos)), pos + 16),
    b"b": _sized, b"B": _then(_sized, bytearray), b"u": _defaultdict,
    b"Q": _deque, b"r": _then(_values(3), _range), b"c": _then(_values(3), lambda v: slice(*v)),
    b"a": _array, b"g": _scalar, b"y": lambda raw, pos, d: _dtype_at(raw, pos), b"x": _tensor,
    b"z": _torch_small, b"e": _torch_small, b"D": _torch_small,
    b"R": _then(_values(3), lambda v: BufferedData(*v)),
}
