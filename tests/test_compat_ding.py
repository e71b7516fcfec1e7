"""DI-engine's buffer guide (seed document 001) run on ``shmbuffer.compat.ding``: its code blocks
with only their import lines changed (and, where DI-engine stores an arbitrary object such as
``'a'``, a row of numeric fields), checked against what the guide says they do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmbuffer.compat import ding
from shmbuffer.compat.ding import BufferedData, DequeBuffer

from .conftest import run_seed

IMPORTS = {
    "from ding.data import DequeBuffer": "from shmbuffer.compat.ding import DequeBuffer",
    "from ding.data.buffer.middleware import": "from shmbuffer.compat.ding import",
}


def run(code: str, ns: dict[str, Any]) -> dict[str, Any]:
    return run_seed(code, ns, IMPORTS, "<seed 001>")


@pytest.fixture
def ns() -> Iterator[dict[str, Any]]:
    """The namespace the blocks run in; every buffer in it is closed afterwards."""
    space: dict[str, Any] = {}
    yield space
    for value in list(space.values()):
        if isinstance(value, DequeBuffer):
            value.close()


CREATE = """
    from ding.data import DequeBuffer

    buffer = DequeBuffer(size=10)
"""


def test_push_of_an_object_is_refused_with_what_to_push(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    with pytest.raises(TypeError, match=r"str \('a'\), which shmbuffer cannot store.*Push a dict of numeric fields"):
        run("""
            for _ in range(10):
                buffer.push('a', meta={})
        """, ns)
    assert ns["buffer"].count() == 0


def test_push_and_sample(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    run("""
        # Data is deposited and processed one sample at a time.
        for _ in range(10):
            buffer.push({'a': 1.0}, meta={})

        buffered_data = buffer.sample(3, replace=False)
        data = [d.data for d in buffered_data]
    """, ns)
    got = ns["buffered_data"]
    assert len(got) == 3 and all(isinstance(d, BufferedData) for d in got)
    assert len({d.index for d in got}) == 3                          # replace=False: distinct rows
    assert [float(d["a"]) for d in ns["data"]] == [1.0, 1.0, 1.0]
    buffer: DequeBuffer = ns["buffer"]
    with pytest.raises(ValueError, match="less than 11 records"):
        buffer.sample(11)                                             # DI-engine raises too
    assert buffer.sample(11, ignore_insufficient=True) == []
    assert len(buffer.sample(11, replace=True)) == 11


def test_priority_experience_replay(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    run("""
        from ding.data.buffer.middleware import PriorityExperienceReplay

        buffer = DequeBuffer(size=10)
        buffer.use(PriorityExperienceReplay(buffer, IS_weight=True))
        for _ in range(10):
            # The meta is essentially a Dict that complements the description of the sample and is empty by default.
            buffer.push({'a': 1.0}, meta={"priority": 2.0})
        buffered_data = buffer.sample(3)
    """, ns)
    data = ns["buffered_data"]
    assert [round(d.meta["priority"], 6) for d in data] == [2.0, 2.0, 2.0]
    assert [d.meta["priority_IS"] for d in data] == [1.0, 1.0, 1.0]  # equal priorities: weight 1
    buffer: DequeBuffer = ns["buffer"]
    assert buffer.update(data[0].index, meta={"priority": 8.0})      # the learner's feedback
    weights = {d.index: d.meta["priority_IS"] for _ in range(20) for d in buffer.sample(3)}
    assert min(weights.values()) < 1.0 and weights.get(data[0].index, 0) < 1.0


def test_clone_object_runs(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    run("""
        from ding.data.buffer.middleware import clone_object

        buffer = DequeBuffer(size=10)
        buffer.use(clone_object())
    """, ns)


def test_grouping_by_episode(ns: dict[str, Any]) -> None:
    """The guide's example: 'a' in episode 1, 'b' and 'c' in episode 2; two groups, one of each."""
    for _ in range(30):
        space = run(CREATE, {})
        run("""
            buffer = DequeBuffer(size=10)

            buffer.push({"v": 1}, {"episode": 1})
            buffer.push({"v": 2}, {"episode": 2})
            buffer.push({"v": 3}, {"episode": 2})

            grouped_data = buffer.sample(2, groupby="episode")
        """, space)
        try:
            groups = sorted([int(d.data["v"]) for d in group] for group in space["grouped_data"])
            assert groups == [[1], [2, 3]]                            # distinct groups, whole
            with pytest.raises(ValueError, match="less than 3 groups"):
                space["buffer"].sample(3, groupby="episode")          # fewer groups than asked
        finally:
            space["buffer"].close()


def test_group_sample_keeps_short_groups(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    space = run("""
        from ding.data.buffer.middleware import group_sample

        buffer = DequeBuffer(size=10)
        # The maximum length of each group of data is set to 3, keeping the original order within the group
        buffer.use(group_sample(size_in_group=3, ordered_in_group=True))
    """, ns)
    buffer: DequeBuffer = space["buffer"]
    for v, episode in ((10, 1), (11, 1), (20, 2), (21, 2), (22, 2), (23, 2), (24, 2)):
        buffer.push({"v": v}, {"episode": episode})
    for _ in range(20):
        groups = sorted([int(d.data["v"]) for d in g] for g in buffer.sample(2, groupby="episode"))
        assert groups[0] == [10, 11]                                  # 2 rows: kept, truncated to 2
        assert len(groups[1]) == 3 and np.all(np.diff(groups[1]) == 1) and groups[1][0] >= 20


def test_use_time_check(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    space = run("""
        from ding.data.buffer.middleware import use_time_check

        buffer = DequeBuffer(size=10)
        # Set the maximum number of times a single sample can be used to 2
        buffer.use(use_time_check(buffer, max_use=2))
    """, ns)
    buffer: DequeBuffer = space["buffer"]
    for v in range(3):
        buffer.push({"v": v})
    buffer.sample(3)
    assert buffer.count() == 3
    buffer.sample(3)
    assert buffer.count() == 0                                        # used twice: gone
    with pytest.raises(ValueError, match="less than 1 records"):
        buffer.sample(1)


def test_update_delete_export_import() -> None:
    with DequeBuffer(size=10) as buffer, DequeBuffer(size=10) as other:
        buffer.use(ding.PriorityExperienceReplay(buffer))
        other.use(ding.PriorityExperienceReplay(other))
        pushed = [buffer.push({"obs": np.full(2, v, np.float32)}, {"priority": v + 1.0}) for v in range(4)]
        assert buffer.update(pushed[1].index, data={"obs": np.ones(2, np.float32) * 9})
        assert buffer.sample(indices=[pushed[1].index])[0].data["obs"].tolist() == [9.0, 9.0]
        buffer.delete(pushed[2].index)
        assert buffer.count() == 3 and not buffer.update(pushed[2].index, data={"obs": np.zeros(2)})
        exported = buffer.export_data()
        assert [d.index for d in exported] == [0, 1, 3]
        assert [round(d.meta["priority"], 6) for d in exported] == [1.0, 2.0, 4.0]
        other.import_data(exported)
        again = other.export_data()
        assert [round(d.meta["priority"], 6) for d in again] == [1.0, 2.0, 4.0]
        assert [d.data["obs"][0] for d in again] == [0.0, 9.0, 3.0]
        with pytest.raises(TypeError, match="meta keys"):
            buffer.push({"obs": np.zeros(2)}, {"note": "text"})
        with pytest.raises(ValueError, match="before the first push"):
            buffer.use(ding.use_time_check(buffer, max_use=2))


def test_groupby_env_with_unroll_len() -> None:
    """R2D2's ``sample(n, groupby="env", unroll_len=T)``: ``T`` consecutive steps of one env's group."""
    with DequeBuffer(size=40, envs=3) as buffer:
        for step in range(10):
            for env in range(3):
                buffer.push({"step": np.int64(step), "env_id": np.int64(env)}, {"env": env})
        for _ in range(10):
            got = buffer.sample(3, groupby="env", unroll_len=4)
            assert len(got) == 3 and sorted(int(g[0].data["env_id"]) for g in got) == [0, 1, 2]
            for group in got:
                steps = [int(d.data["step"]) for d in group]
                assert len(steps) == 4 and np.all(np.diff(steps) == 1)
                assert len({int(d.data["env_id"]) for d in group}) == 1
