"""Smoke test of the benchmark harness: ``python -m benchmarks --quick`` runs to the end, records the
machine and an entry for every case, and leaves nothing of ours in /dev/shm. It passes whether or
not the peers (the ``bench`` extra) are installed: a peer is either measured, "not installed", or
(for a feature it lacks) "no equivalent"."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def left_by(pid: int) -> list[str]:
    """Segments in /dev/shm of the benchmark process ``pid`` (its buffers are named bench-<pid>-...)."""
    prefix = f"shmbuffer-bench-{pid}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] if os.path.isdir("/dev/shm") else []


GROUPS = {
    "shmbuffer and peers": ["floor.*", "mujoco.*", "atari.*", "gpu.*", "her.sample*"],
    "frameworks": ["sb3.*", "torchrl.*", "ray.*", "her.sac"],
}
"""The quick run in two halves (each within its time limit, in parallel under ``pytest -n``); every
case is in one of them (``test_the_halves_cover_every_case``)."""


def listed() -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def test_the_halves_cover_every_case() -> None:
    names = listed()
    for name in names:
        assert sum(any(fnmatch.fnmatch(name, g) for g in globs) for globs in GROUPS.values()) == 1, name


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_quick_benchmark_runs(group: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    globs = GROUPS[group]
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks", "--quick", "--only", *globs, "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # timed out (or interrupted): kill it and every process it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, log[-5000:]
    results = json.loads(out.read_text())
    assert out.with_suffix(".md").exists()

    machine = results["machine"]
    for key in ("cpu", "logical_cores", "memory_gib", "python", "packages", "gpu"):
        assert machine.get(key), key
    assert {"numpy", "torch", "cpprb", "torchrl", "stable-baselines3"} <= set(machine["packages"])

    names = [n for n in listed() if any(fnmatch.fnmatch(n, g) for g in globs)]
    assert set(names) == set(results["cases"]), (names, list(results["cases"]))
    for name, case in results["cases"].items():
        assert case["status"] in {"ok", "not available yet", "skipped"}, (name, case.get("reason"))
        if case["status"] != "ok":
            assert case["reason"], name
            continue
        assert case["subjects"], name
        if "shmbuffer" in case["subjects"] or case["group"] != "floor":
            assert case["subjects"]["shmbuffer"]["status"] == "ok", (name, case["subjects"]["shmbuffer"])
        for who, s in case["subjects"].items():
            # "no equivalent": the peer lacks the case's feature; "unusable": installed but broken here
            # (torchrl's compiled extension built for another torch)
            assert s["status"] in {"ok", "not installed", "n/a", "no equivalent", "unusable"}, (name, who, s)
            if s["status"] == "ok":
                assert all("median" in m or m.get("status") == "n/a" for m in s["metrics"].values()), (name, who)
    assert {t["status"] for t in results["targets"]} <= {"met", "missed", "not measured"}
    assert not left_by(proc.pid)
    assert not results["left_in_dev_shm"]
