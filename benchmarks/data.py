"""The two schemas and self-verifying rows.

Every value of a row derives from two numbers, the writer ``w`` and its sequence number ``seq``, so
a row read back can be checked on its own: ``check`` recovers ``(w, seq)`` from the row and
recomputes everything else. A torn row (half one row, half another) fails, and so does an empty or
garbage row.

MuJoCo-like rows (float32 values, all exact): ``obs = [w, seq // 4096, seq % 4096, body(c)]`` with
``c = seq % 251``, ``next_obs = obs + 0.5``, ``action = -(8c + j)``, ``reward = c + 0.25``,
``done = c odd``.

Atari-like rows: ``obs`` is the random byte pattern ``T[c]`` (``c = seq % 31``) with ``(w, seq)`` as
two int64 in its first and last 16 bytes; ``next_obs`` the same over ``T[c + 1]``; ``action = seq``;
``reward = c + 0.5``; ``done = c odd``. ``check`` compares the headers, trailers and every 61st body
byte (``full=True``: every byte).

``Stamper`` makes a writer's 8-row batches cheaply: it keeps one prepared batch per class and only
writes the sequence numbers into it before each push (the pushes copy the batch).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

Fields = dict[str, np.ndarray]

MUJOCO_P = 251
ATARI_P = 31
ATARI_STRIDE = 61


@dataclass(frozen=True)
class Spec:
    """A schema to benchmark: its fields, its capacity and the smaller one ``--quick`` uses."""

    name: str
    fields: dict[str, tuple[tuple[int, ...], str]]
    capacity: int
    quick_capacity: int
    title: str = field(default="")

    @cached_property
    def schema(self) -> Any:
        import shmbuffer as sb

        return sb.Schema(**self.fields)

    @property
    def row_bytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in self.fields.values())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.fields[name][0]

    def dtype(self, name: str) -> np.dtype[Any]:
        return np.dtype(self.fields[name][1])

    def canonical(self, raw: dict[str, Any]) -> Fields:
        """Fields as numpy arrays of ``(n, *shape)`` and the schema's dtype, from whatever a library
        returns (torch tensors, ``(n, 1)`` scalars, float dones ...)."""
        out: Fields = {}
        for name in self.fields:
            v = raw[name]
            if hasattr(v, "detach"):
                v = v.detach().cpu().numpy()
            a = np.asarray(v)
            a = a.reshape(a.shape[0] if a.ndim else 1, *self.shape(name))
            dt = self.dtype(name)
            if a.dtype != dt:
                a = (a != 0) if dt == np.bool_ else a.astype(dt)
            out[name] = a
        return out

    def make(self, w: int | np.ndarray, seq: np.ndarray) -> Fields:
        return (_mujoco_make if self.name == "mujoco" else _atari_make)(self, w, np.asarray(seq, np.int64))

    def check(self, f: Fields, *, full: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ok, w, seq)`` per row of canonical fields ``f``."""
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return (_mujoco_check if self.name == "mujoco" else _atari_check)(self, f, full)

    @cached_property
    def templates(self) -> np.ndarray:
        n = int(np.prod(self.shape("obs")))
        return np.random.default_rng(12345).integers(0, 256, (ATARI_P, n), dtype=np.uint8)


MUJOCO = Spec(
    "mujoco",
    {"obs": ((17,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32"),
     "next_obs": ((17,), "float32"), "done": ((), "bool")},
    capacity=1_000_000, quick_capacity=20_000, title="MuJoCo-like (obs float32[17], action float32[6])",
)
ATARI = Spec(
    "atari",
    {"obs": ((4, 84, 84), "uint8"), "action": ((), "int64"), "reward": ((), "float32"),
     "next_obs": ((4, 84, 84), "uint8"), "done": ((), "bool")},
    capacity=50_000, quick_capacity=1_000, title="Atari-like (obs uint8[4,84,84], action int64)",
)
SPECS = {s.name: s for s in (MUJOCO, ATARI)}


# -- MuJoCo-like ------------------------------------------------------------------------------------
def _mujoco_make(spec: Spec, w: int | np.ndarray, seq: np.ndarray) -> Fields:
    n = seq.shape[0]
    c = seq % MUJOCO_P
    obs = np.empty((n, 17), np.float32)
    obs[:, 0] = w
    obs[:, 1] = seq // 4096
    obs[:, 2] = seq % 4096
    obs[:, 3:] = c[:, None] * 16 + np.arange(14)
    return {
        "obs": obs,
        "action": -(c[:, None] * 8 + np.arange(6)).astype(np.float32),
        "reward": (c + 0.25).astype(np.float32),
        "next_obs": obs + np.float32(0.5),
        "done": c % 2 == 1,
    }


def _mujoco_check(spec: Spec, f: Fields, full: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    obs = f["obs"]
    w = obs[:, 0].astype(np.int64)
    seq = obs[:, 1].astype(np.int64) * 4096 + obs[:, 2].astype(np.int64)
    ok = (obs[:, 0] == w) & (seq >= 0) & (obs[:, 2] < 4096)
    seq = np.where(ok, seq, 0)
    want = _mujoco_make(spec, np.where(ok, w, 0), seq)
    for name, a in want.items():
        got = f[name]
        ok &= (got == a).reshape(len(a), -1).all(axis=1)
    return ok, w, seq


# -- Atari-like -------------------------------------------------------------------------------------
def _atari_make(spec: Spec, w: int | np.ndarray, seq: np.ndarray) -> Fields:
    n = seq.shape[0]
    c = seq % ATARI_P
    t = spec.templates
    out: Fields = {}
    for name, shift in (("obs", 0), ("next_obs", 1)):
        flat = t.take((c + shift) % ATARI_P, axis=0)
        words = flat.view(np.int64)
        words[:, 0] = w
        words[:, 1] = seq
        words[:, -2] = w
        words[:, -1] = seq
        out[name] = flat.reshape(n, *spec.shape(name))
    return {
        "obs": out["obs"],
        "action": seq.copy(),
        "reward": (c + 0.5).astype(np.float32),
        "next_obs": out["next_obs"],
        "done": c % 2 == 1,
    }


def _atari_check(spec: Spec, f: Fields, full: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = f["obs"].shape[0]
    obs = np.ascontiguousarray(f["obs"]).reshape(n, -1)
    nxt = np.ascontiguousarray(f["next_obs"]).reshape(n, -1)
    ow, nw = obs.view(np.int64), nxt.view(np.int64)
    w, seq = ow[:, 0].copy(), ow[:, 1].copy()
    ok = seq >= 0
    seq = np.where(ok, seq, 0)
    c = seq % ATARI_P
    for words in (ow, nw):
        ok &= (words[:, 0] == w) & (words[:, 1] == seq) & (words[:, -2] == w) & (words[:, -1] == seq)
    body = slice(16, -16, 1 if full else ATARI_STRIDE)
    t = spec.templates
    ok &= (obs[:, body] == t[:, body].take(c, axis=0)).all(axis=1)
    ok &= (nxt[:, body] == t[:, body].take((c + 1) % ATARI_P, axis=0)).all(axis=1)
    ok &= f["action"] == seq
    ok &= f["reward"] == (c + 0.5).astype(np.float32)
    ok &= f["done"] == (c % 2 == 1)
    return ok, w, seq


# -- a writer's batches -------------------------------------------------------------------------------
class Stamper:
    """8-row batches of writer ``w``: ``batch(i)`` holds rows ``i .. i+7`` (``i`` a multiple of 8).

    One batch per class is built up front; ``batch`` writes the sequence numbers into the one for
    ``i % P`` and returns it (the same arrays every P calls: push them before the next call).
    """

    K = 8

    def __init__(self, spec: Spec, w: int) -> None:
        self.spec = spec
        self.w = w
        self.p = MUJOCO_P if spec.name == "mujoco" else ATARI_P
        self.pool = [spec.make(w, c + np.arange(self.K)) for c in range(self.p)]
        self._r = np.arange(self.K, dtype=np.int64)
        self._rf = self._r.astype(np.float32)
        self._rh = self._rf + np.float32(0.5)

    def batch(self, i: int) -> Fields:
        b = self.pool[i % self.p]
        if self.spec.name == "mujoco":
            hi, lo = divmod(i, 4096)  # i % 8 == 0: the 8 rows share hi
            b["obs"][:, 1] = hi
            np.add(self._rf, lo, out=b["obs"][:, 2])
            b["next_obs"][:, 1] = hi + 0.5
            np.add(self._rh, lo, out=b["next_obs"][:, 2])
        else:
            for name in ("obs", "next_obs"):
                words = b[name].reshape(self.K, -1).view(np.int64)
                np.add(self._r, i, out=words[:, 1])
                words[:, -1] = words[:, 1]
            np.add(self._r, i, out=b["action"])
        return b


# -- lanes of episodes (sequence sampling) ----------------------------------------------------------
EPISODE = 1000
"""Steps per episode in the sequence case (MuJoCo's usual time limit)."""


@dataclass
class Lanes:
    """``capacity`` rows as ``lanes`` envs of ``capacity // lanes`` steps each: the row of env ``l`` at
    step ``t`` is ``make(l, t)`` (so ``check`` gives back ``w = l`` and ``seq = t``), and its episode
    id is ``l << 32 | t // EPISODE`` (episodes of ``EPISODE`` steps; the last one of a lane may be
    shorter). ``cols[name]`` is ``(lanes, steps, *shape)``, ``episode`` is ``(lanes, steps)``."""

    spec: Spec
    lanes: int
    steps: int
    cols: Fields
    episode: np.ndarray

    @classmethod
    def make(cls, spec: Spec, capacity: int, lanes: int) -> Lanes:
        steps = capacity // lanes
        t = np.arange(steps)
        cols = {n: np.empty((lanes, steps, *spec.shape(n)), spec.dtype(n)) for n in spec.fields}
        episode = np.empty((lanes, steps), np.int64)
        for lane in range(lanes):
            rows = spec.make(lane, t)
            for n in spec.fields:
                cols[n][lane] = rows[n]
            episode[lane] = (lane << 32) | (t // EPISODE)
        return cls(spec, lanes, steps, cols, episode)

    def episode_end(self, seq: np.ndarray) -> np.ndarray:
        """The step after the last one of the episode that step ``seq`` belongs to."""
        return np.minimum((seq // EPISODE + 1) * EPISODE, self.steps)
