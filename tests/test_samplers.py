"""Samplers: one contract suite run against every sampler, then what each promises on its own."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer.sampling.samplers import check_batch_size, importance_weights, uniform_ids

from .conftest import MUJOCO, SMALL, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]


@dataclass(frozen=True)
class NewestK(sb.Sampler):
    """Uniform over each lane's newest ``k`` rows (docs/samplers.md writes the same)."""

    k: int = 8
    kind: ClassVar[str] = "test-newest"

    def draw(self, ring: Any, tree: Any, rng: np.random.Generator, n: int, *, replace: bool = True,
             taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False) -> sb.Draw:
        first, stop = ring.bounds()
        return sb.Draw(uniform_ids(rng, n, np.maximum(first, stop - self.k), stop, replace=replace, taken=taken))



@dataclass(frozen=True)
class NewestUniform(sb.Uniform):
    """A subclass of ``Uniform`` with a draw of its own: uniform over each lane's newest ``k`` rows."""

    k: int = 8
    kind: ClassVar[str] = "test-newest-uniform"

    def draw(self, ring: Any, tree: Any, rng: np.random.Generator, n: int, *, replace: bool = True,
             taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False) -> sb.Draw:
        first, stop = ring.bounds()
        return sb.Draw(uniform_ids(rng, n, np.maximum(first, stop - self.k), stop, replace=replace, taken=taken))


@dataclass(frozen=True)
class NewestPrioritized(sb.Prioritized):
    """A subclass of ``Prioritized`` with a draw of its own: uniform over each lane's newest ``k``
    rows, weighted by their leaves (``Prioritized.weights``)."""

    k: int = 8
    kind: ClassVar[str] = "test-newest-prioritized"

    def draw(self, ring: Any, tree: Any, rng: np.random.Generator, n: int, *, replace: bool = True,
             taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False) -> sb.Draw:
        first, stop = ring.bounds()
        ids = uniform_ids(rng, n, np.maximum(first, stop - self.k), stop, replace=replace, taken=taken)
        return sb.Draw(ids, tree.leaves[ring.slots(ids)])


@dataclass(frozen=True)
class Clipped(sb.Prioritized):
    """Prioritized replay of clipped priorities: the leaf ``min(p, clip) ** alpha``."""

    clip: float = 4.0
    kind: ClassVar[str] = "test-clipped"

    def leaf(self, priorities: np.ndarray) -> np.ndarray:
        return np.minimum(priorities, self.clip) ** self.alpha

    def priority_of(self, leaves: np.ndarray) -> np.ndarray:
        return np.asarray(leaves, np.float64) ** (1.0 / self.alpha)


SAMPLERS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "uniform-lanes": {"lanes": 4},
    "uniform-max-use": {"max_use": 1000},
    "prioritized": {"sampler": sb.Prioritized(alpha=0.6, beta=0.4)},
    "prioritized-max-use": {"sampler": sb.Prioritized(), "max_use": 1000},
    "users-newest-k": {"sampler": NewestK(10_000)},  # a user's sampler (docs/samplers.md), drawing in Python
    "users-uniform-subclass": {"sampler": NewestUniform(10_000)},  # subclasses with draws of their own
    "users-prioritized-subclass": {"sampler": NewestPrioritized(k=10_000)},
    "users-prioritized-leaf": {"sampler": Clipped(alpha=0.6, clip=0.5)},  # its own leaf, the built-in draw
}


# -- the contract: every sampler ---------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(SAMPLERS))
@pytest.mark.parametrize("replace", [True, False])
def test_contract(config: str, replace: bool, make: Make, name: str) -> None:
    """Ids in range, only committed rows, right shapes, reproducible under a seed."""
    kw = SAMPLERS[config]
    buf = make(MUJOCO, capacity=64, name=name, seed=3, **kw)
    lanes = buf.lanes
    for i in range(0, 100, 4):  # wraps: ids 0..99 pushed, each lane keeps its newest rows
        buf.push(transition(i, 4), lane=(i // 4) % lanes)
    everything = buf.get(slice(None))
    held = set(seq_of(everything))
    seq_of_id = dict(zip(everything.index.tolist(), seq_of(everything).tolist(), strict=True))
    assert len(held) == 64
    twin = sb.ReplayBuffer.attach(buf.handle, seed=3)
    try:
        for n in (1, 7, 64):
            batch = buf.sample(n, replace=replace)
            again = twin.sample(n, replace=replace)
            assert len(batch) == n and batch.obs.shape == (n, 17) and batch.reward.shape == (n,)
            seq = seq_of(batch)  # every value of every row derives from one sequence number
            assert set(seq) <= held
            assert [seq_of_id[i] for i in batch.index.tolist()] == seq.tolist()  # ids name their rows
            assert np.array_equal(batch.index, again.index)
            if not replace:
                assert len(set(seq)) == n
            if "weight" in batch:
                assert batch.weight.shape == (n,) and batch.weight.dtype == np.float32
                assert np.all((batch.weight > 0) & (batch.weight <= 1))
        with pytest.raises(sb.EmptyBufferError):
            buf.sample(65, replace=False)
        assert seq_of(buf.sample(65)).size == 65 or not replace
    finally:
        twin.close()


@pytest.mark.parametrize("config", sorted(SAMPLERS))
def test_contract_skips_rows_being_written(config: str, make: Make, name: str) -> None:
    kw = SAMPLERS[config]
    buf = make(MUJOCO, capacity=16 * kw.get("lanes", 1), name=name, **kw)
    buf.push(transition(0, 8), lane=0)
    prios = buf.priorities  # rows being written have their priority already, as in push()
    res = buf.ring.reserve(4, also=None if prios is None else lambda s: prios.set_rows(s, None, fresh=True))  # a writer in the middle of rows 8..11
    try:
        for _ in range(20):
            assert set(seq_of(buf.sample(32))) <= set(range(8))
    finally:
        buf.ring.abandon(res)


@pytest.mark.parametrize("config", sorted(SAMPLERS))
def test_contract_empty_and_cleared(config: str, make: Make, name: str) -> None:
    kw = SAMPLERS[config]
    buf = make(MUJOCO, capacity=16 * kw.get("lanes", 1), name=name, **kw)
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        buf.sample(4)
    buf.push(transition(0, 10), lane=0)
    buf.clear()
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(4)
    buf.push(transition(50, 3), lane=0)
    assert set(seq_of(buf.sample(50))) == {50, 51, 52}


def test_uniform_ids_on_plain_arrays() -> None:
    rng = np.random.default_rng(0)
    start, stop = np.array([10, 0, 5]), np.array([14, 0, 7])  # lane 1 is empty
    ids = uniform_ids(rng, 60_000, start, stop)
    lane, n = ids % 3, ids // 3
    assert set(lane) == {0, 2}
    assert ((n >= start[lane]) & (n < stop[lane])).all()
    assert np.abs(np.bincount(ids, minlength=3 * 14)[ids.min():].max() / 10_000 - 1) < 0.05
    distinct = uniform_ids(rng, 6, start, stop, replace=False)
    assert len(set(distinct)) == 6
    assert uniform_ids(rng, 7, start, stop, replace=False).size == 6  # only 6 rows exist
    taken = distinct[:3]
    rest = uniform_ids(rng, 6, start, stop, replace=False, taken=taken)
    assert set(rest) == set(distinct) - set(taken)
    assert uniform_ids(rng, 5, np.array([3]), np.array([3])).size == 0


# -- prioritized ------------------------------------------------------------------------------


def test_frequencies_follow_priorities(make: Make, name: str) -> None:
    alpha = 0.7
    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=sb.Prioritized(alpha=alpha, eps=0.0))
    p = np.arange(1, 9, dtype=float)
    buf.push(transition(0, 8), priority=p)
    counts = np.zeros(8)
    for _ in range(200):
        counts += np.bincount(buf.sample(512).index, minlength=8)
    expected = p**alpha / (p**alpha).sum() * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 24  # 7 degrees of freedom, p < 0.001; alpha = 0.6 or 0.8 would give chi2 > 100
    wrong = p**0.6 / (p**0.6).sum() * counts.sum()
    assert ((counts - wrong) ** 2 / wrong).sum() > 100


def test_weights_and_beta_annealing(make: Make, name: str) -> None:
    s = sb.Prioritized(alpha=0.5, beta=0.4, beta_steps=4, eps=0.0)
    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=s)
    p = np.array([1.0, 4, 9, 16, 25, 36, 49, 64])
    buf.push(transition(0, 8), priority=p)
    leaf = p**0.5
    for call in range(6):
        batch = buf.sample(32)
        beta = min(1.0, 0.4 + 0.6 * call / 4)
        assert s.beta_at(call) == pytest.approx(beta)
        want = (leaf[batch.index] / leaf.min()) ** -beta
        np.testing.assert_allclose(batch.weight, want, rtol=1e-6)
    assert s.beta_at(10**6) == 1.0


def test_update_priorities(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, seed=1, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 16))
    batch = buf.sample(16, replace=False)
    prios = np.zeros(16)
    prios[batch.index == 5] = 1.0  # only row 5 keeps a priority
    assert buf.update_priorities(batch, prios) == 16
    assert set(buf.sample(100).index) == {5}
    assert buf.update_priorities([3], [2.0]) == 1  # ids work too
    assert set(buf.sample(300).index) == {3, 5}


def test_bad_priorities_change_nothing(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 16))
    batch = buf.sample(4)
    tree = buf.priorities.tree.sums.copy()  # type: ignore[union-attr]
    for bad, match in [([1, 2, np.nan, 1], r"finite values >= 0, got \[nan\] at positions \[2\]"),
                       ([1, -1, 1, 1], r"got \[-1.0\]"), ([1, np.inf, 1, 1], "inf"),
                       ([1, 2], r"expected 4 values \(one per row\), got shape \(2,\)")]:
        with pytest.raises(sb.FieldError, match=match):
            buf.update_priorities(batch, bad)
        with pytest.raises(sb.FieldError):
            buf.push(transition(0, 4), priority=bad)
    assert np.array_equal(buf.priorities.tree.sums, tree)  # type: ignore[union-attr]
    assert buf.stats["inserted"] == 16


def test_stale_updates_are_dropped(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 8), priority=np.ones(8))
    batch = buf.sample(8, replace=False)
    buf.push(transition(8, 8), priority=np.full(8, 2.0))  # every sampled row is overwritten
    assert buf.update_priorities(batch, np.full(8, 1000.0)) == 0
    assert np.all(buf.priorities.tree.leaves == 2.0)  # type: ignore[union-attr]


def test_new_rows_get_the_largest_priority_so_far(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 2))
    assert buf.priorities.max_priority == 1.0  # type: ignore[union-attr]
    buf.push(transition(2, 1), priority=5.0)
    buf.update_priorities([0], [7.0])
    buf.push(transition(3, 1))
    assert buf.priorities.tree.leaves[:4].tolist() == [7.0, 1.0, 5.0, 7.0]  # type: ignore[union-attr]


def test_priorities_on_a_uniform_buffer_are_refused(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 2))
    with pytest.raises(sb.FieldError, match="samples uniformly"):
        buf.push(transition(0, 1), priority=1.0)
    with pytest.raises(sb.FieldError, match="samples uniformly"):
        buf.update_priorities([0], [1.0])
    assert len(buf) == 2


def test_bad_sampler_options() -> None:
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        sb.Prioritized(alpha=-1)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        sb.Prioritized(beta=2)
    with pytest.raises(ValueError, match=r"beta_steps must be an int >= 0"):
        sb.Prioritized(beta_steps=-1)
    with pytest.raises(ValueError, match=r"beta_steps must be an int >= 0"):
        sb.Prioritized(beta_steps=2.5)  # type: ignore[arg-type]
    # nerveX's anneal_step=0: no annealing, as beta_steps=None
    assert sb.Prioritized(beta=0.4, beta_steps=0).beta_at(10**6) == 0.4
    with pytest.raises(ValueError, match="max_use: expected a positive int"):
        sb.ReplayBuffer(MUJOCO, 8, max_use=0)
    with pytest.raises(ValueError, match=r"sampler: expected a Sampler \(Uniform\(\), Prioritized\(\.\.\.\) or a subclass"):
        sb.ReplayBuffer(MUJOCO, 8, sampler="per")  # type: ignore[arg-type]


def _update_from_child(handle: sb.BufferHandle, ids: list[int]) -> None:
    with sb.ReplayBuffer.attach(handle) as buf:
        buf.update_priorities(ids, np.zeros(len(ids)))


def test_update_from_another_process(make: Make, name: str, procs: list) -> None:
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 8))
    p = mp.get_context("spawn").Process(target=_update_from_child, args=(buf.handle, list(range(7))))
    p.start()
    procs.append(p)
    p.join(60)
    assert p.exitcode == 0
    assert set(buf.sample(100).index) == {7}


# -- max use ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized()])
def test_max_use(sampler: Any, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name, seed=0, sampler=sampler, max_use=3)
    buf.push(transition(0, 10))
    drawn = np.concatenate([buf.sample(1).index for _ in range(29)])
    drawn = np.concatenate([drawn, buf.sample(1).index])
    assert np.bincount(drawn, minlength=10).tolist() == [3] * 10  # every row exactly max_use times
    with pytest.raises(sb.EmptyBufferError, match="max_use=3"):
        buf.sample(1)
    buf.push(transition(10, 2))  # new rows start with no uses
    assert set(buf.sample(6).index) == {10, 11}
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(1)


def test_max_use_within_one_batch(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name, seed=0, max_use=2)
    buf.push(transition(0, 10))
    batch = buf.sample(20)  # with replacement, but no row more than twice
    assert np.bincount(batch.index, minlength=10).tolist() == [2] * 10


def test_max_use_counts_across_processes(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=20, name=name, seed=0, max_use=1)
    buf.push(transition(0, 20))
    other = sb.ReplayBuffer.attach(buf.handle, seed=1)
    try:
        seen = list(buf.sample(10, replace=False).index) + list(other.sample(10, replace=False).index)
    finally:
        other.close()
    assert sorted(seen) == list(range(20))


# -- epochs -------------------------------------------------------------------------------------


def test_epoch_gives_every_row_once(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=40, lanes=2, name=name, seed=0)
    buf.push(transition(0, 20), lane=0)
    buf.push(transition(100, 13), lane=1)
    batches = list(buf.epoch(8))
    assert [len(b) for b in batches] == [8, 8, 8, 8, 1]
    seen = np.concatenate([seq_of(b) for b in batches])
    assert sorted(seen) == list(range(20)) + list(range(100, 113))
    assert not np.array_equal(seen, np.sort(seen))  # shuffled
    ordered = np.concatenate([seq_of(b) for b in buf.epoch(10, shuffle=False, drop_last=True)])
    assert ordered.tolist() == list(range(20)) + list(range(100, 110))
    assert buf.stats["sampled"] == 33 + 30
    with pytest.raises(ValueError, match="positive batch size"):
        next(buf.epoch(0))


def test_epoch_counts_uses_and_drops_overwritten_rows(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name, max_use=2)
    buf.push(transition(0, 10))
    for _ in range(2):
        assert sorted(np.concatenate([seq_of(b) for b in buf.epoch(4)])) == list(range(10))
    assert list(buf.epoch(4)) == []  # every row used twice
    with pytest.raises(sb.EmptyBufferError, match="max_use=2"):
        buf.sample(1)
    fresh = make(MUJOCO, capacity=10, name=name + "f")
    fresh.push(transition(0, 10))
    batches = fresh.epoch(5, shuffle=False)
    assert seq_of(next(batches)).tolist() == [0, 1, 2, 3, 4]
    fresh.push(transition(10, 7))  # overwrites rows 0..6 before the second batch (rows 5..9)
    assert [seq_of(b).tolist() for b in batches] == [[7, 8, 9]]


def test_prioritized_without_replacement_beyond_what_is_left(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=20, name=name, max_use=1)
    buf.push(transition(0, 20))
    buf.sample(15, replace=False)
    with pytest.raises(sb.EmptyBufferError, match=r"only 5 rows of buffer .* can be drawn; the others are used up \(max_use=1\)"):
        buf.sample(6, replace=False)


def test_rows_being_written_are_never_drawn(make: Make, name: str) -> None:
    """Prioritized rows get their priority inside the reservation: a row being written is in the
    tree already, yet a draw that lands on it re-draws."""
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0), max_use=1000)
    buf.push(transition(0, 8), priority=np.full(8, 1.0))
    res = buf.ring.reserve(4, also=lambda slots: buf.priorities.set_rows(slots, np.full(4, 3.0), fresh=True))  # type: ignore[union-attr]
    try:
        assert buf.priorities.tree.leaves[8:12].tolist() == [3.0] * 4  # type: ignore[union-attr]  # 60% of the mass
        assert set(seq_of(buf.sample(64))) <= set(range(8))
    finally:
        buf.ring.abandon(res)



# -- clear is final ------------------------------------------------------------------------------


def test_nothing_cleared_comes_back(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 32))
    batch = buf.sample(8)
    epoch = buf.epoch(8, shuffle=False)
    next(epoch)
    buf.clear()
    assert buf.update_priorities(batch, np.ones(8)) == 0  # stale: dropped, not resurrected
    assert buf.priorities.tree.total == 0  # type: ignore[union-attr]
    assert list(epoch) == []
    with pytest.raises(sb.EmptyBufferError):
        buf.take(batch.index)
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        buf.sample(4)
    buf.push(transition(100, 4))
    assert set(seq_of(buf.sample(64))) == {100, 101, 102, 103}


@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized()])
def test_a_clear_between_draw_and_gather(sampler: Any, make: Make, name: str, monkeypatch: Any) -> None:
    from shmbuffer.protocol import reader

    buf = make(MUJOCO, capacity=64, name=name, seed=0, sampler=sampler)
    buf._paths.one_calls = False  # the Python path, whose gather is the seam (test_draw_gather.py: the one call)
    buf.push(transition(0, 32))
    real = reader.gather
    cleared: list[bool] = []

    def gather(*args: Any, **kwargs: Any) -> Any:
        if not cleared:
            cleared.append(True)
            buf.clear()  # another process clears right here
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "gather", gather)
    with pytest.raises(sb.EmptyBufferError, match="cleared"):
        buf.sample(8)
    assert cleared


# -- ids that never existed, priorities too large for the tree, a clear killed half-way ------


def test_update_priorities_refuses_ids_that_never_existed(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, lanes=2, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 5), lane=0)  # ids 0 2 4 6 8
    buf.push(transition(5, 3), lane=1)  # ids 1 3 5
    tree = buf.priorities.tree.sums.copy()  # type: ignore[union-attr]
    top = buf.priorities.max_priority  # type: ignore[union-attr]
    unknown: list[tuple[Any, str]] = [
        ([-1, 12345], r"\[-1, 12345\]"), ([0, 7], r"\[7\]"), ([2**63 - 1], r"\[9223372036854775807\]"),
        ([-(2**63)], r"\[-9223372036854775808\]"), (np.array([2**64 - 1], np.uint64), r"\[18446744073709551615\]"),
    ]
    for ids, shown in unknown:
        with pytest.raises(sb.FieldError, match=rf"update_priorities: ids {shown} never named a row .* nothing was changed"):
            buf.update_priorities(ids, np.full(len(ids), 5.0))
    for ids in (np.array([0.0, 2.0]), [True, False], ["0", "2"]):
        with pytest.raises(sb.FieldError, match="update_priorities: expected integer row ids"):
            buf.update_priorities(ids, [5.0, 5.0])
    assert np.array_equal(buf.priorities.tree.sums, tree) and buf.priorities.max_priority == top  # type: ignore[union-attr]
    assert buf.update_priorities(np.array([8, 5], np.uint32), [2.0, 3.0]) == 2  # any integer dtype
    assert buf.update_priorities([], []) == 0
    buf.push(transition(8, 5), lane=0)  # lane 0 laps: ids 0..8 of lane 0 are overwritten, not unknown
    assert buf.update_priorities([0, 2, 1], [9.0, 9.0, 9.0]) == 1  # stale rows are still skipped


def test_priorities_whose_leaves_overflow_are_refused(make: Make, name: str) -> None:
    """Finite priorities whose leaf (p + eps) ** alpha overflows would make the total inf, after
    which no sample could ever succeed; they are refused and the tree stays as it was."""
    squared = make(MUJOCO, capacity=8, name=name, seed=0, sampler=sb.Prioritized(alpha=2.0))
    squared.push(transition(0, 4), priority=[1.0, 2.0, 3.0, 1e139])  # leaf 1e278: fine
    tree = squared.priorities.tree  # type: ignore[union-attr]
    before = tree.sums.copy()
    with pytest.raises(sb.FieldError, match=r"priority: got \[1e\+200\] at positions \[0\], whose tree leaves .* exceed 1e\+280"):
        squared.push(transition(4, 1), priority=1e200)
    assert len(squared) == 4 and squared.stats["inserted"] == 4  # refused before any row was reserved
    with pytest.raises(sb.FieldError, match=r"update_priorities: priority: got \[1e\+141\] at positions \[1\], .* expected priorities <= 1e\+140"):
        squared.update_priorities([0, 1], [1.0, 1e141])
    assert np.array_equal(tree.sums, before) and np.isfinite(tree.total)
    assert squared.priorities.max_priority == 1e139  # type: ignore[union-attr]
    assert set(seq_of(squared.sample(16))) <= {0, 1, 2, 3}

    linear = make(MUJOCO, capacity=8, name=name + "l", seed=0, sampler=sb.Prioritized(alpha=1.0))
    with pytest.raises(sb.FieldError, match="exceed 1e"):
        linear.push(transition(0, 2), priority=[1e308, 1e308])
    linear.push(transition(0, 8), priority=np.full(8, 1e280))  # every leaf at the bound: the total stays finite
    assert linear.priorities.tree.total == pytest.approx(8e280)  # type: ignore[union-attr]
    assert len(seq_of(linear.sample(8))) == 8
    root = make(MUJOCO, capacity=8, name=name + "r", sampler=sb.Prioritized(alpha=0.5))
    root.push(transition(0, 2), priority=[1e308, 1.0])  # any finite priority fits with alpha <= 0.5
    assert np.isfinite(root.priorities.tree.total)  # type: ignore[union-attr]


def _die_inside_clear(handle: sb.BufferHandle) -> None:
    """Clear ``handle``'s buffer, dying (SIGKILL, holding the lock) after the lanes moved and
    before the priority tree was reset."""
    import os
    import signal

    from shmbuffer.protocol import priorities

    def die(self: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    priorities.Priorities.clear = die  # type: ignore[method-assign]
    buf = sb.ReplayBuffer.attach(handle)
    buf.clear()


@pytest.mark.parametrize("max_use", [None, 2])
def test_a_clear_killed_after_the_lanes_moved_is_repaired(max_use: int | None, make: Make, name: str, procs: list) -> None:
    import signal

    from shmbuffer.sampling.sumtree import SumTree

    buf = make(MUJOCO, capacity=16, lanes=2, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0),
               max_use=max_use)
    buf.push(transition(0, 5), lane=0, priority=np.arange(1.0, 6.0))
    buf.push(transition(5, 3), lane=1, priority=[7.0, 8.0, 9.0])
    p = mp.get_context("spawn").Process(target=_die_inside_clear, args=(buf.handle,))
    p.start()
    procs.append(p)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    tree = buf.priorities.tree  # type: ignore[union-attr]
    assert len(buf) == 0 and tree.total == 39.0  # the rows are gone, their priorities are not
    ids = buf.push(transition(100, 2), lane=1, priority=[2.0, 3.0])  # the next locker recovers and repairs
    assert buf.stats["lock_recoveries"] == 1 and ids.tolist() == [17, 19]
    want = np.zeros(16)
    want[buf.ring.slots(ids)] = [2.0, 3.0]
    fresh = SumTree(16)
    fresh.update(np.arange(16), want)
    assert np.array_equal(tree.sums, fresh.sums) and np.array_equal(tree.mins, fresh.mins)
    assert set(seq_of(buf.sample(2 if max_use else 64))) <= {100, 101}
    buf.push(transition(102, 1), lane=0)
    assert buf.priorities.max_priority == 9.0  # type: ignore[union-attr]


def test_priority_and_uses_are_public(make: Make, name: str) -> None:
    """A row's tree leaf and use count, read through the public API by id."""
    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0), max_use=3)
    ids = buf.push(transition(0, 4), priority=[1.0, 2.0, 3.0, 4.0])
    assert buf.priority(ids).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert buf.uses(ids).tolist() == [0, 0, 0, 0]
    batch = buf.sample(2, replace=False)
    used = buf.uses(ids)
    assert used.sum() == 2 and set(ids[used == 1].tolist()) == set(batch.index.tolist())
    buf.update_priorities(batch, [5.0, 5.0])
    assert buf.priority(batch.index).tolist() == [5.0, 5.0]
    with pytest.raises(sb.UnknownIdError):
        buf.priority([99])
    plain = make(MUJOCO, capacity=8, name=name + "u")
    plain.push(transition(0, 2))
    with pytest.raises(sb.FieldError, match="no priority tree"):
        plain.priority([0])
    with pytest.raises(sb.FieldError, match="counts no uses"):
        plain.uses([0])


def test_rows_of_a_reclaimed_writer_entry_leave_the_tree(make: Make, name: str) -> None:
    """A writer that died holding reserved rows (their leaves already set, as a push sets them
    inside the reservation), whose entry is later reclaimed because the writer table is full: its
    rows turn empty and their leaves 0, so draws no longer land on them and the tree's total is
    that of the rows that count."""
    import os
    import subprocess
    import sys

    from shmbuffer.protocol.layout import WRITERS
    from shmbuffer.shm.segment import start_time

    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 4), priority=np.ones(4))
    code = (f"import os, shmbuffer as sb; b = sb.ReplayBuffer.attach({name!r}); "
            "b.ring.reserve(2, also=lambda s: b.priorities.set_rows(s, None, fresh=True)); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    rg, tree = buf.ring, buf.priorities.tree  # type: ignore[union-attr]
    assert rg.stamp[4:6].tolist() == [9, 11] and tree.leaves[4:6].tolist() == [1.0, 1.0]
    mine = rg.writer_id()
    dead = int(rg.owner[4])
    table = rg._wpid
    free = [w for w in range(WRITERS) if w not in (mine, dead)]
    table[free] = os.getpid()  # every other entry held by a live process: the table is full
    rg._wstart[free] = start_time()
    try:
        with rg.lock:
            assert rg._reclaim_writer() == dead
        assert rg.stamp[4:6].tolist() == [0, 0]
        assert tree.leaves[4:6].tolist() == [0.0, 0.0] and tree.total == 4.0
        assert buf.stats["reclaimed"] == 2  # counted as reap() and lapping count theirs
        assert set(seq_of(buf.sample(64))) <= {0, 1, 2, 3}
    finally:
        table[free] = 0


def test_importance_weights_are_one_formula() -> None:
    """``(max(leaf, low) / low) ** -beta`` as float32; ones without a positive finite minimum; no
    overflow warning for a tiny minimum (the weight of a huge ratio is 0)."""
    leaves = np.array([1.0, 2.0, 4.0, 0.5])
    np.testing.assert_allclose(importance_weights(leaves, 1.0, 0.5), [1.0, 2 ** -0.5, 0.5, 1.0], rtol=1e-6)
    assert importance_weights(leaves, 1.0, 0.5).dtype == np.float32
    for low in (0.0, -1.0, float("inf"), float("nan")):
        assert (importance_weights(leaves, low, 0.4) == 1).all()
    with np.errstate(over="raise"):
        w = importance_weights(np.array([1e-300, 1e280]), 1e-300, 1.0)
    assert w[0] == 1 and w[1] == 0


def test_prioritized_weights_use_the_formula() -> None:
    """Without the extension's path, ``Prioritized.weights`` is ``importance_weights`` over the tree's minimum."""
    with sb.ReplayBuffer(MUJOCO, 64, sampler=sb.Prioritized(beta=0.5), seed=1) as buf:
        buf.push([transition(i) for i in range(8)], priority=np.arange(1.0, 9.0))
        prios = buf.priorities
        leaves = prios.tree.leaves[:8].copy()
        strided = leaves[::2]  # not C-contiguous: the Python path, not the extension's
        assert not strided.flags.c_contiguous
        got = buf.options.sampler.weights(prios.tree, strided, 0)
        np.testing.assert_allclose(got, importance_weights(leaves[::2], prios.tree.min, 0.5), rtol=1e-6)


@pytest.mark.parametrize("n", [True, False, 0, -3, 2.0, "4", None, np.bool_(True)])
def test_a_sample_size_is_a_positive_int(n: Any) -> None:
    with pytest.raises(ValueError, match="positive number of rows"):
        check_batch_size(n)


def test_a_sample_size_may_be_a_numpy_int() -> None:
    assert check_batch_size(np.int32(5)) == 5 and type(check_batch_size(np.int64(5))) is int



# -- a sampler of the user's: every path asks it ----------------------------------------------------
@pytest.mark.parametrize("lanes", [1, 3])
def test_a_users_sampler_draws_on_every_path(lanes: int, make: Make, name: str, tmp_path: Any) -> None:
    """Its own draw, never a built-in one in its place: the C one-call path leaves it to the reader;
    the batches, distinct rows, max_use, a save and load, and an attach all keep it."""
    from shmbuffer.protocol.draw_gather import DrawGather

    buf = make(sb.Schema(x=((), "int64")), 120, lanes=lanes, sampler=NewestK(5), seed=0, name=name)
    for ln in range(lanes):
        buf.push(x=np.arange(40) + 100 * ln, lane=ln)
    newest = {100 * ln + i for ln in range(lanes) for i in range(35, 40)}
    assert not DrawGather.serves(buf)
    got = buf.sample(2000).x.tolist()
    assert set(got) == newest  # each of them, and nothing else
    counts = np.bincount(np.array(got) % 100 - 35 + 5 * (np.array(got) // 100))
    assert counts.min() > 2000 / len(newest) * 0.7  # about uniform over them
    assert set(buf.sample(len(newest), replace=False).x.tolist()) == newest
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(len(newest) + 1, replace=False)
    again = sb.ReplayBuffer.attach(buf.handle)
    try:
        assert again.options.sampler == NewestK(5) and set(again.sample(200).x.tolist()) <= newest
    finally:
        again.close()
    buf.save(tmp_path / "s")
    loaded = sb.load(tmp_path / "s")
    try:
        assert loaded.options.sampler == NewestK(5) and set(loaded.sample(200).x.tolist()) <= newest
    finally:
        loaded.close()
        loaded.unlink()
    used = make(sb.Schema(x=((), "int64")), 40, sampler=NewestK(4), max_use=1, name=name + "u")
    used.push(x=np.arange(10))
    assert sorted(used.sample(4, replace=False).x.tolist()) == [6, 7, 8, 9]
    with pytest.raises(sb.WaitTimeout):  # the newest rows are used up; older ones are not its to draw
        used.sample(1)


def test_what_cannot_serve_a_users_sampler_says_so(name: str) -> None:
    pytest.importorskip("ray")
    from shmbuffer.ray import ShardedBuffer

    with pytest.raises(ValueError, match=r"own draw only.*Uniform\(\) or Prioritized\(\)"):
        ShardedBuffer(sb.Schema(x=((), "int64")), 100, sampler=NewestK(5))


def test_a_sampler_kind_unknown_to_the_process_is_named(make: Make, name: str) -> None:
    """A process that attaches without the sampler's class is told which kind to import."""
    import subprocess
    import sys

    buf = make(sb.Schema(x=((), "int64")), 16, sampler=NewestK(2), name=name)
    code = f"import shmbuffer as sb\ntry:\n    sb.ReplayBuffer.attach({buf.name!r})\nexcept Exception as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "sampler kind 'test-newest' is not known in this process" in out


def test_sampler_declarations_are_checked() -> None:
    with pytest.raises(TypeError, match="sets kind"):
        type("NoKind", (sb.Sampler,), {})
    with pytest.raises(TypeError, match="already"):
        type("Other", (sb.Sampler,), {"kind": "uniform"})
    with pytest.raises(TypeError, match="subclass Prioritized"):
        type("Fake", (sb.Sampler,), {"kind": "test-fake", "prioritized": True, "served": "tree"})


def test_annealing_continues_after_attach_and_load(make: Make, name: str, tmp_path: Path) -> None:
    s = sb.Prioritized(alpha=1.0, beta=0.0, beta_steps=10, eps=0.0)
    buf = make(SMALL, 10, sampler=s, name=name, seed=0)
    buf.push(obs=np.zeros((2, 3)), reward=np.zeros(2), priority=[1.0, 4.0])
    for _ in range(4):
        buf.sample(2)
    other = sb.ReplayBuffer.attach(buf.handle, seed=1)
    try:
        assert other.priorities.calls == 4
        batch = other.sample(64)                                       # the 5th call: beta 4 / 10
        expected = np.where(batch.index == 0, 1.0, 4.0 ** -0.4)
        assert np.allclose(batch.weight, expected)
        assert buf.priorities.calls == 5
    finally:
        other.close()
    buf.save(tmp_path / "s")
    with sb.load(tmp_path / "s", name=name + "l", seed=2) as back:
        assert back.priorities.calls == 5
        batch = back.sample(64)                                        # the 6th call: beta 5 / 10
        assert np.allclose(batch.weight, np.where(batch.index == 0, 1.0, 4.0 ** -0.5))


def test_update_priorities_with_ids_that_never_existed(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, sampler=sb.Prioritized(), name=name)
    buf.push(transition(0, 4))
    for ids in ([-1], [12345]):
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            buf.update_priorities(ids, [1.0])


def test_a_users_sampler_draws_on_the_device_copy(make: Make, name: str) -> None:
    """The device copy asks the sampler too: a sampler of the user's draws by its own ``draw``
    (on the host), never the device's uniform draw; a Loader over the copy follows it."""
    buf = make(sb.Schema(x=((), "int64")), 120, lanes=2, sampler=NewestK(4), seed=0, name=name)
    for ln in range(2):
        buf.push(x=np.arange(30) + 100 * ln, lane=ln)
    newest = {100 * ln + i for ln in range(2) for i in range(26, 30)}
    with sb.DeviceReplay(buf, "cpu", max_lag_rows=0) as copy:
        got = copy.sample(1000).x.tolist()
        assert set(got) == newest and "weight" not in copy.sample(4).extras


# -- subclasses of the built-in samplers with draws of their own: every path draws by them -------------
NEWEST = [NewestUniform(k=10), NewestPrioritized(k=10)]


def test_a_subclass_with_its_own_draw_is_not_served_by_a_built_in_one() -> None:
    """``served`` follows the methods: a subclass that keeps the built-in draw and weights is
    served as its base, one with its own draw (or weights) is not; nobody declares it."""

    @dataclass(frozen=True)
    class Renamed(sb.Prioritized):
        kind: ClassVar[str] = "test-renamed-prioritized"

    @dataclass(frozen=True)
    class OwnWeights(sb.Prioritized):
        kind: ClassVar[str] = "test-own-weights"

        def weights(self, tree: Any, leaves: Any, calls: int) -> np.ndarray | None:
            return None

    assert (sb.Uniform.served, sb.Prioritized.served, Renamed.served) == ("uniform", "tree", "tree")
    assert NewestUniform.served is None and NewestPrioritized.served is None and OwnWeights.served is None
    with pytest.raises(TypeError, match="served is not set by hand"):
        type("Liar", (NewestUniform,), {"kind": "test-liar", "served": "uniform"})


@pytest.mark.parametrize("sampler", NEWEST, ids=lambda s: type(s).__name__)
def test_a_subclass_draws_by_its_own_draw_on_every_path(sampler: sb.Sampler, path: str, make: Make, name: str) -> None:
    """The newest 10 rows only, from the one-call sample (or the Python path), distinct rows, n-step
    returns, a ``Loader``, a ``Mix`` and the device copy."""
    schema = sb.Schema(x=((), "int64"), reward=((), "float32"), next_obs=((), "float32"), done=((), "bool"))
    buf = make(schema, 1000, sampler=sampler, episodes=True, seed=0, name=name)
    buf.push(x=np.arange(500), reward=np.ones(500), next_obs=np.zeros(500), done=np.zeros(500, bool), episode=0)
    newest = set(range(490, 500))
    assert set(buf.sample(1000).x.tolist()) == newest
    assert set(buf.sample(10, replace=False).x.tolist()) == newest
    assert set(buf.sample(200, n_step=3, gamma=0.9).x.tolist()) <= newest
    assert set(sb.Mix([(buf, 1.0)]).sample(200).x.tolist()) <= newest
    for background in (False, True):
        with sb.Loader(buf, batch_size=200, batches=2, background=background) as loader:
            for batch in loader:
                assert set(batch.x.tolist()) <= newest
    with sb.DeviceReplay(buf, "cpu", max_lag_rows=0) as copy:
        got = copy.sample(500)
        assert set(got.x.tolist()) <= newest and ("weight" in got.extras) == sampler.weighted
    if sampler.weighted:
        batch = buf.sample(64)
        np.testing.assert_allclose(batch.weight, 1.0)  # every leaf the same: weight 1


def test_a_subclass_with_its_own_draw_is_refused_by_the_sharded_buffer() -> None:
    pytest.importorskip("ray")
    from shmbuffer.ray import ShardedBuffer

    for sampler in NEWEST:
        with pytest.raises(ValueError, match=r"own draw only.*Uniform\(\) or Prioritized\(\)"):
            ShardedBuffer(sb.Schema(x=((), "int64")), 100, sampler=sampler)


# -- a user's draw is checked as it returns ---------------------------------------------------------
@dataclass(frozen=True)
class BadDraw(sb.Sampler):
    """Uniform ids, then spoilt as ``how`` says."""

    how: str = "many"
    kind: ClassVar[str] = "test-bad-draw"

    def draw(self, ring: Any, tree: Any, rng: np.random.Generator, n: int, *, replace: bool = True,
             taken: np.ndarray | None = None, retry: bool = False, from_scan: bool = False) -> Any:
        first, stop = ring.bounds()
        ids = uniform_ids(rng, n, first, stop, replace=replace, taken=taken)
        spoilt = {"many": lambda: np.concatenate([ids, ids, ids[:3]]), "column": lambda: ids[:, None],
                  "negative": lambda: ids - 1000, "floats": lambda: ids.astype(np.float64),
                  "never-written": lambda: ids + 10_000, "few": lambda: ids[:-1], "no-draw": lambda: ids,
                  "list": lambda: ids.tolist()}[self.how]()
        return spoilt if self.how == "no-draw" else sb.Draw(spoilt)


BAD_DRAWS = {
    "many": (sb.SamplerError, r"ids of dtype int64 and shape \(\d+,\) for a draw of 8: expected Draw\(ids\) with a 1-D"),
    "column": (sb.SamplerError, r"shape \(8, 1\) for a draw of 8"),
    "negative": (sb.SamplerError, r"ids that never named a row: \[-"),
    "floats": (sb.SamplerError, r"ids of dtype float64"),
    "never-written": (sb.SamplerError, r"ids that never named a row: \[10"),
    "few": (sb.EmptyBufferError, r"gave 7 (distinct )?ids for the 8 asked|gave fewer ids than asked"),
    "no-draw": (sb.SamplerError, r"returned ndarray for a draw of 8: expected Draw\(ids\)"),
    "list": (sb.SamplerError, r"returned ids list"),
}


@pytest.mark.parametrize("how", sorted(BAD_DRAWS))
def test_a_bad_draw_is_named_at_once_on_every_path(how: str, path: str, make: Make, name: str) -> None:
    """Whatever a user's draw returns wrong is refused at its first draw (no second of re-draws),
    naming the class and its draw, and the buffer stays as it was."""
    import time

    error, match = BAD_DRAWS[how]
    buf = make(sb.Schema(x=((), "int64")), 1000, sampler=BadDraw(how), seed=0, name=name)
    buf.push(x=np.arange(500))
    before = buf.stats
    calls: list[Callable[[], Any]] = [lambda: buf.sample(8), lambda: buf.sample(8, replace=False),
                                      lambda: sb.Mix([(buf, 1.0)]).sample(8)]
    copy = sb.DeviceReplay(buf, "cpu")
    try:
        for call in [*calls, lambda: copy.sample(8)]:
            start = time.monotonic()
            with pytest.raises(error, match=match) as got:
                call()
            assert "test_samplers.BadDraw.draw" in str(got.value)
            assert time.monotonic() - start < 0.5
    finally:
        copy.close()
    assert buf.stats == before and len(buf) == 500


def test_distinct_rows_beyond_what_a_users_draw_can_give_name_the_draw(make: Make, name: str) -> None:
    buf = make(sb.Schema(x=((), "int64")), 10_000, sampler=NewestK(1000), seed=0, name=name)
    buf.push(x=np.arange(5000))
    assert len(buf.sample(1000, replace=False)) == 1000
    with pytest.raises(sb.EmptyBufferError, match=r"sample\(1001, replace=False\): .*NewestK.draw gave 1000 distinct "
                                                  r"ids for the 1001 asked, from buffer .* of 5000 rows"):
        buf.sample(1001, replace=False)


def test_the_buffers_sampler_is_an_attribute(make: Make, name: str) -> None:
    buf = make(MUJOCO, 8, sampler=sb.Prioritized(alpha=0.5), name=name)
    assert buf.sampler is buf.options.sampler and buf.sampler == sb.Prioritized(alpha=0.5)


# -- a buffer whose sampler class another process lacks -------------------------------------------------
def test_attach_takes_the_samplers_class_or_module(make: Make, name: str) -> None:
    """A process that lacks the class is told its module; ``attach(sampler=)`` takes the class or
    the module (another kind is refused); ``sampler=Unimported`` reads the rows without it."""
    import subprocess
    import sys

    buf = make(sb.Schema(x=((), "int64")), 16, sampler=NewestPrioritized(k=2), name=name)
    buf.push(x=np.arange(6))
    code = f"""if True:
        import sys
        import shmbuffer as sb
        from shmbuffer.sampling.samplers import Unimported
        try:
            sb.ReplayBuffer.attach({name!r})
        except sb.UnknownSampler as e:
            print("refused:", e)
        with sb.ReplayBuffer.attach({name!r}, sampler=Unimported) as stand_in:
            print("rows:", sorted(stand_in.get(slice(None)).x.tolist()), stand_in.sampler.to_json()["kind"])
            try:
                stand_in.sample(1)
            except sb.UnknownSampler as e:
                print("sample:", e)
        import tests.test_samplers as module
        with sb.ReplayBuffer.attach({name!r}, sampler=module.NewestPrioritized) as by_class:
            print("class:", sorted(set(by_class.sample(64).x.tolist())))
        with sb.ReplayBuffer.attach({name!r}, sampler=module) as by_module:
            print("module:", by_module.sampler)
        try:
            sb.ReplayBuffer.attach({name!r}, sampler=module.NewestK)
        except sb.UnknownSampler as e:
            print("other:", e)
    """
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert ("sampler kind 'test-newest-prioritized' is not known in this process (class NewestPrioritized of module "
            "tests.test_samplers)") in lines["refused"] and "import tests.test_samplers first" in lines["refused"]
    assert lines["rows"] == "[0, 1, 2, 3, 4, 5] test-newest-prioritized"
    assert "not imported in this process" in lines["sample"]
    assert lines["class"] == "[4, 5]"
    assert lines["module"] == "NewestPrioritized(alpha=0.6, beta=0.4, beta_steps=None, eps=1e-06, k=2)"
    assert "the sampler is kind 'test-newest-prioritized'" in lines["other"] and "not NewestK's" in lines["other"]


# -- a prioritized sampler's own leaf: the tree holds it, every path draws and weights by it -----------
def test_a_subclass_leaf_is_drawn_and_weighted_on_every_path(path: str, make: Make, name: str, tmp_path: Path) -> None:
    s = Clipped(alpha=1.0, beta=0.5, eps=0.0, clip=4.0)
    assert Clipped.served == "tree"  # its draw and weights are Prioritized's: the C one-call sample draws it
    buf = make(MUJOCO, capacity=8, name=name, seed=0, sampler=s)
    ids = buf.push(transition(0, 8), priority=np.arange(1.0, 9.0))
    leaves = np.array([1.0, 2, 3, 4, 4, 4, 4, 4])
    assert buf.priority(ids).tolist() == leaves.tolist()

    def follows_leaves(index: np.ndarray) -> None:
        counts = np.bincount(index, minlength=8)
        expected = leaves / leaves.sum() * counts.sum()
        assert ((counts - expected) ** 2 / expected).sum() < 24  # 7 degrees of freedom, p < 0.001

    follows_leaves(np.concatenate([buf.sample(512).index for _ in range(40)]))
    batch = buf.sample(64)
    np.testing.assert_allclose(batch.weight, (leaves[batch.index] / 1.0) ** -0.5, rtol=1e-6)
    with sb.DeviceReplay(buf, "cpu") as copy:
        got = [copy.sample(512) for _ in range(40)]
        follows_leaves(np.concatenate([g.index.numpy() for g in got]))
        np.testing.assert_allclose(got[0].weight.numpy(), leaves[got[0].index.numpy()] ** -0.5, rtol=1e-6)
    assert buf.update_priorities([0, 1], [100.0, 0.5]) == 2
    assert buf.priority([0, 1]).tolist() == [4.0, 0.5]
    buf.push(transition(8, 1))  # a new row gets the largest priority so far (100): its leaf is clipped
    assert buf.priority([8]).tolist() == [4.0]
    buf.save(tmp_path / "s")
    with sb.load(tmp_path / "s", name=name + "l") as back:
        assert back.sampler == s and back.priority(back.get(slice(None)).index).tolist() == buf.priority(
            buf.get(slice(None)).index).tolist()
    exported = sb.export(buf)
    assert exported["priority"].tolist() == buf.priority(exported["index"]).tolist()  # the leaf's inverse (alpha 1)


def test_a_leaf_of_ones_own_needs_its_inverse_and_priorities() -> None:
    leaf = {"leaf": lambda self, p: np.sqrt(p)}
    with pytest.raises(TypeError, match="also writes priority_of"):
        type("NoInverse", (sb.Prioritized,), {"kind": "test-no-inverse", **leaf})
    with pytest.raises(TypeError, match="subclasses Prioritized"):
        type("UniformLeaf", (sb.Uniform,), {"kind": "test-uniform-leaf", "priority_of": lambda self, v: v, **leaf})
