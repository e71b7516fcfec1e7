"""DI-engine's ``ding.data.buffer`` (``DequeBuffer``, ``BufferedData``, its middleware) on a
shared-memory ``ReplayBuffer``.

::

    from shmbuffer.compat.ding import DequeBuffer, PriorityExperienceReplay, use_time_check

    buffer = DequeBuffer(size=10)
    buffer.use(PriorityExperienceReplay(buffer, IS_weight=True))
    buffer.push({"obs": np.zeros(4), "reward": 1.0}, meta={"priority": 2.0})
    buffer.push("any object", meta={"group": "a", "note": [1, 2]})
    data = buffer.sample(2)                 # [BufferedData(data=..., index=id, meta={...}), ...]

**A row.** DI-engine keeps any object; shared memory keeps fixed-size rows. The first push fixes
the row's layout (``Layout``):

* columns: each value of a ``dict`` ``data`` that is a Python ``int``/``float``/``bool``, a numpy
  number or numeric array, or a CPU torch tensor without grad, gets a field of its own, named by
  its key, in its shape and dtype (a bare such ``data`` gets the field ``ding_data``). These are
  copied without pickling, and ``buffer.buffer`` (the ``ReplayBuffer``) samples them as arrays.
* ``ding_object``: a fixed-size ``uint8`` slot holding the pickle of what the columns do not
  take: the other keys of a dict, or the whole ``data`` when it does not fit the columns (another
  type, shape or dtype, a missing key). Its size is ``object_bytes`` (default: 1 KiB, or 4 times
  the first push's pickle if larger); a push whose pickle is larger raises ``ValueError`` naming
  both sizes, and changes nothing.
* ``ding_meta``: the same for ``meta`` (``meta_bytes``, default 256 bytes, or 4 times the
  first), so ``meta`` takes any keys (``group``, ``env``, ``episode``, ``label``, ...).

Every row reads back as pushed: a value of a column in its Python type (``int``, ``float``,
numpy, torch), the rest unpickled. The slots live in the row, under the row's commit stamp like
every field, so a reader never sees a half-written object. A slot's bytes are a pickle (its
first byte non-zero) followed by zeros, which ``pickle.loads`` ignores; an empty slot is zeros.
Unpickling runs code: share buffers (and ``save_data`` files) only with processes you trust, as
with DI-engine's hickle files.

**Middleware** has DI-engine's signature, ``mw(action, chain, *args, **kwargs)`` for the actions
``push``, ``sample``, ``update``, ``delete`` and ``clear``; the first middleware used is the
outermost, as in DI-engine (``apply_middleware``). This module's middleware
(``PriorityExperienceReplay``, ``use_time_check``, ``staleness_check``, ``clone_object``,
``group_sample``, ``padding``, ``sample_range_view``) are such functions; only
``PriorityExperienceReplay`` also shapes the storage (the sum tree in shared memory), so it is
used before the first push.

What differs from DI-engine is listed in docs/migration/ding.md: ``index`` is the row's id
(an ``int`` that never repeats) where DI-engine has a uuid string; ``PriorityExperienceReplay``
draws from the buffer's shared sum tree at the end of the chain (so a middleware used after it sees
``size``, not DI-engine's ``indices=``); ``priority_idx`` is the row's slot; a meta without the
``groupby`` key puts its row in no group; ``ignore_insufficient`` also covers too few groups.
"""

from __future__ import annotations

import copy
import json
import keyword
import os
import pickle
import random
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, NamedTuple

import numpy as np

from .. import persistence
from ..batch import Batch
from ..buffer import ReplayBuffer
from ..errors import EmptyBufferError, FieldError
from ..protocol.priorities import check_priorities
from ..sampling.samplers import Prioritized, Sampler, Uniform
from ..schema import RESERVED, Schema
from . import Facade

__all__ = [
    "BufferedData", "DequeBuffer", "Layout", "PriorityExperienceReplay", "apply_middleware", "clone_object",
    "group_sample", "padding", "sample_range_view", "staleness_check", "use_time_check",
]

DATA, OBJECT, META = "ding_data", "ding_object", "ding_meta"
"""The row's own fields: a bare ``data``'s column, the object slot, the meta slot."""
OBJECT_BYTES, META_BYTES = 1024, 256
"""The slots' least default sizes."""
_DERIVED = ("priority_idx", "priority_IS")
"""Meta keys computed at every read (the row's slot, its IS weight), never stored."""
_PICKLE = 5


@dataclass
class BufferedData:
    """One row as DI-engine returns it: ``data``, ``index`` (its id) and ``meta``."""

    data: Any
    index: Any
    meta: Any = field(default_factory=dict)


# -- the row ------------------------------------------------------------------------------------
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


def _slot(payload: Any, size: int, what: str) -> np.ndarray:
    """``payload`` pickled into a slot of ``size`` bytes (zeros for ``None``), or ``ValueError``."""
    out = np.zeros(size, np.uint8)
    if payload is None:
        return out
    try:
        raw = pickle.dumps(payload, protocol=_PICKLE)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"DequeBuffer: the {what} cannot be pickled into the row ({e}); push picklable objects "
                        "(numbers, arrays, tensors, str, lists and dicts of them, dataclasses); nothing was stored") from None
    if len(raw) > size:
        option = "object_bytes" if what == "data" else "meta_bytes"
        raise ValueError(
            f"DequeBuffer: the {what} pickles to {len(raw)} bytes, more than its slot of {size} bytes in each row "
            f"(set at the first push); create the buffer with DequeBuffer(size, {option}={len(raw)} or more), or "
            "push arrays as values of a dict (they get columns of their own); nothing was stored")
    out[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _unslots(slots: np.ndarray) -> list[Any]:
    """Each slot's object (``None`` when empty): a pickle always starts with a non-zero byte, and
    ``pickle.loads`` ignores the zeros after its end."""
    full = (slots[:, 0] != 0).tolist()
    return [pickle.loads(slots[j]) if full[j] else None for j in range(len(full))]


class Layout:
    """How ``data`` and ``meta`` map onto a row (see the module docstring): ``columns`` (field name
    to ``Column``), ``bare`` (the data itself is the column ``ding_data``), the slots' sizes."""

    def __init__(self, columns: Mapping[str, Column], bare: bool, object_bytes: int, meta_bytes: int) -> None:
        self.columns = dict(columns)
        self.bare = bare
        self.object_bytes = object_bytes
        self.meta_bytes = meta_bytes

    @classmethod
    def first(cls, data: Any, meta: Mapping[str, Any], object_bytes: int | None, meta_bytes: int | None) -> Layout:
        """The layout the first push gives."""
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
            object_bytes = max(OBJECT_BYTES, 4 * len(pickle.dumps(rest, protocol=_PICKLE)) if rest is not None else 0)
        if meta_bytes is None:
            meta_bytes = max(META_BYTES, 4 * len(pickle.dumps(dict(meta), protocol=_PICKLE)) if meta else 0)
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

    def data_fields(self, data: Any) -> dict[str, np.ndarray]:
        """The fields that store ``data`` (an update writes these); ``ValueError`` when too big."""
        cols, payload = self.split(data)
        if payload is not None and not self.object_bytes:
            raise ValueError(f"DequeBuffer: this buffer has no object slot (object_bytes=0), so its data must fit "
                             f"the columns {self.describe()}; got {type(data).__name__}")
        if self.object_bytes:
            cols[OBJECT] = _slot(payload, self.object_bytes, "data")
        return cols

    def meta_fields(self, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The meta slot's field for ``meta`` (pickled); ``ValueError`` when it does not fit."""
        if not self.meta_bytes:
            if meta:
                raise ValueError(f"DequeBuffer: this buffer has no meta slot (meta_bytes=0); got meta keys {list(meta)}")
            return {}
        return {META: _slot(dict(meta) if meta else None, self.meta_bytes, "meta")}

    def row(self, data: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
        """A whole row to push: a row whose data went to the object slot has zeros in the columns."""
        out = self.data_fields(data)
        for name, c in self.columns.items():
            if name not in out:
                out[name] = np.zeros(c.shape, c.dtype)
        out.update(self.meta_fields(meta))
        return out

    def datas(self, fields: Mapping[str, np.ndarray], rows: list[int]) -> list[Any]:
        """Rows ``rows`` of gathered ``fields``, each as it was pushed."""
        payloads = _unslots(fields[OBJECT][rows]) if self.object_bytes else [None] * len(rows)
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

    def metas(self, fields: Mapping[str, np.ndarray], rows: list[int]) -> list[dict[str, Any]]:
        """The meta of rows ``rows`` of gathered ``fields``, each as it was pushed."""
        if not self.meta_bytes:
            return [{} for _ in rows]
        return [{} if m is None else m for m in _unslots(fields[META][rows])]

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


# -- middleware ---------------------------------------------------------------------------------
def apply_middleware(func_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """DI-engine's decorator: the method runs through the buffer's middleware, the first used the
    outermost; each is called ``mw(func_name, chain, *args, **kwargs)`` and ``chain(*args,
    **kwargs)`` runs the next one (the method itself at the end). The method then takes any
    arguments: a middleware may take its own (``staleness_check``'s ``train_iter_sample_data``)."""

    def wrap(base: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(base)
        def handler(buffer: Any, *args: Any, **kwargs: Any) -> Any:
            chain_of = list(buffer.middleware)

            def run(i: int, *args: Any, **kwargs: Any) -> Any:
                if i == len(chain_of):
                    return base(buffer, *args, **kwargs)

                def chain(*args: Any, **kwargs: Any) -> Any:
                    return run(i + 1, *args, **kwargs)

                return chain_of[i](func_name, chain, *args, **kwargs)

            return run(0, *args, **kwargs)

        return handler

    return wrap


class PriorityExperienceReplay:
    """Prioritized replay (DI-engine's middleware): ``alpha = priority_power_factor``, ``beta =
    IS_weight_power_factor`` annealed to 1 over ``IS_weight_anneal_train_iter`` sample calls, in
    the buffer's shared sum tree (``Prioritized``). A sampled row's meta has ``priority`` (as it
    was pushed or updated), ``priority_idx`` (its slot) and, with ``IS_weight``, ``priority_IS``,
    also put in a dict ``data`` as a tensor of one float (as DI-engine does). Use it before the
    first push. A push without ``meta`` takes a ``"priority"`` key out of a dict ``data``; a row
    pushed without a priority gets the largest given so far (1.0 at first)."""

    def __init__(
        self, buffer: DequeBuffer | None = None, IS_weight: bool = True, priority_power_factor: float = 0.6,
        IS_weight_power_factor: float = 0.4, IS_weight_anneal_train_iter: int = int(1e5),
    ) -> None:
        self.buffer = buffer
        self.IS_weight = IS_weight
        self.priority_power_factor = priority_power_factor
        self.IS_weight_power_factor = IS_weight_power_factor
        self.IS_weight_anneal_train_iter = IS_weight_anneal_train_iter

    def sampler(self) -> Prioritized:
        """The shared buffer's sampler for these settings (alpha, beta, its annealing)."""
        return Prioritized(alpha=self.priority_power_factor, beta=self.IS_weight_power_factor,
                           beta_steps=self.IS_weight_anneal_train_iter or None)

    @property
    def buffer_idx(self) -> dict[int, int]:
        """``{priority_idx: index}`` of the rows held (DI-engine's map from tree leaf to row)."""
        store = None if self.buffer is None else self.buffer.buffer
        if store is None:
            return {}
        ids = _live(store)
        return dict(zip(store.ring.slots(ids).tolist(), ids.tolist(), strict=True))

    @property
    def max_priority(self) -> float:
        """The largest priority given so far (DI-engine's ``max_priority``)."""
        store = None if self.buffer is None else self.buffer.buffer
        return 1.0 if store is None or store.priorities is None else store.priorities.max_priority

    def __call__(self, action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "push":
            return self._push(chain, *args, **kwargs)
        if action == "sample":
            sampled = chain(*args, **kwargs)
            if self.IS_weight:
                for item in _flat(sampled):
                    if type(item.data) is dict and isinstance(item.meta, dict) and "priority_IS" in item.meta:
                        import torch

                        item.data["priority_IS"] = torch.as_tensor([item.meta["priority_IS"]]).float()
            return sampled
        return chain(*args, **kwargs)

    def _push(self, chain: Callable[..., Any], data: Any, meta: dict[str, Any] | None = None, *args: Any,
              **kwargs: Any) -> Any:
        if meta is None and type(data) is dict and "priority" in data:
            data = dict(data)
            meta = {"priority": data.pop("priority")}
        return chain(data, meta, *args, **kwargs)


def use_time_check(buffer_: DequeBuffer, max_use: float = float("inf")) -> Callable[..., Any]:
    """A row sampled ``max_use`` times is deleted; ``meta["use_count"]`` counts a row's samples
    (in this process, as in DI-engine)."""
    use_count: dict[Any, int] = defaultdict(int)

    def check(items: list[BufferedData]) -> None:
        gone = []
        for item in items:
            use_count[item.index] += 1
            item.meta["use_count"] = use_count[item.index]
            if use_count[item.index] >= max_use:
                gone.append(item.index)
        buffer_.delete(gone)
        for index in gone:
            use_count.pop(index, None)
        if len(use_count) > 2 * buffer_.size:  # rows overwritten before their last use
            held = set(buffer_.indices.ids().tolist())
            for index in [i for i in use_count if i not in held]:
                del use_count[index]

    def _use_time_check(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sampled = chain(*args, **kwargs)
        if action == "sample" and sampled:
            for group in ([sampled] if isinstance(sampled[0], BufferedData) else sampled):
                check(group)
        return sampled

    return _use_time_check


def staleness_check(buffer_: DequeBuffer, max_staleness: float = float("inf")) -> Callable[..., Any]:
    """Rows whose staleness (``train_iter_sample_data`` given to ``sample`` minus their
    ``meta["train_iter_data_collected"]``) exceeds ``max_staleness`` are deleted before a sample.
    A push without that meta key raises ``AssertionError`` (DI-engine's exception)."""

    def push(chain: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
        meta = kwargs.get("meta", args[0] if args else None)
        if not isinstance(meta, Mapping) or "train_iter_data_collected" not in meta:
            raise AssertionError("staleness_check: push data with meta={'train_iter_data_collected': <train iter>}, "
                                 f"got meta={meta!r}")
        return chain(data, *args, **kwargs)

    def sample(chain: Callable[..., Any], train_iter_sample_data: int, *args: Any, **kwargs: Any) -> Any:
        stale = [item.index for item in buffer_.storage
                 if train_iter_sample_data - item.meta["train_iter_data_collected"] > max_staleness]
        if stale:
            buffer_.delete(stale)
        return chain(*args, **kwargs)

    def _staleness_check(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "push":
            return push(chain, *args, **kwargs)
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _staleness_check


def sample_range_view(buffer_: DequeBuffer, start: int | None = None, end: int | None = None) -> Callable[..., Any]:
    """Sample only the rows at positions ``[start, end)`` (0 the oldest; a negative one counts
    back from ``buffer_.size``, as in DI-engine)."""
    if start is None and end is None:
        raise ValueError("sample_range_view: give start, end or both")
    if start and start < 0:
        start = buffer_.size + start
    if end and end < 0:
        end = buffer_.size + end
    sample_range = slice(start, end)

    def _sample_range_view(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return chain(*args, sample_range=sample_range)  # DI-engine drops the other keywords too
        return chain(*args, **kwargs)

    return _sample_range_view


def clone_object() -> Callable[..., Any]:
    """Nothing to do: a push pickles or copies ``data`` into shared memory, and every sample
    builds new objects, so the buffer's rows never share objects with their users."""

    def _clone_object(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return chain(*args, **kwargs)

    return _clone_object


def group_sample(size_in_group: int, ordered_in_group: bool = True, max_use_in_group: bool = True) -> Callable[..., Any]:
    """With ``sample(n, groupby=...)``: at most ``size_in_group`` rows of each group, consecutive
    (``ordered_in_group``; ``max_use_in_group`` starts them where a whole window fits) or drawn
    without order (all of a shorter group, where DI-engine fails)."""

    def sample(chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("groupby"):
            raise ValueError("group_sample: sample with groupby=<meta key>")
        sampled = chain(*args, **kwargs)
        for i, group in enumerate(sampled):
            if ordered_in_group:
                end = max(0, len(group) - size_in_group) + 1 if max_use_in_group else len(group)
                start = random.choice(range(end))
                sampled[i] = group[start:start + size_in_group]
            else:
                sampled[i] = random.sample(group, k=min(size_in_group, len(group)))
        return sampled

    def _group_sample(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _group_sample


def padding(policy: str = "random") -> Callable[..., Any]:
    """Groups of a grouped sample padded to the longest: with copies of their own random rows
    (``"random"``) or with ``BufferedData(None, None, None)`` (``"none"``)."""
    if policy not in ("random", "none"):
        raise ValueError(f"padding: policy must be 'random' or 'none', got {policy!r}")

    def sample(chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        sampled = chain(*args, **kwargs)
        if not sampled or isinstance(sampled[0], BufferedData):
            return sampled
        longest = max(len(group) for group in sampled)
        for group in sampled:
            base = list(group)
            for _ in range(longest - len(base)):
                pad = copy.deepcopy(random.choice(base)) if policy == "random" else BufferedData(None, None, None)
                group.append(pad)
        return sampled

    def _padding(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "sample":
            return sample(chain, *args, **kwargs)
        return chain(*args, **kwargs)

    return _padding


def _flat(sampled: Any) -> Iterator[BufferedData]:
    for item in sampled or ():
        if isinstance(item, list):
            yield from item
        elif isinstance(item, BufferedData):
            yield item


# -- the buffer ---------------------------------------------------------------------------------
def _live(buf: ReplayBuffer) -> np.ndarray:
    """The ids of the rows held and committed now, oldest first (deleted rows left out)."""
    ring = buf.ring
    held = ring.held_ids()
    return held[ring.ids_of_slots(ring.slots(held)) == held]


class _Store:
    """What a ``DequeBuffer`` and its views share: the ``ReplayBuffer``, its layout, the sampler."""

    def __init__(self, size: int, object_bytes: int | None, meta_bytes: int | None, name: str | None,
                 seed: int | None) -> None:
        self.size = size
        self.object_bytes, self.meta_bytes = object_bytes, meta_bytes
        self.name, self.seed = name, seed
        self.buffer: ReplayBuffer | None = None
        self.layout: Layout | None = None
        self.sampler: Sampler = Uniform()
        self.is_weight = False
        self.meta_keys: list[str] = []
        self.rng = random.Random(seed)

    def make(self, layout: Layout) -> ReplayBuffer:
        if self.buffer is None:
            self.buffer = ReplayBuffer(layout.schema(), self.size, sampler=self.sampler, name=self.name, seed=self.seed)
            self.layout = layout
        return self.buffer


class DequeBuffer(Facade):
    """DI-engine's ``DequeBuffer(size, sliced=False)`` on a shared-memory ``ReplayBuffer`` (see the
    module docstring).

    :param size: rows held; the oldest are overwritten first.
    :param sliced: ``sample(n, groupby=..., unroll_len=T)`` cuts each group into windows of ``T``
        starting at multiples of ``T`` (the last window ends at the group's end), as DI-engine.
    :param object_bytes: bytes of each row's object slot (default: see the module docstring).
    :param meta_bytes: bytes of each row's meta slot.
    :param name: the shared-memory block's name.
    :param seed: seeds the sampling.
    """

    def __init__(self, size: int, sliced: bool = False, *, object_bytes: int | None = None,
                 meta_bytes: int | None = None, name: str | None = None, seed: int | None = None) -> None:
        if type(size) is not int or size < 1:
            raise ValueError(f"DequeBuffer: size must be an int >= 1, got {size!r}")
        for option, given in (("object_bytes", object_bytes), ("meta_bytes", meta_bytes)):
            if given is not None and (type(given) is not int or given < 0):
                raise ValueError(f"DequeBuffer: {option} must be an int >= 0 (bytes per row), got {given!r}")
        self.size = size
        self.sliced = sliced
        self._middleware: list[Callable[..., Any]] = []
        self._store = _Store(size, object_bytes, meta_bytes, name, seed)
        self._viewed = False

    @property
    def buffer(self) -> ReplayBuffer | None:  # type: ignore[override]
        """The ``ReplayBuffer`` behind it (made by the first push), shared with its views."""
        return self._store.buffer

    def close(self) -> None:
        """Close (and, in the creating process, remove) the buffer; a view leaves it to its buffer."""
        if not self._viewed:
            super().close()

    # -- middleware ------------------------------------------------------------------------------
    @property
    def middleware(self) -> tuple[Callable[..., Any], ...]:
        """The middleware in use, the first used the outermost (``apply_middleware``)."""
        return tuple(self._middleware)

    def use(self, func: Callable[..., Any]) -> DequeBuffer:
        """Add a middleware ``func(action, chain, *args, **kwargs)``, after those used before."""
        if not callable(func):
            raise TypeError(f"use: expected a middleware func(action, chain, *args, **kwargs), got {func!r}")
        if isinstance(func, PriorityExperienceReplay):
            if self._store.buffer is not None:
                raise ValueError("use(PriorityExperienceReplay): use it before the first push (its sum tree is part "
                                 "of the shared-memory buffer the first push creates)")
            self._store.sampler = func.sampler()
            self._store.is_weight = bool(func.IS_weight)
            if func.buffer is None:
                func.buffer = self
        self._middleware.append(func)
        return self

    def view(self) -> DequeBuffer:
        """Another ``DequeBuffer`` on the same rows, without middleware (DI-engine's ``view``)."""
        return copy.copy(self)

    def __copy__(self) -> DequeBuffer:
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, _middleware=[], _viewed=True)
        return other

    @property
    def _prioritized(self) -> bool:
        return isinstance(self._store.sampler, Prioritized)

    # -- writing -----------------------------------------------------------------------------------
    @apply_middleware("push")
    def push(self, data: Any, meta: Mapping[str, Any] | None = None) -> BufferedData:
        """Store ``data`` (any object) with ``meta`` (a dict, any keys); returns it as ``BufferedData``."""
        return self._push(data, meta)

    def _push(self, data: Any, meta: Mapping[str, Any] | None) -> BufferedData:
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"push: meta must be a dict (or None), got {type(meta).__name__}")
        stored = {k: v for k, v in (meta or {}).items() if k not in _DERIVED}
        store = self._store
        priority = None
        if self._prioritized:
            if stored.get("priority") is None:
                stored["priority"] = 1.0 if store.buffer is None else store.buffer.priorities.max_priority  # type: ignore[union-attr]
            priority = float(check_priorities(stored["priority"], 1, "push: meta['priority']")[0])
        layout = store.layout or Layout.first(data, stored, store.object_bytes, store.meta_bytes)
        row = layout.row(data, stored)  # raises before anything is stored
        buf = store.make(layout)
        index = int(buf.push(row, priority=priority)[0])
        if self._prioritized:
            stored["priority_idx"] = int(buf.ring.slots(np.array([index]))[0])
        return BufferedData(data, index, stored)

    @apply_middleware("update")
    def update(self, index: Any, data: Any | None = None, meta: Mapping[str, Any] | None = None) -> bool:
        """Replace a row's ``data`` and/or its ``meta`` (``None`` keeps it; a new meta replaces the
        old one, its ``priority`` sets the row's priority); ``False`` when the row is not held."""
        buf, layout = self._store.buffer, self._store.layout
        if buf is None or layout is None or not self._known(index):
            return False
        fields: dict[str, np.ndarray] = {}
        priority = None
        if data is not None:
            fields.update(layout.data_fields(data))
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(f"update: meta must be a dict (or None to keep the row's), got {type(meta).__name__}")
            stored = {k: v for k, v in meta.items() if k not in _DERIVED}
            if self._prioritized and stored.get("priority") is not None:
                priority = float(check_priorities(stored["priority"], 1, "update: meta['priority']")[0])
            fields.update(layout.meta_fields(stored))
        if not fields and priority is None:
            return self.indices.has(index)
        return buf.update(np.array([index], np.int64), fields, priority=priority) == 1

    @apply_middleware("delete")
    def delete(self, indices: Any) -> None:
        """Remove rows by index (one, or several); indices not held are skipped."""
        buf = self._store.buffer
        if buf is None:
            return
        many = isinstance(indices, Iterable) and not isinstance(indices, (str, bytes))
        ids = [i for i in (indices if many else [indices]) if self._known(i)]
        if ids:
            buf.delete(np.array(ids, np.int64))

    @apply_middleware("clear")
    def clear(self) -> None:
        """Forget every row."""
        if self._store.buffer is not None:
            self._store.buffer.clear()

    def _known(self, index: Any) -> bool:
        """``index`` is an id this buffer gave (held or not)."""
        buf = self._store.buffer
        if buf is None or isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            return False
        try:
            buf.ring.check_ids(np.array([index], np.int64), "index")
        except (FieldError, OverflowError):
            return False
        return True

    # -- reading -----------------------------------------------------------------------------------
    @apply_middleware("sample")
    def sample(self, size: int | None = None, indices: list[Any] | None = None, replace: bool = False,
               sample_range: slice | None = None, ignore_insufficient: bool = False, groupby: str | None = None,
               unroll_len: int | None = None) -> list[Any]:
        """``size`` rows (distinct unless ``replace``; a prioritized buffer draws with repeats, as
        DI-engine), or the rows ``indices`` in their order, or with ``groupby`` (a meta key)
        ``size`` groups, each its rows in order (``unroll_len`` consecutive ones of them). Too few
        rows or groups raise ``ValueError`` unless ``ignore_insufficient`` (then fewer, or none)."""
        if not size and not indices:
            raise ValueError("sample: give size or indices")
        if size and indices and size != len(indices):
            raise ValueError(f"sample: size={size} and {len(indices)} indices: give one, or as many indices as size")
        if indices and groupby:
            raise ValueError("sample: groupby and indices cannot go together")
        if unroll_len and not groupby:
            raise ValueError("sample: unroll_len needs groupby")
        if indices:
            return self._take(list(indices))
        assert size is not None
        sampled: list[Any]
        if groupby:
            sampled = self._groups(size, groupby, replace, unroll_len, sample_range, ignore_insufficient)
        else:
            sampled = self._draw(size, replace, sample_range)
        if len(sampled) != size and not ignore_insufficient:
            raise ValueError(f"There are less than {size} records/groups in buffer({self.count()})"
                             + (f" (groups by meta {groupby!r})" if groupby else ""))
        return sampled

    def _draw(self, size: int, replace: bool, sample_range: slice | None) -> list[BufferedData]:
        buf = self._store.buffer
        if buf is None:
            return []
        if sample_range is not None:
            ids = _live(buf)[sample_range].tolist()
            if not ids or (not replace and len(ids) < size):
                return []
            rng = self._store.rng
            return self._take(rng.choices(ids, k=size) if replace else rng.sample(ids, size))
        if not self._prioritized and not replace and len(buf) < size:
            return []
        try:
            return self._rows(buf.sample(size, replace=replace or self._prioritized))
        except EmptyBufferError:
            return []

    def _take(self, ids: list[Any]) -> list[BufferedData]:
        buf = self._store.buffer
        try:
            if buf is None or not all(self._known(i) for i in ids):
                raise EmptyBufferError("not ids of this buffer")
            return self._rows(buf.take(np.array(ids, np.int64)))
        except EmptyBufferError as e:
            raise KeyError(f"sample(indices=...): indices {ids[:5]}{' ...' if len(ids) > 5 else ''} are not all held "
                           f"by this buffer (never pushed here, overwritten, deleted or cleared): {e}") from None

    def _rows(self, batch: Batch, at: list[int] | None = None) -> list[BufferedData]:
        """Rows of a gathered batch (``at``: which, default all) as ``BufferedData``."""
        layout, buf = self._store.layout, self._store.buffer
        assert layout is not None and buf is not None
        ids = np.asarray(batch.index)
        rows = list(range(ids.size)) if at is None else at
        metas = layout.metas(batch.fields, rows)
        if self._prioritized:
            slots = buf.ring.slots(ids[rows]).tolist()
            weight = batch.extras.get("weight") if self._store.is_weight else None
            for j, meta in enumerate(metas):
                if "priority" not in meta:  # a meta updated without one: the tree has it
                    meta["priority"] = float(buf.priorities.priorities_of(buf.priority(ids[rows[j]:rows[j] + 1]))[0])  # type: ignore[union-attr]
                meta["priority_idx"] = slots[j]
                if weight is not None:
                    meta["priority_IS"] = float(weight[rows[j]])
        datas = layout.datas(batch.fields, rows)
        return [BufferedData(d, int(ids[r]), m) for d, r, m in zip(datas, rows, metas, strict=True)]

    def _everything(self, sample_range: slice | None = None) -> tuple[Batch | None, np.ndarray]:
        """Every row held (those at ``sample_range``), gathered; and their ids, oldest first."""
        buf = self._store.buffer
        for _ in range(100):
            ids = np.empty(0, np.int64) if buf is None else _live(buf)
            if sample_range is not None:
                ids = ids[sample_range]
            if buf is None or not ids.size:
                return None, ids
            try:
                return buf.take(ids), ids
            except EmptyBufferError:  # a row went meanwhile (another process pushed, deleted): again
                continue
        raise EmptyBufferError(f"DequeBuffer: rows of {buf.name!r} keep changing while they are read")  # type: ignore[union-attr]

    def _groups(self, size: int, groupby: str, replace: bool, unroll_len: int | None,
                sample_range: slice | None, ignore: bool) -> list[list[BufferedData]]:
        """DI-engine's ``_sample_by_group`` over the meta of every row held."""
        batch, ids = self._everything(sample_range)
        layout = self._store.layout
        if batch is None or layout is None:
            return []
        groups: dict[Any, list[int]] = {}
        for i, meta in enumerate(layout.metas(batch.fields, list(range(ids.size)))):
            if groupby in meta:
                try:
                    groups.setdefault(meta[groupby], []).append(i)
                except TypeError:
                    raise TypeError(f"sample(groupby={groupby!r}): meta[{groupby!r}] of row {int(ids[i])} is a "
                                    f"{type(meta[groupby]).__name__}, which cannot be a group key; push hashable "
                                    "values (an int, a str, a tuple)") from None
        names = list(groups)
        if unroll_len and unroll_len > 1:
            names = [g for g in names if len(groups[g]) >= unroll_len]
        rng = self._store.rng
        if names and not replace and len(names) < size and not ignore:
            raise ValueError(f"There are less than {size} groups in buffer({len(names)} groups) by meta {groupby!r}")
        if not names or (not replace and len(names) < size):
            return []
        chosen = rng.choices(names, k=size) if replace else rng.sample(names, size)
        out = []
        for g in chosen:
            rows = groups[g]
            if unroll_len:
                if self.sliced:
                    start = rng.choice(range(max(1, len(rows)))) // unroll_len
                    if start == (len(rows) - 1) // unroll_len:
                        rows = rows[-unroll_len:]
                    else:
                        rows = rows[start * unroll_len:(start + 1) * unroll_len]
                else:
                    start = rng.choice(range(max(1, len(rows) - unroll_len)))
                    rows = rows[start:start + unroll_len]
            out.append(self._rows(batch, rows))
        return out

    def count(self) -> int:
        """Rows held."""
        return 0 if self._store.buffer is None else len(self._store.buffer)

    def __len__(self) -> int:
        return self.count()

    def get(self, idx: int) -> BufferedData:
        """The row at position ``idx`` (0 the oldest, -1 the newest)."""
        ids = self.indices.ids()
        try:
            index = int(ids[idx])
        except IndexError:
            raise IndexError(f"get({idx}): the buffer holds {len(ids)} rows") from None
        return self._take([index])[0]

    __getitem__ = get

    def get_by_index(self, index: Any) -> BufferedData:
        """The row ``index`` (DI-engine's ``get_by_index``); ``KeyError`` when it is not held."""
        return self._take([index])[0]

    @property
    def storage(self) -> _Storage:
        """The rows held, oldest first, as DI-engine's ``storage`` deque is read: ``len``,
        ``storage[i]``, iteration (each a ``BufferedData`` read now)."""
        return _Storage(self)

    @property
    def indices(self) -> _Indices:
        """DI-engine's ``indices``: ``indices.get(index)`` is the row's position, ``has``, ``len``."""
        return _Indices(self)

    @property
    def meta_index(self) -> dict[str, list[Any]]:
        """DI-engine's ``meta_index``: for each key set (``buffer.meta_index = {"label": []}``), the
        meta value of every row held, oldest first (``None`` where a row has none)."""
        keys = self._store.meta_keys
        rows = self.export_data() if keys else []
        return {key: [r.meta.get(key) for r in rows] for key in keys}

    @meta_index.setter
    def meta_index(self, value: Mapping[str, Any]) -> None:
        self._store.meta_keys = list(value)

    def export_data(self) -> list[BufferedData]:
        """Every row held, oldest first."""
        batch, _ = self._everything()
        return [] if batch is None else self._rows(batch)

    def import_data(self, data_with_meta: Iterable[BufferedData]) -> None:
        """Push rows (``export_data`` of any ``DequeBuffer``) with their meta; they get new indices."""
        for item in data_with_meta:
            self._push(item.data, item.meta)

    def __iter__(self) -> Iterator[BufferedData]:
        return iter(self.export_data())

    # -- files -------------------------------------------------------------------------------------
    def save_data(self, file_name: str) -> None:
        """Write every row held (fields, priorities) and the layout to ``file_name`` (an ``.npz``
        archive whatever its name; its object slots are pickles)."""
        folder = os.path.dirname(file_name)
        if folder:
            os.makedirs(folder, exist_ok=True)
        buf, layout = self._store.buffer, self._store.layout
        arrays: dict[str, Any] = {} if buf is None else dict(persistence.export(buf))
        arrays["ding_layout"] = np.array(json.dumps(None if layout is None else layout.to_json()))
        with open(file_name, "wb") as f:  # a file object: np.savez would add ".npz" to a name
            np.savez(f, **arrays)

    def load_data(self, file_name: str) -> None:
        """Replace the rows held by those ``save_data`` wrote (they get new indices)."""
        with np.load(file_name, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        described = json.loads(str(arrays.pop("ding_layout")))
        store = self._store
        if described is not None:
            layout = Layout.from_json(described)
            if store.layout is not None and store.layout != layout:
                raise ValueError(f"load_data({file_name!r}): its rows have the columns {layout.describe()} and slots of "
                                 f"{layout.object_bytes}/{layout.meta_bytes} bytes; this buffer's are "
                                 f"{store.layout.describe()} and {store.layout.object_bytes}/{store.layout.meta_bytes}: "
                                 "load it into a new DequeBuffer")
            buf = store.make(layout)
        elif store.buffer is None:
            return
        else:
            buf = store.buffer
        buf.clear()
        arrays.pop("uses", None)
        if arrays.get("index", np.empty(0)).size:
            persistence.import_rows(buf, arrays)


class _Storage:
    """``DequeBuffer.storage``: the rows held, read on demand."""

    def __init__(self, buffer: DequeBuffer) -> None:
        self._buffer = buffer

    def __len__(self) -> int:
        return len(self._buffer.indices)

    def __getitem__(self, idx: int) -> BufferedData:
        return self._buffer.get(idx)

    def __iter__(self) -> Iterator[BufferedData]:
        return iter(self._buffer.export_data())


class _Indices:
    """``DequeBuffer.indices``: a row's position by its index."""

    def __init__(self, buffer: DequeBuffer) -> None:
        self._buffer = buffer

    def ids(self) -> np.ndarray:
        """The indices of the rows held, oldest first (ascending: ids grow with every push)."""
        buf = self._buffer.buffer
        return np.empty(0, np.int64) if buf is None else _live(buf)

    def __len__(self) -> int:
        return len(self.ids())

    def has(self, index: Any) -> bool:
        return self._position(index) is not None

    def get(self, index: Any) -> int:
        at = self._position(index)
        if at is None:
            raise KeyError(index)
        return at

    def _position(self, index: Any) -> int | None:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            return None
        ids = self.ids()
        at = int(np.searchsorted(ids, index))
        return at if at < ids.size and ids[at] == index else None
