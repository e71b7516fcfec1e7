"""Velora's ``ReplayBuffer(capacity, state_dim, action_dim, hidden_dim, device)``, on a shared-memory
``shmbuffer.ReplayBuffer``.

::

    from shmbuffer.compat.velora import ReplayBuffer, set_device

    buffer = ReplayBuffer(capacity=100_000, state_dim=11, action_dim=3, hidden_dim=8, device=set_device())
    buffer.add(state, action, reward, next_state, done)            # hidden optional (zeros)
    buffer.add_multi(states, actions, rewards, next_states, dones)  # a leading dimension
    batch = buffer.sample(batch_size=128)                           # BatchExperience on the device

The schema comes from the constructor: ``states`` and ``next_states`` ``(state_dim,)``, ``actions``
``(action_dim,)``, ``rewards`` and ``dones`` ``(1,)``, ``hiddens`` ``(hidden_dim,)``, all float32, so a
``BatchExperience`` holds ``(batch_size, features)`` tensors as Velora's does. A value of the right
size in any shape is taken (a ``(1, 4)`` state is one row of 4, a scalar action one row of an
``action_dim`` of 1); any other size raises ``ValueError`` naming the item. ``sample`` raises
``ValueError`` while fewer than ``batch_size`` rows are held, as Velora does.

``save(dirpath, prefix="buffer_")`` writes ``{prefix}metadata.json`` (Velora's metadata) and the
rows as a shmbuffer save in the directory ``{prefix}state`` (``shmbuffer.save``: a
``rows.safetensors`` and a ``meta.json``) inside ``dirpath``; ``ReplayBuffer.load(Path(dirpath,
"buffer_state"), metadata)`` reads them back, as Velora's code calls it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import persistence
from ..buffer import ReplayBuffer as _Core
from ..protocol import by_position
from ..schema import Schema
from . import Facade, numpy_of

__all__ = ["BatchExperience", "ReplayBuffer", "set_device"]

ITEMS = ("states", "actions", "rewards", "next_states", "dones", "hiddens")


def set_device(device: str = "auto") -> Any:
    """Velora's ``set_device``: CUDA when available, else the CPU (a ``torch.device``)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


@dataclass
class BatchExperience:
    """A batch of ``(batch_size, features)`` tensors on the buffer's device."""

    states: Any
    actions: Any
    rewards: Any
    next_states: Any
    dones: Any
    hiddens: Any


class ReplayBuffer(Facade):
    """Velora's replay buffer (see the module docstring)."""

    buffer: _Core

    def __init__(self, capacity: int, state_dim: int, action_dim: int, hidden_dim: int, device: Any = None, *,
                 name: str | None = None, seed: int | None = None, _core: _Core | None = None) -> None:
        self.capacity = int(capacity)
        self.state_dim, self.action_dim, self.hidden_dim = int(state_dim), int(action_dim), int(hidden_dim)
        self.device = device if device is not None else "cpu"
        self.buffer = _core if _core is not None else _Core(self.schema(), self.capacity, name=name, seed=seed)
        """The ``shmbuffer.ReplayBuffer`` behind it."""

    def schema(self) -> Schema:
        """The fields: Velora's items, float32, ``(n, features)`` each."""
        dims = (self.state_dim, self.action_dim, 1, self.state_dim, 1, self.hidden_dim)
        return Schema(**{name: ((d,), "float32") for name, d in zip(ITEMS, dims, strict=True)})

    def _dims(self) -> tuple[int, ...]:
        return (self.state_dim, self.action_dim, 1, self.state_dim, 1, self.hidden_dim)

    def _rows(self, items: tuple[Any, ...], k: int | None, what: str) -> dict[str, np.ndarray]:
        if not 5 <= len(items) <= 6:
            raise TypeError(f"{what}: expected state, action, reward, next_state, done[, hidden], got {len(items)} items")
        out = {}
        for name, dim, value in zip(ITEMS, self._dims(), (*items, None)[:6], strict=True):
            a = np.zeros(((k or 1), dim), np.float32) if value is None else numpy_of(value).astype(np.float32)
            want = dim if k is None else k * dim
            if a.size != want:
                shape = f"({dim},)" if k is None else f"({k}, {dim})"
                raise ValueError(f"{what}: {name} has shape {a.shape}, expected {want} values {shape} for this buffer")
            out[name] = a.reshape(dim) if k is None else a.reshape(k, dim)
        return out

    def add(self, state: Any, action: Any, reward: Any, next_state: Any, done: Any, hidden: Any = None) -> None:
        """Add one experience (tensors, arrays or numbers; ``hidden`` defaults to zeros)."""
        self.buffer.push(self._rows((state, action, reward, next_state, done, hidden), None, "add"))

    def add_multi(self, state: Any, action: Any, reward: Any, next_state: Any, done: Any, hidden: Any = None) -> None:
        """Add ``k`` experiences given with a leading dimension."""
        k = int(numpy_of(state).shape[0])
        rows = self._rows((state, action, reward, next_state, done, hidden), k, "add_multi")
        step = self.buffer.lane_capacity
        for i in range(0, k, step):
            self.buffer.push({n: a[i:i + step] for n, a in rows.items()})

    def sample(self, batch_size: int) -> BatchExperience:
        """``batch_size`` experiences as tensors on the device; ``ValueError`` with too few held."""
        held = len(self)
        if held < batch_size:
            raise ValueError(f"Buffer does not contain enough experiences. Available: {held}, Requested: {batch_size}")
        batch = self.buffer.sample(batch_size).to(self.device)
        return BatchExperience(*(batch[name] for name in ITEMS))

    def warm(self, agent: Any, n_samples: int, num_envs: int = 8) -> None:
        """Fill with at least ``n_samples`` experiences from ``num_envs`` copies of the agent's
        environment (``agent.env``, a Gymnasium env, or ``agent.env_id``), acting with
        ``agent.predict(states, hidden, train_mode=True)`` when the agent has it, else at random."""
        import gymnasium as gym
        import torch

        env = getattr(agent, "env", None)
        env_id = getattr(agent, "env_id", None) or (env.spec.id if env is not None and env.spec is not None else None)
        if env_id is None:
            raise ValueError("warm: the agent has no env (a Gymnasium env) or env_id")
        envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="sync")
        try:
            states, _ = envs.reset()
            hidden = None
            predict = getattr(agent, "predict", None)
            while len(self) < n_samples:
                if predict is not None:
                    actions, hidden = predict(torch.as_tensor(states, dtype=torch.float32, device=self.device), hidden,
                                              train_mode=True)
                    step_actions = numpy_of(actions)
                else:
                    step_actions = envs.action_space.sample()
                next_states, rewards, terminated, truncated, _ = envs.step(step_actions)
                dones = np.logical_or(terminated, truncated)
                h = None if hidden is None else numpy_of(hidden).reshape(num_envs, -1)
                self.add_multi(states, np.asarray(step_actions).reshape(num_envs, -1), np.asarray(rewards).reshape(-1, 1),
                               next_states, dones.reshape(-1, 1), h)
                states = next_states
        finally:
            envs.close()

    def __len__(self) -> int:
        return len(self.buffer)

    def metadata(self) -> dict[str, Any]:
        """Velora's metadata: capacity, dims, the next write position, size, device."""
        return {"capacity": self.capacity, "state_dim": self.state_dim, "action_dim": self.action_dim,
                "hidden_dim": self.hidden_dim, "position": self._position(),
                "size": len(self), "device": str(self.device)}

    def _position(self) -> int:
        """The slot the next row goes to: 0 again after ``clear()`` (not rows ever inserted modulo
        the capacity)."""
        return by_position.next_slot(self.buffer)

    def save(self, dirpath: str | os.PathLike[str], prefix: str = "buffer_") -> None:
        """Write ``{prefix}metadata.json`` and the save ``{prefix}state/`` into ``dirpath``."""
        folder = Path(dirpath)
        folder.mkdir(parents=True, exist_ok=True)
        persistence.save(self.buffer, folder / f"{prefix}state", overwrite=True)
        with (folder / f"{prefix}metadata.json").open("w") as f:
            json.dump(self.metadata(), f, indent=2)

    @classmethod
    def load(cls, state_path: str | os.PathLike[str], metadata: dict[str, Any], *, name: str | None = None) -> ReplayBuffer:
        """A new buffer holding what ``save`` wrote (``state_path`` is ``dirpath/{prefix}state``)."""
        core = persistence.load(Path(state_path), _Core, name=name)
        try:
            made = cls(metadata["capacity"], metadata["state_dim"], metadata["action_dim"], metadata["hidden_dim"],
                       metadata.get("device", "cpu"), _core=core)
            # the metadata describes the rows: trusted unchecked, it would size later adds (and
            # metadata()) wrong, and an add would be refused for a shape the save never had
            held = [(f.name, f.shape, f.dtype) for f in core.schema]
            dims = (made.state_dim, made.action_dim, 1, made.state_dim, 1, made.hidden_dim)
            if made.capacity != core.capacity or held != [(n, (d,), np.float32) for n, d in zip(ITEMS, dims, strict=True)]:
                raise ValueError(
                    f"ReplayBuffer.load: the metadata says capacity {made.capacity} and dims (state {made.state_dim}, "
                    f"action {made.action_dim}, hidden {made.hidden_dim}), the save at {state_path} holds capacity "
                    f"{core.capacity} and fields {', '.join(f'{f.name} {f.describe()}' for f in core.schema)}: "
                    "pass the metadata save() wrote with it")
            return made
        except BaseException:
            core.__exit__(None, None, None)
            raise

