"""A TorchRL ``Storage`` whose rows live in a shmbuffer (``pip install 'shmbuffer[torchrl]'``).

::

    from torchrl.data import ReplayBuffer
    from shmbuffer.torchrl import ShmStorage, identity

    storage = ShmStorage(100_000)                       # the schema comes from the first extend
    rb = ReplayBuffer(storage=storage, collate_fn=identity, batch_size=256)
    rb.extend(td)                                       # a TensorDict with batch size [k]
    batch = rb.sample()                                 # a TensorDict, drawn by TorchRL's sampler
    # in another process: pickle `storage` (or rb) there; its extends are safe alongside ours

TorchRL's samplers and writers work as with its own storages: a writer's ``set(cursor, data)``
appends the rows to the shared ring, which puts them where a round-robin writer would in one
process (slot ``cursor``); with several writers (processes) the ring gives each push its own
slots, so rows are never torn nor lost — TorchRL's own shared storages let concurrent writers
overwrite each other's rows. ``get(index)`` reads the rows in slots ``index`` as stamped copies
(a row being written is waited for). ``len`` is the slots filled.

TorchRL has no default collate function for a storage it does not know: pass
``collate_fn=identity`` (``get`` already returns a stacked TensorDict).

Keys may be nested (``("next", "obs")``); a field is named by joining them with ``__``. TorchRL's
``index`` key is not stored (samplers set it again); other names a ``Batch`` keeps for itself
(``weight``, ``mask`` ...) are stored with a trailing ``_`` and read back under their own key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from .buffer import ReplayBuffer as SharedBuffer
from .errors import EmptyBufferError
from .schema import RESERVED, Schema

__all__ = ["ShmStorage", "identity"]

SEP = "__"
WAIT = 1.0
"""Seconds ``get`` waits for a row that a writer elsewhere is writing."""


def identity(batch: Any) -> Any:
    """The collate function for ``ShmStorage``: its ``get`` returns a stacked TensorDict."""
    return batch


def _field(key: str | tuple[str, ...]) -> str:
    """The field name of a TensorDict key: nested keys joined by ``__``; a name a Batch keeps for
    itself (``weight``, ``mask`` ...) gets a trailing ``_``."""
    name = SEP.join(key) if isinstance(key, tuple) else key
    return name + "_" if name in RESERVED else name


def _flat(data: TensorDictBase) -> dict[str, np.ndarray]:
    out = {}
    for key, value in data.items(include_nested=True, leaves_only=True):
        if key == "index":  # TorchRL's own: the slots a sample came from, set again at sampling
            continue
        out[_field(key)] = value.detach().cpu().numpy()
    return out


class ShmStorage(Storage):
    """A TorchRL storage over a shmbuffer (see the module docstring).

    :param max_size: rows held (ignored when ``buffer`` is given).
    :param buffer: an existing ``shmbuffer.ReplayBuffer`` to store into (its fields are the keys).
    :param name: the shared buffer's name in ``/dev/shm`` when this storage creates it.
    :param device: where ``get`` puts the tensors (CPU by default).
    """

    def __init__(self, max_size: int | None = None, *, buffer: SharedBuffer | None = None,
                 name: str | None = None, device: Any = "cpu") -> None:
        if buffer is None and max_size is None:
            raise ValueError("ShmStorage: give max_size, or an existing shmbuffer as buffer=")
        if buffer is not None and buffer.lanes != 1:
            raise ValueError(f"ShmStorage: expected a buffer with one lane, got {buffer.lanes}")
        super().__init__(buffer.capacity if buffer is not None else int(max_size))  # type: ignore[arg-type]
        self.buffer = buffer
        self.name = name
        self.device = torch.device(device)
        self.nested: dict[str, tuple[str, ...]] = {}
        if buffer is not None:
            self._keys(buffer.schema)

    def _keys(self, schema: Schema) -> None:
        def key(name: str) -> tuple[str, ...]:
            if name.endswith("_") and name[:-1] in RESERVED:
                name = name[:-1]
            return tuple(name.split(SEP))

        self.nested = {n: key(n) for n in schema.names}

    def _buffer_for(self, rows: Mapping[str, np.ndarray], single: bool) -> SharedBuffer:
        if self.buffer is None:
            fields = {k: (a.shape if single else a.shape[1:], a.dtype) for k, a in rows.items()}
            self.buffer = SharedBuffer(Schema(**fields), self.max_size, name=self.name)
            self._keys(self.buffer.schema)
        return self.buffer

    # -- the Storage contract -------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append ``data`` (a TensorDict, ``[k]`` rows or one) to the shared ring."""
        if not isinstance(data, TensorDictBase):
            if isinstance(data, Mapping):
                data = TensorDict(dict(data), batch_size=[])
            else:
                raise TypeError(f"ShmStorage.set: expected a TensorDict, got {type(data).__name__}")
        single = data.batch_dims == 0
        rows = _flat(data)
        buf = self._buffer_for(rows, single)
        if set_cursor:
            self._set_last_cursor(cursor)
        buf.push(rows)

    def get(self, index: Any) -> TensorDict:
        """The rows in slots ``index`` (an int, ints, a tensor or a slice), as a TensorDict."""
        buf = self._need()
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            slots = np.arange(len(self))[index]
        else:
            slots = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, np.int64).reshape(-1)
        n = len(self)
        if slots.size and (slots.min() < -n or slots.max() >= n):
            raise IndexError(f"ShmStorage.get: slots {slots.min()}..{slots.max()} out of range for {n} rows")
        slots = np.where(slots < 0, slots + n, slots)
        deadline = time.monotonic() + WAIT
        while True:
            ids = buf.ring.ids_of_slots(slots)
            if (ids >= 0).all():
                try:
                    batch = buf.take(ids)
                    break
                except EmptyBufferError:
                    pass  # overwritten meanwhile: read the slots again
            if time.monotonic() > deadline:
                raise EmptyBufferError(f"ShmStorage.get: slots {slots[ids < 0][:5].tolist()} are being written")
            time.sleep(0.0005)
        tensors = batch.to(self.device)
        tree: dict[str, Any] = {}
        for k, v in tensors.fields.items():
            *outer, last = self.nested[k]
            node = tree
            for part in outer:
                node = node.setdefault(part, {})
            node[last] = v
        out = TensorDict(tree, batch_size=[slots.size], device=self.device)
        return out[0] if single else out

    def __len__(self) -> int:
        return 0 if self.buffer is None else len(self.buffer)

    def _need(self) -> SharedBuffer:
        if self.buffer is None:
            raise EmptyBufferError("ShmStorage: nothing was written yet")
        return self.buffer

    def contains(self, item: Any) -> Any:
        if isinstance(item, (int, np.integer)):
            return -len(self) <= item < len(self)
        t = torch.as_tensor(item)
        return (t >= -len(self)) & (t < len(self))

    def _empty(self) -> None:
        if self.buffer is not None:
            self.buffer.clear()

    def state_dict(self) -> dict[str, Any]:
        """The rows (oldest first), not a name."""
        if self.buffer is None:
            return {"rows": None}
        rows = self.buffer.export()
        rows.pop("index", None)
        return {"rows": rows, "schema": self.buffer.schema.to_json()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rows = state_dict["rows"]
        if rows is None:
            self._empty()
            return
        if self.buffer is None:
            self.buffer = SharedBuffer(Schema.from_json(state_dict["schema"]), self.max_size, name=self.name)
            self._keys(self.buffer.schema)
        else:
            self.buffer.clear()
        if len(next(iter(rows.values()))):
            self.buffer.push(rows)

    def dumps(self, path: Any) -> None:
        self._need().save(path)

    def loads(self, path: Any) -> None:
        with SharedBuffer.load(path) as saved:
            rows = saved.export()
            rows.pop("index", None)
            self.load_state_dict({"rows": rows, "schema": saved.schema.to_json()})

    def close(self) -> None:
        """Close this process's view; the creator also removes the shared buffer (even when the
        close raises ``BufferError`` because arrays of it are still alive)."""
        if self.buffer is not None:
            owner = self.buffer.owner
            try:
                self.buffer.close()
            finally:
                if owner:
                    self.buffer.unlink()

    def __repr__(self) -> str:
        return f"ShmStorage({self.buffer!r})"
