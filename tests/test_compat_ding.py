"""``shmbuffer.compat.ding`` as DI-engine's ``ding.data.buffer``: DI-engine's buffer guide (seed
document 001) run with only its import lines changed, then one test for each behaviour DI-engine's
own ``test_buffer.py`` and ``test_middleware.py`` rely on (tools/peer_suites/ding runs those)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from shmbuffer import FieldError
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
    """The namespace the guide's blocks run in; every buffer in it is closed afterwards."""
    space: dict[str, Any] = {}
    yield space
    for value in list(space.values()):
        if isinstance(value, DequeBuffer):
            value.close()


@pytest.fixture
def deque(name: str) -> Iterator[Callable[..., DequeBuffer]]:
    """``DequeBuffer(...)`` with a unique name, closed after the test."""
    made: list[DequeBuffer] = []

    def factory(*args: Any, **kwargs: Any) -> DequeBuffer:
        buffer = DequeBuffer(*args, name=f"{name}-{len(made)}", **kwargs)
        made.append(buffer)
        return buffer

    yield factory
    for buffer in made:
        buffer.close()


# -- the guide ----------------------------------------------------------------------------------
CREATE = """
    from ding.data import DequeBuffer

    buffer = DequeBuffer(size=10)
"""


def test_guide_push_and_sample_any_object(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    run("""
        # Data is deposited and processed one sample at a time.
        for _ in range(10):
            buffer.push('a', meta={})

        buffered_data = buffer.sample(3, replace=False)
        data = [d.data for d in buffered_data]
    """, ns)
    got = ns["buffered_data"]
    assert ns["data"] == ["a", "a", "a"] and all(isinstance(d, BufferedData) for d in got)
    assert len({d.index for d in got}) == 3 and all(d.meta == {} for d in got)  # replace=False: distinct rows
    buffer: DequeBuffer = ns["buffer"]
    with pytest.raises(ValueError, match="less than 11 records"):
        buffer.sample(11)
    assert buffer.sample(11, ignore_insufficient=True) == []
    assert len(buffer.sample(11, replace=True)) == 11


def test_guide_priority_experience_replay(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    run("""
        from ding.data.buffer.middleware import PriorityExperienceReplay

        buffer = DequeBuffer(size=10)
        buffer.use(PriorityExperienceReplay(buffer, IS_weight=True))
        for _ in range(10):
            # The meta is essentially a Dict that complements the description of the sample and is empty by default.
            buffer.push('a', meta={"priority": 2.0})
        buffered_data = buffer.sample(3)
    """, ns)
    data = ns["buffered_data"]
    assert [d.data for d in data] == ["a"] * 3
    assert [d.meta["priority"] for d in data] == [2.0, 2.0, 2.0]
    assert [d.meta["priority_IS"] for d in data] == [1.0, 1.0, 1.0]  # equal priorities: weight 1
    buffer: DequeBuffer = ns["buffer"]
    assert buffer.update(data[0].index, meta={"priority": 8.0})
    weights = {d.index: d.meta["priority_IS"] for _ in range(20) for d in buffer.sample(3)}
    assert min(weights.values()) < 1.0 and weights.get(data[0].index, 0) < 1.0


def test_guide_grouping_by_episode(ns: dict[str, Any]) -> None:
    """The guide's example: 'a' in episode 1, 'b' and 'c' in episode 2; two groups, one of each."""
    for _ in range(20):
        space = run(CREATE, {})
        run("""
            buffer = DequeBuffer(size=10)

            buffer.push("a", {"episode": 1})
            buffer.push("b", {"episode": 2})
            buffer.push("c", {"episode": 2})

            grouped_data = buffer.sample(2, groupby="episode")
        """, space)
        try:
            assert sorted([d.data for d in group] for group in space["grouped_data"]) == [["a"], ["b", "c"]]
            with pytest.raises(ValueError, match="less than 3 groups"):
                space["buffer"].sample(3, groupby="episode")
            assert space["buffer"].sample(3, groupby="episode", ignore_insufficient=True) == []
        finally:
            space["buffer"].close()


def test_guide_group_sample(ns: dict[str, Any]) -> None:
    run(CREATE, ns)
    space = run("""
        from ding.data.buffer.middleware import group_sample

        buffer = DequeBuffer(size=10)
        # The maximum length of each group of data is set to 3, keeping the original order within the group
        buffer.use(group_sample(size_in_group=3, ordered_in_group=True))
    """, ns)
    buffer: DequeBuffer = space["buffer"]
    for v, episode in ((10, 1), (11, 1), (20, 2), (21, 2), (22, 2), (23, 2), (24, 2)):
        buffer.push(v, {"episode": episode})
    for _ in range(20):
        groups = sorted([d.data for d in g] for g in buffer.sample(2, groupby="episode"))
        assert groups[0] == [10, 11]                                  # 2 rows: kept whole
        assert len(groups[1]) == 3 and np.all(np.diff(groups[1]) == 1) and groups[1][0] >= 20


def test_guide_use_time_check(ns: dict[str, Any]) -> None:
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
    assert [d.meta["use_count"] for d in buffer.sample(3)] == [1, 1, 1]
    assert buffer.count() == 3
    buffer.sample(3)
    assert buffer.count() == 0                                        # used twice: deleted
    with pytest.raises(ValueError, match="less than 1 records"):
        buffer.sample(1)


# -- what a row carries -------------------------------------------------------------------------
ODD: list[Any] = [
    7, -2**63, 2**70, 2.5, True, None, "text", b"raw", ["a", {"b": (1, 2)}], {"key": "v", 3: [4]},
    np.float32(1.5), np.int16(-3), np.arange(6, dtype=np.uint8).reshape(2, 3), torch.tensor([1.0, 2.0]),
    torch.tensor([1, 2], dtype=torch.int64), np.array(["s", "t"]), torch.ones(2, requires_grad=True),
]


@pytest.mark.parametrize("first", [0, 3, 12])
def test_any_data_reads_back_as_pushed(deque: Callable[..., DequeBuffer], first: int) -> None:
    """Whatever the first push (it sets the columns), every object reads back equal and of its type."""
    buffer = deque(size=len(ODD))
    order = ODD[first:] + ODD[:first]
    pushed = [buffer.push(value) for value in order]
    for value, item in zip(order, pushed, strict=True):
        [got] = buffer.sample(indices=[item.index])
        assert type(got.data) is type(value)
        if isinstance(value, torch.Tensor):
            assert torch.equal(got.data, value.detach()) and got.data.dtype == value.dtype
        elif isinstance(value, np.ndarray):
            assert got.data.dtype == value.dtype and np.array_equal(got.data, value)
        else:
            assert got.data == value


def test_dict_numbers_get_columns_and_the_rest_the_object_slot(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=4)
    buffer.push({"info": "first", "obs": torch.arange(4, dtype=torch.float32), "reward": 1.5, "step": np.int64(0)})
    schema = buffer.buffer.schema  # type: ignore[union-attr]
    assert {"obs", "reward", "step"} <= set(schema.names) and "info" not in schema.names
    buffer.push({"info": "second", "obs": torch.ones(4), "reward": -1.0, "step": np.int64(1)})
    buffer.push({"obs": torch.zeros(4), "extra": [1], "reward": 0.0, "step": np.int64(2), "info": "third"})
    rows = buffer.export_data()
    assert [list(r.data) for r in rows] == [["info", "obs", "reward", "step"]] * 2 + [
        ["obs", "extra", "reward", "step", "info"]]                   # key order kept
    assert [r.data["info"] for r in rows] == ["first", "second", "third"] and rows[2].data["extra"] == [1]
    assert isinstance(rows[0].data["obs"], torch.Tensor) and type(rows[0].data["reward"]) is float
    core = buffer.buffer.sample(8)  # type: ignore[union-attr]
    assert core.obs.shape == (8, 4) and core.obs.dtype == np.float32  # the core reads the columns as arrays


def test_a_row_that_does_not_fit_the_columns_is_kept_whole(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=4)
    buffer.push({"obs": np.zeros(3, np.float32)})
    odd = [{"obs": np.zeros(5, np.float32)}, {"obs": np.zeros(3, np.float64)}, {"other": 1}]
    items = [buffer.push(value) for value in odd]
    got = buffer.sample(indices=[i.index for i in items])
    assert [d.data["obs"].shape for d in got[:2]] == [(5,), (3,)] and got[1].data["obs"].dtype == np.float64
    assert got[2].data == {"other": 1}


def test_an_object_larger_than_its_slot_is_refused_and_nothing_changes(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=4, object_bytes=64, meta_bytes=64)
    buffer.push("small", {"k": 1})
    with pytest.raises(ValueError, match=r"data takes \d+ bytes, more than its slot of 64 bytes.*object_bytes="):
        buffer.push("x" * 100)
    with pytest.raises(ValueError, match=r"meta takes \d+ bytes, more than its slot of 64 bytes.*meta_bytes="):
        buffer.push("small", {"note": "y" * 100})
    assert buffer.count() == 1 and buffer.buffer.stats["inserted"] == 1  # type: ignore[union-attr]
    index = buffer.storage[0].index
    with pytest.raises(ValueError, match="object_bytes="):
        buffer.update(index, "x" * 100)
    assert buffer.get(0).data == "small" and buffer.get(0).meta == {"k": 1}


def test_an_object_that_cannot_be_pickled_is_refused(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=4)
    buffer.push({"v": 1})
    with pytest.raises(TypeError, match="the data cannot be pickled into the row"):
        buffer.push({"v": 2, "fn": lambda: None})
    with pytest.raises(TypeError, match="the meta cannot be pickled into the row"):
        buffer.push({"v": 2}, {"fn": lambda: None})
    with pytest.raises(TypeError, match="meta must be a dict"):
        buffer.push({"v": 2}, ["not", "a", "dict"])
    with pytest.raises(TypeError, match="meta must be a dict"):
        buffer.update(buffer.get(0).index, None, "meta")
    assert [(d.data, d.meta) for d in buffer.export_data()] == [({"v": 1}, {})]


def test_slot_sizes_follow_the_first_push(deque: Callable[..., DequeBuffer]) -> None:
    big = "z" * 2000
    buffer = deque(size=2)
    buffer.push(big, {"note": "n" * 300})
    schema = buffer.buffer.schema  # type: ignore[union-attr]
    assert schema["ding_object"].shape[0] >= 4 * 2000 and schema["ding_meta"].shape[0] >= 4 * 300
    with pytest.raises(ValueError, match="object_bytes must be an int >= 0"):
        deque(size=2, object_bytes=-1)


def test_meta_takes_any_keys_and_update_replaces_it(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=4)
    item = buffer.push(1, {"group": "g", "label": 3, "nested": {"a": [1, 2]}})
    assert buffer.get(0).meta == {"group": "g", "label": 3, "nested": {"a": [1, 2]}}
    assert buffer.update(item.index, None, {"group": "h"})
    assert buffer.get(0).meta == {"group": "h"} and buffer.get(0).data == 1
    assert buffer.update(item.index, {"new_prop": "any"})                 # None meta: kept
    assert buffer.get(0).data == {"new_prop": "any"} and buffer.get(0).meta == {"group": "h"}
    assert not buffer.update("invalidindex", {}, None) and not buffer.update(10**6, 1)


# -- prioritized replay -------------------------------------------------------------------------
def test_priority_reads_back_as_written_with_its_idx(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=10)
    per = ding.PriorityExperienceReplay(buffer, IS_weight=True)
    buffer.use(per)
    pushed = [buffer.push({"obs": torch.randn(4)}, meta={"priority": 2.0}) for _ in range(10)]
    assert [p.meta["priority_idx"] for p in pushed] == list(range(10))
    data = buffer.sample(size=10, replace=False)
    assert all({"priority", "priority_idx", "priority_IS"} <= set(d.meta) for d in data)
    assert all(d.meta["priority_idx"] == d.index % 10 for d in data)
    assert all(torch.equal(d.data["priority_IS"], torch.tensor([d.meta["priority_IS"]])) for d in data)
    for item in data:
        item.meta["priority"] = 3.0
        assert buffer.update(item.index, item.data, item.meta)        # the sampled meta, given back
    updated = sorted({d.index for d in data})
    assert {d.meta["priority"] for d in buffer.sample(indices=updated)} == {3.0}  # not 3.0000000000000004
    assert {d.meta["priority"] for d in buffer.export_data() if d.index not in updated} <= {2.0}
    buffer.delete(data[0].index)
    assert buffer.count() == 9 and len(per.buffer_idx) == 9 and data[0].index not in per.buffer_idx.values()
    with pytest.raises(ValueError, match="before the first push"):
        buffer.use(ding.PriorityExperienceReplay(buffer))
    buffer.clear()
    assert buffer.count() == 0 and per.buffer_idx == {}


def test_priority_defaults_and_checks(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=8).use(ding.PriorityExperienceReplay())
    buffer.push({"v": 1, "priority": 5.0})                                  # no meta: taken from the data
    buffer.push({"v": 2})                                                   # none: the largest so far
    assert [(r.data, r.meta["priority"]) for r in buffer.export_data()] == [({"v": 1}, 5.0), ({"v": 2}, 5.0)]
    with pytest.raises(ValueError, match=r"meta\['priority'\]: expected finite values >= 0"):
        buffer.push({"v": 3}, {"priority": -1.0})
    assert buffer.count() == 2


# -- groups -------------------------------------------------------------------------------------
def test_groupby_any_meta_key_rows_need_not_be_consecutive(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=30, seed=1)
    for step in range(10):
        for env in "ABC":
            buffer.push(step, {"env": env})
    buffer.push(99)                                                         # no "env": in no group
    for _ in range(10):
        groups = buffer.sample(3, groupby="env", unroll_len=4)
        assert sorted(g[0].meta["env"] for g in groups) == ["A", "B", "C"]
        for group in groups:
            assert [d.data for d in group] == list(range(group[0].data, group[0].data + 4))
    buffer.push(1, {"env": ["unhashable"]})
    with pytest.raises(TypeError, match=r"meta\['env'\] of row 31 is a list, which cannot be a group key"):
        buffer.sample(1, groupby="env")


def test_sliced_windows_start_at_multiples_of_unroll_len(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=20, sliced=True)
    for step in range(10):
        buffer.push(step, {"env": 0})
    starts = {buffer.sample(1, groupby="env", unroll_len=4)[0][0].data for _ in range(60)}
    assert starts == {0, 4, 6}                                              # the last window ends at the end
    unsliced = deque(size=20)
    for step in range(10):
        unsliced.push(step, {"env": 0})
    assert len({unsliced.sample(1, groupby="env", unroll_len=4)[0][0].data for _ in range(200)}) > 3


def test_padding_and_unordered_group_sample(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=10).use(ding.padding(policy="none"))
    for i in range(5):
        buffer.push(i, {"group": i % 2})
    groups = buffer.sample(2, groupby="group")
    assert sorted(len(g) for g in groups) == [3, 3]
    assert sum(d.data is None and d.index is None for g in groups for d in g) == 1
    shuffled = deque(size=10).use(ding.group_sample(size_in_group=2, ordered_in_group=False))
    for i in range(5):
        shuffled.push(i, {"group": 0})
    [group] = shuffled.sample(1, groupby="group")
    assert len(group) == 2 and len({d.data for d in group}) == 2


# -- middleware -----------------------------------------------------------------------------------
def test_user_middleware_runs_in_order_with_their_arguments(deque: Callable[..., DequeBuffer]) -> None:
    calls: list[tuple[str, str, tuple[Any, ...], dict[str, Any]]] = []

    def record(tag: str) -> Callable[..., Any]:
        def mw(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            calls.append((tag, action, args, kwargs))
            return chain(*args, **kwargs)
        return mw

    def plus_ten(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "push":
            return chain(args[0] + 10, *args[1:], **kwargs)
        return chain(*args, **kwargs)

    def drop_odd(action: str, chain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if action == "push" and args[0] % 2:
            return None
        return chain(*args, **kwargs)

    buffer = deque(size=10).use(record("outer")).use(drop_odd).use(plus_ten).use(record("inner"))
    for i in range(4):
        buffer.push(i, meta={"i": i})
    assert sorted(d.data for d in buffer.export_data()) == [10, 12]
    assert [c[:2] for c in calls] == [("outer", "push"), ("inner", "push"), ("outer", "push")] * 2
    assert calls[1][2:] == ((10,), {"meta": {"i": 0}})
    calls.clear()
    buffer.sample(2, replace=True)
    buffer.update(buffer.get(0).index, 5)
    buffer.delete([buffer.get(0).index])
    buffer.clear()
    assert [c[1] for c in calls if c[0] == "outer"] == ["sample", "update", "delete", "clear"]
    assert calls[0][2:] == ((2,), {"replace": True})


def test_staleness_check_and_sample_range_view(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=10)
    buffer.use(ding.staleness_check(buffer, max_staleness=10))
    with pytest.raises(AssertionError, match="train_iter_data_collected"):
        buffer.push(1)
    for collected in (0, 0, 5):
        buffer.push(collected, meta={"train_iter_data_collected": collected})
    assert len(buffer.sample(size=3, train_iter_sample_data=10)) == 3
    with pytest.raises(ValueError):
        buffer.sample(size=3, train_iter_sample_data=11)
    assert [d.data for d in buffer.export_data()] == [5]

    ranged = deque(size=10)
    for i in range(10):
        ranged.push(i)
    view = ranged.view().use(ding.sample_range_view(ranged, start=-5, end=-2))
    assert {view.sample(1)[0].data for _ in range(40)} == {5, 6, 7}
    assert {d.data for d in ranged.sample(3, sample_range=slice(0, 3))} == {0, 1, 2}


def test_view_shares_rows_not_middleware(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=10)
    view = buffer.view()                                                    # before the first push
    view.use(lambda action, chain, *a, **k: chain(*a, **k) if action != "push" else chain(a[0] * 2, *a[1:], **k))
    buffer.push(1)
    view.push(2)
    assert buffer._middleware == [] and [d.data for d in buffer.export_data()] == [1, 4]
    view.close()                                                            # the buffer stays open
    assert buffer.count() == 2 and view.count() == 2


# -- positions, indices, deletes ------------------------------------------------------------------
def test_storage_and_indices_follow_deletes(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=100, seed=3)
    for i in range(40):
        buffer.push(i)
    sampled = buffer.sample(20)
    gone = [item.index for item in sampled]
    buffer.delete(gone)
    buffer.delete("not an index")
    for i in range(10):
        buffer.push(100 + i)
    assert len(buffer.storage) == len(buffer.indices) == buffer.count() == 30
    for i in range(30):
        assert buffer.indices.get(buffer.storage[i].index) == i
    assert buffer.storage[-1].data == 109 and buffer[0].data == min(set(range(40)) - {d.data for d in sampled})
    assert not any(buffer.indices.has(g) for g in gone)
    with pytest.raises(KeyError, match="are not all held"):
        buffer.sample(indices=[gone[0]])
    with pytest.raises(KeyError):
        buffer.get_by_index(gone[0])
    kept = buffer.storage[3]
    assert buffer.get_by_index(kept.index) == kept


def test_samples_are_independent_objects(deque: Callable[..., DequeBuffer]) -> None:
    buffer = deque(size=1)
    buffer.push({"key": "origin", "arr": np.zeros(2)})
    first, second = buffer.sample(2, replace=True)
    first.data["key"] = "new"
    first.data["arr"][0] = 5
    assert second.data["key"] == "origin" and second.data["arr"][0] == 0
    again = buffer.sample(indices=[first.index, first.index])
    again[0].data["key"] = "new"
    assert again[1].data["key"] == "origin" and buffer.get(0).data["key"] == "origin"


def test_torch_dataloader_reads_the_buffer(deque: Callable[..., DequeBuffer]) -> None:
    from torch.utils.data import DataLoader

    buffer = deque(size=10)
    for i in range(10):
        buffer.push(i)
    batches = list(DataLoader(buffer, batch_size=6, shuffle=True, collate_fn=lambda batch: batch))  # type: ignore[arg-type]
    assert sorted(len(b) for b in batches) == [4, 6] and sorted(d.data for b in batches for d in b) == list(range(10))


# -- files and export -----------------------------------------------------------------------------
def test_save_and_load_data(deque: Callable[..., DequeBuffer], tmp_path: Any) -> None:
    buffer = deque(size=10).use(ding.PriorityExperienceReplay())
    buffer.meta_index = {"label": []}
    for i in range(5):
        buffer.push({"obs": np.full(2, i, np.float32), "tag": f"t{i}"}, meta={"label": i, "priority": i + 0.5})
    assert buffer.meta_index == {"label": [0, 1, 2, 3, 4]}
    path = os.path.join(tmp_path, "sub", "data.hkl")
    buffer.save_data(path)
    assert os.listdir(os.path.join(tmp_path, "sub")) == ["data.hkl"]
    other = deque(size=10).use(ding.PriorityExperienceReplay())
    other.load_data(path)
    rows = other.export_data()
    assert [r.data["tag"] for r in rows] == [f"t{i}" for i in range(5)]
    assert [r.meta["priority"] for r in rows] == [i + 0.5 for i in range(5)]
    assert [r.data["obs"].tolist() for r in rows] == [[i, i] for i in range(5)]
    other.load_data(path)                                                  # replaces, does not add
    assert other.count() == 5
    mismatched = deque(size=10)
    mismatched.push("a string")
    with pytest.raises(ValueError, match="load it into a new DequeBuffer"):
        mismatched.load_data(path)
    assert mismatched.count() == 1


def test_a_file_that_load_data_refuses_leaves_the_rows(deque: Callable[..., DequeBuffer], tmp_path: Any) -> None:
    """``load_data`` replaces the rows only once the file's rows passed every check: a damaged
    file raises and the buffer keeps what it held (it was emptied first)."""
    buffer = deque(size=10)
    for i in range(4):
        buffer.push({"obs": np.full(2, i, np.float32)})
    path = os.path.join(tmp_path, "data.npz")
    buffer.save_data(path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["obs"] = arrays["obs"][:2]                                       # fewer rows than the rest
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(FieldError, match="ragged batch"):
        buffer.load_data(path)
    assert buffer.count() == 4 and [r.data["obs"][0] for r in buffer.export_data()] == [0, 1, 2, 3]
    arrays["obs"] = np.zeros((0, 2), np.float32)
    arrays = {k: v[:0] if k != "ding_layout" else v for k, v in arrays.items()}
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    buffer.load_data(path)                                                  # a save of no rows: none
    assert buffer.count() == 0


def test_export_and_import_data(deque: Callable[..., DequeBuffer]) -> None:
    buffer, other = deque(size=10), deque(size=10)
    for i in range(3):
        buffer.push([i], {"group": i})
    other.import_data(buffer.export_data())
    assert [(r.data, r.meta) for r in other] == [([i], {"group": i}) for i in range(3)]


def test_unroll_len_groups_are_consecutive_steps(deque: Callable[..., DequeBuffer]) -> None:
    """DI-engine's own continuity check, on groups that replace and repeat."""
    buffer = deque(size=100)
    for env_id, n in zip("ABC", (3, 4, 5), strict=True):
        for i in range(n):
            buffer.push(i, {"env": env_id})
    with pytest.raises(ValueError, match="There are less than 3 groups"):
        buffer.sample(3, groupby="env", unroll_len=4)
    for group in buffer.sample(3, groupby="env", unroll_len=4, replace=True):
        assert len(group) == 4 and isinstance(
            functools.reduce(lambda a, b: a and a.data + 1 == b.data and b, group), BufferedData)


# -- stored objects are plain data unless the buffer trusts its writers ---------------------------
class _Payload:
    """A class whose unpickling would run code: ``os.system`` on a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x

    __hash__ = None  # type: ignore[assignment]


def test_a_crafted_slot_cannot_run_code_in_the_reader(deque: Callable[..., DequeBuffer], tmp_path: Any) -> None:
    """A process that can write the shared block puts a crafted pickle in a row's object slot:
    the learner's next sample refuses it (naming what it named), and nothing ran."""
    import pickle

    from shmbuffer import UnsafePickle
    from shmbuffer.compat.ding.row import OBJECT

    buffer = deque(size=4)
    item = buffer.push({"obs": np.zeros(2), "note": "plain"})
    store = buffer.buffer
    assert store is not None
    marker = tmp_path / "ran"
    raw = pickle.dumps(("rest", _Payload(str(marker)), None), protocol=5)
    slot = np.zeros(store.schema[OBJECT].shape, np.uint8)
    slot[:len(raw)] = np.frombuffer(raw, np.uint8)
    store.update(np.array([item.index]), {OBJECT: slot})  # what any attached process can do
    with pytest.raises(UnsafePickle, match=r"posix\.system|os\.system") as e:
        buffer.sample(indices=[item.index])
    assert "trusted_pickles=True" in str(e.value) and str(item.index) in str(e.value)
    assert not marker.exists()
    garbage = np.zeros_like(slot)
    garbage[:4] = [0x01, 0x80, 1, 2]
    store.update(np.array([item.index]), {OBJECT: garbage})
    with pytest.raises(UnsafePickle, match="does not hold what this buffer writes"):
        buffer.sample(1)


def test_classes_need_trusted_pickles(deque: Callable[..., DequeBuffer]) -> None:
    """A user's class is refused at the push by default (the error names it and the opt-in,
    nothing is stored), and stored and read back with ``trusted_pickles=True``; plain data,
    arrays, scalars and tensors need no opt-in (test_any_data_reads_back_as_pushed)."""
    from shmbuffer import UnsafePickle

    plain = deque(size=4)
    plain.push({"obs": np.zeros(2)})
    with pytest.raises(UnsafePickle, match=r"Point.*trusted_pickles=True") as e:
        plain.push({"obs": np.zeros(2), "where": Point(3)})
    assert "nothing was stored" in str(e.value) and plain.count() == 1
    with pytest.raises(UnsafePickle, match="Point"):
        plain.push({"obs": np.zeros(2)}, meta={"origin": Point(1)})
    assert plain.count() == 1
    with pytest.raises(TypeError, match="trusted_pickles"):
        deque(size=4, trusted_pickles="yes")
    trusting = deque(size=4, trusted_pickles=True)
    item = trusting.push({"obs": np.zeros(2), "where": Point(3)}, meta={"origin": Point(1)})
    [got] = trusting.sample(indices=[item.index])
    assert got.data["where"] == Point(3) and got.meta["origin"] == Point(1)


def test_load_data_of_a_buffer_never_pushed_to_empties_the_buffer(deque: Callable[..., DequeBuffer],
                                                                   tmp_path: Any) -> None:
    """``load_data`` replaces the rows by the file's, also when the file is the save of a buffer no
    row was ever pushed to (it has no columns): the buffer is emptied (it raised ``missing field``)."""
    path = os.path.join(tmp_path, "empty.npz")
    deque(size=10).save_data(path)
    buffer = deque(size=10)
    for i in range(3):
        buffer.push({"obs": np.full(2, i, np.float32)}, meta={"group": i})
    buffer.load_data(path)
    assert buffer.count() == 0 and buffer.export_data() == []
    buffer.push({"obs": np.full(2, 7, np.float32)})  # the layout stays: the buffer goes on
    assert [r.data["obs"].tolist() for r in buffer.export_data()] == [[7, 7]]


# -- hostile slots: bytes another process (or an altered file) puts where the slots are ----------
class _Reduce:
    """Pickles as ``func(*args)``, then ``__setstate__(state)``: what a crafted pickle can ask for."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _object_array(how: str) -> _Reduce:
    """An object array whose element is a pointer of our choosing: an object dtype with its flags
    zeroed (numpy takes that state) lets numpy build it from bytes, by ``_frombuffer`` or by
    ``_reconstruct`` and ``__setstate__``."""
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy < 2
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    dtype = _Reduce(np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, 0))
    pointer = (0x4141414141).to_bytes(8, "little")
    if how == "frombuffer":
        return _Reduce(numeric._frombuffer, (pointer, dtype, (1,), "C"))
    return _Reduce(multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (1,), dtype, False, pointer))


PLANTED = {  # the way in: where the pickle goes, and the array rebuilder or the allocation it calls
    "data slot, _frombuffer": ("data", "frombuffer"),
    "data slot, _reconstruct": ("data", "reconstruct"),
    "meta slot of a prioritized buffer": ("meta", "frombuffer"),
    "save_data file": ("file", "frombuffer"),
    "data slot, bytearray(256 MiB)": ("data", "bytearray"),
}


def planted(way: str, name: str, folder: str) -> None:
    """Run in a child process (a crash must not take pytest with it): plant ``way``'s pickle, read
    it the way a learner does, and check it is refused with ``UnsafePickle``, that nothing near the
    asked-for size was allocated, and that the buffer still works. Prints the refusal."""
    import pickle
    import tracemalloc
    import warnings

    from shmbuffer import UnsafePickle
    from shmbuffer.compat.ding.row import META, OBJECT

    where, how = PLANTED[way]
    payload = ("whole", _Reduce(bytearray, (1 << 28,))) if how == "bytearray" else _object_array(how)
    raw = pickle.dumps(payload, protocol=5)
    buffer = DequeBuffer(size=4, name=name)
    reader = DequeBuffer(size=4, name=f"{name}-file")
    try:
        if where == "meta":
            buffer.use(ding.PriorityExperienceReplay(buffer, IS_weight=True))
        good = buffer.push({"obs": np.ones(2), "note": "good"}, meta={"label": 1})
        bad = buffer.push({"obs": np.zeros(2), "note": "plain"}, meta={"label": 2})
        store = buffer.buffer
        assert store is not None
        field = META if where == "meta" else OBJECT
        slot = np.zeros(store.schema[field].shape, np.uint8)
        slot[:len(raw)] = np.frombuffer(raw, np.uint8)
        store.update(np.array([bad.index]), {field: slot})  # what any attached process can do
        path = os.path.join(folder, "rows.npz")
        if where == "file":
            buffer.delete(bad.index)  # the altered bytes are the file's only
            buffer.save_data(path)
            buffer.push({"obs": np.zeros(2), "note": "plain"}, meta={"label": 2})
            with np.load(path) as z:
                arrays = {k: z[k] for k in z.files}
            arrays[OBJECT][0] = slot
            with open(path, "wb") as f:
                np.savez(f, **arrays)
        tracemalloc.start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if where == "file":
                    reader.load_data(path)
                    got = reader.sample(1)
                else:
                    got = buffer.sample(2)
            except UnsafePickle as e:
                print("refused:", e)
            else:
                raise AssertionError(f"read without an error: {[type(d.data).__name__ for d in got]}")
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert not caught, [str(w.message) for w in caught]
        assert peak < 1 << 20, f"the read allocated {peak} bytes at its peak"
        if where == "file":
            assert reader.buffer is None and reader.count() == 0  # the refused file changed nothing
            reader.push({"obs": np.ones(2), "note": "after"})
            assert [d.data["note"] for d in reader.sample(1)] == ["after"]
        [again] = buffer.sample(indices=[good.index])
        assert again.data["note"] == "good" and again.meta["label"] == 1
        newer = buffer.push({"obs": np.ones(2), "note": "newer"}, meta={"label": 3})
        assert buffer.sample(indices=[newer.index])[0].data["note"] == "newer"
    finally:
        buffer.close()
        reader.close()


@pytest.mark.parametrize("way", list(PLANTED))
def test_a_planted_slot_cannot_crash_the_reader_or_forge_objects(way: str, name: str, tmp_path: Any) -> None:
    """An object dtype with zeroed flags lets numpy's pickle build an object array whose element is
    any pointer, which the reader's next touch follows (SIGSEGV); ``bytearray(n)`` allocates any
    size. Planted in a data slot, a prioritized buffer's meta slot or a ``save_data`` file, each is
    refused with ``UnsafePickle`` naming what it names; the reader lives on, the buffer works."""
    import subprocess
    import sys

    from .test_cli import ENV, ROOT

    code = f"from tests.test_compat_ding import planted; planted({way!r}, {name!r}, {str(tmp_path)!r})"
    env = {k: v for k, v in ENV.items() if k != "PYTHONWARNINGS"}  # as a learner runs: the child records warnings
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, f"the reader exited with {proc.returncode}: {proc.stderr[-3000:]}"
    [line] = [s for s in proc.stdout.splitlines() if s.startswith("refused:")]
    assert f"{PLANTED[way][1]}" in line and "trusted_pickles=True" in line, line


def test_slots_keep_plain_data_of_every_kind(deque: Callable[..., DequeBuffer]) -> None:
    """Without ``trusted_pickles``, every plain kind a push's leftovers can hold reads back equal,
    of its type; an object array is refused at the push, naming its dtype, and stored with
    ``trusted_pickles=True``."""
    import collections

    from shmbuffer import UnsafePickle

    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(list, {"a": [1]})
    value = {
        "nested": [("t", 2**80, -2**63, 1.5, 2 + 3j, None, True), {"k": b"raw", 3: bytearray(b"ba")}],
        "sets": (set([1, "a"]), frozenset([2.5])), "range": range(1, 9, 2), "slice": slice(None, 4, None),
        "ordered": collections.OrderedDict(b=1, a=2), "counter": collections.Counter("abca"), "counts": counts,
        "window": collections.deque([1, 2], maxlen=3), "text": "é\ud800",
        "arrays": [np.arange(6, dtype=">i4").reshape(2, 3), np.asfortranarray(np.ones((2, 3))), np.array(7.0),
                   np.zeros((0, 4), np.uint8), np.array([True, False]), np.array(["s", "tu"]), np.array([b"x"]),
                   np.array(["2024-01-02"], "datetime64[D]"), np.ones(2, np.complex64)],
        "scalars": [np.float16(1.5), np.bool_(True), np.uint64(2**64 - 1), np.dtype("<f4")],
        "tensors": [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.ones(2, requires_grad=True),
                    torch.tensor(3, dtype=torch.int8), torch.ones(3)[::2], torch.Size([2, 3]),
                    torch.device("cpu"), torch.float16],
        "row": BufferedData(data=[1], index=4, meta={"m": 1}),
    }
    buffer = deque(size=2, object_bytes=4096)
    item = buffer.push(value, meta={"nested": value["nested"]})
    [got] = buffer.sample(indices=[item.index])

    def same(a: Any, b: Any) -> bool:
        if type(a) is not type(b):
            return False
        if isinstance(a, np.ndarray):
            return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all()) and a.flags.writeable
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and torch.equal(a.detach(), b.detach()) and a.requires_grad == b.requires_grad
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        return bool(a == b)

    assert same(got.data, value) and got.data["counts"].default_factory is list
    assert got.data["window"].maxlen == 3 and same(got.meta["nested"], value["nested"])
    objects = np.array([1, "one"], dtype=object)
    with pytest.raises(UnsafePickle, match=r"numpy\.ndarray of dtype object.*trusted_pickles=True"):
        buffer.push({"objects": objects})
    assert buffer.count() == 1
    trusting = deque(size=2, trusted_pickles=True)
    stored = trusting.push({"objects": objects})
    assert trusting.sample(indices=[stored.index])[0].data["objects"].tolist() == [1, "one"]


def _u4(n: int) -> bytes:
    return n.to_bytes(4, "little")


def _i8(n: int) -> bytes:
    return n.to_bytes(8, "little", signed=True)


CRAFTED = {  # bytes for a slot, and what the refusal says
    "a string longer than the slot": (b"s" + _u4(2**32 - 1), "a length of 4294967295"),
    "a list of more items than bytes": (b"l" + _u4(10**9), "a length of 1000000000"),
    "a huge array": (b"a\x03<f8\x02" + _i8(2**40) + _i8(2**40), "an array of 9671406556917033397649408 bytes"),
    "a huge tensor": (b"x\x02\x00s" + _u4(3) + b"cpu\x01" + _i8(2**50), "an array of 4503599627370496 bytes"),
    "a negative size": (b"a\x03<f8\x01" + _i8(-8), "expected at most 32 sizes >= 0"),
    "an object dtype": (b"a\x03|O8\x01" + _i8(1) + _i8(0x4141414141), "dtype '|O8'"),
    "a structured dtype": (b"y\x03|V8", "dtype '|V8'"),
    "a dtype of items of no bytes": (b"a\x03|S0\x01" + _i8(2**62), "dtype '|S0'"),
    "a dtype not as numpy writes it": (b"y\x03<b1", "dtype '<b1'"),
    "a huge int": (b"I" + _u4(2**31), "a length of 2147483648"),
    "values nested too deep": (b"l\x01\x00\x00\x00" * 150 + b"N", "nest more than 100 deep"),
    "an unknown tag": (b"Z", "unknown tag"),
    "a torch dtype out of the table": (b"e\xff", "torch dtype number 255"),
    "a defaultdict factory out of the table": (b"u\x09" + _u4(0), "defaultdict factory number 9"),
    "a slot that ends inside a value": (b"t" + _u4(2) + b"s" + _u4(1012) + b"x" * 1012 + b"q", "ends inside a value"),
    "an unhashable key": (b"m" + _u4(1) + b"l" + _u4(0) + b"N", "unhashable"),
    "a deque of a negative length": (b"Q" + b"q" + _i8(-1) + b"l" + _u4(0), "maxlen"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_slot_bytes_are_refused_without_allocating(deque: Callable[..., DequeBuffer], case: str) -> None:
    """Bytes in this facade's own encoding, crafted: each raises ``UnsafePickle`` naming the row and
    why, allocating nothing near what they ask for; the buffer reads its other rows."""
    import tracemalloc

    from shmbuffer import UnsafePickle
    from shmbuffer.compat.ding.row import OBJECT

    buffer = deque(size=4, object_bytes=1024)  # the size "a slot that ends inside a value" fills
    good = buffer.push({"obs": np.ones(2), "note": "good"})
    bad = buffer.push({"obs": np.zeros(2), "note": "plain"})
    store = buffer.buffer
    assert store is not None
    raw, says = CRAFTED[case]
    slot = np.zeros(store.schema[OBJECT].shape, np.uint8)
    slot[:1 + len(raw)] = np.frombuffer(b"\x01" + raw, np.uint8)
    store.update(np.array([bad.index]), {OBJECT: slot})
    tracemalloc.start()
    try:
        with pytest.raises(UnsafePickle, match=f"row {bad.index}'s data slot does not hold what this buffer writes") as e:
            buffer.sample(indices=[bad.index])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert says in str(e.value) and peak < 1 << 20
    assert buffer.sample(indices=[good.index])[0].data["note"] == "good"
