"""Write the golden files of persistence format version 1 into tests/golden/v1/.

They are committed, and tests/test_persistence.py checks that every later shmbuffer loads them with
exactly the content described here. Run from anywhere: ``python tests/golden/make_golden.py``.
Never regenerate them for a new format version: add a v2/ beside them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import shmbuffer as sb  # noqa: E402
from tests.conftest import MUJOCO, transition  # noqa: E402

OUT = Path(__file__).resolve().parent / "v1"


def uniform() -> None:
    """Capacity 8, one lane, 11 rows pushed: rows 3..10 stay (ids 3..10, each row's values derive
    from its id, see conftest.transition); 5 rows sampled."""
    with sb.ReplayBuffer(MUJOCO, 8, name=f"golden-{os.getpid()}-uniform", seed=0) as buf:
        buf.push(transition(0, 6))
        buf.push(transition(6, 5))
        buf.sample(5)
        sb.save(buf, OUT / "uniform")


def prioritized() -> None:
    """Capacity 8 in 2 lanes of 4, Prioritized(alpha=0.5), max_use=3, episodes. Row values derive
    from the row's id (``n * 2 + lane``).

    lane 0: row numbers 0..5 pushed (ids 0, 2 .. 10), episodes 0 0 0 1 1 1, priority id + 1;
            rows 2..5 stay (ids 4, 6, 8, 10)
    lane 1: row numbers 0..2 (ids 1, 3, 5), episode 7, priority 0.5
    then:   update_priorities(ids 5 and 8 -> 9.0 and 0.25); id 4 drawn 3 times (used up, leaf 0),
            id 3 drawn once. Largest priority given: 11.
    """
    opts = {"sampler": sb.Prioritized(alpha=0.5, beta=0.4), "max_use": 3, "lanes": 2, "episodes": True}
    with sb.ReplayBuffer(MUJOCO, 8, name=f"golden-{os.getpid()}-prioritized", **opts) as buf:
        for episode, ids in ((0, np.array([0, 2, 4])), (1, np.array([6, 8, 10]))):
            buf.push(transition(ids), lane=0, episode=episode, priority=ids + 1.0)
        buf.push(transition(np.arange(3) * 2 + 1), lane=1, episode=7, priority=0.5)
        assert buf.update_priorities(np.array([5, 8]), np.array([9.0, 0.25])) == 2
        prios = buf._prios
        assert prios is not None
        with buf.ring.lock:  # draws without a random generator, so the file never depends on one
            prios.claim(buf.ring.slots(np.array([4, 4, 4, 3])))
        sb.save(buf, OUT / "prioritized")


class _Interrupted(dict):
    """Stands in for a buffer's column table: the push copying through it is interrupted."""

    def __getitem__(self, key: str) -> None:
        raise KeyboardInterrupt


def _interrupted_push(buf: sb.ReplayBuffer, rows: dict, **kw: object) -> None:
    """A push interrupted mid-copy: its rows are given back empty (holes)."""
    targets = buf._targets
    buf._targets = _Interrupted(targets)
    try:
        buf.push(rows, **kw)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the push was not interrupted")
    finally:
        buf._targets = targets


def holes() -> None:
    """Capacity 8 in 2 lanes of 4, Prioritized(alpha=1.0, eps=0.0), episodes; row values derive
    from the row's id (``n * 2 + lane``), priorities are id + 1. Empty rows inside the lanes' runs
    are holes (``_present`` 0, zeros in every tensor):

    lane 0: row 0 (id 0, episode 0); rows 1, 2 (ids 2, 4) pushed with an interrupt mid-copy, so
            empty; row 3 (id 6, episode 0)
    lane 1: rows 0..2 (ids 1, 3, 5, episode 1); row 3 (id 7) interrupted: a hole at the lane's end
    Largest priority given: 7.
    """
    opts = {"sampler": sb.Prioritized(alpha=1.0, eps=0.0), "lanes": 2, "episodes": True}
    with sb.ReplayBuffer(MUJOCO, 8, name=f"golden-{os.getpid()}-holes", **opts) as buf:
        buf.push(transition(np.array([0])), lane=0, episode=0, priority=1.0)
        _interrupted_push(buf, transition(np.array([2, 4])), lane=0, episode=0)
        buf.push(transition(np.array([6])), lane=0, episode=0, priority=7.0)
        ids = np.array([1, 3, 5])
        buf.push(transition(ids), lane=1, episode=1, priority=ids + 1.0)
        _interrupted_push(buf, transition(np.array([7])), lane=1, episode=1)
        sb.save(buf, OUT / "holes")


if __name__ == "__main__":
    uniform()
    prioritized()
    holes()
    print(f"wrote {OUT}")
