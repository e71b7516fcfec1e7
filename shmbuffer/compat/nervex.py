"""nerveX's ``AdvancedReplayBuffer`` (prioritized replay with ``max_use``), on a ``ReplayBuffer``.

::

    from shmbuffer.compat.nervex import AdvancedReplayBuffer

    cfg = dict(replay_buffer_size=100, max_use=10, alpha=0.6, beta=0.4, anneal_step=0)
    buffer = AdvancedReplayBuffer(cfg, None, "policy")
    buffer.push(new_data, cur_collector_envstep=0)      # a transition dict, or a list of them
    data = buffer.sample(32, cur_learner_iter=0)        # a list of dicts (with 'IS'), or None
    buffer.update({"replay_buffer_idx": [d["replay_buffer_idx"] for d in data], "priority": td.tolist()})

The config keys are nerveX's: ``replay_buffer_size`` (or the older ``meta_maxlen``; default
10000), ``max_use`` (or ``max_reuse``; default: no limit), ``alpha`` (0.6), ``beta`` (0.4),
``anneal_step`` (sample calls to anneal ``beta`` to 1 over, 100000; ``0`` keeps ``beta`` fixed).
Other keys are accepted and ignored. The first push fixes the fields: a transition's values must
be numeric (numbers, arrays, tensors); a ``priority`` key is the row's initial priority (Ape-X),
not a field. ``sample`` returns ``None`` when fewer than ``size`` rows are held (as nerveX);
``replay_buffer_idx`` is the row's id and ``replay_unique_id`` its string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..sampling.samplers import Prioritized, Uniform
from . import Facade, as_row, numpy_of, schema_of_row

__all__ = ["AdvancedReplayBuffer", "NaiveReplayBuffer"]

_DEFAULTS = {"replay_buffer_size": 10000, "max_use": None, "alpha": 0.6, "beta": 0.4, "anneal_step": int(1e5)}


def _config(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    cfg = dict(cfg or {})
    out = dict(_DEFAULTS)
    if "meta_maxlen" in cfg and "replay_buffer_size" not in cfg:
        cfg["replay_buffer_size"] = cfg["meta_maxlen"]
    if "max_reuse" in cfg and "max_use" not in cfg:
        cfg["max_use"] = cfg["max_reuse"]
    out.update({k: cfg[k] for k in _DEFAULTS if k in cfg})
    if out["max_use"] is not None and (out["max_use"] == float("inf") or out["max_use"] <= 0):
        out["max_use"] = None
    return out


class AdvancedReplayBuffer(Facade):
    """nerveX's prioritized buffer with ``max_use`` (see the module docstring)."""

    prioritized = True

    def __init__(self, cfg: Mapping[str, Any] | None = None, tb_logger: Any = None, instance_name: str = "buffer",
                 *, name: str | None = None, seed: int | None = None) -> None:
        self.cfg = _config(cfg)
        self.name = instance_name
        self._name, self._seed = name, seed
        self.buffer: ReplayBuffer | None = None
        """The ``ReplayBuffer`` behind it, made by the first push."""

    @property
    def replay_buffer_size(self) -> int:
        """The capacity, from the config's ``replay_buffer_size``."""
        return int(self.cfg["replay_buffer_size"])

    @property
    def beta(self) -> float:
        """``beta`` now (annealed over the shared count of sample calls)."""
        s = self._sampler()
        if s is None:
            return 1.0
        prios = self.buffer.priorities if self.buffer is not None else None
        return s.beta_at(prios.calls if prios is not None else 0)

    def _sampler(self) -> Prioritized | None:
        if not self.prioritized:
            return None
        c = self.cfg
        steps = int(c["anneal_step"])  # 0: no annealing, as in nerveX
        return Prioritized(alpha=float(c["alpha"]), beta=float(c["beta"]), beta_steps=steps if steps > 0 else None)

    def push(self, data: Any, cur_collector_envstep: int = -1) -> None:
        """Push one transition (a dict) or a list of them."""
        items = list(data) if isinstance(data, (list, tuple)) else [data]
        if not items:
            return
        rows = [as_row(d, "AdvancedReplayBuffer.push") for d in items]
        if self.buffer is None:
            fields = {k: v for k, v in rows[0].items() if k != "priority"}
            self.buffer = ReplayBuffer(schema_of_row(fields), self.replay_buffer_size, sampler=self._sampler() or Uniform(),
                                       max_use=self.cfg["max_use"], name=self._name, seed=self._seed)
        buf = self.buffer
        step = buf.lane_capacity
        for i in range(0, len(rows), step):
            part = rows[i:i + step]
            if not self.prioritized:
                part = [{k: v for k, v in r.items() if k != "priority"} for r in part]
            keys = part[0].keys()
            if any(r.keys() != keys for r in part):
                raise TypeError(f"push: every transition needs the same keys as the first ({sorted(keys)})")
            buf.push({k: np.stack([r[k] for r in part]) for k in keys})

    def sample(self, size: int, cur_learner_iter: int = -1, sample_range: slice | None = None) -> list[dict[str, Any]] | None:
        """``size`` transitions as dicts with ``IS`` (importance weight), ``priority``,
        ``replay_buffer_idx`` and ``replay_unique_id``; ``None`` when fewer than ``size`` are held."""
        buf = self.buffer
        if buf is None or len(buf) < size:
            return None
        if sample_range is not None:
            raise ValueError("sample: sample_range has no equivalent in shmbuffer (every held row is drawn)")
        batch = buf.sample(size, replace=False)
        index = np.asarray(batch.index)
        weight = batch.extras.get("weight")
        prios = buf.priorities
        priority = (prios.priorities_of(buf.priority(index)) if self.prioritized and prios is not None
                    else np.ones(size))
        out = []
        for i in range(size):
            d: dict[str, Any] = {n: batch.fields[n][i] for n in batch.fields}
            d["IS"] = float(weight[i]) if weight is not None else 1.0
            d["priority"] = float(priority[i])
            d["replay_buffer_idx"] = int(index[i])
            d["replay_unique_id"] = str(int(index[i]))
            out.append(d)
        return out

    def update(self, info: Mapping[str, Any]) -> None:
        """Priority feedback: ``info["replay_buffer_idx"]`` (or ``replay_unique_id``) and
        ``info["priority"]``, lists of one value per row. Rows gone since are skipped."""
        if self.buffer is None or not self.prioritized:
            return
        key = "replay_buffer_idx" if "replay_buffer_idx" in info else "replay_unique_id"
        ids = np.array([int(x) for x in info[key]], np.int64)
        self.buffer.update_priorities(ids, numpy_of(info["priority"]).astype(np.float64).reshape(-1))

    def count(self) -> int:
        """The rows held (0 before the first push)."""
        return 0 if self.buffer is None else len(self.buffer)

    def __len__(self) -> int:
        return self.count()

    def clear(self) -> None:
        """Remove every row."""
        if self.buffer is not None:
            self.buffer.clear()



class NaiveReplayBuffer(AdvancedReplayBuffer):
    """nerveX's uniform buffer (no priorities; ``priority`` keys are dropped)."""

    prioritized = False
