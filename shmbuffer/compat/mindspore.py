"""MindSpore RL's ``ReplayBuffer(batch_size, capacity, shapes, types)``, on a shared-memory
``shmbuffer.ReplayBuffer``.

::

    from shmbuffer.compat import mindspore as ms
    from shmbuffer.compat.mindspore import ReplayBuffer

    replaybuffer = ReplayBuffer(2, 100000, [(4,), (1,), (1,), (4,)], [ms.float32, ms.int32, ms.float32, ms.float32])
    replaybuffer.insert([state, action, reward, new_state])   # one row, or k rows with a leading dimension
    exp = replaybuffer.get_item(0)                             # a list of arrays, in the order of shapes
    samples = replaybuffer.sample()                            # batch_size rows, a list of arrays
    replaybuffer.size(); replaybuffer.full(); replaybuffer.reset()

The elements of ``shapes`` become fields ``f0, f1, ...`` of the ``buffer`` behind it. Its data lives
in host shared memory as numpy arrays, not on the device as MindSpore tensors: ``get_item`` and
``sample`` return numpy arrays. ``Tensor(values, dtype)`` makes a numpy array and ``float32``,
``int32``, ... are numpy dtypes, so MindSpore's examples run with only their import lines changed.
``get_item(index)``: 0 is the oldest row held (MindSpore remaps by its head cursor the same way).
``sample()`` draws uniformly with replacement; on an empty buffer it raises ``EmptyBufferError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer as _Core
from ..schema import Schema
from . import Facade, numpy_of

__all__ = ["ReplayBuffer", "Tensor", "bool_", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
           "uint8"]

float16, float32, float64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
int8, int16, int32, int64 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)
uint8, bool_ = np.dtype(np.uint8), np.dtype(np.bool_)


def Tensor(input_data: Any, dtype: Any = None) -> np.ndarray:
    """MindSpore's ``Tensor(values, dtype)`` as a numpy array (what this buffer stores)."""
    return np.asarray(numpy_of(input_data), dtype=None if dtype is None else np.dtype(dtype))


class ReplayBuffer(Facade):
    """MindSpore RL's FIFO replay buffer (see the module docstring)."""

    buffer: _Core

    def __init__(self, batch_size: int, capacity: int, shapes: Sequence[Sequence[int]], types: Sequence[Any], *,
                 name: str | None = None, seed: int | None = None) -> None:
        if len(shapes) != len(types):
            raise ValueError(f"ReplayBuffer: {len(shapes)} shapes but {len(types)} types")
        self.batch_size = int(batch_size)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.types = [np.dtype(t) for t in types]
        self.names = [f"f{i}" for i in range(len(self.shapes))]
        schema = Schema(**{n: (s, t.str) for n, s, t in zip(self.names, self.shapes, self.types, strict=True)})
        self.buffer = _Core(schema, int(capacity), name=name, seed=seed)
        """The ``shmbuffer.ReplayBuffer`` behind it."""

    def insert(self, exp: Sequence[Any]) -> None:
        """Append one row (each element of ``exp`` of its shape) or ``k`` rows (a leading dimension)."""
        if len(exp) != len(self.names):
            raise ValueError(f"insert: expected {len(self.names)} elements (one per shape), got {len(exp)}")
        self.buffer.push({n: numpy_of(x) for n, x in zip(self.names, exp, strict=True)})

    def get_item(self, index: int) -> list[np.ndarray]:
        """The row at ``index`` (0 the oldest held), a list of arrays in the order of ``shapes``."""
        row = self.buffer.get(int(index))
        return [np.asarray(row[n]) for n in self.names]

    def sample(self) -> list[np.ndarray]:
        """``batch_size`` rows, uniformly: a list of ``(batch_size, *shape)`` arrays."""
        batch = self.buffer.sample(self.batch_size)
        return [batch[n] for n in self.names]

    def reset(self) -> None:
        """Remove every row (MindSpore RL's name for ``clear``)."""
        self.buffer.clear()

    def size(self) -> int:
        """Rows held now."""
        return len(self.buffer)

    def full(self) -> bool:
        """Whether the buffer is full."""
        return bool(self.buffer.full)

    def destroy(self) -> None:
        """Close the buffer (MindSpore RL's name for ``close``)."""
        self.close()

