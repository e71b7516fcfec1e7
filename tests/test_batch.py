"""``Batch`` (batch.py): fields and extras by attribute and by key, slicing, dicts, TensorDicts."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import shmbuffer as sb

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
