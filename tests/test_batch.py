"""``Batch`` (batch.py): fields and extras by attribute and by key, slicing, dicts, TensorDicts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import shmbuffer as sb
from shmbuffer.loader import aligned_outs

from .conftest import MUJOCO, transition

Make = Callable[..., sb.ReplayBuffer]


def test_batch_slicing_fields_and_dict(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, sampler=sb.Prioritized(), name=name, seed=0)
    buf.push(transition(0, 10))
    batch = buf.sample(6)
    head = batch[:2]
    assert len(head) == 2 and isinstance(head, sb.Batch)
    assert np.array_equal(head.obs, batch.obs[:2]) and np.array_equal(head.index, batch.index[:2])
    assert np.array_equal(head.weight, batch.weight[:2])
    picked = batch[np.array([5, 0])]
    assert np.array_equal(picked.reward, batch.reward[[5, 0]])
    masked = batch[batch.reward > 4]
    assert np.array_equal(masked.index, batch.index[batch.reward > 4])
    one = batch[3]
    assert one.obs.shape == (17,) and one.index == batch.index[3]
    t = batch.to("cpu")[torch.tensor([1, 2])]
    assert torch.equal(t.obs, torch.from_numpy(batch.obs[[1, 2]]))
    with pytest.raises(IndexError, match="6 rows"):
        batch[7]
    d = dict(batch)
    assert set(d) == {*MUJOCO.names, "index", "weight"}
    assert batch.keys() == [*MUJOCO.names, "index", "weight"]
    # a learner-side field
    batch["advantage"] = np.arange(6.0)
    batch.ret = np.ones(6)
    assert np.array_equal(batch.advantage, np.arange(6.0)) and np.array_equal(batch["ret"], np.ones(6))
    assert np.array_equal(batch[:3].advantage, np.arange(3.0))
    assert torch.equal(batch.to("cpu").advantage, torch.arange(6.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"one value per row \(6, ...\)"):
        batch["bad"] = np.arange(5)
    batch["reward"] = np.zeros(6, np.float32)  # replacing a field
    assert not batch.to("cpu").reward.any()


def test_batch_to_tensordict(make: Make, name: str) -> None:
    pytest.importorskip("tensordict")
    buf = make(MUJOCO, capacity=16, name=name, seed=0)
    buf.push(transition(0, 10))
    batch = buf.sample(5)
    td = batch.to_tensordict()
    assert td.batch_size == torch.Size([5])
    assert torch.equal(td["obs"], torch.from_numpy(batch.obs)) and torch.equal(td["index"], torch.from_numpy(batch.index))
    assert set(td.keys()) == {*MUJOCO.names, "index"}


# -- JAX ------------------------------------------------------------------------------------------
FRAMES = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                   frame=((84, 84), "uint8"), done=((), "bool"))


def _frames_buffer(make: Make, name: str) -> sb.ReplayBuffer:
    buf = make(FRAMES, capacity=64, name=name, seed=0)
    for i in range(40):
        buf.push(obs=np.full(4, i, np.float32), action=i, reward=float(i), frame=np.full((84, 84), i, np.uint8),
                 done=i % 7 == 6)
    return buf


def test_aligned_outs_are_gathered_into_aligned_for_xla(make: Make, name: str, path: str) -> None:
    buf = _frames_buffer(make, name)
    for n in (1, 5, 32):
        outs = aligned_outs(buf, n)
        assert outs is not None and set(outs) == {"_block", "frame"}
        batch = buf.sample(n, out=outs)
        assert batch.frame.ctypes.data % sb.batch.ALIGN == 0 and batch.block.ctypes.data % sb.batch.ALIGN == 0
        assert np.shares_memory(batch.frame, outs["frame"])
        assert (batch.frame[:, 0, 0] == batch.index).all()  # row i holds i


def test_to_jax_shares_the_large_fields_memory_on_the_cpu(make: Make, name: str, path: str) -> None:
    jax = pytest.importorskip("jax")
    buf = _frames_buffer(make, name)
    batch = buf.sample(16, out=aligned_outs(buf, 16))
    got = batch.to_jax()
    assert got.keys() == batch.keys()
    assert all(isinstance(v, jax.Array) for v in got.values())
    assert got.frame.unsafe_buffer_pointer() == batch.frame.ctypes.data  # the same memory: no copy
    for key in ("obs", "reward", "done", "frame"):
        assert np.array_equal(np.asarray(got[key]), batch[key]), key
    assert np.array_equal(np.asarray(got.action), batch.action)  # int64 (int32 without jax_enable_x64)
    batch.frame[0, 0, 0] = 200  # shared: JAX sees a write to the batch (which the docs ask not to do)
    assert int(got.frame[0, 0, 0]) == 200
    plain = buf.sample(16)  # numpy's memory, 16-byte aligned: XLA may copy it, the values are the same
    assert np.array_equal(np.asarray(plain.to_jax().frame), plain.frame)


def test_to_jax_keeps_the_batch_memory_alive(make: Make, name: str) -> None:
    pytest.importorskip("jax")
    import gc
    import weakref

    buf = _frames_buffer(make, name)
    batch = buf.sample(8, out=aligned_outs(buf, 8))
    want = batch.frame.copy()
    alive = weakref.ref(batch.frame.base)  # the allocation the aligned frame is a view of
    frame = batch.to_jax().frame
    del batch
    gc.collect()
    assert alive() is not None  # the JAX array holds the gathered memory
    assert bool((frame == want).all())
    del frame
    gc.collect()
    assert alive() is None


def test_to_jax_to_a_device_and_from_torch(make: Make, name: str) -> None:
    jax = pytest.importorskip("jax")
    buf = _frames_buffer(make, name)
    batch = buf.sample(8)
    cpu = jax.devices("cpu")[0]
    moved = batch.to_jax(cpu)
    assert all(v.devices() == {cpu} for v in moved.values())
    assert np.array_equal(np.asarray(moved.obs), batch.obs)
    tensors = buf.sample(8, out=aligned_outs(buf, 8)).to("cpu")
    from_torch = tensors.to_jax()
    assert from_torch.frame.unsafe_buffer_pointer() == tensors.frame.data_ptr()
    assert np.array_equal(np.asarray(from_torch.reward), tensors.reward.numpy())


def test_to_jax_without_jax_says_which_extra(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    buf = _frames_buffer(make, name)
    batch = buf.sample(4)
    monkeypatch.setitem(sys.modules, "jax", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[jax\]'"):
        batch.to_jax()
