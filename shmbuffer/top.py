"""``shmbuffer top``: the buffers on this host as they run, refreshed in place.

::

    shmbuffer top                     your buffers, refreshed every second (Ctrl-C ends it)
    shmbuffer top --all               every user's (other users' are listed, never read)
    shmbuffer top NAME ...            only these
    shmbuffer top --once --json       one measurement as JSON, for scripts

For each buffer: rows held and the fill, rows in and out per second (in total and per writer
process), samples per insert (over the interval, and since creation), rows of dead writers reaped
(``Counter.RECLAIMED``) and lost (left half-written by a dead writer, not reaped yet), rows being
written, lock waits (in all, and per second) and recoveries, how far the newest device copy
(``DeviceReplay``, in a learner's process) is behind (rows and milliseconds since its last refresh
began, from ``Counter.DEVICE_ROWS``/``DEVICE_AT``), and per writer which hot path runs in it (C or Python: whether the
process has the C extension mapped, ``/proc/PID/maps``).

Everything comes from a census of the block's shared columns (``protocol/census.py``), taken by
attaching for a moment: rates are the differences of two censuses. The rows a writer pushed between two reads are those of
the lanes' new row numbers, attributed by ``_owner`` (the writer entry that reserved each slot);
when a lane came round more than once between reads the count is scaled from the rows still
there. Lock waits are the lock's own count (``lock.WAITS``: a locker that found it held); lock
recoveries a holder found dead. With ``rich`` installed (``pip install -e ".[top]"`` in the clone) the view is a table drawn by rich;
without it plain text, redrawn with ANSI codes on a terminal (over SSH too). Nothing here imports
rich unless the live view on a terminal asks for it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import native
from .buffer import ReplayBuffer
from .errors import ForeignBlock, LayoutError, SegmentNotFound
from .protocol import census
from .protocol.layout import WRITERS
from .sampling.samplers import Unimported
from .shm import segment


@dataclass
class Reading:
    """One buffer's counters at one instant (``read``)."""

    t: float
    ident: tuple[int, int]
    cursors: np.ndarray  # each lane's rows ever reserved
    inserted: int
    sampled: int
    writer_sampled: np.ndarray  # rows each writer entry sampled without the lock
    lock_waits: int = 0


def read(name: str, before: Reading | None) -> tuple[dict[str, Any], Reading | None]:
    """What ``top`` shows of buffer ``name`` now, with rates since ``before`` (its previous
    reading, or None: no rates yet); and this reading, for the next call."""
    path = segment.path_of(name)
    uid = -1
    try:
        uid = os.lstat(path).st_uid
        ident = segment.identity(name)
        buf = ReplayBuffer.attach(name, sampler=Unimported)  # the rows need no sampler class
    except (SegmentNotFound, FileNotFoundError):  # removed since it was listed
        return {"name": name, "error": "gone"}, None
    except ForeignBlock:
        return {"name": name, "owner_uid": uid, "error": "another user's: not readable"}, None
    except (LayoutError, OSError) as exc:
        return {"name": name, "error": f"not readable: {exc}"}, None
    try:
        return _measure(buf, name, uid, ident, before if before is not None and before.ident == ident else None)
    finally:
        buf.close()


def _measure(buf: ReplayBuffer, name: str, uid: int, ident: tuple[int, int],
             before: Reading | None) -> tuple[dict[str, Any], Reading]:
    now = time.monotonic()
    c = census.take(buf)
    # the census's own count, of the same moment as its inserted rows; len (a scan) where deleted
    # rows or rows that are not transitions (frames' end rows) must be left out
    count = c.rows if buf.block.kinds is None and not c.removed else len(buf)
    reading = Reading(now, ident, c.cursors, c.inserted, c.sampled, c.writer_sampled, c.lock_waits)
    wpid, wstart, wsampled = c.writer_pid, c.writer_start, c.writer_sampled
    alive = {int(w): segment.process_alive(int(wpid[w]), float(wstart[w])) for w in np.flatnonzero(wpid)}
    dead_odd = int(sum(1 for o in c.writing if not alive.get(int(o), False)))
    header = segment.read_header(name)
    capacity = buf.capacity
    out: dict[str, Any] = {
        "name": name, "owner_uid": uid, "creator_pid": header.creator_pid,
        "creator_alive": header.creator_state == "alive", "rows": count, "capacity": capacity,
        "fill": count / capacity, "lanes": buf.lanes, "inserted": c.inserted, "sampled": c.sampled,
        "samples_per_insert": c.sampled / c.inserted if c.inserted else None,
        "reaped": c.reclaimed, "lost": dead_odd, "being_written": int(c.writing.size) - dead_odd,
        "lock_recoveries": c.lock_recoveries, "lock_waits": c.lock_waits,
        "interval_s": None, "in_rows_s": None, "out_rows_s": None, "samples_per_insert_now": None,
        "lock_waits_s": None, "device_lag_rows": c.device_lag_rows, "device_lag_ms": c.device_lag_ms,
    }
    pushed = np.zeros(WRITERS)
    if before is not None:
        dt = max(now - before.t, 1e-9)
        rows_in, rows_out = c.inserted - before.inserted, c.sampled - before.sampled
        out.update(interval_s=round(dt, 3), in_rows_s=rows_in / dt, out_rows_s=rows_out / dt,
                   samples_per_insert_now=rows_out / rows_in if rows_in > 0 else None,
                   lock_waits_s=(c.lock_waits - before.lock_waits) / dt)
        pushed = census.pushed(buf, before.cursors, c.cursors)
    held = c.held
    writers = []
    for w, live in alive.items():
        entry: dict[str, Any] = {
            "entry": w, "pid": int(wpid[w]), "alive": live, "creator": int(wpid[w]) == header.creator_pid,
            "path": _path(int(wpid[w])) if live else None, "rows_held": int(held[w]), "sampled": int(wsampled[w]),
            "in_rows_s": None, "out_rows_s": None,
        }
        if before is not None:
            dt = out["interval_s"]
            entry.update(in_rows_s=float(pushed[w]) / dt, out_rows_s=int(wsampled[w] - before.writer_sampled[w]) / dt)
        writers.append(entry)
    out["writers"] = writers
    return out, reading


def _path(pid: int) -> str | None:
    """``"native"`` when process ``pid`` has shmbuffer's C extension mapped, ``"python"`` when it
    does not (not built, or ``SHMBUFFER_PURE=1``), ``None`` when its maps cannot be read."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return "native" if "shmbuffer/native/_native." in maps else "python"


def names_to_show(names: list[str], every: bool) -> list[str]:
    """The buffers ``top`` shows: those named, else yours (every user's with ``every``)."""
    if names:
        return names
    found = segment.list_names()
    return found if every else segment.mine(found)


def measure(names: list[str], every: bool, interval: float) -> dict[str, Any]:
    """One measurement: two readings ``interval`` seconds apart (``top --once``)."""
    shown = names_to_show(names, every)
    first = {n: read(n, None)[1] for n in shown}
    time.sleep(interval)
    return _frame([read(n, first.get(n))[0] for n in shown])


def _frame(buffers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"time": time.time(), "host_path": native.ACTIVE,
            "buffers": [b for b in buffers if b.get("error") != "gone"]}


# -- drawing ---------------------------------------------------------------------------------------
def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def lines(frame: dict[str, Any]) -> list[str]:
    """The frame as plain text."""
    out = [f"shmbuffer top  {time.strftime('%H:%M:%S')}  this process's hot path: {frame['host_path']}  (Ctrl-C ends)"]
    if not frame["buffers"]:
        out.append("no buffers of yours in /dev/shm (--all: every user's)")
    for b in frame["buffers"]:
        out.append("")
        if "error" in b:
            out.append(f"{b['name']}: {b['error']}")
            continue
        state = "alive" if b["creator_alive"] else "creator gone"
        out.append(f"{b['name']}  creator {b['creator_pid']} ({state})  rows {b['rows']:,}/{b['capacity']:,} "
                   f"({100 * b['fill']:.0f}%)  lanes {b['lanes']}"
                   + ("" if b.get("device_lag_rows") is None else
                      f"  device copy {b['device_lag_rows']:,} rows / {b['device_lag_ms']:.1f} ms behind"))
        out.append(f"  in {_rate(b['in_rows_s'])} rows/s  out {_rate(b['out_rows_s'])} rows/s  "
                   f"samples/insert {_ratio(b['samples_per_insert_now'])} now, {_ratio(b['samples_per_insert'])} all  "
                   f"reaped {b['reaped']}  lost {b['lost']}  being written {b['being_written']}  "
                   f"lock waits {b['lock_waits']} ({_rate(b['lock_waits_s'])}/s)  lock recoveries {b['lock_recoveries']}")
        out.append(f"  {'PID':>8} {'ROLE':<8} {'STATE':<6} {'PATH':<7} {'IN/S':>8} {'OUT/S':>8} {'HELD':>10} {'SAMPLED':>12}")
        for w in b["writers"]:
            role = "creator" if w["creator"] else "attached"
            out.append(f"  {w['pid']:>8} {role:<8} {'alive' if w['alive'] else 'dead':<6} {w['path'] or '-':<7} "
                       f"{_rate(w['in_rows_s']):>8} {_rate(w['out_rows_s']):>8} {w['rows_held']:>10,} {w['sampled']:>12,}")
        if not b["writers"]:
            out.append("  no process has pushed or sampled yet")
    return out


def _rich_view(frame: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(lines(frame)[0], style="bold")]
    if not frame["buffers"]:
        parts.append(Text("no buffers of yours in /dev/shm (--all: every user's)"))
    for b in frame["buffers"]:
        if "error" in b:
            parts.append(Text(f"{b['name']}: {b['error']}", style="dim"))
            continue
        title = (f"{b['name']}  rows {b['rows']:,}/{b['capacity']:,} ({100 * b['fill']:.0f}%)  "
                 f"in {_rate(b['in_rows_s'])}/s  out {_rate(b['out_rows_s'])}/s  "
                 f"samples/insert {_ratio(b['samples_per_insert_now'])} ({_ratio(b['samples_per_insert'])} all)  "
                 f"reaped {b['reaped']}  lost {b['lost']}  lock waits {b['lock_waits']} ({_rate(b['lock_waits_s'])}/s)  "
                 f"lock recoveries {b['lock_recoveries']}")
        table = Table(title=title, title_justify="left", expand=False)
        for col in ("pid", "role", "state", "path", "in/s", "out/s", "held", "sampled"):
            table.add_column(col, justify="right" if col not in ("role", "state", "path") else "left")
        for w in b["writers"]:
            table.add_row(str(w["pid"]), "creator" if w["creator"] else "attached",
                          "alive" if w["alive"] else "[red]dead[/red]", w["path"] or "-",
                          _rate(w["in_rows_s"]), _rate(w["out_rows_s"]), f"{w['rows_held']:,}", f"{w['sampled']:,}")
        parts.append(table)
    return Group(*parts)


def run(names: list[str], *, every: bool, once: bool, as_json: bool, interval: float) -> int:
    """``shmbuffer top``: one measurement (``once``), or a view refreshed every ``interval``
    seconds until Ctrl-C."""
    if once:
        frame = measure(names, every, interval)
        print(json.dumps(frame, indent=1) if as_json else "\n".join(lines(frame)))
        return 0
    tty = sys.stdout.isatty() and not as_json
    live = None
    if tty:
        try:
            from rich.live import Live
        except ImportError:
            print('(pip install -e ".[top]" in the clone for a table drawn by rich)', file=sys.stderr)
        else:
            live = Live(auto_refresh=False, screen=False, transient=False)
    readings: dict[str, Reading | None] = {}
    try:
        if live is not None:
            live.start()
        while True:
            shown = names_to_show(names, every)
            got = [read(n, readings.get(n)) for n in shown]
            readings = {n: r for n, (_, r) in zip(shown, got, strict=True)}
            frame = _frame([b for b, _ in got])
            if as_json:
                print(json.dumps(frame), flush=True)  # one JSON object a line
            elif live is not None:
                live.update(_rich_view(frame), refresh=True)
            elif tty:
                print("\x1b[H\x1b[2J" + "\n".join(lines(frame)), flush=True)  # home, clear: redrawn in place
            else:
                print("\n".join(lines(frame)) + "\n", flush=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
