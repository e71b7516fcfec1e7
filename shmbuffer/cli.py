"""The ``shmbuffer`` command.

::

    shmbuffer ls [--json]                       buffers in /dev/shm: rows, size, creator, alive
    shmbuffer inspect NAME [--json]             header, options, counters, lanes, field statistics
    shmbuffer gc [--dry-run] [--force] [NAME ...]   remove buffers whose creator is dead
    shmbuffer save NAME PATH                    save a live buffer (persistence.py)
    shmbuffer load PATH --name NAME             load a save and hold it until interrupted
    shmbuffer bench [--seconds S] [--json]      memcpy, push and sample rates on this machine
    shmbuffer demo [--seed 1 ...]               the demo: DQN + PER on CartPole (demo.py)

``ls`` and ``gc`` only read headers (``segment.read_header``) and the lanes' cursors; they never
attach, so they cannot disturb a buffer. ``gc`` removes a block only when its creator (pid and
start time) is dead, including a block whose creator died creating it (no magic yet, but the
header already names its creator: ``segment.unfinished_creator``); one still being created by a
live process is kept. Blocks with our prefix that name no creator at all (foreign or damaged
files) are removed only with ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from . import segment
from .errors import LayoutError, SegmentNotFound, ShmBufferError


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return 0 if demo.main(demo.parse(args.rest))["solved"] else 1


# -- ls, gc: headers only ----------------------------------------------------------------------------
def _short(schema: list[dict[str, Any]]) -> str:
    """``obs[17]f4 action[6]f4 reward f4``"""
    out = []
    for f in schema:
        shape = f"[{','.join(map(str, f['shape']))}]" if f["shape"] else " "
        out.append(f"{f['name']}{shape}{np.dtype(f['dtype']).str[1:]}")
    return " ".join(out)


def _rows(h: segment.Header) -> tuple[int, int, list[tuple[int, int]]]:
    """Rows held, capacity and each lane's ``[first, stop)``, read from the block's ``_lanes``
    column as ``Ring.bounds`` computes them."""
    opts = h.meta["options"]
    capacity, lanes = int(opts["capacity"]), int(opts["lanes"])
    col = next(c for c in h.meta["columns"] if c["name"] == "_lanes")
    fd = os.open(segment.path_of(h.name), os.O_RDONLY)
    try:
        raw = os.pread(fd, lanes * 8 * 8, h.data_offset + col["offset"])
    finally:
        os.close(fd)
    cur, base = np.frombuffer(raw, np.int64).reshape(lanes, 8)[:, :2].T
    first = np.minimum(np.maximum(base, cur - capacity // lanes), cur)
    bounds = [(int(a), int(b)) for a, b in zip(first, cur, strict=True)]
    return int((cur - first).sum()), capacity, bounds


def _entry(name: str) -> dict[str, Any]:
    try:
        h = segment.read_header(name)
        used, capacity, _ = _rows(h)
    except SegmentNotFound:
        return {"name": name, "error": "gone"}
    except (ShmBufferError, KeyError, TypeError, ValueError, StopIteration, OSError) as exc:
        size = os.path.getsize(segment.path_of(name)) if os.path.exists(segment.path_of(name)) else 0
        return {"name": name, "bytes": size, "error": str(exc) or type(exc).__name__}
    return {
        "name": name, "schema": _short(h.meta["schema"]), "rows": used, "capacity": capacity,
        "lanes": int(h.meta["options"]["lanes"]), "bytes": h.size, "creator_pid": h.creator_pid,
        "alive": h.creator_alive,
    }


def _ls(args: argparse.Namespace) -> int:
    entries = [_entry(n) for n in segment.list_names()]
    entries = [e for e in entries if e.get("error") != "gone"]
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        print(f"no buffers in {segment.SHM_DIR}")
        return 0
    print(f"{'NAME':<28} {'ROWS/CAPACITY':>19} {'SIZE':>10} {'PID':>8} {'CREATOR':<8} SCHEMA")
    for e in entries:
        size = segment.human(e["bytes"])
        if "error" in e:
            print(f"{e['name']:<28} {'-':>19} {size:>10} {'-':>8} {'?':<8} not readable: {e['error']}")
        else:
            rows = f"{e['rows']}/{e['capacity']}"
            state = "alive" if e["alive"] else "dead"
            print(f"{e['name']:<28} {rows:>19} {size:>10} {e['creator_pid']:>8} {state:<8} {e['schema']}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    verb = "would remove" if args.dry_run else "removed"
    names = args.names or segment.list_names()
    removed = kept = skipped = 0
    for name in names:
        try:
            creator = segment.unfinished_creator(name)
        except SegmentNotFound:
            continue
        except (ValueError, OSError):
            creator = None
        if creator is not None:  # no magic yet: being created, or its creator died creating it
            pid, started = creator
            if segment.process_alive(pid, started):
                kept += 1
                continue
            size = os.path.getsize(segment.path_of(name)) if os.path.exists(segment.path_of(name)) else 0
            why = f"creator pid {pid} died while creating it, {segment.human(size)}"
            removed += _remove(name, why, args.dry_run)
            continue
        try:
            h = segment.read_header(name)
        except SegmentNotFound:
            continue
        except (LayoutError, ValueError, OSError) as exc:
            if not args.force:
                print(f"skipped {name}: not a readable shmbuffer block ({exc}); --force removes it")
                skipped += 1
                continue
            why = f"not readable: {exc}"
        else:
            if h.creator_alive:
                kept += 1
                continue
            why = f"creator pid {h.creator_pid} is dead, {segment.human(h.size)}"
        removed += _remove(name, why, args.dry_run)
    print(f"{verb} {removed}, kept {kept} live, skipped {skipped} unreadable")
    return 0


def _remove(name: str, why: str, dry_run: bool) -> int:
    """Remove (or, in a dry run, name) one block; 1 if it was there."""
    if not dry_run:
        try:
            os.unlink(segment.path_of(name))
        except FileNotFoundError:
            return 0
    print(f"{'would remove' if dry_run else 'removed'} {segment.path_of(name)} ({why})")
    return 1


# -- inspect, save, load: attach ---------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    from .buffer import ReplayBuffer
    from .persistence import pieces

    h = segment.read_header(args.name)
    _, capacity, bounds = _rows(h)
    buf = ReplayBuffer.attach(args.name)
    try:
        lc = buf.lane_capacity
        acc: dict[str, list[float]] = {}
        for piece in pieces(buf):
            for f in buf.schema:
                a = piece[f.name]
                if f.dtype.kind == "c" or not a.size:
                    continue
                lo, hi, total = float(a.min()), float(a.max()), float(a.sum(dtype=np.float64))
                s = acc.setdefault(f.name, [lo, hi, 0.0, 0.0])
                s[0], s[1] = min(s[0], lo), max(s[1], hi)
                s[2] += total
                s[3] += a.size
        fields = [
            {"name": f.name, "shape": list(f.shape), "dtype": str(f.dtype),
             **({"min": acc[f.name][0], "mean": acc[f.name][2] / acc[f.name][3], "max": acc[f.name][1]}
                if f.name in acc else {})}
            for f in buf.schema
        ]
        info = {
            "name": h.name, "path": segment.path_of(h.name), "layout_version": h.version, "bytes": h.size,
            "creator_pid": h.creator_pid, "creator_alive": h.creator_alive, "fingerprint": h.fingerprint,
            "options": h.meta["options"], "stats": buf.stats, "rows": len(buf), "capacity": capacity,
            "lanes": [{"lane": i, "first": a, "stop": b, "rows": b - a, "capacity": lc} for i, (a, b) in enumerate(bounds)],
            "fields": fields,
        }
    finally:
        buf.close()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    alive = "alive" if info["creator_alive"] else "dead"
    print(f"{info['name']}  {info['path']}  layout v{info['layout_version']}  {segment.human(info['bytes'])}")
    print(f"creator pid {info['creator_pid']} ({alive})  fingerprint {info['fingerprint']}")
    print(f"rows {info['rows']}/{capacity}  options {json.dumps(info['options'])}")
    print("stats " + "  ".join(f"{k} {v}" for k, v in info["stats"].items()))
    for ln in info["lanes"]:
        print(f"lane {ln['lane']}: rows [{ln['first']}, {ln['stop']})  {ln['rows']}/{lc} ({100 * ln['rows'] / lc:.0f}%)")
    print(f"{'FIELD':<16} {'SHAPE':<14} {'DTYPE':<10} {'MIN':>12} {'MEAN':>12} {'MAX':>12}")
    for row in fields:
        nums = [f"{row[k]:>12.6g}" if k in row else f"{'-':>12}" for k in ("min", "mean", "max")]
        print(f"{row['name']:<16} {row['shape']!s:<14} {row['dtype']:<10} {' '.join(nums)}")
    return 0


def _save(args: argparse.Namespace) -> int:
    from .buffer import ReplayBuffer
    from .persistence import save

    buf = ReplayBuffer.attach(args.name)
    try:
        out = save(buf, args.path, progress=sys.stderr.isatty())
    finally:
        buf.close()
    holes = f", {out['holes']} empty rows kept as holes" if out["holes"] else ""
    print(f"saved {out['rows']} rows of {args.name!r} to {out['path']} ({segment.human(out['bytes'])}, "
          f"{out['seconds']:.2f} s, {out['dropped']} dropped{holes})")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _load(args: argparse.Namespace) -> int:
    from .persistence import load

    signal.signal(signal.SIGTERM, _interrupt)
    buf = load(args.path, name=args.name, capacity=args.capacity)
    try:
        print(f"loaded {len(buf)} rows into {buf.name!r}; holding it until interrupted "
              "(Ctrl-C or SIGTERM removes it)", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        buf.close()
        buf.unlink()
    return 0


# -- bench -------------------------------------------------------------------------------------------
def _rate(fn: Any, seconds: float) -> float:
    """Calls of ``fn`` per second, over about ``seconds``."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        calls += 1
    return calls / elapsed


def _bench(args: argparse.Namespace) -> int:
    from .buffer import ReplayBuffer
    from .schema import Schema

    n = 64 << 20
    src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
    memcpy = n * _rate(lambda: np.copyto(dst, src), args.seconds) / 1e9
    schema = Schema(obs=((17,), "float32"), action=((6,), "float32"), reward=((), "float32"),
                    next_obs=((17,), "float32"), done=((), "bool"))
    rng = np.random.default_rng(0)
    one = {"obs": rng.random(17, np.float32), "action": rng.random(6, np.float32), "reward": 1.0,
           "next_obs": rng.random(17, np.float32), "done": False}
    many = {k: np.repeat(np.asarray(v)[None], 256, axis=0) for k, v in one.items()}
    with ReplayBuffer(schema, 100_000, seed=0) as buf:
        push_one = _rate(lambda: buf.push(one), args.seconds)
        push_batch = 256 * _rate(lambda: buf.push(many), args.seconds)
        sample = _rate(lambda: buf.sample(256), args.seconds)
    out = {"memcpy_gb_s": round(memcpy, 2), "push_rows_s_one_at_a_time": round(push_one),
           "push_rows_s_batches_of_256": round(push_batch), "sample_batches_s_of_256": round(sample),
           "row_bytes": schema.row_bytes, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"memcpy                  {out['memcpy_gb_s']:>10} GB/s")
        print(f"push, one row a call    {out['push_rows_s_one_at_a_time']:>10} rows/s  ({schema.row_bytes}-byte MuJoCo-like rows)")
        print(f"push, 256 rows a call   {out['push_rows_s_batches_of_256']:>10} rows/s")
        print(f"sample(256)             {out['sample_batches_s_of_256']:>10} batches/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmbuffer", description="A replay buffer in shared memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo (shmbuffer demo --help: its settings)", add_help=False)
    demo.set_defaults(run=_demo)
    p = sub.add_parser("ls", help="list the buffers in /dev/shm")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_ls)
    p = sub.add_parser("inspect", help="a buffer's header, options, counters, lanes and field statistics")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_inspect)
    p = sub.add_parser("gc", help="remove buffers whose creating process is dead")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these buffers (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--force", action="store_true",
                   help="also remove blocks with our prefix that cannot be read and name no creator")
    p.set_defaults(run=_gc)
    p = sub.add_parser("save", help="save a live buffer to a directory")
    p.add_argument("name")
    p.add_argument("path")
    p.set_defaults(run=_save)
    p = sub.add_parser("load", help="load a saved buffer and hold it in shared memory until interrupted")
    p.add_argument("path")
    p.add_argument("--name", required=True)
    p.add_argument("--capacity", type=int, default=None)
    p.set_defaults(run=_load)
    p = sub.add_parser("bench", help="a quick probe: memcpy, push and sample rates")
    p.add_argument("--seconds", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_bench)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command == "demo":
        return int(args.run(args))
    try:
        return int(args.run(args))
    except (ShmBufferError, FileNotFoundError, FileExistsError) as exc:
        print(f"shmbuffer {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
