"""The learner's side: ``ShardedBuffer``, shards of one buffer on several Ray nodes sampled as one
(``shmbuffer.ray`` says how: the split over shards, prefetching, rate limiting, lost shards).
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import arguments
from ..batch import Batch
from ..buffer import ReplayBuffer
from ..errors import EmptyBufferError, FieldError, UnknownIdError
from ..protocol.layout import UNIFORM, Options
from ..protocol.priorities import check_priorities
from ..sampling.limiter import RateLimiter
from ..sampling.samplers import Prioritized, Sampler, check_batch_size, importance_weights, sampler_from_json
from ..schema import Schema
from .shard import (
    MAX_SHARDS,
    SHIFT,
    ShardActor,
    ShardInfo,
    ShardLost,
    draw_rows,
    row_of,
    shard_of,
    shard_state,
    tag,
    unwrap,
)
from .writer import WriterTarget

__all__ = ["ShardedBuffer"]


@dataclass
class _Remote:
    """A remote shard as the learner sees it: the actor, requests in flight, rows received."""

    actor: Any
    inflight: deque[Any] = field(default_factory=deque)
    chunks: deque[dict[str, Any]] = field(default_factory=deque)


class ShardedBuffer:
    """Shards of one buffer on several Ray nodes, sampled as one (see ``shmbuffer.ray``).

    :param schema: the fields, as for ``ReplayBuffer``.
    :param capacity: rows held by each shard.
    :param nodes: Ray node ids to put a shard on, one each (default: every alive node).
    :param sampler: ``Uniform()`` or ``Prioritized(...)``, for every shard and across them.
    :param prefetch: requests kept in flight to each remote shard (0: a round trip per batch).
    :param limiter: a ``RateLimiter`` over the whole system (samples by this learner per row
        inserted into any shard).
    :param force_remote: read every shard through Ray, even the one on this node (testing and
        benchmarking: nodes on one machine share ``/dev/shm``).
    :param seed: seeds the split over shards and the shuffling of prefetched rows.
    :param timeout: seconds to wait for the shards to start.
    :param sources: a saved shard's directory per node (``load`` gives them): the shards hold its
        rows, ids and priorities instead of starting empty.
    :param options: more ``ReplayBuffer`` options for each shard (``lanes``, ``envs``,
        ``episodes``, ``max_use``).
    """

    _closed = True
    _actors: list[Any] = []  # noqa: RUF012  (a class default so close() works after a failed __init__)

    def __init__(
        self, schema: Schema | Mapping[str, Any], capacity: int, *, nodes: Sequence[str] | None = None,
        sampler: Sampler = UNIFORM, prefetch: int = 2, limiter: RateLimiter | None = None,
        force_remote: bool = False, seed: int | None = None, timeout: float = 120.0,
        sources: Sequence[str] | None = None, **options: Any,
    ) -> None:
        timeout = arguments.timeout(timeout, "ShardedBuffer: timeout")
        if sampler.served is None:
            raise ValueError(f"ShardedBuffer: sampler {sampler!r} draws with its own draw only (served=None), and a "
                             "batch split over shards by their sizes would not be its distribution: sample such a "
                             "buffer on one machine (ReplayBuffer), or use Uniform() or Prioritized()")
        if not ray.is_initialized():
            raise RuntimeError("ShardedBuffer: connect to a Ray cluster first (ray.init(address=...))")
        schema = schema if isinstance(schema, Schema) else Schema(schema)
        if nodes is None:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        nodes = list(nodes)
        if sources is not None and len(sources) != len(nodes):
            raise ValueError(f"ShardedBuffer: {len(sources)} sources for {len(nodes)} nodes; give one per node")
        if not 1 <= len(nodes) <= MAX_SHARDS:
            raise ValueError(f"ShardedBuffer: expected 1 to {MAX_SHARDS} nodes, got {len(nodes)}")
        if limiter is not None and limiter.block_writers:
            raise ValueError("ShardedBuffer: limiter=RateLimiter(block_writers=True) is not supported across "
                             "shards; the learner's side holds the ratio (block_writers=False)")
        if prefetch < 0:
            raise ValueError(f"ShardedBuffer: prefetch must be >= 0, got {prefetch!r}")
        self.schema, self.sampler, self.prefetch, self.limiter = schema, sampler, prefetch, limiter
        self.rng = np.random.default_rng(seed)
        self.token = f"sb{os.getpid()}-{secrets.token_hex(3)}"
        self.namespace = ray.get_runtime_context().namespace
        self.address = ray.get_runtime_context().gcs_address
        self.force_remote = force_remote
        self.remote_calls = 0
        self.lost: list[int] = []
        self._calls = 0
        self._sampled = 0
        self._chunk = 1
        self._closed = False
        self._actors = []
        self._local: ReplayBuffer | None = None
        self._local_index = -1
        self._remote: dict[int, _Remote] = {}
        self._state: dict[int, dict[str, Any]] = {}
        opts = {"sampler": sampler, **options}
        try:
            for i, node in enumerate(nodes):
                name = f"{self.token}-s{i}"
                self._actors.append(ShardActor.options(
                    name=name, namespace=self.namespace, num_cpus=0, max_restarts=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(schema, capacity, {**opts, "name": name}, None if sources is None else str(sources[i])))
            infos = ray.get([a.info.remote() for a in self._actors], timeout=timeout)
            self.shards = tuple(ShardInfo(i, info["node"], info["name"], f"{self.token}-s{i}")
                                for i, info in enumerate(infos))
            self.options: Options = infos[0]["options"]
            here = ray.get_runtime_context().get_node_id()
            for shard, actor in zip(self.shards, self._actors, strict=True):
                if shard.node == here and not force_remote and self._local is None:
                    self._local = ReplayBuffer.attach(shard.name)
                    self._local_index = shard.index
                else:
                    self._remote[shard.index] = _Remote(actor)
            for i, rem in self._remote.items():
                self._state[i] = ray.get(rem.actor.state.remote(), timeout=timeout)
                self.remote_calls += 1
        except BaseException:
            self.close()
            raise

    # -- writers ---------------------------------------------------------------------------
    def writer(self, *, force_remote: bool | None = None, batch_rows: int = 256, failover: bool = False,
               node: str | None = None) -> WriterTarget:
        """A ``WriterTarget`` for writers anywhere (``force_remote`` defaults to the buffer's)."""
        return WriterTarget(self.shards, self.schema, self.options, self.namespace, self.address, node,
                            self.force_remote if force_remote is None else force_remote, batch_rows, failover)

    # -- the state of every shard ----------------------------------------------------------
    @property
    def alive(self) -> list[int]:
        """The indices of the shards not lost."""
        return [s.index for s in self.shards if s.index not in self.lost]

    def _drop(self, i: int, error: BaseException) -> None:
        if i in self.lost:
            return
        self.lost.append(i)
        self._remote.pop(i, None)
        self._state.pop(i, None)
        shard = self.shards[i]
        warnings.warn(ShardLost(f"shard {i} ({shard.name!r} on node {shard.node[:12]}) is gone "
                                f"({type(error).__name__}); sampling goes on from shards {self.alive}"), stacklevel=3)

    def _states(self) -> dict[int, dict[str, Any]]:
        """The latest known state of each live shard (the local one read now)."""
        out = dict(self._state)
        if self._local is not None:
            out[self._local_index] = shard_state(self._local)
        return out

    def refresh(self, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
        """Ask every remote shard for its state now (one round trip, all at once)."""
        timeout = arguments.timeout(timeout, "ShardedBuffer.refresh: timeout")
        refs = {i: rem.actor.state.remote() for i, rem in self._remote.items()}
        self.remote_calls += len(refs)
        for i, ref in refs.items():
            try:
                self._state[i] = ray.get(ref, timeout=timeout)
            except GetTimeoutError:
                continue
            except RayError as e:
                self._drop(i, e)
        return self._states()

    def __len__(self) -> int:
        return sum(s["len"] for s in self.refresh().values())

    @property
    def stats(self) -> dict[str, Any]:
        """Counters summed over the live shards, per shard (with ``pushes``, the push calls its
        actor served), the learner's own, and ``lost``. A round trip to every shard."""
        per: dict[int, dict[str, Any]] = {}
        refs = {i: self._actors[i].stats.remote() for i in self.alive}  # the local one too: its push calls
        self.remote_calls += len(refs)
        for i, ref in refs.items():
            try:
                per[i] = ray.get(ref, timeout=60)
            except RayError as e:
                self._drop(i, e)
        keys = ("inserted", "sampled", "reclaimed", "lock_recoveries", "rows")
        total = {k: sum(int(s[k]) for s in per.values()) for k in keys}
        return {**total, "learner_sampled": self._sampled, "remote_calls": self.remote_calls,
                "lost": list(self.lost), "shards": {i: per[i] for i in sorted(per)}}

    def ls(self) -> list[dict[str, Any]]:
        """Each shard as a row: number, node, buffer name, rows, inserted, alive (``shmbuffer ls``)."""
        st = self.stats["shards"]
        return [{"shard": s.index, "node": s.node, "name": s.name, "alive": s.index in st,
                 "rows": st[s.index]["rows"] if s.index in st else None,
                 "inserted": st[s.index]["inserted"] if s.index in st else None} for s in self.shards]

    # -- sampling --------------------------------------------------------------------------
    def _mass(self, state: dict[str, Any]) -> float:
        return float(state["total"]) if self.sampler.prioritized else float(state["len"])

    def _wait_limiter(self, n: int, timeout: float | None) -> None:
        limiter = self.limiter
        if limiter is None:
            return

        def ready(states: dict[int, dict[str, Any]]) -> bool:
            inserted = sum(s["inserted"] for s in states.values())
            size = sum(s["len"] for s in states.values())
            return limiter.can_sample(inserted, self._sampled, size, n)

        def state() -> str:
            states = self._states()
            return (f"{sum(s['inserted'] for s in states.values())} rows inserted into {len(states)} shards, "
                    f"{self._sampled} sampled, samples_per_insert={limiter.samples_per_insert}, "
                    f"min_size={limiter.min_size}")

        limiter.check_sample_size(n)
        if ready(self._states()):  # the states known; then a round trip to the shards each try
            return
        limiter.wait(lambda: ready(self.refresh()), f"sample of {n} rows", state, timeout)

    def _ask(self, i: int, k: int) -> None:
        rem = self._remote[i]
        rem.inflight.append(rem.actor.sample.remote(k))
        self.remote_calls += 1

    def _receive(self, i: int, reply: dict[str, Any]) -> None:
        rem = self._remote[i]
        self._state[i] = {k: reply[k] for k in ("len", "total", "min", "inserted", "sampled")}
        if reply["index"] is None or not len(reply["index"]):
            return
        order = self.rng.permutation(len(reply["index"]))  # a shard's draw is stratified: any prefix is fair
        rem.chunks.append({"fields": {k: v[order] for k, v in reply["fields"].items()},
                           "index": reply["index"][order],
                           "leaves": None if reply["leaves"] is None else reply["leaves"][order], "at": 0})

    def _take(self, i: int, k: int) -> list[dict[str, Any]]:
        """Up to ``k`` prefetched rows of remote shard ``i`` (fewer when it has none to give)."""
        rem = self._remote[i]
        out: list[dict[str, Any]] = []
        while k > 0:
            if not rem.chunks:
                if not rem.inflight:
                    return out
                reply = ray.get(rem.inflight.popleft())
                self._receive(i, reply)
                self._ask(i, self._chunk)
                if reply["index"] is None:
                    return out
                continue
            c = rem.chunks[0]
            a, b = c["at"], min(c["at"] + k, len(c["index"]))
            out.append({"fields": {f: v[a:b] for f, v in c["fields"].items()}, "index": c["index"][a:b],
                        "leaves": None if c["leaves"] is None else c["leaves"][a:b]})
            k -= b - a
            c["at"] = b
            if b == len(c["index"]):
                rem.chunks.popleft()
        return out

    def _poll(self) -> None:
        """Take in the prefetched replies that have come (their states are newer); a remote shard
        that looked empty is asked now (its reply waited for), so rows pushed since are seen."""
        for i in list(self._remote):
            rem = self._remote[i]
            try:
                if self._mass(self._state[i]) <= 0:
                    if rem.inflight:
                        self._receive(i, ray.get(rem.inflight.popleft()))
                        self._ask(i, self._chunk)
                    else:
                        self.remote_calls += 1
                        self._state[i] = ray.get(rem.actor.state.remote())
                if rem.inflight:
                    ready, _ = ray.wait(list(rem.inflight), num_returns=len(rem.inflight), timeout=0)
                    while rem.inflight and rem.inflight[0] in ready:
                        self._receive(i, ray.get(rem.inflight.popleft()))
                        self._ask(i, self._chunk)
            except RayError as e:
                self._drop(i, e)

    def sample(self, n: int, *, timeout: float | None = None) -> Batch:
        """``n`` rows drawn as one buffer of every shard's rows would draw them (see
        ``shmbuffer.ray``). ``batch.index`` are global ids (``shard_of``), ``batch.shard`` the shards;
        prioritized batches have ``weight``. ``EmptyBufferError`` when no shard has rows."""
        n = check_batch_size(n)
        self._wait_limiter(n, timeout)
        self._chunk = n
        if self.prefetch:
            for i, rem in self._remote.items():
                while len(rem.inflight) < self.prefetch:
                    self._ask(i, n)
        self._poll()
        parts: list[tuple[int, dict[str, Any]]] = []
        want = n
        rounds = 0
        states: dict[int, dict[str, Any]] = {}
        while want > 0:
            states = self._states()
            idx = list(states)
            mass = np.array([self._mass(states[i]) for i in idx])
            if mass.sum() <= 0 and self._remote:  # remote states may be stale: ask once more
                states = self.refresh()
                idx = list(states)
                mass = np.array([self._mass(states[i]) for i in idx])
            if mass.sum() <= 0 or rounds > 1000:
                raise EmptyBufferError(f"sample({n}): no shard holds a row that can be drawn "
                                       f"(shards {self.alive}, lost {self.lost}); push rows first")
            counts = self.rng.multinomial(want, mass / mass.sum())
            want = 0
            direct = {}
            for i, c in zip(idx, counts, strict=True):
                if not c:
                    continue
                if i == self._local_index and self._local is not None:
                    got = draw_rows(self._local, int(c))
                    if got["index"] is not None:
                        parts.append((i, got))
                        want += int(c) - len(got["index"])
                    else:
                        want += int(c)
                elif not self.prefetch:
                    direct[i] = (self._remote[i].actor.sample.remote(int(c)), int(c))
                    self.remote_calls += 1
                else:
                    try:
                        got_parts = self._take(i, int(c))
                    except RayError as e:
                        self._drop(i, e)
                        want += int(c)
                        continue
                    parts.extend((i, p) for p in got_parts)
                    want += int(c) - sum(len(p["index"]) for p in got_parts)
            for i, (ref, c) in direct.items():
                try:
                    reply = ray.get(ref)
                except RayError as e:
                    self._drop(i, e)
                    want += c
                    continue
                self._state[i] = {k: reply[k] for k in ("len", "total", "min", "inserted", "sampled")}
                if reply["index"] is not None:
                    parts.append((i, reply))
                    want += c - len(reply["index"])
                else:
                    want += c
            rounds += 1
        self._calls += 1
        self._sampled += n
        return self._join(parts, states)

    def _join(self, parts: list[tuple[int, dict[str, Any]]], states: dict[int, dict[str, Any]]) -> Batch:
        fields = {name: np.concatenate([p["fields"][name] for _, p in parts]) for name in self.schema.names}
        index = np.concatenate([tag(i, p["index"]) for i, p in parts])
        shard = np.concatenate([np.full(len(p["index"]), i, np.int16) for i, p in parts])
        extras: dict[str, Any] = {"index": index, "shard": shard}
        sampler = self.sampler
        if sampler.prioritized:
            leaves = np.concatenate([p["leaves"] for _, p in parts])
            mins = [s["min"] for s in states.values() if s["len"] and np.isfinite(s["min"]) and s["min"] > 0]
            low = min(mins) if mins else float("inf")
            extras["weight"] = importance_weights(leaves, low, cast(Prioritized, sampler).beta_at(self._calls - 1))
        return Batch(fields, extras)

    def update_priorities(self, rows: Batch | Any, priorities: Any) -> int:
        """Send each row's priority to its shard; returns how many rows were updated. Rows
        overwritten since, and rows of lost shards, are skipped. Priorities, and ids that name no
        shard, are checked before any shard is touched (``FieldError``, ``UnknownIdError``); ids a
        shard never had raise ``UnknownIdError`` from that shard, which then changed nothing, but
        the other shards of the call may have been updated (a check would cost a round trip)."""
        ids = rows.index if isinstance(rows, Batch) else rows
        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise FieldError(f"update_priorities: expected integer row ids (batch.index), got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        p = check_priorities(priorities, ids.size, "update_priorities: priority")
        shard = shard_of(ids)
        bad = (ids < 0) | (shard >= len(self.shards))
        if bad.any():
            raise UnknownIdError(
                f"update_priorities: ids {ids[bad][:5].tolist()} name no shard of this buffer (shards 0 to "
                f"{len(self.shards) - 1} in bits {SHIFT}+): pass batch.index as it came; nothing was changed")
        done = 0
        refs = {}
        for i in np.unique(shard).tolist():
            mine = shard == i
            local_ids, local_p = row_of(ids[mine]), p[mine]
            if i == self._local_index and self._local is not None:
                done += self._local.update_priorities(local_ids, local_p)
            elif i in self._remote:
                refs[i] = self._remote[i].actor.update_priorities.remote(local_ids, local_p)
                self.remote_calls += 1
        for i, ref in refs.items():
            try:
                reply = ray.get(ref)
            except RayError as e:
                self._drop(i, e)
                continue
            done += unwrap(reply)
        return done

    # -- persistence and lifecycle -----------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """One directory per live shard (``shard-<i>``, written by its actor on its node) and
        ``manifest.json`` naming them; returns the manifest."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=False)
        refs = {}
        for shard in self.shards:
            if shard.index in self.lost:
                continue
            refs[shard.index] = self._actors[shard.index].save.remote(str(root / f"shard-{shard.index}"))
        self.remote_calls += len(refs)
        saved = []
        for i, ref in refs.items():
            try:
                meta = ray.get(ref)
            except RayError as e:
                self._drop(i, e)
                continue
            saved.append({"shard": i, "node": self.shards[i].node, "dir": f"shard-{i}",
                          "rows": int(meta.get("rows", -1)) if isinstance(meta, dict) else -1})
        manifest = {"format": "shmbuffer-shards", "version": 1, "schema": self.schema.to_json(),
                    "sampler": self.sampler.to_json(), "shards": saved, "lost": list(self.lost)}
        (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return manifest

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, nodes: Sequence[str] | None = None, **kwargs: Any) -> ShardedBuffer:
        """Shards holding a ``save``: shard ``i`` is loaded on the node that saved it (or on
        ``nodes[i]``) from ``<path>/shard-<i>``, which must be on that node's filesystem; ids keep
        their shard. ``kwargs``: the constructor's (``prefetch``, ``limiter``, ``seed`` ...)."""
        root = Path(path)
        manifest = _manifest(root)
        saved = sorted(manifest["shards"], key=lambda m: m["shard"])
        if [m["shard"] for m in saved] != list(range(len(saved))):
            raise ValueError(f"{root}: the save holds shards {[m['shard'] for m in saved]} (shard(s) "
                             f"{manifest.get('lost')} were lost before it); ids name their shard by number, "
                             "so load needs every shard from 0")
        if nodes is None:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            gone = [m["shard"] for m in saved if m["node"] not in alive]
            if gone:
                raise ValueError(f"load: the nodes that saved shard(s) {gone} are not in the cluster; "
                                 "give nodes=[...], one per shard, each holding its shard-<i> directory")
            nodes = [m["node"] for m in saved]
        if len(nodes) != len(saved):
            raise ValueError(f"load: nodes names {len(nodes)} node(s), the save holds {len(saved)} shards: give one "
                             "node per shard, in shard order")
        return cls(Schema.from_json(manifest["schema"]), 1, nodes=nodes,
                   sampler=sampler_from_json(manifest["sampler"]),
                   sources=[str(root / m["dir"]) for m in saved], **kwargs)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has been called."""
        return self._closed

    def close(self, timeout: float = 30.0) -> None:
        """Close the local view, remove every shard (its block and its actor). Idempotent."""
        timeout = arguments.timeout(timeout, "ShardedBuffer.close: timeout")
        if self._closed and not self._actors:
            return
        self._closed = True
        if self._local is not None:
            try:
                self._local.close()
            except BufferError:
                pass
            self._local = None
        refs = []
        for i, actor in enumerate(self._actors):
            if i not in self.lost:
                try:
                    refs.append(actor.close.remote())
                except RayError:
                    pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
            except RayError:
                pass
        for actor in self._actors:
            try:
                ray.kill(actor)
            except (RayError, ValueError):
                pass
        self._actors = []
        self._remote.clear()

    def __enter__(self) -> ShardedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.shards)} shards, lost {self.lost}"
        return f"ShardedBuffer({self.token!r}, {state}, {self.schema})"


def _manifest(root: Path) -> dict[str, Any]:
    """``<root>/manifest.json`` (``ShardedBuffer.save``'s), checked before anything is made from it:
    every entry a load reads, each shard's directory a plain name inside ``root``."""
    file = root / "manifest.json"
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not a ShardedBuffer save's manifest ({e}); give the directory save() wrote") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "shmbuffer-shards" or manifest.get("version") != 1:
        got = manifest if not isinstance(manifest, dict) else f"{manifest.get('format')!r} version {manifest.get('version')!r}"
        raise ValueError(f"{file}: expected format 'shmbuffer-shards' version 1, got {got}")

    def bad(what: str, got: Any) -> ValueError:
        return ValueError(f"{file}: {what} expected, got {got!r}; the manifest was altered, or is not one save() wrote")

    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("'shards': a non-empty list", shards)
    for m in shards:
        if not isinstance(m, dict) or type(m.get("shard")) is not int or not isinstance(m.get("node"), str):
            raise bad("each shard: {'shard': int, 'node': str, 'dir': str}", m)
        d = m.get("dir")
        if not isinstance(d, str) or not d or d in (".", "..") or "/" in d or "\\" in d:
            raise bad("each shard's 'dir': a directory name inside the save", d)
    for key in ("schema", "sampler"):
        if key not in manifest:
            raise bad(f"{key!r}", None)
    return manifest
