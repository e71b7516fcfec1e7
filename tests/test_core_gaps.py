"""Issue 14's core gaps: lists of rows, the priority inside a row, update / delete by id, len
without deleted or used-up rows, distinct and short episodes, annealing kept in the block,
export / import with priorities, uses and ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import persistence

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]
SMALL = sb.Schema(obs=((3,), "float32"), reward=((), "float32"))


def row(i: float) -> dict[str, Any]:
    return {"obs": np.full(3, i, np.float32), "reward": float(i)}


# -- push -------------------------------------------------------------------------------------------------


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
        out = group.push([row(i) for i in range(4)])
        assert out["policy"].tolist() == out["value"].tolist() == [0, 1, 2, 3]
        assert group["value"].get(slice(None)).reward.tolist() == [0, 1, 2, 3]
        with pytest.raises(sb.FieldError, match="row 1 has fields"):
            group.push([row(0), {"obs": np.zeros(3)}])


def test_the_priority_inside_a_row(make: Make, name: str) -> None:
    s = sb.Prioritized(alpha=0.5, beta=0.4, eps=0.0)
    buf = make(SMALL, 10, sampler=s, name=name)
    buf.push({**row(0), "priority": 4.0})                      # Ape-X: the actor's priority
    buf.push([{**row(1), "priority": 9.0}, {**row(2), "priority": 16.0}])
    assert buf.priority([0, 1, 2]).tolist() == [2.0, 3.0, 4.0]
    assert buf.priorities.max_priority == 16.0
    with pytest.raises(TypeError, match="both in the row and as priority="):
        buf.push({**row(3), "priority": 1.0}, priority=2.0)
    uniform = make(SMALL, 10, name=name + "u")
    with pytest.raises(sb.FieldError, match="samples uniformly"):
        uniform.push({**row(0), "priority": 1.0})


# -- update and delete ------------------------------------------------------------------------------------


def test_update_rows_by_id(make: Make, name: str) -> None:
    buf = make(SMALL, 4, sampler=sb.Prioritized(alpha=1.0, eps=0.0), name=name)
    ids = buf.push(obs=np.zeros((3, 3)), reward=np.zeros(3))
    assert buf.update(ids[1:], reward=[5.0, 6.0]) == 2
    got = buf.get(slice(None))
    assert got.reward.tolist() == [0, 5, 6] and (got.obs == 0).all()      # the fields not given stay
    assert buf.update([0], {"obs": np.ones(3), "priority": 7.0}) == 1
    assert buf.get(0).obs.tolist() == [1, 1, 1] and buf.priority([0]).tolist() == [7.0]
    buf.push(obs=np.zeros((3, 3)), reward=np.zeros(3))                    # ids 0..1 overwritten
    assert buf.update([0, 1, 2], reward=9.0) == 1                          # stale ids are skipped
    assert buf.get(slice(None)).reward.tolist() == [9, 0, 0, 0]
    with pytest.raises(sb.FieldError, match="no field 'bogus'"):
        buf.update([2], bogus=1)
    with pytest.raises(sb.UnknownIdError):
        buf.update([99], reward=1.0)
    with pytest.raises(sb.FieldError, match="field 'obs'"):
        buf.update([2], obs=np.zeros(4))
    buf.freeze()
    with pytest.raises(sb.ReadOnlyError):
        buf.update([2], reward=1.0)


class _Spy(dict[str, Any]):
    """The block's field views, calling ``during`` before each column of an update is copied."""

    def __init__(self, fields: dict[str, np.ndarray], during: Callable[[], None]) -> None:
        super().__init__(fields)
        self.during = during

    def __getitem__(self, key: str) -> Any:
        col = super().__getitem__(key)
        spy = self

        class Column:
            def __setitem__(self, where: Any, value: Any) -> None:
                spy.during()
                col[where] = value

        return Column()


def test_a_reader_never_sees_a_row_half_updated(make: Make, name: str) -> None:
    buf = make(SMALL, 8, name=name, seed=0)
    buf.push(obs=np.zeros((8, 3)), reward=np.zeros(8))
    block = buf.block
    real = block.fields
    seen: list[int] = []

    def during() -> None:
        # mid-update: the row being updated is odd, so samples re-draw it and take refuses it
        block.fields = real
        for _ in range(20):
            batch = buf.sample(8)
            seen.extend(batch.index.tolist())
            assert (batch.obs == batch.reward[:, None]).all()
        with pytest.raises(sb.EmptyBufferError):
            buf.take([3])
        block.fields = spy

    spy = _Spy(real, during)
    block.fields = spy
    try:
        assert buf.update([3], obs=np.full(3, 7.0), reward=7.0) == 1
    finally:
        block.fields = real
    assert seen and 3 not in seen and len(set(seen)) == 7
    assert buf.take([3]).reward.tolist() == [7.0]                     # committed again afterwards


@pytest.mark.parametrize("pure", [False, True])
def test_an_update_of_other_rows_loses_no_row_of_take_or_epoch(
    make: Make, name: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an update anywhere moves Counter.UPDATES, which discards the whole gather it spans; take
    # and epoch cannot re-draw, so they must gather the untouched rows again, not drop them
    from shmbuffer import native
    from shmbuffer.protocol.ring import Ring

    if pure:
        monkeypatch.setattr(native, "lib", None)
    buf = make(SMALL, 64, name=name)
    buf.push(obs=np.zeros((64, 3)), reward=np.arange(64.0))
    cleared = Ring.cleared
    pending: list[int] = []

    def spy(self: Ring, ids: np.ndarray, lowest: int | None = None) -> np.ndarray:
        if pending:  # called by gather after its copies: another process updates row 63 now
            pending.pop()
            buf.update([63], reward=1000.0)
        return cleared(self, ids, lowest)

    monkeypatch.setattr(Ring, "cleared", spy)
    pending.append(1)
    got = np.concatenate([b.reward for b in buf.epoch(16, shuffle=False)])
    assert not pending and got[:63].tolist() == list(range(63))
    pending.append(1)
    assert buf.take([0, 1]).reward.tolist() == [0.0, 1.0] and not pending


@pytest.mark.parametrize("pure", [False, True])
def test_updates_beginning_during_every_large_gather_do_not_starve_reads(
    make: Make, name: str, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a process updating some row without pause begins an update during nearly every gather of
    # many large rows (a sample of 2048 Atari frames failed every time with WaitTimeout); the
    # gather reads such rows again in small pieces, each under its own count
    from shmbuffer import native
    from shmbuffer.protocol import reader
    from shmbuffer.protocol.layout import Counter
    from shmbuffer.protocol.ring import Ring

    if pure:
        monkeypatch.setattr(native, "lib", None)
    buf = make(sb.Schema(obs=((16384,), "float32"), x=((), "int64")), 32, name=name, seed=0)
    buf.push(obs=np.zeros((32, 16384), np.float32), x=np.arange(32))
    assert reader._PIECE_BYTES // buf.schema.row_bytes < 16
    cleared = Ring.cleared

    def spy(self: Ring, ids: np.ndarray, lowest: int | None = None) -> np.ndarray:
        if ids.size > reader._PIECE_BYTES // buf.schema.row_bytes:  # after a large gather's copies
            buf.block.counters[Counter.UPDATES] += 1                  # an update began meanwhile
        return cleared(self, ids, lowest)

    monkeypatch.setattr(Ring, "cleared", spy)
    batch = buf.sample(16)
    assert (batch.x == batch.index).all()
    assert buf.get(slice(None)).x.tolist() == list(range(32))
    assert buf.take(np.arange(16)).x.tolist() == list(range(16))
    assert [len(b) for b in buf.epoch(32, shuffle=False)] == [32]


def test_distinct_rows_beyond_those_left_after_deletes(make: Make, name: str) -> None:
    # len(buf) leaves deleted rows out; sample(replace=False) must say so, not spin for a second
    # and raise WaitTimeout as if rows were being written
    buf = make(sb.Schema(x=((), "int64")), 10, name=name, seed=0)
    buf.push(x=np.arange(10))
    assert buf.delete([0, 1, 2, 3, 4]) == 5 and len(buf) == 5
    with pytest.raises(sb.EmptyBufferError, match="only 5 rows"):
        buf.sample(8, replace=False)
    assert sorted(buf.sample(5, replace=False).x.tolist()) == [5, 6, 7, 8, 9]


def test_delete_rows(make: Make, name: str, tmp_path: Path) -> None:
    buf = make(SMALL, 10, sampler=sb.Prioritized(), name=name, seed=1)
    buf.push(obs=np.arange(6.0)[:, None] * np.ones(3), reward=np.arange(6.0))
    assert len(buf) == 6
    assert buf.delete([1, 4, 4]) == 2 and buf.delete([1]) == 0
    assert len(buf) == 4 and buf.size == 4
    assert buf.priority([1, 4]).tolist() == [0.0, 0.0]
    for _ in range(50):
        assert not {1, 4} & set(buf.sample(8).index.tolist())
    with pytest.raises(sb.EmptyBufferError):
        buf.take([1])
    assert sb.export(buf)["index"].tolist() == [0, 2, 3, 5]
    buf.save(tmp_path / "s")
    with sb.load(tmp_path / "s", name=name + "l") as back:
        assert len(back) == 4 and sb.export(back)["index"].tolist() == [0, 2, 3, 5]
    buf.push(obs=np.zeros((8, 3)), reward=np.zeros(8))       # rows 4..13: row 4 is still deleted
    assert len(buf) == 9
    buf.push(row(0))                                         # the ring comes round: 10 rows held again
    assert len(buf) == 10


def test_used_up_rows_do_not_count(make: Make, name: str) -> None:
    buf = make(SMALL, 10, max_use=1, name=name, seed=0)
    buf.push(obs=np.zeros((6, 3)), reward=np.zeros(6))
    batch = buf.sample(4, replace=False)
    assert len(buf) == 2 and len(batch) == 4
    buf.sample(2, replace=False)
    assert len(buf) == 0


# -- episodes -----------------------------------------------------------------------------------------------


def test_distinct_episodes_and_short_groups(make: Make, name: str) -> None:
    # DI-engine's example: push("a", {"episode": 1}), push("b", {"episode": 2}), push("c", {"episode": 2})
    buf = make(SMALL, 10, episodes=True, name=name, seed=0)
    for value, episode in ((0, 1), (1, 2), (2, 2)):
        buf.push(row(value), episode=episode)
    for _ in range(50):
        groups = buf.sample_groups(2, 2, replace=False, short=True)
        assert sorted(groups.reward[:, 0].tolist()) == [0, 1]        # one group of each episode
        short = int(np.flatnonzero(groups.reward[:, 0] == 0)[0])
        assert groups.mask[short].tolist() == [True, False]            # episode 1 kept, truncated
        assert groups.mask[1 - short].tolist() == [True, True]
        assert groups.index[short].tolist() == [0, -1]
    with pytest.raises(sb.EmptyBufferError, match="holds 2 episodes, fewer than the 3"):
        buf.sample_groups(3, 2, replace=False, short=True)
    # whole episodes: the one still being written (episode 2) is not complete
    assert [e.reward.tolist() for e in buf.sample_episodes(1, replace=False)] == [[0.0]]
    with pytest.raises(sb.EmptyBufferError, match="holds 1 complete episodes"):
        buf.sample_episodes(2, replace=False)


def test_episodes_are_distinct_in_a_call(make: Make, name: str) -> None:
    buf = make(SMALL, 100, episodes=True, name=name, seed=3)
    for episode, length in enumerate([3, 5, 2, 7, 4, 6]):
        buf.push(obs=np.full((length, 3), episode), reward=np.full(length, episode), episode=episode)
    for _ in range(50):
        got = buf.sample_episodes(5, replace=False)                   # the 6th is still open
        assert sorted(int(e.reward[0]) for e in got) == [0, 1, 2, 3, 4]
        groups = buf.sample_groups(6, 3, ordered=False, replace=False, short=True)
        assert sorted(groups.reward[:, 0].tolist()) == [0, 1, 2, 3, 4, 5]
        ordered = buf.sample_groups(4, 4, replace=False)              # only episodes of 4 rows or more
        assert sorted(ordered.reward[:, 0].tolist()) == [1, 3, 4, 5] and "mask" not in ordered


# -- annealing ------------------------------------------------------------------------------------------------


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


# -- export and import ------------------------------------------------------------------------------------------


def test_import_rows_in_pieces_changes_nothing_on_error_and_fills_env_lanes(make: Make, name: str) -> None:
    # import_rows pushes a lane's capacity at a time: a bad value in a later piece must be refused
    # before the first piece goes in, and a buffer with envs= takes whole env steps per piece
    x = sb.Schema(x=((), "int64"))
    buf = make(x, 4, sampler=sb.Prioritized(), max_use=3, name=name)
    with pytest.raises(sb.FieldError, match="nothing was changed"):
        persistence.import_rows(buf, {"x": np.arange(6), "priority": [1.0] * 5 + [-1.0]})
    with pytest.raises(sb.CapacityError, match="uses"):
        persistence.import_rows(buf, {"x": np.arange(6), "uses": [0] * 5 + [-1]})
    assert len(buf) == 0 and buf.stats["inserted"] == 0
    envs = make(x, 6, envs=2, name=name + "e")
    assert persistence.import_rows(envs, {"x": np.arange(4)}).tolist() == [0, 1, 2, 3]
    assert envs.get(slice(None)).x.tolist() == [0, 2, 1, 3]                # lane 0, then lane 1


def test_export_and_import_carry_priorities_uses_and_ids(make: Make, name: str) -> None:
    s = sb.Prioritized(alpha=0.5, eps=0.0)
    buf = make(SMALL, 6, sampler=s, max_use=3, name=name, seed=0)
    buf.push(obs=np.zeros((9, 3))[:6], reward=np.arange(6.0), priority=np.arange(1.0, 7.0))
    buf.push(obs=np.zeros((3, 3)), reward=np.arange(6.0, 9.0), priority=[7.0, 8.0, 9.0])   # ids 3..8 held
    buf.delete([5])
    buf.sample(4, replace=False)
    out = sb.export(buf)
    assert out["index"].tolist() == [3, 4, 6, 7, 8]
    assert np.allclose(out["priority"], [4, 5, 7, 8, 9])
    uses = out["uses"].copy()
    assert uses.sum() == 4
    copy = sb.ReplayBuffer.from_arrays(SMALL, out, sampler=s, max_use=3, name=name + "c")
    try:
        again = sb.export(copy)
        assert again["index"].tolist() == [3, 4, 6, 7, 8]                # the same ids
        assert np.allclose(again["priority"], out["priority"]) and again["uses"].tolist() == uses.tolist()
        assert copy.take([6]).reward.tolist() == [6.0] and len(copy) == 5
        with pytest.raises(sb.EmptyBufferError):
            copy.take([5])                                              # the deleted row stays a hole
    finally:
        copy.close()
        copy.unlink()
    target = make(SMALL, 20, sampler=s, max_use=3, name=name + "t")
    target.push(row(100))
    new = persistence.import_rows(target, out)                          # into an existing buffer
    assert new.tolist() == [1, 2, 3, 4, 5]
    assert np.allclose(sb.export(target)["priority"][1:], out["priority"])
    assert target.uses(new).tolist() == uses.tolist()


def _updater(handle: sb.BufferHandle, rounds: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    try:
        wide = np.ones((8, 300), np.float32)
        for v in range(1, rounds + 1):
            assert buf.update(np.arange(8), obs=wide * v, reward=float(v)) == 8
    finally:
        buf.close()


def test_updates_from_another_process_are_never_seen_torn(make: Make, name: str, procs: list[Any]) -> None:
    """A process rewrites every row over and over (a large field, then a small one); the learner
    samples meanwhile: every row it gets has both fields of one update."""
    import multiprocessing as mp

    schema = sb.Schema(obs=((300,), "float32"), reward=((), "float32"))
    buf = make(schema, 8, name=name, seed=0)
    buf.push(obs=np.zeros((8, 300)), reward=np.zeros(8))
    p = mp.get_context("fork").Process(target=_updater, args=(buf.handle, 3000))
    procs.append(p)
    p.start()
    samples = 0
    while p.is_alive() or not samples:
        batch = buf.sample(8)
        assert (batch.obs == batch.reward[:, None]).all()
        samples += 1
    p.join(30)
    assert p.exitcode == 0
    assert (buf.get(slice(None)).reward == 3000).all()


def test_compat_sits_on_top() -> None:
    """Nothing in the package imports ``shmbuffer.compat``; the facades read no other object's
    underscored names (the rules tests/test_layers.py holds for the package's modules)."""
    from .test_layers import imports, module_paths, private_reads

    paths = module_paths()
    known = set(paths)
    facades = {m for m in paths if m.split(".")[0] == "compat"}
    below = [m for m, p in paths.items() if m not in facades and imports(p, known) & facades]
    assert not below, f"{below} import shmbuffer.compat"
    assert {"compat", "compat.ding", "compat.mindspore", "compat.nervex", "compat.velora"} <= facades
    assert not [r for m in facades for r in private_reads(paths[m])]
