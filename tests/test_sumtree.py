"""The sum tree on plain arrays: batched updates equal one-at-a-time updates, draws follow the
leaves, totals and minima are right."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuffer.sampling.sumtree import FANOUT, TOP, SumTree

CAPACITIES = [1, 7, FANOUT, TOP, TOP + 1, FANOUT * TOP + 3, 100_000]


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_batched_equals_sequential_with_duplicates(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    batched, one_by_one = SumTree(capacity), SumTree(capacity)
    for _ in range(5):
        slots = rng.integers(0, capacity, 300)  # repeats included
        values = rng.random(300) * (rng.random(300) < 0.8)  # some zeros
        batched.update(slots, values)
        for s, v in zip(slots, values, strict=True):
            one_by_one.update(np.array([s]), np.array([v]))
        assert np.array_equal(batched.sums, one_by_one.sums)
        assert np.array_equal(batched.mins, one_by_one.mins)
    assert batched.total == pytest.approx(batched.leaves.sum(), rel=1e-12)
    positive = batched.leaves[batched.leaves > 0]
    assert batched.min == (positive.min() if positive.size else np.inf)


@given(
    capacity=st.integers(1, 5000),
    updates=st.lists(
        st.tuples(st.integers(0, 10**9), st.one_of(st.just(0.0), st.floats(1e-300, 1e6), st.floats(0, 1e-300))),
        min_size=1, max_size=60,
    ),
)
@settings(max_examples=60, deadline=None)
def test_tree_matches_a_plain_array(capacity: int, updates: list[tuple[int, float]]) -> None:
    tree, plain = SumTree(capacity), np.zeros(capacity)
    slots = np.array([s % capacity for s, _ in updates])
    values = np.array([v for _, v in updates])
    tree.update(slots, values)
    for s, v in zip(slots, values, strict=True):
        plain[s] = v
    assert np.array_equal(tree.leaves, plain)
    assert tree.total == pytest.approx(plain.sum(), rel=1e-9, abs=1e-9)
    if plain.sum() > 0:
        u = np.linspace(0, tree.total, 101)[:-1]
        found = tree.find(u)
        assert (plain[found] > 0).all()  # never a leaf of 0, never a padding slot
        if plain[plain > 0].min() > 1e-250:  # away from subnormal numbers, exact up to rounding
            reference = np.searchsorted(np.cumsum(plain), u, side="right")
            assert (found == reference).mean() > 0.95


def test_draws_follow_the_leaves() -> None:
    rng = np.random.default_rng(0)
    capacity = 10_000
    tree = SumTree(capacity)
    p = rng.random(capacity) ** 3
    p[rng.random(capacity) < 0.3] = 0
    tree.update(np.arange(capacity), p)
    found = tree.find(rng.random(2_000_000) * tree.total)
    assert (p[found] > 0).all()
    # group leaves in 20 bins of equal mass: each must get 1/20 of the draws (chi-square)
    bins = np.searchsorted(np.cumsum(p) / p.sum(), np.linspace(0, 1, 21)[1:-1])
    counts = np.bincount(np.searchsorted(bins, found, side="right"), minlength=20)
    expected = np.bincount(np.searchsorted(bins, np.arange(capacity), side="right"), weights=p, minlength=20)
    expected = expected / expected.sum() * found.size
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 for a correct tree; a wrong one is far off


def test_reset_and_sizes() -> None:
    tree = SumTree(100)
    tree.update(np.arange(100), np.ones(100))
    assert tree.total == 100 and tree.min == 1
    tree.reset()
    assert tree.total == 0 and tree.min == np.inf
    with pytest.raises(ValueError, match="needs two arrays"):
        SumTree(100, np.zeros(3), np.zeros(3))
    assert SumTree.size(1_000_000) < 1_000_000 * 1.1



def test_find_stays_inside_a_tree_being_rewritten() -> None:
    """A reader racing an update can see a parent with mass over children already zeroed."""
    tree = SumTree(5000)
    tree.update(np.arange(5000), np.ones(5000))
    tree.leaves[4000:] = 0  # an update or reset half-way: leaves zeroed, parents not yet
    tree._sums[1][4000 // 16:] = 0
    found = tree.find(np.linspace(0, tree.total, 1000, endpoint=False))
    assert found.min() >= 0 and found.max() < 5000


def test_rebuild_repairs_a_half_finished_update() -> None:
    rng = np.random.default_rng(1)
    tree, fresh = SumTree(70_000), SumTree(70_000)
    values = rng.random(70_000)
    tree.update(np.arange(70_000), values)
    fresh.update(np.arange(70_000), values)
    tree._sums[1][:100] = 0  # killed in the middle of recomputing a level
    tree._mins[2][:] = np.inf
    tree.rebuild()
    np.testing.assert_allclose(tree.sums, fresh.sums, rtol=1e-12)
    assert np.array_equal(tree.mins, fresh.mins) and tree.total == pytest.approx(fresh.total)


@pytest.mark.parametrize("capacity", [7, TOP + 1])
def test_rebuild_repairs_a_half_finished_reset(capacity: int) -> None:
    """A holder killed inside ``reset`` (the sums zeroed, the minima not yet) or between a leaf's
    sum and its minimum: the tree is rebuilt from the leaves' sums alone."""
    rng = np.random.default_rng(2)
    tree, fresh = SumTree(capacity), SumTree(capacity)
    tree.update(np.arange(capacity), rng.random(capacity) + 0.5)
    tree.sums[:] = 0  # reset, killed before the minima
    tree.rebuild()
    assert np.array_equal(tree.sums, fresh.sums) and np.array_equal(tree.mins, fresh.mins)
    assert tree.min == np.inf and tree.total == 0
    tree.update([3], [2.0])
    tree._mins[0][3] = 5.0  # killed between the leaf's sum and its minimum
    tree.rebuild()
    fresh.update([3], [2.0])
    assert np.array_equal(tree.mins, fresh.mins) and tree.min == 2.0


@pytest.mark.parametrize("capacity", [2, TOP + 5])
def test_a_point_rounded_up_to_the_total_lands_on_a_leaf_of_mass(capacity: int) -> None:
    """With a subnormal total, 0.99 * total rounds to the total itself (hypothesis found it)."""
    tree = SumTree(capacity)
    tree.update([0], [5e-324])
    found = tree.find(np.linspace(0, tree.total, 101)[:-1])
    assert (found == 0).all()
    tree.update([capacity - 1], [1.0])
    assert tree.find([tree.total, np.nextafter(tree.total, 0)]).tolist() == [capacity - 1] * 2
