"""Several learners on one buffer, beyond rows (``attach(..., rank=, world_size=, seed=)``,
sampling/ranks.py): n-step returns, sequences, groups, episodes, hindsight relabelling, the device
copy (``DeviceReplay``, on the CPU here) and a ``Loader`` over it take the rank from the buffer:
the ranks' batches at a step, joined in rank order, are one process's (``world_size=1``) batch of
``n * world_size`` at that step, on a buffer whose rows are not being written."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.errors import EmptyBufferError
from shmbuffer.sampling.samplers import Prioritized

SCHEMA = sb.Schema(obs=((3,), "float32"), next_obs=((3,), "float32"), reward=((), "float32"), done=((), "bool"))
W = 3


def _filled(make: Any, name: str, lanes: int = 2, per: int = 120, **kw: Any) -> sb.ReplayBuffer:
    """Episodes of 3..9 rows in each lane (ids unique over lanes), every row its own values."""
    buf = make(SCHEMA, lanes * per, name=name, lanes=lanes, episodes=True, **kw)
    for lane in range(lanes):
        lengths = 3 + (np.arange(per) * 5 + lane) % 7
        episode = np.repeat(np.arange(per) * lanes + lane, lengths)[:per]
        k = np.arange(per, dtype=np.float32) + lane * 1000
        done = np.append(episode[1:] != episode[:-1], False)
        buf.push(obs=np.stack([k, k, k], 1), next_obs=np.stack([k + 1, k, k], 1), reward=k / 100, done=done,
                 lane=lane, episode=episode)
    if buf.options.sampler.prioritized:
        buf.update_priorities(buf.ring.held_ids(), np.random.default_rng(2).random(lanes * per) * 5 + 0.1)
    return buf


def _attach(name: str, w: int, seed: int = 17) -> list[sb.ReplayBuffer]:
    return [sb.ReplayBuffer.attach(name, rank=r, world_size=w, seed=seed) for r in range(w)]


def _close(things: list[Any]) -> None:
    for t in things:
        t.close()


def _same(parts: list[Any], whole: Any, keys: list[str]) -> None:
    """The parts joined in rank order are ``whole``, field by field (numpy or torch)."""
    def host(a: Any) -> np.ndarray:
        return a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else np.asarray(a)

    for key in keys:
        joined = np.concatenate([host(p[key]) for p in parts])
        assert np.array_equal(joined, host(whole[key])), key


@pytest.mark.parametrize("prioritized", [False, True])
def test_n_step_ranks_joined_equal_one_process(make: Any, name: str, prioritized: bool) -> None:
    _filled(make, name, **({"sampler": Prioritized()} if prioritized else {}))
    one, parts = _attach(name, 1)[0], _attach(name, W)
    try:
        for _ in range(3):
            whole = one.sample(8 * W, n_step=3, gamma=0.5)
            got = [b.sample(8, n_step=3, gamma=0.5) for b in parts]
            _same(got, whole, ["index", "reward", "next_obs", "done", "steps"] + (["weight"] if prioritized else []))
        assert [b.ranked.step for b in [one, *parts]] == [3] * (W + 1)  # type: ignore[union-attr]
    finally:
        _close([one, *parts])


@pytest.mark.parametrize("time_major", [False, True])
def test_sequences_ranks_joined_equal_one_process(make: Any, name: str, time_major: bool) -> None:
    _filled(make, name)
    one, parts = _attach(name, 1)[0], _attach(name, W)
    try:
        for _ in range(3):
            whole = one.sample_sequences(4 * W, 5, burn_in=2, time_major=time_major)
            got = [b.sample_sequences(4, 5, burn_in=2, time_major=time_major) for b in parts]
            if time_major:  # (T, n, ...): the ranks' windows are columns
                for key in ("index", "mask", "obs"):
                    assert np.array_equal(np.concatenate([g[key] for g in got], axis=1), whole[key])
            else:
                _same(got, whole, ["index", "mask", "obs", "reward"])
            assert not whole.mask.all()  # windows cut at their episodes' ends: the mask is part of it
    finally:
        _close([one, *parts])


@pytest.mark.parametrize("kw", [{}, {"ordered": False}, {"replace": False}, {"short": True}, {"ordered": False, "replace": False}])
def test_groups_ranks_joined_equal_one_process(make: Any, name: str, kw: dict[str, Any]) -> None:
    rows = _filled(make, name).export()
    episode_of = dict(zip(rows["index"].tolist(), rows["episode"].tolist(), strict=True))
    one, parts = _attach(name, 1)[0], _attach(name, W)
    try:
        for _ in range(3):
            whole = one.sample_groups(2 * W, 4, **kw)
            got = [b.sample_groups(2, 4, **kw) for b in parts]
            _same(got, whole, ["index", "obs"] + (["mask"] if kw.get("short") else []))
            if kw.get("replace") is False:  # distinct episodes over the ranks too
                episodes = [episode_of[int(i)] for g in got for i in g.index[:, 0]]
                assert len(set(episodes)) == len(episodes)
    finally:
        _close([one, *parts])


@pytest.mark.parametrize("replace", [False, True])
def test_episodes_ranks_joined_equal_one_process(make: Any, name: str, replace: bool) -> None:
    _filled(make, name)
    one, parts = _attach(name, 1)[0], _attach(name, W)
    try:
        for _ in range(2):
            whole = one.sample_episodes(2 * W, replace=replace)
            got = [e for b in parts for e in b.sample_episodes(2, replace=replace)]
            assert [e.index.tolist() for e in got] == [e.index.tolist() for e in whole]
            assert all(np.array_equal(a.obs, b.obs) for a, b in zip(got, whole, strict=True))
            if not replace:
                assert len({int(e.episode[0]) for e in got}) == len(got)  # distinct over the ranks
        assert [b.ranked.step for b in parts] == [2] * W  # type: ignore[union-attr]
    finally:
        _close([one, *parts])


def test_rank_refuses_more_distinct_groups_than_held_and_changes_nothing(make: Any, name: str) -> None:
    buf = _filled(make, name, per=20)  # 2 lanes of 20 rows: a handful of episodes
    parts = _attach(name, W)
    try:
        before = (dict(buf.stats), {k: v.copy() for k, v in buf.export().items()})
        with pytest.raises(EmptyBufferError, match=r"world_size"):
            parts[1].sample_groups(6, 2, replace=False)  # 18 distinct episodes in the global draw
        with pytest.raises(EmptyBufferError, match=r"world_size"):
            parts[1].sample_episodes(4)
        assert parts[1].ranked.step == 0  # type: ignore[union-attr]  # nothing drawn: the step stays
        assert buf.stats == before[0]
        assert all(np.array_equal(v, before[1][k]) for k, v in buf.export().items())
    finally:
        _close(parts)


# -- hindsight ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("prioritized", [False, True])
def test_hindsight_ranks_joined_equal_one_process(make: Any, name: str, strategy: str, prioritized: bool) -> None:
    from shmbuffer.hindsight import Hindsight
    from tests.test_her import GOAL, Plan, check, compute_reward, fill

    lanes = 2
    buf = make(GOAL, 400, name=name, lanes=lanes, episodes=True, **({"sampler": Prioritized()} if prioritized else {}))
    plans = [Plan(lane, lanes, 200) for lane in range(lanes)]
    for lane, plan in enumerate(plans):
        fill(buf, plan, lane, 0, int(plan.first[-1]))  # whole episodes only: no draw lands on a running one
    if prioritized:
        held = buf.ring.held_ids()
        buf.update_priorities(held, np.random.default_rng(3).random(held.size) + 0.1)
    spec = Hindsight(compute_reward, strategy=strategy, n_sampled_goal=2)
    one, parts = _attach(name, 1)[0], _attach(name, W)
    try:
        relabelled = 0
        for _ in range(4):
            whole = one.sample(10 * W, hindsight=spec)
            got = [b.sample(10, hindsight=spec) for b in parts]
            for g in got:
                check(g, lanes, strategy, plans)  # each rank's batch is a hindsight batch in its own right
            _same(got, whole, ["index", "relabelled", "goal", "desired_goal", "next_desired_goal", "reward"]
                  + (["weight"] if prioritized else []))
            relabelled += int(whole.relabelled.sum())
        assert relabelled == 4 * int(spec.her_ratio * 10 * W)  # the global batch's share, split over the ranks
    finally:
        _close([one, *parts])


# -- the device copy (CPU) -------------------------------------------------------------------------
@pytest.mark.parametrize("prioritized", [False, True])
def test_device_copies_ranks_joined_equal_one_process(make: Any, name: str, prioritized: bool) -> None:
    pytest.importorskip("torch")
    from shmbuffer.device import DeviceReplay

    _filled(make, name, **({"sampler": Prioritized()} if prioritized else {}))
    one, parts, twin = _attach(name, 1)[0], _attach(name, W), _attach(name, W)
    copies = [DeviceReplay(b, "cpu", refresher=False) for b in [one, *parts]]
    try:
        whole_copy, part_copies = copies[0], copies[1:]
        for _ in range(3):
            whole = whole_copy.sample(8 * W)
            got = [c.sample(8) for c in part_copies]
            _same(got, whole, ["index", "obs"] + (["weight"] if prioritized else []))
            host = [b.sample(8) for b in twin]  # the host's draw of the same rank, step
            if prioritized:  # drawn from the one tree on the host: the rows a host sample draws
                _same(host, whole, ["index", "weight"])
        whole = whole_copy.sample(8 * W, n_step=3, gamma=0.5)
        _same([c.sample(8, n_step=3, gamma=0.5) for c in part_copies], whole, ["index", "reward", "next_obs", "steps"])
        whole = whole_copy.sample_sequences(2 * W, 4, burn_in=1)
        _same([c.sample_sequences(2, 4, burn_in=1) for c in part_copies], whole, ["index", "mask", "obs"])
        assert [b.ranked.step for b in [one, *parts]] == [5] * (W + 1)  # type: ignore[union-attr]
    finally:
        _close(copies)
        _close([one, *parts, *twin])


def test_loader_over_a_device_copy_takes_the_rank(make: Any, name: str) -> None:
    pytest.importorskip("torch")
    from shmbuffer.device import DeviceReplay
    from shmbuffer.loader import Loader

    _filled(make, name)
    rank, twin = _attach(name, 2)[1], sb.ReplayBuffer.attach(name, rank=1, world_size=2, seed=17)
    copy = DeviceReplay(twin, "cpu", refresher=False)
    try:
        with Loader(rank, 16, device="cpu", batches=4, resident=True, background=False) as loader:
            assert loader.path == "resident"  # the device copy, not the host's sample
            got = [b.index.numpy() for b in loader]
        assert len(got) == 4
        assert all(np.array_equal(g, copy.sample(16).index.numpy()) for g in got)
        assert rank.ranked.step == 4  # type: ignore[union-attr]
    finally:
        copy.close()
        _close([rank, twin])
