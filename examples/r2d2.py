"""A recurrent (R2D2-style) Q-learner on sequences with burn-in, on a partially observed CartPole.

    python examples/r2d2.py [--updates 2500] [--seconds 175] [--seed 0]

The agent sees the cart position, the pole angle and the pole's angular velocity, not the cart's
velocity: it reads that from consecutive positions, so it needs memory. Each env writes into its
own lane with episode ids; the learner samples time-major windows of ``burn_in + length`` steps
(``sample_sequences``), runs the LSTM over the burn-in part without gradients to warm up its state
(R2D2's stored-state burn-in), and trains on the rest with a masked loss: ``batch.mask`` is False
past an episode's end and before its start.

The hidden state is used as when acting: an episode starts from a zero state (``unroll`` keeps it
at zero over the padding before an episode's start), and the value of the observation after step
``t`` is read from the same unroll one step later (a target network's, picked by the online one:
double DQN), so it has seen every observation before it. Targets are n-step returns within the
window (``n_step_targets``); a step whose episode leaves the window without ending (a lane's
newest row) is left out of the loss.

What a run at the defaults shows: the mean return of the last 20 episodes starts near random
play (about 20), and the last line is the verdict, ``LEARNED: mean return of the last 20 episodes
R (the first 20: F; target 100), 2500 updates, E episodes, S s`` when it reaches ``--target``. The
learner is sensitive to its seed at this length (with ``--seed 1`` one run stayed near random
play), and a busy machine may end the run at ``--seconds`` first. It exits with status 1
(``NOT LEARNED``) when that mean stays below ``--target``, also when ``--seconds`` ran out first. With both velocities hidden
(``VISIBLE = [0, 2]``) the same learner stays near random play (about 20) for the 2,500 updates:
that needs far more experience than an example's few minutes.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field, fields

import gymnasium as gym
import numpy as np
import torch

import shmbuffer as sb


@dataclass
class Args:
    """The example's settings; each is a flag (``--batch-size 64``)."""

    envs: int = field(default=4, metadata={"help": "CartPole envs stepped in turn, one buffer lane each"})
    capacity: int = field(default=40_000, metadata={"help": "rows the buffer holds (a multiple of the envs)"})
    batch_size: int = field(default=32, metadata={"help": "windows per learner batch"})
    length: int = field(default=16, metadata={"help": "trained steps per window"})
    burn_in: int = field(default=8, metadata={"help": "steps before each window that only warm the LSTM state up"})
    hidden: int = field(default=64, metadata={"help": "LSTM width"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.95, metadata={"help": "discount"})
    n_step: int = field(default=2, metadata={"help": "rewards summed before bootstrapping (R2D2's n-step returns)"})
    target_every: int = field(default=50, metadata={"help": "updates between target network copies"})
    learning_starts: int = field(default=1_000, metadata={"help": "rows pushed before the first update"})
    updates: int = field(default=2_500, metadata={"help": "learner updates"})
    act_steps: int = field(default=8, metadata={"help": "steps of every env between two updates"})
    explore: float = field(default=0.6, metadata={"help": "share of the updates over which epsilon decays from 1 to 0.05"})
    seconds: float = field(default=175.0, metadata={"help": "wall-clock limit"})
    target: float = field(default=100.0, metadata={"help": "mean return of the last 20 episodes that counts as learned"})
    seed: int = field(default=0, metadata={"help": "seeds torch, numpy, the envs and the buffer's sampling"})


VISIBLE = [0, 2, 3]  # cart position, pole angle, pole angular velocity: not the cart velocity
SCALE = {0: 1 / 2.4, 1: 1 / 2.0, 2: 1 / 0.21, 3: 1 / 2.0}  # each observation to about [-1, 1]


class RecurrentQ(torch.nn.Module):
    def __init__(self, hidden: int, actions: int) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(len(VISIBLE), hidden)
        self.head = torch.nn.Linear(hidden, actions)
        # the position and the angle to about [-1, 1]: the LSTM reads the velocities from the
        # differences of consecutive steps, a hundredth of the raw angle's range
        self.register_buffer("scale", torch.tensor([SCALE[i] for i in VISIBLE]))

    def forward(self, obs: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None):  # type: ignore[no-untyped-def]
        out, state = self.lstm(obs * self.scale, state)  # obs: (T, B, features), time-major
        return self.head(out), state


def unroll(q: RecurrentQ, obs: torch.Tensor, valid: torch.Tensor, state=None):  # type: ignore[no-untyped-def]
    """Q-values of ``obs`` (T, B, features), one step at a time: where ``valid`` is False (the
    padding before an episode's start) the state goes back to zero, so an episode starts from a
    zero state, as when acting."""
    out = []
    for t in range(obs.shape[0]):
        y, (h, c) = q.lstm(obs[t:t + 1] * q.scale, state)
        keep = valid[t].float()[None, :, None]
        state = (h * keep, c * keep)
        out.append(y)
    return q.head(torch.cat(out)), state


def n_step_targets(reward: torch.Tensor, done: torch.Tensor, mask: torch.Tensor, value: torch.Tensor, b: int,
                   n: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """R2D2's n-step targets of the steps ``b:`` of time-major windows, and which steps have one.

    ``value[p]`` is the value of the observation at position ``p`` (``T + 1`` of them: the last
    is the window's last ``next_obs``). A step's target sums up to ``n`` rewards of its episode in
    the window and bootstraps from the value ``n`` steps on (or at the window's end, sooner); an
    episode's end stops it without bootstrap. A step whose episode leaves the window without ending
    (a lane's newest row, a time limit) has no target here."""
    T, L = reward.shape[0], reward.shape[0] - b
    has = torch.cat([mask, mask[-1:]])  # the positions holding an observation
    goal = torch.zeros_like(value[b:T])
    ok = torch.zeros_like(mask[b:])
    alive = mask[b:].clone()  # still summing rewards
    j = torch.arange(L)
    for k in range(n):
        at = (j + k).clamp(max=L - 1) + b  # the step k after each trained step (clamped: masked by alive)
        alive = alive & (j + k < L)[:, None]
        goal += gamma ** k * reward[at] * alive
        ended = alive & done[at]
        nxt = has[at + 1]
        last = ((k == n - 1) | (at + 1 >= T))[:, None]  # n rewards summed, or the window's rows run out
        boot = alive & ~done[at] & nxt & last
        goal += gamma ** (k + 1) * value[at + 1] * boot
        ok |= ended | boot
        alive = alive & ~done[at] & nxt & ~last
    return goal, ok


def main(args: Args) -> dict[str, float]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    envs = [gym.make("CartPole-v1") for _ in range(args.envs)]
    schema = sb.Schema(obs=((len(VISIBLE),), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((len(VISIBLE),), "float32"), done=((), "bool"))
    q = RecurrentQ(args.hidden, 2)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    b = args.burn_in
    with sb.ReplayBuffer(schema, args.capacity, lanes=args.envs, episodes=True, seed=args.seed) as buf:
        # -- acting: one lane per env, an episode id per episode, the LSTM state per env ----------
        obs = np.stack([e.reset(seed=args.seed + i)[0][VISIBLE] for i, e in enumerate(envs)])
        episode = np.arange(args.envs) * 1_000_000
        state = None
        returns: list[float] = []
        ret = np.zeros(args.envs)
        updates, start = 0, time.monotonic()
        while updates < args.updates and time.monotonic() - start < args.seconds:
            for _ in range(args.act_steps):  # every env steps act_steps times between updates
                with torch.no_grad():
                    values, state = q(torch.from_numpy(obs)[None], state)
                eps = max(0.05, 1.0 - 0.95 * updates / (args.explore * args.updates))
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
                    returns.append(float(ret[i]))
                    ret[i] = 0
                    episode[i] += 1
                    next_obs[i] = envs[i].reset()[0][VISIBLE]
                    state[0][:, i] = 0  # type: ignore[index]
                    state[1][:, i] = 0  # type: ignore[index]
                obs = next_obs
            if len(buf) < args.learning_starts:
                continue

            # -- learning: time-major windows, burn-in without gradients, masked TD loss -------------
            batch = buf.sample_sequences(args.batch_size, args.length, burn_in=b, time_major=True).to("cpu")
            mask = batch.mask
            with torch.no_grad():
                _, warm = unroll(q, batch.obs[:b], mask[:b])  # R2D2's burn-in: warm the state up
                # the target net over the whole window plus the last step's next observation: the
                # value of the observation after step t is its output at t + 1, having seen obs[<= t]
                seq, valid = torch.cat([batch.obs, batch.next_obs[-1:]]), torch.cat([mask, mask[-1:]])
                after, _ = unroll(target, seq, valid)
                best, _ = unroll(q, seq, valid)  # double DQN: the online net picks, the target net values
                value = after.gather(-1, best.argmax(-1, keepdim=True)).squeeze(-1)
                goal, train = n_step_targets(batch.reward, batch.done, mask, value, b, args.n_step, args.gamma)
            values_now, _ = unroll(q, batch.obs[b:], mask[b:], warm)
            taken = values_now.gather(-1, batch.action[b:, :, None]).squeeze(-1)
            train = train.float()
            loss = (torch.nn.functional.smooth_l1_loss(taken, goal, reduction="none") * train).sum() / train.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(q.parameters(), 10.0)
            opt.step()
            updates += 1
            if updates % args.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % 250 == 0:
                print(f"update {updates:5d}  loss {loss.item():8.4f}  mean return (last 20) {np.mean(returns[-20:]):6.1f}  "
                      f"rows {len(buf)}  steps kept per window {mask[b:].sum(0).float().mean().item():.1f}/{args.length}",
                      flush=True)
        seconds = time.monotonic() - start
    last = float(np.mean(returns[-20:])) if returns else 0.0
    first = float(np.mean(returns[:20])) if returns else 0.0
    verdict = "LEARNED" if last >= args.target else "NOT LEARNED"
    print(f"{verdict}: mean return of the last 20 episodes {last:.1f} (the first 20: {first:.1f}; target {args.target:g}), "
          f"{updates} updates, {len(returns)} episodes, {seconds:.0f} s")
    return {"last": last, "first": first, "updates": updates, "seconds": seconds}


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    args = parse()
    sys.exit(0 if main(args)["last"] >= args.target else 1)
