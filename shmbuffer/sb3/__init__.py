"""Stable-Baselines3's replay buffers whose rows live in a shmbuffer (``pip install -e ".[sb3]"``).

``ReplayBuffer`` and ``DictReplayBuffer`` are in ``buffers.py`` (its docstring is their
specification), ``NStepReplayBuffer`` in ``nstep.py``; ``HerReplayBuffer`` (hindsight relabelling at sample time,
``shmbuffer.hindsight``) in ``her.py``.
"""

from .buffers import WAIT as WAIT
from .buffers import DictReplayBuffer, ReplayBuffer
from .her import HerReplayBuffer
from .nstep import NStepReplayBuffer

__all__ = ["DictReplayBuffer", "HerReplayBuffer", "NStepReplayBuffer", "ReplayBuffer"]
