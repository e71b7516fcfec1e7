"""shmbuffer.torchrl: a TorchRL Storage whose rows live in a shmbuffer. The contract is TorchRL's
storage one: its ReplayBuffer, samplers and writers work on it, set/get/len/state_dict behave as
for LazyTensorStorage; and writers in other processes lose or tear no row."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl")
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement

from shmbuffer.torchrl import ShmStorage, identity


def rows(start: int, k: int) -> TensorDict:
    """``k`` self-verifying rows: every value derives from the row's sequence number."""
    seq = torch.arange(start, start + k)
    return TensorDict({"obs": seq[:, None].float() + torch.arange(4.0), "action": seq, "next": {"obs": seq[:, None].float() + 1}},
                      batch_size=[k])


def check(td: TensorDict) -> torch.Tensor:
    seq = td["action"]
    assert torch.equal(td["obs"], seq[:, None].float() + torch.arange(4.0))
    assert torch.equal(td["next", "obs"], seq[:, None].float() + 1)
    return seq


@pytest.fixture
def storages() -> Iterator[list[ShmStorage]]:
    made: list[ShmStorage] = []
    yield made
    for s in made:
        s.close()


def test_matches_lazy_tensor_storage(name: str, storages: list[ShmStorage]) -> None:
    """The same extends into TorchRL's LazyTensorStorage and ours hold the same rows in the same
    slots (wrapping included), so any sampler's indices give the same rows."""
    ours = ShmStorage(10, name=name)
    storages.append(ours)
    theirs = LazyTensorStorage(10)
    rb_ours = ReplayBuffer(storage=ours, collate_fn=identity)
    rb_theirs = ReplayBuffer(storage=theirs)
    for start, k in [(0, 3), (3, 4), (7, 1), (8, 5), (13, 2)]:  # 15 rows into 10 slots
        assert rb_ours.extend(rows(start, k)).tolist() == rb_theirs.extend(rows(start, k)).tolist()
        assert len(ours) == len(theirs)
    index = torch.tensor([0, 9, 3, 3, 5])
    got, expected = ours.get(index), theirs.get(index)
    assert torch.equal(got["action"], expected["action"]) and torch.equal(got["next", "obs"], expected["next", "obs"])
    check(got)
    assert set(check(ours.get(slice(None))).tolist()) == set(range(5, 15))
    one = ours.get(4)
    assert one.batch_size == torch.Size([]) and one["action"] == theirs.get(4)["action"]
    assert ours.contains(9) and not ours.contains(10)
    with pytest.raises(IndexError):
        ours.get(torch.tensor([10]))


@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_torchrl_samplers_on_it(sampler: Any, name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(64, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, sampler=sampler(), collate_fn=identity, batch_size=16)
    rb.extend(rows(0, 48))  # whole batches: without replacement, an epoch's last batch is short
    seen = set()
    for _ in range(5):
        batch = rb.sample()
        assert batch.batch_size == torch.Size([16])
        seen |= set(check(batch).tolist())
    assert seen <= set(range(48)) and len(seen) > 16


def test_add_single_rows_and_state_dict(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, collate_fn=identity)
    for i in range(3):
        rb.add(rows(i, 1)[0])
    assert len(storage) == 3 and check(storage.get(slice(None))).tolist() == [0, 1, 2]
    state = storage.state_dict()
    copy = ShmStorage(8, name=name + "c")
    storages.append(copy)
    copy.load_state_dict(state)
    assert check(copy.get(slice(None))).tolist() == [0, 1, 2]
    rb.empty()
    assert len(storage) == 0


def _writer(rb: ReplayBuffer, start: int, pushes: int, k: int) -> None:
    for p in range(pushes):
        rb.extend(rows(start + p * k, k))
    rb.storage.buffer.close()


def test_writers_in_other_processes_lose_and_tear_nothing(name: str, storages: list[ShmStorage], procs: list[Any]) -> None:
    """Two processes extend the same storage at once, each with its copy of one ReplayBuffer (so
    their round-robin writers' cursors collide): every row of both is there, whole, once."""
    storage = ShmStorage(4000, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage)
    rb.extend(rows(100_000, 1))  # creates the shared buffer before it travels
    ctx = mp.get_context("spawn")
    for start in (0, 10_000):
        procs.append(ctx.Process(target=_writer, args=(rb, start, 150, 8)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    seq = check(storage.get(slice(None)))
    assert len(storage) == 1 + 2 * 150 * 8
    assert sorted(seq.tolist()) == [*range(1200), *range(10_000, 11_200), 100_000]


def test_dumps_and_loads_and_tensordict_replay_buffer(name: str, storages: list[ShmStorage], tmp_path: Any) -> None:
    from torchrl.data import TensorDictReplayBuffer

    storage = ShmStorage(16, name=name)
    storages.append(storage)
    rb = TensorDictReplayBuffer(storage=storage, collate_fn=identity, batch_size=4)
    rb.extend(rows(0, 10))
    batch = rb.sample()
    assert torch.equal(storage.get(batch["index"])["action"], batch["action"])  # the sampled slots' rows
    check(batch)
    storage.dumps(tmp_path / "s")
    other = ShmStorage(16, name=name + "o")
    storages.append(other)
    other.loads(tmp_path / "s")
    assert check(other.get(slice(None))).tolist() == list(range(10))
    assert other.get(slice(None))["next", "obs"].shape == (10, 1)
