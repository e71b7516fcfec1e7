"""Real Atari frames (``examples/atari.py``): the example runs end to end as a subprocess with a few
hundred env steps, and on real ALE frames a buffer made with ``next_of="obs", stack="obs"`` returns
bit-identical transitions to a buffer storing ``obs`` and ``next_obs`` whole, for the same pushes:
Pong episodes cut by a time limit (truncated) and Breakout episodes ended by a lost life
(terminated), two envs in two lanes, the compressed buffer wrapping round several times.

Skipped, with the reason, where ``ale-py`` (the ``atari`` extra) or opencv (Gymnasium's
``AtariPreprocessing`` needs it) is not installed."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.shm import segment

ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("ale_py", "cv2") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"{' and '.join(MISSING)} not installed: pip install -e '.[atari]' (ale-py, opencv-python-headless)")


def left_by(pid: int) -> list[str]:
    """Segments in /dev/shm of process ``pid`` (default names start with its pid)."""
    return [n for n in segment.list_names() if n.startswith(f"{pid}-")]


@pytest.mark.slow
def test_the_example_runs_with_collectors_and_a_learner() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}
    args = ["--steps", "300", "--updates", "3", "--learning-starts", "200", "--batch-size", "16",
            "--capacity", "2000", "--max-seconds", "120"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "atari.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # timed out: kill it and its collector processes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert not left_by(proc.pid)
    steps = re.search(r"([\d,]+) env steps in \d+ episodes by 2 collectors, 3 updates of 16", out)
    assert steps and int(steps.group(1).replace(",", "")) >= 300, out
    assert "next_obs[:, :-1] == obs[:, 1:] for every sampled transition: True" in out, out
    sizes = re.search(r"bytes per transition: ([\d,]+) with next_of/stack .* ([\d,]+) without", out)
    assert sizes, out
    comp, plain = (int(s.replace(",", "")) for s in sizes.groups())
    assert comp <= 1.15 * (84 * 84 + 8 + 4 + 1 + 1)  # one frame and the small fields (plus stamps and kinds)
    assert plain / comp > 7


# -- real frames: compressed == uncompressed ------------------------------------------------------------
def real_env(game: str, *, truncate_after: int | None = None, life_loss: bool = False) -> Any:
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    limit = None if truncate_after is None else 4 * truncate_after  # TimeLimit counts raw frames: 4 a step
    env = gym.make(game, frameskip=1, max_episode_steps=limit)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, terminal_on_life_loss=life_loss)
    return FrameStackObservation(env, 4)


SCHEMA = sb.Schema(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"),
                   next_obs=((4, 84, 84), "uint8"), done=((), "bool"), truncated=((), "bool"))


def play(env: Any, seed: int, steps: int) -> list[dict[str, Any]]:
    """``steps`` transitions of random play, as Gymnasium hands them over, resetting after each end."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = []
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        nxt, reward, terminated, truncated, _ = env.step(action)
        out.append(dict(obs=obs, action=action, reward=float(reward), next_obs=nxt, done=terminated,
                        truncated=truncated))
        obs = env.reset()[0] if terminated or truncated else nxt
    return out


def test_real_frames_compressed_equals_uncompressed(make: Callable[..., sb.ReplayBuffer], name: str) -> None:
    steps = 240
    lanes = [play(real_env("ALE/Pong-v5", truncate_after=45), seed=1, steps=steps),
             play(real_env("ALE/Breakout-v5", life_loss=True), seed=2, steps=steps)]
    ends = [sum(bool(r["done"] or r["truncated"]) for r in lane) for lane in lanes]
    assert sum(r["truncated"] for r in lanes[0]) >= 4 and sum(r["done"] for r in lanes[1]) >= 2, ends
    full = make(SCHEMA, 2 * 512, envs=2, name=name + "f")
    comp = make(SCHEMA, 2 * 96, envs=2, next_of="obs", stack="obs", name=name + "c", seed=0)
    to_full: dict[int, int] = {}
    checked = 0
    rng = np.random.default_rng(0)
    t = [0, 0]
    while min(t) < steps:
        # each env pushes its next 1-4 steps into its own lane; sometimes both envs in one push
        k = [min(int(rng.integers(1, 5)), steps - t[i]) for i in (0, 1)]
        if k[0] and k[1] and rng.random() < 0.5:
            chunk = [(lanes[i][t[i] + j], i) for i in (0, 1) for j in range(k[i])]
            pushes = [chunk]
        else:
            pushes = [[(lanes[i][t[i] + j], i) for j in range(k[i])] for i in (0, 1) if k[i]]
        for p in pushes:
            rows = {n: np.stack([np.asarray(r[n]) for r, _ in p]) for n in SCHEMA.names}
            lane = np.array([i for _, i in p])
            a = full.push(rows, lane=lane)
            b = comp.push(rows, lane=lane)
            assert b.shape == a.shape
            to_full.update(zip(b.tolist(), a.tolist(), strict=True))
        t = [t[i] + k[i] for i in (0, 1)]
        held = [i for i in to_full if comp.ring.current(np.array([i]))[0]]
        readable = 0
        for i in held:
            try:
                got = comp.take([i])
            except sb.EmptyBufferError:
                continue
            want = full.take([to_full[i]])
            for n in SCHEMA.names:
                assert got[n].dtype == want[n].dtype and np.array_equal(got[n], want[n]), (n, i)
            readable += 1
        # only a lane's newest row (no next observation yet) and rows whose stack reaches past the
        # lane's oldest rows may be unreadable
        assert readable >= len(held) - 2 * 5
        checked += readable
    assert len(to_full) == 2 * steps and checked > 4 * 2 * 96  # the ring wrapped: every row checked many times
    batch = comp.sample(128)
    ref = full.take([to_full[i] for i in batch.index.tolist()])
    for n in SCHEMA.names:
        assert np.array_equal(batch[n], ref[n]), n
    assert np.array_equal(batch.obs[:, 1:], batch.next_obs[:, :-1])
    # bytes: one frame a row against two stacks of four
    sizes = [os.path.getsize(segment.path_of(b.handle.name)) for b in (comp, full)]
    assert (sizes[1] / (2 * 512)) / (sizes[0] / (2 * 96)) > 7
