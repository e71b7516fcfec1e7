"""A TorchRL ``Storage`` whose rows live in a shmbuffer (from a clone: ``pip install -e ".[torchrl]"``).

::

    from torchrl.data import ReplayBuffer
    from shmbuffer.torchrl import ShmStorage

    storage = ShmStorage(100_000)                       # the schema comes from the first extend
    rb = ReplayBuffer(storage=storage, batch_size=256)  # no collate_fn needed: get() stacks
    rb.extend(td)                                       # a TensorDict with batch size [k]
    batch = rb.sample()                                 # a TensorDict, drawn by TorchRL's sampler
    rb[3:4] = td[:1]                                    # overwrites slot 3, as LazyTensorStorage does

The contract is TorchRL's ``Storage`` one, as ``LazyTensorStorage`` keeps it (``ndim=1``):

- A storage index is a slot, ``0 .. max_size - 1``. ``set(cursor, data)`` and ``rb[idx] = data``
  write row ``i`` of ``data`` into slot ``cursor[i]``: a slot that holds a row is overwritten in
  place (``ReplayBuffer.update``: no reader sees a row half-written); the next empty slots are
  filled. Writing to an empty slot that is not the next one raises ``IndexError``.
- A writer's ``extend`` lands where its round-robin cursor says; past ``max_size`` it wraps and
  the newest rows win, also when one ``extend`` holds more rows than ``max_size``.
- TensorDicts (nested keys, lazy stacks of equal shapes), tensorclasses and plain tensors are
  stored, and ``get`` gives back the same type; a list of them is stacked first. Rows may have
  batch dims of their own: a TensorDict of batch size ``[k, 4]`` is ``k`` rows of batch size
  ``[4]``. Anything else (pytrees, non-tensor leaves such as strings, ragged lazy stacks, a key
  the first write did not have) is refused with ``TypeError`` (``KeyError``): shared memory holds
  fixed-shape numeric columns.
- ``ndim=2`` (TorchRL's layout for ``[envs, time]`` batches: its ``ReplayBuffer`` extends along
  time, so the storage is ``[time, envs]``): a storage index along dim 0 is one shmbuffer row whose
  fields hold every env of that step (``(envs, *shape)``), ``max_size`` counts elements (steps of
  one env), ``len`` too, and ``shape`` is ``[rows, envs]``. All envs of a step are one row, so
  they commit together: a sampled ``(step, env)`` never comes from a step half-written, and the
  ring orders concurrent writers' steps as it orders rows. Not a lane per env: TorchRL writes
  the envs of a step in one call and addresses an element by ``(step, env)``, which is index
  arithmetic on one row. ``rb[:]`` (and so ``rb[i, j] = td``, which TorchRL writes through it)
  gives views of the shared columns, unstamped like ``buf.view()``; ``rb.extend`` and
  ``storage.set`` are stamped. ``ndim > 2`` is refused (``ValueError``).
- TorchRL's base ``Storage`` arguments (``checkpointer``, ``compilable``) and ``shared_init`` are
  accepted. The shared buffer is made by the first write, in whichever process holds a copy
  (``shmbuffer.deferred``): TorchRL's collectors leave it to their workers, whose rows may have
  keys the main process never sees (``max_frames_per_traj``'s step count).
- ``dumps(path)`` overwrites an earlier dump in ``path``; ``loads`` / ``load_state_dict`` put
  every row back in its slot, so a writer's restored cursor goes on where it stopped.
- A ``ReplayBuffer`` built on it needs no ``collate_fn=``: TorchRL picks a default by storage
  class and knows only its own, so ``ShmStorage`` subclasses ``StoreStorage`` (whose ``get``, like
  ours, returns a stacked batch) for that choice alone; none of ``StoreStorage``'s code runs.
  ``identity`` stays for code that passes it.

Several processes: every process that holds a copy of this storage (pickle it, or its
``ReplayBuffer``, before or after the first write) reads and writes the same rows. TorchRL's writers share
one cursor between processes without ordering them, so two can get the same slots, or slots past
ones another has yet to write; TorchRL's own storages then overwrite rows just written. Here a
writer's run of slots (``extend``, ``add``) is appended instead once the storage is a copy, or
once writers elsewhere have written since this object last did: the ring gives each run its own
slots, so concurrent writers never tear nor lose rows, and a run's rows may sit in other slots
than the index ``extend`` returned. Index writes (``rb[idx] = td``) overwrite their slots
everywhere; in one process with no other writer, every write goes exactly where TorchRL puts it.

Keys may be nested (``("next", "obs")``); a field is named by joining them with ``__``. TorchRL's
``index`` key is not stored (samplers set it again); other names a ``Batch`` keeps for itself
(``weight``, ``mask`` ...) are stored with a trailing ``_`` and read back under their own key.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import (
    TensorDict,
    TensorDictBase,
    is_tensorclass,
)
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
from torchrl.data.replay_buffers.storages import Storage, StoreStorage

from . import tensordicts
from .buffer import ReplayBuffer as SharedBuffer
from .deferred import DeferredBuffer
from .errors import EmptyBufferError
from .persistence import MANIFEST
from .persistence import META as SAVE_META
from .persistence import ROWS as SAVE_ROWS
from .protocol import by_position
from .schema import RESERVED, Schema
from .shm.segment import new_name
from .tensordicts import SEP

__all__ = ["ShmStorage", "identity"]

WAIT = 1.0
"""Seconds ``get`` and ``set`` wait for a row that a writer elsewhere is writing."""
TENSOR = "tensor"
"""The one field of a storage of plain tensors (its ``kind`` says so)."""
KINDS = ("tensordict", "tensorclass", "tensor")
META = "torchrl.json"
"""The file ``dumps`` writes beside the save: what kind of data the rows are."""


def identity(batch: Any) -> Any:
    """A collate function for ``ShmStorage`` (TorchRL's default for it does the same): its ``get``
    returns a stacked batch."""
    return batch


class ShmStorage(StoreStorage):
    """A TorchRL storage over a shmbuffer (see the module docstring).

    :param max_size: rows held (ignored when ``buffer`` is given).
    :param buffer: an existing ``shmbuffer.ReplayBuffer`` to store into (its fields are the keys).
    :param name: the shared buffer's name in ``/dev/shm`` when this storage creates it.
    :param device: where ``get`` puts the tensors (CPU by default; ``"auto"``: the first data's).
    :param ndim: 1, or 2 for TorchRL's ``[time, envs]`` layout (see the module docstring).
    :param checkpointer: as TorchRL's ``Storage``: when set, ``dumps``/``loads`` go through it.
    :param compilable: as TorchRL's ``Storage`` (its bookkeeping in tensors rather than shared values).
    :param shared_init: ``LazyTensorStorage``'s, accepted: this storage is always made by its
        first write, in whichever process (``shared_init`` reads ``True``: TorchRL's collectors
        then leave that write to their workers).
    """

    _default_checkpointer = StorageCheckpointerBase

    def __init__(self, max_size: int | None = None, *, buffer: SharedBuffer | None = None,
                 name: str | None = None, device: Any = "cpu", ndim: int = 1,
                 checkpointer: StorageCheckpointerBase | None = None, compilable: bool = False,
                 shared_init: bool = False) -> None:
        if buffer is None and max_size is None:
            raise ValueError("ShmStorage: give max_size, or an existing shmbuffer as buffer=")
        if buffer is not None and buffer.lanes != 1:
            raise ValueError(f"ShmStorage: expected a buffer with one lane, got {buffer.lanes}")
        if ndim not in (1, 2):
            raise ValueError(
                f"ShmStorage: ndim={ndim} is not supported, only 1 or 2 ([time, envs]): flatten the leading "
                "dims before writing (td.reshape(-1)), use LazyTensorStorage(max_size, ndim=...), or shmbuffer's "
                "own ReplayBuffer(schema, capacity, envs=n), which keeps each env's steps in a lane"
            )
        if ndim == 2 and buffer is not None:
            raise ValueError("ShmStorage: ndim=2 makes its own buffer from the first write (its rows hold every env "
                             "of a step); give max_size, not buffer=")
        # StoreStorage (a Redis-backed storage) only for TorchRL's choice of a ReplayBuffer's
        # default collate_fn (storages/utils.py: its get, like ours, returns a stacked batch);
        # none of its code runs: the methods TorchRL calls are ShmStorage's, its __init__ is skipped
        Storage.__init__(self, buffer.capacity if buffer is not None else int(max_size),  # type: ignore[arg-type]
                         checkpointer=checkpointer, compilable=compilable)
        self.ndim = ndim
        self.buffer = buffer
        self.shared_init = True  # TorchRL's collectors read it: the first write may happen in any process
        self.deferred = None if buffer is not None else DeferredBuffer(name if name is not None else new_name())
        self.name = buffer.name if buffer is not None else self.deferred.name  # type: ignore[union-attr]
        self.device: Any = device if device == "auto" else torch.device(device)
        self.nested: dict[str, tuple[str, ...]] = {}
        self.kind: str | None = "tensordict" if buffer is not None else None
        self.classes: dict[tuple[str, ...], type] = {}
        self.row_batch: tuple[int, ...] | None = () if buffer is not None else None  # a row's own batch dims
        self._seen: int | None = None  # the ring's cursor after this object's last write
        self.shared_writers = False  # whether writers elsewhere have written since (see the module docstring)
        if buffer is not None:
            self._keys(buffer.schema)
            self._seen = by_position.cursor(buffer)

    @property
    def initialized(self) -> bool:
        """Whether the shared buffer exists (made by the first write, in any process)."""
        return self._attach() is not None

    def _attach(self) -> SharedBuffer | None:
        """The shared buffer, attached here once a process has made it (``shmbuffer.deferred``)."""
        if self.buffer is None and self.deferred is not None and (found := self.deferred.find()) is not None:
            self._adopt(*found)
        return self.buffer

    def _adopt(self, buf: SharedBuffer, described: dict[str, Any]) -> None:
        self.buffer = buf
        self._keys(buf.schema)
        self._seen = by_position.cursor(buf)
        self.kind = described["kind"]
        names = described.get("tensorclass") or {}
        if {SEP.join(p): tensordicts.class_name(c) for p, c in self.classes.items()} != names:
            self.classes = {tuple(p.split(SEP)) if p else (): tensordicts.import_class(c) for p, c in names.items()}
        self.row_batch = tuple(described["row_batch"] or ())

    def _init(self, data: Any) -> None:
        raise NotImplementedError("ShmStorage: the shared buffer is made by the first set() (its schema from the data)")

    def __getstate__(self) -> dict[str, Any]:
        if self._attach() is None and self.deferred is not None:
            self.deferred.share()  # the copy may make the buffer: the first write anywhere does
        return Storage.__getstate__(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__setstate__(self, state)
        # a copy (another process's, most often) writes the same rows as the original: its
        # writers' runs append (see _writer_run)
        self.shared_writers = True

    def _keys(self, schema: Schema) -> None:
        def key(name: str) -> tuple[str, ...]:
            if name.endswith("_") and name[:-1] in RESERVED:
                name = name[:-1]
            return tuple(name.split(SEP))

        self.nested = {n: key(n) for n in schema.names}

    # -- what a write holds ---------------------------------------------------------------------
    def _as_tensordict(self, data: Any, single: bool) -> tuple[str, dict[tuple[str, ...], type], TensorDictBase]:
        classes: dict[tuple[str, ...], type]
        td: TensorDictBase
        if type(data) is TensorDict:  # the usual case first: the checks below cost microseconds each
            kind, classes, td = "tensordict", {}, data
        elif isinstance(data, (list, tuple)):
            data = tensordicts.stack_rows(data)
            return self._as_tensordict(data, single)
        elif isinstance(data, torch.Tensor):
            kind, classes = "tensor", {}
            td = TensorDict({TENSOR: data}, batch_size=data.shape[:self.ndim - 1 if single else self.ndim])
        elif is_tensorclass(data):
            kind, classes, td = "tensorclass", tensordicts.classes(data), data.to_tensordict()
        elif isinstance(data, TensorDictBase):
            kind, classes, td = "tensordict", {}, data
        else:
            raise TypeError(
                f"ShmStorage.set: expected a TensorDict, a tensorclass or a torch.Tensor (or a list of them), got "
                f"{type(data).__name__}; pytrees are not stored (shared memory holds named numeric columns): "
                "wrap a dict of tensors in TensorDict(d, batch_size=[k])"
            )
        if self.kind is not None and kind != self.kind:
            raise TypeError(f"ShmStorage.set: this storage holds {self.kind} rows, got {kind} ({type(data).__name__})")
        if kind == "tensorclass" and self.classes and classes != self.classes:
            raise TypeError(f"ShmStorage.set: this storage holds {tensordicts.class_name(self.classes[()])} rows, got "
                            f"{tensordicts.class_name(type(data))}")
        return kind, classes, td

    def _cap(self, row_batch: tuple[int, ...] | None = None) -> int:
        """The rows the storage holds (with ``ndim=2``, ``max_size`` elements over a row's envs)."""
        if self.buffer is not None:
            return self.buffer.capacity
        if self.ndim == 1:
            return self.max_size
        row_batch = row_batch if row_batch is not None else self.row_batch
        if not row_batch:
            raise ValueError("ShmStorage(ndim=2): expected rows of batch size [envs] (the storage's second dim), got "
                             "no second dim; write data of batch size [k, envs]")
        return -(self.max_size // -int(np.prod(row_batch[: self.ndim - 1])))

    def _rows(self) -> int:
        return 0 if self._attach() is None else len(self.buffer)  # type: ignore[arg-type]

    def _slots(self, cursor: Any) -> tuple[np.ndarray, bool]:
        """The indices of a cursor (an int, a slice, ints, a tensor) as given (``_in_range``
        checks them), and whether it names one row."""
        if isinstance(cursor, torch.Tensor):
            if cursor.ndim == 0:
                return np.array([int(cursor)], np.int64), True
            a = cursor.detach().cpu().numpy()
        elif isinstance(cursor, (int, np.integer)):
            return np.array([int(cursor)], np.int64), True
        elif isinstance(cursor, slice):
            return np.arange(self._cap(), dtype=np.int64)[cursor], False
        else:
            if isinstance(cursor, tuple) and any(not isinstance(c, (int, np.integer)) for c in cursor):
                raise IndexError(f"ShmStorage: expected a 1-D index (ndim=1), got a tuple {cursor!r}")
            a = np.asarray(cursor)
        if a.dtype.kind not in "iu":
            raise IndexError(f"ShmStorage: expected an int, a slice or integer indices, got {a.dtype} ({cursor!r})")
        return a.reshape(-1).astype(np.int64, copy=False), False

    def _in_range(self, slots: np.ndarray) -> np.ndarray:
        """``slots`` with negative indices counted from ``max_size``, as a tensor's are; out of
        range ones raise ``IndexError``."""
        if not slots.size:
            return slots
        lo, hi, cap = int(slots.min()), int(slots.max()), self._cap()
        if lo < 0:
            slots = np.where(slots < 0, slots + cap, slots)
            lo = int(slots.min())
        if lo < 0 or hi >= cap:
            raise IndexError(f"ShmStorage: indices {lo}..{hi} out of range for {cap} rows (max_size {self.max_size})")
        return slots

    # -- the Storage contract -------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write row ``i`` of ``data`` into slot ``cursor[i]`` (an int cursor: one row): a held
        slot is overwritten, the next empty ones are filled (see the module docstring)."""
        if self.ndim == 2 and isinstance(cursor, tuple) and len(cursor) == 2:
            return self._set_elements(cursor, data)
        slots, single = self._slots(cursor)
        kind, classes, td = self._as_tensordict(data, single)
        self._attach()
        k = slots.size
        if not single and (td.batch_dims < 1 or td.batch_size[0] != k):
            raise ValueError(f"ShmStorage.set: expected {k} rows (batch size [{k}, ...]) for {k} indices, got batch size "
                             f"{list(td.batch_size)}")
        row_batch = tuple(td.batch_size[0 if single else 1:])
        if self.row_batch is not None and row_batch != self.row_batch:
            raise ValueError(f"ShmStorage.set: this storage holds rows of batch size {list(self.row_batch)}, got "
                             f"{list(row_batch)} (batch size {list(td.batch_size)})")
        rows = tensordicts.flatten(td)
        if single:
            rows = {n: a[None] for n, a in rows.items()}
        if self.buffer is None and self.deferred is not None and self.deferred.record is not None:
            self._buffer_for(rows, kind, classes, td, row_batch)  # shared: the first write anywhere makes it
        cap = self._cap(row_batch)
        head = 0 if self.buffer is None else by_position.next_slot(self.buffer)
        appends = by_position.is_run(slots, head, cap)
        if not appends:
            slots = self._in_range(slots)
            if set_cursor and self.buffer is not None and by_position.is_run(slots, int(slots[0]), cap):
                appends = self._writer_run(self.buffer, slots)
        if self.buffer is None and not appends:
            raise IndexError(f"ShmStorage.set: the storage is empty: expected the first rows at slots 0..{k - 1}, "
                             f"got {slots[:5].tolist()}")
        buf = self._buffer_for(rows, kind, classes, td, row_batch)
        unknown = sorted(rows.keys() - self.nested.keys())
        if unknown:
            raise KeyError(f"ShmStorage.set: keys {[SEP.join(self.nested.get(u, (u,))) for u in unknown]} are not in "
                           f"this storage (it holds {sorted(SEP.join(v) for v in self.nested.values())}); its columns "
                           "are fixed by the first write: write every key from the start")
        if appends:
            self._append(buf, rows, k)
        else:
            self._write_at(buf, slots, rows)
        self._seen = by_position.cursor(buf)
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _append(self, buf: SharedBuffer, rows: dict[str, np.ndarray], k: int) -> None:
        cap = buf.capacity
        # more rows than slots: only the last ones stay; starting at a multiple of cap keeps row i
        # in slot (head + i) % cap, where TorchRL's writer put it
        start = (k - cap) // cap * cap if k > cap else 0
        for lo in range(start, k, cap):
            buf.push({n: a[lo:lo + cap] for n, a in rows.items()})

    def _writer_run(self, buf: SharedBuffer, slots: np.ndarray) -> bool:
        """Whether a writer's run of slots that is not the next one is appended: yes once writers
        elsewhere have written, since TorchRL's shared cursor gives colliding writers the same
        slots (and their runs arrive out of order); a run of empty slots waits a while for them."""
        cap = buf.capacity
        deadline = time.monotonic() + WAIT
        while True:
            if self._others_wrote(buf):
                return True
            if by_position.is_run(slots, by_position.next_slot(buf), cap):
                return True
            if by_position.held(buf, slots).any() or time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)

    def _others_wrote(self, buf: SharedBuffer) -> bool:
        """Whether rows were added by someone else since this object last wrote (sticky)."""
        if not self.shared_writers and self._seen is not None and by_position.cursor(buf) != self._seen:
            self.shared_writers = True
        return self.shared_writers

    def _write_at(self, buf: SharedBuffer, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        """Overwrite the held slots among ``slots``; the empty ones must be the next ones."""
        cap = buf.capacity
        # a slot given twice keeps its last row, as tensor indexing does
        last = np.sort(slots.size - 1 - np.unique(slots[::-1], return_index=True)[1])
        slots, rows = slots[last], {n: a[last] for n, a in rows.items()}
        empty = ~by_position.held(buf, slots)
        if not by_position.is_run(slots[empty], by_position.next_slot(buf), cap):
            raise IndexError(
                f"ShmStorage.set: slots {slots[empty][:5].tolist()} hold no row and are not the next ones "
                f"({self._rows()} rows held): write at held slots to overwrite them, or at slot {by_position.next_slot(buf)} and "
                "on to add rows"
            )
        fresh = {n: a[empty] for n, a in rows.items()}
        if empty.any():
            buf.check(fresh)  # before the overwrite: on bad rows nothing changes
        if not empty.all():
            self._overwrite(buf, slots[~empty], {n: a[~empty] for n, a in rows.items()})
        if empty.any():
            buf.push(fresh)

    def _overwrite(self, buf: SharedBuffer, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        deadline = time.monotonic() + WAIT
        while True:
            ids = by_position.ids_at(buf, slots)
            if (ids >= 0).all():
                break
            if time.monotonic() > deadline:
                raise EmptyBufferError(f"ShmStorage.set: slots {slots[ids < 0][:5].tolist()} are being written")
            time.sleep(0.0005)
        # under update's commit protocol no reader sees a row half-overwritten; a row a writer
        # elsewhere replaces meanwhile is skipped: its newer row stands
        buf.update(ids, rows)

    def _buffer_for(self, rows: dict[str, np.ndarray], kind: str, classes: dict[tuple[str, ...], type],
                    td: TensorDictBase, row_batch: tuple[int, ...]) -> SharedBuffer:
        if self.buffer is None:
            schema = Schema(**{k: (a.shape[1:], a.dtype) for k, a in rows.items()})
            self._make(schema, self._cap(row_batch), kind, classes, row_batch)
            if kind != self.kind:
                raise TypeError(f"ShmStorage.set: this storage holds {self.kind} rows, got {kind} ({type(td).__name__})")
        if self.kind is None:
            self.kind, self.classes, self.row_batch = kind, classes, row_batch
        if isinstance(self.device, str):  # "auto"
            self.device = td.device if td.device is not None else torch.device("cpu")
        return self._need()

    def get(self, index: Any) -> Any:
        """The rows in slots ``index`` (an int, ints, a tensor or a slice), as the type written."""
        buf = self._need()
        if self.ndim == 2 and isinstance(index, tuple):
            return self._get_elements(index)
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            slots = np.arange(self._rows())[index]
        else:
            slots = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, np.int64).reshape(-1)
        n = self._rows()
        if slots.size and (slots.min() < -n or slots.max() >= n):
            raise IndexError(f"ShmStorage.get: slots {slots.min()}..{slots.max()} out of range for {n} rows")
        slots = np.where(slots < 0, slots + n, slots)
        deadline = time.monotonic() + WAIT
        while True:
            ids = by_position.ids_at(buf, slots)
            if (ids >= 0).all():
                try:
                    batch = buf.take(ids)
                    break
                except EmptyBufferError:
                    pass  # overwritten meanwhile: read the slots again
            if time.monotonic() > deadline:
                raise EmptyBufferError(f"ShmStorage.get: slots {slots[ids < 0][:5].tolist()} are being written")
            time.sleep(0.0005)
        device = torch.device("cpu") if self.device == "auto" else self.device
        tensors = batch.to(device)
        tree: dict[str, Any] = {}
        for k, v in tensors.fields.items():
            *outer, last = self.nested[k]
            node = tree
            for part in outer:
                node = node.setdefault(part, {})
            # the small fields of a gathered row share one packed record, so they come as strided
            # views of it; TorchRL's storages give contiguous tensors (``.view(-1)`` works on them)
            node[last] = v.contiguous()
        out: Any = TensorDict(tree, batch_size=[slots.size, *(self.row_batch or ())], device=device)
        if single:
            out = out[0]
        if self.kind == "tensor":
            return out[TENSOR]
        if self.kind == "tensorclass":
            for path in sorted(self.classes, key=len, reverse=True):  # innermost first
                if path:
                    out[path] = self.classes[path].from_tensordict(out[path])  # type: ignore[attr-defined]
            return self.classes[()].from_tensordict(out)  # type: ignore[attr-defined]
        return out

    def __len__(self) -> int:
        """Elements held: rows, times a row's envs with ``ndim=2`` (TorchRL's ``len``)."""
        return self._rows() * (int(np.prod(self.row_batch)) if self.ndim == 2 and self.row_batch else 1)

    # -- ndim=2: [time, envs] -------------------------------------------------------------------
    @property
    def _len_along_dim0(self) -> int:
        return self._rows()

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if self.ndim == 1 or self.buffer is not None or self.row_batch is not None:
            return self._cap()
        if single_data is not None:
            return self._cap(tuple(single_data.shape[: self.ndim - 1]))
        if batched_data is None:
            raise ValueError("single_data or batched_data must be passed.")
        return self._cap(tuple(batched_data.shape[1: self.ndim]))

    @property
    def shape(self) -> torch.Size | None:
        """``[rows, envs]`` (``ndim=2``) or ``[rows]``; ``None`` before the first write with ``ndim=2``."""
        if self.ndim == 1:
            return torch.Size([self._rows()])
        if self.row_batch is None:
            return None
        return torch.Size([self._rows(), *self.row_batch])

    def _rand_given_ndim(self, batch_size: int) -> Any:
        if self.ndim == 1:
            return torch.randint(0, len(self), (batch_size,), generator=self._rng)
        return tuple(torch.randint(int(d), (batch_size,), generator=self._rng) for d in self.shape or ())

    def _views(self) -> TensorDictBase:
        """Zero-copy, writable views of the held rows, ``[rows, envs]`` (not stamped)."""
        buf = self._need()
        rows = self._rows()
        tree: dict[str, Any] = {}
        for name, column in buf.block.fields.items():
            if name not in self.nested:
                continue
            *outer, last = self.nested[name]
            node = tree
            for part in outer:
                node = node.setdefault(part, {})
            node[last] = torch.from_numpy(column[:rows])
        return TensorDict(tree, batch_size=[rows, *(self.row_batch or ())])

    def _get_elements(self, index: tuple[Any, ...]) -> Any:
        """``get`` of ``(steps, envs)``: two index tensors pair up (a sampler's draw); a whole-range
        index gives views (TorchRL writes ``rb[i, j] = td`` through them)."""
        if len(index) == 1:
            return self.get(index[0])
        rows, cols = index
        if all(isinstance(i, slice) and i == slice(None) for i in index) and self.kind == "tensordict":
            return self._views()
        if isinstance(rows, torch.Tensor) and isinstance(cols, torch.Tensor) and rows.ndim == cols.ndim == 1:
            out = self.get(rows)
            return out[torch.arange(rows.numel()), cols]
        out = self.get(rows)
        single = isinstance(rows, (int, np.integer)) or (isinstance(rows, torch.Tensor) and rows.ndim == 0)
        return out[cols] if single else out[:, cols]

    def _set_elements(self, index: tuple[Any, Any], data: Any) -> None:
        """``set`` of ``(steps, envs)``: the rows read, changed and written back whole."""
        rows_at, cols = index
        current = self.get(rows_at)
        single = isinstance(rows_at, (int, np.integer)) or (isinstance(rows_at, torch.Tensor) and rows_at.ndim == 0)
        if single:
            current[cols] = data
        else:
            current[:, cols] = data
        self.set(rows_at, current, set_cursor=False)

    def _need(self) -> SharedBuffer:
        if (buf := self._attach()) is None:
            raise EmptyBufferError("ShmStorage: nothing was written yet")
        return buf

    def _make(self, schema: Schema, cap: int, kind: str, classes: dict[tuple[str, ...], type],
              row_batch: tuple[int, ...]) -> None:
        """Make the shared buffer, or attach the one a process made meanwhile (``shmbuffer.deferred``)."""
        self.kind, self.classes, self.row_batch = None, classes, row_batch
        self._adopt(*self.deferred.make(schema, cap, self._describe(kind, classes, row_batch)))  # type: ignore[union-attr]

    def contains(self, item: Any) -> Any:
        """TorchRL's ``contains``: whether a storage index holds a row (an int, or per index)."""
        n = self._rows()
        if isinstance(item, (int, np.integer)):
            return -n <= item < n
        t = torch.as_tensor(item)
        return (t >= -n) & (t < n)

    def _empty(self) -> None:
        if self.buffer is not None:
            self.buffer.clear()
            self._seen = by_position.cursor(self.buffer)

    def _meta(self) -> dict[str, Any]:
        return self._describe(self.kind, self.classes, self.row_batch)

    @staticmethod
    def _describe(kind: str | None, classes: dict[tuple[str, ...], type], row_batch: tuple[int, ...] | None) -> dict[str, Any]:
        return {"kind": kind, "tensorclass": {SEP.join(p): tensordicts.class_name(c) for p, c in classes.items()},
                "row_batch": None if row_batch is None else list(row_batch)}

    def state_dict(self) -> dict[str, Any]:
        """The rows in slot order (so a load puts each back in its slot), not a name."""
        if (buf := self._attach()) is None:
            return {"rows": None, **self._meta()}
        return {"rows": by_position.in_slot_order(buf.export(), buf.capacity), "schema": buf.schema.to_json(), **self._meta()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """TorchRL's ``load_state_dict``: the rows of ``state_dict`` (``state_dict()``'s), each back in its slot."""
        kind, classes = self._kind_of(state_dict, "load_state_dict")
        self._attach()
        rows = state_dict["rows"]
        if rows is None:
            self._empty()
            return
        schema = self.buffer.schema if self.buffer is not None else Schema.from_json(state_dict["schema"])
        row_batch = self._state_row_batch(state_dict.get("row_batch"), schema)
        if self.buffer is None:
            self.row_batch = row_batch
            self._make(schema, self._cap(), kind, classes, row_batch)
        buf = self._need()
        k, *_ = buf.check(rows)  # before the rows held go: rows it refuses leave the storage as it was
        self._empty()
        self.kind, self.classes = kind, classes
        self.row_batch = row_batch
        if k:
            buf.push(rows)
        self._seen = by_position.cursor(buf)
        self._bump_mutation_revision()

    def _kind_of(self, meta: dict[str, Any], where: str) -> tuple[str, dict[tuple[str, ...], type]]:
        """The kind of rows a state or dump says it holds, and its tensorclasses, checked before
        anything else is read or made: they come from a file, and only classes of modules already
        imported are used (``tensordicts.import_class``)."""
        kind = meta.get("kind") or "tensordict"
        if kind not in KINDS:
            raise ValueError(f"ShmStorage.{where}: expected a kind in {KINDS}, got {kind!r}: the state or dump is not "
                             "one ShmStorage wrote")
        if self.kind is not None and kind != self.kind:
            raise TypeError(f"ShmStorage.{where}: this storage holds {self.kind} rows, the state holds {kind} rows")
        classes = self.classes
        if kind == "tensorclass" and not classes:
            names = meta.get("tensorclass") or {}
            if not isinstance(names, dict) or not all(isinstance(c, str) for c in names.values()):
                raise ValueError(f"ShmStorage.{where}: 'tensorclass' must map keys to 'module:qualname' names, got "
                                 f"{str(names)[:100]}: the state or dump is not one ShmStorage wrote")
            classes = {tuple(p.split(SEP)) if p else (): tensordicts.import_class(c) for p, c in names.items()}
        return kind, classes

    def _state_row_batch(self, got: Any, schema: Schema) -> tuple[int, ...]:
        """A state's ``row_batch`` (a row's own batch dims), checked against this storage's and the
        fields' shapes (each field's shape starts with them) before anything changes."""
        try:
            row_batch = tuple(int(d) for d in got or ())
        except (TypeError, ValueError):
            raise ValueError(f"ShmStorage.load_state_dict: 'row_batch' must be a list of ints (a row's batch dims), "
                             f"got {got!r}") from None
        if self.buffer is not None and self.row_batch is not None and row_batch != self.row_batch:
            raise ValueError(f"ShmStorage.load_state_dict: this storage holds rows of batch size {list(self.row_batch)}, "
                             f"the state's rows have batch size {list(row_batch)}; load it into a new ShmStorage")
        for f in schema:
            if tuple(f.shape[:len(row_batch)]) != row_batch or min(row_batch, default=1) < 1:
                raise ValueError(f"ShmStorage.load_state_dict: field {f.name!r} has shape {list(f.shape)}, which does "
                                 f"not start with the state's row batch size {list(row_batch)}; the state is not "
                                 "one that state_dict() wrote")
        return row_batch

    def _custom_checkpointer(self) -> bool:
        return type(self.checkpointer) is not StorageCheckpointerBase

    def dumps(self, path: Any) -> None:
        """Checkpoint the rows into the directory ``path`` (``ReplayBuffer.checkpoint``): the first
        dump there writes every row, a later one what changed since (a full save left there by an
        older release is removed)."""
        if self._custom_checkpointer():
            return super().dumps(path)
        self._need().checkpoint(path)
        for old in (SAVE_META, SAVE_ROWS):  # an older release's full dump: the checkpoint replaces it
            with contextlib.suppress(FileNotFoundError):
                (Path(path) / old).unlink()
        (Path(path) / META).write_text(json.dumps(self._meta()))
        return None

    def loads(self, path: Any) -> None:
        """TorchRL's ``loads``: the rows ``dumps`` wrote into ``path``, each back in its slot."""
        if self._custom_checkpointer():
            return super().loads(path)
        meta = Path(path) / META
        kinds = json.loads(meta.read_text()) if meta.exists() else {}
        if not isinstance(kinds, dict):
            raise ValueError(f"ShmStorage.loads: {meta} holds a {type(kinds).__name__}, expected the object dumps() "
                             "wrote: the dump is not one ShmStorage wrote")
        self._kind_of(kinds, "loads")  # before the rows are read: a file chose what it says
        restore = SharedBuffer.resume if (Path(path) / MANIFEST).exists() else SharedBuffer.load
        with restore(path) as saved:
            rows = by_position.in_slot_order(saved.export(), saved.capacity)
            self.load_state_dict({"rows": rows, "schema": saved.schema.to_json(), **kinds})
        return None

    def close(self) -> None:
        """Close this process's view; the creator also removes the shared buffer (even when the
        close raises ``BufferError`` because arrays of it are still alive)."""
        try:
            if self._attach() is not None:  # one a worker made: taken over, so removed here
                owner = self.buffer.owner  # type: ignore[union-attr]
                try:
                    self.buffer.close()  # type: ignore[union-attr]
                finally:
                    if owner:
                        self.buffer.unlink()  # type: ignore[union-attr]
        finally:
            if self.deferred is not None:
                self.deferred.close()

    def __repr__(self) -> str:
        return f"ShmStorage({self.buffer!r})"
