"""``shmbuffer.minari``: a buffer's episodes as a Minari dataset and back, and a dataset made by
Minari's own ``DataCollector`` read into a buffer, step for step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import shmbuffer as sb

minari = pytest.importorskip("minari")
pytest.importorskip("h5py")
import gymnasium as gym  # noqa: E402

from shmbuffer.minari import from_minari, to_minari  # noqa: E402
from shmbuffer.vector import RecordTransitions  # noqa: E402

Make = Callable[..., sb.ReplayBuffer]
pytestmark = [
    # Minari nags about metadata a test does not need (META below silences the rest)
    pytest.mark.filterwarnings("ignore:`eval_env` is set to None:UserWarning"),
    pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning"),
    # DataCollector.close() removes its TemporaryDirectory's folder with rmtree, so the object
    # warns when it is collected (minari 0.5.4)
    pytest.mark.filterwarnings("ignore:Implicitly cleaning up <TemporaryDirectory:ResourceWarning"),
]
META = {"author": "shmbuffer tests", "author_email": "tests@example.org", "code_permalink": "tests/test_minari.py",
        "description": "made by a test"}
"""What Minari warns about when it is missing (warnings are errors here)."""
CARTPOLE = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                     next_obs=((4,), "float32"), done=((), "bool"), truncated=((), "bool"))


@pytest.fixture(autouse=True)
def datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Minari's datasets under this test's own folder."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    return tmp_path


def collected(dataset_id: str, episodes: int) -> None:
    """A CartPole dataset made by Minari's ``DataCollector`` (a random policy, seeded)."""
    from minari import DataCollector

    env = DataCollector(gym.make("CartPole-v1", max_episode_steps=30))
    env.action_space.seed(0)
    for k in range(episodes):
        env.reset(seed=k)
        while True:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                break
    env.create_dataset(dataset_id=dataset_id, algorithm_name="random", **META)
    env.close()


def test_from_minari_holds_the_datacollector_steps(name: str) -> None:
    collected("cartpole/random-v0", 12)
    ds = minari.load_dataset("cartpole/random-v0")
    buf = from_minari("cartpole/random-v0", name=name, seed=0)
    try:
        assert len(buf) == ds.total_steps
        rows = sb.export(buf)
        at = 0
        for ep in ds.iterate_episodes():
            t = len(ep)
            assert np.array_equal(rows["obs"][at:at + t], ep.observations[:-1])
            assert np.array_equal(rows["next_obs"][at:at + t], ep.observations[1:])
            assert np.array_equal(rows["action"][at:at + t], ep.actions)
            assert np.array_equal(rows["reward"][at:at + t], ep.rewards.astype(np.float32))
            assert np.array_equal(rows["done"][at:at + t], ep.terminations)
            assert np.array_equal(rows["truncated"][at:at + t], ep.truncations)
            assert (rows["episode"][at:at + t] == ep.id).all()
            at += t
        assert at == len(buf) and ds.total_episodes == 12
    finally:
        buf.close()
        buf.unlink()


def test_minari_round_trip_is_equal(name: str) -> None:
    collected("cartpole/random-v0", 9)
    buf = from_minari("cartpole/random-v0", name=name, seed=0)
    try:
        back = to_minari(buf, "cartpole/copy-v0", env="CartPole-v1", algorithm_name="copy", **META)
        assert isinstance(back, minari.MinariDataset)
        again = minari.load_dataset("cartpole/copy-v0")
        assert again.total_episodes == 9 and again.total_steps == len(buf)
        for a, b in zip(minari.load_dataset("cartpole/random-v0").iterate_episodes(), again.iterate_episodes(),
                        strict=True):
            assert np.array_equal(a.observations, b.observations)
            assert np.array_equal(a.actions, b.actions)
            assert np.array_equal(a.rewards, b.rewards)
            assert np.array_equal(a.terminations, b.terminations)
            assert np.array_equal(a.truncations, b.truncations)
    finally:
        buf.close()
        buf.unlink()


def test_to_minari_writes_recorded_episodes_whole(make: Make, name: str) -> None:
    schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((4,), "float32"), done=((), "bool"), truncated=((), "bool"))
    buf = make(schema, capacity=400, envs=2, episodes=True, name=name, seed=0)
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    rec = RecordTransitions(envs, buf)
    rec.reset(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(60):
        rec.step(rng.integers(0, 2, 2))
    envs.close()
    ds = to_minari(buf, "cartpole/recorded-v0", action_space=gym.spaces.Discrete(2), algorithm_name="random", **META)
    rows = sb.export(buf)
    eps = list(minari.load_dataset("cartpole/recorded-v0").iterate_episodes())
    assert eps and ds.total_episodes == len(eps)
    for ep in eps:
        # each episode: consecutive rows of one lane and one episode id, whole, ended
        first = int(np.flatnonzero((rows["obs"] == ep.observations[0]).all(axis=1))[0])
        t = len(ep)
        assert (rows["episode"][first:first + t] == rows["episode"][first]).all()
        assert np.array_equal(ep.observations[1:], rows["next_obs"][first:first + t])
        assert np.array_equal(ep.observations[:-1], rows["obs"][first:first + t])
        assert ep.terminations[-1] or ep.truncations[-1]
        assert not (ep.terminations[:-1] | ep.truncations[:-1]).any()
    # the episode still running in each lane is not written
    assert sum(len(e) for e in eps) < len(buf)


def test_to_minari_refuses_a_buffer_without_episodes(make: Make, name: str) -> None:
    buf = make(CARTPOLE, capacity=10, name=name, seed=0)
    with pytest.raises(sb.SchemaError, match="episodes=True"):
        to_minari(buf, "x/y-v0", env="CartPole-v1")


def test_minari_missing_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "minari", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[minari\]'"):
        from_minari("x/y-v0")


def test_other_fields_travel_as_infos(make: Make, name: str) -> None:
    schema = sb.Schema(obs=((2,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((2,), "float32"), done=((), "bool"), cost=((), "float32"))
    buf = make(schema, capacity=50, episodes=True, name=name, seed=0)
    for ep, t in enumerate((3, 5, 4)):
        steps = np.arange(t, dtype=np.float32)
        obs = np.stack([steps, steps + ep], axis=1)
        buf.push(obs=obs, action=np.arange(t), reward=steps, next_obs=obs + 1, done=steps == t - 1,
                 cost=steps * 10, episode=ep)
    to_minari(buf, "toy/costs-v0", action_space=gym.spaces.Discrete(8), algorithm_name="toy", **META)
    eps = list(minari.load_dataset("toy/costs-v0").iterate_episodes())
    assert [len(e) for e in eps] == [3, 5, 4]
    assert np.array_equal(eps[1].infos["cost"], np.arange(5) * 10.0)
    back = from_minari("toy/costs-v0", infos=("cost",), name=f"{name}-back")
    try:
        assert np.array_equal(sb.export(back)["cost"], sb.export(buf)["cost"])
        assert np.array_equal(sb.export(back)["obs"], sb.export(buf)["obs"])
    finally:
        back.close()
        back.unlink()
