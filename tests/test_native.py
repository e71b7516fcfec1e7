"""The C extension (``shmbuffer.native._native``) as a whole: which path runs (``SHMBUFFER_PURE=1``
forces Python), ``layout.h`` against the Python layout and row arithmetic, every C file built and
shipped, and the protocol on both paths (the ``path`` fixture). Each C file's kernels against the
Python reference: test_native_tree.py, test_native_gather.py, test_native_push.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import native
from shmbuffer.protocol import ring
from shmbuffer.protocol.layout import Counter, Lane
from shmbuffer.sampling import sumtree

from .conftest import LIB, MUJOCO, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]


def test_active_path_is_reported_and_can_be_forced() -> None:
    code = "import shmbuffer.native as n; print(n.ACTIVE, '|', n.REASON)"
    env = {**os.environ, "SHMBUFFER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("python |") and "SHMBUFFER_PURE" in out
    assert native.ACTIVE == ("native" if LIB is not None else "python")
    if os.environ.get("SHMBUFFER_PURE", "") in ("", "0"):
        # on a machine that built the package, the extension must load (CI has a compiler)
        assert LIB is not None, native.REASON


# -- the tree ------------------------------------------------------------------------------------


# -- gather ---------------------------------------------------------------------------------------


# large rows wider than a 4 KiB page and not a multiple of it (the gather prefetches rows ahead page by page)


# -- push -------------------------------------------------------------------------------------------


# -- the protocol on both paths ---------------------------------------------------------------
def test_round_trip_and_torn_rows_never_kept(path: str, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=64, name=name, sampler=sb.Prioritized(), seed=1)
    for i in range(0, 96, 8):
        buf.push(transition(i, 8))
    res = buf.ring.reserve(3)  # rows 96-98 being written: never returned
    try:
        seq = seq_of(buf.sample(512))
        assert set(seq) <= set(range(32, 96))
        buf.update_priorities(np.arange(32, 96), np.where(np.arange(32, 96) == 40, 1e6, 1e-6))
        assert (seq_of(buf.sample(256)) == 40).mean() > 0.9
    finally:
        buf.ring.commit(res)


def writer(name: str, pure: bool, rows: int) -> None:
    if pure:
        native.lib = None
    buf = sb.ReplayBuffer.attach(name)
    try:
        for i in range(0, rows, 8):
            buf.push(transition(i, 8))
    finally:
        buf.close()


@pytest.mark.slow
def test_a_writer_process_and_a_sampler_never_tear_rows(path: str, make: Make, name: str, procs: list[Any]) -> None:
    import multiprocessing as mp

    buf = make(MUJOCO, capacity=256, name=name)
    buf.push(transition(0, 8))
    p = mp.get_context("spawn").Process(target=writer, args=(name, path == "python", 40_000))
    procs.append(p)
    p.start()
    batches = 0
    while p.is_alive() or batches < 5:
        seq_of(buf.sample(128))  # every value of every row checked against its sequence number
        batches += 1
    p.join(30)
    assert p.exitcode == 0 and buf.stats["inserted"] == 40_008
    assert batches >= 5


def test_dead_writers_rows_are_never_read_and_are_reclaimed(path: str, make: Make, name: str) -> None:
    """A writer that reserves rows and dies: readers skip them, and a reservation that comes round
    takes them over (the C reservation leaves odd slots to ring.py's lapping rules)."""
    buf = make(MUJOCO, capacity=8, name=name, seed=3)
    buf.push(transition(0, 4))
    code = f"import os, shmbuffer as sb; sb.ReplayBuffer.attach({name!r}).ring.reserve(2); os._exit(0)"
    env = {**os.environ, "SHMBUFFER_PURE": "1" if path == "python" else "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert buf.ring.stamp[:6].tolist() == [2, 4, 6, 8, 9, 11]
    assert set(seq_of(buf.sample(64))) <= {0, 1, 2, 3}
    buf.push(transition(6, 2))  # slots 6, 7
    buf.push(transition(8, 4))  # slots 0-3: wraps, nothing odd there
    assert buf.stats["reclaimed"] == 0
    buf.push(transition(12, 2))  # slots 4, 5: odd rows of a dead writer, reclaimed
    assert buf.stats["reclaimed"] == 2 and not (buf.ring.stamp & 1).any()
    assert sorted(seq_of(buf.get(slice(None))).tolist()) == [6, 7, 8, 9, 10, 11, 12, 13]


def test_lanes_clear_and_limits_on_both_paths(path: str, make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=12, lanes=3, name=name, seed=4)
    ids = buf.push(transition(0, 6), lane=np.array([0, 1, 2, 0, 1, 2]))
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert buf.push(transition(6, 2), lane=1).tolist() == [7, 10]
    assert set(seq_of(buf.sample(200))) == set(range(8))
    buf.clear()
    assert len(buf) == 0
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(4)
    buf.push(transition(20, 3), lane=np.array([2, 2, 0]))
    assert set(seq_of(buf.sample(100))) == {20, 21, 22}
    with pytest.raises(sb.CapacityError):  # more rows than a lane holds: refused before anything changes
        buf.push(transition(30, 5), lane=np.zeros(5, np.int64))
    with pytest.raises(sb.CapacityError, match="lane numbers"):
        buf.push(transition(30, 2), lane=np.array([0, 3]))
    assert len(buf) == 3 and buf.stats["inserted"] == 11


# -- prioritized replay: the draw, the weights, the update -----------------------------------------


LAYOUT_H = Path(native.__file__).with_name("layout.h")


def layout_h_defines() -> dict[str, int]:
    """Every ``#define NAME value`` of ``native/layout.h`` (its include guard aside), evaluated."""
    found: dict[str, int] = {}
    for line in LAYOUT_H.read_text().splitlines():
        m = re.match(r"#define\s+(\w+)\s+(.+?)\s*(/\*.*)?$", line)
        if m and not m.group(1).endswith("_H"):
            text = m.group(2).replace("(int64_t)", "")
            assert re.fullmatch(r"[-+*<>() 0-9]+", text), f"layout.h: {m.group(1)} is not a plain integer: {text}"
            found[m.group(1)] = int(eval(text))  # digits, operators and parentheses only (checked above)
    return found


def test_layout_h_states_the_python_layout() -> None:
    """Every constant the C files take from ``native/layout.h`` is the Python definition's number:
    a change on one side alone fails here."""
    from shmbuffer import frames
    from shmbuffer.protocol import layout
    from shmbuffer.shm import lock

    specs = {c.name: c for c in layout.columns(sb.Schema(x=((), "float32")), layout.Options(capacity=12, lanes=3))}
    python = {
        "LANE_WORDS": layout.LANE_WORDS, "LANE_CURSOR": layout.Lane.CURSOR, "LANE_BASE": layout.Lane.BASE,
        "STATS_WORDS": specs["_stats"].shape[0], "COUNTER_UPDATES": Counter.UPDATES, "COUNTER_DELETES": Counter.DELETES, "COUNTER_DEVICE_ROWS": Counter.DEVICE_ROWS, "COUNTER_DEVICE_AT": Counter.DEVICE_AT, "COUNTER_INSERTED": Counter.INSERTED, "COUNTER_FROZEN": Counter.FROZEN, "COUNTER_REMOVED": Counter.REMOVED, "COUNTER_EDITS": Counter.EDITS, "COUNTER_EDITS_BEGUN": Counter.EDITS_BEGUN,
        "WRITERS": layout.WRITERS, "LOCK_SIZE": lock.SIZE, "LOCK_REPAIR": lock.REPAIR,
        "KIND_END": frames.END, "KIND_START": frames.START, "KIND_ZERO": frames.ZERO, "KIND_LEAD": frames.LEAD,
        "FANOUT": sumtree.FANOUT, "INVALID_ID": ring.INVALID,
    }
    assert specs["_writer_pid"].shape == (layout.WRITERS,) and specs["_mutex"].shape == (lock.SIZE,)
    assert {k: int(v) for k, v in python.items()} == layout_h_defines()
    if LIB is not None:  # the module's attributes come from the same header (a stale build fails here)
        assert {k: getattr(LIB, k) for k in python} == layout_h_defines()


ARITHMETIC_C = """
#include <stdio.h>
#include "layout.h"
static const int64_t V[] = {%(values)s};
#define NV (sizeof(V) / sizeof(V[0]))
#define OUT(x) printf("%%lld\\n", (long long)(x))
int main(void) {
    const int64_t lanes_[] = {1, 3, 4}, lcs[] = {5, 7};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (size_t i = 0; i < NV; i++) {
                int64_t lanes = lanes_[a], lc = lcs[b], v = V[i];
                OUT(slot_of(lanes - 1, v, lc)); OUT(row_id(v, lanes - 1, lanes)); OUT(lane_of_id(v, lanes));
                OUT(number_of_id(v, lanes)); OUT(slot_of_id(v, lanes, lc)); OUT(committed_stamp_of_id(v, lanes));
                OUT(first_row(v, V[(i + 1) %% NV], lc));
            }
    for (size_t i = 0; i < NV; i++) {
        int64_t v = V[i], w = V[(i + 3) %% NV];
        OUT(writing_stamp(v)); OUT(committed_stamp(v)); OUT(commit_stamp(writing_stamp(v))); OUT(number_of_stamp(v));
        OUT(is_committed(v)); OUT(is_writing(v)); OUT(next_row(v, w)); OUT(intact(v, w, v)); OUT(intact(v, v, v));
        OUT(intact(w, v, v));
    }
    return 0;
}
"""


def test_layout_h_does_the_row_arithmetic_of_rows_py(tmp_path: Path) -> None:
    """The row arithmetic of ``native/layout.h`` (slots, ids, stamps, bounds) gives what
    ``protocol/rows.py`` gives, on ids and stamps of any value (wrapping as numpy's int64)."""
    from shmbuffer.protocol import rows

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the layout.h check")
    values = [0, 1, 2, 3, 5, 6, 7, 11, 12, 13, 35, 1_000_003, -1, -2, -3, -7, -36, 2**62 - 1, 2**62, -(2**62),
              2**63 - 1, -(2**63), -(2**63) + 1]
    source = tmp_path / "arithmetic.c"
    source.write_text(ARITHMETIC_C % {"values": ", ".join(f"INT64_C({v})" if v > -(2**63) else "INT64_MIN" for v in values)})
    program = tmp_path / "arithmetic"
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Werror", "-I", str(LAYOUT_H.parent), str(source), "-o", str(program)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout.split()]
    v = np.array(values, np.int64)
    nxt = np.roll(v, -1)
    expected: list[np.ndarray] = []
    for lanes in (1, 3, 4):
        for lc in (5, 7):
            table = np.zeros((len(v), 8), np.int64)
            table[:, int(Lane.CURSOR)], table[:, int(Lane.BASE)] = v, nxt
            per = [rows.slot(lanes - 1, v, lc), rows.row_id(v, lanes - 1, lanes), rows.lane_of(v, lanes),
                   rows.number_of(v, lanes), rows.slot_of_id(v, lanes, lc), rows.committed_of_id(v, lanes),
                   rows.bounds(table, lc)[0]]
            expected.append(np.stack([np.broadcast_to(np.asarray(x, np.int64), v.shape) for x in per], axis=1).reshape(-1))
    w = np.roll(v, -3)
    per = [rows.writing(v), rows.committed(v), rows.committed(v), rows.number_of_stamp(v), rows.is_committed(v),
           rows.is_writing(v), np.maximum(v, w),  # ring.py's reservation: a lane's next row, max(cursor, base)
           rows.intact(v, w, v), rows.intact(v, v, v), rows.intact(w, v, v)]
    expected.append(np.stack([np.asarray(x, np.int64) for x in per], axis=1).reshape(-1))
    assert got == np.concatenate(expected).tolist()


def test_every_c_file_is_built_and_shipped() -> None:
    """setup.py builds every C file of ``shmbuffer/native`` and MANIFEST.in puts them and the
    headers in the sdist (a file added on one side only would break a build from the sdist)."""
    root = LAYOUT_H.parents[2]
    setup = (root / "setup.py").read_text()
    listed = set(re.findall(r'"(\w+\.c)"', setup))
    assert listed == {p.name for p in LAYOUT_H.parent.glob("*.c")}
    assert {"layout.h", "native.h"} <= set(re.findall(r'"(\w+\.h)"', setup))
    assert "include shmbuffer/native/*.c shmbuffer/native/*.h" in (root / "MANIFEST.in").read_text().splitlines()


def test_the_lanes_column_has_lane_words_per_lane() -> None:
    from shmbuffer.protocol.layout import LANE_WORDS, Options, columns

    specs = {c.name: c for c in columns(sb.Schema(x=((), "float32")), Options(capacity=12, lanes=3))}
    assert specs["_lanes"].shape == (3, LANE_WORDS)
