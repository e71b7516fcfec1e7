"""A push that fails anywhere between its reservation and its commit leaves no hole.

A failure is injected at each step of a push (the priorities set inside the reservation, the
frames pusher's confirmation, the start of the copy, midway through the copy, the commit, the
bookkeeping after it), on the C extension and on the pure-Python path, into empty slots and over
older rows of a full ring, for uniform, prioritized, per-lane and ``next_of`` buffers. After each
the buffer must be exactly as before the push (a failure before the rows were copied whole) or
hold the rows whole (a failure after), nothing odd, and the next push must go in at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import push
from shmbuffer.protocol.frames_push import Pusher
from shmbuffer.protocol.layout import Counter
from shmbuffer.protocol.priorities import Priorities
from shmbuffer.protocol.push import Copier
from shmbuffer.protocol.ring import Ring
from shmbuffer.shm import segment

from .conftest import MUJOCO, copy_through, python_push, transition

Make = Callable[..., sb.ReplayBuffer]
FRAMES = sb.Schema(obs=((3,), "float32"), next_obs=((3,), "float32"), done=((), "bool"))
CONFIGS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "prioritized": {"sampler": sb.Prioritized(alpha=0.7)},
    "lanes": {"lanes": 2},
    "next_of": {"next_of": "obs"},
}
BEFORE = ("priorities", "confirm", "copy starts", "copy midway")  # the buffer is as it was
AFTER = ("commit", "after the commit")  # the rows are whole


class Injected(Exception):
    pass


def rows(config: str, t: int, k: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The rows of steps ``t .. t + k`` and the push's keywords."""
    if config == "next_of":
        obs = np.repeat(np.arange(t, t + k + 1, dtype=np.float32)[:, None], 3, axis=1)
        return {"obs": obs[:-1], "next_obs": obs[1:], "done": np.zeros(k, bool)}, {}
    data = transition(t, k)
    return data, ({"lane": np.arange(k, dtype=np.int64) % 2} if config == "lanes" else {})


def state(buf: sb.ReplayBuffer) -> dict[str, Any]:
    """What a reader sees: the rows held (every field, their ids), priorities, counts."""
    held = len(buf)
    out: dict[str, Any] = {"len": held, "inserted": buf.stats["inserted"]}
    if held:
        got = buf.get(slice(None))
        out.update({k: np.asarray(v).tobytes() for k, v in got.fields.items()}, index=got.index.tobytes())
        if buf.priorities is not None:
            out["leaves"] = buf.priority(got.index).tobytes()
            out["max"] = buf.priorities.max_priority
    return out


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "native" and native.lib is None:
        pytest.skip("the C extension is not built here (SHMBUFFER_PURE, or no compiler)")
    if request.param == "python":
        monkeypatch.setattr(native, "lib", None)
    yield request.param


def inject(monkeypatch: pytest.MonkeyPatch, buf: sb.ReplayBuffer, step: str) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise Injected(step)

    if step == "priorities":
        monkeypatch.setattr(Priorities, "set_rows", fail)
    elif step == "confirm":
        monkeypatch.setattr(Pusher, "confirm", fail)
    elif step == "copy starts":
        monkeypatch.setattr(Copier, "copy", fail)
    elif step == "copy midway":  # after the first field, before the second
        second = buf._copier.names[1]
        copied: list[str] = []

        def midway(field: str) -> None:
            copied.append(field)
            if field == second and copied.count(second) == 1:
                raise Injected(step)

        copy_through(buf, midway)
    elif step == "commit":
        monkeypatch.setattr(Ring, "commit", fail)
    elif step == "after the commit":
        if buf.options.rows.once:
            monkeypatch.setattr(Pusher, "done", fail)
        else:
            monkeypatch.setattr(push, "note_interleaving", fail)


@pytest.mark.parametrize("lapped", [False, True], ids=["empty slots", "over older rows"])
@pytest.mark.parametrize("step", BEFORE + AFTER)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_push_leaves_the_buffer_as_it_was_or_its_rows_whole(
    make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str, config: str, step: str, lapped: bool,
) -> None:
    if step == "priorities" and config != "prioritized":
        pytest.skip("only a prioritized buffer sets priorities inside the reservation")
    if step == "confirm" and config != "next_of":
        pytest.skip("only a next_of/stack buffer confirms its rows after the reservation")
    schema = FRAMES if config == "next_of" else MUJOCO
    buf = make(schema, 8, name=name, **CONFIGS[config])
    ref = make(schema, 8, name=name + "r", **CONFIGS[config])
    # the Python steps, where a push can fail after its reservation (the one C call cannot)
    python_push(buf)
    t = 0
    for _ in range(6 if lapped else 2):  # 12 rows lap the ring of 8; 4 leave it half empty
        data, kw = rows(config, t, 2)
        buf.push(data, **kw)
        ref.push(data, **kw)
        t += 2
    before = state(buf)
    data, kw = rows(config, t, 2)
    ref.push(data, **kw)
    after = state(ref)
    assert before != after
    with monkeypatch.context() as m:
        inject(m, buf, step)
        with pytest.raises(Injected):
            buf.push(data, **kw)
    assert not (buf.ring.stamp & 1).any()  # nothing left odd under a live writer
    assert state(buf) == (before if step in BEFORE else after)
    buf.ring.stall_timeout = 1.0  # the next push goes in at once: no row waits for a live writer
    if step in BEFORE:
        buf.push(data, **kw)  # the failed push, again
    more, kw = rows(config, t + 2, 2)
    if config == "next_of" and step == "after the commit":
        return  # the pusher did not note its last rows: its next row would start an episode
    buf.push(more, **kw)
    ref.push(more, **kw)
    assert state(buf) == state(ref)


def test_a_failed_push_after_another_writer_reserved_leaves_empty_rows_never_torn(make: Make, name: str) -> None:
    """When a writer reserved rows after the failed push's, its rows cannot be given back: they
    read as empty (a hole, reported as lost by id), never as committed, never drawn or counted."""
    buf = make(MUJOCO, 8, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 8))
    res = buf.ring.reserve(2)
    other = sb.ReplayBuffer.attach(buf.handle)
    try:
        other.push(transition(10, 1))
    finally:
        other.close()
    buf.ring.undo(res, copied=False, lost=lambda slots: buf.priorities.tree.update(slots, 0.0))  # type: ignore[union-attr]
    assert not (buf.ring.stamp & 1).any()
    assert set(buf.sample(200).reward.astype(int).tolist()) == {3, 4, 5, 6, 7, 10}
    # len and get's positions leave the holes out, as sample does
    assert len(buf) == 6 and buf.get(4).reward == 7 and buf.get(5).reward == 10
    with pytest.raises(sb.EmptyBufferError, match=r"lost: .*its push failed after another writer had reserved"):
        buf.take([8])


def test_a_packed_records_field_is_pushed_whole(make: Make, name: str) -> None:
    """A field of a packed structured array is C-contiguous but unaligned: it is stored, on every
    path, and leaves no hole (the C push raised AssertionError after the reservation)."""
    schema = sb.Schema(obs=((3,), "float32"), r=((), "float64"), n=((), "int64"))
    rec = np.zeros(5, dtype=[("pad", "u1"), ("obs", "<f4", (3,)), ("r", "<f8"), ("n", "<i8")])
    rec["obs"] = np.arange(15).reshape(5, 3)
    rec["r"] = np.arange(5) / 2
    rec["n"] = np.arange(5) * 7
    assert not rec[0]["obs"].flags.aligned and rec[0]["obs"].flags.c_contiguous
    for prioritized in (False, True):
        buf = make(schema, 8, name=f"{name}{int(prioritized)}", **({"sampler": sb.Prioritized()} if prioritized else {}))
        for i in range(5):
            buf.push(obs=rec[i]["obs"], r=rec[i]["r"], n=rec[i]["n"])
        buf.push({"obs": rec["obs"][3:], "r": rec["r"][3:], "n": rec["n"][3:]})  # unaligned rows, k of them
        got = buf.get(slice(0, len(buf)))
        assert len(buf) == 7 and got.obs.tolist() == rec["obs"].tolist() + rec["obs"][3:].tolist()
        assert got.r.tolist() == [0, 0.5, 1, 1.5, 2, 1.5, 2] and got.n.tolist() == [0, 7, 14, 21, 28, 21, 28]


def test_a_push_through_a_buffer_nobody_else_holds_goes_in(name: str, path: str) -> None:
    """A bound method keeps its object alive: ``ReplayBuffer(...).push(...)`` and a held
    ``ReplayBuffer.attach(h).push`` push, on every path (the C path raised ClosedError)."""
    owner = sb.ReplayBuffer(MUJOCO, 8, name=name)
    try:
        held = sb.ReplayBuffer.attach(owner.handle).push
        assert held(transition(0, 2)).tolist() == [0, 1]
        assert held(**{k: v[0] for k, v in transition(2, 1).items()}).tolist() == [2]
        assert len(owner) == 3
        held.__self__.close()
        assert sb.ReplayBuffer(MUJOCO, 4, name=name + "t").push(transition(0, 1)).tolist() == [0]
        assert name + "t" not in segment.list_names()  # the temporary buffer went with its push
    finally:
        owner.close()
        owner.unlink()


# -- edge cases, each failing before its fix --------------------------------------------------
def _failing_put(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None] = lambda: None) -> None:
    def put(*args: Any, **kwargs: Any) -> None:
        then()
        raise Injected("copy starts")

    monkeypatch.setattr(Copier, "copy", put)


def test_an_undone_push_that_reclaimed_a_dead_writers_row_leaves_nothing_odd(
    make: Make, name: str, monkeypatch: pytest.MonkeyPatch, procs: list,
) -> None:
    """A reservation that laps a dead writer's odd slot reclaims it; undoing that push must not
    put the odd stamp back under this live process (the slot would block every writer)."""
    import multiprocessing as mp

    buf = make(MUJOCO, 4, name=name)
    buf.ring.stall_timeout = 1.0
    buf.push(transition(0, 2))
    p = mp.get_context("fork").Process(target=_reserve_and_die, args=(buf.handle,))
    procs.append(p)
    p.start()
    p.join(30)
    buf.push(transition(3, 1))
    assert buf.ring.stamp[2] & 1  # the dead writer's row
    python_push(buf)
    with monkeypatch.context() as m:
        _failing_put(m)
        with pytest.raises(Injected):
            buf.push(transition(10, 4))  # laps slots 0..3, slot 2 among them
    assert not (buf.ring.stamp & 1).any()
    buf.push(transition(20, 4))  # at once: nothing waits for a live owner
    assert buf.get(slice(None)).reward.tolist() == [20, 21, 22, 23]


def _reserve_and_die(handle: sb.BufferHandle) -> None:
    import os

    sb.ReplayBuffer.attach(handle).ring.reserve(1, 0)
    os._exit(0)


def test_a_clear_while_a_push_fails_is_not_undone(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear() between a push's reservation and its failure: the undo must not put back the
    cleared rows, their priorities or the cursor below the new base."""
    buf = make(MUJOCO, 4, name=name, sampler=sb.Prioritized(alpha=1.0))
    buf.push(transition(0, 4), priority=np.full(4, 5.0))
    python_push(buf)
    with monkeypatch.context() as m:
        _failing_put(m, then=buf.clear)
        with pytest.raises(Injected):
            buf.push(transition(10, 4))  # ends on a lane boundary: the clear leaves the cursor there
    assert len(buf) == 0 and not buf.priorities.tree.leaves.any()  # type: ignore[union-attr]
    assert buf.priorities.max_priority == 1.0  # type: ignore[union-attr]
    buf.push(transition(99, 1))
    assert set(buf.sample(8, timeout=1.0).reward.tolist()) == {99}


def test_an_undo_counts_itself_so_a_reader_spanning_it_reads_again(
    make: Make, name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The undo puts a slot's old stamp back: a reader whose copy spanned the reservation and the
    undo sees the same stamp twice, so the undo counts itself as an update does (no ABA)."""
    buf = make(MUJOCO, 4, name=name)
    buf.push(transition(0, 4))
    python_push(buf)
    updates = int(buf.block.counters[Counter.UPDATES])
    with monkeypatch.context() as m:
        _failing_put(m)
        with pytest.raises(Injected):
            buf.push(transition(10, 2))
    assert int(buf.block.counters[Counter.UPDATES]) == updates + 1
    assert buf.get(slice(None)).reward.tolist() == [0, 1, 2, 3]


def test_an_undo_keeps_a_largest_priority_raised_meanwhile(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, 8, name=name, sampler=sb.Prioritized(alpha=1.0))
    buf.push(transition(0, 4))
    python_push(buf)
    with monkeypatch.context() as m:
        _failing_put(m, then=lambda: buf.update_priorities(np.arange(4), np.full(4, 50.0)))
        with pytest.raises(Injected):
            buf.push(transition(10, 2))
    assert buf.priorities.max_priority == 50.0  # type: ignore[union-attr]
    assert buf.priority(buf.push(transition(20, 1))).tolist() == pytest.approx([50.0])


def test_the_largest_priorities_a_push_takes_save_and_load(make: Make, name: str, tmp_path: Any) -> None:
    """A save refused such leaves as "of no finite priority" (the check inverted them)."""
    buf = make(MUJOCO, 8, name=name, sampler=sb.Prioritized(alpha=0.6))
    buf.push(transition(0, 3), priority=np.array([1.0, 2.0, 1.7976931348623155e308]))
    sb.save(buf, tmp_path / "s")
    new = sb.load(tmp_path / "s")
    try:
        assert np.array_equal(new.priority(np.arange(3)), buf.priority(np.arange(3)))
        assert np.isfinite(new.export()["priority"]).all()
    finally:
        new.close()
        new.unlink()


def test_the_push_method_behaves_as_a_bound_method(make: Make, name: str) -> None:
    import inspect
    import weakref

    if native.lib is None:
        pytest.skip("the C extension is not built here")
    buf = make(MUJOCO, 8, name=name)
    assert buf.push == buf.push and hash(buf.push) == hash(buf.push) and buf.push != make(MUJOCO, 8, name=name + "o").push
    assert str(inspect.signature(buf.push)) == str(inspect.signature(sb.ReplayBuffer.push.__get__(buf)))
    assert buf.push.__qualname__ == "ReplayBuffer.push" and buf.push.__module__ == "shmbuffer.buffer"
    again = weakref.WeakMethod(buf.push)()
    assert again is not None and again(transition(0, 1)).tolist() == [0]
    with pytest.raises(TypeError, match="made without its function"):
        native.lib.PushMethod.__new__(native.lib.PushMethod).__get__(None, object)
