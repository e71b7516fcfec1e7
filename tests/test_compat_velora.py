"""Velora's buffer guide (seed document 002) on ``shmbuffer.compat.velora``: its code blocks with
only their import lines changed, checked against what the guide says they do."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer.compat.velora import BatchExperience, ReplayBuffer
from shmbuffer.shm import segment

from .conftest import run_seed

IMPORTS = {
    "from velora.buffer import ReplayBuffer": "from shmbuffer.compat.velora import ReplayBuffer",
    "from velora.utils import set_device": "from shmbuffer.compat.velora import set_device",
    "from velora.models import NeuroFlow": "from tests.test_compat_velora import NeuroFlow",
}


def run(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    return run_seed(code, ns, IMPORTS, "<seed 002>")


@pytest.fixture
def ns() -> Iterator[dict[str, Any]]:
    space: dict[str, Any] = {}
    yield space
    for value in list(space.values()):
        if isinstance(value, ReplayBuffer):
            value.close()
        buffer = getattr(value, "buffer", None)
        if isinstance(buffer, ReplayBuffer):
            buffer.close()


class NeuroFlow:
    """A stand-in for Velora's agent: what the buffer guide's full example touches."""

    def __init__(self, env_id: str, hidden: int, capacity_hint: int, device: Any = None) -> None:
        import gymnasium as gym

        self.env = gym.make(env_id)
        self.state_dim = int(self.env.observation_space.shape[0])
        self.action_dim = 1
        self.device = device

        class Actor:
            hidden_size = hidden

        self.actor = Actor()
        self.buffer = ReplayBuffer(100_000, self.state_dim, self.action_dim, hidden, device=device)


def test_create_with_its_dims(ns: dict[str, Any]) -> None:
    run("""
        from velora.buffer import ReplayBuffer
        from velora.utils import set_device

        device = set_device()
        buffer = ReplayBuffer(
            capacity=100_000,
            state_dim=11,
            action_dim=3,
            hidden_dim=8,
            device=device
        )
    """, ns)
    buffer: ReplayBuffer = ns["buffer"]
    assert len(buffer) == 0 and buffer.buffer.schema["states"].shape == (11,)
    with pytest.raises(ValueError, match=r"states has shape \(1, 4\), expected 11 values"):
        buffer.add(torch.zeros((1, 4)), torch.zeros(3), 2.0, torch.zeros((1, 4)), False)


def test_add_add_multi_and_sample(ns: dict[str, Any]) -> None:
    # the guide's items: a (1, 4) state with a scalar action, so state_dim=4 and action_dim=1
    run("""
        from velora.buffer import ReplayBuffer
        buffer = ReplayBuffer(capacity=100_000, state_dim=4, action_dim=1, hidden_dim=8, device="cpu")
    """, ns)
    run("""
        import torch

        exp = (
            torch.zeros((1, 4)),
            torch.tensor((1.)),
            2.,
            torch.zeros((1, 4)),
            False,
        )

        buffer.add(*exp)
        buffer.add(
            torch.zeros((1, 4)),
            torch.tensor((1.)),
            2.,
            torch.zeros((1, 4)),
            False,
        )
    """, ns)
    assert len(ns["buffer"]) == 2
    run("""
        import torch

        exp = (
            torch.zeros((5, 4)),
            torch.ones((5, 1)),
            torch.ones((5, 1)),
            torch.zeros((5, 4)),
            torch.zeros(5, 1),
        )

        buffer.add_multi(*exp)
        buffer.add_multi(
            torch.zeros((5, 4)),
            torch.ones((5, 1)),
            torch.ones((5, 1)),
            torch.zeros((5, 4)),
            torch.zeros(5, 1),
        )
    """, ns)
    buffer: ReplayBuffer = ns["buffer"]
    assert len(buffer) == 12
    with pytest.raises(ValueError, match="Available: 12, Requested: 128"):
        run("batch = buffer.sample(batch_size=128)", ns)          # "only after we have enough experience"
    batch = buffer.sample(batch_size=12)
    assert isinstance(batch, BatchExperience)
    for item in (batch.states, batch.actions, batch.rewards, batch.next_states, batch.dones, batch.hiddens):
        assert isinstance(item, torch.Tensor) and item.dim() == 2 and item.shape[0] == 12
    assert set(batch.rewards.flatten().tolist()) <= {1.0, 2.0}                  # drawn with replacement
    assert buffer.buffer.get(slice(None)).rewards.flatten().tolist() == [2.0] * 2 + [1.0] * 10
    gamma, target_q = 0.99, torch.ones(12, 1)
    target_q = batch.rewards + (1 - batch.dones) * gamma * target_q   # the guide's calculation
    assert target_q.shape == (12, 1)


def test_full_example(ns: dict[str, Any]) -> None:
    run("""
        from velora.utils import set_device
        from velora.models import NeuroFlow

        import torch

        device = set_device()

        agent = NeuroFlow("CartPole-v1", 20, 128, device=device)

        # Warm with at least 5 samples - can go over!
        agent.buffer.warm(agent, 5, num_envs=2)

        # Single experience
        exp = (
            torch.zeros(agent.state_dim, device=device),
            torch.tensor((1.), device=device),
            2.,
            torch.zeros(agent.state_dim, device=device),
            False,
            torch.zeros(agent.actor.hidden_size, device=device),
        )
        agent.buffer.add(*exp)

        # 3 more samples
        exp = (
            torch.zeros((3, agent.state_dim), device=device),
            torch.ones((3, 1), device=device),
            torch.ones((3, 1), device=device),
            torch.zeros((3, agent.state_dim), device=device),
            torch.ones((3, 1), device=device),
            torch.zeros((3, agent.actor.hidden_size), device=device),
        )
        agent.buffer.add_multi(*exp)

        # Get a batch
        batch = agent.buffer.sample(batch_size=5)

        size = len(agent.buffer)  # 10
    """, ns)
    assert ns["size"] == 10                      # 3 warm steps of 2 envs, 1 and 3 more
    assert ns["batch"].states.shape == (5, 4)


def test_save_and_load(ns: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run("""
        from velora.buffer import ReplayBuffer

        buffer = ReplayBuffer(100, 11, 3, 8, device="cpu")

        buffer.save(
            'checkpoints/nf/CartPole_100',
            prefix="buffer_" # (1)
        )
    """, ns)
    assert (tmp_path / "checkpoints/nf/CartPole_100/buffer_metadata.json").exists()
    first = ns["buffer"]
    run("""
        import json
        from pathlib import Path
        from velora.buffer import ReplayBuffer

        root_path = 'checkpoints/nf/CartPole_100'

        with Path(root_path, 'buffer_metadata.json').open("r") as f:
            metadata = json.load(f)

        buffer = ReplayBuffer.load(Path(root_path, 'buffer_state'), metadata)
        print(buffer.metadata())
    """, ns)
    first.close()
    assert ns["buffer"].metadata() == {"capacity": 100, "state_dim": 11, "action_dim": 3, "hidden_dim": 8,
                                       "position": 0, "size": 0, "device": "cpu"}
    # with rows: they come back, and the metadata says where the next one goes
    with ReplayBuffer(100, 2, 1, 3) as full:
        full.add_multi(torch.arange(10.0).reshape(5, 2), torch.ones(5, 1), torch.arange(5.0), torch.zeros(5, 2),
                       torch.zeros(5, 1))
        full.save(tmp_path / "again", prefix="run_")
        meta = full.metadata()
    with ReplayBuffer.load(tmp_path / "again" / "run_state", meta) as back:
        assert back.metadata() == meta and meta["position"] == 5 and meta["size"] == 5
        assert back.buffer.get(slice(None)).rewards.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert back.sample(5).states.shape == (5, 2)
        assert np.array_equal(back.buffer.get(slice(None)).states, np.arange(10.0).reshape(5, 2))
        back.buffer.clear()  # the next row goes to slot 0 again (not rows ever inserted modulo the capacity)
        assert back.metadata()["position"] == 0
        back.add_multi(torch.zeros(3, 2), torch.ones(3, 1), torch.zeros(3), torch.zeros(3, 2), torch.zeros(3, 1))
        assert back.metadata()["position"] == 3 and back.metadata()["size"] == 3


def test_load_checks_the_metadata_against_the_save(tmp_path: Path) -> None:
    """The metadata sizes the buffer's adds and ``metadata()``: one that does not describe the save
    (hand-edited, or another save's) is refused, naming both, and leaves nothing in shared memory."""
    buffer = ReplayBuffer(10, 3, 2, 4)
    try:
        buffer.add(np.zeros(3), np.zeros(2), 1.0, np.ones(3), False)
        buffer.save(tmp_path)
        good = buffer.metadata()
    finally:
        buffer.close()
    for key, value in (("state_dim", 5), ("hidden_dim", 0), ("capacity", 20)):
        with pytest.raises(ValueError, match=r"the metadata says capacity .*the save at .* holds capacity 10"):
            ReplayBuffer.load(tmp_path / "buffer_state", {**good, key: value}, name=f"v{os.getpid()}-{key}")
        assert not os.path.exists(segment.path_of(f"v{os.getpid()}-{key}"))
    back = ReplayBuffer.load(tmp_path / "buffer_state", good)
    try:
        assert len(back) == 1 and back.metadata() == good
    finally:
        back.close()
