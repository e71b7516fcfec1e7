"""TorchRL's collectors filling a shared ``ShmStorage`` from their worker processes.

    pip install -e ".[torchrl]"
    python examples/torchrl_collector.py [--workers 2] [--total-frames 2000]

A ``MultiSyncCollector`` (``MultiSyncDataCollector`` before TorchRL 0.11) steps CartPole in
``--workers`` processes with a random policy; given ``replay_buffer=``, each worker extends the
TorchRL ``ReplayBuffer`` itself, whose storage is ``shmbuffer.torchrl.ShmStorage``: the rows go
straight into shared memory, none through the main process. The main process then samples
batches from the same buffer. The run checks that every frame arrived and that every stored
transition is whole: a ``StepCounter`` numbers each env's steps, and in every row
``("next", "step_count")`` is ``step_count + 1``. It exits with status 1 otherwise.

What a run at the defaults shows: 2,000 frames from 2 workers, every row whole (the last line
says so, with the batch sampled in the main process); most of its time is the workers' start.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field, fields

import torch

# TorchRL's collectors module warns about a class of its own when imported (torchrl 0.14)
warnings.filterwarnings("ignore", "Creating .* WeightUpdaterBase is deprecated", DeprecationWarning)
from torchrl.collectors import MultiSyncCollector  # noqa: E402
from torchrl.data import ReplayBuffer  # noqa: E402
from torchrl.envs import GymEnv, StepCounter, TransformedEnv  # noqa: E402

from shmbuffer.torchrl import ShmStorage  # noqa: E402


@dataclass
class Args:
    """The example's settings; each is a flag (``--total-frames 400``)."""

    workers: int = field(default=2, metadata={"help": "collector worker processes"})
    total_frames: int = field(default=2000, metadata={"help": "env steps collected in all"})
    frames_per_batch: int = field(default=200, metadata={"help": "env steps a worker collects before it writes"})
    batch_size: int = field(default=64, metadata={"help": "rows the main process samples at a time"})


def make_env() -> TransformedEnv:
    return TransformedEnv(GymEnv("CartPole-v1"), StepCounter())


def main(args: Args) -> bool:
    start = time.monotonic()
    storage = ShmStorage(2 * args.total_frames)
    rb = ReplayBuffer(storage=storage, batch_size=args.batch_size)
    collector = MultiSyncCollector([make_env] * args.workers, policy=None, frames_per_batch=args.frames_per_batch,
                                   total_frames=args.total_frames, replay_buffer=rb)
    try:
        for _ in collector:  # with replay_buffer= the workers write; nothing comes back here
            pass
    finally:
        collector.shutdown()
    held = rb[:]
    steps, next_steps = held["step_count"].squeeze(-1), held["next", "step_count"].squeeze(-1)
    whole = bool((next_steps == steps + 1).all())
    batch = rb.sample()
    seconds = time.monotonic() - start
    ok = len(rb) >= args.total_frames and whole and batch.batch_size == torch.Size([args.batch_size])
    print(f"{'OK' if ok else 'FAILED'}: {len(rb):,d} frames in the shared storage from {args.workers} collector "
          f"workers (--total-frames {args.total_frames:,d}), every row whole: {whole}; sampled "
          f"{list(batch.batch_size)} in the main process; {seconds:.0f} s")
    del held, batch
    storage.close()
    return ok


def parse(argv: list[str] | None = None) -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=f.metadata["help"])
    return Args(**vars(p.parse_args(argv)))


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help; the docstring as written."""


if __name__ == "__main__":
    sys.exit(0 if main(parse()) else 1)
