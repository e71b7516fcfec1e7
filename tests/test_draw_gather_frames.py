"""The one-call sample of buffers with ``next_of``/``stack`` (``native/sample.c``'s transitions,
``frames.py``'s read rules in C) against the Python reading it stands in for
(``gather._transitions``) and against a buffer that stores every observation whole: the same
transitions for the same ids over both paddings, stack axes, lanes and wrap-around; the same
distribution (uniform over the whole transitions, prioritized by their priorities); nothing read
from a row being written; ``out=``, ``max_use`` and an empty buffer's refusal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import draw_gather, gather, reader
from shmbuffer.sampling.samplers import importance_weights

from .test_draw_gather import counts, p_value, served, uniform_on_both_paths
from .test_frames import CASES, same, schema, stepper

Make = Callable[..., sb.ReplayBuffer]

pytestmark = pytest.mark.skipif(native.lib is None, reason="the one-call sample is the C extension's")


def filled(case: int, seed: int, make: Make, name: str, pushes: int = 60, **options: Any
           ) -> tuple[sb.ReplayBuffer, sb.ReplayBuffer, dict[int, int]]:
    """A buffer of ``CASES[case]`` that has wrapped its lanes, the reference holding the same
    transitions whole, and each of its ids' reference id."""
    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(seed)
    full = make(sch, 300 * lanes, lanes=lanes, name=name + "f")
    comp = make(sch, 40 * lanes, lanes=lanes, next_of=next_of, stack=stack, name=name + "c", seed=seed, **options)
    streams = stepper(rng, lanes, frame, k, axis, pad)
    to_full: dict[int, int] = {}
    for _ in range(pushes):
        lane = int(rng.integers(lanes))
        chunk = [next(streams[lane]) for _ in range(int(rng.integers(1, 5)))]
        rows = {n: np.stack([np.asarray(r[n]) for r in chunk]) for n in sch.names}
        to_full.update(zip(comp.push(rows, lane=lane).tolist(), full.push(rows, lane=lane).tolist(), strict=True))
    return full, comp, to_full


def readable(buf: sb.ReplayBuffer) -> np.ndarray:
    """The ids of the transitions ``buf`` can read now (not those whose stack reaches rows
    overwritten: ``reader.counted_ids`` counts them)."""
    ids = reader.counted_ids(buf)
    return ids[gather.gather(buf.block, buf.ring, ids).ok]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_transition_is_the_one_its_id_names(case: int, make: Make, name: str) -> None:
    full, comp, to_full = filled(case, case, make, name)
    one = served(comp)
    names = comp.schema.names
    for _ in range(10):
        batch = comp.sample(64)
        assert comp._paths.one_call is one
        assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), names)
        assert same(batch, comp.take(batch.index), names)  # the Python reading of the same ids
        assert batch.block is not None and batch.block.shape == (64, comp.block.stored_record.itemsize)


@pytest.mark.parametrize("case", [0, 1, 4, 5])
def test_draws_are_uniform_over_the_whole_transitions_on_both_paths(case: int, make: Make, name: str) -> None:
    """End rows, lead rows and each lane's newest row (with next_of) are never drawn; the others
    equally often, as on the Python path (chi-square against uniform and against each other)."""
    _, comp, _ = filled(case, 7, make, name)
    ids = readable(comp)  # counts() fails on an id outside them
    assert 0 < ids.size < len(comp.ring)
    uniform_on_both_paths(comp, ids, 300)


def test_prioritized_transitions_follow_their_priorities_with_their_weights(make: Make, name: str) -> None:
    alpha, beta = 0.6, 0.4
    full, comp, to_full = filled(1, 3, make, name, sampler=sb.Prioritized(alpha=alpha, beta=beta, eps=0.0))
    ids = readable(comp)
    prio = 1.0 + (np.arange(ids.size) % 4)
    comp.update_priorities(ids, prio)
    leaves = comp.priority(comp.ring.held_ids())  # a lane's newest row has one too: it counts in the minimum
    mass = prio ** alpha
    low = float(leaves[leaves > 0].min())  # end rows have 0: never drawn
    assert low == mass.min()
    served(comp)
    batch = comp.sample(64)
    by_id = dict(zip(ids.tolist(), mass.tolist(), strict=True))
    want = importance_weights(np.array([by_id[i] for i in batch.index.tolist()]), low, beta)
    np.testing.assert_allclose(batch.weight, want, rtol=1e-6)
    assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), comp.schema.names)
    seen = counts(comp, ids, 300)
    expected = seen.sum() * mass / mass.sum()
    assert p_value(float(((seen - expected) ** 2 / expected).sum()), ids.size - 1) > 1e-4


@pytest.mark.parametrize("case", [0, 1])
def test_no_transition_uses_a_row_being_written(case: int, make: Make, name: str) -> None:
    """Rows with odd stamps (a writer mid-copy) inside the lanes: every transition that would
    read one (its own row, its next, a frame of a stack) is drawn again."""
    full, comp, to_full = filled(case, 11, make, name)
    served(comp)
    ring = comp.ring
    held = ring.held_ids()
    torn = held[5::9]
    slots = ring.slots(torn)
    ring.stamp[slots] += 1
    try:
        uses = np.zeros(0, np.int64)
        for _ in range(30):
            batch = comp.sample(32)
            assert len(batch) == 32
            assert gather.gather(comp.block, ring, batch.index).ok.all()  # the Python reading: none torn
            uses = np.concatenate([uses, batch.index])
        # some transitions were refused for a torn row other than their own
        refused = ~gather.gather(comp.block, ring, reader.counted_ids(comp)).ok
        assert refused.sum() > torn.size // 2
        assert not np.isin(uses, reader.counted_ids(comp)[refused]).any()
    finally:
        ring.stamp[slots] -= 1
    batch = comp.sample(64)
    assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), comp.schema.names)


@pytest.mark.parametrize("case", [1, 2])
def test_out_arrays(case: int, make: Make, name: str) -> None:
    """``out=`` (the loader's staging): filled in place where the C copies can (stacks along the
    first axis), else the Python path fills them; the same transitions either way."""
    full, comp, to_full = filled(case, 2, make, name)
    first = comp.sample(16)
    out = {"_block": np.empty_like(first.block)}
    out.update({n: np.empty_like(first[n]) for n in ("obs", "next_obs")})
    for _ in range(5):
        batch = comp.sample(16, out=out)
        assert all(np.shares_memory(batch[n], out[n]) for n in ("obs", "next_obs"))
        assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), comp.schema.names)


def test_max_use_counts_each_transition_returned(make: Make, name: str) -> None:
    _, comp, _ = filled(1, 4, make, name, max_use=2)
    ids = readable(comp)
    got: list[int] = comp.sample(1).index.tolist()
    assert isinstance(comp._paths.one_call, draw_gather.DrawGather)
    for _ in range(ids.size // 8):  # half their uses: every sample finds rows left
        got += comp.sample(8).index.tolist()
    drawn, times = np.unique(got, return_counts=True)
    assert set(drawn.tolist()) <= set(ids.tolist()) and times.max() <= 2
    assert np.array_equal(comp.uses(drawn), times)
    assert not comp.uses(np.setdiff1d(comp.ring.held_ids(), drawn)).any()
    # once the transitions are used up, only rows that are not transitions have uses left (each
    # lane's newest, those whose stack reaches overwritten rows): as on the Python path, the
    # sample waits for a whole transition, gives up after a second and gives back the uses it
    # counted: every use counted is a transition returned
    with pytest.raises(sb.WaitTimeout, match="not whole transitions"):
        for _ in range(10 * ids.size):
            got += comp.sample(8).index.tolist()
    drawn, times = np.unique(got, return_counts=True)
    assert np.array_equal(comp.uses(drawn), times) and times.max() == 2
    assert not comp.uses(np.setdiff1d(comp.ring.held_ids(), drawn)).any()


def test_a_buffer_without_a_whole_transition_says_so(make: Make, name: str) -> None:
    frame, k, axis, _, _, _, _ = CASES[0]
    comp = make(schema(frame, k, axis), 16, next_of="obs", stack="obs", name=name)
    row = next(stepper(np.random.default_rng(0), 1, frame, k, axis, "reset")[0])
    comp.push(**row)  # its next observation is not pushed: no transition yet
    with pytest.raises(sb.EmptyBufferError, match="0 whole transitions"):
        comp.sample(4)


def test_out_arrays_without_the_record(make: Make, name: str) -> None:
    """``out=`` with the stacks' and next observations' arrays but no ``"_block"``: the Python
    reading makes the record's array (``gather._into``), so the one call must not refuse it
    (it raised KeyError)."""
    full, comp, to_full = filled(1, 2, make, name)
    first = comp.sample(16)
    out = {n: np.empty_like(first[n]) for n in ("obs", "next_obs")}
    for _ in range(3):
        batch = comp.sample(16, out=out)
        assert all(np.shares_memory(batch[n], out[n]) for n in ("obs", "next_obs"))
        assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), comp.schema.names)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_transitions_still_torn_after_the_c_rounds_go_to_fetch(case: int, make: Make, name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Most rows being written: positions still not whole after the C rounds are handed to
    ``reader.fetch`` with the call's rows (``Rows.large`` keyed and shaped as ``_transitions``'s,
    stacks in the field's layout), which re-draws them: every transition returned is whole."""
    full, comp, to_full = filled(case, 13, make, name)
    served(comp)
    ring = comp.ring
    held = ring.held_ids()
    torn = held[held // ring.lanes // 6 % 3 != 0]  # runs of 6 rows of a lane stay intact: few whole windows
    slots = ring.slots(torn)
    ring.stamp[slots] += 1
    fetched = []
    real = draw_gather.fetch
    monkeypatch.setattr(draw_gather, "fetch", lambda *a, **k: fetched.append(1) or real(*a, **k))
    monkeypatch.setattr(reader, "draw", None)  # the call serves each sample (no fallback to draw)
    try:
        ids = reader.counted_ids(comp)
        whole = set(ids[gather.gather(comp.block, ring, ids).ok].tolist())
        assert whole
        for _ in range(10):
            batch = comp.sample(16)
            assert set(batch.index.tolist()) <= whole
            assert same(batch, full.take([to_full[i] for i in batch.index.tolist()]), comp.schema.names)
    finally:
        ring.stamp[slots] -= 1
    assert fetched
