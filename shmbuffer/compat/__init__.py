"""Facades with the names of other libraries' replay buffers, on top of ``shmbuffer.ReplayBuffer``.

One thin module per library, each giving its class names, constructors, method names, defaults
and return types, and doing nothing a ``ReplayBuffer`` does not do itself:

``shmbuffer.compat.cpprb``      cpprb's ``ReplayBuffer(size, env_dict)`` and ``PrioritizedReplayBuffer``
``shmbuffer.compat.ding``       DI-engine's ``DequeBuffer`` and its middleware
``shmbuffer.compat.nervex``     nerveX's ``AdvancedReplayBuffer`` from its config dict
``shmbuffer.compat.velora``     Velora's ``ReplayBuffer(capacity, state_dim, action_dim, hidden_dim, device)``
``shmbuffer.compat.mindspore``  MindSpore RL's ``ReplayBuffer(batch_size, capacity, shapes, types)``

The rows still live in shared memory as fixed-schema columns. A facade takes its schema from its
constructor where the library has one (Velora, MindSpore RL), else from the first push (DI-engine,
nerveX). nerveX's, Velora's and MindSpore RL's rows must keep the same numeric fields, shapes and
dtypes, and what cannot be stored that way (a string, a Python object, a nested dict) is refused
with ``TypeError`` saying what to push instead. DI-engine's buffer stores any object, so its facade
encodes what the columns do not take into fixed-size slots of the row (see ``ding``). Each facade's ``buffer`` is its ``ReplayBuffer``; ``close()`` (or ``with``)
closes it and, in the creating process, removes it.

This package imports the root package; nothing below it imports this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from ..buffer import ReplayBuffer
from ..schema import Schema
from ..schema import as_numpy as numpy_of

__all__ = ["Facade", "as_row", "numpy_of", "schema_of_row"]

_F = TypeVar("_F", bound="Facade")


class Facade:
    """What every facade shares: its ``buffer`` (a ``ReplayBuffer``, or ``None`` until the first
    push gives the schema) and the lifecycle: ``close()`` and ``with`` close it and, in the creating
    process, remove it."""

    buffer: ReplayBuffer | None = None

    def close(self) -> None:
        """Close the shared-memory buffer (and remove it in the creating process)."""
        if self.buffer is not None:
            self.buffer.__exit__(None, None, None)

    def __enter__(self: _F) -> _F:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse(what: str, key: str | None, value: Any, hint: str) -> TypeError:
    where = f"field {key!r}" if key is not None else "the data"
    return TypeError(
        f"{what}: {where} is a {type(value).__name__} ({str(value)[:40]!r}), which shmbuffer cannot store: its rows "
        "are fixed-schema numeric columns in shared memory (numbers, bools, numpy arrays, torch tensors). "
        f"{hint}"
    )


HINT = ("Push a dict of numeric fields instead, e.g. {'obs': np.zeros(4), 'action': 1, 'reward': 0.5}; "
        "keep other objects in a list of your own and push their integer position as a field.")


def as_row(data: Any, what: str) -> dict[str, np.ndarray]:
    """A pushed row (a mapping of numeric values) as numpy arrays, or ``TypeError`` saying why not."""
    if not isinstance(data, Mapping):
        raise _refuse(what, None, data, HINT)
    row: dict[str, np.ndarray] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TypeError(f"{what}: field names must be identifiers (str), got {key!r}")
        try:
            a = numpy_of(value)
        except (TypeError, ValueError):
            raise _refuse(what, key, value, HINT) from None
        if a.dtype.kind not in "biufc":
            raise _refuse(what, key, value, HINT)
        row[key] = a
    return row


def schema_of_row(row: Mapping[str, np.ndarray]) -> Schema:
    """The schema of one row as the first push gives it: each field's shape and dtype."""
    return Schema(**{key: (tuple(a.shape), a.dtype.str) for key, a in row.items()})
