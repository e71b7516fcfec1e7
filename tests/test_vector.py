"""Vector envs writing into a buffer (``shmbuffer/vector.py``): ``RecordTransitions`` around real
Gymnasium vector envs in every autoreset mode, and ``AsyncVectorEnv`` whose workers push their own
rows. The env's observation is ``[env, episode, t, length]``, so every row checks itself: its
``next_obs`` is the same episode one step on (never the next episode's reset observation), its
reward and action follow from ``t``, its lane and episode id from the env, and the rows of each
episode are all there, in order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import shmbuffer as sb
from shmbuffer.errors import SchemaError
from shmbuffer.shm import segment
from shmbuffer.vector import AsyncVectorEnv, RecordTransitions

from .envs import LIMIT, EpisodeEnv

SCHEMA = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                   next_obs=((4,), "float32"), done=((), "bool"), truncated=((), "bool"))


def policy(obs: np.ndarray) -> np.ndarray:
    """The action each env is given: ``t % 2``, so the row's action checks itself."""
    return (obs[:, 2] % 2).astype(np.int64)


def check_rows(rows: dict[str, np.ndarray], n_envs: int) -> dict[tuple[int, int], list[int]]:
    """Every row is one real transition of one episode; returns each (env, episode)'s steps."""
    obs, nxt = rows["obs"], rows["next_obs"]
    env, episode, t, length = (obs[:, k].astype(np.int64) for k in range(4))
    assert (nxt[:, :2] == obs[:, :2]).all(), "a row joins two episodes (next_obs is another episode's)"
    assert (nxt[:, 2] == t + 1).all(), "next_obs is not the next step's observation"
    assert (rows["reward"] == t + 1).all()
    assert (rows["action"] == t % 2).all()
    assert (rows["done"] == (t + 1 == length)).all(), "done must be terminated"
    assert (rows["truncated"] == ((t + 1 == LIMIT) & (t + 1 < length))).all()
    assert (rows["index"] % n_envs == env).all(), "a row is not in its env's lane"
    assert (rows["episode"] == (env << 32 | episode)).all()
    steps: dict[tuple[int, int], list[int]] = {}
    for e, ep, s in zip(env.tolist(), episode.tolist(), t.tolist(), strict=True):
        steps.setdefault((e, ep), []).append(s)
    for key, seen in steps.items():
        assert seen == list(range(len(seen))), f"env {key[0]} episode {key[1]}: steps {seen}"
    return steps


def run(envs: Any, steps: int, *, disabled: bool = False) -> int:
    """Step ``envs`` with ``policy``; returns the env steps that were transitions."""
    obs, _ = envs.reset(seed=list(range(envs.num_envs)))
    moved = 0
    reset_next = np.zeros(envs.num_envs, bool)
    for _ in range(steps):
        obs, _, terminated, truncated, _ = envs.step(policy(obs))
        ended = terminated | truncated
        if disabled:
            moved += envs.num_envs
            if ended.any():
                obs, _ = envs.reset(options={"reset_mask": ended})
        else:
            moved += int((~reset_next).sum()) if envs.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP \
                else envs.num_envs
            reset_next = ended
    return moved


def buffer(envs: int = 3, schema: sb.Schema = SCHEMA, **kw: Any) -> sb.ReplayBuffer:
    return sb.ReplayBuffer(schema, 3000, envs=envs, episodes=True, name=f"vec-{uuid.uuid4().hex[:12]}", **kw)


MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_recorded_rows_are_the_envs_real_transitions(kind: str, mode: AutoresetMode) -> None:
    n = 3
    fns = [EpisodeEnv] * n
    vec = gym.vector.SyncVectorEnv(fns, autoreset_mode=mode) if kind == "sync" else \
        gym.vector.AsyncVectorEnv(fns, autoreset_mode=mode)
    with buffer(n) as buf, RecordTransitions(vec, buf) as envs:
        moved = run(envs, 60, disabled=mode == AutoresetMode.DISABLED)
        rows = buf.export()
        assert len(rows["obs"]) == moved == buf.stats["inserted"], "a transition is missing or one too many"
        steps = check_rows(rows, n)
        assert sum(1 for e in range(n) for k in steps if k[0] == e) >= n * 4  # several episodes each


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_workers_write_the_real_transitions(mode: AutoresetMode) -> None:
    n = 3
    with buffer(n) as buf:
        envs = AsyncVectorEnv([EpisodeEnv] * n, buf, autoreset_mode=mode)
        try:
            moved = run(envs, 60, disabled=mode == AutoresetMode.DISABLED)
        finally:
            envs.close()
        rows = buf.export()
        assert len(rows["obs"]) == moved
        check_rows(rows, n)
        assert all(p.exitcode is not None for p in envs.processes), "a worker outlived close()"


class Gym029Vector:
    """A vector env with 0.29's rules: same-step autoreset, final observations in
    ``info["final_observation"]`` (masked by ``"_final_observation"``), no ``autoreset_mode``."""

    def __init__(self, n: int) -> None:
        self.metadata: dict[str, Any] = {}
        self.envs = [EpisodeEnv() for _ in range(n)]
        self.num_envs = n
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[np.ndarray, dict]:
        return np.stack([e.reset(seed=s)[0] for e, s in zip(self.envs, seed, strict=True)]), {}

    def step(self, actions: Any) -> tuple[Any, ...]:
        out = [e.step(a) for e, a in zip(self.envs, actions, strict=True)]
        obs = np.stack([o[0] for o in out])
        terminated = np.array([o[2] for o in out])
        truncated = np.array([o[3] for o in out])
        info: dict[str, Any] = {}
        ended = terminated | truncated
        if ended.any():
            info["final_observation"] = np.array([o[0] if d else None for o, d in zip(out, ended, strict=True)], object)
            info["_final_observation"] = ended
            for i in np.flatnonzero(ended):
                obs[i] = self.envs[i].reset()[0]
        return obs, np.array([o[1] for o in out]), terminated, truncated, info

    def close(self) -> None:
        pass


def test_gymnasium_029_final_observation_is_next_obs() -> None:
    n = 2
    with buffer(n) as buf:
        envs = RecordTransitions(Gym029Vector(n), buf)
        obs, _ = envs.reset(seed=[0, 1])
        for _ in range(40):
            obs, *_ = envs.step(policy(obs))
        rows = buf.export()
        assert len(rows["obs"]) == 80
        check_rows(rows, n)


def test_a_schema_that_does_not_fit_the_env_is_refused() -> None:
    vec = gym.vector.SyncVectorEnv([EpisodeEnv] * 2)
    wrong = sb.Schema(obs=((3,), "float32"), action=((), "int64"))
    with buffer(2, wrong) as buf, pytest.raises(SchemaError, match=r"field 'obs': expected \(4,\) float32.*got \(3,\)"):
        RecordTransitions(vec, buf)
    narrowing = sb.Schema(obs=((4,), "uint8"), action=((), "int64"))
    with buffer(2, narrowing) as buf, pytest.raises(SchemaError, match=r"field 'obs'.*uint8"):
        RecordTransitions(vec, buf)
    other = sb.Schema(obs=((4,), "float32"), value=((), "float32"))
    with buffer(2, other) as buf, pytest.raises(SchemaError, match=r"field 'value': expected the fields a step fills"):
        RecordTransitions(vec, buf)
    with sb.ReplayBuffer(SCHEMA, 100, episodes=True, name=f"vec-{uuid.uuid4().hex[:12]}") as buf:
        with pytest.raises(ValueError, match="envs=2"):
            RecordTransitions(vec, buf)
        with pytest.raises(ValueError, match="envs=2"):
            AsyncVectorEnv([EpisodeEnv] * 2, buf)
    with buffer(2, wrong) as buf, pytest.raises(SchemaError, match="field 'obs'"):
        AsyncVectorEnv([EpisodeEnv] * 2, buf)
    vec.close()


GYM_CLOSE = "ignore:.*Calling `close` while waiting:UserWarning"
"""Gymnasium's warning when a vector env is closed after a step that failed: expected there."""
GYM_ERROR = "ignore:.*ERROR:UserWarning"
"""Gymnasium's log line (a warning) when a worker reports an error: the error itself is checked."""


def by_hand(mode: AutoresetMode, n: int, actions: np.ndarray) -> list[list[Any]]:
    """The rows of ``n`` seeded ``EpisodeEnv`` stepped with ``actions``, written by hand from
    the module's rules (one list per step): ``(env, obs, action, reward, next_obs, done,
    truncated, episode id)``."""
    vec = gym.vector.SyncVectorEnv([EpisodeEnv] * n, autoreset_mode=mode)
    obs, _ = vec.reset(seed=list(range(n)))
    episode, resetting, steps = np.zeros(n, np.int64), np.zeros(n, bool), []
    for a in actions:
        nxt, reward, terminated, truncated, info = vec.step(a)
        rows = []
        for i in range(n):
            if mode == AutoresetMode.NEXT_STEP and resetting[i]:
                episode[i] += 1  # the reset step: no transition
                continue
            ended = terminated[i] or truncated[i]
            final = info["final_obs"][i] if mode == AutoresetMode.SAME_STEP and ended else nxt[i]
            rows.append([i, obs[i].tolist(), int(a[i]), float(reward[i]), np.asarray(final).tolist(),
                         bool(terminated[i]), bool(truncated[i]), i << 32 | int(episode[i])])
            if mode == AutoresetMode.SAME_STEP and ended:
                episode[i] += 1
        resetting = terminated | truncated if mode == AutoresetMode.NEXT_STEP else resetting
        obs = nxt
        steps.append(rows)
    vec.close()
    return steps


def recorded(buf: sb.ReplayBuffer, n: int) -> list[list[Any]]:
    """The buffer's rows as ``by_hand`` writes them, each env's in the order pushed."""
    rows = buf.export()
    order = np.argsort(rows["index"], kind="stable")
    out = [[int(rows["index"][k] % n), rows["obs"][k].tolist(), int(rows["action"][k]), float(rows["reward"][k]),
            rows["next_obs"][k].tolist(), bool(rows["done"][k]), bool(rows["truncated"][k]), int(rows["episode"][k])]
           for k in order]
    return sorted(out, key=lambda r: r[0])  # stable: each env's rows stay in order


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m.value)
def test_a_failed_push_loses_that_steps_rows_only(mode: AutoresetMode) -> None:
    """A push that times out (a rate limiter holding writers back) in a step where episodes end
    loses exactly that step's rows and says so; the recorder follows the envs all the same, so
    every later row, across resets, is the envs' real transition."""
    n, total = 3, 60
    actions = np.random.default_rng(0).integers(0, 2, (total, n))
    reference = by_hand(mode, n, actions)
    ends = [s for s, rows in enumerate(reference) if s >= 5 and any(r[5] or r[6] for r in rows)]
    fail = ends[0]  # an episode ends in the failed step: the resets after it must still be followed
    admitted = sum(len(rows) for rows in reference[:fail])
    limiter = sb.RateLimiter(samples_per_insert=1.0, min_size=1, error=admitted - 1, block_writers=True, timeout=0.05)
    failed: list[tuple[int, Exception]] = []
    with buffer(n, limiter=limiter) as buf, \
            RecordTransitions(gym.vector.SyncVectorEnv([EpisodeEnv] * n, autoreset_mode=mode), buf) as envs:
        envs.reset(seed=list(range(n)))
        for step, a in enumerate(actions):
            if failed:
                buf.sample(n)  # a learner: room for the next push
            try:
                envs.step(a)
            except sb.WaitTimeout as exc:
                failed.append((step, exc))
                assert exc.result[0].shape == (n, *buf.schema["obs"].shape)  # type: ignore[attr-defined]
        assert [s for s, _ in failed] == [fail]
        want = sorted((r for s, rows in enumerate(reference) if s != fail for r in rows), key=lambda r: r[0])
        assert recorded(buf, n) == want
        lost = sorted(r[0] for r in reference[fail])
        assert f"this step's {len(lost)} rows (envs {lost}) were not pushed" in str(failed[0][1])


@pytest.mark.filterwarnings(GYM_CLOSE)
@pytest.mark.filterwarnings(GYM_ERROR)
def test_a_workers_failed_push_says_what_happened(capfd: pytest.CaptureFixture[str]) -> None:
    """A worker whose push times out ends as Gymnasium's workers do at an error: the main process
    is told which env's step was not pushed, and the worker closes its mapping without an error."""
    limiter = sb.RateLimiter(samples_per_insert=1.0, min_size=1, error=4, block_writers=True, timeout=0.1)
    with buffer(2, limiter=limiter) as buf:
        envs = AsyncVectorEnv([EpisodeEnv] * 2, buf)
        try:
            obs, _ = envs.reset(seed=[0, 1])
            with pytest.raises(sb.WaitTimeout, match=r"env \d's step was not pushed, and its worker ends.*rate limiter"):
                for _ in range(20):
                    obs, *_ = envs.step(policy(obs))
        finally:
            envs.close()
        assert all(p.exitcode is not None for p in envs.processes)
        check_rows(buf.export(), 2)
    assert "BufferError" not in capfd.readouterr().err




@pytest.mark.filterwarnings(GYM_CLOSE)
@pytest.mark.filterwarnings(GYM_ERROR)
def test_an_env_error_reaches_the_main_process_as_gymnasiums_does() -> None:
    with buffer(2) as buf:
        envs = AsyncVectorEnv([EpisodeEnv, lambda: EpisodeEnv(fail_at=7)], buf)
        try:
            obs, _ = envs.reset(seed=[0, 1])
            with pytest.raises(RuntimeError, match="failed on purpose at step 7"):
                for _ in range(20):
                    obs, *_ = envs.step(policy(obs))
        finally:
            envs.close(terminate=True)
        check_rows(buf.export(), 2)
        assert buf.stats["inserted"] >= 12


SIZE = 1 << 18  # a 1 MiB observation: a push takes long enough to be killed in the middle


def step_until_broken(envs: Any, stepping: threading.Event) -> None:
    """Step until a worker is gone (Gymnasium raises on its pipe: the rows are what is checked)."""
    try:
        envs.reset(seed=[0, 1])
        for _ in range(10_000):
            envs.step(np.zeros(2, np.int64))
            stepping.set()
    except Exception:
        pass


@pytest.mark.filterwarnings(GYM_CLOSE)
def test_a_worker_killed_mid_push_leaves_no_torn_row() -> None:
    schema = sb.Schema(obs=((SIZE,), "int32"), next_obs=((SIZE,), "int32"), action=((), "int64"))
    for round_ in range(3):
        with sb.ReplayBuffer(schema, 40, envs=2, name=f"vec-{uuid.uuid4().hex[:12]}") as buf:
            envs = AsyncVectorEnv([lambda: EpisodeEnv(size=SIZE)] * 2, buf, shared_memory=True)
            victim = envs.processes[1]
            stepping = threading.Event()
            thread = threading.Thread(target=step_until_broken, args=(envs, stepping), daemon=True)
            thread.start()
            try:
                assert stepping.wait(60)
                time.sleep(0.05 + 0.07 * round_)
                os.kill(victim.pid, signal.SIGKILL)
                thread.join(30)
            finally:
                envs.close(terminate=True)
            rows = buf.export()
            assert len(rows["obs"]) > 0
            for o, n in zip(rows["obs"], rows["next_obs"], strict=True):
                assert (o == o[0]).all() and (n == n[0]).all(), "a torn row"
                assert n[0] == o[0] + 1
            batch = buf.sample(32)
            assert (batch.obs == batch.obs[:, :1]).all()


ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, args: list[str]) -> str:
    """Run ``examples/name`` as a subprocess (warnings as errors), killing its process group if it
    hangs; returns its stdout and checks it left no segment behind."""
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # timed out: kill it and its worker processes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert not [n for n in segment.list_names() if n.startswith(f"{proc.pid}-")]
    return out


@pytest.mark.slow
def test_the_cleanrl_example_runs_with_writing_workers() -> None:
    out = run_example("cleanrl_dqn_vector.py", ["--total-timesteps", "3000", "--learning-starts", "1000",
                                                "--num-envs", "4", "--eval-episodes", "1", "--target", "0"])
    done = re.search(r"OK: 3,000 env steps by 4 writing workers, ([\d,]+) rows pushed, ([\d,]+) updates", out)
    assert done, out
    assert 2_500 <= int(done.group(1).replace(",", "")) < 3_000  # a row per step but the reset steps
    assert int(done.group(2).replace(",", "")) == 500
