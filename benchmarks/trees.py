"""Push and sample of several source trees measured together: each tree in its own process pinned
to one core, the trees in turn (each first in turn), several rounds; ratios against the last tree.

::

    python -m benchmarks.trees base=/path/to/worktree new=. --rounds 20 [--out trees.json]

Each tree needs its C extension built in place (``python setup.py build_ext --inplace``). A
process fills a 1M-row MuJoCo buffer (obs 17 float32, action 6 float32, reward float32, next_obs
17 float32, done bool) and times ``push(**one_row)`` (50k calls), ``push(**rows)`` of 64 rows
(10k calls) and ``sample(256)`` (2k calls), 11 repeats each, in ns a call from CPU time
(``time.process_time``). Summaries: the best of all rounds, the median of the rounds' best, the
median of the rounds' medians, and the median of the paired per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import time
from typing import Any

CASES = ("push1", "push64", "sample256")


def child(tree: str) -> dict[str, list[float]]:
    """The figures of ``tree``, measured in this process."""
    sys.path.insert(0, tree)
    import numpy as np

    import shmbuffer as sb
    from shmbuffer import native

    if not os.path.abspath(sb.__file__).startswith(os.path.join(tree, "")):
        raise SystemExit(f"{tree}: imported shmbuffer from {sb.__file__} instead")
    if native.ACTIVE != "native":
        raise SystemExit(f"{tree}: the C extension is not built ({native.REASON}): python setup.py build_ext --inplace")
    schema = sb.Schema(obs=((17,), "float32"), action=((6,), "float32"), reward=((), "float32"),
                       next_obs=((17,), "float32"), done=((), "bool"))
    rng = np.random.default_rng(0)
    one = {"obs": rng.random(17, np.float32), "action": rng.random(6, np.float32), "reward": np.float32(1.0),
           "next_obs": rng.random(17, np.float32), "done": False}
    many = {"obs": rng.random((64, 17), np.float32), "action": rng.random((64, 6), np.float32),
            "reward": rng.random(64, np.float32), "next_obs": rng.random((64, 17), np.float32),
            "done": np.zeros(64, bool)}

    def rate(fn: Any, calls: int) -> list[float]:
        out = []
        for _ in range(11):
            t = time.process_time()
            for _ in range(calls):
                fn()
            out.append((time.process_time() - t) / calls * 1e9)
        return out

    with sb.ReplayBuffer(schema, 1_000_000) as buf:
        for _ in range(1_000_000 // 64):
            buf.push(**many)  # full: every sample draws from the whole ring
        return {"push1": rate(lambda: buf.push(**one), 50_000), "push64": rate(lambda: buf.push(**many), 10_000),
                "sample256": rate(lambda: buf.sample(256), 2_000)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="*", help="NAME=PATH of each tree; the last is compared with the others")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--core", default="0", help="the core each process is pinned to (taskset -c)")
    p.add_argument("--out", help="write every figure and the load averages here (JSON)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return
    trees = dict(t.split("=", 1) for t in a.trees)
    if len(trees) < 2:
        p.error("give at least two trees, NAME=PATH each")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "SHMBUFFER_THREADS": "1"}
    names = list(trees)
    runs: dict[str, list[dict[str, list[float]]]] = {t: [] for t in names}
    loads = []
    for r in range(a.rounds):
        for t in names[r % len(names):] + names[:r % len(names)]:
            loads.append(os.getloadavg()[0])
            out = subprocess.run(["taskset", "-c", a.core, sys.executable, "-m", "benchmarks.trees", "--child",
                                  os.path.abspath(trees[t])], env=env, capture_output=True, text=True, check=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            runs[t].append(json.loads(out.stdout))
            print(r, t, {k: round(min(v)) for k, v in runs[t][-1].items()}, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"trees": trees, "runs": runs, "loads": loads}, f)
    print(f"load average {min(loads):.1f}-{max(loads):.1f}")
    new = names[-1]
    for base in names[:-1]:
        print(f"== {base}'s time / {new}'s (above 1: {new} is faster)")
        for case in CASES:
            b, n = runs[base], runs[new]
            best = min(min(x[case]) for x in b) / min(min(x[case]) for x in n)
            bests = st.median([min(x[case]) for x in b]) / st.median([min(x[case]) for x in n])
            meds = st.median([st.median(x[case]) for x in b]) / st.median([st.median(x[case]) for x in n])
            paired = st.median([min(x[case]) / min(y[case]) for x, y in zip(b, n, strict=True)])
            print(f"{case}: best {best:.2f}x, median of bests {bests:.2f}x, median of medians {meds:.2f}x, "
                  f"paired rounds {paired:.2f}x")


if __name__ == "__main__":
    main()
