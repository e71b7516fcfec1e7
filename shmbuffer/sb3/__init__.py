"""Stable-Baselines3's replay buffers whose rows live in a shmbuffer (``pip install -e ".[sb3]"``).

``ReplayBuffer``, ``DictReplayBuffer`` and ``NStepReplayBuffer`` are in ``buffers.py`` (its
docstring is their specification); ``HerReplayBuffer`` (hindsight relabelling at sample time,
``shmbuffer.hindsight``) in ``her.py``.
"""

from .buffers import WAIT as WAIT
from .buffers import DictReplayBuffer, NStepReplayBuffer, ReplayBuffer
from .her import HerReplayBuffer

__all__ = ["DictReplayBuffer", "HerReplayBuffer", "NStepReplayBuffer", "ReplayBuffer"]
