"""What the Stable-Baselines3 buffers of ``buffers.py`` share: SB3's arrays over a shmbuffer
(``Shared``). Positions map to lanes' slots, columns written through the commit protocol
(``Column``), ``pos``/``full`` read from the shared ring, samples drawn with SB3's ``np.random``
calls and read as stamped copies (``waiting``), and pickling that stores the rows. The behaviour
this gives SB3's classes is stated in ``buffers.py``'s docstring."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape
from stable_baselines3.common.utils import get_device

from ..buffer import ReplayBuffer as SharedBuffer
from ..errors import EmptyBufferError
from ..protocol import by_position
from ..protocol.rows import lane_of
from ..sampling.limiter import RateLimiter
from ..schema import Schema

__all__ = ["WAIT", "Column", "Shared", "waiting"]
T = TypeVar("T")

WAIT = 1.0
"""Seconds ``sample`` waits for drawn rows that writers elsewhere are writing (a writer can be
descheduled between reserving a row and committing it) or keep overwriting."""


def waiting(read: Callable[[], T], what: str) -> T:
    """``read()``, called again for up to ``WAIT`` seconds while it finds rows being written."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return read()
        except EmptyBufferError:
            if time.monotonic() > deadline:
                raise EmptyBufferError(
                    f"sample: {what} were still being written after {WAIT:g} s (a writer elsewhere stopped or "
                    "died mid-push); sample again"
                ) from None
            time.sleep(0.0005)


class Column(np.ndarray):
    """One shared field as SB3's array, ``(buffer_size, n_envs, *shape)``: a live, read-only view
    of the column (position ``p`` of env ``e`` is slot ``p`` of lane ``e``). Item assignment
    (``rb.dones[pos] = True``) goes through ``Shared._write`` and the commit protocol. Slices of it
    are read-only plain arrays; copies and arithmetic results own their data and write as plain
    arrays do."""

    write: Callable[[Any, Any], None] | None = None
    """``write(key, value)``: the owner's ``_write`` of this field; ``None`` on derived arrays"""

    def __array_finalize__(self, obj: Any) -> None:
        self.write = None  # only the column itself writes through the protocol

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        return out.view(np.ndarray) if isinstance(out, np.ndarray) else out

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.write is None:
            super().__setitem__(key, value)
        else:
            self.write(key, value)

    def __reduce__(self) -> Any:  # a pickled or deep-copied column is its values
        return np.array, (np.asarray(self.view(np.ndarray)),)


class Shared:
    """What both buffers share: the shmbuffer, SB3's positions and arrays mapped onto its lanes,
    pickling."""

    buffer: SharedBuffer
    buffer_size: int
    n_envs: int
    handle_timeout_termination: bool
    optimize_memory_usage: bool
    observation_space: Any
    action_space: spaces.Space
    obs_shape: Any
    action_dim: int
    device: Any
    _full_set = False
    """``full = True`` was set by hand: every position counts (SB3's ``full``)"""
    _full_from = 0
    """``full = False`` was set by hand: not full until the least filled lane's cursor reaches this"""
    _sb3_pos = 0
    """SB3's own ``pos`` (this process's adds since ``reset()``, modulo ``buffer_size``) ..."""
    _sb3_full = False
    """... and ``full``: what SB3's ``sample`` bounds its draws with (``_draw_as_sb3``)"""
    _seeded = False
    """The shared buffer's generator was seeded from ``np.random`` (``_seed``)"""

    def _init_shared(
        self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space, device: Any,
        n_envs: int, optimize_memory_usage: bool, handle_timeout_termination: bool, name: str | None,
        stack: Any = None, rows: dict[str, np.ndarray] | None = None, episodes: bool = False,
        limiter: RateLimiter | None = None,
    ) -> None:
        if stack is not None and not optimize_memory_usage:
            raise ValueError("stack: frames are stored once only with optimize_memory_usage=True")
        if not isinstance(n_envs, int) or n_envs < 1:
            raise ValueError(f"n_envs: expected a positive int, got {n_envs!r}")
        # BaseBuffer's attributes, without its pos/full (they are read from the shared ring)
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = get_obs_shape(observation_space)
        self.action_dim = get_action_dim(action_space)
        self.device = get_device(device)
        self.n_envs = n_envs
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = bool(optimize_memory_usage)
        self.handle_timeout_termination = handle_timeout_termination
        self._settings = {"buffer_size": buffer_size, "observation_space": observation_space,
                          "action_space": action_space, "n_envs": n_envs,
                          "handle_timeout_termination": handle_timeout_termination,
                          "optimize_memory_usage": self.optimize_memory_usage, "stack": stack,
                          "episodes": episodes}
        capacity = self.buffer_size * n_envs
        self._episodic = self.optimize_memory_usage or episodes
        if self._episodic:
            # Episode ids let a position set done by hand (``dones[pos] = True``) end its lane's
            # episode (_cut); each env's next add after a done starts a new one.
            self._episode = np.arange(n_envs, dtype=np.int64)
            self._cut = np.zeros(n_envs, bool)
        # The global generator is left alone here: SB3's buffer draws from it only in sample(), and a
        # draw now would shift every later one (an SB3 run's exploration) from the run on SB3's buffer.
        # The shared buffer's own generator is seeded at the first sample instead (_seed).
        if self.optimize_memory_usage:
            self.buffer = SharedBuffer(self._schema(), capacity, envs=n_envs, name=name, next_of="obs", stack=stack,
                                       episodes=True)
        elif rows is not None:  # unpickling: the rows keep their ids, so their slots and SB3's positions
            self.buffer = SharedBuffer.from_arrays(self._schema(), rows, capacity, envs=n_envs, name=name,
                                                   episodes=episodes)
            if episodes and rows["episode"].size:  # fresh ids for the lanes whose saved episodes all ended...
                self._episode += (int(rows["episode"].max()) // n_envs + 1) * n_envs
                index = np.asarray(rows["index"], np.int64)
                lane = lane_of(index, n_envs)
                for ln in np.unique(lane).tolist():
                    at = int(np.flatnonzero(lane == ln)[np.argmax(index[lane == ln])])  # the lane's newest step
                    if not (rows["done"][at] or rows["timeouts"][at]):
                        # ...the others' next adds go on with their episode, as the original's would:
                        # else it would never end (hindsight draws complete episodes only)
                        self._episode[ln] = int(rows["episode"][at])
        else:
            self.buffer = SharedBuffer(self._schema(), capacity, envs=n_envs, name=name, episodes=episodes,
                                       limiter=limiter)

    # -- the schema ------------------------------------------------------------------------------
    def _obs_fields(self) -> dict[str, tuple[Any, ...]]:
        raise NotImplementedError

    def _schema(self) -> Schema:
        action_dtype = self.action_space.dtype
        if action_dtype == np.float64:  # as SB3 stores actions: float64 becomes float32 (SB3 GH#1572)
            action_dtype = np.dtype(np.float32)
        return Schema(**self._obs_fields(), action=((self.action_dim,), action_dtype),
                      reward=((), "float32"), done=((), "float32"), timeouts=((), "float32"))

    # -- SB3's positions on the shared lanes ------------------------------------------------------
    def _least(self) -> tuple[int, int]:
        """The cursor of the least filled lane and the rows written to it since the last clear
        (SB3's ``pos`` counts on past the end)."""
        stop, rows = by_position.lanes(self.buffer)
        lane = int(np.argmin(rows))
        return int(stop[lane]), int(rows[lane])

    @property
    def pos(self) -> int:
        """The position SB3 writes next: the slot of the least filled lane's next row (a lane's
        row ``n`` is in its slot ``n % buffer_size``; ``reset()`` starts every lane at slot 0)."""
        return int(by_position.position(self.buffer, self._least()[0]))

    @pos.setter
    def pos(self, value: int) -> None:
        if value != self.pos:
            raise ValueError(
                f"pos: the next row of each env goes to the next slot of its lane of the shared buffer "
                f"(position {self.pos}); it cannot be moved to {value!r} (writers in other processes push "
                "there too); reset() starts over at 0"
            )

    @property
    def full(self) -> bool:
        """SB3's ``full``: every env has written ``buffer_size`` rows since the last ``reset()``,
        or ``full`` was set (``True``: every position counts; ``False``: until the next wrap)."""
        cursor, rows = self._least()
        return self._full_set or (rows >= self.buffer_size and cursor >= self._full_from)

    @full.setter
    def full(self, value: bool) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"full: expected a bool, got {value!r}")
        self._full_set = self._sb3_full = bool(value)
        # False: positions count up to pos again until the least filled lane wraps once more
        self._full_from = 0 if value else (self._least()[0] // self.buffer_size + 1) * self.buffer_size

    def size(self) -> int:
        """SB3's ``size()``: the positions that hold rows (``buffer_size`` once full)."""
        return self._upper_bound()

    def _upper_bound(self) -> int:
        """SB3's ``buffer_size if full else pos`` (with ``optimize_memory_usage``: the whole
        transitions held, per env), from one read of the lanes' cursors."""
        if self.optimize_memory_usage:
            return min(len(self.buffer) // self.n_envs, self.buffer_size)
        cursor, rows = self._least()
        if self._full_set or (rows >= self.buffer_size and cursor >= self._full_from):  # ``full``
            return self.buffer_size
        return int(by_position.position(self.buffer, cursor))

    def reset(self) -> None:
        """SB3's ``reset()``: the shared buffer cleared (every process sees it empty)."""
        self.buffer.clear()
        self._full_set, self._full_from = False, 0
        self._sb3_pos, self._sb3_full = 0, False

    def _seed(self, entropy: Any = None) -> None:
        """Seed the shared buffer's generator, once, from ``entropy`` (draws made from ``np.random``
        as SB3's ``sample`` makes them) or else one draw of ``np.random``: at the first sample, not
        when the buffer is made (SB3 seeds ``np.random`` before it makes the buffer, so runs repeat)."""
        if not self._seeded:
            self.buffer.rng = np.random.default_rng(np.random.randint(2**31 - 1) if entropy is None else entropy)
            self._seeded = True

    def _draw_as_sb3(self, batch_size: int) -> None:
        """Draw from ``np.random`` what SB3's ``sample`` with ``optimize_memory_usage`` draws: its
        positions, then its envs, the same calls with the same bounds (SB3's own ``pos`` and
        ``full``), so the global generator moves on as in the run on SB3's buffer (its later draws,
        an algorithm's exploration, stay the same). The transitions are drawn by the shared
        buffer's generator, which the first of these draws seed."""
        lo, hi = (1, self.buffer_size) if self._sb3_full else (0, self._sb3_pos)
        if hi <= lo or not batch_size:  # SB3's sample would raise or draw nothing (rows pushed elsewhere only)
            self._seed()
            return
        drawn = np.concatenate([np.random.randint(lo, hi, size=batch_size),
                                np.random.randint(0, high=self.n_envs, size=(batch_size,))])
        self._seed(drawn)

    def close(self) -> None:
        """Close this process's view; the creator also removes the shared buffer (even when the
        close raises ``BufferError`` because arrays of it are still alive)."""
        owner = self.buffer.owner
        try:
            self.buffer.close()
        finally:
            if owner:
                self.buffer.unlink()

    def _slots(self) -> np.ndarray:
        """The slot of each SB3 position ``(buffer_size, n_envs)``: slot ``p`` of lane ``e``. With
        ``optimize_memory_usage`` lanes also hold end rows, so their cursors differ: position
        ``pos - 1 - j`` of env ``e`` is then the ``j``-th newest row of lane ``e`` (so
        ``dones[pos - 1]`` is every env's newest row, as SB3 means it)."""
        bs, lane = self.buffer_size, np.arange(self.n_envs)[None, :]
        if not self.optimize_memory_usage:
            return by_position.lane_slots(self.buffer, lane, np.arange(bs)[:, None])
        stop = by_position.lanes(self.buffer)[0]
        back = (self.pos - 1 - np.arange(bs)) % bs  # how far position p is behind pos - 1
        return by_position.lane_slots(self.buffer, lane, stop[None, :] - 1 - back[:, None])

    def _column(self, field: str) -> Column:
        """The field as SB3's array ``(buffer_size, n_envs, *shape)``: a view of the shared column
        (a copy with ``optimize_memory_usage``, whose positions are not one stride apart)."""
        raw = self.buffer.block.fields[field]
        bs, n = self.buffer_size, self.n_envs
        if self.optimize_memory_usage:
            col = raw[self._slots()].view(Column)
            col.flags.writeable = False
        else:
            st = raw.strides
            col = np.lib.stride_tricks.as_strided(raw, (bs, n, *raw.shape[1:]), (st[0], bs * st[0], *st[1:]),
                                                  writeable=False).view(Column)
        col.write = partial(self._write, field)
        return col

    def _write(self, field: str, key: Any, value: Any) -> None:
        """``array[key] = value`` on SB3's array of ``field``, through the commit protocol: the
        rows it touches that hold a committed row are rewritten with ``buffer.update`` (a reader
        sees each row as it was or as it is after, never half of it; a row overwritten meanwhile
        keeps what its writer pushed); positions that hold no row (never written, or cleared)
        take the values under the ring's lock unless a writer is filling them, as SB3's arrays
        would (no reader reads them; the next row pushed there replaces them)."""
        raw = self.buffer.block.fields[field]
        inner = raw.shape[1:]
        shape = (self.buffer_size, self.n_envs, *inner)
        width = int(np.prod(inner, dtype=np.int64))
        grid = self._slots().reshape(*shape[:2], *(1,) * len(inner))
        try:
            at = np.broadcast_to(grid, shape)[key]
            off = np.broadcast_to(np.arange(width).reshape(1, 1, *inner), shape)[key]
        except (IndexError, TypeError, ValueError) as e:
            raise IndexError(f"{field}: index {key!r} does not fit SB3's array of shape {shape}: {e}") from None
        try:
            new = np.broadcast_to(np.asarray(value).astype(raw.dtype), np.shape(at))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field}[{key!r}] = ...: expected values of shape {np.shape(at)} (or broadcastable) "
                             f"castable to {raw.dtype}, got {np.shape(value)} {np.asarray(value).dtype}: {e}") from None
        slots, which = np.unique(np.asarray(at).reshape(-1), return_inverse=True)
        if not slots.size:
            return
        ids = by_position.ids_at(self.buffer, slots)  # first: a row overwritten after this is skipped by update
        rows = raw[slots].reshape(slots.size, width).copy()
        rows[which.reshape(-1), np.asarray(off).reshape(-1)] = new.reshape(-1)
        rows = rows.reshape(slots.size, *inner)
        live = ids != by_position.INVALID
        if live.any():
            self.buffer.update(ids[live], {field: rows[live]})
        if not live.all():
            by_position.write_free(self.buffer, slots[~live], field, rows[~live])
        if self._episodic and field in ("done", "timeouts"):
            # a lane's newest row set done by hand ends its episode: the env's next add starts one
            lanes = np.arange(self.n_envs)
            last, since_clear = by_position.newest(self.buffer, lanes)
            newest = by_position.lane_slots(self.buffer, lanes, last)
            ended = (self.buffer.block.fields["done"][newest] != 0) | (self.buffer.block.fields["timeouts"][newest] != 0)
            self._cut |= ended & since_clear

    def _set_column(self, field: str, value: Any) -> None:
        """``rb.dones = array``: SB3 replaces the array; here its values are written into the column."""
        self._column(field)[...] = value

    @property
    def actions(self) -> np.ndarray:
        """SB3's ``actions`` array ``(buffer_size, n_envs, ...)``, over the shared column (``Column``)."""
        return self._column("action")

    @actions.setter
    def actions(self, value: np.ndarray) -> None:
        self._set_column("action", value)

    @property
    def rewards(self) -> np.ndarray:
        """SB3's ``rewards`` array ``(buffer_size, n_envs, ...)``, over the shared column (``Column``)."""
        return self._column("reward")

    @rewards.setter
    def rewards(self, value: np.ndarray) -> None:
        self._set_column("reward", value)

    @property
    def dones(self) -> np.ndarray:
        """SB3's ``dones`` array ``(buffer_size, n_envs, ...)``, over the shared column (``Column``)."""
        return self._column("done")

    @dones.setter
    def dones(self, value: np.ndarray) -> None:
        self._set_column("done", value)

    @property
    def timeouts(self) -> np.ndarray:
        """SB3's ``timeouts`` array ``(buffer_size, n_envs, ...)``, over the shared column (``Column``)."""
        return self._column("timeouts")

    @timeouts.setter
    def timeouts(self, value: np.ndarray) -> None:
        self._set_column("timeouts", value)

    def ids(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> np.ndarray:
        """The shmbuffer row ids of SB3's positions ``batch_inds`` of envs ``env_indices``: the
        newest row of lane ``env`` in slot ``pos`` (below the lane's first row where the lane has
        not come to that slot since its last clear)."""
        lane = np.asarray(env_indices, np.int64)
        return by_position.row_ids(self.buffer, by_position.newest_at(self.buffer, batch_inds, lane)[0], lane)

    def _take(self, batch_inds: np.ndarray, env_indices: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at those positions: stamped copies, read again (up to ``WAIT`` seconds) while
        a writer elsewhere is writing or overwriting one of them. SB3's ``pos`` counts the rows
        being written, so the newest position can be one whose writer is between reserving and
        committing it: a tight retry loop gave up on a writer descheduled there. Positions no row
        of the env has reached since the last clear (``full`` set by hand) read the arrays as
        they are, as SB3 reads its arrays."""
        def read() -> tuple[np.ndarray, np.ndarray | None, Any]:  # the ids again each time: writers move the lanes on
            ids = self.ids(batch_inds, env_indices)
            if ids.size:
                try:  # every position holds a row (as always unless full was set by hand): one stamped read
                    return ids, None, self.buffer.take(ids)
                except EmptyBufferError:  # some position holds no row, or a row being written (then again)
                    pass
            empty = by_position.cleared(self.buffer, ids)
            return ids, empty, None if empty.all() else self.buffer.take(ids[~empty])

        ids, empty, batch = waiting(read, "rows at the drawn positions")
        if empty is None or (batch is not None and not empty.any()):  # the batch's own arrays
            return batch.fields
        out: dict[str, np.ndarray] = {}
        if batch is not None:
            for name in self.buffer.schema.names:
                got = batch[name]
                out[name] = np.empty((ids.size, *got.shape[1:]), got.dtype)
                out[name][~empty] = got
        slots = by_position.slots_of(self.buffer, ids[empty])
        for name in self.buffer.schema.names:  # every field, also for no position (SB3's sample(0))
            raw = self.buffer.block.fields[name]
            out.setdefault(name, np.empty((ids.size, *raw.shape[1:]), raw.dtype))[empty] = raw[slots]
        return out

    def _push(self, obs: dict[str, np.ndarray], action: np.ndarray, reward: np.ndarray, done: np.ndarray,
              infos: list[dict[str, Any]]) -> None:
        n = self.n_envs
        if self.handle_timeout_termination:
            timeout = np.array([info.get("TimeLimit.truncated", False) for info in infos], np.float32).reshape(n)
        else:
            timeout = np.zeros(n, np.float32)
        rows = {**obs, "action": np.asarray(action).reshape(n, self.action_dim),
                "reward": np.asarray(reward, np.float32).reshape(n),
                "done": np.asarray(done, np.float32).reshape(n), "timeouts": timeout}
        if not self._episodic:
            self.buffer.push(rows)
            return
        # a lane whose newest row was set done by hand starts an episode (frames_push.Pusher: a row of
        # another episode does not continue the lane); so does each env after its done
        episode = np.where(self._cut, self._episode + n, self._episode)
        self.buffer.push(rows, episode=episode)
        self._episode = np.where((rows["done"] != 0) | (timeout != 0), episode + n, episode)
        self._cut[:] = False
        self._sb3_pos += 1  # as SB3's add moves its pos and full
        if self._sb3_pos == self.buffer_size:
            self._sb3_full, self._sb3_pos = True, 0

    def _own_tensor(self, array: np.ndarray) -> th.Tensor:
        """SB3's ``to_torch`` for an array no one else holds (a sample's own copy): no second copy
        (``th.tensor`` copies every array again; torch's tensor then shares the sample's memory).
        Contiguous, as SB3's tensors are."""
        array = np.ascontiguousarray(array)
        if self.device.type == "cpu":  # the cheapest way to a tensor sharing the array's memory
            return th.from_numpy(array)
        return th.as_tensor(array, device=self.device)

    def _tail(self, batch: Any, env: Any) -> tuple[Any, Any, Any]:
        """Actions, dones (time-limit ends masked) and rewards as SB3 returns them."""
        dones = (batch["done"] * (1 - batch["timeouts"])).reshape(-1, 1)
        rewards = self._normalize_reward(batch["reward"].reshape(-1, 1), env)  # type: ignore[attr-defined]
        return batch["action"], dones, rewards

    # -- pickling: the rows, not a name ----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        rows = self.buffer.export()
        pending = self.buffer.pending() if self.optimize_memory_usage else None
        if pending is not None and pending["index"].size:  # each env's newest step: its next observation is ours
            rows = {k: np.concatenate([rows[k], pending[k]]) for k in rows}
        return {"settings": self._settings, "device": str(self.device), "rows": rows,
                "pending": np.empty(0, np.int64) if pending is None else pending["index"],
                "lanes": self.buffer.lanes, "full": (self._full_set, self._full_from),
                "sb3": (self._sb3_pos, self._sb3_full),
                "free": None if self.optimize_memory_usage else self._free_values()}

    def _free_values(self) -> dict[str, np.ndarray]:
        """The values SB3's arrays show where no row is (left by rows cleared with ``reset()``;
        SB3 reads them once ``full`` is set by hand): ``"slot"`` and each field, for the slots not
        all zeros (a copy starts from zeros)."""
        fields = self.buffer.block.fields
        slots = by_position.free(self.buffer)
        used = np.zeros(slots.size, bool)
        for column in fields.values():
            if slots.size and column[0].size:  # (a reshape of no rows cannot infer the width)
                used |= column[slots].reshape(slots.size, -1).any(axis=1)
        slots = slots[used]
        return {"slot": slots, **{n: column[slots].copy() for n, column in fields.items()}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        s = state["settings"]
        once = bool(s.get("optimize_memory_usage", False))
        rows = dict(state["rows"])
        self._init_shared(s["buffer_size"], s["observation_space"], s["action_space"], state["device"],
                          s["n_envs"], once, s["handle_timeout_termination"], None, s.get("stack"),
                          None if once else rows, episodes=bool(s.get("episodes", False)))
        self._full_set, self._full_from = state.get("full", (False, 0))
        self._sb3_pos, self._sb3_full = state.get("sb3", (0, False))
        if not once:
            free = state.get("free")
            if free is not None and free["slot"].size:
                for n in self.buffer.block.fields:
                    by_position.write_free(self.buffer, free["slot"], n, free[n])
            return
        try:  # rows refused leave no shared buffer behind
            self._push_saved(rows, state)
        except BaseException:
            self.close()
            raise

    def _push_saved(self, rows: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        """Unpickling with ``optimize_memory_usage``: push the saved transitions, lane by lane,
        each lane's episodes as they were (see ``__setstate__``)."""
        index = np.asarray(rows.pop("index"), np.int64)
        episode = np.asarray(rows.pop("episode"), np.int64)
        self.buffer.schema.validate(rows)  # first: a damaged state raises naming the field
        pending = np.isin(index, state.get("pending", ()))
        lanes = int(state["lanes"])
        lane = lane_of(index, lanes)
        if episode.size:  # fresh ids for the next adds: none of the saved episodes continues...
            self._episode = np.arange(lanes, dtype=np.int64) + (int(episode.max()) // lanes + 1) * lanes
        for ln in range(lanes):  # each lane's rows oldest first
            mine = np.flatnonzero(lane == ln)
            for run in _runs(rows, mine):
                if not run.size:
                    continue
                data = {k: v[run] for k, v in rows.items()}
                if pending[run[-1]]:
                    # ...but the one whose newest step waited for the env's next add: pushed by this
                    # buffer, which then holds its next observation and goes on with it, as the original
                    self.buffer.push(data, lane=ln, episode=episode[run])
                    self._episode[ln] = episode[run[-1]]
                    continue
                # a run that does not continue the one before starts an episode: a new handle
                # has no memory of the lane, so its first row does (frames_push.Pusher)
                writer = SharedBuffer.attach(self.buffer.handle)
                try:
                    # flushed: the run's last transition keeps the next observation it was saved with
                    writer.push(data, lane=ln, episode=episode[run], flush=True)
                finally:
                    writer.close()


def _runs(rows: dict[str, np.ndarray], mine: np.ndarray) -> list[np.ndarray]:
    """``mine`` (one lane's exported transitions, oldest first) cut where a transition does not
    continue the one before: not after an episode's end, and its ``obs`` not that one's ``next_obs``
    (a transition between them could not be read when saved)."""
    if mine.size < 2:
        return [mine]
    obs, nxt = rows["obs"][mine], rows["next_obs"][mine]
    ended = (rows["done"][mine] != 0) | (rows["timeouts"][mine] != 0)
    same = (obs[1:] == nxt[:-1]).reshape(mine.size - 1, -1).all(axis=1)
    cut = np.flatnonzero(~ended[:-1] & ~same) + 1
    return np.split(mine, cut)
