"""A recurrent (R2D2-style) Q-learner on sequences with burn-in, on a partially observed CartPole.

    python examples/r2d2.py [--updates 2000] [--seconds 120]

The agent sees only the cart position and the pole angle (no velocities), so it needs memory. Each
env writes into its own lane with episode ids; the learner samples time-major windows of
``burn_in + length`` steps (``sample_sequences``), runs the LSTM over the burn-in part without
gradients to warm up its state (R2D2's stored-state burn-in), and trains on the rest with a
masked loss: ``batch.mask`` is False past an episode's end and before its start.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

import shmbuffer as sb


@dataclass
class Args:
    envs: int = 4
    capacity: int = 40_000
    batch_size: int = 32
    length: int = 16
    burn_in: int = 8
    hidden: int = 64
    lr: float = 1e-3
    gamma: float = 0.99
    updates: int = 2_000
    seconds: float = 120.0
    seed: int = 0


VISIBLE = [0, 2]  # cart position, pole angle


class RecurrentQ(torch.nn.Module):
    def __init__(self, hidden: int, actions: int) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(len(VISIBLE), hidden)
        self.head = torch.nn.Linear(hidden, actions)

    def forward(self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None):  # type: ignore[no-untyped-def]
        out, state = self.lstm(obs, state)  # obs: (T, B, features), time-major
        return self.head(out), state


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    envs = [gym.make("CartPole-v1") for _ in range(args.envs)]
    schema = sb.Schema(obs=((len(VISIBLE),), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((len(VISIBLE),), "float32"), done=((), "bool"))
    q = RecurrentQ(args.hidden, 2)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    with sb.ReplayBuffer(schema, args.capacity, lanes=args.envs, episodes=True, seed=args.seed) as buf:
        # -- acting: one lane per env, an episode id per episode, the LSTM state per env ----------
        obs = np.stack([e.reset(seed=args.seed + i)[0][VISIBLE] for i, e in enumerate(envs)])
        episode = np.arange(args.envs) * 1_000_000
        state = None
        returns, ret = [], np.zeros(args.envs)
        updates, start = 0, time.monotonic()
        while updates < args.updates and time.monotonic() - start < args.seconds:
            with torch.no_grad():
                values, state = q(torch.from_numpy(obs)[None], state)
            eps = max(0.05, 1.0 - updates / (0.5 * args.updates))
            action = np.where(rng.random(args.envs) < eps, rng.integers(2, size=args.envs), values[0].argmax(1).numpy())
            steps = [e.step(int(a)) for e, a in zip(envs, action, strict=True)]
            next_obs = np.stack([s[0][VISIBLE] for s in steps])
            reward = np.array([s[1] for s in steps], np.float32)
            terminated = np.array([s[2] for s in steps])
            ended = terminated | np.array([s[3] for s in steps])
            buf.push(obs=obs, action=action, reward=reward, next_obs=next_obs, done=terminated,
                     lane=np.arange(args.envs), episode=episode)
            ret += reward
            for i in np.flatnonzero(ended):  # a new episode: new id, fresh observation and LSTM state
                returns.append(ret[i])
                ret[i] = 0
                episode[i] += 1
                next_obs[i] = envs[i].reset()[0][VISIBLE]
                state[0][:, i] = 0  # type: ignore[index]
                state[1][:, i] = 0  # type: ignore[index]
            obs = next_obs
            if len(buf) < 1_000:
                continue

            # -- learning: time-major windows, burn-in without gradients, masked TD loss -------------
            batch = buf.sample_sequences(args.batch_size, args.length, burn_in=args.burn_in, time_major=True).to("cpu")
            mask = batch.mask[args.burn_in:].float()
            with torch.no_grad():
                _, warm = q(batch.obs[: args.burn_in])  # R2D2's burn-in: warm the state up
                next_q, _ = q(batch.next_obs[args.burn_in:], warm)
                goal = batch.reward[args.burn_in:] + args.gamma * (~batch.done[args.burn_in:]).float() * next_q.max(-1).values
            values_now, _ = q(batch.obs[args.burn_in:], warm)
            taken = values_now.gather(-1, batch.action[args.burn_in:, :, None]).squeeze(-1)
            loss = ((taken - goal) ** 2 * mask).sum() / mask.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1
            if updates % 250 == 0:
                print(f"update {updates:5d}  loss {loss.item():8.4f}  mean return (last 20) {np.mean(returns[-20:]):6.1f}  "
                      f"rows {len(buf)}  steps kept per window {mask.sum(0).mean().item():.1f}/{args.length}")
        print(f"{updates} updates, {len(returns)} episodes, mean return of the last 20: {np.mean(returns[-20:]):.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, default in vars(Args()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    main(Args(**vars(p.parse_args())))
