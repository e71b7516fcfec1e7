"""The loader: batches sampled ahead in a thread, on the CPU here and through pinned staging
memory on CUDA (those tests run only where a GPU is present)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import shmbuffer as sb
from shmbuffer.loader import Loader

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_batches(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    with Loader(buf, 32, prefetch=3, batches=10) as loader:
        got = list(loader)
    assert len(got) == 10
    for batch in got:
        assert isinstance(batch.obs, torch.Tensor) and batch.obs.shape == (32, 17)
        seq_of(batch.numpy())
    assert buf.stats["sampled"] >= 320


def test_sample_kwargs_and_priority_feedback(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 16))
    with Loader(buf, 16, replace=False, batches=1) as loader:
        batch = next(iter(loader))
        assert sorted(batch.index.tolist()) == list(range(16)) and batch.weight.dtype == torch.float32
        prios = (batch.index == 3).double()
        assert loader.update_priorities(batch, prios) == 16
    assert set(buf.sample(50).index) == {3}


def test_custom_sampler(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=40, episodes=True, name=name)
    buf.push(transition(0, 40), episode=np.repeat(np.arange(4), 10))
    with Loader(buf, sample=lambda b: b.sample_sequences(4, 5), batches=2) as loader:
        for batch in loader:
            assert batch.obs.shape == (4, 5, 17) and batch.mask.dtype == torch.bool


def test_an_error_in_the_thread_reaches_the_learner(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)  # empty: sampling raises
    loader = Loader(buf, 4)
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        next(loader)
    loader.close()
    assert not loader._thread.is_alive()


def test_close_stops_the_thread(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    loader = Loader(buf, 8, prefetch=2)
    next(loader)
    loader.close()
    loader.close()
    assert not loader._thread.is_alive()


def test_gather_into_given_memory(make: Make, name: str) -> None:
    """The pinned-staging path's gather (``sample(out=)``), checked on plain host memory."""
    buf = make(sb.Schema(img=((2000,), "uint8"), r=((), "float32")), capacity=50, name=name, seed=0)
    for i in range(50):
        buf.push(img=np.full(2000, i, np.uint8), r=float(i))
    out = {"_block": np.empty((16, buf.schema.record.itemsize), np.uint8), "img": np.empty((16, 2000), np.uint8)}
    batch = buf.sample(16, out=out)
    assert np.shares_memory(batch.img, out["img"]) and np.shares_memory(batch.r, out["_block"])
    assert np.array_equal(batch.img[:, 0], batch.r.astype(np.uint8)) and np.array_equal(batch.r, batch.index)


def test_cpu_device_is_refused_for_cuda_without_gpu(make: Make, name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        Loader(buf, 4, device="cuda")


@cuda
@pytest.mark.parametrize("prefetch", [1, 3])
def test_cuda_batches_match_the_buffer(prefetch: int, make: Make, name: str) -> None:
    schema = sb.Schema(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"))
    buf = make(schema, capacity=64, name=name)
    for i in range(64):
        buf.push(obs=np.full((4, 84, 84), i, np.uint8), action=i, reward=float(i))
    with Loader(buf, 32, device="cuda", prefetch=prefetch, batches=20) as loader:
        for batch in loader:
            assert batch.obs.is_cuda and batch.action.is_cuda
            # compute on the consumer's stream: the event ordering makes the data visible
            assert torch.equal(batch.obs[:, 0, 0, 0].long(), batch.action)
            assert torch.equal(batch.reward.long(), batch.action)
            assert torch.equal(batch.index.cpu(), batch.action.cpu())


@cuda
def test_cuda_batches_stay_valid_while_referenced(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=128, name=name)
    buf.push(transition(0, 128))
    with Loader(buf, 64, device="cuda", prefetch=2, batches=12) as loader:
        kept = list(loader)
    torch.cuda.synchronize()
    for batch in kept:
        seq_of(batch.numpy())
