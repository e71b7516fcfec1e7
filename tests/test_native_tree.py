"""The C tree and priorities (``native/tree.c``, ``native/priorities.c``) against the Python
reference: the same tree after the same updates, the same slots found, the same draws, weights and
priority updates; every kernel refuses bad input instead of crashing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import ring
from shmbuffer.sampling import sumtree
from shmbuffer.sampling.sumtree import SumTree

from .conftest import LIB, MUJOCO, needs_lib, python_tree, transition

Make = Callable[..., sb.ReplayBuffer]


CAPACITIES = [1, 15, 16, 4096, 4097, 70_001, 1_000_000]


@needs_lib
@pytest.mark.parametrize("capacity", CAPACITIES)
def test_tree_native_equals_python(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    fast, ref = SumTree(capacity), python_tree(capacity)
    assert fast.sums.shape == ref.sums.shape  # the same layout
    for _ in range(6):
        k = int(rng.integers(1, 400))
        slots = rng.integers(0, capacity, k)  # repeats included: the last value wins
        # dyadic values (multiples of 1/64 below 1024): every sum is exact in either order
        values = np.floor(rng.random(k) * 65536) / 64 * (rng.random(k) < 0.8)
        fast.update(slots, values)
        ref.update(slots, values)
        assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)
        assert fast.total == ref.total and fast.min == ref.min
    fast.update(rng.integers(0, capacity, 5), 2.5)  # a scalar value
    ref.update(fast.leaves.nonzero()[0][:0], 0.0)  # an empty update changes nothing
    ref.update(np.flatnonzero(fast.leaves != ref.leaves), fast.leaves[fast.leaves != ref.leaves])
    assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)
    if fast.total <= 0:
        return
    # the same points on the same tree land on the same slots; points at and past the total too
    mass = np.concatenate([rng.random(2000) * fast.total, [0.0, fast.total, fast.total * 2, np.nextafter(fast.total, 0)]])
    reader = python_tree(capacity, fast.sums, fast.mins)
    got, want = fast.find(mass), reader.find(mass)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert (fast.leaves[got] > 0).all()


@needs_lib
def test_tree_mins_follow_every_change() -> None:
    """The C update carries a min up (a parent takes a smaller new value, keeps its min when the
    child was not the smallest, looks at the 16 again when the smallest grew), or for a run of
    consecutive slots recomputes it from the children: many small updates in a few blocks, with
    ties, zeros and repeats, give exactly the mins numpy recomputes."""
    rng = np.random.default_rng(5)
    capacity = 70_001  # three levels: ties and changes reach the top
    fast, ref = SumTree(capacity), python_tree(capacity)
    for step in range(300):
        k = int(rng.integers(1, 9))
        slots = rng.integers(0, 600, k) if step % 3 else rng.integers(0, 40, k) * 16 * 16  # a few leaf and level-1 blocks
        if step % 5 == 0:  # a run of consecutive slots (a push): its mins are recomputed block by block
            k = int(rng.integers(1, 40))
            slots = np.arange(k) + int(rng.integers(0, 600))
        values = rng.integers(0, 4, k).astype(float)  # 0 leaves (min +inf) and ties
        fast.update(slots, values)
        ref.update(slots, values)
        assert np.array_equal(fast.mins, ref.mins), step
        assert np.array_equal(fast.sums, ref.sums), step  # small integers: every sum is exact
    ref.rebuild()
    assert np.array_equal(fast.mins, ref.mins) and fast.min == ref.min


@needs_lib
def test_tree_random_floats_agree_with_python() -> None:
    """Random float priorities: leaves and mins are bit-equal; inner sums may differ in the last
    bits (C adds 16 children in order, numpy through BLAS); finds agree away from boundaries."""
    rng = np.random.default_rng(7)
    capacity = 200_000
    fast, ref = SumTree(capacity), python_tree(capacity)
    for _ in range(5):
        slots = rng.integers(0, capacity, 5000)
        values = rng.random(5000) ** 3
        fast.update(slots, values)
        ref.update(slots, values)
    assert np.array_equal(fast.leaves, ref.leaves) and np.array_equal(fast.mins, ref.mins)
    np.testing.assert_allclose(fast.sums, ref.sums, rtol=1e-12, atol=0)
    mass = rng.random(4096) * min(fast.total, ref.total) * 0.999
    same = fast.find(mass) == ref.find(mass)
    assert same.mean() > 0.999


@needs_lib
def test_tree_rebuild_and_native_update_are_interchangeable() -> None:
    rng = np.random.default_rng(3)
    fast = SumTree(50_000)
    fast.update(rng.integers(0, 50_000, 3000), rng.integers(0, 100, 3000).astype(float))
    ref = python_tree(50_000, fast.sums.copy(), fast.mins.copy())
    ref.rebuild()  # the tree is a function of its leaves: the C-made tree is the rebuilt one
    assert np.array_equal(fast.sums, ref.sums) and np.array_equal(fast.mins, ref.mins)


@needs_lib
def test_tree_kernels_refuse_bad_input() -> None:
    assert LIB is not None
    tree = SumTree(5000)
    plan = tuple(sumtree._plan(5000))
    slots = np.array([0, 4999], np.int64)
    for bad in ([5000], [-1]):
        with pytest.raises(IndexError):
            LIB.tree_update(tree.sums, tree.mins, plan, 5000, np.array(bad, np.int64), 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_update(tree.sums, tree.mins, (5000, 313), 5000, slots, 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_update(tree.sums, tree.mins, plan, 6000, slots, 1.0)
    with pytest.raises(ValueError, match="plan"):
        LIB.tree_find(tree.sums[:-1], plan, 5000, np.zeros(2), np.empty(2, np.int64))
    with pytest.raises(ValueError):
        LIB.tree_update(tree.sums, tree.mins, plan, 5000, slots, np.ones(3))
    with pytest.raises(ValueError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(3), np.empty(2, np.int64))
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums[::2], plan, 5000, np.zeros(2), np.empty(2, np.int64))  # not contiguous
    with pytest.raises(TypeError):
        LIB.tree_update(tree.sums, tree.mins, plan, 5000, np.array([0, 1], np.int32), 1.0)
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(2), np.empty(2, np.int64)[:1].repeat(2)[::1].view(np.int32))
    readonly = np.empty(2, np.int64)
    readonly.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.tree_find(tree.sums, plan, 5000, np.zeros(2), readonly)
    assert tree.total == 0  # nothing was written


def python_ring(rg: Any) -> Any:
    """The same ring, read by the numpy code (no C view of its stamps and cursors)."""
    clone = ring.Ring.__new__(ring.Ring)
    clone.__dict__.update(rg.__dict__)
    clone.native_view, clone._lib = None, None
    return clone


def messy_prioritized(make: Make, name: str, lanes: int, dyadic: bool) -> sb.ReplayBuffer:
    """A prioritized buffer whose lanes lapped and whose slots hold every case a draw must tell
    apart: committed rows, rows being written, empty slots with a leaf, leaves of 0."""
    rng = np.random.default_rng(lanes)
    buf = make(MUJOCO, capacity=600, lanes=lanes, name=name, seed=0, sampler=sb.Prioritized(alpha=0.6, beta=0.4))
    for j in range(5):  # 950 rows into 600 slots: every lane laps, lane 0 most (cursors differ)
        k = 200 if j < 4 else 150
        p = np.floor(rng.random(k) * 4096) / 64 if dyadic else rng.random(k) ** 2 * 10
        p[rng.random(k) < 0.1] = 0.0
        lane = (rng.integers(0, lanes, k) if j < 4 else np.zeros(k, np.int64)) if lanes > 1 else 0
        buf.push(transition(200 * j, k), lane=lane, priority=p)
    st = buf.ring.stamp
    odd = rng.choice(600, 30, replace=False)
    st[odd[:15]] += 1  # being written
    st[odd[15:]] = 0  # empty, yet their leaves stay
    # a clear() that died before it reset the tree (priorities.py's repair case): rows before the
    # new base keep their leaves; then a few rows pushed after it
    leaves = buf.priorities.tree.leaves.copy()  # type: ignore[union-attr]
    buf.clear()
    buf.priorities.tree.update(np.arange(600), leaves)  # type: ignore[union-attr]
    buf.push(transition(900, 60), lane=rng.integers(0, lanes, 60) if lanes > 1 else 0, priority=np.ones(60))
    return buf


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("dyadic", [True, False])
def test_prioritized_draw_native_equals_python(make: Make, name: str, lanes: int, dyadic: bool) -> None:
    """The same RNG state gives the same ids, leaves and INVALID marks, stratified or not; with
    dyadic priorities every sum is exact (the same walk to the bit), with random floats the inner
    sums may differ in the last bit (C adds in order, numpy by BLAS) and so may a draw on a boundary."""
    from shmbuffer.sampling.samplers import Draw, tree_draw

    buf = messy_prioritized(make, name, lanes, dyadic)
    tree, rg = buf.priorities.tree, buf.ring  # type: ignore[union-attr]
    assert rg.native_view is not None and tree.lib is not None
    ref_tree, ref_ring = python_tree(tree.capacity, tree.sums, tree.mins), python_ring(rg)
    same = total = invalid = 0
    for seed, k, stratified in [(1, 1, True), (2, 256, True), (3, 256, False), (4, 3000, True), (5, 7, False)]:
        a = tree_draw(rg, tree, np.random.default_rng(seed), k, stratified=stratified)
        b = tree_draw(ref_ring, ref_tree, np.random.default_rng(seed), k, stratified=stratified)
        assert type(a) is Draw and a.ids.dtype == np.int64 and a.leaves is not None and b.leaves is not None
        assert a.ids.shape == b.ids.shape == (k,)
        if dyadic:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.leaves, b.leaves)
        same += int((a.ids == b.ids).sum())
        total += k
        # what the ids say is what the ring holds: invalid exactly where the Python rules say
        valid = a.ids != ring.INVALID
        assert np.array_equal(rg.current(a.ids[valid]), np.ones(int(valid.sum()), bool))
        invalid += int((~valid).sum())
    assert same >= total * 0.999
    assert 0 < invalid < total  # the messy ring exercised both
    # the generators were advanced alike: the next draws agree too
    ga, gb = np.random.default_rng(9), np.random.default_rng(9)
    tree_draw(rg, tree, ga, 5, stratified=True)
    tree_draw(ref_ring, ref_tree, gb, 5, stratified=True)
    assert ga.random() == gb.random()


@needs_lib
def test_prioritized_draw_of_an_empty_tree_draws_nothing(make: Make, name: str) -> None:
    from shmbuffer.sampling.samplers import tree_draw

    buf = make(MUJOCO, capacity=64, name=name, sampler=sb.Prioritized())
    g = np.random.default_rng(0)
    got = tree_draw(buf.ring, buf.priorities.tree, g, 16, stratified=True)  # type: ignore[union-attr]
    assert got.ids.size == 0 and got.leaves is not None and got.leaves.size == 0
    assert g.random() == np.random.default_rng(0).random()  # no number was used


@needs_lib
@pytest.mark.parametrize("low", [1.0, 1e-3, 1e-300, 0.0])
def test_prioritized_weights_native_equal_python(low: float) -> None:
    """Weights agree to 1 float32 ulp (the C library's pow against numpy's, which may be a
    vectorized one that differs in float64's last bit); a tree without positive leaves gives ones;
    ratios past float64's range give 0."""
    rng = np.random.default_rng(11)
    capacity = 70_001
    fast = SumTree(capacity)
    leaves = np.exp(rng.standard_normal(capacity) * 3) * (rng.random(capacity) < 0.7)
    if low > 0:
        leaves[5] = low
        leaves = np.where(leaves > 0, np.maximum(leaves, low), 0.0)
    else:
        leaves[:] = 0.0
    fast.update(np.arange(capacity), leaves)
    ref = python_tree(capacity, fast.sums, fast.mins)
    drawn = np.concatenate([fast.leaves[rng.integers(0, capacity, 4000)], [0.0, 1e280, low]])
    for beta, calls, steps in [(0.4, 0, None), (0.0, 10, None), (1.0, 3, None), (0.4, 50, 100), (0.7, 500, 100)]:
        s = sb.Prioritized(alpha=0.6, beta=beta, beta_steps=steps)
        got = s.weights(fast, drawn, calls)
        want = s.weights(ref, drawn, calls)
        assert got is not None and want is not None and got.dtype == want.dtype == np.float32
        np.testing.assert_array_max_ulp(got, want, maxulp=1)
        if low == 0.0:
            assert (got == 1).all()
        elif low == 1e-300 and beta > 0:
            assert got[-2] == 0.0  # 1e280 / 1e-300 overflows: weight 0, as numpy gives
    if low == 1.0:  # a min tree holding NaN (never made by the checked paths): ones, as numpy's min gives
        fast._mins[-1][3] = np.nan  # a node of the top level
        s = sb.Prioritized(alpha=0.6, beta=0.4)
        assert np.all(s.weights(fast, drawn, 0) == 1) and np.all(s.weights(ref, drawn, 0) == 1)


@needs_lib
def test_prioritized_weights_find_the_smallest_leaf_under_any_top_node() -> None:
    """The C weights take the min of the top level in several lanes at once and a scalar tail:
    the smallest leaf (or a NaN in the min tree) under any top node counts, as in numpy."""
    capacity = 70_001  # levels 70,016 / 4,384 / 274: the top node of slot s is s // 256
    s = sb.Prioritized(alpha=0.6, beta=0.4)
    drawn = np.array([1.0, 0.5, 0.25])
    for node in [*range(10), 264, 271, 272, 273]:
        fast = SumTree(capacity)
        fast.update(np.arange(capacity), 1.0)
        fast.update(np.array([node * 256 + 7]), 0.25)
        ref = python_tree(capacity, fast.sums, fast.mins)
        got = s.weights(fast, drawn, 0)
        assert got is not None and got[-1] == 1.0 and got[0] < 0.6
        np.testing.assert_array_max_ulp(got, s.weights(ref, drawn, 0), maxulp=1)  # type: ignore[arg-type]
        fast._mins[-1][node] = np.nan
        fast._mins[-1][0 if node else 1] = 0.25  # a missed NaN would give weights below 1
        assert np.all(s.weights(fast, drawn, 0) == 1) and np.all(s.weights(ref, drawn, 0) == 1)


@pytest.mark.parametrize("lanes", [1, 3])
def test_priority_updates_give_the_same_tree_on_both_paths(make: Make, name: str, monkeypatch: pytest.MonkeyPatch,
                                                           lanes: int) -> None:
    """The same pushes and updates (stale, cleared and repeated ids among them: the last value of
    a repeated id wins) leave the same leaves, mins, largest priority and counts on the C path and
    on the Python path; inner sums agree to rounding (bit-equal for dyadic priorities)."""
    if LIB is None:
        pytest.skip(f"the C extension is not loaded: {native.REASON}")
    bufs = []
    for which in ("native", "python"):
        with monkeypatch.context() as m:
            if which == "python":
                m.setattr(native, "lib", None)
            bufs.append(make(MUJOCO, capacity=300, lanes=lanes, name=f"{name}{which[0]}", seed=2,
                             sampler=sb.Prioritized(alpha=0.6, beta=0.4)))
    fast, ref = bufs
    assert fast.ring.native_view is not None and ref.ring.native_view is None
    fused: list[Any] = []  # what each one-call update (_native.update_priorities) returned
    real = LIB.update_priorities
    monkeypatch.setattr(LIB, "update_priorities", lambda *a: fused.append(real(*a)) or fused[-1])
    rng = np.random.default_rng(lanes)
    for step in range(12):
        k = int(rng.integers(1, 120))
        lane = rng.integers(0, lanes, k) if lanes > 1 else 0
        p = rng.random(k) * 5 if step % 2 else np.floor(rng.random(k) * 512) / 8
        for b in bufs:
            if step == 6:
                b.clear()  # every id before is stale from now on
            b.push(transition(k * step, k), lane=lane, priority=p)
        held = fast.ring.held_ids()
        # rows held (some twice), and ids of rows overwritten or cleared since (stale: skipped)
        ids = np.concatenate([rng.choice(held, 200), held[:20], np.arange(10, dtype=np.int64)])
        q = rng.random(ids.size) * 3 if step % 3 else np.floor(rng.random(ids.size) * 512) / 8
        assert fast.update_priorities(ids, q) == ref.update_priorities(ids, q)
        ft, rt = fast.priorities.tree, ref.priorities.tree  # type: ignore[union-attr]
        assert np.array_equal(ft.leaves, rt.leaves) and np.array_equal(ft.mins, rt.mins)
        np.testing.assert_allclose(ft.sums, rt.sums, rtol=1e-12, atol=0)
        assert fast.priorities.max_priority == ref.priorities.max_priority  # type: ignore[union-attr]
        assert np.array_equal(fast.ring.stamp, ref.ring.stamp)
    assert len(fused) == 12 and None not in fused  # the C path made every update above
    for bad in ([np.nan], [-1.0], [np.inf]):
        for b in bufs:
            with pytest.raises(sb.FieldError, match="finite values"):
                b.update_priorities(b.ring.held_ids()[:1], np.array(bad))
    for b in bufs:
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            b.update_priorities(np.array([-1, 0], np.int64), np.ones(2))
        with pytest.raises(sb.UnknownIdError, match="never named a row"):
            b.update_priorities(np.array([10**12], np.int64), np.ones(1))


def test_a_stale_priority_update_changes_nothing_on_both_paths(path: str, make: Make, name: str) -> None:
    """Ids of rows overwritten or cleared since are skipped, their priorities count nowhere (not
    in the largest priority either); in a batch mixing them with current ids, a repeated id's
    last value wins."""
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    old = buf.push(transition(0, 8), priority=np.ones(8))
    new = buf.push(transition(8, 4), priority=np.full(4, 2.0))  # laps old[:4]
    tree = buf.priorities.tree  # type: ignore[union-attr]
    before = (tree.sums.copy(), tree.mins.copy())
    assert buf.update_priorities(old[:4], np.full(4, 50.0)) == 0
    assert np.array_equal(tree.sums, before[0]) and np.array_equal(tree.mins, before[1])
    assert buf.priorities.max_priority == 2.0  # type: ignore[union-attr]
    ids = np.array([old[0], old[5], new[1], old[5], old[2]], np.int64)
    assert buf.update_priorities(ids, np.array([70.0, 3.0, 4.0, 5.0, 60.0])) == 3
    assert buf.priority(old[4:]).tolist() == [1.0, 5.0, 1.0, 1.0]
    assert buf.priority(new).tolist() == [2.0, 4.0, 2.0, 2.0]
    assert buf.priorities.max_priority == 5.0 and tree.total == 18.0  # type: ignore[union-attr]
    buf.clear()  # the rows keep their committed stamps, but no longer count
    assert buf.update_priorities(new, np.full(4, 9.0)) == 0 and tree.total == 0


def test_a_priority_update_leaves_used_up_rows_out_on_both_paths(path: str, make: Make, name: str) -> None:
    """Under max_use a row drawn max_use times keeps a leaf of 0 whatever priority it is given."""
    buf = make(MUJOCO, capacity=8, name=name, seed=1, sampler=sb.Prioritized(alpha=1.0, eps=0.0), max_use=1)
    ids = buf.push(transition(0, 4), priority=np.ones(4))
    used = np.sort(buf.sample(2, replace=False).index)
    assert buf.update_priorities(ids, np.array([2.0, 3.0, 4.0, 5.0])) == 4
    want = np.array([2.0, 3.0, 4.0, 5.0])
    want[np.searchsorted(ids, used)] = 0.0
    assert buf.priority(ids).tolist() == want.tolist()
    assert buf.priorities.max_priority == 5.0  # type: ignore[union-attr]


def test_priorities_at_the_leaf_bound_on_both_paths(path: str, make: Make, name: str) -> None:
    """With alpha 2 the largest priority is 1e140 (leaf 1e280): just below it is taken, just above
    refused with nothing changed, however the C path skips the bound check for smaller ones."""
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized(alpha=2.0, eps=0.0))
    ids = buf.push(transition(0, 4), priority=[1.0, 2.0, 3.0, 4.0])
    assert buf.update_priorities(ids[:2], np.array([1e140 * (1 - 1e-12), 5.0])) == 2
    assert buf.priorities.max_priority == 1e140 * (1 - 1e-12)  # type: ignore[union-attr]
    before = buf.priorities.tree.sums.copy()  # type: ignore[union-attr]
    with pytest.raises(sb.FieldError, match="exceed 1e"):
        buf.update_priorities(ids[2:], np.array([1.0, 1e140 * (1 + 1e-12)]))
    with pytest.raises(sb.FieldError, match="exceed 1e"):
        buf.push(transition(4, 1), priority=np.array([1e141]))
    assert np.array_equal(buf.priorities.tree.sums, before)  # type: ignore[union-attr]
    assert buf.priority(ids).tolist()[1:] == [25.0, 9.0, 16.0]


@needs_lib
@pytest.mark.parametrize("lanes", [1, 3])
def test_current_and_known_ids_equal_python(make: Make, name: str, lanes: int) -> None:
    buf = make(MUJOCO, capacity=60, lanes=lanes, name=name)
    rg = buf.ring
    rng = np.random.default_rng(4)
    for j in range(5):
        buf.push(transition(30 * j, 30), lane=rng.integers(0, lanes, 30) if lanes > 1 else 0)
        if j == 3:
            buf.clear()
    rg.stamp[rng.choice(60, 6, replace=False)] += 1  # some rows being written
    ref = python_ring(rg)
    ids = np.concatenate([rng.integers(-5, 200, 500), [ring.INVALID, 2**62, -(2**63), 2**63 - 1]]).astype(np.int64)
    assert np.array_equal(rg.current(ids), ref.current(ids))
    held = rg.held_ids()
    assert held.size and rg.current(held).any() and not rg.current(held).all()
    assert np.array_equal(rg.check_ids(held, "x"), ref.check_ids(held, "x"))
    cursors = rg._lanes[:, 0]
    first_unborn = [int(cursors[lane]) * lanes + lane for lane in range(lanes)]  # the next id of each lane
    assert np.array_equal(rg.check_ids(np.array(first_unborn) - lanes, "x"), np.array(first_unborn) - lanes)
    for bad in ([-1], first_unborn[-1:], first_unborn[:1], [2**63 - 1], [-(2**63)]):
        with pytest.raises(sb.UnknownIdError) as a:
            rg.check_ids(np.array(bad, np.int64), "x")
        with pytest.raises(sb.UnknownIdError) as b:
            ref.check_ids(np.array(bad, np.int64), "x")
        assert str(a.value) == str(b.value)


@needs_lib
def test_prioritized_kernels_refuse_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=64, lanes=2, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 8), lane=0)
    tree, rg = buf.priorities.tree, buf.ring  # type: ignore[union-attr]
    stamp, cur = rg.native_view  # type: ignore[misc]
    plan, cap = tree.plan, tree.capacity
    u, out_i, out_f = np.zeros(4), np.empty(4, np.int64), np.empty(4)

    def draw(**kw: Any) -> Any:
        a = dict(sums=tree.sums, plan=plan, cap=cap, total=1.0, u=u, strat=True, stamp=stamp, cur=cur,
                 slots=out_i.copy(), leaves=out_f.copy(), ids=out_i.copy())
        a.update(kw)
        return LIB.tree_draw(*a.values())

    draw()  # fine as given
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        (dict(ids=np.empty(3, np.int64)), ValueError), (dict(leaves=np.empty(4, np.float32)), TypeError),
        (dict(stamp=stamp[:-1]), ValueError), (dict(cur=cur[:, :3].copy()), ValueError),
        (dict(cur=np.zeros((3, 8), np.int64)), ValueError), (dict(sums=tree.sums[:-1]), ValueError),
        (dict(cap=65), ValueError), (dict(u=np.zeros(4, np.float32)), TypeError),
        (dict(slots=np.empty(8, np.int64)[::2]), TypeError),
    ]
    for kw, exc in cases:
        with pytest.raises(exc):
            draw(**kw)
    leaves = np.ones(4)
    with pytest.raises(TypeError):
        LIB.weights(tree.mins, plan, cap, leaves, 0.4, np.empty(4))  # float64 out
    with pytest.raises(ValueError):
        LIB.weights(tree.mins, plan, cap, leaves, 0.4, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="plan"):
        LIB.weights(tree.mins[:-1], plan, cap, leaves, 0.4, np.empty(4, np.float32))
    lock, prio = rg.lock.memory, buf.priorities._prio  # type: ignore[union-attr]

    def update(**kw: Any) -> Any:
        a = dict(lock=lock, ids=np.array([0, 2], np.int64), p=np.ones(2), leaves=np.ones(2), stamp=stamp, cur=cur,
                 sums=tree.sums, mins=tree.mins, plan=plan, cap=cap, prio=prio)
        a.update(kw)
        return LIB.update_priorities(*a.values())

    assert update() == 2  # fine as given: ids 0 and 2 are lane 0's rows 0 and 1, both current
    assert update(ids=np.array([0, 1], np.int64)) is None  # lane 1 has no row yet: the Python path raises
    assert update(ids=np.array([-2, 0], np.int64)) is None
    bad_updates: list[tuple[dict[str, Any], type[Exception]]] = [
        (dict(lock=lock[:32]), ValueError), (dict(p=np.ones(3)), ValueError), (dict(leaves=np.ones(1)), ValueError),
        (dict(stamp=stamp[:-2]), ValueError), (dict(cur=np.zeros((3, 8), np.int64)), ValueError),
        (dict(mins=tree.mins[:-1]), ValueError), (dict(sums=tree.sums[:-1]), ValueError), (dict(cap=65), ValueError),
        (dict(prio=prio[:0]), ValueError), (dict(ids=np.array([0, 2], np.int32)), TypeError),
        (dict(leaves=np.ones(2, np.float32)), TypeError), (dict(prio=prio.copy()[::2]), TypeError),
    ]
    ro = tree.sums.copy()
    ro.flags.writeable = False
    bad_updates.append((dict(sums=ro), TypeError))
    for kw, exc in bad_updates:
        with pytest.raises(exc):
            update(**kw)
    assert LIB.scan(np.array([1.0, 3.0])) == 3.0 and LIB.scan(np.empty(0)) == 0.0
    for bad in ([1.0, np.nan], [-0.5], [np.inf]):
        assert LIB.scan(np.array(bad)) == -1.0
    with pytest.raises(TypeError):
        LIB.scan(np.ones(2, np.float32))
    ids = np.array([0, 2], np.int64)
    with pytest.raises(ValueError):
        LIB.known(ids, np.zeros(12, np.int64))
    with pytest.raises(TypeError):
        LIB.known(ids.astype(np.int32), cur)
    with pytest.raises(ValueError):
        LIB.current(ids, stamp, cur, np.empty(3, np.bool_))
    with pytest.raises(ValueError):
        LIB.current(ids, stamp[:63], cur, np.empty(2, np.bool_))  # 2 lanes do not divide 63 slots
    ro = np.empty(2, np.bool_)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.current(ids, stamp, cur, ro)
