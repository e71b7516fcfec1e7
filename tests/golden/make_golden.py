"""Write the golden files of the persistence format versions into tests/golden/v1/, v2/ and v3/.

They are committed, and tests/test_persistence.py checks that every later shmbuffer loads them with
exactly the content described here. Run from anywhere: ``python tests/golden/make_golden.py [v1|v2|v3]``.
Never regenerate a version's files with a later format: add a folder for the new version beside them.
v1/ was written by the release that introduced format version 1; v2/ (``next_of``/``stack``) by
commit 969d4a4, which introduced format version 2; v3/ (the saving process's last rows, ``pushed``)
by the commit that introduced format version 3.
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
OUT2 = Path(__file__).resolve().parent / "v2"
OUT3 = Path(__file__).resolve().parent / "v3"


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


FRAMES = sb.Schema(obs=((2, 2, 3), "uint8"), next_obs=((2, 2, 3), "uint8"), action=((), "int64"),
                   done=((), "bool"), truncated=((), "bool"))
"""The v2 golden's schema: observations of 2 stacked frames of (1, 2, 3) bytes."""


def frame(t: int) -> np.ndarray:
    """Frame ``t`` of the v2 golden's episodes: every byte ``10 * t + i``."""
    return (10 * t + np.arange(6, dtype=np.uint8)).reshape(1, 2, 3)


def frames_episode(ts: list[int], end: str) -> list[dict[str, object]]:
    """The transitions of an episode whose frames are ``frame(t)`` for ``t`` in ``ts`` (one more
    frame than transitions), padded by repeating the first frame; it ends by ``end``."""
    history = [frame(ts[0]), frame(ts[0])]
    out = []
    for i in range(len(ts) - 1):
        obs = np.concatenate(history[-2:])
        history.append(frame(ts[i + 1]))
        last = i == len(ts) - 2
        out.append({"obs": obs, "next_obs": np.concatenate(history[-2:]), "action": ts[i],
                    "done": last and end == "done", "truncated": last and end == "truncated"})
    return out


def frames() -> None:
    """Format version 2: capacity 16, one lane, ``next_of="obs"``, ``stack="obs"``. One episode of
    frames 0..3 (3 transitions, actions 0, 1, 2, ends done), then one of frames 5..7 (2 transitions,
    actions 5, 6, ends truncated). Stored: 7 rows (each transition's newest frame, an end row per
    episode); ``get`` gives the 5 transitions."""
    with sb.ReplayBuffer(FRAMES, 16, name=f"golden-{os.getpid()}-frames", next_of="obs", stack="obs") as buf:
        for r in frames_episode([0, 1, 2, 3], "done") + frames_episode([5, 6, 7], "truncated"):
            buf.push(**r)
        sb.save(buf, OUT2 / "frames")


def pushed() -> None:
    """Format version 3: capacity 6, one lane, ``next_of="obs"``, ``stack="obs"``, saved by the
    process that pushed. The first 7 transitions of an episode of frames 0..8 (actions 0..6; it goes
    on): the lane holds rows 1..6 (actions 1..6), ``get`` gives actions 2..5 (row 1's stack reaches
    the lapped row 0), and the step of action 6 waits for its next observation (frames 6, 7), which
    ``pushed`` holds."""
    with sb.ReplayBuffer(FRAMES, 6, name=f"golden-{os.getpid()}-pushed", next_of="obs", stack="obs") as buf:
        for r in frames_episode(list(range(9)), "truncated")[:7]:
            buf.push(**r)
        sb.save(buf, OUT3 / "pushed")


if __name__ == "__main__":
    which = sys.argv[1:] or ["v1", "v2", "v3"]
    if "v1" in which:
        uniform()
        prioritized()
        holes()
        print(f"wrote {OUT}")
    if "v2" in which:
        frames()
        print(f"wrote {OUT2}")
    if "v3" in which:
        pushed()
        print(f"wrote {OUT3}")
