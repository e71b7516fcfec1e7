"""The compressed Atari case: frames stored once (``next_of="obs", stack="obs"``, ``frames.py``)
against the same buffer storing ``obs`` and ``next_obs`` whole and against the peers' own
compressed buffers.

* ``atari.compressed``: stacked Atari transitions (``obs`` uint8[4, 84, 84], ``action`` int64,
  ``reward`` float32, ``next_obs`` uint8[4, 84, 84], ``done`` bool) from 8 envs, each a stream of
  episodes of 100-200 steps, padded at an episode's start as Gymnasium's
  ``FrameStackObservation`` pads (copies of the first frame). Measured, at capacity 50,000
  (``--quick``: 2,048), all subjects full: push of 256 transitions a call (rows/s) and uniform
  sample of 256 stacked transitions (batches/s, as numpy and as torch tensors); the bytes each
  subject holds per transition; and the bytes of our compressed buffer at capacity 1,000,000,
  computed from its column table (``layout.columns``) without allocating, and measured on a real
  buffer at the largest capacity up to 1,000,000 that this machine's free memory and /dev/shm
  hold (``--quick``: 20,000), filled to capacity and checked.

Subjects:

* shmbuffer: ``ReplayBuffer(schema, capacity, envs=8, next_of="obs", stack="obs")``; a push is 32
  steps of the 8 envs (256 rows, env-major per step, one lane per env), in one call.
* shmbuffer, uncompressed (the baseline): the same without ``next_of``/``stack``.
* Stable-Baselines3: ``ReplayBuffer(capacity, obs_space, action_space, n_envs=8,
  optimize_memory_usage=True, handle_timeout_termination=False)`` (SB3 refuses the two together);
  a push is 32 ``add`` calls of one step of the 8 envs (its API takes one step a call). It keeps
  ``next_obs`` as the next step's ``obs`` and stores whole stacks: an episode's final observation is
  overwritten by the next episode's first (its docs' known limitation, which the sanity check
  allows for exactly those transitions and counts).
* cpprb: ``ReplayBuffer(capacity, env_dict, next_of="obs", stack_compress="obs")``. cpprb's
  ``stack_compress`` needs the stack on the last axis, so its observations are (84, 84, 4),
  transposed up front (as a channel-last env wrapper would hand them over), and its batches come
  back channel-last. It keeps one stream of steps: a push is 256 consecutive steps of one env,
  split at episode ends by ``on_episode_end()``, as its docs require.

Sanity checks, before timing, on a small buffer of each subject that has wrapped round: every
sampled transition's fields equal what was pushed for it (frames carry their env and frame number,
actions their env and step), whole stacks included.
"""

from __future__ import annotations

import os
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import peers
from .harness import BATCH, Case, Config, Metric, Op, Subject, case_result, measure
from .peers import Unavailable, need

ENVS = 8
STEPS = 32  # steps of the 8 envs a push: 256 transitions
CYCLE = 256  # steps a env's stream repeats after (its last step ends an episode)
EPISODES = (100, 156)  # per env, shifted by 7 * env
K = 4
FRAME = (84, 84)
FIELDS = {"obs": ((K, *FRAME), "uint8"), "action": ((), "int64"), "reward": ((), "float32"),
          "next_obs": ((K, *FRAME), "uint8"), "done": ((), "bool")}
SMALL = 8 + 4 + 1  # action, reward, done
FRAME_BYTES = FRAME[0] * FRAME[1]
TEMPLATES = 31
CAPACITY, QUICK_CAPACITY = 50_000, 2_048
BIG, QUICK_BIG = 1_000_000, 20_000
GIB = 2 ** 30


# -- the data: 8 envs' streams of stacked, self-verifying transitions ---------------------------------
@dataclass
class Streams:
    """Per env ``e`` and step ``t < CYCLE``: ``obs[e, t]``, ``next_obs[e, t]`` (``(K, 84, 84)``),
    ``action = e << 16 | t``, ``reward = t % 7``, ``done`` at an episode's last step. Frame ``f`` of
    env ``e`` is a random template with ``(e, f)`` as two int64 in its first 16 bytes."""

    obs: np.ndarray  # (ENVS, CYCLE, K, 84, 84)
    next_obs: np.ndarray
    action: np.ndarray  # (ENVS, CYCLE)
    reward: np.ndarray
    done: np.ndarray
    seen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("transitions", "episode ends", "episode starts"), 0))
    """what ``check`` has checked: transitions, of them episodes' last and first steps"""

    @classmethod
    def make(cls) -> Streams:
        rng = np.random.default_rng(7)
        templates = rng.integers(0, 256, (TEMPLATES, FRAME_BYTES), dtype=np.uint8)
        obs = np.empty((ENVS, CYCLE, K, *FRAME), np.uint8)
        nxt = np.empty_like(obs)
        done = np.zeros((ENVS, CYCLE), bool)
        for e in range(ENVS):
            first = EPISODES[0] + 7 * e
            lengths = (first, CYCLE - first)
            frames = templates[(e * 5 + np.arange(CYCLE + len(lengths))) % TEMPLATES].copy()
            words = frames.view(np.int64)
            words[:, 0] = e
            words[:, 1] = np.arange(len(frames))
            frames = frames.reshape(-1, *FRAME)
            t0 = f0 = 0
            for length in lengths:
                t = np.arange(length)
                back = np.arange(-K + 1, 1)
                obs[e, t0:t0 + length] = frames[f0 + np.maximum(t[:, None] + back, 0)]
                nxt[e, t0:t0 + length] = frames[f0 + np.maximum(t[:, None] + 1 + back, 0)]
                done[e, t0 + length - 1] = True
                t0 += length
                f0 += length + 1  # an episode's frames: its first and one after each step
        steps = np.arange(CYCLE)
        action = (np.arange(ENVS)[:, None] << 16) | steps[None, :]
        reward = np.broadcast_to((steps % 7).astype(np.float32), (ENVS, CYCLE)).copy()
        return cls(obs, nxt, action.astype(np.int64), reward, done)

    def pushes(self) -> list[dict[str, np.ndarray]]:
        """The ``CYCLE // STEPS`` pushes of a cycle: ``STEPS`` steps of every env, env-major per step."""
        out = []
        for j in range(CYCLE // STEPS):
            s = slice(j * STEPS, (j + 1) * STEPS)
            out.append({n: np.ascontiguousarray(np.swapaxes(getattr(self, n)[:, s], 0, 1)).reshape(
                STEPS * ENVS, *getattr(self, n).shape[2:]) for n in FIELDS})
        return out

    def check(self, got: dict[str, np.ndarray], *, channels_last: bool = False,
              final_may_differ: bool = False) -> int:
        """Raise ``Unavailable("wrong data")`` unless every transition of ``got`` (numpy, ``(n, ...)``)
        is the one pushed with its action; returns how many next observations differed where
        ``final_may_differ`` allows it (an episode's last step)."""
        action = np.asarray(got["action"]).reshape(-1).astype(np.int64)
        e, t = action >> 16, action & 0xFFFF
        if not ((0 <= e) & (e < ENVS) & (0 <= t) & (t < CYCLE)).all():
            raise Unavailable("wrong data", "sampled actions that were never pushed")
        allowed = 0
        self.seen["transitions"] += len(action)
        self.seen["episode ends"] += int(self.done[e, t].sum())
        self.seen["episode starts"] += int((self.obs[e, t][:, 0] == self.obs[e, t][:, -1]).all(axis=(1, 2)).sum())
        for name in ("obs", "next_obs"):
            a = np.asarray(got[name])
            if channels_last:
                a = np.moveaxis(a, -1, 1)
            same = (a.reshape(len(a), -1) == getattr(self, name)[e, t].reshape(len(a), -1)).all(axis=1)
            if name == "next_obs" and final_may_differ:
                allowed = int((~same & self.done[e, t]).sum())
                same |= self.done[e, t]
            if not same.all():
                raise Unavailable("wrong data", f"{(~same).sum()} of {len(a)} sampled {name} differ from those pushed")
        for name in ("reward", "done"):
            a = np.asarray(got[name]).reshape(-1)
            if not (a.astype(getattr(self, name).dtype) == getattr(self, name)[e, t]).all():
                raise Unavailable("wrong data", f"sampled {name} differ from those pushed")
        return allowed


_CACHE: dict[str, Any] = {}


def streams() -> Streams:
    if "streams" not in _CACHE:
        _CACHE["streams"] = Streams.make()
    return _CACHE["streams"]


def pushes() -> list[dict[str, np.ndarray]]:
    """``streams().pushes()``, made once (the subjects only read them)."""
    if "pushes" not in _CACHE:
        _CACHE["pushes"] = streams().pushes()
    return _CACHE["pushes"]


def schema() -> Any:
    import shmbuffer as sb

    return sb.Schema(**FIELDS)


def to_numpy(batch: Any) -> dict[str, np.ndarray]:
    """SB3's ``ReplayBufferSamples`` or a dict of tensors / arrays as numpy, our field names."""
    if hasattr(batch, "observations"):
        batch = {"obs": batch.observations, "action": batch.actions, "reward": batch.rewards,
                 "next_obs": batch.next_observations, "done": batch.dones}
    return {k: v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v) for k, v in batch.items()}


# -- the subjects ---------------------------------------------------------------------------------------
class Subjectish:
    """One library's buffer: ``push()`` pushes the next 256 transitions of the streams (round and
    round), ``sample(n)`` / ``sample_torch(n)``, ``nbytes`` the memory it holds, ``held`` the
    transitions it holds when full."""

    name = ""
    kind = "peer"
    numpy_sample = True
    final_may_differ = False
    channels_last = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def push(self) -> Any:
        raise NotImplementedError

    def sample(self, n: int) -> Any:
        raise NotImplementedError

    def sample_torch(self, n: int) -> Any:
        import torch

        return {k: torch.from_numpy(v) for k, v in self.sample(n).items()}

    def nbytes(self) -> int:
        raise NotImplementedError

    def held(self) -> int:
        return self.capacity

    def close(self) -> None:
        pass


class Ours(Subjectish):
    name = "shmbuffer"
    kind = "ours"
    compressed = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        import shmbuffer as sb

        stored_once = "obs" if self.compressed else None
        self.buf: Any = sb.ReplayBuffer(schema(), capacity, envs=ENVS, name=peers.buffer_name(peers.Ours.prefix),
                                        seed=0, next_of=stored_once, stack=stored_once)
        self._pushes = pushes()
        self._next = 0

    def push(self) -> Any:
        rows = self._pushes[self._next]
        self._next = (self._next + 1) % len(self._pushes)
        return self.buf.push(rows)

    def sample(self, n: int) -> Any:
        return self.buf.sample(n)

    def sample_torch(self, n: int) -> Any:
        return self.buf.sample(n).to("cpu")

    def nbytes(self) -> int:
        from shmbuffer.shm import segment

        return os.path.getsize(segment.path_of(self.buf.handle.name))

    def held(self) -> int:
        return len(self.buf)

    def close(self) -> None:
        peers.close_ours(self.buf)


class Plain(Ours):
    name = "shmbuffer, uncompressed"
    kind = "baseline"
    compressed = False


class SB3(Subjectish):
    name = "sb3.ReplayBuffer(optimize_memory_usage=True)"
    numpy_sample = False
    final_may_differ = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        need("stable_baselines3")
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer

        self.rb = ReplayBuffer(capacity, spaces.Box(0, 255, (K, *FRAME), np.uint8), spaces.Discrete(18), device="cpu",
                               n_envs=ENVS, optimize_memory_usage=True, handle_timeout_termination=False)
        s = streams()
        self._steps = [(s.obs[:, t], s.next_obs[:, t], s.action[:, t], s.reward[:, t], s.done[:, t])
                       for t in range(CYCLE)]
        self._infos: list[dict[str, Any]] = [{} for _ in range(ENVS)]
        self._next = 0

    def push(self) -> Any:
        for _ in range(STEPS):
            obs, nxt, act, rew, done = self._steps[self._next]
            self.rb.add(obs, nxt, act, rew, done, self._infos)
            self._next = (self._next + 1) % CYCLE

    def sample_torch(self, n: int) -> Any:
        return self.rb.sample(n)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self.rb).values() if isinstance(a, np.ndarray))

    def held(self) -> int:
        return (self.rb.buffer_size - 1) * ENVS  # the newest step's next observation is not there yet


class Cpprb(Subjectish):
    name = "cpprb.ReplayBuffer(next_of, stack_compress)"
    channels_last = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        cpprb = need("cpprb")
        env_dict = {"obs": {"shape": (*FRAME, K), "dtype": np.uint8}, "action": {"shape": 1, "dtype": np.int64},
                    "reward": {"shape": 1, "dtype": np.float32}, "done": {"shape": 1, "dtype": np.bool_}}
        traced = tracemalloc.is_tracing()
        if not traced:
            tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        self.rb = cpprb.ReplayBuffer(capacity, env_dict, next_of="obs", stack_compress="obs")
        self._nbytes = tracemalloc.get_traced_memory()[0] - before  # its arrays, allocated by numpy
        if not traced:
            tracemalloc.stop()
        s = streams()
        e = 0  # one stream: env 0's steps, cut at its episode ends
        ends = [int(t) + 1 for t in np.flatnonzero(s.done[e])]
        self._chunks = []
        for a, b in zip([0, *ends[:-1]], ends, strict=True):
            self._chunks.append({"obs": np.ascontiguousarray(np.moveaxis(s.obs[e, a:b], 1, -1)),
                                 "next_obs": np.ascontiguousarray(np.moveaxis(s.next_obs[e, a:b], 1, -1)),
                                 "action": s.action[e, a:b, None], "reward": s.reward[e, a:b, None],
                                 "done": s.done[e, a:b, None]})

    def push(self) -> Any:  # 256 steps: the whole cycle of env 0, two episodes
        for chunk in self._chunks:
            self.rb.add(**chunk)
            self.rb.on_episode_end()

    def sample(self, n: int) -> Any:
        return self.rb.sample(n)

    def nbytes(self) -> int:
        return self._nbytes


SUBJECTS: list[type[Subjectish]] = [Ours, Plain, SB3, Cpprb]
NOTES = {
    Ours.name: "`ReplayBuffer(schema, capacity, envs=8, next_of=\"obs\", stack=\"obs\")`; `push(rows)` of 32 steps "
               "of 8 envs (256 rows); `sample(256)`, `.to('cpu')` for torch",
    Plain.name: "the same without next_of/stack: obs and next_obs stored whole",
    SB3.name: "`ReplayBuffer(capacity, obs_space, action_space, n_envs=8, optimize_memory_usage=True, "
              "handle_timeout_termination=False)`; 32 `add()` of one step of 8 envs a push; `sample(256)` "
              "(torch tensors). An episode's final next_obs is lost (overwritten by the next episode's first obs)",
    Cpprb.name: "`ReplayBuffer(capacity, env_dict, next_of=\"obs\", stack_compress=\"obs\")`, obs (84, 84, 4) "
                "channel-last (stack_compress needs the stack last); `add()` of one env's consecutive steps, "
                "`on_episode_end()` after each episode; `sample(256)` (dict of numpy, channel-last)",
}


def available(cls: type[Subjectish]) -> None:
    need({Ours: "shmbuffer", Plain: "shmbuffer", SB3: "stable_baselines3", Cpprb: "cpprb"}[cls])


def fill(store: Subjectish, capacity: int) -> None:
    """Push until the buffer is full and has wrapped once (every page touched)."""
    for _ in range(-(-capacity // (STEPS * ENVS)) + CYCLE // STEPS):
        store.push()


def sanity(cls: type[Subjectish], _done: dict[str, Unavailable | None] = {}) -> None:  # noqa: B006
    """A small buffer of ``cls``, wrapped round: every sampled transition is the one pushed."""
    if cls.name not in _done:
        _done[cls.name] = None
        try:
            store = cls(ENVS * 160)
            try:
                # wrapped round, and the rows held (steps 32-191 of the cycle) have episode ends and starts
                for _ in range(CYCLE // STEPS + 6):
                    store.push()
                allowed, before = 0, dict(streams().seen)
                for _ in range(4):
                    allowed += streams().check(to_numpy(store.sample_torch(BATCH)), channels_last=cls.channels_last,
                                               final_may_differ=cls.final_may_differ)
                    if cls.numpy_sample:
                        streams().check(to_numpy(store.sample(BATCH)), channels_last=cls.channels_last)
                seen = {k: v - before[k] for k, v in streams().seen.items()}
                _SANITY[cls.name] = {"checked": seen, "final_next_obs_lost": allowed}
            finally:
                store.close()
        except Unavailable as e:
            _done[cls.name] = e
        except Exception as e:
            _done[cls.name] = Unavailable("error", f"sanity check raised {type(e).__name__}: {e}")
    if _done[cls.name] is not None:
        raise _done[cls.name]  # type: ignore[misc]


_SANITY: dict[str, dict[str, Any]] = {}


def subject(cls: type[Subjectish], capacity: int, memory: dict[str, dict[str, Any]]) -> Subject:
    def check() -> None:
        available(cls)
        sanity(cls)

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        store = cls(capacity)
        try:
            fill(store, capacity)
            memory[cls.name] = {"bytes": store.nbytes(), "transitions": store.held(),
                                "bytes_per_transition": store.nbytes() / store.held()}
            ops: dict[str, Op] = {"push": store.push, "torch": lambda: store.sample_torch(BATCH)}
            if cls.numpy_sample:
                ops["numpy"] = lambda: store.sample(BATCH)
            return ops, store.close
        except BaseException:
            store.close()
            raise

    row = 2 * K * FRAME_BYTES + SMALL
    per = {Ours: FRAME_BYTES + SMALL + 11, Plain: row + 10, SB3: K * FRAME_BYTES + 20, Cpprb: FRAME_BYTES + SMALL}[cls]
    return Subject(cls.name, cls.kind, setup, capacity * per, NOTES[cls.name], check)


# -- bytes at 1,000,000: computed, and a real buffer ---------------------------------------------------
def computed(capacity: int) -> dict[str, Any]:
    """Our block's bytes at ``capacity`` from its column table, compressed and not (nothing allocated)."""
    from shmbuffer.frames import PLAIN, Frames
    from shmbuffer.protocol.layout import Options, columns

    sch = schema()
    opts = Options(capacity, ENVS, envs=ENVS, rows=Frames.make(sch, "obs", "obs"))
    comp = sum(c.nbytes for c in columns(sch, opts))
    plain = sum(c.nbytes for c in columns(sch, replace(opts, rows=PLAIN)))
    one = FRAME_BYTES + SMALL
    return {"capacity": capacity, "bytes": comp, "gib": comp / GIB, "bytes_per_row": comp / capacity,
            "uncompressed_bytes": plain, "uncompressed_gib": plain / GIB, "uncompressed_bytes_per_row": plain / capacity,
            "one_frame_plus_small": one, "per_row_vs_one_frame": comp / capacity / one, "saving": plain / comp}


def real(cfg: Config) -> dict[str, Any]:
    """Our compressed buffer at the largest capacity up to 1,000,000 (a multiple of the envs) that
    half this machine's free memory and /dev/shm hold, filled and checked; its /dev/shm size."""
    import psutil

    per = computed(BIG)["bytes_per_row"]
    free = min(psutil.virtual_memory().available, os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize)
    want = QUICK_BIG if cfg.quick else BIG
    capacity = int(min(want, 0.5 * free / per)) // (STEPS * ENVS) * (STEPS * ENVS)
    if capacity < STEPS * ENVS:
        return {"status": "skipped", "reason": f"{free / GIB:.1f} GiB free: not enough for a real buffer"}
    t0 = time.perf_counter()
    store = Ours(capacity)
    try:
        fill(store, capacity)
        filled = time.perf_counter() - t0
        from shmbuffer.shm import segment

        st = os.stat(segment.path_of(store.buf.handle.name))
        for _ in range(4):
            streams().check(to_numpy(store.sample(BATCH)))
        t1 = time.perf_counter()
        n = 0
        while time.perf_counter() - t1 < (0.2 if cfg.quick else 2.0):
            store.sample(BATCH)
            n += 1
        rate = n / (time.perf_counter() - t1)
        return {"status": "ok", "capacity": capacity, "bytes": st.st_size, "gib": st.st_size / GIB,
                "resident_bytes": st.st_blocks * 512, "bytes_per_row": st.st_size / capacity,
                "transitions": store.held(), "fill_s": round(filled, 1), "sample256_per_s": rate,
                "free_gib": free / GIB, "checked": 4 * BATCH}
    finally:
        store.close()


# -- the case ---------------------------------------------------------------------------------------------
TARGETS = [
    ("bytes", "bytes per transition <= 1.15x one 84x84 frame plus the small fields"),
    ("uncompressed", "sample 256 >= 0.7x the uncompressed buffer's batches/s"),
    ("cpprb", "sample 256 ahead of cpprb's compressed buffer"),
    ("8gib", "1,000,000 Atari transitions fit in 8 GiB"),
]


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    subj, mem, one = res["subjects"], res["memory"], FRAME_BYTES + SMALL

    def med(who: str, metric: str) -> float | None:
        s = subj.get(who, {})
        return s.get("metrics", {}).get(metric, {}).get("median") if s.get("status") == "ok" else None

    out = []
    for key, text in TARGETS:
        row: dict[str, Any] = {"id": key, "text": text}
        if key == "bytes":
            got = mem.get(Ours.name, {}).get("bytes_per_transition")
            need_ = 1.15
            value = None if got is None else got / one
            detail = None if got is None else f"{got:,.0f} bytes per transition = {value:.3f}x {one:,} (needs <= 1.15x)"
            met = value is not None and value <= need_
        elif key == "8gib":
            value = res["computed"]["gib"]
            detail = f"{res['computed']['bytes']:,} bytes = {value:.2f} GiB at capacity 1,000,000 (computed)"
            met = value <= 8
        else:
            other = Plain.name if key == "uncompressed" else Cpprb.name
            need_ = 0.7 if key == "uncompressed" else 1.0
            mine, theirs = med(Ours.name, "numpy"), med(other, "numpy")
            value = mine / theirs if mine and theirs else None
            detail = None if value is None else f"{value:.2f}x {other} (numpy batches; needs {need_:g}x)"
            met = value is not None and value >= need_
        row.update(value=value, detail=detail or "not measured",
                   status="not measured" if value is None else "met" if met else "missed")
        out.append(row)
    return out


def compressed_case(cfg: Config) -> dict[str, Any]:
    cap = QUICK_CAPACITY if cfg.quick else CAPACITY
    cap -= cap % (STEPS * ENVS)
    metrics = {"push": Metric(f"push {STEPS * ENVS} transitions", "rows/s", STEPS * ENVS, 2 * K * FRAME_BYTES + SMALL),
               "numpy": Metric(f"sample {BATCH} stacked as numpy", "batches/s", 1, BATCH * (2 * K * FRAME_BYTES + SMALL)),
               "torch": Metric(f"sample {BATCH} stacked as torch tensors", "batches/s", 1,
                               BATCH * (2 * K * FRAME_BYTES + SMALL))}
    memory: dict[str, dict[str, Any]] = {}
    subjects = [subject(c, cap, memory) for c in SUBJECTS]
    res = measure(subjects, metrics, cfg)
    for name, m in memory.items():
        res[name]["memory"] = m
    for name, checked in _SANITY.items():
        if name in res:
            res[name]["sanity"] = checked
    if res.get(SB3.name, {}).get("sanity"):
        lost, seen = res[SB3.name]["sanity"]["final_next_obs_lost"], res[SB3.name]["sanity"]["checked"]
        res[SB3.name]["final_next_obs_lost"] = (
            f"{lost} of the {seen['episode ends']} episode ends among {seen['transitions']} sampled transitions "
            "returned the next episode's first observation as next_obs")
    out = case_result(f"Atari, frames stored once: push {STEPS * ENVS} and sample {BATCH} stacked transitions "
                      f"from {ENVS} envs", None, cfg, metrics, res, capacity=cap,
                      row_bytes=2 * K * FRAME_BYTES + SMALL, memory=memory, computed=computed(BIG), real=real(cfg))
    out["targets"] = targets(out)
    for t in out["targets"]:
        print(f"    target: {t['text']}: {t['status']} ({t['detail']})", flush=True)
    return out


def register(cases: dict[str, Case]) -> None:
    cases["atari.compressed"] = Case("atari.compressed", "frames stored once (next_of + stack) vs uncompressed, "
                                     "SB3 optimize_memory_usage, cpprb next_of + stack_compress", "sample",
                                     compressed_case)
