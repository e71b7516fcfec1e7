"""The demo: a DQN with prioritized replay on CartPole-v1, fed by collector processes.

    shmbuffer demo [--seed 1] [--workers 2] [--max-seconds 170] ...

Two worker processes step 4 CartPole envs each with an epsilon-greedy copy of the
Q-network and push every transition into a shared buffer (one lane per env, episode
ids, so that 3-step returns can be formed at sample time; the capacity is rounded up
to a multiple of the envs). The learner samples prioritized batches through a
``Loader`` (prefetched in a thread; on a GPU through pinned memory), trains a double
DQN with importance weights, sends the TD errors back as priorities, and publishes its
weights to the workers. A rate limiter holds the collectors to ``samples_per_insert``
so that on two cores the learner is not starved. Every ``eval_every`` updates the
greedy policy is evaluated on separate envs; the run ends when it averages ``target``
(300: about 14 times random play's 22) over ``eval_episodes`` episodes, or after
``max_seconds``; ``--target 475`` asks for CartPole's bar.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass
class Args:
    """The demo's settings; each is a flag of ``shmbuffer demo`` (``--batch-size 64``)."""

    seed: int = field(default=1, metadata={"help": "seeds torch, numpy, the envs and the buffer's sampling"})
    workers: int = field(default=2, metadata={"help": "collector processes"})
    envs_per_worker: int = field(default=4, metadata={"help": "CartPole envs each worker steps (one buffer lane each)"})
    capacity: int = field(default=100_000, metadata={"help": "rows the buffer holds (rounded up to a multiple of the envs)"})
    batch_size: int = field(default=128, metadata={"help": "rows per learner batch"})
    lr: float = field(default=1e-3, metadata={"help": "Adam's learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    n_step: int = field(default=3, metadata={"help": "steps of the n-step return formed at sample time"})
    hidden: int = field(default=128, metadata={"help": "width of the Q-network's two hidden layers"})
    tau: float = field(default=0.01, metadata={"help": "Polyak rate of the target network, per update"})
    learning_starts: int = field(default=2_000, metadata={"help": "rows the buffer holds before the first update"})
    samples_per_insert: float = field(default=16.0, metadata={"help": "rate limiter: rows sampled per row inserted"})
    eps_start: float = field(default=1.0, metadata={"help": "epsilon of the collectors' epsilon-greedy policy at the start"})
    eps_end: float = field(default=0.02, metadata={"help": "epsilon after eps_steps env steps"})
    eps_steps: int = field(default=15_000, metadata={"help": "env steps (all workers) over which epsilon decays linearly"})
    publish_every: int = field(default=25, metadata={"help": "updates between publishing the weights to the collectors"})
    eval_every: int = field(default=1_000, metadata={"help": "updates between greedy evaluations"})
    eval_episodes: int = field(default=20, metadata={"help": "episodes of each evaluation"})
    target: float = field(default=300.0, metadata={"help": "mean evaluation return that ends the run as learned "
                                                     "(random play scores about 22; CartPole's bar is 475)"})
    max_seconds: float = field(default=170.0, metadata={"help": "wall-clock limit of the run"})
    device: str = field(default="cpu", metadata={"help": "torch device of the learner (cuda for a GPU)"})


# -- the Q-network and the collectors' policy ----------------------------------------------------
def make_env() -> Any:
    """The demo's environment: Gymnasium's ``CartPole-v1``."""
    import gymnasium as gym

    return gym.make("CartPole-v1")


def q_network(obs_dim: int, actions: int, hidden: int) -> Any:
    """The demo's Q-network: an MLP with two hidden ReLU layers of ``hidden`` units."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(obs_dim, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, actions),
    )


class EpsilonGreedy:
    """Greedy on the worker's copy of the Q-network, random with a probability that decays
    linearly from ``start`` to ``end`` over the worker's first ``steps`` env steps."""

    def __init__(self, start: float, end: float, steps: int, actions: int, seed: int) -> None:
        self.start, self.end, self.steps, self.actions = start, end, steps, actions
        self.rng = np.random.default_rng(seed)

    def __call__(self, model: Any, obs: np.ndarray, step: int) -> np.ndarray:
        import torch

        eps = self.end + (self.start - self.end) * max(0.0, 1.0 - step / self.steps)
        with torch.no_grad():
            greedy = model(torch.from_numpy(np.asarray(obs, np.float32))).argmax(dim=1).numpy()
        explore = self.rng.random(obs.shape[0]) < eps
        return np.where(explore, self.rng.integers(self.actions, size=obs.shape[0]), greedy)


def evaluate(model: Any, episodes: int, seed: int) -> np.ndarray:
    """Returns of ``episodes`` greedy episodes on fresh envs."""
    import torch

    device = next(model.parameters()).device  # the learner's model: on the GPU with --device cuda
    env = make_env()
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                action = int(model(torch.from_numpy(obs[None]).to(device)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return np.array(returns)


# -- the learner ----------------------------------------------------------------------------------
def buffer_size(capacity: int, envs: int) -> tuple[int, int]:
    """The buffer's capacity and lanes: one lane per env, so that each env's steps are consecutive
    rows, which n-step returns need (in a shared lane the envs' steps interleave and every return
    is cut to one step). The capacity is rounded up to a multiple of the envs."""
    if envs < 1:
        raise ValueError(f"demo: expected at least one env, got workers * envs_per_worker = {envs}")
    return -(-capacity // envs) * envs, envs


def main(args: Args) -> dict[str, Any]:
    """Run the demo with these settings; returns its summary (``solved``, the mean evaluation return, timings)."""
    import torch

    import shmbuffer as sb
    from shmbuffer.collector import Collector
    from shmbuffer.loader import Loader

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # two cores, two collectors: more threads only contend
    env = make_env()
    obs_dim, actions = env.observation_space.shape[0], int(env.action_space.n)
    env.close()
    device = torch.device(args.device)
    q = q_network(obs_dim, actions, args.hidden)
    target = copy.deepcopy(q)
    q, target = q.to(device), target.to(device)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    schema = sb.Schema(obs=((obs_dim,), "float32"), action=((), "int64"), reward=((), "float32"),
                       next_obs=((obs_dim,), "float32"), done=((), "bool"))
    envs = args.workers * args.envs_per_worker
    limiter = sb.RateLimiter(samples_per_insert=args.samples_per_insert, min_size=args.learning_starts,
                             error=args.samples_per_insert * args.learning_starts, block_writers=True)
    capacity, lanes = buffer_size(args.capacity, envs)
    if capacity != args.capacity:
        print(f"capacity {args.capacity:,d} rounded up to {capacity:,d}: a multiple of the {envs} envs "
              "(one lane each, for the n-step returns)", flush=True)
    policy = EpsilonGreedy(args.eps_start, args.eps_end, args.eps_steps, actions, args.seed)
    start = time.monotonic()
    report: dict[str, Any] = {"seed": args.seed, "solved": False}
    with sb.ReplayBuffer(schema, capacity, sampler=sb.Prioritized(alpha=0.6, beta=0.4, beta_steps=20_000),
                         lanes=lanes, episodes=True, limiter=limiter, seed=args.seed) as buf, \
            Collector(make_env, buf, workers=args.workers, envs_per_worker=args.envs_per_worker,
                      policy=policy, model=copy.deepcopy(q).cpu(), seed=args.seed) as collector:
        collector.warm(args.learning_starts)
        loader = Loader(buf, args.batch_size, device=device, prefetch=2, collector=collector,
                        n_step=args.n_step, gamma=args.gamma, timeout=30.0)
        best, best_state, updates, last_line, evals = -np.inf, None, 0, 0.0, []
        with loader:
            for batch in loader:
                obs, act = batch.obs.float(), batch.action.long()
                q_taken = q(obs).gather(1, act[:, None]).squeeze(1)
                with torch.no_grad():
                    next_obs = batch.next_obs.float()
                    best_next = q(next_obs).argmax(dim=1, keepdim=True)
                    bootstrap = target(next_obs).gather(1, best_next).squeeze(1)
                    discount = args.gamma ** batch.steps.float()
                    goal = batch.reward + discount * (~batch.done).float() * bootstrap
                td = goal - q_taken
                loss = (batch.weight * torch.nn.functional.smooth_l1_loss(q_taken, goal, reduction="none")).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(q.parameters(), 10.0)
                opt.step()
                loader.update_priorities(batch, td.detach().abs())
                with torch.no_grad():
                    for p, tp in zip(q.parameters(), target.parameters(), strict=True):
                        tp.lerp_(p, args.tau)
                updates += 1
                if updates % args.publish_every == 0:
                    collector.publish(q)
                elapsed = time.monotonic() - start
                if updates % args.eval_every == 0:
                    returns = evaluate(q, 5, seed=10_000 + updates)
                    evals.append(float(returns.mean()))
                    if returns.mean() >= best:
                        best, best_state = float(returns.mean()), copy.deepcopy(q.state_dict())
                    if returns.mean() >= args.target:
                        full = evaluate(q, args.eval_episodes, seed=50_000 + updates)
                        if full.mean() >= args.target:
                            report.update(solved=True, eval_returns=full)
                            break
                if elapsed - last_line >= 1.0 or updates == 1:
                    last_line = elapsed
                    _line(elapsed, collector.stats(), buf, updates, evals)
                if elapsed > args.max_seconds:
                    break
        collector.stop()
        stats = collector.stats()
        if not report["solved"]:
            if best_state is not None:
                q.load_state_dict(best_state)
            report["eval_returns"] = evaluate(q, args.eval_episodes, seed=90_000)
            report["solved"] = bool(report["eval_returns"].mean() >= args.target)
        report.update(seconds=time.monotonic() - start, updates=updates, env_steps=stats["env_steps"],
                      episodes=stats["episodes"], rows=len(buf), sampled=buf.stats["sampled"])
    _summary(report, args)
    return report


def _line(elapsed: float, stats: dict[str, Any], buf: Any, updates: int, evals: list[float]) -> None:
    recent = stats["recent_return"]
    line = (f"{elapsed:6.1f}s  env steps {stats['env_steps']:>8,d} ({stats['env_steps'] / max(elapsed, 1e-9):,.0f}/s)  "
            f"buffer {len(buf):>7,d}  updates {updates:>6,d} ({updates / max(elapsed, 1e-9):,.0f}/s)  "
            f"return {_num(recent)}  eval {_num(evals[-1] if evals else None)}")
    end = "\r" if sys.stdout.isatty() else "\n"
    print(line, end=end, flush=True)


def _num(x: float | None) -> str:
    """A return, or ``-`` before there is one (no episode ended, no evaluation yet)."""
    return f"{'-':>6}" if x is None or not np.isfinite(x) else f"{x:6.1f}"


SOLVED = 475.0
"""CartPole-v1's bar (Gymnasium's reward threshold): a run whose evaluation averages it says SOLVED."""


def _summary(report: dict[str, Any], args: Args) -> None:
    returns = report["eval_returns"]
    print()
    verdict = "NOT LEARNED" if not report["solved"] else "SOLVED" if returns.mean() >= SOLVED else "LEARNED"
    print(f"{verdict}: mean evaluation return {returns.mean():.1f} "
          f"+- {returns.std():.1f} over {returns.size} episodes (target {args.target:g}), seed {args.seed}")
    print(f"{report['seconds']:.0f} s, {report['env_steps']:,d} env steps in {report['episodes']:,d} episodes "
          f"by {args.workers} collector processes, {report['updates']:,d} updates of {args.batch_size} rows "
          f"({report['sampled']:,d} rows sampled, {args.n_step}-step prioritized replay)")


def parse(argv: list[str] | None = None) -> Args:
    """The demo's settings from command-line arguments (``shmbuffer demo --help`` lists them)."""
    p = argparse.ArgumentParser(prog="shmbuffer demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f"{f.metadata['help']} (default: {f.default})")
    return Args(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    result = main(parse())
    sys.exit(0 if result["solved"] else 1)
