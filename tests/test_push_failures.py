"""A push that fails anywhere between its reservation and its commit leaves no hole (issue 22).

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
from shmbuffer import edits, native, segment
from shmbuffer.frames import Pusher
from shmbuffer.priorities import Priorities
from shmbuffer.ring import Copier, Ring

from .conftest import MUJOCO, transition

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


class Breaks(np.ndarray):
    """A column whose assignment fails: a copy stopped midway, after the fields before it."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Injected("copy midway")


class Midway(dict):
    """The block's field table with one column that breaks (numpy copies through it)."""

    def __getitem__(self, key: str) -> Any:
        col = super().__getitem__(key)
        return col.view(Breaks) if key == list(self)[1] else col


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
        monkeypatch.setattr(Copier, "put", fail)
    elif step == "copy midway":
        monkeypatch.setattr(buf.block, "fields", Midway(buf.block.fields))
    elif step == "commit":
        monkeypatch.setattr(Ring, "commit", fail)
    elif step == "after the commit":
        if buf.options.frames is not None:
            monkeypatch.setattr(Pusher, "done", fail)
        else:
            monkeypatch.setattr(edits, "note_interleaving", fail)


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
    monkeypatch.setattr(buf, "_push_plan", None)
    monkeypatch.setattr(buf, "_one_call", None)
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
    read as empty (a hole, reported as lost), never as committed, and are never drawn."""
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
    assert buf.get(4).reward == 7 and buf.get(7).reward == 10
    with pytest.raises(sb.EmptyBufferError, match=r"lost: .*its push failed after another writer had reserved"):
        buf.get(5)  # row 8


def test_a_packed_records_field_is_pushed_whole(make: Make, name: str) -> None:
    """A field of a packed structured array is C-contiguous but unaligned: it is stored, on every
    path, and leaves no hole (issue 22: the C push raised AssertionError after the reservation)."""
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
    ``ReplayBuffer.attach(h).push`` push, on every path (issue 22: the C path raised ClosedError)."""
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
