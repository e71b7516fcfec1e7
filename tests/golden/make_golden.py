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


if __name__ == "__main__":
    uniform()
    prioritized()
    print(f"wrote {OUT}")
