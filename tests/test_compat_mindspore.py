"""MindSpore RL's ReplayBuffer guide (seed document 004) on ``shmbuffer.compat.mindspore``: its
code blocks with only their import lines changed, and the FIFO behaviour it describes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.compat.mindspore import ReplayBuffer

from .conftest import run_seed

IMPORTS = {
    "from mindspore_rl.core.replay_buffer import ReplayBuffer": "from shmbuffer.compat.mindspore import ReplayBuffer",
    "import mindspore as ms": "from shmbuffer.compat import mindspore as ms",
}


def run(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    return run_seed(code, ns, IMPORTS, "<seed 004>")


@pytest.fixture
def ns() -> Iterator[dict[str, Any]]:
    space: dict[str, Any] = {}
    yield space
    for value in list(space.values()):
        if isinstance(value, ReplayBuffer):
            value.close()


CREATE = """
    from mindspore_rl.core.replay_buffer import ReplayBuffer
    import mindspore as ms
    sample_size = 2
    capacity = 100000
    shapes = [(4,), (1,), (1,), (4,)]
    types = [ms.float32, ms.int32, ms.float32, ms.float32]
    replaybuffer = ReplayBuffer(sample_size, capacity, shapes, types)
"""


def test_the_guide(ns: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    run(CREATE, ns)
    run("""
        state = ms.Tensor([0.1, 0.2, 0.3, 0.4], ms.float32)
        action = ms.Tensor([1], ms.int32)
        reward = ms.Tensor([1], ms.float32)
        new_state = ms.Tensor([0.4, 0.3, 0.2, 0.1], ms.float32)
        replaybuffer.insert([state, action, reward, new_state])
        replaybuffer.insert([state, action, reward, new_state])
    """, ns)
    run("""
        exp = replaybuffer.get_item(0)
    """, ns)
    exp = ns["exp"]
    assert [e.dtype for e in exp] == [np.float32, np.int32, np.float32, np.float32]
    assert np.allclose(exp[0], [0.1, 0.2, 0.3, 0.4]) and exp[1].tolist() == [1] and np.allclose(exp[3], [0.4, 0.3, 0.2, 0.1])
    run("""
        samples = replaybuffer.sample()
    """, ns)
    assert [s.shape for s in ns["samples"]] == [(2, 4), (2, 1), (2, 1), (2, 4)]   # batch_size from the constructor
    run("""
        size = replaybuffer.size()
    """, ns)
    assert ns["size"] == 2
    run("""
        if replaybuffer.full():
            print("Full use of this buffer.")
    """, ns)
    assert capsys.readouterr().out == ""
    run("""
        replaybuffer.reset()
    """, ns)
    assert ns["replaybuffer"].size() == 0
    with pytest.raises(sb.EmptyBufferError):
        ns["replaybuffer"].sample()


def test_fifo_as_the_guide_draws_it() -> None:
    """Capacity 6: insert 2 rows, then 4 (full, count 6), then 2 more: the oldest 2 are overwritten
    and get_item remaps by the head, so item 0 is the third row inserted."""
    from shmbuffer.compat import mindspore as ms

    with ReplayBuffer(3, 6, [(2,), (1,)], [ms.float32, ms.int64]) as rb:
        def rows(lo: int, k: int) -> list[np.ndarray]:
            return [np.arange(lo, lo + k, dtype=np.float32)[:, None] * np.ones(2, np.float32),
                    np.arange(lo, lo + k)[:, None]]

        rb.insert(rows(0, 2))
        assert rb.size() == 2 and not rb.full()
        rb.insert(rows(2, 4))
        assert rb.size() == 6 and rb.full()
        rb.insert(rows(6, 2))
        assert rb.size() == 6
        assert [int(rb.get_item(i)[1][0]) for i in range(6)] == [2, 3, 4, 5, 6, 7]
        assert len(rb.sample()[0]) == 3
        with pytest.raises(ValueError, match="expected 2 elements"):
            rb.insert([np.zeros(2)])
        with pytest.raises(sb.FieldError, match="field 'f0'"):
            rb.insert([np.zeros(3), np.zeros(1)])
