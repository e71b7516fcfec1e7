"""A pytest plugin: Stable-Baselines3's own tests, with ``shmbuffer.sb3``'s buffers in place of SB3's.

Loaded with ``-p shmbuffer_sb3_swap`` (see README.md). Before collection, every name that SB3's
modules and the test modules import for ``ReplayBuffer``, ``DictReplayBuffer`` or
``NStepReplayBuffer`` (and ``HerReplayBuffer``) is bound to ours, so ``from stable_baselines3.common.buffers import
ReplayBuffer`` in a test module, ``from stable_baselines3 import HerReplayBuffer`` and the default
``replay_buffer_class`` of DQN, SAC, TD3 and DDPG all give shmbuffer's classes. ``stable_baselines3.common.buffers`` gets its own names back once
the tests are collected: SB3's ``DictReplayBuffer`` (which ``HerReplayBuffer`` extends) calls
``super(ReplayBuffer, self)`` by that module's name.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from stable_baselines3.common import buffers
from stable_baselines3.her import her_replay_buffer

from shmbuffer import sb3 as ours

SWAP: dict[type, type] = {
    buffers.ReplayBuffer: ours.ReplayBuffer,
    buffers.DictReplayBuffer: ours.DictReplayBuffer,
    buffers.NStepReplayBuffer: ours.NStepReplayBuffer,
    her_replay_buffer.HerReplayBuffer: ours.HerReplayBuffer,
}
ORIGINAL = {cls.__name__: cls for cls in SWAP}


class _ChecksAsSB3(type(ours.ReplayBuffer)):  # SB3's buffers are ABCs
    """``isinstance(x, cls)`` asks SB3's ``ReplayBuffer``: every buffer of ours derives from SB3's."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, ORIGINAL["ReplayBuffer"])


class DefaultReplayBuffer(ours.ReplayBuffer, metaclass=_ChecksAsSB3):
    """``off_policy_algorithm``'s ``ReplayBuffer``: the default buffer it makes is ours, and its
    ``load_replay_buffer`` check (``isinstance(rb, ReplayBuffer)``) passes for each of ours, as it does
    without the swap (``shmbuffer.sb3.DictReplayBuffer`` and ``HerReplayBuffer`` derive from SB3's
    ``DictReplayBuffer``, not from ``shmbuffer.sb3.ReplayBuffer``)."""


def _swap_everywhere(*, buffers_too: bool) -> None:
    """Bind SB3's buffer names to ours in every loaded SB3 and test module."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("stable_baselines3") or name.startswith("tests")):
            continue
        if module is buffers and not buffers_too:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in SWAP:
                setattr(module, attr, SWAP[value])
        if name == "stable_baselines3.common.off_policy_algorithm":
            module.ReplayBuffer = DefaultReplayBuffer  # type: ignore[attr-defined]


_swap_everywhere(buffers_too=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[Any]:
    _swap_everywhere(buffers_too=True)  # the test modules import the names from buffers
    try:
        yield
    finally:
        for name, cls in ORIGINAL.items():
            if hasattr(buffers, name):
                setattr(buffers, name, cls)
        _swap_everywhere(buffers_too=False)  # a module first imported by a test module


def pytest_report_header() -> str:
    return f"shmbuffer_sb3_swap: {', '.join(c.__name__ for c in SWAP)} of SB3 are shmbuffer.sb3's"
