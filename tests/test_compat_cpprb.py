"""cpprb's ReplayBuffer and PrioritizedReplayBuffer as cpprb users call them (shmbuffer.compat.cpprb)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.compat.cpprb import PrioritizedReplayBuffer, ReplayBuffer

ENV = {"obs": {"shape": 4}, "act": {}, "rew": {}, "next_obs": {"shape": 4}, "done": {}}


@pytest.fixture
def made(name: str) -> Iterator[list[Any]]:
    out: list[Any] = []
    yield out
    for rb in out:
        rb.close()


def test_replay_buffer_as_cpprb(made: list[Any], name: str) -> None:
    rb = ReplayBuffer(32, ENV, name=name, seed=0)
    made.append(rb)
    assert rb.add(obs=np.zeros(4), act=1, rew=1.0, next_obs=np.ones(4), done=0) == 0
    first = rb.add(obs=np.arange(40).reshape(10, 4), act=np.arange(10), rew=np.arange(10), next_obs=np.ones((10, 4)),
                   done=np.zeros(10))
    assert first == 1 and rb.get_stored_size() == 11 and rb.get_buffer_size() == 32 and rb.get_next_index() == 11
    sample = rb.sample(64)
    assert set(sample) == {"obs", "act", "rew", "next_obs", "done", "indexes"}
    assert sample["obs"].shape == (64, 4) and sample["act"].shape == (64, 1) and sample["rew"].dtype == np.float32
    assert (sample["act"][:, 0] == np.where(sample["indexes"] == 0, 1, sample["indexes"] - 1)).all()
    every = rb.get_all_transitions()
    assert every["obs"].shape == (11, 4) and set(every) == set(ENV)
    shuffled = rb.get_all_transitions(shuffle=True)
    assert sorted(shuffled["act"][:, 0].tolist()) == sorted(every["act"][:, 0].tolist())
    rb.on_episode_end()
    rb.clear()
    assert rb.get_stored_size() == 0 and not rb.is_Nstep()
    assert rb.add(obs=np.zeros((0, 4)), act=np.zeros(0), rew=np.zeros(0), next_obs=np.zeros((0, 4)),
                  done=np.zeros(0)) is None  # an empty push writes no row


def test_prioritized_weights_follow_the_calls_beta(made: list[Any], name: str) -> None:
    rb = PrioritizedReplayBuffer(64, ENV, alpha=0.7, eps=1e-4, name=name, seed=0)
    made.append(rb)
    rows = {"obs": np.zeros((8, 4)), "act": np.arange(8), "rew": np.zeros(8), "next_obs": np.zeros((8, 4)),
            "done": np.zeros(8)}
    rb.add(priorities=np.arange(1, 9, dtype=np.float64), **rows)
    assert rb.get_max_priority() == 8.0
    for beta in (0.0, 0.4, 1.0):
        got = rb.sample(256, beta=beta)
        p = got["act"][:, 0] + 1.0  # row i has priority i + 1
        leaf = (p + 1e-4) ** 0.7
        want = (leaf / ((1 + 1e-4) ** 0.7)) ** -beta
        assert np.allclose(got["weights"], want, rtol=1e-5), beta
    got = rb.sample(4)
    rb.update_priorities(got["indexes"], np.full(4, 100.0))
    assert rb.get_max_priority() == 100.0
    with pytest.raises(ValueError, match="beta must be in"):
        rb.sample(4, beta=2.0)


def test_refusals_name_the_way(name: str) -> None:
    with pytest.raises(sb.UnknownKeyword, match=r"n_step=3"):
        ReplayBuffer(32, ENV, Nstep={"size": 3, "gamma": 0.99}, name=name)
    with pytest.raises(sb.UnknownKeyword, match="/dev/shm"):
        ReplayBuffer(32, ENV, mmap_prefix="x", name=name)
    with pytest.raises(ValueError, match="env_dict is required"):
        ReplayBuffer(32, name=name)
    with pytest.raises(TypeError, match="observation_space"):
        ReplayBuffer(32, ENV, observation_space=None, name=name)


def test_explorers_share_the_rows(made: list[Any], name: str) -> None:
    """cpprb's MPReplayBuffer: the facade pickles as its handle, an explorer adds to the same rows."""
    rb = ReplayBuffer(32, ENV, default_dtype=np.float64, name=name)
    made.append(rb)
    explorer = pickle.loads(pickle.dumps(rb))
    try:
        explorer.add(obs=np.ones(4), act=1, rew=2.0, next_obs=np.ones(4), done=1)
    finally:
        explorer.buffer.close()
    assert rb.get_stored_size() == 1 and rb.sample(1)["rew"].dtype == np.float64
    assert len(pickle.dumps(rb)) < 200  # the handle, not the rows


def test_next_of_and_stack_compress(made: list[Any], name: str) -> None:
    env = {"obs": {"shape": (3, 3, 2), "dtype": np.uint8}, "next_obs": {"shape": (3, 3, 2), "dtype": np.uint8},
           "act": {}, "done": {}}
    rb = ReplayBuffer(32, env, next_of="obs", stack_compress="obs", name=name)
    made.append(rb)
    frames = [np.full((3, 3, 1), t, np.uint8) for t in range(6)]
    stack = [np.concatenate([frames[max(t - 1, 0)], frames[t]], axis=-1) for t in range(6)]
    for t in range(4):
        rb.add(obs=stack[t], next_obs=stack[t + 1], act=t, done=t == 3)
    got = rb.sample(64)
    t = got["act"][:, 0].astype(int)
    assert set(t.tolist()) == {0, 1, 2, 3}
    assert all(np.array_equal(got["obs"][i], stack[t[i]]) and np.array_equal(got["next_obs"][i], stack[t[i] + 1])
               for i in range(64))


@pytest.mark.parametrize("next_of", [None, "obs"])
def test_get_next_index_is_the_slot_of_the_next_row(next_of: str | None, made: list[Any], name: str) -> None:
    """``get_next_index`` is where the next ``add`` writes, as cpprb's: 0 again after ``clear``,
    and with ``next_of`` past the rows holding episodes' final observations (it counted rows ever
    inserted: 5 after a clear of 5 rows, then 7 for a row written at slot 2)."""
    rb = ReplayBuffer(8, ENV, next_of=next_of, name=name)
    made.append(rb)

    def add(ts: range, done_at: int = -1) -> int | None:
        t = np.array(list(ts), np.float32)
        return rb.add(obs=np.repeat(t[:, None], 4, 1), act=t, rew=t, next_obs=np.repeat(t[:, None] + 1, 4, 1),
                      done=t == done_at)

    add(range(5), done_at=4)
    rb.clear()
    assert rb.get_next_index() == 0
    add(range(2), done_at=1)  # with next_of the episode's end takes a slot of its own
    slots = rb.buffer.ring.slots(np.array([rb.buffer.ring.bounds()[1][0] - 1]))
    assert rb.get_next_index() == (int(slots[0]) + 1) % 8 == (3 if next_of else 2)
