"""What a push takes: one row or k rows, a mapping or keywords, a list of row mappings, the
priority inside a row (protocol/push.py's check)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import shmbuffer as sb

from .conftest import MUJOCO, SMALL, seq_of, small_row, transition

Make = Callable[..., sb.ReplayBuffer]


def test_push_of_a_list_of_rows(make: Make, name: str) -> None:
    buf = make(MUJOCO, 20, name=name)
    rows = [transition(i) for i in range(5)]
    ids = buf.push(rows)
    assert ids.tolist() == [0, 1, 2, 3, 4]
    assert seq_of(buf.get(slice(None))).tolist() == [0, 1, 2, 3, 4]
    bad = [transition(0), {k: v for k, v in transition(1).items() if k != "done"}]
    with pytest.raises(sb.FieldError, match="row 1 has fields"):
        buf.push(bad)
    with pytest.raises(TypeError, match="row 1 of the list is a str"):
        buf.push([transition(0), "a"])
    with pytest.raises(TypeError, match="expected a mapping of fields or a list of them, got str"):
        buf.push("a")  # type: ignore[arg-type]
    assert len(buf) == 5  # nothing of the refused pushes was written


def test_buffers_push_a_list(name: str) -> None:
    group = sb.Buffers(policy=dict(schema=SMALL, capacity=10, name=name + "p", max_use=2),
                       value=dict(schema=SMALL, capacity=20, name=name + "v"))
    with group:
        out = group.push([small_row(i) for i in range(4)])
        assert out["policy"].tolist() == out["value"].tolist() == [0, 1, 2, 3]
        assert group["value"].get(slice(None)).reward.tolist() == [0, 1, 2, 3]
        with pytest.raises(sb.FieldError, match="row 1 has fields"):
            group.push([small_row(0), {"obs": np.zeros(3)}])


def test_the_priority_inside_a_row(make: Make, name: str) -> None:
    s = sb.Prioritized(alpha=0.5, beta=0.4, eps=0.0)
    buf = make(SMALL, 10, sampler=s, name=name)
    buf.push({**small_row(0), "priority": 4.0})                      # Ape-X: the actor's priority
    buf.push([{**small_row(1), "priority": 9.0}, {**small_row(2), "priority": 16.0}])
    assert buf.priority([0, 1, 2]).tolist() == [2.0, 3.0, 4.0]
    assert buf.priorities.max_priority == 16.0
    with pytest.raises(TypeError, match="both in the row and as priority="):
        buf.push({**small_row(3), "priority": 1.0}, priority=2.0)
    uniform = make(SMALL, 10, name=name + "u")
    with pytest.raises(sb.FieldError, match="samples uniformly"):
        uniform.push({**small_row(0), "priority": 1.0})
