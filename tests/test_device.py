"""The device-resident copy (``shmbuffer.device``), tested with ``device="cpu"`` (torch tensors):
rows equal ``take()`` of the same ids bit for bit; writers pushing, lapping, killed mid-push and
``clear()`` while the copy refreshes never yield a torn, cleared or beyond-the-lag row; the draws
have the shared buffer's distribution. CUDA runs the same code where a device exists."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.device import DeviceReplay
from shmbuffer.protocol import reader, refresh
from shmbuffer.protocol.layout import EDIT_LOG

from .conftest import MUJOCO, copy_through, needs_lib, seq_of, transition

torch = pytest.importorskip("torch")
Make = Callable[..., sb.ReplayBuffer]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="no CUDA device here: the same code runs on the CPU"))]


def whole(batch: sb.Batch) -> np.ndarray:
    """Check every row is one push's row (``transition``'s payload derives from its number); the numbers."""
    got = batch.numpy()
    s = got.reward[:, None]
    assert np.array_equal(got.obs, s + np.arange(17, dtype=np.float32))
    assert np.array_equal(got.action, -s + np.arange(6, dtype=np.float32))
    assert np.array_equal(got.next_obs, got.obs + 1)
    assert np.array_equal(got.done, got.reward % 2 == 1)
    return got.reward.astype(np.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_equal_take_of_the_same_ids_bit_for_bit(make: Make, name: str, device: str) -> None:
    buf = make(MUJOCO, 64, name=name, lanes=2, episodes=True)
    for t in range(0, 80, 5):
        buf.push(transition(t, 5), lane=(t // 5) % 2, episode=t // 10)
    dev = DeviceReplay(buf, device, max_lag_rows=0, seed=0)
    assert len(dev) == len(buf) == 64
    batch = dev.sample(200)
    assert batch.obs.device.type == device and batch.obs.dtype == torch.float32 and batch.obs.shape == (200, 17)
    ref = buf.take(batch.index.cpu().numpy())
    for key in ("obs", "action", "reward", "next_obs", "done", "episode", "index"):
        assert np.array_equal(batch[key].cpu().numpy(), np.asarray(ref[key])), key
    assert set(buf.sample(4).keys()) == set(batch.keys())


@pytest.mark.parametrize("device", DEVICES)
def test_a_sample_syncs_within_the_lag_and_sync_on_demand(make: Make, name: str, device: str) -> None:
    buf = make(MUJOCO, 32, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, device, max_lag_rows=None, max_lag_s=None, refresher=False, seed=1)
    buf.push(transition(8, 8))
    assert dev.lag()[0] == 8 and set(seq_of(dev.sample(500))) == set(range(8))  # lagging, by choice
    assert dev.sync() == 8 and dev.lag()[0] == 0
    assert set(seq_of(dev.sample(500))) == set(range(16))
    lagging = DeviceReplay(buf, device, max_lag_rows=4, max_lag_s=None, refresher=False, seed=2)
    buf.push(transition(16, 4))
    assert set(seq_of(lagging.sample(500))) == set(range(16))  # 4 rows behind: allowed, not synced
    buf.push(transition(20, 1))
    assert set(seq_of(lagging.sample(500))) == set(range(21))  # 5 rows behind: synced first
    timed = DeviceReplay(buf, device, max_lag_rows=None, max_lag_s=0.05, refresher=False, seed=3)
    buf.push(transition(21, 3))
    time.sleep(0.1)
    assert set(seq_of(timed.sample(500))) == set(range(24))


def test_overwritten_updated_cleared_and_deleted_rows(make: Make, name: str) -> None:
    buf = make(MUJOCO, 8, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=4)
    buf.push(transition(8, 4))  # laps rows 0..3
    assert set(seq_of(dev.sample(400))) == set(range(4, 12))
    buf.update([5], reward=np.float32(99.0))
    dev.sample(1)
    got = dev.sample(400)
    assert set(got.reward.numpy()[got.index.numpy() == 5]) == {99.0}
    buf.delete([6])
    dev.sync()  # a delete is lag like any change: gone at the next sync
    assert 6 not in set(dev.sample(400).index.tolist())
    buf.clear()
    with pytest.raises(sb.EmptyBufferError, match="holds no rows"):
        dev.sample(4)  # synced first: a cleared row is never drawn
    assert len(dev) == 0
    with pytest.raises(sb.EmptyBufferError, match="holds no rows"):
        dev.sample(4)
    buf.push(transition(100, 2))
    assert set(seq_of(dev.sample(50))) == {100, 101}


def test_a_row_being_written_is_never_usable(make: Make, name: str) -> None:
    buf = make(MUJOCO, 16, name=name)
    buf.push(transition(0, 4))
    res = buf.ring.reserve(2, deferring=False)  # rows 4 and 5: reserved, odd, never copied whole
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=5)
    assert len(dev) == 4 and set(seq_of(dev.sample(300))) == set(range(4))
    buf.ring.abandon(res)
    buf.push(transition(6, 2))
    assert set(seq_of(dev.sample(300))) == {0, 1, 2, 3, 6, 7}


@pytest.mark.parametrize("sampler", [sb.Uniform(), sb.Prioritized(alpha=1.0, beta=0.5)], ids=["uniform", "tree"])
def test_a_sample_waits_for_rows_the_copy_lacks_while_the_buffer_holds_them(make: Make, name: str,
                                                                            sampler: sb.Sampler) -> None:
    """A copy with no row to draw while the buffer holds rows (every slot being written when it
    refreshed, as when writers lap a small ring faster than it refreshes) refreshes and draws
    again, as the host's sample waits for rows being written: within ``GIVE_UP`` seconds, then
    ``WaitTimeout``. An empty buffer still raises ``EmptyBufferError`` at once."""
    buf = make(MUJOCO, 16, name=name, sampler=sampler)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    start = time.monotonic()
    with pytest.raises(sb.EmptyBufferError, match=r"holds no rows|holds none of the rows"):
        dev.sample(4)
    assert time.monotonic() - start < 0.5
    res = buf.ring.reserve(8, deferring=False)  # every row the buffer holds being written
    assert dev.sync() == 0 and len(dev) == 0
    start = time.monotonic()
    with pytest.raises(sb.WaitTimeout, match=r"held no row to draw for 1 s while the buffer holds 8"):
        dev.sample(4)
    assert 0.9 < time.monotonic() - start < 5
    # rows come in while those are still being written (abandoned after: a sample between an
    # abandon and a push would find the buffer empty, which raises at once, as it should)
    late = threading.Timer(0.2, lambda: (buf.push(transition(8, 8)), buf.ring.abandon(res)))
    late.start()
    try:
        batch = dev.sample(64)
    finally:
        late.join()
    assert set(whole(batch)) == set(range(8, 16))
    assert buf.stats["sampled"] == 64  # the refused draws counted nothing


@pytest.mark.parametrize("device", DEVICES)
def test_prioritized_draws_from_the_shared_tree(make: Make, name: str, device: str) -> None:
    buf = make(MUJOCO, 16, name=name, sampler=sb.Prioritized(alpha=1.0, beta=0.5), seed=6)
    buf.push(transition(0, 4), priority=np.array([1.0, 2.0, 3.0, 4.0]))
    dev = DeviceReplay(buf, device, max_lag_rows=0, seed=6)
    n = 20000
    got = dev.sample(n).numpy()
    counts = np.bincount(got.index, minlength=4)
    expect = n * np.array([1, 2, 3, 4]) / 10
    assert ((counts - expect) ** 2 / expect).sum() < 16.27  # chi-square, 3 dof, p = 0.001
    ref = buf.sample(400)
    w, i = got.weight, got.index
    assert w.dtype == np.float32 and ref.weight.dtype == np.float32
    for row in range(4):  # the shared buffer's weights: (leaf / min leaf) ** -beta
        assert set(w[i == row].tolist()) == set(ref.weight[ref.index == row].tolist())
    np.testing.assert_allclose(w[i == 3], 4 ** -0.5, rtol=1e-5)
    assert np.array_equal(whole(got), got.index)
    dev.update_priorities(torch.tensor([0], device=device), torch.tensor([100.0], device=device))  # the shared tree: every process sees it
    assert buf.priority([0]).tolist() == pytest.approx([100.0])


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("full", [False, True])
def test_uniform_draws_match_the_shared_buffers(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str,
                                                full: bool) -> None:
    """Uniform over the rows the copy holds: a few rows of each lane, or every slot (where the C
    draw takes the place as the slot), by the C sample and by the Python steps."""
    if path == "native" and native.lib is None:
        pytest.skip("the C extension is not built")
    buf = make(MUJOCO, 64 if full else 80, name=name, lanes=4)
    for lane in range(4):
        buf.push(transition(np.arange(lane * 16, lane * 16 + (16 if full else 5))), lane=lane)
    if path == "python":
        monkeypatch.setattr(native, "lib", None)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=7)
    assert dev.one_call == (path == "native") and len(dev) == len(buf)
    n, rows = 40000, len(buf)
    batch = dev.sample(n)
    whole(batch)
    counts = np.bincount(np.searchsorted(np.sort(buf.get(slice(None)).index), batch.index.numpy()), minlength=rows)
    assert counts.size == rows
    expect = n / rows
    limit = {19: 43.82, 63: 103.4}[rows - 1]  # chi-square, p = 0.001
    assert ((counts - expect) ** 2 / expect).sum() < limit
    ref = buf.take(batch.index.numpy()[:500])
    for key in ("obs", "action", "reward", "next_obs", "done"):
        assert np.array_equal(batch[key][:500].numpy(), np.asarray(ref[key])), key
    dev.close()


@needs_lib
def test_the_one_call_lag_question_equals_the_python_steps(make: Make, name: str) -> None:
    """Whether a copy is behind its bounds, asked in C and in Python steps, after each kind of
    change (rows pushed, an update, a delete, a clear), for each kind of bound, at a sample's
    share and at the refresher's."""
    buf = make(MUJOCO, 64, name=name, lanes=2)
    bounds = [(None, None), (0, None), (5, None), (None, 0.0), (None, 1e6), (5, 1e6)]
    copies = [DeviceReplay(buf, "cpu", max_lag_rows=r, max_lag_s=s, refresher=False, seed=0) for r, s in bounds]
    changes: list[Callable[[], Any]] = [
        lambda: None, lambda: buf.push(transition(0, 2), lane=0), lambda: buf.push(transition(2, 9), lane=1),
        lambda: buf.update(buf.get(slice(0, 1)).index, reward=np.float32(3.0)),
        lambda: buf.delete(buf.get(slice(0, 1)).index), lambda: buf.clear()]
    answers = set()
    for change in changes:
        for dev in copies:
            dev.sync()
        change()
        for dev in copies:
            for share in (0.5, 1.0):
                got = dev._behind(share)
                steps = refresh.behind(buf, dev.state, dev.bases, dev.max_lag_rows, dev.max_lag_s, share)
                assert got == steps, (change, dev.max_lag_rows, dev.max_lag_s, share)
                answers.add(got)
    assert answers == {False, True}
    for dev in copies:
        dev.close()


def test_refused_buffers_name_the_alternative(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_lag_rows"):
        DeviceReplay(make(MUJOCO, 8, name=name + "a"), "cpu", max_lag_rows=-1)
    small = make(MUJOCO, 8, name=name + "s")
    for bad in (float("nan"), "x", -1.0):
        with pytest.raises(ValueError, match=r"DeviceReplay: max_lag_s: expected seconds, a finite number >= 0"):
            DeviceReplay(small, "cpu", max_lag_s=bad)  # type: ignore[arg-type]
    for seed in (-1, "a", 1.5):
        with pytest.raises(ValueError, match=r"DeviceReplay: seed: expected an int >= 0 or None, got") as refused:
            DeviceReplay(small, "cpu", seed=seed)  # type: ignore[arg-type]
        assert isinstance(refused.value.__cause__, (TypeError, ValueError))  # numpy's own, chained
    big = make(MUJOCO, 4096, name=name + "b")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 80_000))
    with pytest.raises(sb.CapacityError, match=r"needs [\d,]+ bytes on cuda.*1,000 free of 80,000"):
        DeviceReplay(big, "cuda")


def _writer(handle: sb.BufferHandle, lane: int) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    for t in range(0, 2**24 - 4, 4):  # until the test stops it
        buf.push(transition(t, 4), lane=lane)


def _killed_writer(handle: sb.BufferHandle) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    copy_through(buf, lambda field: os.kill(os.getpid(), 9) if field == "reward" else None)
    buf.push(transition(-1000, 2), lane=0)  # killed midway through its copy: odd rows of a dead writer


@pytest.mark.slow
def test_writers_lapping_and_killed_while_the_copy_refreshes(make: Make, name: str, procs: list[Any]) -> None:
    """Two writer processes lap a small ring while the device copy syncs and samples; a third is
    killed mid-copy; a clear() comes midway: every row drawn is whole, none from before the clear."""
    buf = make(MUJOCO, 256, name=name, lanes=2)
    buf.push(transition(0, 2), lane=0)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=64, seed=8)
    ctx = mp.get_context("fork")
    k = ctx.Process(target=_killed_writer, args=(buf.handle,))
    procs.append(k)
    k.start()
    k.join(30)
    writers = [ctx.Process(target=_writer, args=(buf.handle, lane)) for lane in range(2)]
    for p in writers:
        procs.append(p)
        p.start()
    drawn = 0
    base = None
    t0 = time.monotonic()
    while drawn < 400 and time.monotonic() - t0 < 60:
        before = buf.ring.bounds()[1].copy()  # each lane's cursor
        try:
            batch = dev.sample(128)
        except sb.EmptyBufferError:
            continue
        whole(batch)
        assert not (batch.reward.numpy() < 0).any()  # the killed writer's rows are never drawn
        # never stale beyond the lag: a row drawn was in its lane's last 128 rows at most 64 inserts ago
        ids = batch.index.numpy()
        assert (ids // 2 >= before[ids % 2] - 128 - 64).all()
        if base is not None:
            lane = batch.index.numpy() % 2
            assert (batch.index.numpy() // 2 >= base[lane]).all()
        drawn += 1
        if drawn == 200 and base is None:
            buf.clear()
            base = buf.ring.bounds()[0].copy()
            dev.sync()
    assert drawn == 400 and all(p.is_alive() for p in writers)  # drawn while both wrote
    for p in writers:
        p.kill()
        p.join(10)


def test_the_loader_says_which_path_it_took(make: Make, name: str) -> None:
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 64))
    with sb.Loader(buf, 32, resident=True, batches=3) as loader:
        assert loader.path == "resident" and loader.why == ""
        got = list(loader)
    assert len(got) == 3 and all(b.obs.shape == (32, 17) for b in got)
    for b in got:
        assert np.array_equal(whole(b), b.index.numpy())
    with sb.Loader(buf, 32, batches=1) as host:
        assert host.path == "host" and "not a CUDA device" in host.why
    with sb.Loader(buf, 32, resident=False, batches=1) as host:
        assert host.path == "host" and host.why == "resident=False"
    with pytest.raises(sb.LayoutError, match=r"sample keywords.*n_step.*resident=False"):
        sb.Loader(buf, 32, resident=True, n_step=3)
    used = make(MUJOCO, 16, name=name + "f", max_use=2)
    used.push(transition(0, 16))
    with sb.Loader(used, 4, resident=True, batches=4) as loader:  # max_use served on the device too
        assert loader.path == "resident"
        drawn = np.concatenate([b.index.numpy() for b in loader])
    ids, times = np.unique(drawn, return_counts=True)
    assert times.max() <= 2 and np.array_equal(used.uses(ids), times)


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_use_on_the_device_hands_no_row_out_more_than_max_use_times(make: Make, name: str, sampler: str) -> None:
    """Each row the device sample hands out counts a use in the shared counts, a used-up row
    leaves, and once every row is used up the device sample says so at once, as the host's does."""
    buf = make(MUJOCO, 16, name=name, max_use=3, sampler=sb.Prioritized() if sampler == "prioritized" else sb.Uniform())
    buf.push(transition(0, 16))
    with DeviceReplay(buf, "cpu", refresher=False, seed=0) as dev:
        drawn = np.concatenate([dev.sample(4).index.numpy() for _ in range(12)])  # 16 rows x 3 uses
        ids, times = np.unique(drawn, return_counts=True)
        assert ids.size == 16 and (times == 3).all() and (buf.uses(ids) == 3).all()
        with pytest.raises(sb.EmptyBufferError) as host:
            buf.sample(4)
        with pytest.raises(sb.EmptyBufferError) as device:
            dev.sample(4)
        assert str(device.value) == str(host.value) and "drawn max_use=3 times" in str(host.value)


def test_a_device_sample_short_of_uses_gives_them_back_as_the_host_does(make: Make, name: str) -> None:
    """A device sample that uses up the rows before its batch is full raises as the host's does,
    and the buffer's use counts are as they were."""
    buf = make(MUJOCO, 16, name=name, max_use=1)
    buf.push(transition(0, 16))
    with DeviceReplay(buf, "cpu", refresher=False, seed=0) as dev:
        first = dev.sample(12).index.numpy()
        assert np.unique(first).size == 12
        before = buf.uses(np.arange(16))
        with pytest.raises(sb.EmptyBufferError) as host:
            buf.sample(8)
        with pytest.raises(sb.EmptyBufferError) as device:
            dev.sample(8)
        assert str(device.value) == str(host.value) and "4 draws left" in str(host.value)
        assert np.array_equal(buf.uses(np.arange(16)), before)
        assert np.unique(dev.sample(4).index.numpy()).size == 4


def test_a_device_sample_that_raises_before_counting_its_uses_gives_none_back(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A use is given back only once it was counted: a sample interrupted while it counts them
    (here the count itself raises) leaves every use count as it was, never wrapped below 0."""
    buf = make(MUJOCO, 16, name=name, max_use=3)
    buf.push(transition(0, 16))
    with DeviceReplay(buf, "cpu", refresher=False, seed=0) as dev:

        def interrupted(self: Any, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
            raise KeyboardInterrupt

        monkeypatch.setattr(reader.Uses, "claim", interrupted)
        with pytest.raises(KeyboardInterrupt):
            dev.sample(4)
        monkeypatch.undo()
        assert not buf.uses(np.arange(16)).any()
        assert len(buf) == 16 and dev.sample(4).index.shape == (4,)


def test_a_rate_limiter_holds_the_device_sample_as_it_holds_the_host_sample(make: Make, name: str) -> None:
    """Two buffers alike, one sampled on the host, one on the device copy: the same samples pass
    and wait, the same ``WaitTimeout`` says why, the same rows are counted sampled, and a waiting
    device sample goes on once a writer's push lets it."""
    limiter = sb.RateLimiter(samples_per_insert=1.0, min_size=4, error=2.0, timeout=0.05)
    host, other = (make(MUJOCO, 32, name=name + s, limiter=limiter) for s in "hd")
    for b in (host, other):
        b.push(transition(0, 2))
    with DeviceReplay(other, "cpu", refresher=False, seed=0) as dev:
        with pytest.raises(sb.WaitTimeout) as waited_host:
            host.sample(1)
        with pytest.raises(sb.WaitTimeout) as waited_dev:
            dev.sample(1)
        assert str(waited_dev.value) == str(waited_host.value) and "min_size=4" in str(waited_host.value)
        for b in (host, other):
            b.push(transition(2, 6))  # 8 inserted: diff 8, the window's floor 4 - 2
        assert len(host.sample(4)) == len(dev.sample(4)) == 4
        with pytest.raises(sb.WaitTimeout) as waited_host:
            host.sample(4, timeout=0.01)
        with pytest.raises(sb.WaitTimeout) as waited_dev:
            dev.sample(4, timeout=0.01)
        assert str(waited_dev.value) == str(waited_host.value)
        assert host.stats["sampled"] == other.stats["sampled"] == 4
        with pytest.raises(ValueError, match="sample: timeout"):
            dev.sample(4, timeout=-1.0)
        timer = threading.Timer(0.02, lambda: other.push(transition(8, 4)))
        timer.start()
        try:
            assert len(dev.sample(4, timeout=10.0)) == 4  # held until the push, then drawn
        finally:
            timer.join()
        assert other.stats["sampled"] == 8


def test_n_step_on_the_device_equals_the_host_reference(make: Make, name: str) -> None:
    """The same n-step transitions as ``sequences.add_n_step`` gives for the same ids: episodes that
    end, lanes, the write head, rows lapped since; refused as on the host without episodes."""
    from shmbuffer.sequences import add_n_step

    buf = make(MUJOCO, 64, name=name, lanes=2, episodes=True)
    t = 0
    for step in range(50):
        for lane in range(2):
            rows = transition(t, 1)
            rows["done"] = np.array([step % 7 == 6])
            buf.push(rows, lane=lane, episode=(step // 7) * 2 + lane)
            t += 1
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=9)
    got = dev.sample(500, n_step=4, gamma=0.9)
    ref = buf.take(got.index.numpy())
    add_n_step(buf, ref, 4, 0.9, None)
    for key in ("reward", "next_obs", "done", "steps", "obs", "index", "episode"):
        assert np.array_equal(got[key].numpy(), np.asarray(ref[key])), key
    assert set(got.steps.tolist()) == {1, 2, 3, 4}
    with pytest.raises(sb.FieldError, match="episode"):
        DeviceReplay(make(MUJOCO, 8, name=name + "e"), "cpu").sample(4, n_step=3)
    with pytest.raises(ValueError, match="n_step"):
        dev.sample(4, n_step=0)


# -- edge cases, each failing before its fix --------------------------------------------------
def test_a_prioritized_draw_never_pairs_an_id_with_a_newer_rows_data(make: Make, name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows accepted early in a prioritized draw whose slots the draw's own sync then refreshed
    with newer rows are drawn again, not served with the newer data."""
    buf = make(MUJOCO, 8, name=name, sampler=sb.Prioritized(alpha=1.0, beta=0.5), seed=0)
    buf.push(transition(0, 8), priority=1.0)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    buf.push(transition(8, 4), priority=4.0)  # in slots 0..3; the device copy does not hold them yet
    sampler = buf.options.sampler
    real = type(sampler).draw
    calls = [0]

    def draw(self: Any, *a: Any, **k: Any) -> Any:  # a writer elsewhere pushes between two rounds
        calls[0] += 1
        if calls[0] == 2:
            buf.push(transition(12, 4), priority=1.0)  # over slots 4..7, rows accepted in round 1
        return real(self, *a, **k)

    monkeypatch.setattr(type(sampler), "draw", draw)
    got = dev.sample(32)
    assert calls[0] > 8  # the draw's own sync ran
    assert np.array_equal(whole(got), got.index.numpy())


def test_a_clear_during_a_sync_is_never_drawn_past(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "lib", None)  # the Python steps: a clear between them
    buf = make(MUJOCO, 16, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    buf.push(transition(8, 2))
    real = dev.copy_run

    def copy(slot0: int, n0: int, k: int) -> np.ndarray:  # another process clears while the sync copies
        buf.clear()
        return real(slot0, n0, k)

    monkeypatch.setattr(dev, "copy_run", copy)
    dev.sync()
    monkeypatch.setattr(dev, "copy_run", real)
    with pytest.raises(sb.EmptyBufferError):
        dev.sample(64)  # synced again first: nothing held is left
    buf.push(transition(100, 1))
    assert set(dev.sample(64).index.tolist()) == {16}


def _killed_prioritized(handle: sb.BufferHandle) -> None:
    buf = sb.ReplayBuffer.attach(handle)
    copy_through(buf, lambda field: os.kill(os.getpid(), 9) if field == "reward" else None)
    buf.push(transition(1000, 32), priority=50.0)


def test_a_prioritized_draw_reaps_a_dead_writers_rows(make: Make, name: str, procs: list[Any]) -> None:
    """A writer killed mid-copy leaves odd rows with the leaves they took: reaped, as the host's
    sample reaps them, instead of every draw landing on them."""
    buf = make(MUJOCO, 64, name=name, sampler=sb.Prioritized(alpha=1.0, beta=0.5), seed=0)
    buf.push(transition(0, 32), priority=1.0)
    p = mp.get_context("fork").Process(target=_killed_prioritized, args=(buf.handle,))
    procs.append(p)
    p.start()
    p.join(30)
    assert p.exitcode == -9 and (buf.ring.stamp & 1).sum() == 32
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=0)
    got = dev.sample(64)
    assert np.array_equal(whole(got), got.index.numpy()) and got.index.max() < 32


def test_cleared_rows_are_not_copied_again_at_every_sync(make: Make, name: str) -> None:
    buf = make(MUJOCO, 4096, name=name)
    buf.push(transition(0, 4096))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    buf.clear()
    for t in range(3):
        buf.push(transition(5000 + t, 1))
        assert dev.sync() == 1 and len(dev) == t + 1


def test_close_while_sampling_says_closed_and_staging_fits_the_buffer(make: Make, name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make(MUJOCO, 100, name=name)
    buf.push(transition(0, 100))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=0)
    assert dev.chunk == 100 and all(t.shape[0] == 100 for t in dev._staging.values())
    monkeypatch.setattr(dev, "_maybe_sync", dev.close)  # another thread closes it mid-sample
    with pytest.raises(sb.ClosedError, match="closed"):
        dev.sample(4)


@pytest.mark.parametrize("case", range(6))
def test_frames_stored_once_are_rebuilt_on_the_device_as_take_rebuilds_them(case: int, make: Make, name: str) -> None:
    """Stacks (padded by reset or zeros, channels first or last) and next observations read from the
    lane: the same bytes as ``take()`` of the same ids; end rows and a lane's newest row never drawn."""
    from .test_frames import CASES, same, schema, stepper

    frame, k, axis, pad, next_of, stack, lanes = CASES[case]
    sch = schema(frame, k, axis)
    rng = np.random.default_rng(case)
    buf = make(sch, 40 * lanes, lanes=lanes, episodes=True, next_of=next_of, stack=stack, name=name,
               sampler=sb.Prioritized() if case % 2 else sb.Uniform(), seed=case)
    streams = stepper(rng, lanes, frame, k, axis, pad)
    dev = None
    for step in range(60):
        lane = int(rng.integers(lanes))
        chunk = [next(streams[lane]) for _ in range(int(rng.integers(1, 5)))]
        buf.push({n: np.stack([np.asarray(r[n]) for r in chunk]) for n in sch.names}, lane=lane,
                 episode=np.array([r["tag"][1] * lanes + lane for r in chunk]))
        if step == 20:
            dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=case)
    assert dev is not None
    got = dev.sample(200)
    ref = buf.take(got.index.numpy())
    assert same(got.numpy(), ref, sch.names)
    assert np.array_equal(got.episode.numpy(), ref.episode)
    with pytest.raises(sb.FieldError, match="n-step returns over frames"):
        dev.sample(4, n_step=2)


@pytest.mark.slow
def test_frames_from_writers_killed_and_a_clear_are_never_mixed_on_the_device(make: Make, name: str,
                                                                              procs: list[Any]) -> None:
    """Two writer processes push stacked episodes into a small ring, one is killed and replaced,
    a clear() comes midway: every transition the device copy serves is one episode's, whole."""
    from .test_frames import FRAME, _expected, _writer, schema

    buf = make(schema(FRAME, 4, 0), 2 * 48, lanes=2, next_of="obs", stack="obs", name=name, seed=5)
    ctx = mp.get_context("spawn")
    writers = {lane: ctx.Process(target=_writer, args=(buf.handle, lane, 0, 4.0)) for lane in (0, 1)}
    for p in writers.values():
        p.start()
        procs.append(p)
    deadline = time.monotonic() + 60
    while len(buf) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=8, seed=5)
    checked, killed, cleared = 0, False, False
    start = time.monotonic()
    while any(p.is_alive() for p in writers.values()) and time.monotonic() - start < 30:
        if not killed and time.monotonic() - start > 0.8:
            writers[0].kill()
            writers[0].join(5)
            writers[0] = ctx.Process(target=_writer, args=(buf.handle, 0, 10_000, 2.0))
            writers[0].start()
            procs.append(writers[0])
            killed = True
        if not cleared and time.monotonic() - start > 1.5:
            buf.clear()
            cleared = True
        try:
            batch = dev.sample(32).numpy()
        except sb.EmptyBufferError:
            continue
        for j in range(32):
            lane, ep, t = batch.tag[j].tolist()
            obs, nxt = _expected(lane, ep, t)
            assert np.array_equal(batch.obs[j], obs) and np.array_equal(batch.next_obs[j], nxt), (lane, ep, t)
            assert batch.action[j] == t and batch.reward[j] == t + 1
        checked += 32
    dev.close()
    assert killed and cleared and checked > 300


@pytest.mark.parametrize("time_major", [False, True])
def test_sequences_on_the_device_are_the_episodes_windows(make: Make, name: str, time_major: bool) -> None:
    """Windows of one lane and episode, masked where the episode ends or the lane's rows stop,
    burn-in included, the same rows as ``take()``; time major transposes."""
    buf = make(MUJOCO, 400, name=name, lanes=2, episodes=True)
    lengths = {0: [7, 3, 12, 5, 9], 1: [4, 11, 6]}
    first = {}  # id -> (episode, step, length)
    for lane, eps in lengths.items():
        for e, n in enumerate(eps):
            ids = buf.push(transition(1000 * lane + 50 * e, n), lane=lane, episode=10 * lane + e)
            first.update({int(i): (10 * lane + e, t, n) for t, i in enumerate(ids)})
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, seed=11)
    got = dev.sample_sequences(300, 4, burn_in=2, time_major=time_major).numpy()
    index, mask, reward = got.index, got.mask, got.reward
    if time_major:
        assert index.shape == (6, 300)
        index, mask, reward = index.T, mask.T, reward.T
    assert index.shape == (300, 6) and got.obs.shape == ((6, 300, 17) if time_major else (300, 6, 17))
    for w in range(300):
        anchor = int(index[w, 2])
        ep, t, n = first[anchor]
        steps = np.arange(t - 2, t + 4)
        assert np.array_equal(mask[w], (steps >= 0) & (steps < n)), (w, ep, t, n)
        assert (index[w][~mask[w]] == -1).all() and (reward[w][~mask[w]] == 0).all()
        held = index[w][mask[w]]
        assert np.array_equal(reward[w][mask[w]], buf.take(held).reward)
    with pytest.raises(sb.FieldError, match="episode"):
        DeviceReplay(make(MUJOCO, 8, name=name + "e"), "cpu").sample_sequences(4, 2)


def _paced_writer(handle: sb.BufferHandle, lane: int, per_s: float) -> None:
    """Push 4-row batches at a fixed rate, lapping the ring (until the test stops it)."""
    buf = sb.ReplayBuffer.attach(handle)
    t0 = time.monotonic()
    for i, t in enumerate(range(0, 2**24 - 4, 4)):
        buf.push(transition(t, 4), lane=lane)
        ahead = 4 * (i + 1) / per_s - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)


def test_the_background_refresher_keeps_rows_whole_current_and_never_cleared(
        make: Make, name: str, procs: list[Any], path: str) -> None:
    """Writers at a fixed rate lap the ring, one is killed mid-push, and a clear() comes while the
    refresher runs: every row drawn equals take() of its id when both still hold it, is whole, was
    in its lane within the row bound, and none from before the clear; the usable slots kept per
    change are exactly the held ones."""
    buf = make(MUJOCO, 512, name=name, lanes=2)
    buf.push(transition(0, 2), lane=0)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=64, max_lag_s=0.02, seed=12)
    assert dev.refreshing and dev.one_call == (path == "native")
    ctx = mp.get_context("fork")
    k = ctx.Process(target=_killed_writer, args=(buf.handle,))
    procs.append(k)
    k.start()
    k.join(30)
    writers = [ctx.Process(target=_paced_writer, args=(buf.handle, lane, 20_000.0)) for lane in range(2)]
    for p in writers:
        procs.append(p)
        p.start()
    drawn, base, t0 = 0, None, time.monotonic()
    while drawn < 300 and time.monotonic() - t0 < 60:
        before = buf.ring.bounds()[1].copy()
        try:
            batch = dev.sample(64)
        except sb.EmptyBufferError:
            continue
        whole(batch)
        ids = batch.index.numpy()
        assert not (batch.reward.numpy() < 0).any()
        assert (ids // 2 >= before[ids % 2] - 256 - 64).all()  # within a lane, 64 rows of lag at most
        live = np.flatnonzero(buf.ring.current(ids))
        with contextlib.suppress(sb.EmptyBufferError, ValueError):  # lapped meanwhile (or none left)
            ref = buf.take(ids[live])
            assert np.array_equal(batch.obs.numpy()[live], np.asarray(ref.obs))
        if base is not None:
            assert (ids // 2 >= base[ids % 2]).all()
        drawn += 1
        if drawn == 150:
            buf.clear()
            base = buf.ring.bounds()[0].copy()
        with dev.lock:
            assert set(dev.dense[:len(dev)].tolist()) == set(np.flatnonzero(dev.usable).tolist())
            assert (dev.held[dev.usable] > 0).all() and not dev.held[~dev.usable].any()
    assert drawn == 300 and all(p.is_alive() for p in writers)
    for p in writers:
        p.kill()
        p.join(10)
    dev.close()
    assert not dev.refreshing


def test_the_state_words_are_the_c_refreshs() -> None:
    """``DeviceRows.state``'s words (``protocol/refresh.py``) are ``native/native.h``'s ``ST_*``, the
    array as long as ``ST_WORDS``: the C refresh and sample read and write the same words."""
    import re
    from pathlib import Path

    from shmbuffer.protocol import refresh as rows

    header = (Path(native.__file__).parent / "native.h").read_text()
    words = {k: int(v) for k, v in re.findall(r"#define ST_(\w+) (\d+)", header)}
    assert words.pop("WORDS") == rows.STATE_WORDS
    assert words == {k: getattr(rows, k) for k in words}
    assert len(words) == 15 and max(words.values()) < rows.STATE_WORDS


def _wide_writer(handle: sb.BufferHandle) -> None:
    """Push 8-row batches into both lanes as fast as it can, each row's ``obs`` all its row number in
    its lane (until the test stops it)."""
    buf = sb.ReplayBuffer.attach(handle)
    for t in range(1, 2**30, 8):  # row 0 of each lane: the test's
        for lane in range(2):
            buf.push(obs=np.repeat(np.arange(t, t + 8, dtype=np.float32)[:, None], 4096, 1),
                     n=np.arange(t, t + 8), lane=lane)


@needs_lib
def test_a_sample_copying_a_slot_a_refresh_copies_into_draws_it_again(make: Make, name: str, procs: list[Any]) -> None:
    """The C uniform sample copies its rows outside the copy's lock: rows of 16 KiB in 64 slots,
    rewritten as fast as a writer can and refreshed every half millisecond, are each whole (``obs``
    all one number: its row number in its lane, as its id says) however often a refresh copied
    into a slot while a sample copied it out; such rows were drawn again (``state[REDRAWN]``)."""
    from shmbuffer.protocol.refresh import REDRAWN

    buf = make(sb.Schema(obs=((4096,), "float32"), n=((), "int64")), 64, name=name, lanes=2)
    buf.push(obs=np.zeros((2, 4096), np.float32), n=np.zeros(2, np.int64), lane=np.arange(2))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=0.001, seed=3)
    assert dev.refreshing and dev.one_call
    try:
        writer = mp.get_context("fork").Process(target=_wide_writer, args=(buf.handle,))
        procs.append(writer)
        writer.start()
        samples, t0 = 0, time.monotonic()
        while (samples < 300 or not dev.state[REDRAWN]) and time.monotonic() - t0 < 60:
            try:
                batch = dev.sample(32)
            except sb.EmptyBufferError:  # every slot mid-write or being copied again at that moment
                continue
            obs, n, ids = batch.obs.numpy(), batch.n.numpy(), batch.index.numpy()
            assert (obs == obs[:, :1]).all(), "a torn row: a refresh copied into its slot as the sample copied it"
            assert np.array_equal(obs[:, 0], n) and np.array_equal(n, ids // 2)
            samples += 1
        assert samples >= 300 and dev.state[REDRAWN] > 0, (samples, dev.state[REDRAWN])
    finally:
        dev.close()  # the refresher thread stops even when an assertion failed (procs kills the writer)


def test_a_refresh_copies_the_new_rows_not_every_slot(make: Make, name: str, path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows copied are the lanes' new rows (found from the cursors), in at most two runs a lane:
    every other device slot keeps what it held (a mark put there is not copied over)."""
    buf = make(MUJOCO, 128, name=name, lanes=2)
    buf.push(transition(0, 62), lane=0)
    buf.push(transition(64, 32), lane=1)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    assert dev.one_call == (path == "native")
    runs: list[tuple[int, int, int]] = []
    real = dev.copy_run
    monkeypatch.setattr(dev, "copy_run", lambda s0, n0, k: runs.append((s0, n0, k)) or real(s0, n0, k))
    for col in dev.rows.values():
        col.fill_(-1)  # a mark in every slot: only the slots refreshed lose it
    buf.push(transition(100, 5), lane=0)  # lane 0 wraps: rows 62..66, slots 62, 63 and 0..2
    buf.push(transition(200, 3), lane=1)  # rows 32..34 of lane 1, slots 96..98
    assert dev.sync() == 8
    new = [62, 63, 0, 1, 2, 96, 97, 98]
    for name_, col in dev.rows.items():
        got = col.numpy()
        assert np.array_equal(got[new], dev.columns[name_][new]), name_
        assert (np.delete(got, new, axis=0) == -1).all(), name_
    assert sorted(runs) == ([] if path == "native" else [(0, 64, 3), (62, 62, 2), (96, 32, 3)])
    runs.clear()
    assert dev.sync() == 0 and runs == []


def test_gather_run_native_equals_python(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmbuffer import native
    from shmbuffer.protocol.gather import gather_run

    buf = make(MUJOCO, 16, name=name)
    buf.push(transition(0, 16))
    buf.ring.stamp[5] += 1  # row 5 being written again: not intact
    col = buf.block.large["obs"] if "obs" in buf.block.large else buf.block.packed
    got = []
    for lib in (native.lib, None):
        monkeypatch.setattr(native, "lib", lib)
        out, ok = np.zeros((6, *col.shape[1:]), col.dtype), np.zeros(6, bool)
        got.append((gather_run(buf.ring.stamp, (col,), 2, 2, (out,), ok), out, ok))
    buf.ring.stamp[5] -= 1
    assert got[0][0] == got[1][0] == 5 and np.array_equal(got[0][2], got[1][2]) and not got[0][2][3]
    assert np.array_equal(got[0][1], got[1][1]) and np.array_equal(got[0][1], col[2:8])


def _threads() -> int:
    """Threads of this process, C threads included."""
    return len(os.listdir("/proc/self/task"))


def test_the_refresher_stops_with_close_and_before_a_fork(make: Make, name: str, path: str) -> None:
    buf = make(MUJOCO, 32, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", seed=0)
    assert dev.refreshing and dev._refresher.starts == 1
    pid = os.fork()
    if pid == 0:  # the child: no refresher, and none of the parent's threads
        os._exit(0 if not dev.refreshing and _threads() == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert dev.refreshing and dev._refresher.starts == 2  # joined before the fork, started again after it
    buf.push(transition(8, 8))
    t0 = time.monotonic()
    while dev.lag()[0] and time.monotonic() - t0 < 10:
        time.sleep(0.005)
    assert dev.lag()[0] == 0  # the refresher took them in
    before = _threads()
    dev.close()
    t0 = time.monotonic()  # a joined thread's task leaves /proc a moment after the join returns
    while _threads() != before - 1 and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert not dev.refreshing and _threads() == before - 1  # the thread ended
    dev.close()
    assert not dev.refreshing


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_forked_child_copies_the_rows_again_and_shares_no_page_with_the_parent(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The copy's host memory is not shared copy-on-write with a forked child (so the parent's
    refreshes never fault on its pages): in the child it reads as zeros and the copy holds
    nothing, and the child's first sample copies every row again; the parent's copy is as it was."""
    if path == "native" and native.lib is None:
        pytest.skip("the C extension is not built")
    buf = make(MUJOCO, 64, name=name, episodes=True)
    buf.push(transition(0, 40), episode=np.repeat(np.arange(4), 10))
    if path == "python":
        monkeypatch.setattr(native, "lib", None)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    assert len(dev) == 40 and dev.one_call == (path == "native")
    keys = ("obs", "action", "reward", "next_obs", "done", "episode")

    def same(batch: sb.Batch) -> bool:
        ref = buf.take(batch.index.numpy())
        return all(np.array_equal(batch[key].numpy(), np.asarray(ref[key])) for key in keys)

    pid = os.fork()
    if pid == 0:  # the child: report by exit code, never return into pytest
        code = 3
        try:
            wiped = len(dev) == 0 and not dev.held.any() and not any(bool(col.any()) for col in dev.rows.values())
            code = 0 if wiped and same(dev.sample(500)) and len(dev) == 40 else 2 if wiped else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # 1: not wiped, 2: wrong rows after the refresh
    assert len(dev) == 40 and same(dev.sample(200))
    dev.close()


def test_the_refresher_ends_with_its_process_and_leaves_nothing(name: str) -> None:
    import subprocess
    import sys

    code = (f"import shmbuffer as sb, numpy as np\nfrom shmbuffer.device import DeviceReplay\n"
            f"buf = sb.ReplayBuffer(sb.Schema(x=((3,), 'float32')), 64, name={name!r})\n"
            "buf.push(x=np.ones((10, 3), np.float32))\ndev = DeviceReplay(buf, 'cpu')\n"
            "assert dev.refreshing\nprint('ok', flush=True)\n")  # exits without close()
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "ok\n" and done.stderr == "", done.stderr
    assert not os.path.exists(f"/dev/shm/{name}")


@needs_lib
def test_the_one_call_refresh_equals_the_python_steps(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C refresh and the Python steps, refreshing the same buffer through pushes that wrap the
    lanes, rows being written (reserved, then abandoned), an update, a delete and a clear: the same
    rows taken in, held with the same stamps, pending, and the same device rows and episodes."""
    buf = make(MUJOCO, 128, name=name, lanes=2, episodes=True)
    one = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, chunk=8, seed=0)
    saved = native.lib
    monkeypatch.setattr(native, "lib", None)
    steps = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, chunk=8, seed=0)
    monkeypatch.setattr(native, "lib", saved)
    assert one.one_call and not steps.one_call
    rng = np.random.default_rng(0)
    t, res = 0, None
    for step in range(40):
        lane = step % 2
        k = int(rng.integers(1, 12))
        ids = buf.push(transition(t, k), lane=lane, episode=np.full(k, step // 5))
        t += k
        if step == 8:
            res = buf.ring.reserve(3, 1, deferring=False)  # odd rows: pending on both
        if step == 12 and res is not None:
            buf.ring.abandon(res)
        if step == 20:
            buf.update(ids[:2], reward=np.float32(-5.0))
        if step == 25:
            buf.delete(ids[-1:])
        if step == 30:
            buf.clear()
        assert one.sync() == steps.sync(), step
        usable = np.flatnonzero(one.usable)
        assert np.array_equal(usable, np.flatnonzero(steps.usable)), step
        assert np.array_equal(one.held, steps.held) and len(one) == len(steps) == usable.size == np.count_nonzero(one.held)
        assert sorted(one.dense[:len(one)].tolist()) == usable.tolist()
        assert sorted(one.pending.tolist()) == sorted(steps.pending.tolist()), step
        for key, col in one.rows.items():
            assert np.array_equal(col.numpy()[usable], steps.rows[key].numpy()[usable]), (step, key)
            assert np.array_equal(col.numpy()[usable], one.columns[key][usable]), (step, key)
        assert np.array_equal(one.episodes[usable], steps.episodes[usable])
    assert one.pending.size == 0 and len(one) == len(buf)
    one.close()
    steps.close()


def test_a_sample_behind_the_bound_waits_for_the_refresh_under_way_not_for_another(make: Make, name: str) -> None:
    """A sample that finds the bound broken while a refresh runs waits for that refresh and looks
    again: it does not copy again the rows that refresh took in."""
    import threading

    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 8))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    real = dev._refresh
    calls: list[int] = []
    started = threading.Event()

    def slow() -> int:
        calls.append(1)
        started.set()
        time.sleep(0.3)  # the sample arrives meanwhile
        return real()

    dev._refresh = slow  # type: ignore[method-assign]
    buf.push(transition(8, 8))
    other = threading.Thread(target=dev.sync)
    other.start()
    started.wait(10)
    got = dev.sample(200)
    other.join()
    assert set(seq_of(got)) == set(range(16)) and len(calls) == 1


def test_a_full_refresh_keeps_serving_the_rows_it_has_not_copied_again(make: Make, name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After more in-place changes than the log of edits holds every row is copied again, a piece
    at a time: meanwhile a sample (another thread) draws whole rows from all but the piece being
    copied, instead of finding the copy empty."""
    import threading

    monkeypatch.setattr(native, "lib", None)  # the Python steps: a sample between two pieces
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 64))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, chunk=8, seed=0)
    for _ in range(EDIT_LOG // 64 + 1):  # the same values, past what the log holds: only a full copy follows
        buf.update(np.arange(64), reward=np.arange(64, dtype=np.float32))
    real = dev.copy_run
    seen: list[tuple[int, np.ndarray]] = []

    def copy(slot0: int, n0: int, k: int) -> np.ndarray:
        if slot0 == 24:  # the fourth piece: slots 24..31 dropped, the others held
            t = threading.Thread(target=lambda: seen.append((len(dev), dev.sample(500).index.numpy())))
            t.start()
            t.join(10)
        return real(slot0, n0, k)

    monkeypatch.setattr(dev, "copy_run", copy)
    assert dev.sync() == 64
    (held, ids), = seen
    assert held == 56 and set(ids.tolist()) == set(range(64)) - set(range(24, 32))
    assert len(dev) == 64


@pytest.mark.parametrize("path", ["native", "python"])
def test_an_edit_is_copied_again_alone(make: Make, name: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A refresh after an ``update()`` copies the rows it changed, not every row; after a
    ``delete()`` it drops the rows deleted; after more edits than the log holds it copies every
    row; the rows always equal ``take()``'s."""
    if path == "native" and native.lib is None:
        pytest.skip("the C extension is not built")
    if path == "python":
        monkeypatch.setattr(native, "lib", None)
    buf = make(MUJOCO, 2048, name=name, lanes=2)
    for lane in range(2):
        buf.push(transition(np.arange(lane * 1024, lane * 1024 + 1000)), lane=lane)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, seed=0)
    assert len(dev) == 2000 and dev.one_call == (path == "native")
    ids = buf.get(slice(None)).index
    buf.update(ids[[3, 1500]], reward=np.float32(-7.0))
    assert dev.sync() == 2  # the two rows, not 2,000

    def check() -> np.ndarray:
        batch = dev.sample(4000)
        ref = buf.take(batch.index.numpy())
        for key in ("obs", "action", "reward", "next_obs", "done"):
            assert np.array_equal(batch[key].numpy(), np.asarray(ref[key])), key
        return batch.index.numpy()

    assert (check() == ids[3]).any()
    buf.delete(ids[[10, 11]])
    assert dev.sync() == 0 and len(dev) == 1998 and not np.isin(check(), ids[[10, 11]]).any()
    for _ in range(2):
        buf.update(ids[20:21 + EDIT_LOG // 2], reward=np.float32(1.0))  # more than the log holds since the last refresh
    assert dev.sync() == 1998  # every row again
    check()
    dev.close()


def test_a_row_edited_during_a_refresh_is_held_only_once_the_edit_is_read(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An update that runs while a refresh copies the rows keeps the stamps it found, so the copy's
    stamp check cannot see it: the log of edits, read again after the copies, keeps its row from
    being held, and the next refresh copies it."""
    monkeypatch.setattr(native, "lib", None)  # the Python steps: an update between the copy and the hold
    buf = make(MUJOCO, 64, name=name)
    buf.push(transition(0, 32))
    dev = DeviceReplay(buf, "cpu", max_lag_rows=None, max_lag_s=None, refresher=False, chunk=16, seed=0)
    buf.push(transition(32, 16))
    real = dev.copy_run

    def copy(slot0: int, n0: int, k: int) -> np.ndarray:
        ok = real(slot0, n0, k)
        buf.update(buf.get(slice(33, 34)).index, reward=np.float32(-1.0))  # after the copies, before the hold
        return ok

    monkeypatch.setattr(dev, "copy_run", copy)
    assert dev.sync() == 15 and not dev.usable[33] and dev.pending.tolist() == [33]
    monkeypatch.setattr(dev, "copy_run", real)
    assert dev.sync() == 1 and dev.usable[33]
    assert dev.rows["_record"].numpy()[33].tobytes() == buf.block.packed[33].tobytes()
    dev.close()


def test_a_kept_transition_whose_older_frames_a_refresh_midway_lapped_is_drawn_again(
        make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host draw (prioritized) over frames stored once keeps the transitions the copy holds and
    refreshes for the rows it lacks; a writer meanwhile laps the older frames of some kept ones'
    stacks (their own row stays): those are drawn again, not served from overwritten frames."""
    from .test_frames import episode, same, schema

    frame, k = (1, 4, 4), 4
    sch = schema(frame, k, 0)
    steps = iter(episode(0, 0, 100, "terminated", frame, k, 0, "zero"))

    def push(m: int) -> np.ndarray:
        rows = [next(steps) for _ in range(m)]
        return buf.push({n: np.stack([np.asarray(r[n]) for r in rows]) for n in sch.names}, episode=np.zeros(m, int))

    buf = make(sch, 40, episodes=True, next_of="obs", stack="obs", sampler=sb.Prioritized(), name=name, seed=0)
    ids = push(30)
    dev = DeviceReplay(buf, "cpu", max_lag_rows=0, refresher=False, seed=0)
    ids = np.concatenate([ids, push(9)])  # rows the copy lacks: the draw refreshes for them
    # drawn: now and then rows 12-14 (the copy holds them and their stacks' rows 9-11), mostly rows it lacks
    buf.update_priorities(ids, np.where(ids >= 30, 1.0, np.where(np.isin(ids, [12, 13, 14]), 0.15, 1e-9)))
    monkeypatch.setattr(dev, "_maybe_sync", lambda: None)
    real_sync, pushed = dev.sync, []

    def writer_then_sync() -> int:
        if not pushed:  # a writer meanwhile: laps rows 0-11, which the refresh copies over
            pushed.append(push(12))
        return real_sync()

    monkeypatch.setattr(dev, "sync", writer_then_sync)
    got = dev.sample(16)
    assert pushed and np.isin(got.index.numpy(), [12, 13, 14]).any()  # kept ones whose stacks stayed whole
    assert same(got.numpy(), buf.take(got.index.numpy()), sch.names)
    dev.close()
