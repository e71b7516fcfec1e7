"""Incremental checkpoints (``buf.checkpoint``) against a full ``save``, against ``np.save`` of the
new rows' bytes, ``resume`` against ``load``, and against SB3's ``save_replay_buffer``::

    python benchmarks/checkpoint.py                    # 1M rows (about 7 GB of shared memory)
    python benchmarks/checkpoint.py --rows 200000      # the same ratios on a smaller machine

Atari rows (4 frames of 84x84 uint8, ``next_of="obs"``, ``stack="obs"``, 8 lanes): the buffer
filled (full: new rows lap it), a full ``save`` and a first checkpoint (every row) written, then
rounds of ``--new`` rows (10,000) pushed and checkpointed again (each checkpoint ``fsync``-s its
chunk and manifest, as ``save`` does not: the ratio is given with ``sync=False`` too, to another
folder) and ``np.save`` of those rows' stored bytes (gathered beforehand, not timed) into a new
file, as each chunk is (on this VM ``np.save`` over an existing file ran 10x faster than into a
new one, which would compare a page-cache rewrite with a new file), and ``np.save`` followed by
``fsync`` (durable, as the chunk). Dirty pages are flushed (``os.sync``, untimed) before each
timed operation, so none pays for another's. The ratio to ``np.save`` is reported both ways: the
issue's (the checkpoint with its fsyncs / ``np.save`` into the page cache) and like for like
(both durable, or neither). ``resume`` of the folder and ``load`` of the save
read what was just written (the page cache). SB3: a ``ReplayBuffer`` of ``--rows`` MuJoCo rows
pickled by ``save_replay_buffer`` (``save_to_pkl``), against an incremental checkpoint of the
same rows in shmbuffer after ``--new`` more. Each time is the best of ``--repeat`` runs (rounds);
files go to ``--dir`` (default: a temporary folder on the disk of ``/tmp``), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import shmbuffer as sb

LANES = 8
FRAME = (84, 84)


def save_synced(file: Path, a: np.ndarray) -> None:
    """``np.save`` and ``fsync``: durable, as a checkpoint's chunk is."""
    with open(file, "wb") as f:
        np.save(f, a)
        f.flush()
        os.fsync(f.fileno())


def best(fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None) -> float:
    """The shortest of ``repeat`` runs of ``fn`` (``before`` run, untimed, before each)."""
    out = []
    for _ in range(repeat):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


class Atari:
    """Each lane's frames, pushed as stacks: ``obs[t]`` is frames ``t .. t + 3`` (the first four equal)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.frames: dict[int, np.ndarray] = {}

    def push(self, buf: sb.ReplayBuffer, lane: int, k: int) -> None:
        last = self.frames.get(lane)
        if last is None:
            first = self.rng.integers(0, 256, (1, *FRAME), np.uint8)
            last = np.repeat(first, 4, axis=0)
        new = self.rng.integers(0, 256, (k, *FRAME), np.uint8)
        f = np.concatenate([last, new])  # frames; the stacks are windows of 4 of them
        windows = np.lib.stride_tricks.sliding_window_view(f, 4, axis=0)  # (n, 84, 84, 4)
        stacks = np.ascontiguousarray(np.moveaxis(windows, -1, 1))  # (n, 4, 84, 84)
        buf.push({"obs": stacks[:k], "next_obs": stacks[1:k + 1], "action": self.rng.integers(0, 18, k),
                  "reward": self.rng.random(k, np.float32), "done": np.zeros(k, bool)}, lane=lane)
        self.frames[lane] = f[k:k + 4]  # the last next_obs: where the next push goes on


def atari(rows: int, new: int, repeat: int, folder: Path) -> dict[str, Any]:
    schema = sb.Schema(obs=((4, *FRAME), "uint8"), next_obs=((4, *FRAME), "uint8"), action=((), "int64"),
                       reward=((), "float32"), done=((), "bool"))
    cap = -(-rows // LANES) * LANES  # full once filled: each round of new rows laps the ring
    buf = sb.ReplayBuffer(schema, cap, lanes=LANES, next_of="obs", stack="obs", name=f"bc{os.getpid()}a", seed=0)
    env = Atari(0)
    try:
        per = rows // LANES
        for lane in range(LANES):
            for a in range(0, per, 2000):
                env.push(buf, lane, min(2000, per - a))
        out: dict[str, Any] = {"rows": len(buf), "new": new, "bytes": buf.block.arrays["_record"].nbytes
                               + sum(buf.block.fields[n].nbytes for n in ("obs",))}
        save_dir = folder / "save"
        out["save_s"] = best(lambda: buf.save(save_dir, overwrite=True), repeat, os.sync)
        os.sync()
        first = buf.checkpoint(folder / "ckpt")
        buf.checkpoint(folder / "nosync", sync=False)
        out["first_checkpoint_s"] = first["seconds"]
        times: dict[str, list[float]] = {"checkpoint_s": [], "checkpoint_nosync_s": [], "np_save_s": [],
                                         "np_save_fsync_s": []}
        for i in range(repeat):  # each round: new rows, then each way of writing them
            for lane in range(LANES):
                env.push(buf, lane, new // LANES)
            os.sync()
            got = buf.checkpoint(folder / "ckpt")
            assert not got["full"] and got["new"] >= new, got
            times["checkpoint_s"].append(got["seconds"])
            out["checkpoint_bytes"] = got["bytes"]
            os.sync()
            times["checkpoint_nosync_s"].append(buf.checkpoint(folder / "nosync", sync=False)["seconds"])
            stop = buf.ring.bounds()[1]
            lc = buf.lane_capacity
            slots = np.concatenate([lane * lc + np.arange(stop[lane] - new // LANES, stop[lane]) % lc
                                    for lane in range(LANES)])
            raw = np.concatenate([buf.block.fields["obs"][slots].reshape(slots.size, -1),
                                  buf.block.arrays["_record"][slots]], axis=1)  # the rows' stored bytes
            # into a new file, as each checkpoint's chunk is (overwriting one file is 10x faster here)
            times["np_save_s"].append(best(lambda raw=raw, i=i: np.save(folder / f"rows{i}.npy", raw), 1, os.sync))
            times["np_save_fsync_s"].append(best(lambda raw=raw, i=i: save_synced(folder / f"synced{i}.npy", raw), 1,
                                                 os.sync))
            (folder / f"rows{i}.npy").unlink()
            (folder / f"synced{i}.npy").unlink()
        out |= {k: min(v) for k, v in times.items()}
        out["folder_bytes"] = got["folder_bytes"]

        def resume() -> None:
            other = sb.ReplayBuffer.resume(folder / "ckpt")
            other.close()
            other.unlink()

        def load() -> None:
            other = sb.ReplayBuffer.load(save_dir)
            other.close()
            other.unlink()

        out["resume_s"] = best(resume, repeat, os.sync)
        out["load_s"] = best(load, repeat, os.sync)
    finally:
        buf.close()
        buf.unlink()
    out["checkpoint_over_save"] = out["checkpoint_s"] / out["save_s"]
    out["checkpoint_over_np_save"] = out["checkpoint_s"] / out["np_save_s"]
    out["checkpoint_nosync_over_np_save"] = out["checkpoint_nosync_s"] / out["np_save_s"]
    out["checkpoint_over_np_save_fsync"] = out["checkpoint_s"] / out["np_save_fsync_s"]
    out["resume_over_load"] = out["resume_s"] / out["load_s"]
    return out


def mujoco(rows: int, new: int, repeat: int, folder: Path) -> dict[str, Any]:
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer
    from stable_baselines3.common.save_util import save_to_pkl

    rng = np.random.default_rng(0)
    obs = rng.random((rows, 17), np.float32)
    nxt = rng.random((rows, 17), np.float32)
    act = rng.random((rows, 6), np.float32)
    rew = rng.random(rows, np.float32)
    done = np.zeros(rows, bool)
    space = gym.spaces.Box(-1, 1, (17,), np.float32)
    theirs = SB3Buffer(rows, space, gym.spaces.Box(-1, 1, (6,), np.float32), device="cpu")
    theirs.observations[:, 0], theirs.next_observations[:, 0], theirs.actions[:, 0] = obs, nxt, act
    theirs.rewards[:, 0], theirs.dones[:, 0], theirs.full = rew, done, True
    sb3_s = best(lambda theirs=theirs: save_to_pkl(folder / "sb3.pkl", theirs), repeat, os.sync)
    del theirs
    schema = sb.Schema(obs=((17,), "float32"), action=((6,), "float32"), reward=((), "float32"),
                       next_obs=((17,), "float32"), done=((), "bool"))
    buf = sb.ReplayBuffer(schema, rows + new, name=f"bc{os.getpid()}m", seed=0)
    try:
        for a in range(0, rows, 100_000):
            z = slice(a, a + 100_000)
            buf.push(obs=obs[z], action=act[z], reward=rew[z], next_obs=nxt[z], done=done[z])
        buf.checkpoint(folder / "mujoco")
        took = []
        for _ in range(repeat):
            buf.push(obs=obs[:new], action=act[:new], reward=rew[:new], next_obs=nxt[:new], done=done[:new])
            os.sync()
            took.append(buf.checkpoint(folder / "mujoco")["seconds"])
    finally:
        buf.close()
        buf.unlink()
    return {"rows": rows, "new": new, "sb3_save_replay_buffer_s": sb3_s, "checkpoint_s": min(took),
            "checkpoint_over_sb3": min(took) / sb3_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--new", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="shmbuffer-bench-", dir=args.dir))
    try:
        res = {"load": os.getloadavg(), "atari": atari(args.rows, args.new, args.repeat, folder),
               "mujoco": mujoco(args.rows, args.new, args.repeat, folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    a, m = res["atari"], res["mujoco"]
    print(f"load average {res['load'][0]:.1f}; Atari {a['rows']} rows (next_of, stack), {a['new']} new:")
    print(f"  full save {a['save_s']:.3f} s, first checkpoint {a['first_checkpoint_s']:.3f} s")
    print(f"  incremental checkpoint {a['checkpoint_s']:.3f} s ({a['checkpoint_bytes'] / 1e6:.1f} MB), "
          f"without fsync {a['checkpoint_nosync_s']:.3f} s, np.save of the rows {a['np_save_s']:.3f} s")
    print(f"  checkpoint / save {a['checkpoint_over_save']:.4f}x (target <= 0.05)")
    print(f"  checkpoint (fsync) / np.save (no fsync) {a['checkpoint_over_np_save']:.2f}x (target <= 2)")
    print(f"  both durable: checkpoint (fsync) / np.save + fsync ({a['np_save_fsync_s']:.3f} s) "
          f"{a['checkpoint_over_np_save_fsync']:.2f}x")
    print(f"  neither durable: checkpoint without fsync / np.save {a['checkpoint_nosync_over_np_save']:.2f}x")
    print(f"  resume {a['resume_s']:.3f} s / load {a['load_s']:.3f} s = {a['resume_over_load']:.2f}x (target <= 1.2)")
    print(f"MuJoCo {m['rows']} rows, {m['new']} new: checkpoint {m['checkpoint_s']:.3f} s / SB3 save_replay_buffer "
          f"{m['sb3_save_replay_buffer_s']:.3f} s = {m['checkpoint_over_sb3']:.3f}x")


if __name__ == "__main__":
    main()
