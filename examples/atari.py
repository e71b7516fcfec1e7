"""Atari in an eighth of the memory: collector processes play Pong into a buffer that stores each
84x84 frame once, and a DQN learner samples stacked batches from it.

    pip install -e ".[atari]"        # ale-py (its ROMs ship in the wheel) and opencv for the resize
    python examples/atari.py [--steps 8000] [--updates 1000] [--capacity 100000]

Each collector process steps its envs (``ALE/Pong-v5`` with ``frameskip=1``, Gymnasium's
``AtariPreprocessing`` skipping 4 frames to 84x84 grayscale, and ``FrameStackObservation`` stacking
the last 4) and pushes every step into the env's own lane: ``obs`` (4, 84, 84) uint8, ``action``,
``reward``, ``next_obs`` (4, 84, 84), ``done`` (terminated) and ``truncated``, the same full fields
as for a plain buffer. The buffer, made with ``next_of="obs", stack="obs"``, keeps one frame a row:
``next_obs`` of a step is read from the next row of its lane, the 3 older frames of a stack from the
rows before it (padded at an episode's start as ``FrameStackObservation`` padded them), and an
episode's final observation from an end row. The learner's batches hold the full stacks, as if
they had been stored whole. At the end it prints the bytes a transition takes against the same
buffer without ``next_of``/``stack``.

``--steps`` env steps are collected (the collectors stop there, give or take the steps in flight),
and the learner makes ``--updates`` updates; the run ends when both are done. What a run at the
defaults shows: the collectors stop a little past ``--steps`` env steps (they finish the step they
are in), the learner goes on to ``--updates`` updates, and the last line is the verdict, ``OK: N
env steps (--steps 8,000), 1,000 updates; 7,083 bytes a transition instead of 56,474 (8.0x less),
stacks rebuilt intact: True; return of the last episodes R``. Pong's return stays near a random
player's -21 at this length: the example shows the memory, not learning. It exits with status 1
(``FAILED``) if the stacks were not rebuilt intact or the buffer is not 7x smaller.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

import shmbuffer as sb
from shmbuffer.frames import PLAIN
from shmbuffer.protocol.layout import columns
from shmbuffer.shm.segment import path_of


@dataclass
class Args:
    """The example's settings; each is a flag (``--batch-size 64``)."""

    env_id: str = field(default="ALE/Pong-v5", metadata={"help": "an ALE game (played with frameskip=1: AtariPreprocessing skips)"})
    workers: int = field(default=2, metadata={"help": "collector processes"})
    envs_per_worker: int = field(default=1, metadata={"help": "envs each collector steps (one buffer lane each)"})
    capacity: int = field(default=100_000, metadata={"help": "rows the buffer holds (a multiple of the envs)"})
    steps: int = field(default=8_000, metadata={"help": "env steps (all collectors) to collect: the collectors stop there"})
    updates: int = field(default=1_000, metadata={"help": "learner updates: the run ends once these are done and the steps collected"})
    learning_starts: int = field(default=2_000, metadata={"help": "rows pushed before the first update"})
    batch_size: int = field(default=32, metadata={"help": "transitions per learner batch"})
    lr: float = field(default=1e-4, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    eps_steps: int = field(default=10_000, metadata={"help": "env steps per collector over which epsilon decays 1 -> 0.05"})
    publish_every: int = field(default=100, metadata={"help": "updates between publishing the weights to the collectors"})
    target_every: int = field(default=1_000, metadata={"help": "updates between target network copies"})
    max_seconds: float = field(default=3_600.0, metadata={"help": "wall-clock limit"})
    seed: int = field(default=0, metadata={"help": "seeds torch, the envs, the collectors and the buffer's sampling"})


# -- the env: ALE frames, Gymnasium's preprocessing and frame stack ----------------------------------
def make_env(env_id: str = "ALE/Pong-v5") -> Any:
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1)  # AtariPreprocessing does the frame skipping (and max-pooling)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    return FrameStackObservation(env, 4)  # (4, 84, 84) uint8, padded at reset with copies of the first frame


class EnvFactory:
    """A picklable env factory for the collector processes."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self) -> Any:
        return make_env(self.env_id)


# -- the Q-network (Nature DQN) and the collectors' epsilon-greedy policy ---------------------------
def nature_cnn(actions: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(4, 32, 8, stride=4), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 4, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, stride=1), torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 7 * 7, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, actions),
    )


def scaled(obs: Any) -> torch.Tensor:
    return torch.as_tensor(obs).float() / 255.0


class EpsilonGreedy:
    """Greedy on the collector's copy of the network, random with a probability that decays
    linearly from 1 to 0.05 over the collector's first ``steps`` env steps."""

    def __init__(self, actions: int, steps: int, seed: int) -> None:
        self.actions, self.steps = actions, steps
        self.rng = np.random.default_rng(seed)

    def __call__(self, model: Any, obs: np.ndarray, step: int) -> np.ndarray:
        eps = max(0.05, 1.0 - 0.95 * step / self.steps)
        explore = np.asarray(self.rng.random(obs.shape[0]) < eps)
        if explore.all():
            return np.asarray(self.rng.integers(self.actions, size=obs.shape[0]))
        with torch.no_grad():
            greedy = model(scaled(obs)).argmax(dim=1).numpy()
        return np.where(explore, self.rng.integers(self.actions, size=obs.shape[0]), greedy)


# -- the learner ---------------------------------------------------------------------------------------
def main(args: Args) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # two cores, two collectors
    env = make_env(args.env_id)
    shape, actions = env.observation_space.shape, int(env.action_space.n)
    env.close()
    envs = args.workers * args.envs_per_worker
    schema = sb.Schema(obs=(shape, "uint8"), action=((), "int64"), reward=((), "float32"),
                       next_obs=(shape, "uint8"), done=((), "bool"), truncated=((), "bool"))
    q = nature_cnn(actions)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr, eps=1.5e-4)
    policy = EpsilonGreedy(actions, args.eps_steps, args.seed)
    start = time.monotonic()
    updates, losses = 0, []
    with sb.ReplayBuffer(schema, args.capacity, envs=envs, next_of="obs", stack="obs", seed=args.seed) as buf, \
            sb.Collector(EnvFactory(args.env_id), buf, workers=args.workers, envs_per_worker=args.envs_per_worker,
                         policy=policy, model=copy.deepcopy(q), seed=args.seed) as collector:
        collector.warm(min(args.learning_starts, args.steps))
        collecting = True
        while time.monotonic() - start < args.max_seconds:
            stats = collector.stats()
            if collecting and stats["env_steps"] >= args.steps:
                # --steps env steps are in: the collectors stop (those in flight finish: a few
                # more), and the learner goes on with the buffer until --updates are done
                collector.stop()
                collecting = False
            if updates >= args.updates and not collecting:
                break
            # -- a DQN update on a batch of stacked transitions, rebuilt from one frame a row ------
            batch = buf.sample(args.batch_size).to("cpu")
            with torch.no_grad():
                bootstrap = target(scaled(batch.next_obs)).max(dim=1).values
                goal = batch.reward.sign() + args.gamma * (~batch.done).float() * bootstrap  # clipped rewards
            taken = q(scaled(batch.obs)).gather(1, batch.action[:, None]).squeeze(1)
            loss = torch.nn.functional.smooth_l1_loss(taken, goal)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            updates += 1
            if updates % args.publish_every == 0 and collecting:
                collector.publish(q)
            if updates % args.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % 250 == 0:
                print(f"{time.monotonic() - start:6.1f}s  env steps {stats['env_steps']:>8,d}  rows {len(buf):>7,d}  "
                      f"updates {updates:>6,d}  loss {np.mean(losses[-250:]):.4f}  return {stats['recent_return']:6.1f}",
                      flush=True)
        collector.stop()
        stats = collector.stats()
        # every stacked transition shifts by one frame: next_obs's older frames are obs's newer ones
        last = buf.sample(args.batch_size)
        shifted = bool(np.array_equal(last.obs[:, 1:], last.next_obs[:, :-1]))
        size = os.path.getsize(path_of(buf.handle.name))
        plain = sum(c.nbytes for c in columns(buf.schema, replace(buf.options, rows=PLAIN)))
        frame = int(np.prod(shape[1:]))
        report = {"env_steps": stats["env_steps"], "episodes": stats["episodes"], "updates": updates,
                  "transitions": len(buf), "rows": buf.stats["inserted"], "bytes_per_row": size / args.capacity,
                  "bytes_per_row_uncompressed": plain / args.capacity, "shifted": shifted,
                  "loss": float(np.mean(losses[-100:])) if losses else float("nan")}
    print(f"{report['env_steps']:,d} env steps in {report['episodes']} episodes by {args.workers} collectors, "
          f"{updates:,d} updates of {args.batch_size} in {time.monotonic() - start:.0f} s, "
          f"mean loss of the last 100 {report['loss']:.4f}")
    print(f"batches: next_obs[:, :-1] == obs[:, 1:] for every sampled transition: {shifted}")
    print(f"bytes per transition: {report['bytes_per_row']:,.0f} with next_of/stack (one {frame:,d}-byte frame a row), "
          f"{report['bytes_per_row_uncompressed']:,.0f} without: "
          f"{report['bytes_per_row_uncompressed'] / report['bytes_per_row']:.1f}x less "
          f"(1,000,000 transitions: {report['bytes_per_row'] * 1e6 / 2**30:.1f} GiB instead of "
          f"{report['bytes_per_row_uncompressed'] * 1e6 / 2**30:.1f} GiB)")
    ratio = report["bytes_per_row_uncompressed"] / report["bytes_per_row"]
    report["ok"] = shifted and ratio > 7
    print(f"{'OK' if report['ok'] else 'FAILED'}: {report['env_steps']:,d} env steps (--steps {args.steps:,d}), "
          f"{updates:,d} updates; {report['bytes_per_row']:,.0f} bytes a transition instead of "
          f"{report['bytes_per_row_uncompressed']:,.0f} ({ratio:.1f}x less), stacks rebuilt intact: {shifted}; "
          f"return of the last episodes {stats['recent_return']:.1f}")
    return report


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse())["ok"] else 1)
