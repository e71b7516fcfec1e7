"""Several learners on one buffer (``attach(..., rank=, world_size=, seed=)``, sampling/ranks.py): the
ranks' batches at a step, joined in rank order, are one process's batch at that step (uniform,
prioritized, distinct rows, epochs); prioritized draws are one stratified global draw; updates,
``max_use`` and the rate limiter count every rank; a rank killed mid-sample leaves the others."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from scipy import stats

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.errors import EmptyBufferError
from shmbuffer.sampling import ranks
from shmbuffer.sampling.samplers import Prioritized, Uniform

SCHEMA = sb.Schema(x=((3,), "float32"), r=((), "float32"))
CTX = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _filled(make: Any, name: str, rows: int = 600, lanes: int = 2, **kw: Any) -> sb.ReplayBuffer:
    buf = make(SCHEMA, rows, name=name, lanes=lanes, **kw)
    per = rows // lanes
    for lane in range(lanes):
        x = np.arange(per * 3, dtype=np.float32).reshape(per, 3) + lane * 10_000
        buf.push(x=x, r=np.arange(per, dtype=np.float32), lane=lane)
    if buf.options.sampler.prioritized:
        buf.update_priorities(np.arange(rows), np.random.default_rng(1).random(rows) * 5)
    return buf


def _ranks(name: str, w: int, seed: int = 11) -> list[sb.ReplayBuffer]:
    return [sb.ReplayBuffer.attach(name, rank=r, world_size=w, seed=seed) for r in range(w)]


def _rank(name: str, r: int, w: int, seed: int = 11) -> sb.ReplayBuffer:
    return sb.ReplayBuffer.attach(name, rank=r, world_size=w, seed=seed)


def _close(bufs: list[sb.ReplayBuffer]) -> None:
    for b in bufs:
        b.close()


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "max_use"])
@pytest.mark.parametrize("one_call", [True, False])
def test_ranks_joined_equal_one_process_bit_for_bit(make: Any, name: str, kind: str, one_call: bool) -> None:
    kw: dict[str, Any] = {"prioritized": {"sampler": Prioritized(beta_steps=5)}, "max_use": {"max_use": 10_000}}.get(kind, {})
    _filled(make, name, **kw)
    one, parts = _ranks(name, 1)[0], _ranks(name, 3)
    try:
        for b in [one, *parts]:
            b._paths.one_calls = one_call  # type: ignore[union-attr]
        for _ in range(4):  # steps 0..3: each step's global batch, and beta annealed by the step
            whole = one.sample(24)
            got = [b.sample(8) for b in parts]
            assert np.array_equal(np.concatenate([g.index for g in got]), whole.index)
            assert np.array_equal(np.concatenate([g["x"] for g in got]), whole["x"])
            if kind == "prioritized":
                assert np.array_equal(np.concatenate([g.weight for g in got]), whole.weight)
        assert [b.ranked.step for b in [one, *parts]] == [4, 4, 4, 4]  # type: ignore[union-attr]
        distinct = one.sample(30, replace=False)
        split = [b.sample(10, replace=False) for b in parts]
        joined = np.concatenate([g.index for g in split])
        assert np.unique(joined).size == 30  # distinct over the ranks too
        if kind != "prioritized":  # distinct prioritized rows are the reader's re-draws, each rank its own
            assert np.array_equal(joined, distinct.index)
    finally:
        _close([one, *parts])


@pytest.mark.skipif(native.lib is None, reason="the one-call sample needs the extension")
@pytest.mark.parametrize("kind", ["uniform", "prioritized", "max_use"])
def test_keyed_one_call_draws_the_numpy_rows(make: Any, name: str, kind: str) -> None:
    kw: dict[str, Any] = {"prioritized": {"sampler": Prioritized()}, "max_use": {"max_use": 10_000}}.get(kind, {})
    _filled(make, name, lanes=3, **kw)
    fast, slow = sb.ReplayBuffer.attach(name, rank=1, world_size=2, seed=5), sb.ReplayBuffer.attach(
        name, rank=1, world_size=2, seed=5)
    try:
        slow._paths.one_calls = False  # type: ignore[union-attr]
        for _ in range(3):
            a, b = fast.sample(64), slow.sample(64)
            assert np.array_equal(a.index, b.index)
        assert fast._paths.one_call is not None and slow._paths.one_call is None  # type: ignore[union-attr]
    finally:
        _close([fast, slow])


def test_uniforms_are_points_of_one_stream() -> None:
    whole = ranks.uniforms(123, 0, 100)
    assert np.array_equal(np.concatenate([ranks.uniforms(123, 0, 37), ranks.uniforms(123, 37, 63)]), whole)
    assert ((whole >= 0) & (whole < 1)).all()
    assert not np.array_equal(ranks.uniforms(124, 0, 100), whole)
    assert stats.kstest(ranks.uniforms(7, 0, 20_000), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("drop_last", [False, True])
def test_epoch_split_over_ranks_covers_every_row_once(make: Any, name: str, drop_last: bool) -> None:
    buf = _filled(make, name, rows=100)
    one, parts = _ranks(name, 1)[0], _ranks(name, 3)
    try:
        for _ in range(2):  # two epochs: each its own permutation, the same on every rank
            whole = [b.index for b in one.epoch(21, drop_last=drop_last)]
            split = [[b.index for b in p.epoch(7, drop_last=drop_last)] for p in parts]
            if drop_last:
                assert [len(s) for s in split] == [len(whole)] * 3  # the same number of batches every rank
            for t, batch in enumerate(whole):
                assert np.array_equal(np.concatenate([s[t] for s in split if t < len(s)]), batch)
            seen = np.concatenate([i for s in split for i in s])
            assert np.unique(seen).size == seen.size  # once
            if not drop_last:
                assert np.array_equal(np.sort(seen), np.sort(buf.ring.held_ids()))  # every row
        assert [p.ranked.epochs for p in parts] == [2, 2, 2]  # type: ignore[union-attr]
    finally:
        _close([one, *parts])


def test_prioritized_global_draw_is_stratified_and_proportional(make: Any, name: str) -> None:
    buf = make(SCHEMA, 40, name=name, sampler=Prioritized(alpha=1.0, eps=0.0))
    buf.push(x=np.zeros((40, 3), np.float32), r=np.zeros(40, np.float32))
    p = np.arange(1, 41, dtype=np.float64)
    buf.update_priorities(np.arange(40), p)
    parts = _ranks(name, 2, seed=3)
    try:
        counts = np.zeros(40)
        cum = np.cumsum(p) / p.sum()
        for _ in range(400):
            for r, b in enumerate(parts):
                got = b.sample(8)
                counts += np.bincount(got.index, minlength=40)
                # rank r's strata: its rows lie in its half of the mass (a row spans at most the boundary)
                lo, hi = cum[got.index] - p[got.index] / p.sum(), cum[got.index]
                assert ((hi > r / 2) & (lo < (r + 1) / 2)).all()
                assert np.allclose(got.weight, (p[got.index] / p.min()) ** -0.4, rtol=1e-5)
        expected = p / p.sum() * counts.sum()
        assert stats.chisquare(counts, expected).pvalue > 1e-4
    finally:
        _close(parts)


def test_beta_anneals_over_global_steps(make: Any, name: str) -> None:
    buf = _filled(make, name, sampler=Prioritized(beta=0.2, beta_steps=4))
    parts = _ranks(name, 2)
    try:
        for step in range(6):
            beta = min(1.0, 0.2 + 0.8 * step / 4)
            low = buf.priorities.tree.min  # type: ignore[union-attr]
            for b in parts:
                got = b.sample(16)
                assert np.allclose(got.weight, (buf.priority(got.index) / low) ** -beta, rtol=1e-5)
        assert buf.priorities.calls == 6  # type: ignore[union-attr]  # rank 0 counts the global steps
    finally:
        _close(parts)


def test_attach_refuses_bad_ranks_and_leaves_buffer(make: Any, name: str) -> None:
    buf = _filled(make, name)
    before = (buf.stats, buf.export())
    for kw, word in (({"rank": 2, "world_size": 2, "seed": 1}, "rank"), ({"rank": 0, "world_size": 0, "seed": 1}, "world_size"),
                     ({"rank": 0, "world_size": 2}, "seed"), ({"rank": 0, "world_size": 2, "seed": -1}, "seed"),
                     ({"rank": True, "world_size": 2, "seed": 1}, "rank"), ({"world_size": 2, "seed": 1}, "rank")):
        with pytest.raises(ValueError, match=word):
            sb.ReplayBuffer.attach(name, **kw)
    assert buf.stats == before[0]
    assert all(np.array_equal(v, before[1][k]) for k, v in buf.export().items())


def test_rank_refuses_more_distinct_rows_than_held(make: Any, name: str) -> None:
    buf = make(SCHEMA, 64, name=name, episodes=True)
    buf.push(x=np.zeros((64, 3), np.float32), r=np.zeros(64, np.float32), episode=np.repeat(np.arange(8), 8))
    rank = _rank(name, 1, 2)
    try:
        with pytest.raises(EmptyBufferError, match="world_size=2"):
            rank.sample(40, replace=False)  # 80 distinct rows in the global batch: more than held
        assert rank.ranked.step == 0  # type: ignore[union-attr]  # nothing drawn: the step stays
    finally:
        rank.close()


@pytest.mark.parametrize("background", [False, True])
def test_loader_takes_the_rank_from_the_buffer(make: Any, name: str, background: bool) -> None:
    from shmbuffer.loader import Loader

    _filled(make, name)
    rank, twin = _rank(name, 1, 2), _rank(name, 1, 2)
    try:
        with Loader(rank, 16, batches=4, background=background) as loader:
            got = [b.index.numpy() for b in loader]
        assert all(np.array_equal(g, twin.sample(16).index) for g in got)  # the attach's steps, in order
    finally:
        _close([rank, twin])


# -- rank processes ---------------------------------------------------------------------------------
def _rank_sampler(name: str, rank: int, w: int, steps: int, out: Any) -> None:
    buf = sb.ReplayBuffer.attach(name, rank=rank, world_size=w, seed=21)
    try:
        idx = [buf.sample(8).index for _ in range(steps)]
        ep = [b.index for b in buf.epoch(5, drop_last=True)]
        out.put((rank, idx, ep))
    finally:
        buf.close()


def test_rank_processes_draw_one_process_batches(make: Any, name: str, procs: list[Any]) -> None:
    _filled(make, name, rows=200)
    q = CTX.Queue()
    for r in range(2):
        p = CTX.Process(target=_rank_sampler, args=(name, r, 2, 5, q))
        p.start()
        procs.append(p)
    got = dict((r, (i, e)) for r, i, e in (q.get(timeout=20) for _ in range(2)))
    (one,) = _ranks(name, 1, seed=21)
    try:
        for t in range(5):
            assert np.array_equal(np.concatenate([got[0][0][t], got[1][0][t]]), one.sample(16).index)
        for t, batch in enumerate(one.epoch(10, drop_last=True)):
            assert np.array_equal(np.concatenate([got[0][1][t], got[1][1][t]]), batch.index)
    finally:
        one.close()


def _rank_updater(name: str, rank: int, steps: int, out: Any) -> None:
    buf = sb.ReplayBuffer.attach(name, rank=rank, world_size=2, seed=4)
    try:
        seen = []
        for _ in range(steps):
            batch = buf.sample(16)
            buf.update_priorities(batch, 1.0 + batch.index % 7)  # a function of the row: any order agrees
            seen.append(batch.index)
        out.put(np.concatenate(seen))
    finally:
        buf.close()


def test_updates_from_every_rank_land_in_the_tree(make: Any, name: str, procs: list[Any]) -> None:
    buf = _filled(make, name, rows=400, sampler=Prioritized(alpha=1.0, eps=0.0))
    q = CTX.Queue()
    for r in range(2):
        p = CTX.Process(target=_rank_updater, args=(name, r, 200, q))
        p.start()
        procs.append(p)
    drawn = np.unique(np.concatenate([q.get(timeout=30) for _ in range(2)]))
    tree = buf.priorities.tree  # type: ignore[union-attr]
    assert np.allclose(buf.priority(drawn), 1.0 + drawn % 7)
    assert tree.total == pytest.approx(tree.leaves.sum(), rel=1e-9)


def _rank_max_use(name: str, rank: int, out: Any) -> None:
    buf = sb.ReplayBuffer.attach(name, rank=rank, world_size=2, seed=8)
    try:
        got = []
        while True:
            try:
                got.append(buf.sample(4).index)
            except EmptyBufferError:
                break
        out.put(np.concatenate(got) if got else np.empty(0, np.int64))
    finally:
        buf.close()


def test_max_use_counts_every_rank(make: Any, name: str, procs: list[Any]) -> None:
    buf = _filled(make, name, rows=64, max_use=1)
    q = CTX.Queue()
    for r in range(2):
        p = CTX.Process(target=_rank_max_use, args=(name, r, q))
        p.start()
        procs.append(p)
    ids = np.concatenate([q.get(timeout=30) for _ in range(2)])
    assert np.unique(ids).size == ids.size  # each row drawn once, by one rank
    assert ids.size == 64 and (buf.uses(np.arange(64)) == 1).all()


def test_limiter_counts_every_rank(make: Any, name: str) -> None:
    buf = _filled(make, name, rows=64, limiter=sb.RateLimiter(samples_per_insert=1.0, min_size=1, error=8.0))
    parts = _ranks(name, 2)
    try:
        # window: sampled <= inserted - (offset - error) = 64 - (1 - 8) = 71 rows, both ranks together
        for _ in range(8):
            for b in parts:
                b.sample(4, timeout=0.5)
        parts[0].sample(4, timeout=0.5)  # 68
        with pytest.raises(sb.WaitTimeout):
            parts[1].sample(4, timeout=0.05)  # 72: held back by rank 0's samples too
        assert buf.stats["sampled"] == 68
    finally:
        _close(parts)


def _rank_forever(name: str, rank: int, progress: Any) -> None:
    buf = sb.ReplayBuffer.attach(name, rank=rank, world_size=2, seed=9)
    while True:
        batch = buf.sample(32)
        buf.update_priorities(batch, np.abs(np.sin(batch.index)) + 0.1)
        progress[rank] += 1


def test_rank_killed_mid_sample_leaves_others_running(make: Any, name: str, procs: list[Any]) -> None:
    buf = _filled(make, name, rows=2000, sampler=Prioritized())
    progress = CTX.Array("l", 2, lock=False)
    for r in range(2):
        p = CTX.Process(target=_rank_forever, args=(name, r, progress))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + 20
    while min(progress[0], progress[1]) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(procs[1].pid, signal.SIGKILL)  # anywhere: mid-sample, mid-update, holding the lock
    procs[1].join(5)
    at = progress[0]
    while progress[0] < at + 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress[0] >= at + 50, "rank 0 stopped when rank 1 died"
    assert procs[0].is_alive()
    tree = buf.priorities.tree  # type: ignore[union-attr]
    procs[0].kill()
    procs[0].join(5)
    buf.sample(8)  # the buffer still serves (a lock left held is repaired by the next locker)
    assert tree.total == pytest.approx(tree.leaves.sum(), rel=1e-6)


def test_plain_attach_is_not_a_rank(make: Any, name: str) -> None:
    _filled(make, name, sampler=Uniform())
    plain = sb.ReplayBuffer.attach(name, seed=1)
    try:
        assert plain.ranked is None
        assert plain.sample(4).index.size == 4
    finally:
        plain.close()


@pytest.mark.slow
def test_the_ddp_example_trains_two_ranks_from_one_buffer() -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "ddp_dqn.py"), "--updates", "100", "--learning-starts", "500", "--eval-episodes", "1",
           "--target", "0"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # timed out: kill it, its ranks and their collectors
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert re.search(r"OK: 2 ranks \(gloo\) trained one model from one buffer: 100 updates of a global batch of 128 "
                     r"\(64 a rank, uniform\), [\d,]+ rows pushed by 8 collector envs, in \d+ s; models equal on every "
                     r"rank: True", out), out
