"""nerveX's multi-buffer guide (seed document 000) and prioritized replay best practice (seed
document 003) on ``shmbuffer.compat.nervex``: their config dicts and the PPG pipeline as written,
with stand-ins for the collector and learner they drive."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest

from shmbuffer.compat.nervex import AdvancedReplayBuffer


class EasyDict(dict[str, Any]):
    """nerveX configs are EasyDicts: keys read as attributes."""

    def __init__(self, d: dict[str, Any]) -> None:
        super().__init__({k: EasyDict(v) if isinstance(v, dict) else v for k, v in d.items()})

    def __getattr__(self, key: str) -> Any:
        return self[key]


CONFIG = """
    cartpole_ppg_config = dict(
        # ...
        policy=dict(
            # ...
            other=dict(
                replay_buffer=dict(
                    multi_buffer=True,
                    policy=dict(
                        replay_buffer_size=100,
                        max_use=10,
                    ),
                    value=dict(
                        replay_buffer_size=1000,
                        max_use=100,
                    ),
                ),
            ),
        ),
    )
"""

PIPELINE = """
    # Init two buffers
    policy_buffer = AdvancedReplayBuffer(cfg.policy.other.replay_buffer.policy, tb_logger, 'policy')
    value_buffer = AdvancedReplayBuffer(cfg.policy.other.replay_buffer.value, tb_logger, 'value')

    while True:
        # ...
        new_data = collector.collect(train_iter=learner.train_iter)
        # Push data into two buffers repectively. Remember to deepcopy if it is a must.
        policy_buffer.push(new_data, cur_collector_envstep=collector.envstep)
        value_buffer.push(deepcopy(new_data), cur_collector_envstep=collector.envstep)
        for i in range(cfg.policy.learn.update_per_collect):
            batch_size = learner.policy.get_attribute('batch_size')
            # Sample from two buffers respectively. Form the new `train_data` and start learner training.
            policy_data = policy_buffer.sample(batch_size['policy'], learner.train_iter)
            value_data = policy_buffer.sample(batch_size['value'], learner.train_iter)
            if policy_data is not None and value_data is not None:
                train_data = {'policy': policy_data, 'value': value_data}
                learner.train(train_data, collector.envstep)
        # Since `PPG` is on-policy, remember to clear two buffers.
        policy_buffer.clear()
        value_buffer.clear()
"""


class Done(Exception):
    pass


class Collector:
    """Hands over a list of transition dicts, as nerveX's collector does."""

    def __init__(self) -> None:
        self.envstep = 0

    def collect(self, train_iter: int) -> list[dict[str, Any]]:
        rows = [{"obs": np.full(4, self.envstep + i, np.float32), "action": np.int64(i % 2), "reward": 1.0}
                for i in range(8)]
        self.envstep += 8
        return rows


class Learner:
    def __init__(self, stop_after: int) -> None:
        self.train_iter = 0
        self.stop_after = stop_after
        self.trained: list[dict[str, Any]] = []

        class Policy:
            @staticmethod
            def get_attribute(name: str) -> dict[str, int]:
                assert name == "batch_size"
                return {"policy": 4, "value": 6}

        self.policy = Policy()

    def train(self, data: dict[str, Any], envstep: int) -> None:
        self.trained.append(data)
        self.train_iter += 1
        if self.train_iter == self.stop_after:
            raise Done


def test_ppg_pipeline_with_two_buffers() -> None:
    ns: dict[str, Any] = {"AdvancedReplayBuffer": AdvancedReplayBuffer, "tb_logger": None}
    exec(textwrap.dedent(CONFIG), ns)
    cfg = EasyDict(ns["cartpole_ppg_config"])
    cfg["policy"]["learn"] = EasyDict({"update_per_collect": 2})
    learner = Learner(stop_after=6)
    ns.update(cfg=cfg, collector=Collector(), learner=learner)
    exec("from copy import deepcopy", ns)
    try:
        with pytest.raises(Done):
            exec(textwrap.dedent(PIPELINE), ns)
        policy_buffer, value_buffer = ns["policy_buffer"], ns["value_buffer"]
        assert policy_buffer.buffer.capacity == 100 and policy_buffer.buffer.options.max_use == 10
        assert value_buffer.buffer.capacity == 1000 and value_buffer.buffer.options.max_use == 100
        assert len(learner.trained) == 6
        for data in learner.trained:
            assert len(data["policy"]) == 4 and len(data["value"]) == 6
            batch = data["policy"]
            assert {"obs", "action", "reward", "IS", "priority", "replay_buffer_idx"} <= set(batch[0])
            # sampled without replacement from the 8 rows of this collect
            assert len({d["replay_buffer_idx"] for d in batch}) == 4
        assert policy_buffer.count() == 8                      # the last collect, not cleared yet
    finally:
        for key in ("policy_buffer", "value_buffer"):
            if key in ns:
                ns[key].close()


def test_too_few_rows_give_none() -> None:
    with AdvancedReplayBuffer(dict(replay_buffer_size=10), None, "agent") as buffer:
        assert buffer.sample(4, 0) is None                       # empty
        buffer.push([{"obs": np.zeros(2)} for _ in range(3)], cur_collector_envstep=0)
        assert buffer.sample(4, 0) is None                       # nerveX returns None, never raises
        assert len(buffer.sample(3, 0)) == 3


PRIORITY_CONFIG = """
    replay_buffer=dict(
        buffer_name=['agent'],
        agent=dict(
            meta_maxlen=4096,
            max_reuse=16,
            alpha=0.6,
            beta=0.4,
            # sample step count
            anneal_step=0,
        )
    )
"""


def test_priority_best_practice() -> None:
    ns: dict[str, Any] = {}
    exec(textwrap.dedent(PRIORITY_CONFIG), ns)
    cfg = EasyDict(ns["replay_buffer"])
    with AdvancedReplayBuffer(cfg.agent, None, "agent") as buffer:
        # Ape-X: the actor's priority travels inside the transition and becomes the initial one
        transitions = [{"obs": np.full(2, i, np.float32), "action": np.int64(0), "reward": 0.0,
                        "priority": float(i + 1), "done": False} for i in range(4)]
        buffer.push(transitions, cur_collector_envstep=0)
        assert buffer.buffer is not None and "priority" not in buffer.buffer.schema
        assert buffer.buffer.capacity == 4096 and buffer.buffer.options.max_use == 16
        for _ in range(5):
            data = buffer.sample(4, cur_learner_iter=0)
            assert data is not None
            assert sorted(round(d["priority"], 6) for d in data) == [1.0, 2.0, 3.0, 4.0]
            assert buffer.beta == 0.4                            # anneal_step=0: no annealing
            # IS = (p / min p) ** -beta with p = (priority + eps) ** alpha
            for d in data:
                assert d["IS"] == pytest.approx((d["priority"] / 1.0) ** (-0.6 * 0.4), rel=1e-4)
        # the learner returns 'priority': td_error_per_sample.abs().tolist()
        buffer.update({"replay_buffer_idx": [d["replay_buffer_idx"] for d in data], "priority": [5.0, 5.0, 5.0, 5.0]})
        again = buffer.sample(4, cur_learner_iter=1)
        assert again is not None and [round(d["priority"], 6) for d in again] == [5.0] * 4
        assert [d["IS"] for d in again] == [1.0] * 4


def test_annealing_when_anneal_step_is_given() -> None:
    with AdvancedReplayBuffer(dict(replay_buffer_size=8, alpha=1.0, beta=0.2, anneal_step=4)) as buffer:
        buffer.push([{"obs": np.zeros(1), "priority": p} for p in (1.0, 2.0)])
        betas = []
        for _ in range(6):
            betas.append(round(buffer.beta, 6))
            buffer.sample(2, 0)
        assert betas == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
