"""Smoke test of the benchmark harness: ``python -m benchmarks --quick`` runs to the end, records the
machine and an entry for every case, and leaves nothing of ours in /dev/shm. It passes whether or
not the peers (the ``bench`` extra) are installed: a peer is either measured, "not installed", or
(for a feature it lacks) "no equivalent"."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def left_by(pid: int) -> list[str]:
    """Segments in /dev/shm of the benchmark process ``pid`` (its buffers are named bench-<pid>-...)."""
    prefix = f"shmbuffer-bench-{pid}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] if os.path.isdir("/dev/shm") else []


GROUPS = {
    "shmbuffer and peers": ["floor.*", "mujoco.*", "atari.*", "gpu.*", "her.sample*", "ranks.*"],
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



def bench(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "benchmarks", "--quick", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    """``proc``'s output once it ends; killed with every process it started if it runs past ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.slow
def test_a_stopped_run_keeps_its_cases_and_a_rerun_merges(tmp_path: Path) -> None:
    """The results file is written after each case: a run killed in its second case leaves the first
    case's figures; a later ``--only`` run adds its case to them, each case saying when it was measured."""
    out = tmp_path / "r.json"
    proc = bench("--only", "floor.memcpy", "mujoco.multiproc", "--out", str(out))  # the second: several seconds
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), "no results file after the first case"
        os.killpg(proc.pid, signal.SIGKILL)  # a stop: no handler runs, nothing more is written
    finally:
        log = finish(proc, 60)
        for name in left_by(proc.pid):  # the killed case's buffers
            os.unlink(f"/dev/shm/{name}")
    first = json.loads(out.read_text())
    assert list(first["cases"]) == ["floor.memcpy"], log[-3000:]
    assert first["cases"]["floor.memcpy"]["measured"]["rounds"] == 1

    log = finish(bench("--only", "mujoco.push1", "--out", str(out)), 240)
    merged = json.loads(out.read_text())
    assert set(merged["cases"]) == {"floor.memcpy", "mujoco.push1"}, log[-3000:]
    assert merged["cases"]["floor.memcpy"] == first["cases"]["floor.memcpy"]
    assert [r["cases"] for r in merged["runs"]] == [["floor.memcpy"], ["mujoco.push1"]]
    for case in merged["cases"].values():
        assert {"date", "commit", "rounds", "load_average_start", "load_average_end"} <= set(case["measured"])
    assert any(r["case"] == "mujoco.push1" for r in merged["ratios"])
    assert "mujoco.push1" in out.with_suffix(".md").read_text()



def imports_of(path: Path) -> set[str]:
    """The sibling modules of ``benchmarks`` that ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "benchmarks":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
    return found


def benchmark_imports() -> dict[str, set[str]]:
    """For each module of ``benchmarks``, the modules of ``benchmarks`` it imports."""
    paths = sorted((ROOT / "benchmarks").glob("*.py"))
    names = {p.stem for p in paths}
    return {p.stem: (imports_of(p) & names) - {p.stem} for p in paths}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (``a -> b -> a``), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for other in sorted(graph.get(module, ())):
            if (found := visit(other, [*path, module])) is not None:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        if (found := visit(module, [])) is not None:
            return found
    return None


def test_no_benchmark_modules_import_each_other() -> None:
    """The benchmarks' imports form no circle: the shared machinery is ``harness.py``, which the
    cases import, and no module imports one that imports it back (directly or round about)."""
    graph = benchmark_imports()
    assert "harness" in graph["cases"] and "harness" in graph["features"]
    assert graph["harness"] <= {"data", "peers"}, graph["harness"]
    assert circle(graph) is None, f"benchmarks import in a circle: {' -> '.join(circle(graph) or [])}"


def test_the_circle_check_sees_one(tmp_path: Path) -> None:
    """The parser reads ``from . import x`` and ``from .x import y`` alike, and a circle is found."""
    src = tmp_path / "m.py"
    src.write_text("from . import cases\ndef f():\n    from .features import PROFILES\nimport benchmarks.data\n")
    assert imports_of(src) == {"cases", "features", "data"}
    assert circle({"cases": {"features", "data"}, "features": {"data", "cases"}, "data": set()}) == [
        "cases", "features", "cases"]
    assert circle({"cases": {"harness"}, "features": {"harness"}, "harness": set()}) is None


def test_the_pages_state_the_results_file() -> None:
    """benchmarks/README.md's block and the README's table are what ``python -m benchmarks.page`` writes
    from the committed results file: a number edited by hand, or a new run whose pages were not
    rewritten, fails here."""
    from benchmarks import page

    for path, text in page.pages(json.loads(page.RESULTS.read_text())).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} differs from {page.RESULTS.relative_to(ROOT)}: " \
                                         "run python -m benchmarks.page"
    assert page.PLOT.exists()
