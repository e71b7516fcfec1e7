"""The loader: batches sampled ahead in a thread, on the CPU here and through pinned staging
memory on CUDA. The CUDA tests run only where a GPU is present; the CPU half of the CUDA path
(staging, slot reuse, the hand-over to the consumer's stream) is also driven here on the CPU,
with stand-ins for ``torch.cuda``'s streams and events."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import shmbuffer as sb
import shmbuffer.loader as loader_module
from shmbuffer.loader import SLICE, Loader

from .conftest import MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
IMAGES = sb.Schema(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"))
"""A large field (its own column) and two small ones (the packed record)."""


def images(buf: sb.ReplayBuffer) -> sb.ReplayBuffer:
    """Row ``i`` holds ``i`` in every field."""
    for i in range(buf.capacity):
        buf.push(obs=np.full((4, 84, 84), i, np.uint8), action=i, reward=float(i))
    return buf


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception, failing the test if it takes longer than ``seconds``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("background", [True, False])
def test_cpu_batches(background: bool, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    with Loader(buf, 32, prefetch=3, batches=10, background=background) as loader:
        got = list(loader)
    assert len(got) == 10
    for batch in got:
        assert isinstance(batch.obs, torch.Tensor) and batch.obs.shape == (32, 17)
        seq_of(batch.numpy())
    assert buf.stats["sampled"] >= 320


def test_sample_kwargs_and_priority_feedback(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, sampler=sb.Prioritized(alpha=1.0, eps=0.0))
    buf.push(transition(0, 16))
    with Loader(buf, 16, replace=False, batches=1) as loader:
        batch = next(iter(loader))
        assert sorted(batch.index.tolist()) == list(range(16)) and batch.weight.dtype == torch.float32
        prios = (batch.index == 3).double()
        assert loader.update_priorities(batch, prios) == 16
    assert set(buf.sample(50).index) == {3}


def test_custom_sampler(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=40, episodes=True, name=name)
    buf.push(transition(0, 40), episode=np.repeat(np.arange(4), 10))
    with Loader(buf, sample=lambda b: b.sample_sequences(4, 5), batches=2) as loader:
        got = list(loader)
    assert len(got) == 2  # the assertions below run on every batch, and batches do come
    for batch in got:
        assert batch.obs.shape == (4, 5, 17) and batch.mask.dtype == torch.bool


def test_an_error_in_the_thread_reaches_the_learner(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)  # empty: sampling raises
    loader = Loader(buf, 4, background=True)
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        next(loader)
    loader.close()
    assert not loader._thread.is_alive()


def test_close_stops_the_thread(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    loader = Loader(buf, 8, prefetch=2, background=True)
    next(loader)
    assert loader._thread.is_alive()
    loader.close()
    loader.close()
    assert not loader._thread.is_alive()


def test_on_the_cpu_batches_are_sampled_in_the_callers_thread(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    with Loader(buf, 8, batches=3) as loader:
        got = list(loader)
        assert not loader._thread.is_alive() and len(got) == 3
    assert buf.stats["sampled"] == 24  # nothing sampled ahead


def test_gather_into_given_memory(make: Make, name: str) -> None:
    """The pinned-staging path's gather (``sample(out=)``), checked on plain host memory."""
    buf = make(sb.Schema(img=((2000,), "uint8"), r=((), "float32")), capacity=50, name=name, seed=0)
    for i in range(50):
        buf.push(img=np.full(2000, i, np.uint8), r=float(i))
    out = {"_block": np.empty((16, buf.schema.record.itemsize), np.uint8), "img": np.empty((16, 2000), np.uint8)}
    batch = buf.sample(16, out=out)
    assert np.shares_memory(batch.img, out["img"]) and np.shares_memory(batch.r, out["_block"])
    assert np.array_equal(batch.img[:, 0], batch.r.astype(np.uint8)) and np.array_equal(batch.r, batch.index)


def test_cpu_device_is_refused_for_cuda_without_gpu(make: Make, name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available"):
        Loader(buf, 4, device="cuda")


@pytest.mark.parametrize("background", [True, False])
def test_next_after_the_end_does_not_hang(background: bool, make: Make, name: str) -> None:
    """After the last batch, close() or an error, next() answers at once, again."""
    buf = make(MUJOCO, capacity=64, name=name)
    buf.push(transition(0, 32))
    loader = Loader(buf, 4, batches=2, background=background)
    assert len(within(10, lambda: list(loader))) == 2
    assert within(3, lambda: list(loader)) == []  # a second pass is empty, not stuck
    with pytest.raises(StopIteration):
        within(3, lambda: next(loader))
    endless = Loader(buf, 4, background=background)
    seq_of(next(endless).numpy())
    endless.close()
    with pytest.raises(StopIteration):
        within(3, lambda: next(endless))
    assert within(3, lambda: list(endless)) == [] and not endless._thread.is_alive()
    empty = make(MUJOCO, capacity=8, name=name + "e")
    failing = Loader(empty, 4, background=background)
    with pytest.raises(sb.EmptyBufferError, match="empty") as first:
        within(10, lambda: next(failing))
    for _ in range(2):
        with pytest.raises(sb.EmptyBufferError) as again:
            within(3, lambda: next(failing))
        assert again.value is first.value
        failing.close()


@pytest.mark.parametrize("prefetch", [1, 3])
def test_the_thread_hands_over_every_batch_once_in_order(prefetch: int, make: Make, name: str) -> None:
    """The hand-off between the thread and the learner (a deque and two wake tokens) loses,
    repeats and reorders nothing, whichever side waits for the other."""
    buf = make(MUJOCO, capacity=600, name=name)
    buf.push(transition(0, 600))
    made = itertools.count()

    def sample(b: sb.ReplayBuffer) -> sb.Batch:
        i = next(made)
        if i % 7 == 0:
            time.sleep(0.002)  # the learner waits for the thread now and then
        return b.get(np.array([i]))

    seen = []
    with Loader(buf, 1, prefetch=prefetch, sample=sample, batches=600, background=True) as loader:
        for k, batch in enumerate(loader):
            seen.extend(seq_of(batch.numpy()).tolist())
            if k % 5 == 0:
                time.sleep(0.001)  # and the thread waits for the learner
    assert seen == list(range(600))


def test_close_wakes_the_thread_and_a_waiting_learner(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() wakes both sides of the hand-off at once, not at their next look (``POLL``): the
    thread waiting for room, and a learner waiting in ``next()`` for a batch."""
    monkeypatch.setattr(loader_module, "POLL", 60.0)
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    full = Loader(buf, 4, prefetch=1, background=True)
    within(10, lambda: next(full))
    assert within(10, lambda: _until(lambda: len(full._queue.items) == 1))  # the thread waits for room
    within(5, full.close)  # without the wake, close() would wait JOIN seconds for the thread
    assert not full._thread.is_alive()

    go = threading.Event()

    def slow(b: sb.ReplayBuffer) -> sb.Batch:
        go.wait(10)
        return b.sample(4)

    stuck = Loader(buf, sample=slow, background=True)
    waiting = threading.Thread(target=lambda: list(stuck), daemon=True)
    waiting.start()
    time.sleep(0.2)  # the learner waits in next() for the first batch
    closer = threading.Thread(target=stuck.close, daemon=True)
    closer.start()
    time.sleep(0.2)
    go.set()  # the thread's sample returns; close() can join it
    waiting.join(8)  # without the wake, the learner would wait POLL seconds for a batch that never comes
    assert not waiting.is_alive() and not stuck._thread.is_alive()
    closer.join(5)


def _until(cond: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("resident", [False, True])
def test_close_while_a_rate_limiter_holds_the_sample(resident: bool, make: Make, name: str) -> None:
    """close() returns at once with the thread joined, and the thread admits no sample after it:
    nobody would receive it, yet it would count in the shared window. The same from a device
    copy (``resident=True``), whose sample the limiter holds as it holds the buffer's."""
    limiter = sb.RateLimiter(min_size=20, timeout=30.0)
    buf = make(MUJOCO, capacity=64, limiter=limiter, name=name)
    buf.push(transition(0, 10))
    loader = Loader(buf, 4, background=True, resident=resident)
    assert loader.path == ("resident" if resident else "host")
    time.sleep(0.3)  # the thread is waiting for min_size
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 2 * SLICE + 1.0 and not loader._thread.is_alive()
    buf.push(transition(10, 10))  # min_size reached
    time.sleep(0.5)
    assert buf.stats["sampled"] == 0
    with pytest.raises(StopIteration):
        next(loader)


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("where", ["sample_kwargs", "limiter"])
def test_a_sliced_sample_keeps_its_timeout(where: str, background: bool, make: Make, name: str) -> None:
    """The slices add up to the timeout given to the loader, or else to the limiter's."""
    limiter = sb.RateLimiter(min_size=20, timeout=0.8 if where == "limiter" else 30.0)
    buf = make(MUJOCO, capacity=64, limiter=limiter, name=name)
    buf.push(transition(0, 10))
    kwargs = {"timeout": 0.8} if where == "sample_kwargs" else {}
    with Loader(buf, 4, background=background, **kwargs) as loader:
        t0 = time.monotonic()
        with pytest.raises(sb.WaitTimeout, match=r"no batch of 4 rows after 0\.8 s; the last try: .*rate limiter"):
            within(10, lambda: next(loader))
        assert 0.5 < time.monotonic() - t0 < 5  # the whole timeout, not one slice
    assert buf.stats["sampled"] == 0


@pytest.mark.parametrize("background", [True, False])
def test_a_sliced_sample_gets_its_batch_when_the_limiter_opens(background: bool, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, limiter=sb.RateLimiter(min_size=20, timeout=30.0), name=name)
    buf.push(transition(0, 10))
    late = threading.Timer(10 * SLICE, lambda: buf.push(transition(10, 10)))
    late.start()
    try:
        with Loader(buf, 4, batches=1, background=background) as loader:
            got = within(20, lambda: list(loader))
    finally:
        late.join()
    assert len(got) == 1 and len(seq_of(got[0].numpy())) == 4 and buf.stats["sampled"] == 4


# -- the CPU half of the CUDA path, with stand-ins for torch.cuda's streams and events ----------------
class FakeEvent:
    """Logs its record and its synchronize: a staging slot may be refilled only after the copy that
    read it, i.e. after its event was synchronized."""

    count = itertools.count()

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log, self.id = log, next(self.count)

    def record(self, stream: Any) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("sync", self.id))


class FakeStream:
    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", event.id))


def on_fake_cuda(loader: Loader, log: list[tuple[str, int]]) -> Loader:
    """Turn a finished CPU loader into one whose ``_to_device`` runs the CUDA path's host side:
    the "device" is the CPU, so a device tensor is its pinned staging tensor."""
    within(10, loader.close)
    stream = FakeStream(log)
    fake_cuda = types.SimpleNamespace(
        Stream=lambda *a: stream, Event=lambda: FakeEvent(log), stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda device=None: stream,
    )
    loader._torch = types.SimpleNamespace(
        cuda=fake_cuda, from_numpy=torch.from_numpy,
        empty=lambda *a, pin_memory=False, **k: torch.empty(*a, **k),
    )
    loader.cuda, loader._stream = True, stream
    return loader


def spy_on(buf: sb.ReplayBuffer, log: list[tuple[str, int]], drawn: list[np.ndarray]) -> None:
    """Log each ``buf.sample`` and keep each batch's ids. An attribute of the instance: the loader
    still sees a ReplayBuffer and keeps its default path (the gather into staging memory)."""
    real = buf.sample

    def sample(n: int, **kwargs: Any) -> sb.Batch:
        log.append(("sample", len(drawn)))
        batch = real(n, **kwargs)
        drawn.append(np.array(batch.index))
        return batch

    buf.sample = sample  # type: ignore[method-assign]


@pytest.mark.parametrize("path", ["default", "custom"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_staging_slots_are_refilled_only_after_their_copy(prefetch: int, path: str, make: Make, name: str) -> None:
    buf = images(make(IMAGES, capacity=64, name=name, seed=0))
    log: list[tuple[str, int]] = []
    drawn: list[np.ndarray] = []
    if path == "custom":
        def numbered(b: sb.ReplayBuffer) -> sb.Batch:  # batch k holds row k in every row
            log.append(("sample", len(drawn)))
            drawn.append(np.full(16, len(drawn)))
            return b.take(drawn[-1])

        loader = Loader(buf, 16, prefetch=prefetch, batches=0, sample=numbered)
    else:
        loader = Loader(buf, 16, prefetch=prefetch, batches=0)
    on_fake_cuda(loader, log)
    if path == "default":
        spy_on(buf, log, drawn)
    slots = prefetch + 2
    events = []
    for k in range(4 * slots):
        got = loader._to_device(k)
        assert got is not None
        batch, event = got
        events.append(event.id)
        ids = drawn[k]  # the batch's contents, read at once: the next use of its slot overwrites them
        assert np.array_equal(batch.index.numpy(), ids) and np.array_equal(batch.action.numpy(), ids)
        assert np.array_equal(batch.reward.numpy(), ids) and (batch.obs.numpy() == ids[:, None, None, None]).all()
        assert batch.obs.dtype == torch.uint8 and batch.action.dtype == torch.int64
        if k >= slots:  # refilling the slot of batch k - slots: only after that copy completed
            assert log.index(("sync", events[k - slots])) < log.index(("sample", k))
            if path == "default":  # gathered straight into the slot's pinned memory
                stage = loader._staging[k % slots]
                assert batch.obs.data_ptr() == stage.pinned["obs"].data_ptr()
    assert len(loader._staging) == slots


def test_the_consumer_stream_waits_then_marks_every_tensor(make: Make, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_stream`` on every device tensor of a batch, after the consumer's stream waits for
    the copy: without it the caching allocator could give a dropped batch's memory to the next
    copy while the consumer's kernels still read it."""
    buf = images(make(IMAGES, capacity=64, name=name, seed=0))
    log: list[tuple[str, int]] = []
    loader = on_fake_cuda(Loader(buf, 8, batches=0, n_step=1), log)
    got = loader._to_device(0)
    assert got is not None
    batch, event = got
    marked: list[int] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: marked.append(id(t)) or log.append(("mark", 0)))
    assert loader._receive(batch, event) is batch
    assert log[-len(marked) - 1] == ("wait", event.id)
    assert sorted(marked) == sorted(id(t) for t in (*batch.fields.values(), *batch.extras.values()))
    assert sorted(batch.extras) == ["index"] and len(marked) == 4


def test_staging_is_made_for_the_first_batchs_keys(make: Make, name: str) -> None:
    """A later batch with other keys or shapes is refused by name, never a KeyError or a key
    silently dropped."""
    buf = images(make(IMAGES, capacity=64, name=name, seed=0))
    plan: Iterator[sb.Batch] = iter([])

    def planned(b: sb.ReplayBuffer) -> sb.Batch:
        return next(plan)

    def with_weight(n: int, dtype: Any = np.float32) -> sb.Batch:
        batch = buf.take(np.arange(n))
        batch.extras["weight"] = np.ones(n, dtype)
        return batch

    cases = [
        (buf.take(np.arange(8)), r"lacks extra 'weight'"),
        (with_weight(8, np.float64), r"extra 'weight': expected shape \(8,\) float32, got \(8,\) float64"),
        (with_weight(4), r"field 'obs': expected shape \(8, 4, 84, 84\) uint8, got \(4, 4, 84, 84\) uint8"),
    ]
    for later, why in cases:
        plan = iter([with_weight(8), with_weight(8), later])
        loader = on_fake_cuda(Loader(buf, 8, batches=0, sample=planned), [])
        for k in range(2):
            got = loader._to_device(k)
            assert got is not None and sorted(got[0].extras) == ["index", "weight"]
        with pytest.raises(sb.FieldError, match=r"Loader: batch 2 does not match the first batch \(.*" + why):
            loader._to_device(2)
    plan = iter([buf.take(np.arange(8)), with_weight(8)])
    loader = on_fake_cuda(Loader(buf, 8, batches=0, sample=planned), [])
    loader._to_device(0)
    with pytest.raises(sb.FieldError, match="has extra 'weight', which the first batch had not"):
        loader._to_device(1)


def test_sequence_windows_on_the_cuda_path(make: Make, name: str) -> None:
    """(n, T) windows: the packed rows travel flattened and come back as (n, T) views; large
    fields and the mask keep their shapes. Each device batch holds its own host batch's rows."""
    schema = sb.Schema(frame=((2000,), "uint8"), r=((), "float32"))  # a large field and a small one
    buf = make(schema, capacity=60, episodes=True, name=name, seed=0)
    for i in range(60):
        buf.push(frame=np.full(2000, i, np.uint8), r=float(i), episode=i // 12)
    host: list[sb.Batch] = []

    def windows(b: sb.ReplayBuffer) -> sb.Batch:
        host.append(b.sample_sequences(4, 5))
        return host[-1]

    loader = on_fake_cuda(Loader(buf, sample=windows, batches=0), [])
    for k in range(8):
        got = loader._to_device(k)
        assert got is not None
        batch = got[0]
        assert batch.frame.shape == (4, 5, 2000) and batch.r.shape == (4, 5) and batch.mask.shape == (4, 5)
        for key in ("frame", "r", "mask", "index"):
            assert np.array_equal(batch[key].numpy(), host[k][key]), key


def test_a_mix_on_the_cuda_path_keeps_weight(make: Make, name: str) -> None:
    """r13: the prioritized source's share is 0 rows in some batches; every device batch still
    has every key, with the rows of its own host batch."""
    agent = make(MUJOCO, capacity=64, name=name + "a", seed=0)
    expert = make(MUJOCO, capacity=64, name=name + "e", sampler=sb.Prioritized(), seed=1)
    agent.push(transition(0, 32))
    expert.push(transition(1000, 32))
    mix = sb.Mix([(agent, 0.9), (expert, 0.1)])
    host: list[sb.Batch] = []

    def sample(m: sb.Mix) -> sb.Batch:
        host.append(m.sample(8))
        return host[-1]

    loader = on_fake_cuda(Loader(mix, 8, batches=0, sample=sample), [])
    for k in range(24):
        got = loader._to_device(k)
        assert got is not None
        batch = got[0]
        assert sorted(batch.extras) == ["index", "source", "weight"]
        for key in ("index", "source", "weight"):
            assert np.array_equal(batch[key].numpy(), host[k][key])
        assert np.array_equal(seq_of(batch.numpy()), seq_of(host[k]))
    assert any((b.source == 0).all() for b in host)


# -- CUDA -----------------------------------------------------------------------------------------------
LAG = 20_000_000
"""GPU clock cycles a stream is kept busy (``torch.cuda._sleep``): about 10-20 ms."""


@cuda
@pytest.mark.parametrize("path", ["default", "custom"])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_cuda_batches_arrive_in_order_with_their_own_rows(prefetch: int, path: str, make: Make, name: str) -> None:
    """Each batch holds the rows sampled for it, in order. The loader's stream is held back before
    every copy, so a staging slot refilled before its copy ran would hand over a later batch's rows
    (whole rows, so a check of one field against another could not see it). The consumer only
    queues work and checks at the end, as a learner does."""
    buf = images(make(IMAGES, capacity=64, name=name, seed=0))
    drawn: list[np.ndarray] = []
    box: list[Loader] = []

    def lag() -> None:  # in the loader's thread, before the batch's copy is queued
        if box:
            with torch.cuda.stream(box[0]._stream):
                torch.cuda._sleep(LAG)

    if path == "custom":
        def numbered(b: sb.ReplayBuffer) -> sb.Batch:  # batch k: row k, 32 times
            lag()
            drawn.append(np.full(32, len(drawn)))
            return b.take(drawn[-1])

        loader = Loader(buf, 32, device="cuda", prefetch=prefetch, batches=20, sample=numbered)
    else:
        real = buf.sample

        def spied(n: int, **kwargs: Any) -> sb.Batch:
            lag()
            batch = real(n, **kwargs)
            drawn.append(np.array(batch.index))
            return batch

        buf.sample = spied  # type: ignore[method-assign]  # still a ReplayBuffer: the default path
        loader = Loader(buf, 32, device="cuda", prefetch=prefetch, batches=20)
    seen = []
    with loader:
        box.append(loader)
        for batch in loader:
            assert batch.obs.is_cuda and batch.action.is_cuda and batch.index.is_cuda
            # on the consumer's stream, after its wait for the copy; the batch is dropped next round
            seen.append(torch.stack([batch.obs.amin(dim=(1, 2, 3)).long(), batch.obs.amax(dim=(1, 2, 3)).long(),
                                     batch.action, batch.reward.long(), batch.index]))
    torch.cuda.synchronize()
    assert len(seen) == 20 and len(drawn) == 20
    for k, got in enumerate(seen):
        assert (got.cpu().numpy() == drawn[k]).all(), f"batch {k} holds other rows"


@cuda
def test_cuda_batches_dropped_early_are_not_reused_while_read(make: Make, name: str) -> None:
    """The consumer's stream is busy when it reads each batch; the batch is dropped at once and
    device memory is allocated on the loader's stream, where the batch's memory goes back. Without
    ``record_stream`` the caching allocator hands that memory out (and it is overwritten) before
    the consumer's read runs."""
    buf = images(make(IMAGES, capacity=64, name=name, seed=0))
    counter = itertools.count()
    with Loader(buf, 32, device="cuda", prefetch=2, batches=12,
                sample=lambda b: b.take(np.full(32, next(counter)))) as loader:
        seen = []
        for _ in range(12):
            batch = next(loader)
            torch.cuda._sleep(LAG * 2)  # the consumer's stream: its reads below run after this
            seen.append(torch.stack([batch.obs.amin(dim=(1, 2, 3)).long(), batch.obs.amax(dim=(1, 2, 3)).long(),
                                     batch.action, batch.reward.long(), batch.index]))
            like = [(t.shape, t.dtype) for t in (batch.block, *batch.fields.values(), *batch.extras.values())]
            del batch
            with torch.cuda.stream(loader._stream):  # runs now: this stream is idle
                junk = [torch.full(shape, 255 if dtype == torch.uint8 else -1, dtype=dtype, device="cuda")
                        for shape, dtype in like]
            del junk
    torch.cuda.synchronize()
    assert len(seen) == 12
    for k, got in enumerate(seen):
        assert (got.cpu() == k).all(), f"batch {k} was overwritten while the consumer read it"


@cuda
def test_cuda_loader_over_a_mix_keeps_weight(make: Make, name: str) -> None:
    agent = make(MUJOCO, capacity=64, name=name + "a", seed=0)
    expert = make(MUJOCO, capacity=64, name=name + "e", sampler=sb.Prioritized(), seed=1)
    agent.push(transition(0, 32))
    expert.push(transition(1000, 32))
    with Loader(sb.Mix([(agent, 0.9), (expert, 0.1)]), 8, device="cuda", batches=24) as loader:
        got = [batch.numpy() for batch in loader]
    assert len(got) == 24 and any((b.source == 0).all() for b in got)
    for b in got:
        assert b.weight.shape == (8,) and (b.weight[b.source == 0] == 1).all()
        assert np.array_equal(seq_of(b) >= 1000, b.source == 1)


@cuda
def test_cuda_batches_stay_valid_while_referenced(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=128, name=name)
    buf.push(transition(0, 128))
    with Loader(buf, 64, device="cuda", prefetch=2, batches=12) as loader:
        kept = list(loader)
    torch.cuda.synchronize()
    for batch in kept:
        seq_of(batch.numpy())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4", None])
def test_a_batch_size_that_is_not_a_row_count_is_refused(bad: Any, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 16))
    with pytest.raises(ValueError, match=r"Loader: batch_size: expected a positive number of rows, got"):
        Loader(buf, bad)
    assert buf.stats["sampled"] == 0


def test_sample_keywords_are_checked_when_the_loader_is_made(make: Make, name: str) -> None:
    """A mistyped keyword (``sample_kwargs=``), one ``sample=`` would never see, and a timeout that
    is not seconds are refused by the constructor, not at the first batch."""
    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 16))
    with pytest.raises(TypeError, match=r"Loader\(\) got an unexpected keyword argument 'sample_kwargs'"):
        Loader(buf, 4, sample_kwargs={"replace": False})
    with pytest.raises(TypeError, match=r"the keywords \['n_step'\] go to buffer.sample, which sample= replaces"):
        Loader(buf, 4, sample=lambda b: b.sample(4), n_step=3)
    with pytest.raises(ValueError, match="Loader: timeout: expected seconds"):
        Loader(buf, 4, timeout=float("nan"))
    assert buf.stats["sampled"] == 0
    with Loader(buf, 4, replace=False, timeout=1, batches=1) as loader:  # sample's own keywords pass
        assert len(next(iter(loader)).index.unique()) == 4
@pytest.mark.parametrize("background", [False, True])
def test_jax_batches_share_the_sampled_memory(background: bool, make: Make, name: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    jax = pytest.importorskip("jax")
    buf = images(make(IMAGES, capacity=32, name=name, seed=0))
    sampled: list[int] = []
    to_jax = sb.Batch.to_jax

    def spy(batch: sb.Batch, device: Any = None) -> sb.Batch:
        sampled.append(batch.obs.ctypes.data)  # where the sample gathered the large field
        return to_jax(batch, device)

    monkeypatch.setattr(sb.Batch, "to_jax", spy)
    with Loader(buf, batch_size=8, framework="jax", batches=3, background=background) as loader:
        got = list(loader)
    assert [b.obs.unsafe_buffer_pointer() for b in got] == sampled  # JAX reads the gathered memory
    assert len(got) == 3 and loader.path == "host"
    for batch in got:
        assert isinstance(batch.obs, jax.Array) and batch.obs.devices() == {jax.devices("cpu")[0]}
        rows = np.asarray(batch.index)
        assert np.array_equal(np.asarray(batch.obs)[:, 0, 0, 0], rows % 256)  # row i holds i
        assert np.array_equal(np.asarray(batch.reward), rows.astype(np.float32))
    assert len({b.obs.unsafe_buffer_pointer() for b in got}) == 3  # fresh memory per batch: none overwritten


def test_jax_loader_refuses_what_it_cannot_do(make: Make, name: str) -> None:
    buf = images(make(IMAGES, capacity=8, name=name, seed=0))
    with pytest.raises(ValueError, match="expected 'torch' or 'jax'"):
        Loader(buf, framework="flax")
    pytest.importorskip("jax")
    with pytest.raises(ValueError, match="resident=True"):
        Loader(buf, framework="jax", resident=True)
