"""Buffer shards on Ray (``shmbuffer.ray``), on a ``ray.cluster_utils.Cluster`` of several raylets
on this machine. Its nodes share ``/dev/shm``, so every test that is about the remote path forces
it (``force_remote``) and counts the calls that went through Ray."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="shmbuffer.ray needs Ray: pip install -e '.[ray]'")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

import shmbuffer as sb  # noqa: E402
from shmbuffer.errors import FieldError, UnknownIdError  # noqa: E402
from shmbuffer.ray import RemoteWriter, ShardedBuffer, ShardLost, ShardLostError, row_of, shard_of  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    # Ray's own modules warn about their dependencies' deprecations; only theirs is silenced
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:google.*"),
    pytest.mark.filterwarnings("ignore::ResourceWarning:ray.*"),
]

ROOT = Path(__file__).resolve().parent.parent
STORE = 80 * 2**20
SCHEMA = sb.Schema(x=((3,), "float32"), i=((), "int64"))
ALPHA, BETA, EPS = 0.7, 0.5, 1e-6
HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
    """Self-verifying rows: row ``i`` holds ``x = i * (1, 2, 3)``."""
    i = np.arange(lo, hi, dtype=np.int64)
    return {"x": (i[:, None] * np.array([1, 2, 3])).astype(np.float32), "i": i}


def intact(batch: sb.Batch) -> bool:
    return bool(np.array_equal(batch.x, (np.asarray(batch.i)[:, None] * np.array([1, 2, 3])).astype(np.float32)))


def start(nodes: int) -> Cluster:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False, "_system_config": HEALTH})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=STORE)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster


SHM = Path("/dev/shm")
_MAPPED = re.compile(r"^\S+ \S+ \S+ \S+ (\d+) +/dev/shm/sem\.", re.M)


def semaphores() -> set[str]:
    """The named POSIX semaphores of ``multiprocessing`` (``SemLock``) in ``/dev/shm`` now."""
    return {n for n in os.listdir(SHM) if n.startswith("sem.mp-")}


def _pids() -> dict[int, int]:
    """Every live process and its parent."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _held(pids: Iterable[int]) -> set[int]:
    """The inodes of the semaphores these processes map (a ``SemLock`` maps its semaphore for
    life; its creator's map names the file glibc made it under, ``sem.XXXXXX``, since linked to
    the ``sem.mp-*`` name: hence the inode)."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            inodes.update(map(int, _MAPPED.findall(Path(f"/proc/{pid}/maps").read_text())))
        except OSError:
            pass
    return inodes


def _inodes(names: Iterable[str]) -> dict[str, int]:
    out = {}
    for n in names:
        try:
            out[n] = os.stat(SHM / n).st_ino
        except FileNotFoundError:
            pass
    return out


class Semaphores:
    """Which new ``sem.mp-*`` files this pytest process's tree made: a thread looks twice a second
    at the files that appeared since it started and records those held (mapped) by this process or
    a descendant (Ray's raylets, its workers, their children; a Ray worker's processes are
    reparented away when their raylet dies, so the record is made while they live). Files of
    parallel xdist workers are never mapped by our tree and are never counted."""

    def __init__(self) -> None:
        self.known = semaphores()
        self.ours: set[str] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="sem-watch", daemon=True).start()

    def tree(self) -> set[int]:
        parents = _pids()
        children: dict[int, list[int]] = {}
        for pid, ppid in parents.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = set(), [os.getpid()]
        while todo:
            pid = todo.pop()
            out.add(pid)
            todo.extend(children.get(pid, ()))
        return out

    def scan(self) -> None:
        with self._lock:
            new = _inodes(semaphores() - self.known - self.ours)
            if new:
                held = _held(self.tree())
                mine = {n for n, ino in new.items() if ino in held}
                self.ours |= mine
                self.known |= set(new) - mine  # a creator maps its semaphore before naming it

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            try:
                self.scan()
            except Exception:  # a process gone while read: next round
                pass

    def left(self, before: set[str], settle: float) -> list[str]:
        """Files of ours made since ``before`` that are still there and held by no live process:
        waits 2 s (the resource tracker of a process that exited unlinks its semaphores then) and
        up to ``regather`` s while a live process holds one (a Ray worker still dying after its
        cluster's shutdown). Those left are removed, and returned."""
        self.scan()
        now = time.monotonic()
        grace, deadline = now + 2.0, now + settle
        while True:
            with self._lock:
                new = _inodes((self.ours - before) & semaphores())
            if not new:
                return []
            inodes = _held(_pids())
            held = {n for n, ino in new.items() if ino in inodes}
            now = time.monotonic()
            if now > grace and (not held or now > deadline):
                break
            time.sleep(0.2)
        orphans = sorted(set(new) - held)
        for n in orphans:
            try:
                os.unlink(SHM / n)
            except FileNotFoundError:
                pass
        return orphans


_WATCH: list[Semaphores] = []


@pytest.fixture(autouse=True)
def no_semaphores_left(request: pytest.FixtureRequest) -> Iterator[Semaphores]:
    """Fail a test after which a ``multiprocessing`` semaphore (``/dev/shm/sem.mp-*``) made by a
    process of this test's tree is left with nobody holding it (a process killed with its resource
    tracker: Ray kills a worker's children with it). The leftovers are removed."""
    if not _WATCH:
        _WATCH.append(Semaphores())
    watch = _WATCH[0]
    before = semaphores()
    yield watch
    # a test on the class's cluster: its workers live on (the cluster's own check follows its
    # shutdown); any other test has shut its cluster down: wait for its processes to let go
    left = watch.left(before, settle=0.0 if "cluster" in request.fixturenames else 15.0)
    assert not left, f"named semaphores left in /dev/shm (removed now): {left}"


@pytest.fixture(scope="class")
def cluster():
    if not _WATCH:
        _WATCH.append(Semaphores())
    before = semaphores()
    cluster = start(3)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
    left = _WATCH[0].left(before, settle=15.0)  # the actors killed at shutdown
    assert not left, f"named semaphores left in /dev/shm at the cluster's shutdown (removed now): {left}"


@ray.remote(num_cpus=0)
def write(target, lo: int, hi: int, step: int, priority_mod: int = 0) -> tuple[str, int, str]:
    """Push rows ``[lo, hi)`` in pushes of ``step`` rows through ``target``; returns the writer's
    kind, its Ray calls and the node it ran on."""
    w = target.open()
    for j in range(lo, hi, step):
        part = rows(j, min(j + step, hi))
        prio = None if not priority_mod else 1.0 + (part["i"] % priority_mod)
        w.push(part, priority=prio)
    w.close()
    return type(w).__name__, getattr(w, "calls", 0), ray.get_runtime_context().get_node_id()


def on(node: str):
    return write.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))


def gone(name: str, within: float = 60.0) -> bool:
    """Whether the block ``name`` is removed within ``within`` seconds (a bound, not a timing claim)."""
    block = Path("/dev/shm") / f"shmbuffer-{name}"
    deadline = time.monotonic() + within
    while block.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not block.exists()


def wilson_hilferty(chi2: float, dof: int) -> float:
    """The upper tail probability of a chi-square statistic (Wilson-Hilferty's approximation)."""
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = counts.sum() * p / p.sum()
    return wilson_hilferty(float(((counts - expected) ** 2 / expected).sum()), counts.size - 1)


class TestOneCluster:
    """Tests sharing one cluster of 3 nodes (started once: a cluster takes seconds on 2 cores)."""

    def test_rows_from_every_node_arrive_intact_through_ray(self, cluster) -> None:
        with ShardedBuffer(SCHEMA, 2_000, force_remote=True, seed=1) as buf:
            assert len(buf.shards) == 3
            target = buf.writer(batch_rows=100)
            per = 300
            out = ray.get([on(s.node).remote(target, s.index * per, (s.index + 1) * per, 25) for s in buf.shards])
            for s, (kind, calls, node) in zip(buf.shards, out, strict=True):
                assert node == s.node and kind == "RemoteWriter"
                assert calls == per // 100  # 25-row pushes gathered into calls of 100 rows
            stats = buf.stats
            assert stats["inserted"] == stats["rows"] == 3 * per == len(buf)
            for s in buf.shards:
                assert stats["shards"][s.index]["pushes"] == per // 100  # the rows came through the actor
                with sb.ReplayBuffer.attach(s.name) as shard:  # the rows each node wrote, all there, none lost
                    got = shard.export()
                    assert np.array_equal(np.sort(got["i"]), np.arange(s.index * per, (s.index + 1) * per))
                    assert intact(sb.Batch({"x": got["x"], "i": got["i"]}))
            calls = buf.remote_calls
            seen = np.zeros(3, np.int64)
            for _ in range(60):
                batch = buf.sample(50)
                assert len(batch) == 50 and intact(batch)
                shard = shard_of(batch.index)
                assert np.array_equal(shard, batch.shard) and np.array_equal(shard, batch.i // per)
                assert np.array_equal(row_of(batch.index), batch.i % per)  # one lane: a row's id is its number
                seen += np.bincount(shard, minlength=3)
            assert buf.remote_calls > calls  # every shard, even this node's, was read through Ray
            # uniform: shards in proportion to their rows (equal here): chi-square, 2 degrees of freedom
            chi2 = float((((seen - seen.sum() / 3) ** 2) / (seen.sum() / 3)).sum())
            assert chi2 < 18.4  # p = 1e-4


    @pytest.mark.parametrize("prefetch", [2, 0])
    def test_prioritized_draws_and_weights_are_one_buffers(self, cluster, prefetch) -> None:
        """Shards of 40, 80 and 120 rows with different priorities (so different totals): the rows
        come as often as from one buffer holding them all, with that buffer's importance weights."""
        sampler = sb.Prioritized(alpha=ALPHA, beta=BETA)
        sizes = [40, 80, 120]
        bounds = np.cumsum([0, *sizes])
        with ShardedBuffer(SCHEMA, 1_000, sampler=sampler, prefetch=prefetch, seed=2) as buf, \
                sb.ReplayBuffer(SCHEMA, 1_000, sampler=sampler) as one:
            target = buf.writer(batch_rows=64)
            mods = [3, 5, 11]  # priorities 1 + i % mod: each shard's total and minimum differ
            ray.get([on(s.node).remote(target, int(bounds[s.index]), int(bounds[s.index + 1]), 20, mods[s.index])
                     for s in buf.shards])
            for s in buf.shards:
                part = rows(int(bounds[s.index]), int(bounds[s.index + 1]))
                one.push(part, priority=1.0 + part["i"] % mods[s.index])
            n_rows = int(bounds[-1])
            counts = np.zeros(n_rows, np.int64)
            leaf = one.priority(np.arange(n_rows))  # one buffer's leaves, by row number (ids are 0..n-1)
            calls = buf.remote_calls
            for _ in range(250):
                batch = buf.sample(64)
                assert intact(batch)
                counts += np.bincount(batch.i, minlength=n_rows)
                want = sampler.weights(one.priorities.tree, leaf[batch.i], 0)
                np.testing.assert_allclose(batch.weight, want, rtol=1e-6)
            assert buf.remote_calls > calls
            assert chi_square(counts, leaf) > 1e-4
            # the test has the power to see a wrong split: rows drawn by rows, not by totals
            by_rows = np.concatenate([leaf[a:b] / leaf[a:b].sum() * (b - a) for a, b in itertools.pairwise(bounds)])
            assert chi_square(counts, by_rows) < 1e-9


    def test_priority_updates_reach_their_shard(self, cluster) -> None:
        sampler = sb.Prioritized(alpha=ALPHA, beta=BETA)
        with ShardedBuffer(SCHEMA, 1_000, sampler=sampler, seed=3) as buf:
            target = buf.writer(batch_rows=50, force_remote=True)
            ray.get([on(s.node).remote(target, 100 * s.index, 100 * s.index + 100, 50) for s in buf.shards])
            batch = buf.sample(120)
            calls = buf.remote_calls
            new = 2.0 + batch.i.astype(np.float64)
            assert buf.update_priorities(batch, new) == 120
            assert buf.remote_calls >= calls + 2  # the two remote shards were updated through Ray
            for s in buf.shards:
                with sb.ReplayBuffer.attach(s.name) as shard:
                    mine = batch.shard == s.index
                    got = shard.priority(row_of(batch.index[mine]))
                    np.testing.assert_allclose(got, (new[mine] + EPS) ** ALPHA)
                    untouched = np.setdiff1d(np.arange(100), row_of(batch.index[mine]))
                    np.testing.assert_allclose(shard.priority(untouched), (1.0 + EPS) ** ALPHA)
            with pytest.raises(UnknownIdError, match="name no shard"):
                buf.update_priorities(np.array([7 << 56]), [1.0])
            remote = next(i for i in range(3) if i != buf.shards[0].index and i in buf.alive)
            with pytest.raises(UnknownIdError, match="never named a row"):  # raised by the shard, brought home
                buf.update_priorities(np.array([remote << 56 | 5_000]), [1.0])


    def test_a_bad_remote_push_is_refused_as_a_local_one(self, cluster) -> None:
        with ShardedBuffer(SCHEMA, 100, seed=4) as buf:
            s = buf.shards[-1]
            target = buf.writer(force_remote=True, node=s.node)
            writer = target.open()
            assert isinstance(writer, RemoteWriter)
            bad = {"x": np.zeros((4, 2), np.float32), "i": np.arange(4)}
            with pytest.raises(FieldError) as remote:
                writer.push(bad)
            with sb.ReplayBuffer.attach(s.name) as local, pytest.raises(FieldError) as here:
                local.push(bad)
            assert str(remote.value) == str(here.value) and "field 'x'" in str(remote.value)
            with pytest.raises(FieldError) as remote:
                writer.push(rows(0, 2), priority=1.0)
            with sb.ReplayBuffer.attach(s.name) as local, pytest.raises(FieldError) as here:
                local.push(rows(0, 2), priority=1.0)
            assert str(remote.value) == str(here.value)
            both = {**rows(0, 2), "priority": np.ones(2)}  # one normaliser: the same refusals, word for word
            for kwargs, error in (({"priority": 1.0}, TypeError), ({"lane": 5}, sb.CapacityError)):
                with pytest.raises(error) as remote:
                    writer.push(both if error is TypeError else rows(0, 2), **kwargs)
                with sb.ReplayBuffer.attach(s.name) as local, pytest.raises(error) as here:
                    local.push(both if error is TypeError else rows(0, 2), **kwargs)
                assert str(remote.value) == str(here.value)
            writer.push(rows(0, 3))
            writer.close()
            assert writer.calls == 1 and buf.stats["shards"][s.index]["inserted"] == 3  # nothing of the bad pushes
            # what only the shard can refuse comes back as the shard raised it
            with sb.ReplayBuffer.attach(s.name) as local:
                local.freeze()
                with pytest.raises(sb.ReadOnlyError) as here:
                    local.push(rows(3, 4))
            writer = target.open()
            writer.push(rows(3, 4))
            with pytest.raises(sb.ReadOnlyError) as remote:
                writer.flush()
            assert str(remote.value) == str(here.value) and buf.stats["shards"][s.index]["inserted"] == 3


    def test_sample_sizes_are_checked_as_the_cores(self, cluster) -> None:
        """The core's check of ``sample(n)`` (``samplers.check_batch_size``): ``True`` is not a size."""
        with ShardedBuffer(SCHEMA, 100, seed=6) as buf, sb.ReplayBuffer(SCHEMA, 10) as local:
            for n in (True, 0, -1, 2.0, "3"):
                with pytest.raises(ValueError) as here:
                    local.sample(n)
                with pytest.raises(ValueError) as sharded:
                    buf.sample(n)
                assert str(sharded.value) == str(here.value), n

    def test_the_rate_limiter_counts_every_shard(self, cluster) -> None:
        with pytest.raises(ValueError, match="block_writers"):
            ShardedBuffer(SCHEMA, 100, limiter=sb.RateLimiter(1.0, block_writers=True))
        limiter = sb.RateLimiter(samples_per_insert=2.0, min_size=10, error=0.0, timeout=0.5)
        with ShardedBuffer(SCHEMA, 1_000, limiter=limiter, force_remote=True, seed=5) as buf:
            target = buf.writer(batch_rows=10)
            ray.get([on(s.node).remote(target, 20 * s.index, 20 * s.index + 20, 10) for s in buf.shards])
            # 60 rows inserted: 2 * 60 - sampled - n >= 2 * 10 allows 100 rows sampled
            buf.sample(64)
            buf.sample(36)
            with pytest.raises(sb.WaitTimeout, match="60 rows inserted into 3 shards"):
                buf.sample(1)
            ray.get(on(buf.shards[1].node).remote(target, 60, 61, 1))  # one more row, anywhere: two more samples
            buf.sample(2)
            with pytest.raises(sb.WaitTimeout):
                buf.sample(1)


    def test_len_stats_ls_and_save_cover_every_shard(self, cluster, tmp_path) -> None:
        with ShardedBuffer(SCHEMA, 1_000, force_remote=True, seed=6) as buf:
            target = buf.writer(batch_rows=30)
            ray.get([on(s.node).remote(target, 100 * s.index, 100 * s.index + 10 * (s.index + 1), 10) for s in buf.shards])
            assert len(buf) == 10 + 20 + 30
            assert [r["rows"] for r in buf.ls()] == [10, 20, 30]
            manifest = buf.save(tmp_path / "saved")
            assert manifest == json.loads((tmp_path / "saved" / "manifest.json").read_text())
            assert [m["dir"] for m in manifest["shards"]] == ["shard-0", "shard-1", "shard-2"]
            assert [m["rows"] for m in manifest["shards"]] == [10, 20, 30]
            for m in manifest["shards"]:
                with sb.ReplayBuffer.load(tmp_path / "saved" / m["dir"]) as back:
                    got = back.export()
                    i = m["shard"]
                    assert np.array_equal(np.sort(got["i"]), np.arange(100 * i, 100 * i + 10 * (i + 1)))
        with ShardedBuffer.load(tmp_path / "saved", seed=7) as again:  # each shard on the node that saved it
            assert [s.node for s in again.shards] == [s.node for s in buf.shards] and len(again) == 60
            batch = again.sample(200)
            assert intact(batch) and np.array_equal(batch.shard, batch.i // 100)
            assert np.array_equal(row_of(batch.index), batch.i % 100)  # ids kept: shard and row number


    def test_a_collector_on_a_second_node_feeds_the_learner(self, cluster) -> None:
        pytest.importorskip("gymnasium")

        @ray.remote(num_cpus=0)
        def collect(target, rows_wanted: int) -> tuple[str, int]:
            import gymnasium as gym

            from shmbuffer.collector import Collector

            target = target.handle  # pinned to this node: its workers find this node's shard
            with Collector(lambda: gym.make("CartPole-v1"), target, workers=1, envs_per_worker=2, seed=7) as col:
                col.warm(rows_wanted, timeout=240)
            return ray.get_runtime_context().get_node_id(), target.stats["inserted"]

        schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                           next_obs=((4,), "float32"), done=((), "bool"))
        with ShardedBuffer(schema, 5_000, seed=8) as buf:
            second = buf.shards[1]
            node, inserted = ray.get(collect.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(second.node, soft=False)).remote(buf.writer(), 200))
            assert node == second.node and inserted >= 200
            stats = buf.stats["shards"]
            assert stats[second.index]["inserted"] == inserted and stats[second.index]["pushes"] == 0  # shared memory
            assert sum(stats[s.index]["inserted"] for s in buf.shards if s.index != second.index) == 0
            batch = buf.sample(64)
            assert np.all(batch.shard == second.index)
            assert np.all(np.abs(batch.obs).max(axis=1) < 5) and set(np.unique(batch.action)) <= {0, 1}

    def test_a_collector_pushes_through_ray_where_there_is_no_shard(self, cluster) -> None:
        """The same ``Collector`` with a target forced remote: its worker connects to the cluster
        and pushes batches to the shard actor (counted)."""
        pytest.importorskip("gymnasium")
        import gymnasium as gym

        from shmbuffer.collector import Collector

        schema = sb.Schema(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                           next_obs=((4,), "float32"), done=((), "bool"))
        with ShardedBuffer(schema, 5_000, seed=10) as buf:
            home = buf.shards[0].index if buf.shards[0].node == ray.get_runtime_context().get_node_id() else None
            target = buf.writer(force_remote=True, batch_rows=64)
            with Collector(lambda: gym.make("CartPole-v1"), target, workers=1, envs_per_worker=2, seed=11) as col:
                col.warm(300, timeout=240)
            stats = buf.stats["shards"]
            shard = target.handle.home().index
            assert home is None or shard == home
            assert stats[shard]["inserted"] >= 300 and stats[shard]["pushes"] >= 300 // 64
            batch = buf.sample(32)
            assert np.all(batch.shard == shard) and set(np.unique(batch.action)) <= {0, 1}

    def test_a_killed_shard_actor_is_reported_once_and_its_block_removed(self, cluster) -> None:
        with ShardedBuffer(SCHEMA, 500, sampler=sb.Prioritized(), seed=12) as buf:
            target = buf.writer(batch_rows=50)
            ray.get([on(s.node).remote(target, 100 * s.index, 100 * s.index + 100, 50) for s in buf.shards])
            here = ray.get_runtime_context().get_node_id()
            victim = next(s for s in buf.shards if s.node != here)
            buf.sample(64)
            ray.kill(ray.get_actor(victim.actor, namespace=buf.namespace))
            with pytest.warns(ShardLost, match=f"shard {victim.index}") as told:
                for _ in range(30):
                    batch = buf.sample(64)
                    assert intact(batch)
            assert len([w for w in told if issubclass(w.category, ShardLost)]) == 1
            assert buf.lost == [victim.index] and victim.index not in batch.shard
            assert len(buf) == 200 and buf.stats["rows"] == 200
            with pytest.raises(ShardLostError, match=f"shard {victim.index}"):
                writer = buf.writer(force_remote=True, node=victim.node).open()
                writer.push(rows(900, 901))
                writer.flush()
            assert gone(victim.name), f"{victim.name} outlived its shard actor"

    def test_a_learner_killed_without_close_leaves_no_block(self, cluster) -> None:
        """Ray kills the actors a dead learner owned, and their children with them: each shard's
        janitor, outside that tree, removes the shard's block."""
        child = (
            "import os, signal, sys, ray\n"
            "import shmbuffer as sb\n"
            "from shmbuffer.ray import ShardedBuffer\n"
            "ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)\n"
            "buf = ShardedBuffer(sb.Schema(x=((3,), 'float32')), 100)\n"
            "print(' '.join(s.name for s in buf.shards), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n"
        )
        out = subprocess.run([sys.executable, "-c", child, cluster.address], capture_output=True, text=True,
                             timeout=240)
        names = out.stdout.split()
        assert len(names) == 3 and out.returncode == -9, out.stderr[-2000:]
        assert all(gone(n) for n in names), f"left in /dev/shm: {[n for n in names if not gone(n, 0)]}"


def test_killing_a_node_leaves_the_learner_running(tmp_path) -> None:
    cluster = start(2)
    try:
        node = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
        with ShardedBuffer(SCHEMA, 1_000, sampler=sb.Prioritized(), seed=9) as buf:
            here = ray.get_runtime_context().get_node_id()
            head = buf.shards[0] if buf.shards[0].node == here else buf.shards[1]
            other = buf.shards[1 - head.index]
            target = buf.writer(batch_rows=50)
            ray.get(on(head.node).remote(target, 0, 100, 50))
            ray.get(on(other.node).remote(replace(target, force_remote=True), 100, 200, 50))
            first = buf.sample(100)
            assert set(np.unique(first.shard)) == {0, 1}
            writer = buf.writer(force_remote=True, node=other.node).open()
            failover = buf.writer(force_remote=True, node=other.node, failover=True).open()
            cluster.remove_node(node)
            with pytest.warns(ShardLost, match=f"shard {other.index}") as told:
                for _ in range(20):
                    batch = buf.sample(32)
            assert len([w for w in told if issubclass(w.category, ShardLost)]) == 1  # told once
            assert buf.lost == [other.index] and np.all(batch.shard == head.index) and intact(batch)
            assert gone(other.name)  # the dead node's block (nodes share /dev/shm here): its janitor removed it
            assert buf.stats["rows"] == 100  # the other shard's rows are all still there
            # rows of the dead shard are dropped as overwritten ones are; the others are updated
            assert buf.update_priorities(first, np.ones(100)) == int((first.shard == head.index).sum())
            with pytest.raises(ShardLostError, match=f"shard {other.index}"):
                writer.push(rows(500, 550))
                writer.flush()
            failover.push(rows(600, 650))
            failover.flush()
            assert failover.shard.index == head.index and buf.stats["rows"] == 150
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_the_example_runs(tmp_path) -> None:
    pytest.importorskip("gymnasium")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_cluster.py"), "--tiny"],
                         capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "shards" in out.stdout


@pytest.mark.parametrize(("manifest", "says"), [
    ("not json", "not a ShardedBuffer save's manifest"),
    ({"format": "shmbuffer", "version": 1}, "expected format 'shmbuffer-shards' version 1"),
    ({"shards": []}, "'shards': a non-empty list"),
    ({"shards": [{"shard": "0", "node": "n", "dir": "shard-0"}]}, "each shard"),
    ({"shards": [{"shard": 0, "node": "n", "dir": "../elsewhere"}]}, "a directory name inside the save"),
    ({"shards": [{"shard": 0, "node": "n", "dir": "shard-0"}], "schema": None}, "'sampler'"),
], ids=["not-json", "format", "no-shards", "shard-type", "dir-outside", "no-sampler"])
def test_a_load_checks_the_manifest(manifest: object, says: str, tmp_path) -> None:
    """An altered manifest is refused with what was expected, before any shard is made."""
    if isinstance(manifest, dict) and "format" not in manifest:
        manifest = {"format": "shmbuffer-shards", "version": 1, **manifest}
    (tmp_path / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    with pytest.raises(ValueError, match=re.escape(says)):
        ShardedBuffer.load(tmp_path)
