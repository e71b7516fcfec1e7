"""Cases on a local Ray cluster (``ray.cluster_utils.Cluster``: 2 raylets on this machine, each its own
object store), for ``shmbuffer.ray``. Skipped ("not installed") without Ray.

* ``ray.<schema>.push<k>``: rows per second from a remote writer (this process, on the head node)
  into a buffer on the second node, in calls of ``k`` rows (64 or 512), MuJoCo-like and Atari-like
  rows. shmbuffer: a ``RemoteWriter`` into a shard (``force_remote``: the nodes share ``/dev/shm``
  here, so the shard could be attached; it is not), one call in flight. TorchRL: ``RayReplayBuffer``
  (the whole buffer in one actor on the second node), ``extend`` of a TensorDict per call. RLlib
  style: an actor holding a Python list of numpy batch dicts (what RLlib's replay actors hold), one
  ``add`` call in flight as ours.
* ``ray.mujoco.learner``: batches of 256 MuJoCo-like rows per second for a learner on the head
  node sampling 2 buffers of 50,000 rows, one per node, uniformly. shmbuffer: a ``ShardedBuffer``
  (the head node's shard read through shared memory, the other through Ray), with ``prefetch=2``
  (metric ``prefetch``) and without (``noprefetch``: one round trip per batch). TorchRL: one
  ``RayReplayBuffer`` on the head node holding all 100,000 rows (its design: one actor, a call per
  batch). RLlib style: 2 list actors (Ape-X shards replay over actors), 128 rows asked of each per
  batch, in parallel. The peers have no prefetch; they are measured once and shown under both
  metrics.

Every subject is checked first: rows pushed come back intact (``Spec.check``) and a sampled batch
holds valid rows.
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .data import ATARI, MUJOCO, Spec
from .harness import BATCH, Case, Config, Metric, Op, Subject, case_result, measure
from .peers import Unavailable

STORE = 400 * 2**20
_CLUSTER: dict[str, Any] = {}


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise Unavailable("not installed", f"ray: {e}") from None
    return ray


def cluster() -> tuple[str, str]:
    """Start the 2-node cluster once a run; returns (head node id, second node id)."""
    ray = _ray()
    if not _CLUSTER:
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE,
                                                          "include_dashboard": False})
        c.add_node(num_cpus=1, object_store_memory=STORE)
        c.wait_for_nodes(timeout=120)
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        _CLUSTER.update(cluster=c, head=head, other=other)

        def stop() -> None:
            ray.shutdown()
            c.shutdown()

        atexit.register(stop)
    return _CLUSTER["head"], _CLUSTER["other"]


def _on(node: str) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


class ListReplay:
    """RLlib-style replay: a Python list of numpy batch dicts in an actor, uniform sampling."""

    def __init__(self, capacity: int) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self.sizes: list[int] = []
        self.rows, self.capacity = 0, capacity
        self.rng = np.random.default_rng(0)

    def add(self, batch: dict[str, np.ndarray]) -> int:
        batch = {k: np.array(v) for k, v in batch.items()}  # own the rows (Ray's arrays are read-only views)
        self.batches.append(batch)
        n = len(next(iter(batch.values())))
        self.sizes.append(n)
        self.rows += n
        while self.rows - self.sizes[0] >= self.capacity:
            self.rows -= self.sizes.pop(0)
            self.batches.pop(0)
        return n

    def sample(self, k: int) -> dict[str, np.ndarray]:
        ends = np.cumsum(self.sizes)
        pos = self.rng.integers(0, int(ends[-1]), k)
        which = np.searchsorted(ends, pos, side="right")
        at = pos - (ends[which] - np.asarray(self.sizes)[which])
        return {key: np.stack([self.batches[b][key][i] for b, i in zip(which, at, strict=True)])
                for key in self.batches[0]}


def _rows(spec: Spec, k: int, w: int = 0) -> list[dict[str, np.ndarray]]:
    """A few self-verifying batches of ``k`` rows to push in turn."""
    return [spec.make(w, np.arange(j * k, (j + 1) * k)) for j in range(4)]


def _check_rows(spec: Spec, fields: dict[str, Any], what: str) -> None:
    ok, _, _ = spec.check(spec.canonical(fields))
    if not ok.all():
        raise RuntimeError(f"{what}: {int((~ok).sum())} of {ok.size} rows came back wrong")


# -- ingest: a remote writer into a buffer on another node -------------------------------------------------
def _ours_writer(spec: Spec, k: int, capacity: int) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        import shmbuffer as sb
        from shmbuffer.ray import RemoteWriter, ShardedBuffer

        _, other = cluster()
        buf = ShardedBuffer(sb.Schema(**spec.fields), capacity, nodes=[other], force_remote=True, prefetch=0)
        try:
            writer = buf.writer(batch_rows=k).open()
            assert isinstance(writer, RemoteWriter)
            batches = _rows(spec, k)
            writer.push(batches[0])
            writer.flush()
            _check_rows(spec, buf.sample(k).fields, "shmbuffer RemoteWriter")
        except BaseException:
            buf.close()
            raise
        it = itertools.cycle(batches)
        return {"push": lambda: writer.push(next(it))}, lambda: (writer.close(), buf.close())

    return Subject("shmbuffer", "ours", setup, note="RemoteWriter into a shard on node 2, one call in flight")


def _torchrl_rb(capacity: int, node: str, batch: int) -> Any:
    try:
        from torchrl.data import LazyTensorStorage
        from torchrl.data.replay_buffers import RayReplayBuffer
    except ImportError as e:
        raise Unavailable("not installed", f"torchrl RayReplayBuffer: {e}") from None
    return RayReplayBuffer(storage=partial(LazyTensorStorage, capacity), batch_size=batch, remote_config=_on(node),
                           transport="ray")


def _torchrl_shutdown(rb: Any) -> None:
    """End a TorchRL ``RayReplayBuffer``'s actor gracefully, then ``rb.shutdown()``.

    ``shutdown`` alone is ``ray.kill`` (SIGKILL), and the actor holds named POSIX semaphores: its
    storage's and writer's ``mp.Value`` locks (importing torchrl makes ``spawn`` multiprocessing's
    default start method, so a ``SemLock`` has a name, ``/dev/shm/sem.mp-*``, unlinked by a
    finalizer at exit or by the resource tracker). A killed actor runs neither, and Ray kills its
    resource tracker with it (a worker's children die with it): 5 files left per buffer.
    ``__ray_terminate__`` exits the actor as ``ray.actor.exit_actor`` does, running its ``atexit``
    handlers, multiprocessing's finalizers among them."""
    ray = _ray()
    actor = getattr(rb, "_rb", None)
    if actor is not None:
        try:
            ray.get(actor.__ray_terminate__.remote(), timeout=60)
        except ray.exceptions.RayError:  # the actor has exited (or was already gone)
            pass
    rb.shutdown()


def _td(spec: Spec, rows: dict[str, np.ndarray]) -> Any:
    import torch
    from tensordict import TensorDict

    n = len(rows["reward"])
    return TensorDict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rows.items()}, batch_size=[n])


def _torchrl_writer(spec: Spec, k: int, capacity: int) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        _, other = cluster()
        rb = _torchrl_rb(capacity, other, k)
        try:
            tds = [_td(spec, b) for b in _rows(spec, k)]
            rb.extend(tds[0])
            _check_rows(spec, dict(rb.sample().items()), "TorchRL RayReplayBuffer")
        except BaseException:
            _torchrl_shutdown(rb)
            raise
        it = itertools.cycle(tds)
        return {"push": lambda: rb.extend(next(it))}, partial(_torchrl_shutdown, rb)

    return Subject("torchrl RayReplayBuffer", "peer", setup, note="the whole buffer in one actor on node 2")


def _list_writer(spec: Spec, k: int, capacity: int) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        ray = _ray()
        _, other = cluster()
        actor = ray.remote(ListReplay).options(**_on(other)).remote(capacity)
        batches = _rows(spec, k)
        ray.get(actor.add.remote(batches[0]))
        _check_rows(spec, ray.get(actor.sample.remote(k)), "RLlib-style list actor")
        state: dict[str, Any] = {"prev": None, "i": 0}

        def push() -> None:
            if state["prev"] is not None:
                ray.get(state["prev"])
            state["i"] += 1
            state["prev"] = actor.add.remote(batches[state["i"] % len(batches)])

        def teardown() -> None:
            if state["prev"] is not None:
                ray.get(state["prev"])
            ray.kill(actor)

        return {"push": push}, teardown

    return Subject("RLlib-style list actor", "peer", setup, note="a list of numpy batch dicts in an actor on node 2")


def _ingest_case(spec: Spec, k: int) -> Callable[[Config], dict[str, Any]]:
    def run(cfg: Config) -> dict[str, Any]:
        _ray()
        capacity = 100_000 if spec is MUJOCO else 2_048
        metrics = {"push": Metric(f"push {k} rows through Ray", "rows/s", k, spec.row_bytes)}
        subjects = [_ours_writer(spec, k, capacity), _torchrl_writer(spec, k, capacity), _list_writer(spec, k, capacity)]
        return case_result(f"remote writer, {k}-row calls", spec, cfg, metrics, measure(subjects, metrics, cfg),
                           cluster="2 raylets on this machine", capacity_used=capacity)

    return run


# -- the learner: batches across 2 buffers ---------------------------------------------------------------
FILL = 50_000


def _ours_learner() -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        import shmbuffer as sb
        from shmbuffer.ray import ShardedBuffer

        head, other = cluster()
        spec = MUJOCO
        bufs = [ShardedBuffer(sb.Schema(**spec.fields), FILL, nodes=[head, other], prefetch=p, seed=p) for p in (2, 0)]
        try:
            first = bufs[0]
            for w, shard in enumerate(first.shards):  # each learner has its own 2 shards, filled alike
                writer = first.writer(batch_rows=8192, node=shard.node).open()
                for j in range(0, FILL, 8192):
                    writer.push(spec.make(w, np.arange(j, min(j + 8192, FILL))))
                writer.close()
            for w, shard in enumerate(bufs[1].shards):
                writer = bufs[1].writer(batch_rows=8192, node=shard.node).open()
                for j in range(0, FILL, 8192):
                    writer.push(spec.make(w, np.arange(j, min(j + 8192, FILL))))
                writer.close()
            for b in bufs:
                batch = b.sample(BATCH)
                _check_rows(spec, batch.fields, "shmbuffer ShardedBuffer")
                if len(set(batch.shard.tolist())) != 2:
                    raise RuntimeError("shmbuffer ShardedBuffer: a batch did not draw from both shards")
        except BaseException:
            for b in bufs:
                b.close()
            raise
        return ({"prefetch": lambda: bufs[0].sample(BATCH), "noprefetch": lambda: bufs[1].sample(BATCH)},
                lambda: [b.close() for b in bufs])

    return Subject("shmbuffer", "ours", setup, note="ShardedBuffer: head shard via shared memory, node 2's via Ray")


def _torchrl_learner() -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        head, _ = cluster()
        rb = _torchrl_rb(2 * FILL, head, BATCH)
        try:
            for w in range(2):
                for j in range(0, FILL, 8192):
                    rb.extend(_td(MUJOCO, MUJOCO.make(w, np.arange(j, min(j + 8192, FILL)))))
            _check_rows(MUJOCO, dict(rb.sample().items()), "TorchRL RayReplayBuffer")
        except BaseException:
            _torchrl_shutdown(rb)
            raise
        return {"prefetch": rb.sample, "noprefetch": rb.sample}, partial(_torchrl_shutdown, rb)

    return Subject("torchrl RayReplayBuffer", "peer", setup, note="one actor holding all rows, a call per batch")


def _list_learner() -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        ray = _ray()
        head, other = cluster()
        actors = [ray.remote(ListReplay).options(**_on(n)).remote(FILL) for n in (head, other)]
        for w, a in enumerate(actors):
            ray.get([a.add.remote(MUJOCO.make(w, np.arange(j, min(j + 200, FILL)))) for j in range(0, FILL, 200)])

        def sample() -> dict[str, np.ndarray]:
            parts = ray.get([a.sample.remote(BATCH // 2) for a in actors])
            return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

        _check_rows(MUJOCO, sample(), "RLlib-style list actors")
        return {"prefetch": sample, "noprefetch": sample}, lambda: [ray.kill(a) for a in actors]

    return Subject("RLlib-style list actors", "peer", setup, note="2 actors of numpy batch lists, half a batch each")


def _learner_case(cfg: Config) -> dict[str, Any]:
    _ray()
    metrics = {"prefetch": Metric(f"sample {BATCH} across 2 nodes, prefetch=2", "batches/s", 1, BATCH * MUJOCO.row_bytes),
               "noprefetch": Metric(f"sample {BATCH} across 2 nodes, no prefetch", "batches/s", 1,
                                    BATCH * MUJOCO.row_bytes)}
    subjects = [_ours_learner(), _torchrl_learner(), _list_learner()]
    return case_result(f"learner: {BATCH} rows from 2 buffers on 2 nodes", MUJOCO, cfg, metrics,
                       measure(subjects, metrics, cfg), cluster="2 raylets on this machine", rows_per_node=FILL)


def register(cases: dict[str, Case]) -> None:
    for spec in (MUJOCO, ATARI):
        for k in (64, 512):
            name = f"ray.{spec.name}.push{k}"
            cases[name] = Case(name, f"remote writer into a shard, {k}-row calls", "distributed", _ingest_case(spec, k))
    cases["ray.mujoco.learner"] = Case("ray.mujoco.learner", "learner batches across 2 shards, prefetch or not",
                                       "distributed", _learner_case)
