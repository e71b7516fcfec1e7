"""A Hypothesis state machine drives push / sample / get / view / clear against a plain model."""

from __future__ import annotations

import os
import uuid

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import shmbuffer as sb

from .conftest import MUJOCO, seq_of, transition


class RingModel(RuleBasedStateMachine):
    """The model: one list of sequence numbers per lane, each keeping its newest rows."""

    buf: sb.ReplayBuffer | None = None

    @initialize(lane_capacity=st.integers(1, 12), lanes=st.integers(1, 3), seed=st.integers(0, 2**16))
    def create(self, lane_capacity: int, lanes: int, seed: int) -> None:
        name = f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.buf = sb.ReplayBuffer(MUJOCO, lane_capacity * lanes, lanes=lanes, name=name, seed=seed)
        self.lc = lane_capacity
        self.model: list[list[int]] = [[] for _ in range(lanes)]
        self.next = 0

    def rows(self) -> list[int]:
        return [s for lane in self.model for s in lane]

    @rule(k=st.integers(0, 12), lane=st.integers(0, 2))
    def push(self, k: int, lane: int) -> None:
        assert self.buf is not None
        lane %= len(self.model)
        if k > self.lc:
            before = self.rows()
            try:
                self.buf.push(transition(self.next, k), lane=lane)
                raise AssertionError("a push larger than a lane was accepted")
            except sb.CapacityError:
                pass
            assert seq_of(self.buf.get(slice(None))).tolist() == before
            return
        self.buf.push(transition(self.next, k), lane=lane)
        self.model[lane] = (self.model[lane] + list(range(self.next, self.next + k)))[-self.lc:]
        self.next += k

    @rule(lanes=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def push_across_lanes(self, lanes: list[int]) -> None:
        assert self.buf is not None
        lanes = [x % len(self.model) for x in lanes]
        if max(lanes.count(x) for x in lanes) > self.lc:
            return
        self.buf.push(transition(self.next, len(lanes)), lane=lanes)
        for i, lane in enumerate(lanes):
            self.model[lane] = (self.model[lane] + [self.next + i])[-self.lc:]
        self.next += len(lanes)

    @precondition(lambda self: self.buf is not None and len(self.buf) > 0)
    @rule(n=st.integers(1, 40), replace=st.booleans())
    def sample(self, n: int, replace: bool) -> None:
        assert self.buf is not None
        rows = self.rows()
        if not replace and n > len(rows):
            try:
                self.buf.sample(n, replace=False)
                raise AssertionError("sampled more distinct rows than stored")
            except sb.EmptyBufferError:
                return
        got = seq_of(self.buf.sample(n, replace=replace))
        assert len(got) == n and set(got) <= set(rows)
        if not replace:
            assert len(set(got)) == n

    @precondition(lambda self: self.buf is not None and len(self.buf) > 0)
    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        assert self.buf is not None
        rows = self.rows()
        i = data.draw(st.integers(-len(rows), len(rows) - 1))
        assert int(self.buf.get(i).reward) == rows[i]

    @precondition(lambda self: self.buf is not None)
    @rule(data=st.data())
    def view(self, data: st.DataObject) -> None:
        assert self.buf is not None
        lane = data.draw(st.integers(0, len(self.model) - 1))
        held = self.model[lane]
        start = data.draw(st.integers(0, len(held)))
        stop = data.draw(st.integers(start, len(held)))
        try:
            got = seq_of(self.buf.view(start, stop, lane=lane)).tolist()
        except ValueError as exc:
            assert "wrap" in str(exc)
            return
        assert got == held[start:stop]

    @rule()
    def clear(self) -> None:
        assert self.buf is not None
        self.buf.clear()
        self.model = [[] for _ in self.model]

    @invariant()
    def size(self) -> None:
        if self.buf is None:
            return
        assert len(self.buf) == len(self.rows())
        assert self.buf.full == (len(self.rows()) == self.buf.capacity)
        assert seq_of(self.buf.get(slice(None))).tolist() == self.rows()
        ids = self.buf.get(slice(None)).index
        assert np.array_equal(ids % len(self.model), np.repeat(np.arange(len(self.model)), [len(x) for x in self.model]))

    def teardown(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf.unlink()


RingModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestRing = RingModel.TestCase
