"""DI-engine's ``DequeBuffer`` and its middleware, on a shared-memory ``ReplayBuffer``.

::

    from shmbuffer.compat.ding import DequeBuffer, PriorityExperienceReplay, use_time_check

    buffer = DequeBuffer(size=10)
    buffer.use(PriorityExperienceReplay(buffer, IS_weight=True))
    buffer.push({"obs": np.zeros(4), "reward": 1.0}, meta={"priority": 2.0})
    data = buffer.sample(3)                 # [BufferedData(data={...}, index=id, meta={...}), ...]

What differs from DI-engine:

* ``data`` is a dict of numeric fields (numbers, numpy arrays, torch tensors); the first push
  fixes the schema. A string or any other object is refused with ``TypeError`` (DI-engine's
  ``push('a')`` stores any object; shared memory cannot).
* ``meta`` takes ``priority`` (with ``PriorityExperienceReplay``), ``episode`` and ``env`` (the
  group key of ``groupby=``; an int, or any hashable, numbered in this process). Other meta keys
  raise ``TypeError``: they have nowhere to go.
* ``index`` is the row's id (an int that never repeats), not a string.
* Middleware that shapes the storage (``PriorityExperienceReplay``, ``use_time_check``) must be
  used before the first push. ``clone_object`` does nothing: every sample is a copy.
* ``groupby`` groups consecutive rows with the same key (``meta["episode"]``, else
  ``meta["env"]``). Envs that push in turns need ``DequeBuffer(size, envs=N)``: one lane per
  env, so each env's steps stay consecutive (R2D2's ``groupby="env", unroll_len=T``).
* ``sample(n, groupby="episode")`` draws ``n`` distinct groups (as DI-engine), each its rows in
  order, the group still being pushed with the rows it has so far; with ``group_sample`` a group is
  at most ``size_in_group`` rows (fewer when the episode is shorter, as DI-engine keeps it).
* Too few rows or groups: ``ValueError`` (as DI-engine), unless ``ignore_insufficient=True``
  (then an empty list).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import persistence, sequences
from ..batch import Batch
from ..buffer import ReplayBuffer
from ..samplers import Prioritized, Sampler, Uniform
from . import Facade, as_row, numpy_of, schema_of_row

__all__ = [
    "BufferedData", "DequeBuffer", "PriorityExperienceReplay", "clone_object", "group_sample", "use_time_check",
]

_META = ("priority", "episode", "env")


@dataclass
class BufferedData:
    """One row as DI-engine returns it: ``data`` (its fields), ``index`` (its id), ``meta``."""

    data: Any
    index: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Middleware:
    kind: str
    options: dict[str, Any]


def PriorityExperienceReplay(
    buffer: DequeBuffer | None = None, IS_weight: bool = True, priority_power_factor: float = 0.6,
    IS_weight_power_factor: float = 0.4, IS_weight_anneal_train_iter: int = int(1e5),
) -> _Middleware:
    """Prioritized replay: ``alpha = priority_power_factor``, ``beta = IS_weight_power_factor``
    annealed to 1 over ``IS_weight_anneal_train_iter`` sample calls; ``meta["priority_IS"]``."""
    return _Middleware("per", {"alpha": priority_power_factor, "beta": IS_weight_power_factor,
                               "steps": IS_weight_anneal_train_iter, "IS_weight": IS_weight})


def use_time_check(buffer: DequeBuffer | None = None, max_use: int = 1) -> _Middleware:
    """A row leaves once sampled ``max_use`` times (``ReplayBuffer(max_use=...)``)."""
    return _Middleware("max_use", {"max_use": max_use})


def clone_object() -> _Middleware:
    """Nothing to do: every sample is already a copy."""
    return _Middleware("clone", {})


def group_sample(size_in_group: int, ordered_in_group: bool = True, max_use_in_group: bool = True) -> _Middleware:
    """With ``sample(n, groupby=...)``: at most ``size_in_group`` rows per group, consecutive
    (``ordered_in_group``) or distinct ones in random order."""
    return _Middleware("group", {"size": size_in_group, "ordered": ordered_in_group})


class DequeBuffer(Facade):
    """DI-engine's ``DequeBuffer(size)`` (see the module docstring)."""

    def __init__(self, size: int, *, envs: int | None = None, name: str | None = None, seed: int | None = None) -> None:
        self.size = size
        self.envs = envs
        """With ``envs=N``, one lane per env (``size`` rounded up to a multiple of ``N``): a row
        pushed with ``meta={"env": e}`` goes to lane ``e % N``, so ``sample(n, groupby="env",
        unroll_len=T)`` finds each env's consecutive steps even when envs push in turns."""
        self._name, self._seed = name, seed
        self._sampler: Sampler = Uniform()
        self._max_use: int | None = None
        self._is_weight = False
        self._group: dict[str, Any] | None = None
        self._keys: dict[Hashable, int] = {}
        self.buffer: ReplayBuffer | None = None
        """The ``ReplayBuffer`` behind it, made by the first push."""

    # -- middleware ------------------------------------------------------------------------------
    def use(self, func: _Middleware) -> DequeBuffer:
        """Add a middleware (``PriorityExperienceReplay``, ``use_time_check``, ``clone_object``,
        ``group_sample``). Those that shape the storage must come before the first push."""
        if not isinstance(func, _Middleware):
            raise TypeError(f"use: expected one of this module's middleware, got {func!r}")
        if func.kind in ("per", "max_use") and self.buffer is not None:
            raise ValueError(f"use({func.kind}): use it before the first push (it shapes the shared-memory buffer)")
        if func.kind == "per":
            o = func.options
            self._sampler = Prioritized(alpha=o["alpha"], beta=o["beta"], beta_steps=o["steps"] or None)
            self._is_weight = bool(o["IS_weight"])
        elif func.kind == "max_use":
            self._max_use = int(func.options["max_use"])
        elif func.kind == "group":
            self._group = dict(func.options)
        return self

    # -- writing -----------------------------------------------------------------------------------
    def _make(self, row: dict[str, np.ndarray]) -> ReplayBuffer:
        if self.buffer is None:
            lanes = self.envs or 1
            self.buffer = ReplayBuffer(schema_of_row(row), -(-self.size // lanes) * lanes, sampler=self._sampler,
                                       max_use=self._max_use, lanes=lanes, episodes=True, name=self._name,
                                       seed=self._seed)
        return self.buffer

    def _key(self, meta: dict[str, Any]) -> int:
        key = meta.get("episode", meta.get("env", 0))
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            return int(key)
        if not isinstance(key, Hashable):
            raise TypeError(f"push: meta episode/env must be an int or hashable, got {type(key).__name__}")
        return self._keys.setdefault(key, -1 - len(self._keys))  # other keys: negative ids, this process

    def push(self, data: Any, meta: dict[str, Any] | None = None) -> BufferedData:
        """Store one row (a dict of numeric fields) with its meta; returns it as ``BufferedData``."""
        meta = dict(meta or {})
        unknown = [k for k in meta if k not in _META]
        if unknown:
            raise TypeError(f"push: meta keys {unknown} cannot be stored; shmbuffer keeps {list(_META)}")
        row = as_row(data, "DequeBuffer.push")
        buf = self._make(row)
        priority = meta.get("priority")
        if priority is not None and not isinstance(buf.options.sampler, Prioritized):
            priority = None  # DI-engine ignores it without the PER middleware
        lane = int(meta.get("env", 0)) % buf.lanes if buf.lanes > 1 else 0
        ids = buf.push(row, episode=self._key(meta), priority=priority, lane=lane)
        return BufferedData(data, int(ids[0]), meta)

    # -- reading -----------------------------------------------------------------------------------
    def _rows(self, batch: Any, at: Any = slice(None)) -> list[BufferedData]:
        names = list(batch.fields)
        fields = {n: batch.fields[n][at] for n in names}
        index = np.asarray(batch.index)[at]
        weight = batch.extras.get("weight")
        buf = self.buffer
        assert buf is not None
        prioritized = isinstance(buf.options.sampler, Prioritized)
        prios = buf.priorities
        p = prios.priorities_of(buf.priority(index)) if prioritized and prios is not None else None
        out = []
        for i in range(len(index)):
            meta: dict[str, Any] = {}
            if p is not None:
                meta["priority"] = float(p[i])
                if self._is_weight and weight is not None:
                    meta["priority_IS"] = float(np.asarray(weight)[at][i])
            out.append(BufferedData({n: fields[n][i] for n in names}, int(index[i]), meta))
        return out

    def sample(self, size: int | None = None, indices: list[int] | None = None, replace: bool = False,
               sample_range: slice | None = None, ignore_insufficient: bool = False, groupby: str | None = None,
               unroll_len: int | None = None) -> list[BufferedData] | list[list[BufferedData]]:
        """``size`` rows (distinct unless ``replace``), or the rows ``indices``; with ``groupby``
        (``"episode"`` or ``"env"``) ``size`` groups, each a list of rows (see the module docstring)."""
        buf = self.buffer
        if indices is not None:
            if buf is None:
                raise ValueError("sample: the buffer is empty")
            return self._rows(buf.take(np.asarray(indices, np.int64)))
        if size is None:
            raise ValueError("sample: give size or indices")
        if sample_range is not None:
            raise ValueError("sample: sample_range has no equivalent in shmbuffer (every held row is drawn)")
        held = 0 if buf is None else len(buf)
        if groupby is not None:
            return self._groups(size, replace, ignore_insufficient, unroll_len)
        if buf is None or held == 0 or (not replace and held < size):
            if ignore_insufficient:
                return []
            raise ValueError(f"There are less than {size} records in buffer({held})")
        return self._rows(buf.sample(size, replace=replace))

    def _groups(self, size: int, replace: bool, ignore: bool, unroll_len: int | None) -> list[list[BufferedData]]:
        buf = self.buffer
        lanes = sequences.episode_runs(buf, complete=False)[0].size if buf is not None and len(buf) else 0
        if buf is None or lanes == 0 or (not replace and lanes < size):
            if ignore:
                return []
            raise ValueError(f"There are less than {size} groups in buffer({lanes} groups)")
        if unroll_len is not None:
            batch = buf.sample_groups(size, unroll_len, ordered=True, replace=replace)
            return [self._rows(batch, g) for g in range(size)]
        if self._group is not None:
            width, ordered = int(self._group["size"]), bool(self._group["ordered"])
        else:
            _, first, stop = sequences.episode_runs(buf, complete=False)
            width, ordered = int((stop - first).max()), True
        batch = buf.sample_groups(size, width, ordered=ordered, replace=replace, short=True)
        out = []
        for g in range(size):
            keep = np.flatnonzero(batch.extras["mask"][g])
            sub = self._rows(_group_of(batch, g), keep)
            out.append(sub)
        return out

    # -- changing rows -----------------------------------------------------------------------------
    def update(self, index: int, data: Any | None = None, meta: dict[str, Any] | None = None) -> bool:
        """Replace a row's data and/or its meta priority; ``False`` when the row is gone."""
        buf = self.buffer
        if buf is None:
            return False
        ids = np.array([index], np.int64)
        done = True
        if data is not None:
            done = buf.update(ids, as_row(data, "DequeBuffer.update")) == 1
        if meta and meta.get("priority") is not None and isinstance(buf.options.sampler, Prioritized):
            done = buf.update_priorities(ids, [float(numpy_of(meta["priority"]))]) == 1 and done
        return done

    def delete(self, indices: int | list[int]) -> None:
        """Remove rows by id: never sampled again, no longer counted."""
        if self.buffer is not None:
            self.buffer.delete(np.atleast_1d(np.asarray(indices, np.int64)))

    def count(self) -> int:
        return 0 if self.buffer is None else len(self.buffer)

    def __len__(self) -> int:
        return self.count()

    def get(self, idx: int) -> BufferedData:
        """The row at position ``idx`` (0 the oldest)."""
        if self.buffer is None:
            raise IndexError("get: the buffer is empty")
        return self._rows(self.buffer.get(slice(idx, idx + 1 if idx != -1 else None)))[0]

    def clear(self) -> None:
        if self.buffer is not None:
            self.buffer.clear()

    def export_data(self) -> list[BufferedData]:
        """Every row as ``BufferedData``, oldest first, meta with its priority and use count."""
        if self.buffer is None:
            return []
        out = persistence.export(self.buffer)
        names = list(self.buffer.schema.names)
        rows = []
        for i, index in enumerate(out["index"]):
            meta: dict[str, Any] = {"episode": int(out["episode"][i])}
            if "priority" in out:
                meta["priority"] = float(out["priority"][i])
            if "uses" in out:
                meta["use_count"] = int(out["uses"][i])
            rows.append(BufferedData({n: out[n][i] for n in names}, int(index), meta))
        return rows

    def import_data(self, data_with_meta: list[BufferedData]) -> None:
        """Push exported rows (``export_data`` of any buffer of the same fields) with their
        priorities, use counts and episodes. They get new ids."""
        if not data_with_meta:
            return
        rows = [as_row(d.data, "DequeBuffer.import_data") for d in data_with_meta]
        buf = self._make(rows[0])
        arrays: dict[str, Any] = {n: np.stack([r[n] for r in rows]) for n in rows[0]}
        arrays["episode"] = np.array([self._key(d.meta or {}) for d in data_with_meta], np.int64)
        metas = [d.meta or {} for d in data_with_meta]
        if all("priority" in m for m in metas):
            arrays["priority"] = np.array([float(m["priority"]) for m in metas])
        if all("use_count" in m for m in metas):
            arrays["uses"] = np.array([int(m["use_count"]) for m in metas])
        if buf.lanes > 1:
            arrays["lane"] = np.array([int(m.get("env", 0)) % buf.lanes for m in metas], np.int64)
        persistence.import_rows(buf, arrays)


    def __iter__(self) -> Iterator[BufferedData]:
        return iter(self.export_data())


def _group_of(batch: Batch, g: int) -> Batch:
    extras = {"index": batch.extras["index"][g]}
    if "weight" in batch.extras:
        extras["weight"] = np.broadcast_to(batch.extras["weight"], batch.extras["index"].shape)[g]
    return Batch({n: a[g] for n, a in batch.fields.items()}, extras)

