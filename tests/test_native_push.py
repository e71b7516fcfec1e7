"""The C push (``native/push.c``, ``copies.c``, ``plan.c``, ``method.c``) against the Python
reference: the same bytes and stamps pushed, what Python must decide left to it, bad input refused."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import push
from shmbuffer.protocol.layout import Counter
from shmbuffer.shm import segment

from .conftest import LIB, MUJOCO, needs_lib, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]


def block_bytes(buf: sb.ReplayBuffer) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in buf.block.arrays.items() if k not in ("_mutex", "_writer_pid", "_writer_start")}


@needs_lib
@pytest.mark.parametrize("lanes", [1, 4])
def test_push_native_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """The same pushes (one row, k rows, wrapping, lanes per row, casts, priorities, episodes)
    leave the same bytes in every column, whichever path copies."""
    schema = sb.Schema(obs=((3, 5), "float32"), img=((2, 32, 32), "uint8"), action=((), "int64"),
                       reward=((), "float32"), flag=((2,), "bool"))
    bufs = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "lib", None)
        bufs.append(make(schema, capacity=24, lanes=lanes, episodes=True, sampler=sb.Prioritized(), name=f"{name}{int(use_native)}"))
    fast, ref = bufs
    rng = np.random.default_rng(lanes)
    for _ in range(30):
        k = int(rng.integers(1, 6))
        one = rng.random() < 0.3
        rows: dict[str, Any] = {
            "obs": rng.random((k, 3, 5)),  # float64: cast to float32
            "img": rng.integers(0, 255, (k, 2, 32, 32)).astype(np.uint8)[:, :, ::-1],  # not contiguous
            "action": rng.integers(-5, 5, k).astype(np.int32),
            "reward": rng.random(k).astype(np.float32),
            "flag": rng.random((k, 2)) < 0.5,
        }
        if one:
            rows = {n: v[0] for n, v in rows.items()}
            k = 1
        lane: Any = int(rng.integers(0, lanes)) if rng.random() < 0.5 or one else rng.integers(0, lanes, k)
        prio = rng.random(k) + 0.1
        episode = int(rng.integers(0, 9)) if rng.random() < 0.5 else rng.integers(0, 9, k)
        if one:
            prio, episode = prio[0], int(rng.integers(0, 9))
        got = fast.push(rows, lane=lane, episode=episode, priority=prio)
        want = ref.push(rows, lane=lane, episode=episode, priority=prio)
        assert np.array_equal(got, want)
    a, b = block_bytes(fast), block_bytes(ref)
    assert a.keys() == b.keys()
    for key in a:
        if key not in ("_tree_sum",):
            assert a[key] == b[key], key
    assert np.allclose(fast.block.arrays["_tree_sum"], ref.block.arrays["_tree_sum"], rtol=1e-12)
    assert (fast.ring.stamp % 2 == 0).all()


@needs_lib
@pytest.mark.parametrize("lanes", [1, 4])
def test_draw_gather_push_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, lanes: int) -> None:
    """Uniform pushes take one C call (``_native.push``): one lane or a lane per row, episodes,
    wrapping lanes, float64 into float32 and Python numbers cast as ``Schema.validate`` casts; the
    same bytes, ids and counts as the Python path; a frozen buffer still refuses."""
    assert LIB is not None
    schema = sb.Schema(obs=((3, 5), "float32"), img=((2, 32, 32), "uint8"), action=((), "int64"), flag=((2,), "bool"),
                       reward=((), "float32"), gain=((), "float64"), done=((), "bool"), small=((), "int16"), old=((1,), "float32"))
    fast = make(schema, capacity=24, lanes=lanes, episodes=True, name=name + "n")
    with monkeypatch.context() as m:
        m.setattr(native, "lib", None)
        ref = make(schema, capacity=24, lanes=lanes, episodes=True, name=name + "p")
    calls: list[bool] = []
    python_push = push.push

    def counted(*a: Any, **k: Any) -> Any:  # the Python steps: a push the one call did not take
        if a[0] is fast:
            calls[-1] = False
        return python_push(*a, **k)

    monkeypatch.setattr(fast, "_fast_push", None)  # the Python method goes to push.push, counted
    monkeypatch.setattr(push, "push", counted)
    fast.ring.writer_id()  # this process registered (as its first push through the steps does)
    rng = np.random.default_rng(lanes)
    for i in range(60):
        k = int(rng.integers(1, 6))
        rows: dict[str, Any] = {"obs": rng.normal(size=(k, 3, 5)).astype(np.float32 if i % 2 else np.float64),
                                "img": rng.integers(0, 255, (k, 2, 32, 32)).astype(np.uint8),
                                "action": rng.integers(-5, 5, k), "flag": rng.random((k, 2)) < 0.5,
                                "reward": rng.normal(size=k) * 1e30, "gain": rng.normal(size=k).astype(np.float32),
                                "done": rng.random(k) < 0.5, "small": rng.integers(-300, 300, k).astype(np.int16),
                                "old": rng.normal(size=(k, 1)).astype(np.float32)}
        if i % 3 == 0:  # one row, fields as Python numbers and numpy scalars
            k = 1
            rows = {n: v[0] for n, v in rows.items()}
            rows.update(reward=float(rows["reward"]), gain=float(rows["gain"]), done=bool(rows["done"]),
                        small=int(rows["small"]), old=float(rows["old"][0]) if i % 2 else rows["old"][0])
            if i % 6 == 0:
                rows.update(reward=int(rng.integers(-9, 9)), gain=True, done=int(rng.integers(0, 2)))
        lane: Any = int(rng.integers(0, lanes)) if rng.random() < 0.5 else rng.integers(0, lanes, k)
        episode = int(rng.integers(0, 9)) if rng.random() < 0.5 else rng.integers(0, 9, k)
        calls.append(True)
        got = fast.push(rows, lane=lane, episode=episode)
        with monkeypatch.context() as m:
            m.setattr(native, "lib", None)
            want = ref.push(rows, lane=lane, episode=episode)
        assert np.array_equal(got, want)
    # each push in one call, wrapping lanes too
    assert calls == [True] * 60
    a, b = block_bytes(fast), block_bytes(ref)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], key
    assert fast.stats["inserted"] == ref.stats["inserted"]
    fast.freeze()
    with pytest.raises(sb.ReadOnlyError):
        fast.push({n: v[:1] for n, v in rows.items()}, lane=0, episode=0)


@needs_lib
def test_draw_gather_push_leaves_what_python_must_decide_alone(make: Make, name: str) -> None:
    """Anything the one call does not take returns ``None`` with the buffer unchanged, and the
    Python steps then push it or raise their clear error: values it would have to cast otherwise,
    a lane out of range or too full, episodes missing or unwanted, a push that may interleave
    envs, a process it does not name, a busy lock, an odd slot, a frozen buffer."""
    assert LIB is not None
    buf = make(MUJOCO, capacity=12, lanes=2, episodes=True, name=name)
    plan = buf._copier.plan
    block, ring_ = buf.block, buf.ring
    stats, stamp = block.arrays["_stats"], block.stamp
    rows = {k: np.ascontiguousarray(v) for k, v in transition(0, 2).items()}
    e2 = np.array([4, 5], np.int64)
    ring_.writer_id()
    before = {n: a.copy() for n, a in block.arrays.items() if n != "_mutex"}
    for data, lane, episode in (
        ({**rows, "obs": rows["obs"].astype(np.int32)}, 0, 1),  # a cast validate decides
        ({**rows, "obs": rows["obs"].astype(np.float64) * 1e300}, 0, 1),  # float64 too large for float32: validate refuses
        ({**rows, "action": rows["action"][:, ::-1]}, 0, 1),  # not contiguous
        ({**rows, "done": rows["done"][:1]}, 0, 1),  # ragged
        ({k: v for k, v in rows.items() if k != "done"}, 0, 1),  # a missing field
        ({**rows, "extra": rows["done"]}, 0, 1),  # an unknown one
        ({**rows, "obs": rows["obs"].tolist()}, 0, 1),  # not an array
        ({**{k: v[0] for k, v in rows.items()}, "reward": 2 ** 70}, 0, 1),  # a number too large
        ({**{k: v[0] for k, v in rows.items()}, "done": 2}, 0, 1),  # 2 is not a flag
        ({**{k: v[0] for k, v in rows.items()}, "reward": -1e300}, 0, 1),  # would become -inf
        ({**{k: v[0] for k, v in rows.items()}, "action": 1.0}, 0, 1),  # a float into an int field
        (list(rows.values()), 0, 1),  # not a dict
        (rows, 2, 1), (rows, -1, 1), (rows, np.array([0, 2]), 1), (rows, np.array([0], np.int64), 1),
        (rows, np.array([0, 1], np.int32), 1), (rows, None, 1),  # two lanes and no lane=
        ({k: np.repeat(v, 4, axis=0) for k, v in rows.items()}, 0, 1),  # 8 rows for a lane of 6
        (rows, 0, None), (rows, 0, 1.5), (rows, 0, np.array([1, 2, 3])), (rows, 0, 2 ** 70),
        (rows, 0, np.arange(4)[::2]), (rows, 0, np.arange(2)[::-1]),  # strided episode ids: numpy copies them
        ({**{k: v[0] for k, v in rows.items()}, "reward": b"\x01\x02\x03\x04"}, 0, 1),  # bytes: validate refuses
    ):
        assert LIB.push(plan, data, lane, episode) is None
    solo = make(MUJOCO, capacity=8, episodes=True, name=name + "s")
    solo.ring.writer_id()
    assert LIB.push(solo._copier.plan, rows, None, e2) is None  # push.note_interleaving decides
    assert LIB.push(solo._copier.plan, rows, None, 3) is not None
    small = make(sb.Schema(u=((), "uint8")), capacity=4, name=name + "u")
    small.ring.writer_id()
    assert LIB.push(small._copier.plan, {"u": b"\x01"}, None, None) is None  # bytes: numpy makes it a string
    with pytest.raises(sb.FieldError):
        small.push(u=b"\x01")
    assert len(small) == 0
    me = ring_.me.copy()
    ring_.me[0] += 1  # another process's entry
    assert LIB.push(plan, rows, 0, 1) is None
    ring_.me[:] = me
    child = os.fork()  # a forked child holds its parent's entry until it registers its own
    if child == 0:
        code = 9
        try:
            code = 0 if LIB.push(plan, rows, 0, 1) is None else 1
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    stamp[1] = 3  # lane 0's slot 1 is being written
    assert LIB.push(plan, rows, 0, 1) is None
    stamp[1] = 0
    stats[int(Counter.FROZEN)] = 1
    assert LIB.push(plan, rows, 0, 1) is None
    stats[int(Counter.FROZEN)] = 0
    ring_.lock.acquire()  # busy: the Python steps wait for it
    try:
        assert LIB.push(plan, rows, 0, 1) is None
    finally:
        ring_.lock.release()
    for n, a in before.items():
        assert np.array_equal(block.arrays[n], a), n
    with pytest.raises(TypeError):
        LIB.push(plan, rows, 0)
    with pytest.raises(ValueError):  # not a plan
        LIB.push(stamp, rows, 0, 1)
    got = LIB.push(plan, rows, np.array([1, 0], np.int64), e2)
    assert got.tolist() == [1, 0] and stamp[[0, 6]].tolist() == [2, 2] and stats[int(Counter.INSERTED)] == 2
    assert block.episode is not None and block.episode[[6, 0]].tolist() == [4, 5]


@needs_lib
def test_a_push_plan_refuses_what_does_not_fit_the_ring(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=12, lanes=2, name=name)
    c, r = buf._copier, buf.ring
    packed = buf.block.packed
    assert packed is not None
    widths = tuple(int(buf.block.fields[n].dtype.itemsize * np.prod(s)) for n, s in zip(c.names, c.shapes, strict=True))
    ring_ = dict(lock=r.lock.memory, cursors=r.cursors, stats=r.stats_array, stamp=r.stamp, owner=r.owner,
                 writers=r.writers, me=r.me)
    fields = dict(names=c.names, formats=c.formats, shapes=c.shapes, widths=widths, targets=c.columns, offsets=c.offsets)

    def plan(**kw: Any) -> Any:
        views = tuple(kw.get(k, v) for k, v in ring_.items())
        f = {k: kw.get(k, v) for k, v in fields.items()}
        return LIB.plan(views, kw.get("fields", tuple(zip(*f.values(), strict=True))), episode=kw.get("episode"), envs=kw.get("envs", 0))

    assert plan() is not None
    assert LIB.plan(ring=tuple(ring_.values()), fields=tuple(zip(*fields.values(), strict=True))) is not None
    for bad in (dict(lock=r.lock.memory[:32]), dict(cursors=r.cursors.reshape(-1)[:12]), dict(stats=r.stats_array[:11]),
                dict(writers=r.writers[:8]), dict(owner=r.owner[:5]), dict(owner=r.stamp), dict(me=np.zeros(3, np.int64)),
                dict(envs=3), dict(envs=-1), dict(episode=np.zeros(5, np.int64)),
                dict(widths=(10 ** 6,) * len(widths)), dict(offsets=(packed.shape[1],) * len(widths)),
                dict(shapes=((-1,),) * len(widths)), dict(formats=("f",) * len(widths)), dict(fields=()),
                dict(fields=((c.names[0],),)), dict(fields=[tuple(zip(*fields.values(), strict=True))]), dict(stamp=r.stamp[:5])):
        with pytest.raises((ValueError, TypeError)):
            plan(**bad)


@needs_lib
def test_put_reserve_and_check_refuse_bad_input(make: Make, name: str) -> None:
    assert LIB is not None
    buf = make(MUJOCO, capacity=10, name=name)
    packed, stamp, owner = buf.block.packed, buf.block.stamp, buf.ring.owner
    assert packed is not None
    before = (packed.copy(), stamp.copy(), owner.copy())
    src = np.zeros((2, 4), np.uint8)
    for where, offset in (([0, 10], 0), ([-1, 0], 0), ([0, 1], packed.shape[1] - 3), ([0, 1], -1), (9, 0), (-1, 0)):
        slots: Any = np.array(where, np.int64) if isinstance(where, list) else where
        with pytest.raises((IndexError, ValueError)):
            LIB.put(slots, 2, stamp, (packed,), (offset,), None, (src,), True)
    with pytest.raises(ValueError):  # 9 bytes are not 2 rows
        LIB.put(0, 2, stamp, (packed,), (0,), None, (np.zeros((3, 3), np.uint8),), True)
    with pytest.raises(ValueError):  # k slots expected
        LIB.put(np.array([0, 1, 2], np.int64), 2, stamp, (packed,), (0,), None, (src,), True)
    with pytest.raises(ValueError):
        LIB.put(0, 2, stamp, (packed,), (), None, (src,), True)
    with pytest.raises(ValueError):  # a format per source
        LIB.put(0, 2, stamp, (packed,), (0,), (), (src,), True)
    readonly = packed.copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError):
        LIB.put(0, 2, stamp, (readonly,), (0,), None, (src,), True)
    # a source of another format, or not contiguous: False, nothing copied (the caller casts)
    assert LIB.put(0, 2, stamp, (packed,), (0,), (b"f",), (src,), True) is False
    assert LIB.put(0, 2, stamp, (packed,), (0,), None, (np.zeros((2, 8), np.uint8)[:, ::2],), True) is False
    for args in ((-1, 2, 0, 0), (9, 2, 0, 0), (0, 2, -1, 0), (0, 2, 0, 70_000), (0, 2, 2 ** 62, 0)):
        with pytest.raises(ValueError):
            LIB.reserve(stamp, owner, *args, np.empty(2, np.int64))
    with pytest.raises(TypeError):
        LIB.reserve(stamp, owner.astype(np.int64), 0, 1, 0, 0, np.empty(1, np.int64))
    with pytest.raises(ValueError):  # a stamp kept for each slot
        LIB.reserve(stamp, owner, 0, 2, 0, 0, np.empty(1, np.int64))
    assert np.array_equal(packed, before[0]) and np.array_equal(stamp, before[1]) and np.array_equal(owner, before[2])
    cursors = buf.block.arrays["_lanes"]
    n, at = np.empty(2, np.int64), np.empty(2, np.int64)
    for lane, w in (([0, 1], 0), ([0, -1], 0), ([0, 0], -1)):  # one lane: lane 1 does not exist
        with pytest.raises(ValueError):
            LIB.reserve_lanes(cursors, stamp, owner, np.array(lane, np.int64), w, n, at, np.empty(2, np.int64))
    with pytest.raises(ValueError):
        LIB.reserve_lanes(cursors, stamp, owner, np.zeros(3, np.int64), 0, n, at, np.empty(3, np.int64))
    with pytest.raises(ValueError):
        LIB.reserve_lanes(cursors, stamp, owner, np.zeros(2, np.int64), 0, n, at, np.empty(3, np.int64))
    assert np.array_equal(stamp, before[1]) and cursors[0, 0] == 0
    assert LIB.lanes_worst(np.array([0, 1, 1, 0, 1], np.int64), 2) == 3
    assert LIB.lanes_worst(np.array([0, 2], np.int64), 2) == -1 and LIB.lanes_worst(np.array([-1], np.int64), 2) == -1
    with pytest.raises(ValueError):
        LIB.lanes_worst(np.zeros(2, np.int64), 0)
    stamp[3] = 7  # being written: reserve leaves everything alone
    old = np.full(3, -1, np.int64)
    assert LIB.reserve(stamp, owner, 2, 3, 50, 5, old) is False and owner[2:5].tolist() == [0, 0, 0]
    assert old.tolist() == [-1, -1, -1]
    stamp[5] = 42
    old = np.full(2, -1, np.int64)
    assert LIB.reserve(stamp, owner, 4, 2, 50, 5, old) is True
    assert stamp[4:6].tolist() == [101, 103] and owner[4:6].tolist() == [5, 5] and old.tolist() == [0, 42]
    stamp[:] = 0


@needs_lib
def test_fast_checks_take_exactly_what_validate_takes_unchanged(make: Make, name: str) -> None:
    """``Copier.fast_check`` accepts only rows that ``Schema.validate`` would pass through as they are
    (the fields' dtypes and shapes, contiguous); anything else goes to ``validate``."""
    buf = make(MUJOCO, capacity=10, name=name)
    copier = buf._copier
    rows = {k: np.ascontiguousarray(v) for k, v in transition(0, 3).items()}
    assert copier.fast_check(rows) == (3, rows)
    one = {k: v[0] for k, v in rows.items()}
    assert copier.fast_check(one) == (1, one)
    assert copier.fast_check({**rows, "done": rows["done"][:2]}) is None  # ragged
    assert copier.fast_check({**rows, "done": one["done"]}) is None  # one row and 3 rows
    assert copier.fast_check({**rows, "obs": rows["obs"].astype(np.float64)}) is None  # a cast
    assert copier.fast_check({**rows, "obs": np.asfortranarray(np.zeros((3, 17), np.float32))[:, ::-1]}) is None
    assert copier.fast_check({**rows, "obs": rows["obs"][:, :16]}) is None  # a wrong shape
    assert copier.fast_check({**rows, "obs": rows["obs"].tolist()}) is None  # not an array
    assert copier.fast_check({k: v for k, v in rows.items() if k != "done"}) is None  # a missing field
    assert copier.fast_check({**rows, "extra": rows["done"]}) is None
    assert copier.fast_check({k: v[:0] for k, v in rows.items()}) is None  # no rows: validate's case
    assert copier.fast_check({**one, "reward": float(one["reward"])}) is None  # a number: validate makes it an array
    old = make(sb.Schema(obs=((17,), "float32"), rew=((1,), "float32")), capacity=10, name=name + "c")._copier
    three = {"obs": np.zeros((3, 17), np.float32), "rew": np.zeros(3, np.float32)}
    assert old.fast_check(three) is None  # cpprb's (k,) for a (1,) field: validate reshapes it to (k, 1)
    assert old.fast_check({**three, "rew": np.zeros((3, 1), np.float32)}) is not None
    with pytest.raises(sb.FieldError):  # and validate still raises what it raised
        buf.push({**rows, "obs": rows["obs"][:, :16]})
    assert len(buf) == 0


@needs_lib
def test_a_native_copy_that_fails_gives_the_rows_back(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))

    class Failing:
        check = staticmethod(LIB.check)  # type: ignore[union-attr]

        def put(self, *args: Any) -> None:
            raise KeyboardInterrupt

    copier = buf._copier
    monkeypatch.setattr(copier, "lib", Failing())
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(4, 2))
    monkeypatch.undo()
    assert set(seq_of(buf.sample(100))) == {0, 1, 2, 3}
    assert buf.priorities.tree.leaves[4:6].tolist() == [0.0, 0.0]  # type: ignore[union-attr]
    assert buf.ring.stamp[4:6].tolist() == [0, 0]


@needs_lib
def test_push_itself_runs_in_c_for_its_usual_calls_and_the_method_for_the_rest(make: Make, name: str) -> None:
    """A uniform buffer's ``push`` (and ``add``) is a ``_native.BoundPush``: ``push(**fields)`` and
    ``push(dict)``, with ``lane=`` and ``episode=`` or without, push in C with no dict made; every
    other call gives what the Python method gives, errors included, and leaves the buffer as it was."""

    buf = make(MUJOCO, capacity=16, lanes=2, episodes=True, name=name)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "lib", None)
        ref = make(MUJOCO, capacity=16, lanes=2, episodes=True, name=name + "r")
    assert type(buf.push) is LIB.BoundPush and buf.push.__self__ is buf
    assert ref.push.__self__ is ref and ref.push.__func__ is sb.ReplayBuffer.push  # no plan: the Python method's calls
    prioritized = make(MUJOCO, capacity=8, sampler=sb.Prioritized(), name=name + "p")
    assert prioritized.push.__self__ is prioritized and prioritized.push.__func__ is sb.ReplayBuffer.push
    assert sb.ReplayBuffer.push.__doc__ == buf.push.__doc__ and sb.ReplayBuffer.push.__name__ == "push"
    rows = transition(0, 2)
    one = {k: v[0] for k, v in transition(2, 1).items()}
    for args, kwargs in (((), {**rows, "lane": 0, "episode": 1}), ((rows,), {"lane": 1, "episode": np.array([3, 4])}),
                         ((one,), {"lane": 0, "episode": 5}), ((), {**one, "episode": 6, "lane": np.array([1])})):
        assert np.array_equal(buf.push(*args, **kwargs), ref.push(*args, **kwargs))
    for lane in (np.int64(1), np.array(0)):  # a numpy integer lane, as an env's index often is
        assert np.array_equal(buf.push(rows, lane=lane, episode=2), ref.push(rows, lane=lane, episode=2))
    for args, kwargs, error in (
        ((), {**rows, "episode": 1}, "lane: this buffer has 2 lanes"),
        ((), {**rows, "lane": 0}, "episode: this buffer keeps episodes"),
        ((), {**rows, "lane": 0, "episode": 1, "priority": 1.0}, "priority: this buffer samples uniformly"),
        ((), {**rows, "obz": rows["obs"], "lane": 0, "episode": 1}, "unknown field 'obz'"),
        ((), {**{k: v for k, v in rows.items() if k != "obs"}, "lane": 0, "episode": 1}, "missing field 'obs'"),
        ((), {**rows, "done": rows["done"][:1], "lane": 0, "episode": 1}, "ragged batch"),
        ((), {**rows, "lane": 5, "episode": 1}, "lane"),
        ((rows,), {"lane": 0, "episode": 1, "obs": rows["obs"]}, "takes a mapping or keyword fields"),
    ):
        for b in (buf, ref):
            with pytest.raises((sb.FieldError, sb.CapacityError, TypeError), match=error):
                b.push(*args, **kwargs)
    assert block_bytes(buf) == block_bytes(ref)
    import pickle

    again = pickle.loads(pickle.dumps(buf.push))  # a bound method's pickle: the buffer's push
    assert np.array_equal(again(rows, lane=0, episode=7), ref.push(rows, lane=0, episode=7))
    other = sb.ReplayBuffer.attach(buf.handle)
    assert np.array_equal(other.push(rows, lane=1, episode=8), ref.push(rows, lane=1, episode=8))
    other.close()
    kept = sb.ReplayBuffer.attach(buf.handle).push  # as a bound method, it keeps its buffer object
    assert not kept.__self__.closed
    assert np.array_equal(kept(rows, lane=0, episode=9), ref.push(rows, lane=0, episode=9))
    with pytest.raises(sb.FieldError, match="priority: this buffer samples uniformly"):  # the method, for the rest
        kept(rows, lane=0, episode=9, priority=1.0)
    kept.__self__.close()
    assert block_bytes(buf) == block_bytes(ref)
    held = buf.push
    buf.close()  # a push callable still held does not keep the mapping
    with pytest.raises(sb.ClosedError):
        held(**rows, lane=0, episode=1)
    with pytest.raises(sb.ClosedError):
        buf.push(**rows, lane=0, episode=1)


@needs_lib
def test_a_push_is_read_as_an_attribute_and_keeps_its_buffer_without_a_cycle(name: str) -> None:
    """``buf.push`` is one object at every read (seated in the buffer's ``__dict__``: nothing made
    per read); held after the buffer is dropped, it keeps the buffer as a bound method does; and
    the block goes as soon as the last of them does, without the cycle collector."""
    r = {k: v[0] for k, v in transition(0, 1).items()}
    gc.disable()
    try:
        buf = sb.ReplayBuffer(MUJOCO, capacity=8, name=name)
        assert buf.push is buf.push and vars(buf)["push"] is buf.push
        held = buf.push
        del buf
        assert os.path.exists(segment.path_of(name))  # the push keeps its buffer
        assert held(**r).tolist() == [0] and len(held.__self__) == 1 and not held.__self__.closed
        del held
        assert not os.path.exists(segment.path_of(name))  # and the block goes with the push
        buf = sb.ReplayBuffer(MUJOCO, capacity=8, name=name)
        buf.push(**r)
        del buf
        assert not os.path.exists(segment.path_of(name))
    finally:
        gc.enable()
        if os.path.exists(segment.path_of(name)):  # a failed check above left it
            os.unlink(segment.path_of(name))


@needs_lib
def test_push_called_through_the_buffer_and_bound_pushes_reused_push_into_their_own_buffer(make: Make, name: str) -> None:
    """``buf.push(obs=...)`` written out, through the class, and pushes read from two buffers and
    kept push into their own buffer: each row lands where it was sent."""
    a = make(MUJOCO, capacity=8, name=name + "a")
    b = make(MUJOCO, capacity=8, name=name + "b")
    r = {k: v[0] for k, v in transition(0, 1).items()}
    ids = a.push(obs=r["obs"], action=r["action"], reward=r["reward"], next_obs=r["next_obs"], done=r["done"])
    assert ids.tolist() == [0] and len(a) == 1 and len(b) == 0
    with pytest.raises(sb.FieldError, match="unknown field 'obz'"):  # the method for the rest, as bound
        a.push(obz=r["obs"], action=r["action"], reward=r["reward"], next_obs=r["next_obs"], done=r["done"])
    sb.ReplayBuffer.push(b, **r)  # through the class: the function
    for _ in range(3):
        bound_a = a.push
        del bound_a  # its object is kept for the next bound push
        bound_b = b.push
        assert bound_b.__self__ is b
        bound_b(**r)
    kept = a.push
    b.push(**r)
    kept(**r)
    assert (len(a), len(b)) == (2, 5)
