"""``RecordTransitions`` over an EnvPool env: its synchronous ``step`` and its asynchronous
``send``/``recv``, checked against a by-hand record of the same seeded envs, which tells a reset
observation by EnvPool's own ``info["elapsed_step"] == 0``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb

envpool = pytest.importorskip("envpool")
from shmbuffer.vector import RecordTransitions  # noqa: E402

Make = Callable[..., sb.ReplayBuffer]
pytestmark = [
    # EnvPool's CartPole space has float64 bounds that Gymnasium's Box casts (envpool 1.2.5)
    pytest.mark.filterwarnings("ignore:.*precision lowered by casting to float32:UserWarning"),
]
SCHEMA = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                   next_obs=((4,), "float32"), done=((), "bool"), truncated=((), "bool"))
N = 6
STEPS = 10  # episodes truncated at 10 steps: both ends occur


def pool(batch_size: int | None = None) -> Any:
    kwargs = {} if batch_size is None else {"batch_size": batch_size}
    return envpool.make("CartPole-v1", env_type="gymnasium", num_envs=N, seed=7, max_episode_steps=STEPS,
                        num_threads=2, **kwargs)


def policy(env_id: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The action of each env from its own step count: the same whatever order the envs come in."""
    return ((count * 5 + env_id * 3) // 2 % 2).astype(np.int32)


class ByHand:
    """Per env: its transitions as ``(obs, action, reward, next_obs, terminated, truncated, episode)``."""

    def __init__(self) -> None:
        self.rows: list[list[tuple[Any, ...]]] = [[] for _ in range(N)]
        self.obs: list[Any] = [None] * N
        self.action = [0] * N
        self.episode = [-1] * N

    def see(self, obs: Any, reward: Any, terminated: Any, truncated: Any, info: dict[str, Any]) -> None:
        for k, e in enumerate(info["env_id"]):
            if info["elapsed_step"][k] == 0:  # a reset: an episode starts
                self.episode[e] += 1
            else:
                self.rows[e].append((self.obs[e], self.action[e], reward[k], obs[k], terminated[k], truncated[k],
                                     self.episode[e]))
            self.obs[e] = obs[k].copy()


def lanes(buf: sb.ReplayBuffer) -> list[dict[str, np.ndarray]]:
    rows = sb.export(buf)
    lane = sb.protocol.by_position.in_lane(buf, rows["index"])[1]
    return [{k: v[lane == e] for k, v in rows.items()} for e in range(N)]


def same(recorded: dict[str, np.ndarray], expected: list[tuple[Any, ...]], e: int) -> None:
    n = min(len(expected), recorded["obs"].shape[0])
    assert n >= 2 * STEPS, f"env {e}: too few steps to compare ({n})"
    obs, action, reward, next_obs, term, trunc, episode = (np.array(c) for c in zip(*expected[:n], strict=True))
    assert np.array_equal(recorded["obs"][:n], obs)
    assert np.array_equal(recorded["action"][:n], action)
    assert np.array_equal(recorded["reward"][:n], reward)
    assert np.array_equal(recorded["next_obs"][:n], next_obs)
    assert np.array_equal(recorded["done"][:n], term)
    assert np.array_equal(recorded["truncated"][:n], trunc)
    assert np.array_equal(recorded["episode"][:n] & 0xFFFFFFFF, episode)
    assert (recorded["episode"][:n] >> 32 == e).all()  # the env's own episode ids
    assert (term | trunc).any() and (episode > 0).any()


def drive(env: Any, hand: ByHand | None, failed: list[str] | None = None) -> None:
    """150 batches of EnvPool's async API, each env's action from its own step count; with
    ``failed``, a push that fails in ``recv`` is noted there and its batch taken from the error."""
    count = np.zeros(N, np.int64)
    env.async_reset()
    for _ in range(150):
        try:
            got = env.recv()
        except sb.WaitTimeout as exc:
            if failed is None:
                raise
            failed.append(str(exc))
            got = exc.result  # type: ignore[attr-defined]
        ids = np.asarray(got[4]["env_id"])
        if hand is not None:
            hand.see(*got)
        actions = policy(ids, count[ids])
        count[ids] += 1
        if hand is not None:
            for k, e in enumerate(ids):
                hand.action[e] = actions[k]
        env.send(actions, ids)


def test_envpool_sync_step_matches_a_by_hand_record(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=N * 200, envs=N, episodes=True, name=name, seed=0)
    rec, ref = RecordTransitions(pool(), buf), pool()
    hand = ByHand()
    obs, _ = rec.reset()
    obs2, info2 = ref.reset()
    assert np.array_equal(obs, obs2)
    hand.see(obs2, np.zeros(N), np.zeros(N, bool), np.zeros(N, bool), info2)
    ids = np.arange(N)
    for count in range(60):
        actions = policy(ids, np.full(N, count))
        rec.step(actions)
        hand.action = list(actions)
        hand.see(*ref.step(actions))
    got = lanes(buf)
    for e in range(N):
        assert len(got[e]["obs"]) == len(hand.rows[e])  # no autoreset step stored
        same(got[e], hand.rows[e], e)
    rec.close()
    ref.close()


def test_envpool_async_recv_matches_a_by_hand_record(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=N * 200, envs=N, episodes=True, name=name, seed=0)
    rec, ref = RecordTransitions(pool(batch_size=2), buf), pool(batch_size=2)

    hand = ByHand()
    drive(rec, None)
    drive(ref, hand)
    got = lanes(buf)
    for e in range(N):
        same(got[e], hand.rows[e], e)
        ep = got[e]["episode"]
        ends = np.flatnonzero(ep[1:] != ep[:-1])  # an episode's last row is where its id changes
        assert (got[e]["done"][ends] | got[e]["truncated"][ends]).all()
        inside = np.flatnonzero(ep[1:] == ep[:-1])  # within an episode, each next_obs is the next obs
        assert np.array_equal(got[e]["next_obs"][inside], got[e]["obs"][inside + 1])
    rec.close()
    ref.close()


def test_a_failed_push_in_recv_loses_that_batchs_rows_only(make: Make, name: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that fails in ``recv`` loses exactly that batch's rows and says so; the batch comes
    with the error, and every later row is the envs' real transition."""
    buf = make(SCHEMA, capacity=N * 200, envs=N, episodes=True, name=name, seed=0)
    rec, ref = RecordTransitions(pool(batch_size=2), buf), pool(batch_size=2)
    push, calls, lost = buf.push, [0], {}

    def failing_push(rows: dict[str, np.ndarray], **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 40:
            lost.update({int(e): rows["next_obs"][k].copy() for k, e in enumerate(np.asarray(kwargs["lane"]))})
            raise sb.WaitTimeout("push: the rate limiter held this writer back")
        return push(rows, **kwargs)

    monkeypatch.setattr(buf, "push", failing_push)
    failed: list[str] = []

    hand = ByHand()
    drive(rec, None, failed)
    drive(ref, hand)
    assert len(failed) == 1 and len(lost) >= 1
    assert f"this batch's {len(lost)} rows (envs {list(lost)}) were not pushed and are lost" in failed[0]
    got = lanes(buf)
    for e in range(N):
        want = hand.rows[e]
        if e in lost:  # that env's transition of the failed batch, and only it, is missing
            at = [k for k, row in enumerate(want) if np.array_equal(row[3], lost[e])]
            assert len(at) == 1
            want = want[:at[0]] + want[at[0] + 1:]
        assert len(got[e]["obs"]) == len(want)
        same(got[e], want, e)
    rec.close()
    ref.close()


def test_envpool_recv_before_reset_says_what_to_do(make: Make, name: str) -> None:
    buf = make(SCHEMA, capacity=120, envs=N, episodes=True, name=name, seed=0)
    rec = RecordTransitions(pool(batch_size=2), buf)
    with pytest.raises(RuntimeError, match="async_reset"):
        rec.recv()
    rec.async_reset()
    with pytest.raises(ValueError, match="one action per env id"):
        rec.send(np.zeros(3, np.int32), np.arange(2))
    assert len(buf) == 0
    rec.close()


@pytest.mark.slow
def test_the_envpool_example_runs() -> None:
    import re

    from .test_vector import run_example

    out = run_example("envpool_dqn.py", ["--total-timesteps", "3000", "--learning-starts", "1000",
                                         "--eval-episodes", "1", "--target", "0"])
    done = re.search(r"OK: 3,000 env steps by 8 EnvPool envs \(4 a batch\), ([\d,]+) rows pushed, ([\d,]+) updates", out)
    assert done, out
    assert 2_500 <= int(done.group(1).replace(",", "")) < 3_000  # a row per step but the reset steps
    assert int(done.group(2).replace(",", "")) == 250
