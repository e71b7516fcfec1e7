"""``sample(256)`` of a buffer that stores observations once (``next_of``/``stack``) against the same
buffer storing them whole, in one process, as microseconds a sample (best of 3 slices)::

    python benchmarks/frames_sample.py            # this checkout's shmbuffer
    PYTHONPATH=/path/to/other/worktree python benchmarks/frames_sample.py   # another's, same run

MuJoCo rows (obs 17 float64, 200,000 rows, 8 lanes, ``next_of="obs"``) and Atari rows (4 frames of
84x84 uint8, 50,000 rows, 8 lanes, ``next_of="obs", stack="obs"``). The ``atari.compressed`` case
of ``python -m benchmarks`` is the full comparison (cpprb, SB3, 1M rows); this one is quick enough
for a before/after of the read path.
"""

from __future__ import annotations

import os
import time

import numpy as np

import shmbuffer as sb

N = 256
LANES = 8


def per_sample(buf: sb.ReplayBuffer, seconds: float = 2.0) -> float:
    for _ in range(20):
        buf.sample(N)
    best = []
    for _ in range(3):
        k, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds / 3:
            buf.sample(N)
            k += 1
        best.append((time.perf_counter() - t) / k)
    return min(best) * 1e6


def mujoco(once: bool) -> float:
    schema = sb.Schema(obs=((17,), "float64"), act=((6,), "float32"), reward=((), "float32"),
                       next_obs=((17,), "float64"), done=((), "bool"))
    cap = 200_000
    buf = sb.ReplayBuffer(schema, cap, envs=LANES, name=f"fs{os.getpid()}m{once}", seed=0,
                          next_of="obs" if once else None)
    try:
        rng = np.random.default_rng(0)
        per = cap // LANES
        for lane in range(LANES):
            states = rng.random((per + 1, 17))
            for a in range(0, per, 64):
                b = min(a + 64, per)
                buf.push(dict(obs=states[a:b], act=rng.random((b - a, 6), dtype=np.float32),
                              reward=rng.random(b - a, dtype=np.float32), next_obs=states[a + 1:b + 1],
                              done=np.zeros(b - a, bool)), lane=lane)
        return per_sample(buf)
    finally:
        buf.close()
        buf.unlink()


def atari(once: bool) -> float:
    k, frame = 4, (84, 84)
    schema = sb.Schema(obs=((k, *frame), "uint8"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((k, *frame), "uint8"), done=((), "bool"))
    cap = 50_000
    buf = sb.ReplayBuffer(schema, cap, envs=LANES, name=f"fs{os.getpid()}a{once}", seed=0,
                          next_of="obs" if once else None, stack="obs" if once else None)
    try:
        frames = np.random.default_rng(0).integers(0, 255, (40, *frame), dtype=np.uint8)
        back = np.arange(k)[::-1]
        for lane in range(LANES):
            for i in range(cap // LANES // 32):
                t = np.arange(32) + 32 * i  # one endless episode a lane, padded by its first frame
                obs = np.stack([frames[np.maximum(j - back, 0) % 40] for j in t])
                nxt = np.stack([frames[np.maximum(j + 1 - back, 0) % 40] for j in t])
                buf.push(dict(obs=obs, action=t, reward=t.astype(np.float32), next_obs=nxt,
                              done=np.zeros(32, bool)), lane=lane)
        return per_sample(buf)
    finally:
        buf.close()
        buf.unlink()


if __name__ == "__main__":
    print(f"shmbuffer from {os.path.dirname(sb.__file__)}")
    for name, run in (("MuJoCo", mujoco), ("Atari", atari)):
        whole, once = run(False), run(True)
        print(f"{name:7s} sample({N}): stored whole {whole:7.1f} us, stored once {once:7.1f} us ({whole / once:.2f}x)")
