"""Several buffers: groups created together, mixes by ratio, read-only expert buffers."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.loader import Loader
from shmbuffer.mixing import apportion

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]


@pytest.mark.parametrize("weights", [[0.75, 0.25], [1, 1, 1], [0.9, 0.1], [0.5, 0.0, 0.5]])
def test_shares_are_exact_and_unbiased(weights: list[float]) -> None:
    w = np.array(weights, float) / sum(weights)
    carry = np.zeros(len(w))
    rng = np.random.default_rng(0)
    total, given = 0, np.zeros(len(w))
    for _ in range(10_000):
        n = int(rng.integers(1, 300))
        counts = apportion(n, w, carry)
        assert counts.sum() == n and (counts >= 0).all()
        assert np.all(np.abs(counts - n * w) < 2)  # each batch within a row or so of its share
        total += n
        given += counts
        assert np.all(np.abs(given - total * w) < 1 + 1e-9)  # over all calls: less than one row
    assert given[np.array(weights) == 0].sum() == 0


def test_mix_takes_each_share_from_its_source(make: Make, name: str) -> None:
    agent = make(MUJOCO, capacity=1000, name=name + "a", seed=0)
    expert = make(MUJOCO, capacity=1000, name=name + "e", seed=1)
    agent.push(transition(0, 500))
    expert.push(transition(100_000, 200))
    mix = sb.Mix([(agent, 0.75), (expert, 0.25)])
    given = np.zeros(2)
    for _ in range(50):
        batch = mix.sample(30)
        seq = seq_of(batch)
        assert len(batch) == 30 and batch.source.dtype == np.int8
        assert np.array_equal(seq >= 100_000, batch.source == 1)  # each row from its source
        assert np.array_equal(np.where(batch.source == 1, seq - 100_000, seq), batch.index)
        given += np.bincount(batch.source, minlength=2)
    assert np.all(np.abs(given - 1500 * np.array([0.75, 0.25])) < 1)
    assert np.array_equal(batch.obs, np.concatenate([batch.obs[batch.source == 0], batch.obs[batch.source == 1]]))


def test_mix_priority_updates_go_home(make: Make, name: str) -> None:
    per = sb.Prioritized(alpha=1.0, eps=0.0)
    a = make(MUJOCO, capacity=100, name=name + "a", sampler=per, seed=0)
    b = make(MUJOCO, capacity=100, name=name + "b", sampler=per, seed=1)
    u = make(MUJOCO, capacity=100, name=name + "u", seed=2)  # uniform: updates skip it
    a.push(transition(0, 50))
    b.push(transition(1000, 50))
    u.push(transition(2000, 50))
    mixed = sb.Mix([(a, 1), (b, 1), (u, 1)]).sample(60)
    assert mixed.weight.shape == (60,) and (mixed.weight[mixed.source == 2] == 1).all()
    mix = sb.Mix([(a, 1), (b, 1)])
    batch = mix.sample(100, replace=False)  # every row of both sources
    keep = np.isin(batch.index, [7]) & (batch.source == 0) | np.isin(batch.index, [9]) & (batch.source == 1)
    assert mix.update_priorities(batch, keep.astype(float)) == 100
    assert sb.Mix([(a, 1), (u, 1)]).update_priorities(mixed, np.ones(60)) == int((mixed.source == 0).sum())
    a.update_priorities(np.arange(50), (np.arange(50) == 7).astype(float))
    for _ in range(5):
        again = mix.sample(100)
        assert set(again.index[again.source == 0]) == {7} and set(again.index[again.source == 1]) == {9}


def test_mix_priority_update_checks_every_priority_first(make: Make, name: str) -> None:
    """A bad priority for source 1's rows changes no source, source 0 included."""
    per = sb.Prioritized(alpha=1.0, eps=0.0)
    a = make(MUJOCO, capacity=64, name=name + "a", sampler=per, seed=0)
    b = make(MUJOCO, capacity=64, name=name + "b", sampler=per, seed=1)
    a.push(transition(0, 16))
    b.push(transition(100, 16))
    mix = sb.Mix([(a, 0.5), (b, 0.5)])
    batch = mix.sample(8)
    assert set(batch.source.tolist()) == {0, 1}
    before = [buf.priorities.tree.leaves.copy() for buf in (a, b)]  # type: ignore[union-attr]
    for bad in (np.nan, -1.0, np.inf):
        p = np.full(8, 50.0)
        p[batch.source == 1] = bad
        with pytest.raises(sb.FieldError, match="nothing was changed"):
            mix.update_priorities(batch, p)
        assert all(np.array_equal(buf.priorities.tree.leaves, old) for buf, old in zip((a, b), before, strict=True))  # type: ignore[union-attr]
    with pytest.raises(sb.FieldError, match=r"expected 8 values"):
        mix.update_priorities(batch, np.ones(7))
    assert mix.update_priorities(batch, np.full(8, 50.0)) == 8


def test_a_mix_with_a_prioritized_source_always_gives_weight(make: Make, name: str) -> None:
    """Also in a batch to which the prioritized source gave no row: every batch of a mix
    has the same keys."""
    agent = make(MUJOCO, capacity=64, name=name + "a", seed=0)
    expert = make(MUJOCO, capacity=64, name=name + "e", sampler=sb.Prioritized(), seed=1)
    agent.push(transition(0, 32))
    expert.push(transition(100, 32))
    mix = sb.Mix([(agent, 0.9), (expert, 0.1)])
    batches = [mix.sample(8) for _ in range(20)]
    assert any((b.source == 0).all() for b in batches)  # some batches have no expert row
    for b in batches:
        assert b.keys() == mix.sample(8).keys() and sorted(b.extras) == ["index", "source", "weight"]
        assert b.weight.dtype == np.float32 and b.weight.shape == (8,) and (b.weight[b.source == 0] == 1).all()
    other = make(MUJOCO, capacity=64, name=name + "o", seed=2)
    other.push(transition(200, 32))
    assert "weight" not in sb.Mix([(agent, 0.5), (other, 0.5)]).sample(8).extras  # no prioritized source


def test_a_short_source_waits_or_raises(make: Make, name: str) -> None:
    agent = make(MUJOCO, capacity=100, name=name + "a")
    expert = make(MUJOCO, capacity=100, name=name + "e")
    agent.push(transition(0, 100))
    expert.push(transition(500, 3))
    strict = sb.Mix([(agent, 0.5), (expert, 0.5)], on_short="raise")
    with pytest.raises(sb.EmptyBufferError, match=r"source 1 .* holds 3 rows, its share of this batch is 5"):
        strict.sample(10)
    assert np.array_equal(strict._carry, np.zeros(2))  # the refused batch took nothing
    patient = sb.Mix([(agent, 0.5), (expert, 0.5)], timeout=0.2)
    with pytest.raises(sb.WaitTimeout, match=r"after waiting 0\.2 s"):
        patient.sample(10)
    late = threading.Timer(0.3, lambda: expert.push(transition(600, 10)))
    late.start()
    patient.timeout = 10
    batch = patient.sample(10)
    late.join()
    assert np.bincount(batch.source).tolist() == [5, 5]


def test_mixed_schemas_share_their_common_fields(make: Make, name: str) -> None:
    other = sb.Schema(obs=((17,), "float32"), reward=((), "float32"), extra=((2,), "int8"))
    a = make(MUJOCO, capacity=10, name=name + "a")
    b = make(other, capacity=10, name=name + "b")
    a.push(transition(0, 5))
    b.push(obs=np.zeros((5, 17)), reward=np.ones(5), extra=np.zeros((5, 2), np.int8))
    batch = sb.Mix([(a, 1), (b, 1)]).sample(8)
    assert batch.keys() == ["obs", "reward", "index", "source"] and list(batch.fields) == ["obs", "reward"]
    c = make(sb.Schema(x=((), "int8")), capacity=10, name=name + "c")
    with pytest.raises(sb.SchemaError, match="share no field"):
        sb.Mix([(a, 1), (c, 1)])
    with pytest.raises(ValueError, match="weights must be finite"):
        sb.Mix([(a, -1), (b, 1)])


def test_loader_over_a_mix(make: Make, name: str) -> None:
    a = make(MUJOCO, capacity=100, name=name + "a")
    b = make(MUJOCO, capacity=100, name=name + "b")
    a.push(transition(0, 100))
    b.push(transition(1000, 100))
    with Loader(sb.Mix([(a, 3), (b, 1)]), 16, batches=4) as loader:
        got = list(loader)
    assert len(got) == 4
    for batch in got:
        assert batch.source.tolist() == [0] * 12 + [1] * 4


# -- groups -------------------------------------------------------------------------------------


def _push_into_group(handles: dict) -> None:
    with sb.Buffers.attach(handles) as group:
        group.push(transition(900, 2), to=["value"])


def test_buffers_created_and_pushed_together(name: str, procs: list) -> None:
    with sb.Buffers(policy=dict(schema=MUJOCO, capacity=10, max_use=1, name=name + "p"),
                    value=dict(schema=MUJOCO, capacity=40, name=name + "v")) as group:
        assert list(group) == ["policy", "value"] and group["policy"].options.max_use == 1
        ids = group.push(transition(0, 8))
        assert set(ids) == {"policy", "value"} and len(group["value"]) == 8
        group.push(**transition(8), to=["value"])
        assert len(group["policy"]) == 8 and len(group["value"]) == 9
        bad = transition(0, 2)
        bad["obs"] = np.zeros((2, 3))
        with pytest.raises(sb.FieldError):
            group.push(bad)
        assert len(group["policy"]) == 8 and len(group["value"]) == 9
        p = mp.get_context("spawn").Process(target=_push_into_group, args=(group.handles,))
        p.start()
        procs.append(p)
        p.join(60)
        assert p.exitcode == 0 and len(group["value"]) == 11
        assert seq_of(group["policy"].sample(8, replace=False)).size == 8
        with pytest.raises(sb.EmptyBufferError):  # each row of the policy buffer is used once
            group["policy"].sample(1)
        batch = group.mix({"policy": 0.0, "value": 1.0}).sample(4)
        assert (batch.source == 1).all()
    with pytest.raises(KeyError, match="no buffer 'x'"):
        group["x"]
    with pytest.raises(ValueError, match="needs a dict with schema and capacity"):
        sb.Buffers(a=dict(schema=MUJOCO))


# -- read-only expert buffers -----------------------------------------------------------------


def test_frozen_buffers(make: Make, name: str) -> None:
    expert = make(MUJOCO, capacity=50, name=name, sampler=sb.Prioritized())
    expert.push(transition(0, 20))
    expert.freeze()
    assert expert.frozen
    with pytest.raises(sb.ReadOnlyError, match="frozen"):
        expert.push(**transition(20))
    with pytest.raises(sb.ReadOnlyError):
        expert.clear()
    other = sb.ReplayBuffer.attach(expert.handle)
    try:
        assert other.frozen
        with pytest.raises(sb.ReadOnlyError):
            other.push(**transition(20))
        batch = other.sample(10)
        assert other.update_priorities(batch, np.ones(10)) == 10
    finally:
        other.close()
    assert len(expert) == 20 and expert.stats["inserted"] == 20


def test_group_push_is_all_or_nothing(name: str) -> None:
    with sb.Buffers(a=dict(schema=MUJOCO, capacity=10, episodes=True, name=name + "a"),
                    b=dict(schema=MUJOCO, capacity=4, episodes=True, name=name + "b")) as group:
        with pytest.raises(sb.CapacityError):
            group.push(transition(0, 5), episode=0)  # b holds 4: a must not take them either
        group["b"].freeze()
        with pytest.raises(sb.ReadOnlyError):
            group.push(transition(0, 2), episode=0)
        with pytest.raises(sb.FieldError, match="episode"):
            group.push(transition(0, 2), to=["a"])
        assert len(group["a"]) == 0 and len(group["b"]) == 0
        group.push(transition(0, 2), to=["a"], episode=[3, 3])
        assert len(group["a"]) == 2


def test_a_mix_refuses_what_it_cannot_sample(make: Make, name: str) -> None:
    """A source that is not a (buffer, weight) pair, and a timeout that is not seconds (a NaN one
    would make a short source's wait endless), are refused when the mix is made."""
    a = make(MUJOCO, capacity=10, name=name)
    a.push(transition(0, 5))
    for bad, what in (((np.zeros(3), 1.0), "ndarray"), ((a.handle, 1.0), "BufferHandle"), (a, "ReplayBuffer")):
        with pytest.raises(TypeError, match=rf"Mix: source 1: expected a \(ReplayBuffer, weight\) pair, got .*{what}"):
            sb.Mix([(a, 1.0), bad])  # type: ignore[list-item]
    for timeout in (float("nan"), "1", -1):
        with pytest.raises(ValueError, match="Mix: timeout: expected seconds"):
            sb.Mix([(a, 1.0)], timeout=timeout)  # type: ignore[arg-type]
    assert len(a) == 5 and a.stats["inserted"] == 5
