"""Shared fixtures: a unique buffer name per test, buffers that are always cleaned up, processes
that are always killed, and a check that no test leaves a segment of ours in /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

# One thread for torch and numpy's BLAS in every test process and the processes it starts (set
# before anything imports torch): under `pytest -n auto` each worker has a core at most, and torch's
# default of a thread per core made every op wait on threads sharing that core with the other
# worker: on the 2-core VM under load, a DQN test's 300 updates took minutes instead of seconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.sampling.sumtree import SumTree
from shmbuffer.shm import segment

MUJOCO = sb.Schema(
    obs=((17,), "float32"), action=((6,), "float32"), reward=((), "float32"),
    next_obs=((17,), "float32"), done=((), "bool"),
)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A buffer name no other test (or xdist worker) uses."""
    return f"t{os.getpid()}-{uuid.uuid4().hex[:10]}"


def own_blocks() -> set[str]:
    """The blocks in /dev/shm that this process made (named ``<pid>-...`` or ``t<pid>-...``): other
    xdist workers' blocks come and go meanwhile."""
    mine = f"{os.getpid()}-"
    return {n for n in segment.list_names() if n.startswith(mine) or n.startswith(f"t{mine}")}


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves behind a segment created by this process."""
    before = set(segment.list_names())
    yield
    mine = f"{os.getpid()}-"
    left = [n for n in set(segment.list_names()) - before if n.startswith(mine) or n.startswith(f"t{mine}")]
    for n in left:
        try:
            os.unlink(segment.path_of(n))
        except FileNotFoundError:
            pass
    assert not left, f"segments left in /dev/shm: {left}"


@pytest.fixture
def make() -> Iterator[Callable[..., sb.ReplayBuffer]]:
    """Create buffers that are closed and unlinked after the test, even when it fails."""
    made: list[sb.ReplayBuffer] = []

    def factory(*args: Any, **kwargs: Any) -> sb.ReplayBuffer:
        buf = sb.ReplayBuffer(*args, **kwargs)
        made.append(buf)
        return buf

    yield factory
    discard(made)


def discard(buffers: list[sb.ReplayBuffer]) -> None:
    """Close and unlink every buffer, even one whose views a failed test still holds."""
    for buf in buffers:
        try:
            buf.close()
        except BufferError:
            pass
        buf.unlink()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes started by a test; killed and joined at teardown whatever happened."""
    started: list[Any] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


class _Hooked:
    """A column a numpy copy writes through: ``hook(name)`` runs before each assignment."""

    def __init__(self, name: str, column: np.ndarray, hook: Callable[[str], None]) -> None:
        self.name, self.column, self.hook = name, column, hook

    def __getitem__(self, key: Any) -> Any:
        return self.column[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.hook(self.name)
        self.column[key] = value


class _NumpyCopies:
    """The extension, but its row copy declines (``put`` returns ``False``), so numpy copies."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def put(self, *args: Any) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)


def python_push(buf: sb.ReplayBuffer) -> None:
    """Make ``buf``'s pushes take the Python steps (``protocol/push.py``), where a push can fail
    after its reservation (the one C call cannot): ``buf.push`` the Python method for every call."""
    buf._fast_push = None
    sb.buffer.SEATS.seat(buf, None)


def copy_through(buf: sb.ReplayBuffer, hook: Callable[[str], None]) -> None:
    """Make ``buf``'s pushes take the Python steps and copy with numpy, calling ``hook(field)``
    before each field's rows are written (``"_episode"`` for the episode ids): the seam where a
    test stops, stalls or kills a push midway through its copy (``protocol/push.py``)."""
    python_push(buf)
    copier = buf._copier
    copier.lib = None if copier.lib is None else _NumpyCopies(copier.lib)  # the numpy copy
    names = [*copier.names, "_episode"]
    real = type(copier).numpy_targets
    mine = weakref.ref(copier)  # no cycle through the copier: its views go with the buffer's close()
    copier.numpy_targets = lambda: [_Hooked(n, c, hook) for n, c in zip(names, real(mine()), strict=False)]


SMALL = sb.Schema(obs=((3,), "float32"), reward=((), "float32"))
"""A schema of two small fields, for tests of what a row carries besides its fields."""


STEP = sb.Schema(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                 next_obs=((3,), "float32"), done=((), "bool"))
"""A transition of small fields (a vector env's step, one row per env)."""


def small_row(i: float) -> dict[str, Any]:
    """A row of ``SMALL`` that names ``i``."""
    return {"obs": np.full(3, i, np.float32), "reward": float(i)}


def transition(i: int | np.ndarray, k: int | None = None) -> dict[str, np.ndarray]:
    """Self-verifying MuJoCo-like rows: every value derives from the row's sequence number
    (below 2**24, which float32 holds exactly)."""
    seq = np.arange(i, i + k) if k is not None else np.asarray(i)
    s = seq.astype(np.float32)[..., None]
    return {
        "obs": s + np.arange(17, dtype=np.float32),
        "action": -s + np.arange(6, dtype=np.float32),
        "reward": seq.astype(np.float32),
        "next_obs": s + 1 + np.arange(17, dtype=np.float32),
        "done": seq % 2 == 1,
    }


def seq_of(batch: Any, *, done: bool = True) -> np.ndarray:
    """The sequence numbers of a batch of ``transition`` rows, after checking every value (but
    ``done`` when the test sets it itself)."""
    seq = np.asarray(batch["reward"]).astype(np.int64)
    s = seq.astype(np.float32)[..., None]
    assert np.array_equal(batch["obs"], s + np.arange(17, dtype=np.float32))
    assert np.array_equal(batch["action"], -s + np.arange(6, dtype=np.float32))
    assert np.array_equal(batch["next_obs"], s + 1 + np.arange(17, dtype=np.float32))
    if done:
        assert np.array_equal(batch["done"], seq % 2 == 1)
    return seq


START_METHODS = [m for m in ("spawn", "forkserver", "fork") if m in mp.get_all_start_methods()]


def run_seed(code: str, ns: dict[str, Any], imports: dict[str, str], label: str) -> dict[str, Any]:
    """Run a code block of a seed document in ``ns``, its import lines replaced by ``imports``
    (theirs -> ours), and nothing else changed."""
    import textwrap

    code = textwrap.dedent(code)
    for theirs, ours in imports.items():
        code = code.replace(theirs, ours)
    exec(compile(code, label, "exec"), ns)
    return ns


LIB = native.lib


needs_lib = pytest.mark.skipif(LIB is None, reason=f"the C extension is not loaded: {native.REASON}")


def python_tree(capacity: int, sums: np.ndarray | None = None, mins: np.ndarray | None = None) -> SumTree:
    """A SumTree that runs the numpy code whatever is loaded."""
    saved = native.lib
    native.lib = None
    try:
        return SumTree(capacity, sums, mins)
    finally:
        native.lib = saved


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a test on the C path and on the Python path (buffers made inside see the choice)."""
    if request.param == "native":
        if LIB is None:
            pytest.skip(f"the C extension is not loaded: {native.REASON}")
    else:
        monkeypatch.setattr(native, "lib", None)
    yield request.param
