"""The device copy and the block's log of edits (``Counter.EDITS``, ``Ring.log_edits``), with the
one-call sample and lag question beside them: the interleavings that the log of edits must survive (a refresh between an edit's log and its change, a writer that
overwrites entries of the log while a refresh reads them), and the counter the log lives in."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.device import DeviceReplay
from shmbuffer.protocol import refresh
from shmbuffer.protocol.layout import EDIT_LOG, Counter

from .conftest import MUJOCO, transition
from .test_device import whole

torch = pytest.importorskip("torch")
Make = Callable[..., sb.ReplayBuffer]
PATHS = ["native", "python"]


def on_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The C refresh (one call), or the Python steps."""
    if path == "native" and native.lib is None:
        pytest.skip("the C extension is not built")
    if path == "python":
        monkeypatch.setattr(native, "lib", None)


def assert_held_rows_current(dev: DeviceReplay) -> None:
    """Every row the copy may draw is the row the shared buffer holds in that slot now, byte for
    byte, committed with the stamp the copy recorded (to call once no writer runs and after a sync)."""
    slots = np.flatnonzero(dev.usable)
    assert np.array_equal(dev.held[slots], dev.buf.ring.stamp[slots]), "a held row is no longer the slot's row"
    for key, column in dev.columns.items():
        mine = dev.rows[key].numpy()[slots]
        stale = np.flatnonzero((mine != column[slots]).reshape(slots.size, -1).any(1))
        assert not stale.size, f"{key}: the copy holds {stale.size} stale rows, slots {slots[stale][:8].tolist()}"


def refresh_after_each_log(monkeypatch: pytest.MonkeyPatch, buf: sb.ReplayBuffer, dev: DeviceReplay) -> None:
    """A refresh (another process's refresher, say) runs just after an edit is logged, before its
    writer goes on."""
    real = buf.ring.log_edits

    def log_then_refresh(slots: np.ndarray) -> None:
        real(slots)
        dev.sync()

    monkeypatch.setattr(buf.ring, "log_edits", log_then_refresh)


def test_every_counter_has_a_word_of_its_own() -> None:
    """No two ``Counter`` names share a word of ``_stats`` (an ``IntEnum`` makes the second an alias)."""
    words = [int(c) for c in Counter.__members__.values()]
    assert len(set(words)) == len(words), {n: int(c) for n, c in Counter.__members__.items()}


def test_an_update_or_delete_does_not_mark_the_buffer_interleaved(make: Make, name: str) -> None:
    """``Counter.EDITS`` has a word of its own: an ``update()`` or ``delete()`` leaves n-step
    samples and windows allowed, and the flag of interleaved episodes leaves the log's count alone."""
    buf = make(MUJOCO, 64, name=name, episodes=True)
    buf.push(transition(0, 16), episode=0)
    ids = buf.get(slice(None)).index
    buf.update(ids[3:5], reward=np.float32(-1.0))
    buf.delete(ids[7:8])
    assert not buf.block.interleaved
    assert buf.sample(8, n_step=2).steps.shape == (8,)  # refused once the buffer reads as interleaved
    assert buf.sample_sequences(2, 3).mask.shape == (2, 3)

    other = make(MUJOCO, 64, name=name + "b", episodes=True)
    other.push(transition(0, 3), episode=np.array([0, 1, 0]))  # a vector env's steps in one lane
    assert other.block.interleaved
    assert int(other.block.counters[Counter.EDITS]) == 0  # no edit was logged


@pytest.mark.parametrize("path", PATHS)
def test_a_refresh_between_an_updates_log_and_its_writes_never_keeps_the_old_row(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """An ``update()`` logs its slots; a refresh that reads the log before the update's rows go odd
    sees them committed, copies them as they were and holds them; the update then rewrites them
    and puts the same stamps back. The log's entry is behind that refresh, so no later refresh
    copies the rows again: the copy must never keep serving the row as it was."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 32))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    ids = buf.get(slice(None)).index
    refresh_after_each_log(monkeypatch, buf, dev)
    buf.update(ids[5:7], reward=np.float32(-3.0))
    monkeypatch.undo()
    dev.sync()
    dev.sync()
    assert_held_rows_current(dev)
    assert len(dev) == 32
    got = dev.sample(2000)
    assert np.array_equal(got.reward.numpy(), np.asarray(buf.take(got.index.numpy()).reward))
    dev.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_refresh_between_a_deletes_log_and_its_stamps_never_keeps_the_deleted_row(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A ``delete()`` logs its slots, then zeroes their stamps: a refresh between the two sees the
    rows committed and holds them; the deleted rows must not stay drawable."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 32))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    ids = buf.get(slice(None)).index
    refresh_after_each_log(monkeypatch, buf, dev)
    buf.delete(ids[10:12])
    monkeypatch.undo()
    dev.sync()
    dev.sync()
    slots = buf.ring.slots(ids[10:12])
    assert not dev.usable[slots].any(), "a deleted row is still drawable"
    assert len(dev) == 30
    assert not np.isin(dev.sample(4000).index.numpy(), ids[10:12]).any()
    assert_held_rows_current(dev)
    dev.close()


@pytest.mark.parametrize("path", PATHS)
def test_the_rows_an_undone_push_puts_back_are_held_again(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A push that fails before its copy is undone: the cursors move back and the slots get their
    old rows (and stamps) back. A refresh that ran during the push dropped those rows (their slots
    odd); one that reads the undo's entry must find the old rows and hold them again, not leave
    them out of the copy until the lane laps them."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 8, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    assert len(dev) == 8
    res = buf.ring.reserve(3, deferring=False)  # rows 8-10 over rows 0-2's slots, odd
    assert dev.sync() == 0 and len(dev) == 5
    refresh_after_each_log(monkeypatch, buf, dev)
    buf.ring.undo(res, copied=False)
    monkeypatch.undo()
    assert len(buf) == 8
    dev.sync()
    dev.sync()
    assert_held_rows_current(dev)
    assert len(dev) == 8, "the rows put back are never held again"
    assert set(dev.sample(2000).index.numpy().tolist()) == set(buf.get(slice(None)).index.tolist())
    dev.close()


class _EntriesThenRefresh:
    """The log's array as a writer sees it: after the writer stores its entries (and before
    whatever it stores next) a refresh runs once: a writer overwriting entries of the log while a
    refresh (another process's) reads them."""

    def __init__(self, real: np.ndarray, refresh: Callable[[], Any]) -> None:
        self.real, self.refresh = real, refresh

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real[key] = value
        refresh, self.refresh = self.refresh, lambda: None
        refresh()

    def __getitem__(self, key: Any) -> Any:
        return self.real[key]


@pytest.mark.parametrize("path", PATHS)
def test_entries_overwritten_while_a_refresh_reads_them_are_not_taken_as_read(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A refresh 1000 edits behind reads the log while an update of 100 more rows has stored its
    entries (over the oldest 76 the refresh is reading) but not yet its count: the count says 1000,
    within the log, so the refresh takes the overwritten entries for the old ones. The rows the
    first update changed must still be copied again (here: a full refresh)."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 2048, name=name)
    buf.push(transition(0, 2000))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    ids = buf.get(slice(None)).index
    buf.update(ids[:1000], reward=np.float32(-1.0))  # 1000 entries the copy has not read
    monkeypatch.setattr(buf.ring, "_edits", _EntriesThenRefresh(buf.ring._edits, dev.sync))
    buf.update(ids[1000:1100], reward=np.float32(-2.0))  # 100 more: entries 1000-1099 over 0-75
    monkeypatch.undo()
    assert EDIT_LOG == 1024
    dev.sync()
    dev.sync()
    assert_held_rows_current(dev)
    assert len(dev) == 2000
    dev.close()


class _RefreshBeforeWrite:
    """A field's column as ``update()`` writes it: a refresh runs first (the update's rows odd,
    its bytes not written yet), once."""

    def __init__(self, real: np.ndarray, refresh: Callable[[], Any]) -> None:
        self.real, self.refresh = real, refresh

    def __setitem__(self, key: Any, value: Any) -> None:
        refresh, self.refresh = self.refresh, lambda: None
        refresh()
        self.real[key] = value

    def __getitem__(self, key: Any) -> Any:
        return self.real[key]


@pytest.mark.parametrize("path", PATHS)
def test_a_new_row_being_updated_during_a_refresh_is_pending_once(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Rows pushed since the last refresh and being updated as the next one runs: the log names
    them (pending) and they are new (the refresh's run copies them, odd: pending again). Pending
    twice, the refresh after the update held each twice: inconsistent slot lists (the C refresh
    raises; the Python steps count the slot twice in ``dense``)."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    buf.push(transition(8, 4))  # new since the refresh
    ids = buf.get(slice(None)).index
    monkeypatch.setitem(buf.block.fields, "reward", _RefreshBeforeWrite(buf.block.fields["reward"], dev.sync))
    buf.update(ids[9:11], reward=np.float32(-5.0))
    monkeypatch.undo()
    dev.sync()  # the C refresh raised: "the device copy's slot lists are inconsistent"
    count = len(dev)
    assert count == 12 and np.unique(dev.dense[:count]).size == count
    assert_held_rows_current(dev)
    dev.close()


@pytest.mark.parametrize("path", PATHS)
def test_an_undone_push_over_more_than_half_the_lane_refreshes(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A refresh during a push of 5 rows into a lane of 8 leaves their ids pending; the push is
    undone (the cursor moves back under them) and the next refresh finds the 5 old rows to copy:
    the ids above the cursor must not stay pending beside them (10 ids for 8 slots)."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 8, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    res = buf.ring.reserve(5, deferring=False)
    dev.sync()
    assert dev.pending.size == 5
    buf.ring.undo(res, copied=False)
    dev.sync()
    assert len(dev) == 8 and dev.pending.size == 0
    assert_held_rows_current(dev)
    buf.push(transition(100, 3))  # the undone rows' numbers again, now committed
    dev.sync()
    assert len(dev) == 8 and dev.pending.size == 0
    assert_held_rows_current(dev)
    dev.close()


def test_close_between_the_one_call_draw_and_the_n_step_returns_says_closed(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread closes the copy after the C draw and before the n-step returns are built
    from the device columns: the sample says closed (as every other path does), not a KeyError."""
    if native.lib is None:
        pytest.skip("the C extension is not built")
    buf = make(MUJOCO, 64, name=name, episodes=True)
    buf.push(transition(0, 16), episode=0)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    real = dev._uniform_one_call

    def draw_then_close(n: int) -> sb.Batch:
        batch = real(n)
        dev.close()
        return batch

    monkeypatch.setattr(dev, "_uniform_one_call", draw_then_close)
    with pytest.raises(sb.ClosedError, match="closed"):
        dev.sample(4, n_step=3)


def test_the_c_lag_question_equals_the_python_steps(make: Make, name: str) -> None:
    """``behind`` (C) and ``refresh.behind`` give the same answer over rows, updates, deletes, a
    clear and each bound and share (the seconds bound far passed or far ahead: no timing)."""
    if native.lib is None:
        pytest.skip("the C extension is not built")
    import time

    buf = make(MUJOCO, 64, name=name, lanes=2)
    buf.push(transition(0, 8), lane=0)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    ids = buf.get(slice(None)).index
    from shmbuffer.protocol.refresh import AT

    def compare() -> int:
        n = 0
        for rows_bound in (None, 0, 1, 3, 7, 100):
            for seconds in (None, 0.0, 0.01, 1e6):
                for at in (0, time.monotonic_ns() + 10**15):
                    dev.max_lag_rows, dev.max_lag_s = rows_bound, seconds
                    dev.state[AT] = at
                    for share in (0.5, 1.0, 0.3):
                        steps = refresh.behind(buf, dev.state, dev.bases, rows_bound, seconds, share)
                        assert dev._behind(share) == steps, (rows_bound, seconds, at, share)
                        n += 1
        return n

    assert compare()
    buf.push(transition(8, 3), lane=1)
    compare()
    dev.sync()
    compare()
    buf.update(ids[:1], reward=np.float32(2.0))
    compare()
    dev.sync()
    buf.delete(ids[1:2])
    compare()
    buf.push(transition(20, 5), lane=0)
    compare()
    buf.clear()
    compare()
    dev.close()


def _pusher_updater(handle: sb.BufferHandle, rounds: int) -> None:
    """Push 8 rows, then rewrite the 8 newest (pushed since the copy's last refresh, often) as
    other whole rows, ``rounds`` times."""
    buf = sb.ReplayBuffer.attach(handle)
    for r in range(rounds):
        buf.push(transition(100 * r, 8))
        newest = buf.get(slice(-8, None)).index
        buf.update(newest, **transition(100 * r + 50, 8))
    buf.close()


@pytest.mark.parametrize("path", PATHS)
def test_updates_of_new_rows_while_the_refresher_runs(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str, procs: list[Any]) -> None:
    """A writer process pushes and at once rewrites its newest rows by ``update()`` (TorchRL's
    storage writes so) while the background refresher refreshes and the learner samples: the
    refresher never stops on inconsistent lists, every row drawn is whole, and once the writer is
    done a sync leaves every held row current."""
    on_path(monkeypatch, path)
    buf = make(MUJOCO, 512, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_s=0.001, seed=1)
    p = mp.get_context("fork").Process(target=_pusher_updater, args=(buf.handle, 1500))
    procs.append(p)
    p.start()
    while p.is_alive():
        whole(dev.sample(64))  # raises once the refresher stopped on inconsistent lists
    p.join(60)
    assert p.exitcode == 0
    dev.sync()
    whole(dev.sample(256))
    assert_held_rows_current(dev)
    dev.close()


def test_two_copies_of_one_buffer_follow_the_log_each_at_its_own_pace(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two device copies (the C refresh and the Python steps where the extension is built) read the
    one log: one refreshes after every few edits, the other only after more than the log holds
    (a full refresh); both end with every held row current and none deleted."""
    buf = make(MUJOCO, 2048, name=name, lanes=2)
    for lane in range(2):
        buf.push(transition(np.arange(lane * 1024, lane * 1024 + 900)), lane=lane)
    often = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    monkeypatch.setattr(native, "lib", None)
    seldom = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=1)
    ids = buf.get(slice(None)).index
    rng = np.random.default_rng(0)
    for r in range(12):
        buf.update(rng.choice(ids, 100, replace=False), reward=np.float32(-r))
        buf.delete(ids[r:r + 1])
        often.sync()
    seldom.sync()
    for dev in (often, seldom):
        assert_held_rows_current(dev)
        assert len(dev) == 1800 - 12
        assert not np.isin(dev.sample(3000).index.numpy(), ids[:12]).any()
        dev.close()


@pytest.mark.parametrize("path", ["native", "python"])
def test_under_a_row_bound_a_delete_is_seen_by_the_next_sample(make: Callable[..., sb.ReplayBuffer], name: str,
                                                               monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """``max_lag_rows=0`` without a time bound: a row deleted is never drawn by a later sample,
    even when no row came in since (the delete alone makes the sample refresh)."""
    if path == "native" and native.lib is None:
        pytest.skip("the C extension is not built")
    if path == "python":
        monkeypatch.setattr(native, "lib", None)
    buf = make(MUJOCO, 32, name=name)
    ids = buf.push(transition(0, 10))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, max_lag_s=None, refresher=False, seed=0)
    assert ids[3] in dev.sample(500).index.numpy()
    buf.delete(ids[3:4])
    assert ids[3] not in dev.sample(2000).index.numpy() and len(dev) == 9
    dev.close()
