"""cpprb's ``ReplayBuffer(size, env_dict)`` and ``PrioritizedReplayBuffer``, on a shared-memory
``shmbuffer.ReplayBuffer``.

::

    from shmbuffer.compat.cpprb import PrioritizedReplayBuffer, ReplayBuffer

    rb = ReplayBuffer(100_000, {"obs": {"shape": 4}, "act": {"shape": 1}, "rew": {}, "next_obs": {"shape": 4},
                                "done": {}})
    rb.add(obs=o, act=a, rew=r, next_obs=o2, done=d)      # one row, or k rows with a leading dimension
    sample = rb.sample(32)                                # {"obs": (32, 4), ..., "indexes": (32,)}
    rb.get_stored_size(); rb.get_all_transitions(); rb.clear()

cpprb's names, argument order, defaults and return types: ``add(**fields)`` returns the first
row's index (our id; ``None`` for an empty push), ``sample(n)`` a dict of arrays in cpprb's shapes
(a field of the default shape ``1`` comes back ``(n, 1)``) with ``"indexes"``, and with
``PrioritizedReplayBuffer`` ``"weights"`` for the ``beta`` of the call: the buffer's sampler is
``Prioritized(alpha, beta=1, eps)``, whose weights ``(p_i / p_min)^-1`` raised to ``beta`` are
cpprb's ``(N P(i))^-beta`` normalised by their maximum. ``next_of`` and ``stack_compress`` store
observations once (``frames.py``; cpprb's stacks are on the last axis); ``Nstep`` is refused with
the call that does it here (n-step returns at sample time). The shared buffer is ``buffer``; the
facade pickles as its handle, so explorer processes (cpprb's ``MPReplayBuffer``) get one attached
to the same rows. What differs from cpprb: docs/migration/cpprb.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer as _Core
from ..errors import UnknownKeyword
from ..hints import keyword_error, page
from ..protocol import by_position
from ..sampling.samplers import Prioritized
from ..schema import Schema
from . import Facade

__all__ = ["PrioritizedReplayBuffer", "ReplayBuffer"]


class ReplayBuffer(Facade):
    """cpprb's ``ReplayBuffer(size, env_dict, next_of=None, stack_compress=None)`` (see the module
    docstring). ``name`` and ``seed`` are ours: the block's name in ``/dev/shm``, the sampling seed."""

    buffer: _Core

    def __init__(self, size: int, env_dict: Mapping[str, Any] | None = None, *, next_of: Any = None,
                 stack_compress: Any = None, default_dtype: Any = None, Nstep: Any = None, mmap_prefix: Any = None,
                 name: str | None = None, seed: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise keyword_error("ReplayBuffer", kwargs)
        if Nstep:
            raise UnknownKeyword(
                "ReplayBuffer(Nstep=...): n-step returns are made at sample time here, from the stored 1-step "
                "rows: make a shmbuffer.ReplayBuffer(env_dict, size, episodes=True) and sample(n, n_step=3, "
                f"gamma=0.99, fields={{'reward': 'rew'}}). See {page('cpprb')}.")
        if mmap_prefix is not None:
            raise UnknownKeyword(f"ReplayBuffer(mmap_prefix=...): the rows live in /dev/shm here. See {page('cpprb')}.")
        if not isinstance(env_dict, Mapping) or not env_dict:
            raise ValueError(f"ReplayBuffer: env_dict is required, {{name: {{'shape': ..., 'dtype': ...}}}}, got {env_dict!r}")
        if default_dtype is not None:  # for the fields that name no dtype
            env_dict = {k: {"dtype": default_dtype, **(v or {})} for k, v in env_dict.items()}
        schema = Schema(env_dict)
        self.buffer = _Core(schema, size, sampler=self._sampler(), next_of=next_of,
                            stack=_stacks(schema, stack_compress), name=name, seed=seed)

    def _sampler(self) -> Any:
        from ..sampling.samplers import Uniform

        return Uniform()

    @classmethod
    def attached(cls, handle: Any) -> ReplayBuffer:
        """The facade over the buffer ``handle`` names, attached in this process (its pickles)."""
        self = cls.__new__(cls)
        self.buffer = _Core.attach(handle)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).attached, (self.buffer.handle,))

    def add(self, **kwargs: Any) -> int | None:
        """Push one row, or ``k`` rows with a leading dimension; the first row's index (its id)."""
        ids = self.buffer.push(**kwargs)
        return int(ids[0]) if ids.size else None

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        """``batch_size`` rows drawn uniformly, as cpprb's dict: each field and ``"indexes"``."""
        batch = self.buffer.sample(batch_size)
        out = {name: np.asarray(batch[name]) for name in self.buffer.schema.names}
        out["indexes"] = np.asarray(batch.index)
        return out

    def get_all_transitions(self, shuffle: bool = False) -> dict[str, np.ndarray]:
        """Every row held, oldest first (``shuffle``: in a random order), as a dict of the fields."""
        rows = self.buffer.export()
        out = {name: rows[name] for name in self.buffer.schema.names}
        if shuffle:
            order = self.buffer.rng.permutation(rows["index"].size)
            out = {name: a[order] for name, a in out.items()}
        return out

    def get_stored_size(self) -> int:
        """The rows held (``len(buffer)``)."""
        return len(self.buffer)

    def get_buffer_size(self) -> int:
        """The capacity."""
        return self.buffer.capacity

    def get_next_index(self) -> int:
        """Where the next row goes: the slot of the buffer's next row (0 again after ``clear``; with
        ``next_of`` rows holding episodes' final observations take slots too)."""
        return by_position.next_slot(self.buffer)

    def clear(self) -> None:
        """Forget every row."""
        self.buffer.clear()

    def on_episode_end(self) -> None:
        """Nothing to do: an episode ends at a row whose ``done`` is set (``next_of``/``stack_compress``
        start the next episode there)."""

    def is_Nstep(self) -> bool:
        """cpprb's: ``False``, n-step returns are made at sample time (the module docstring)."""
        return False


class PrioritizedReplayBuffer(ReplayBuffer):
    """cpprb's ``PrioritizedReplayBuffer(size, env_dict, alpha=0.6, eps=1e-4)``: ``add(priorities=p,
    **fields)``, ``sample(n, beta=0.4)`` with ``"weights"``, ``update_priorities(indexes,
    priorities)``, ``get_max_priority()``."""

    def __init__(self, size: int, env_dict: Mapping[str, Any] | None = None, *, alpha: float = 0.6,
                 eps: float = 1e-4, check_for_update: bool = False, **kwargs: Any) -> None:
        self._alpha, self._eps = alpha, eps
        super().__init__(size, env_dict, **kwargs)

    def _sampler(self) -> Any:
        return Prioritized(alpha=self._alpha, beta=1.0, eps=self._eps)

    def add(self, priorities: Any = None, **kwargs: Any) -> int | None:
        """Push rows, with their priorities (else the largest given so far); the first row's index."""
        ids = self.buffer.push(priority=priorities, **kwargs)
        return int(ids[0]) if ids.size else None

    def sample(self, batch_size: int, beta: float = 0.4) -> dict[str, np.ndarray]:
        """``batch_size`` rows in proportion to their priorities, with ``"indexes"`` and the
        importance ``"weights"`` for ``beta``."""
        if not 0 <= beta <= 1:
            raise ValueError(f"sample: beta must be in [0, 1], got {beta!r}")
        batch = self.buffer.sample(batch_size)
        out = {name: np.asarray(batch[name]) for name in self.buffer.schema.names}
        out["indexes"] = np.asarray(batch.index)
        out["weights"] = np.power(np.asarray(batch.weight, np.float64), beta).astype(np.float32)
        return out

    def update_priorities(self, indexes: Any, priorities: Any) -> None:
        """Set the rows' priorities (rows overwritten since they were sampled are left alone)."""
        self.buffer.update_priorities(indexes, priorities)

    def get_max_priority(self) -> float:
        """The largest priority given so far."""
        prios = self.buffer.priorities
        assert prios is not None
        return float(prios.max_priority)


def _stacks(schema: Schema, stack_compress: Any) -> dict[str, tuple[int, int]] | None:
    """cpprb's ``stack_compress`` (a field, or several): frames on the field's last axis."""
    if stack_compress is None:
        return None
    names = [stack_compress] if isinstance(stack_compress, str) else list(stack_compress)
    return {n: (schema[n].shape[-1], -1) for n in names}
