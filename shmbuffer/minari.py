"""Minari datasets in and out: a buffer's episodes written as a Minari dataset, and a buffer filled
from one (extra ``minari``: ``pip install -e ".[minari]"``; minari is imported here only, when a
function runs).

A buffer row is a transition ``(obs, action, reward, next_obs, done ...)``; a Minari episode of
``T`` steps holds ``T + 1`` observations (the reset one, then each step's), ``T`` actions,
rewards, terminations and truncations, and per-step ``infos``. So:

* ``observations`` are the episode's ``obs`` rows and the last row's ``next_obs``;
* ``terminations`` are ``terminated`` (or ``done`` without it); ``truncations`` are
  ``truncated``, and also true on the last step of an episode that ended without either flag
  (another episode followed it in its lane: a truncation the schema had no field for);
* every other field of the schema goes to ``infos`` under its name (one value per step);
* the buffer must keep episodes (``episodes=True``): an episode is a run of rows of one lane with
  one episode id, oldest first. Written are the episodes that are whole in the buffer: not the
  oldest of a lane whose first rows were overwritten, not the newest of a lane while it has
  not ended (no flag, nothing after it).

``from_minari`` does the reverse into fields ``obs``, ``action``, ``reward``, ``next_obs``,
``done`` (Minari's terminations), ``truncated`` and the ``infos`` keys asked for, one lane,
episode ids Minari's. It reads the episodes through the dataset's storage
(``MinariStorage.get_episodes``, what ``iterate_episodes`` reads) and pushes them at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .buffer import ReplayBuffer
from .errors import FieldError, SchemaError
from .persistence import export
from .protocol import by_position
from .schema import Schema

STEP = ("obs", "action", "reward", "next_obs", "done", "terminated", "truncated")
"""The fields that are a step's own; any other field of the schema is written to ``infos``."""


def _minari() -> Any:
    try:
        import minari
    except ImportError:
        raise ImportError("shmbuffer.minari needs the minari package (with h5py): pip install 'minari[hdf5,create]', "
                          "or from shmbuffer's clone pip install -e '.[minari]'") from None
    return minari


def episodes(buf: ReplayBuffer) -> list[dict[str, Any]]:
    """The buffer's whole episodes (see the module docstring) as Minari's episode dicts
    (``observations``, ``actions``, ``rewards``, ``terminations``, ``truncations``, ``infos``),
    lane by lane, oldest first; each with ``id`` its number in that order."""
    names = buf.schema.names
    missing = [f for f in ("obs", "action", "reward", "next_obs") if f not in names]
    if missing:
        raise SchemaError(f"to_minari: buffer {buf.name!r} has no field {', '.join(map(repr, missing))}: a Minari "
                          f"episode needs obs, action, reward and next_obs (the schema has {', '.join(names)})")
    if not buf.options.episodes:
        raise SchemaError(f"to_minari: buffer {buf.name!r} keeps no episodes: make it with episodes=True (and push with "
                          "episode=), e.g. through shmbuffer.vector.RecordTransitions")
    rows = export(buf)
    _, lane = by_position.in_lane(buf, rows["index"])
    written = by_position.lanes(buf)[1]
    ep = rows["episode"]
    n = ep.size
    cut = np.flatnonzero((ep[1:] != ep[:-1]) | (lane[1:] != lane[:-1])) + 1
    firsts = np.concatenate([[0], cut]).astype(np.int64) if n else np.empty(0, np.int64)
    stops = np.concatenate([cut, [n]]).astype(np.int64) if n else np.empty(0, np.int64)
    ended = rows.get("terminated", rows.get("done", np.zeros(n, bool))).astype(bool)
    truncated = rows.get("truncated", np.zeros(n, bool)).astype(bool)
    infos = [f for f in names if f not in STEP]
    out: list[dict[str, Any]] = []
    for i, (first, stop) in enumerate(zip(firsts, stops, strict=True)):
        ln = lane[first]
        lane_first = i == 0 or lane[firsts[i - 1]] != ln
        lane_last = i + 1 == firsts.size or lane[firsts[i + 1]] != ln
        if lane_first and written[ln] > np.count_nonzero(lane == ln):
            continue  # its first rows were overwritten
        last = stop - 1
        if lane_last and not (ended[last] or truncated[last]):
            continue  # still being written
        trunc = truncated[first:stop].copy()
        trunc[-1] |= not ended[last]
        out.append({
            "id": len(out),
            "observations": np.concatenate([rows["obs"][first:stop], rows["next_obs"][last:stop]]),
            "actions": rows["action"][first:stop],
            "rewards": rows["reward"][first:stop],
            "terminations": ended[first:stop],
            "truncations": trunc,
            "infos": {name: rows[name][first:stop] for name in infos},
        })
    return out


def _space(field: Any) -> Any:
    import gymnasium

    dtype = np.dtype(field.dtype)
    if dtype.kind == "f":
        return gymnasium.spaces.Box(-np.inf, np.inf, field.shape, dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return gymnasium.spaces.Box(info.min, info.max, field.shape, dtype)
    raise SchemaError(f"to_minari: field {field.name!r} is {dtype}: pass observation_space= and action_space= "
                      "(or env=) for it")


def to_minari(buf: ReplayBuffer, dataset_id: str, *, env: Any = None, observation_space: Any = None,
              action_space: Any = None, **kwargs: Any) -> Any:
    """Write ``buf``'s whole episodes as the Minari dataset ``dataset_id`` (under
    ``MINARI_DATASETS_PATH``) and return it (a ``minari.MinariDataset``). ``env`` (an id, a
    ``gymnasium.Env`` or its spec) gives the spaces; without it ``observation_space`` and
    ``action_space``, by default ``Box`` spaces of the ``obs`` and ``action`` fields. Other
    keywords go to ``minari.create_dataset_from_buffers`` (``algorithm_name``, ``author``,
    ``data_format`` ...). ``FieldError`` when no episode is whole."""
    minari = _minari()
    eps = episodes(buf)
    if not eps:
        raise FieldError(f"to_minari: buffer {buf.name!r} holds no whole episode (an episode is written once it has "
                         "ended and its first row is still in the buffer)")
    if env is None:
        fields = {f.name: f for f in buf.schema}
        observation_space = observation_space or _space(fields["obs"])
        action_space = action_space or _space(fields["action"])
    from minari.data_collector import EpisodeBuffer

    episode_buffers = [EpisodeBuffer(**e) for e in eps]
    return minari.create_dataset_from_buffers(dataset_id, episode_buffers, env=env, observation_space=observation_space,
                                              action_space=action_space, **kwargs)


def _field_of(space: Any, what: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    import gymnasium

    if isinstance(space, gymnasium.spaces.Box):
        return tuple(space.shape), np.dtype(space.dtype)
    if isinstance(space, gymnasium.spaces.Discrete):
        return (), np.dtype(np.int64)
    if isinstance(space, gymnasium.spaces.MultiBinary | gymnasium.spaces.MultiDiscrete):
        return tuple(space.shape), np.dtype(space.dtype)
    raise SchemaError(f"from_minari: the dataset's {what} space is {space}; a buffer field takes a Box, Discrete, "
                      "MultiBinary or MultiDiscrete space (flatten Dict and Tuple spaces first)")


def from_minari(dataset_id: str, buf: ReplayBuffer | None = None, *, infos: tuple[str, ...] = (),
                capacity: int | None = None, **kwargs: Any) -> ReplayBuffer:
    """A buffer holding the Minari dataset ``dataset_id``'s episodes (see the module docstring).

    :param buf: fill this buffer (its schema must have the fields, ``episodes=True``); by default
        a new one is made with ``capacity`` (default: the dataset's steps) and ``kwargs``
        (``name``, ``seed``, ``sampler`` ...): the caller closes it.
    :param infos: keys of the episodes' ``infos`` stored as fields of the same name (one value per
        step: Minari's first info, the reset's, is left out when there are ``T + 1``).
    """
    minari = _minari()
    ds = minari.load_dataset(dataset_id)
    obs_shape, obs_dtype = _field_of(ds.observation_space, "observation")
    act_shape, act_dtype = _field_of(ds.action_space, "action")
    total = int(ds.total_steps)
    arrays: dict[str, Any] = {
        "obs": np.empty((total, *obs_shape), obs_dtype), "action": np.empty((total, *act_shape), act_dtype),
        "reward": np.empty(total, np.float32), "next_obs": np.empty((total, *obs_shape), obs_dtype),
        "done": np.empty(total, bool), "truncated": np.empty(total, bool),
    }
    info_arrays: dict[str, np.ndarray] = {}
    episode = np.empty(total, np.int64)
    at = 0
    for e in ds.storage.get_episodes(ds.episode_indices):
        t = len(e["rewards"])
        o = e["observations"]
        arrays["obs"][at:at + t] = o[:t]
        arrays["next_obs"][at:at + t] = o[1:t + 1]
        arrays["action"][at:at + t] = e["actions"]
        arrays["reward"][at:at + t] = e["rewards"]
        arrays["done"][at:at + t] = e["terminations"]
        arrays["truncated"][at:at + t] = e["truncations"]
        for key in infos:
            value = (e["infos"] or {}).get(key)
            if value is None:
                raise FieldError(f"from_minari: episode {e['id']} of {dataset_id!r} has no info {key!r} "
                                 f"(its infos: {sorted(e['infos'] or {})})")
            value = np.asarray(value)
            value = value[1:] if len(value) == t + 1 else value
            if key not in info_arrays:
                info_arrays[key] = np.empty((total, *value.shape[1:]), value.dtype)
            info_arrays[key][at:at + t] = value
        episode[at:at + t] = e["id"]
        at += t
    arrays.update(info_arrays)
    if buf is None:
        schema = Schema(**{k: (a.shape[1:], a.dtype) for k, a in arrays.items()})
        buf = ReplayBuffer(schema, max(capacity or at, 1), episodes=True, **kwargs)
    elif not buf.options.episodes:
        raise SchemaError(f"from_minari: buffer {buf.name!r} keeps no episodes: make it with episodes=True")
    if at:
        buf.push({k: a[:at] for k, a in arrays.items() if k in buf.schema.names}, episode=episode[:at])
    return buf
