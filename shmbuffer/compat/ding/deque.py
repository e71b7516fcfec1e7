"""``DequeBuffer``, DI-engine's buffer on a shared-memory ``ReplayBuffer``, with
``apply_middleware`` (how its methods run through the middleware) and ``PriorityExperienceReplay``,
the middleware that shapes the storage (the package's docstring says more).
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import wraps
from typing import Any

import numpy as np

from ... import persistence
from ...batch import Batch
from ...buffer import ReplayBuffer
from ...errors import EmptyBufferError, FieldError
from ...protocol import by_position
from ...protocol.priorities import check_priorities
from ...sampling.samplers import Prioritized, Sampler, Uniform
from .. import Facade
from .row import DERIVED, BufferedData, Layout, flat, live


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
        ids = live(store)
        return dict(zip(by_position.slots_of(store, ids).tolist(), ids.tolist(), strict=True))

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
                for item in flat(sampled):
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



class _Store:
    """What a ``DequeBuffer`` and its views share: the ``ReplayBuffer``, its layout, the sampler."""

    def __init__(self, size: int, object_bytes: int | None, meta_bytes: int | None, name: str | None,
                 seed: int | None, trusted: bool = False) -> None:
        self.size = size
        self.trusted = trusted
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
    """DI-engine's ``DequeBuffer(size, sliced=False)`` on a shared-memory ``ReplayBuffer`` (see
    ``shmbuffer.compat.ding``).

    :param size: rows held; the oldest are overwritten first.
    :param sliced: ``sample(n, groupby=..., unroll_len=T)`` cuts each group into windows of ``T``
        starting at multiples of ``T`` (the last window ends at the group's end), as DI-engine.
    :param object_bytes: bytes of each row's object slot (default: see ``shmbuffer.compat.ding``).
    :param meta_bytes: bytes of each row's meta slot.
    :param name: the shared-memory block's name.
    :param seed: seeds the sampling.
    :param trusted_pickles: pickle the object and meta slots, and load pickles from them: any
        class. By default slots hold plain data (builtins, containers, numpy arrays, scalars and
        dtypes of plain kinds, torch tensors, ``BufferedData``) in ``codec``'s encoding, and
        anything else raises ``UnsafePickle``: a process that can attach to the shared block can
        write any bytes into a slot, and unpickling runs code. Turn it on only when every process
        that can attach to the buffer (and every ``save_data`` file it loads) is trusted.
    """

    def __init__(self, size: int, sliced: bool = False, *, object_bytes: int | None = None,
                 meta_bytes: int | None = None, name: str | None = None, seed: int | None = None,
                 trusted_pickles: bool = False) -> None:
        if type(size) is not int or size < 1:
            raise ValueError(f"DequeBuffer: size must be an int >= 1, got {size!r}")
        for option, given in (("object_bytes", object_bytes), ("meta_bytes", meta_bytes)):
            if given is not None and (type(given) is not int or given < 0):
                raise ValueError(f"DequeBuffer: {option} must be an int >= 0 (bytes per row), got {given!r}")
        self.size = size
        self.sliced = sliced
        self._middleware: list[Callable[..., Any]] = []
        if type(trusted_pickles) is not bool:
            raise TypeError(f"DequeBuffer: trusted_pickles must be True or False, got {trusted_pickles!r}")
        self._store = _Store(size, object_bytes, meta_bytes, name, seed, trusted_pickles)
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
        return self._store.sampler.prioritized

    # -- writing -----------------------------------------------------------------------------------
    @apply_middleware("push")
    def push(self, data: Any, meta: Mapping[str, Any] | None = None) -> BufferedData:
        """Store ``data`` (any object) with ``meta`` (a dict, any keys); returns it as ``BufferedData``."""
        return self._push(data, meta)

    def _push(self, data: Any, meta: Mapping[str, Any] | None) -> BufferedData:
        if meta is not None and not isinstance(meta, Mapping):
            raise TypeError(f"push: meta must be a dict (or None), got {type(meta).__name__}")
        stored = {k: v for k, v in (meta or {}).items() if k not in DERIVED}
        store = self._store
        priority = None
        if self._prioritized:
            if stored.get("priority") is None:
                stored["priority"] = 1.0 if store.buffer is None else store.buffer.priorities.max_priority  # type: ignore[union-attr]
            priority = float(check_priorities(stored["priority"], 1, "push: meta['priority']")[0])
        layout = store.layout or Layout.first(data, stored, store.object_bytes, store.meta_bytes, store.trusted)
        row = layout.row(data, stored, store.trusted)  # raises before anything is stored
        buf = store.make(layout)
        index = int(buf.push(row, priority=priority)[0])
        if self._prioritized:
            stored["priority_idx"] = int(by_position.slots_of(buf, np.array([index]))[0])
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
            fields.update(layout.data_fields(data, self._store.trusted))
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(f"update: meta must be a dict (or None to keep the row's), got {type(meta).__name__}")
            stored = {k: v for k, v in meta.items() if k not in DERIVED}
            if self._prioritized and stored.get("priority") is not None:
                priority = float(check_priorities(stored["priority"], 1, "update: meta['priority']")[0])
            fields.update(layout.meta_fields(stored, self._store.trusted))
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
            by_position.known(buf, np.array([index], np.int64), "index")
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
            ids = live(buf)[sample_range].tolist()
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
        trusted = self._store.trusted
        metas = layout.metas(batch.fields, rows, ids[rows], trusted)
        if self._prioritized:
            slots = by_position.slots_of(buf, ids[rows]).tolist()
            weight = batch.extras.get("weight") if self._store.is_weight else None
            for j, meta in enumerate(metas):
                if "priority" not in meta:  # a meta updated without one: the tree has it
                    meta["priority"] = float(buf.priorities.priorities_of(buf.priority(ids[rows[j]:rows[j] + 1]))[0])  # type: ignore[union-attr]
                meta["priority_idx"] = slots[j]
                if weight is not None:
                    meta["priority_IS"] = float(weight[rows[j]])
        datas = layout.datas(batch.fields, rows, ids[rows], trusted)
        return [BufferedData(d, int(ids[r]), m) for d, r, m in zip(datas, rows, metas, strict=True)]

    def _everything(self, sample_range: slice | None = None) -> tuple[Batch | None, np.ndarray]:
        """Every row held (those at ``sample_range``), gathered; and their ids, oldest first."""
        buf = self._store.buffer
        for _ in range(100):
            ids = np.empty(0, np.int64) if buf is None else live(buf)
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
        for i, meta in enumerate(layout.metas(batch.fields, list(range(ids.size)), ids, self._store.trusted)):
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
        archive whatever its name; its slots as ``codec`` writes them)."""
        folder = os.path.dirname(file_name)
        if folder:
            os.makedirs(folder, exist_ok=True)
        buf, layout = self._store.buffer, self._store.layout
        arrays: dict[str, Any] = {} if buf is None else dict(persistence.export(buf))
        arrays["ding_layout"] = np.array(json.dumps(None if layout is None else layout.to_json()))
        with open(file_name, "wb") as f:  # a file object: np.savez would add ".npz" to a name
            np.savez(f, **arrays)

    def load_data(self, file_name: str) -> None:
        """Replace the rows held by those ``save_data`` wrote (they get new indices). Without
        ``trusted_pickles``, every slot is read first: a file whose slots this buffer would not read
        back (an altered file, or one a trusting buffer saved with pickles) raises ``UnsafePickle``
        and changes nothing."""
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
            layout.check_slots(arrays, store.trusted, f"load_data({file_name!r})")
            buf = store.make(layout)
        else:  # the save of a buffer no row was pushed to: no rows, and no columns to check
            if store.buffer is not None:
                store.buffer.clear()
            return
        arrays.pop("uses", None)
        persistence.import_rows(buf, arrays, replace=True)  # checked first: a bad file leaves the rows


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
        return np.empty(0, np.int64) if buf is None else live(buf)

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

