"""The ``shmbuffer`` command.

::

    shmbuffer ls [--all] [--json]               your buffers in /dev/shm (--all: everyone's): rows, size, creator, alive
    shmbuffer inspect NAME [--json]             header, options, counters, lanes, field statistics
    shmbuffer gc [--dry-run] [--force] [NAME ...]   remove buffers whose creator is dead
    shmbuffer save NAME PATH [--force]          save a live buffer (persistence/saving.py)
    shmbuffer load PATH --name NAME             load a save and hold it until interrupted
    shmbuffer checkpoint NAME PATH [--no-sync]  checkpoint a live buffer: only what changed since the last one
    shmbuffer resume PATH [--name NAME]         resume the last complete checkpoint and hold it until interrupted
    shmbuffer bench [--seconds S] [--json]      memcpy, push and sample rates on this machine
    shmbuffer top [--all] [--once] [--json]     a live view: fill, rows in/out per second, writers (top.py)
    shmbuffer demo [--seed 1 ...]               the demo: DQN + PER on CartPole (demo.py)
    shmbuffer info [--json]                     versions, the hot path and why, /dev/shm, CPU, GPU
    shmbuffer --version                         the version

``ls`` and ``gc`` only read headers (``segment.read_header``) and the lanes' cursors; they never
attach, so they cannot disturb a buffer. ``gc`` removes a block only when its creator (pid and
start time) is dead, including a block whose creator died creating it (no magic yet, but the
header already names its creator: ``segment.unfinished_creator``); one still being created by a
live process is kept. Blocks of ours that cannot be read (damaged, or naming no creator) are
removed only with ``--force``. A block whose creator is in another pid namespace (a container
sharing /dev/shm but not its pids) has a liveness nobody here can judge: ``ls`` says so, and
``gc`` keeps it unless it is named with ``--force``. ``gc`` removes a file only if it is still
the one it judged (same device and inode).

Files that are not ours (not regular files, another user's, open to other users: see
``segment.py``) are listed as not readable, never read, and never removed, even with ``--force``.
Every NAME is checked (``segment.check_name``), so none reaches outside /dev/shm;
``/dev/shm/shmbuffer-NAME`` and ``shmbuffer-NAME`` are taken for NAME.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from . import native
from .buffer import ReplayBuffer
from .errors import ForeignBlock, LayoutError, SegmentNotFound, ShmBufferError
from .frames import PLAIN
from .persistence import pieces
from .protocol import census
from .protocol.layout import columns
from .sampling.samplers import Unimported, not_imported
from .schema import Schema
from .shm import segment


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return 0 if demo.main(demo.parse(args.rest))["solved"] else 1


# -- ls, gc: headers only ----------------------------------------------------------------------------
def _name(arg: str) -> str:
    """A NAME argument: a buffer name, or its file (``/dev/shm/shmbuffer-NAME``, or ``shmbuffer-NAME``
    unless a buffer has that very name)."""
    path = segment.path_of("")
    if arg.startswith(path):
        arg = arg[len(path):]
    elif arg.startswith(segment.PREFIX) and not os.path.lexists(segment.path_of(arg)):
        arg = arg[len(segment.PREFIX):]
    try:
        return segment.check_name(arg)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _new_name(arg: str) -> str:
    try:
        return segment.check_name(arg)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _schema(h: segment.Header) -> Schema:
    try:
        return Schema.from_json(h.meta["schema"])
    except segment.MALFORMED as exc:
        raise LayoutError(f"buffer {h.name!r} is damaged: its schema cannot be read ({type(exc).__name__})") from None


def _short(schema: Schema) -> str:
    """``obs[17]f4 action[6]f4 reward f4``"""
    out = []
    for f in schema:
        shape = f"[{','.join(map(str, f.shape))}]" if f.shape else " "
        out.append(f"{f.name}{shape}{f.dtype.str[1:]}")
    return " ".join(out)


def _size(name: str) -> int:
    try:
        return os.lstat(segment.path_of(name)).st_size
    except OSError:
        return 0


OTHER_NS = "other pid namespace: liveness unknown"


def _entry(name: str) -> dict[str, Any]:
    try:
        h = segment.read_header(name)
        used, capacity, bounds = census.unmapped(h)
        schema = _short(_schema(h))
    except SegmentNotFound:
        return {"name": name, "error": "gone"}
    except LayoutError as exc:
        return {"name": name, "bytes": _size(name), "error": str(exc)}
    state = h.creator_state
    return {
        "name": name, "schema": schema, "rows": used, "capacity": capacity, "lanes": len(bounds),
        "bytes": h.size, "creator_pid": h.creator_pid, "alive": None if state == "unknown" else state == "alive",
        **({"liveness": OTHER_NS} if state == "unknown" else {}),
    }


def _ls(args: argparse.Namespace) -> int:
    names = segment.list_names()
    entries = [_entry(n) for n in (names if args.all else segment.mine(names))]
    entries = [e for e in entries if e.get("error") != "gone"]
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        others = len(names) - len(segment.mine(names)) if not args.all else 0
        hint = f" ({others} of other users: --all lists them)" if others > 0 else ""
        print(f"no buffers of yours in {segment.SHM_DIR}{hint}" if not args.all else f"no buffers in {segment.SHM_DIR}")
        return 0
    print(f"{'NAME':<28} {'ROWS/CAPACITY':>19} {'SIZE':>10} {'PID':>8} {'CREATOR':<8} SCHEMA")
    for e in entries:
        size = segment.human(e["bytes"])
        if "error" in e:
            print(f"{e['name']:<28} {'-':>19} {size:>10} {'-':>8} {'?':<8} not readable: {e['error']}")
        else:
            rows = f"{e['rows']}/{e['capacity']}"
            state = {True: "alive", False: "dead", None: "unknown"}[e["alive"]]
            note = f"  ({OTHER_NS})" if e["alive"] is None else ""
            print(f"{e['name']:<28} {rows:>19} {size:>10} {e['creator_pid']:>8} {state:<8} {e['schema']}{note}")
    return 0


def _judge(name: str) -> tuple[str, str]:
    """What gc makes of a block: ``alive``, ``dead``, ``other`` (its creator is in another pid
    namespace) or ``unreadable``, and why."""
    creator = segment.unfinished_creator(name)
    if creator is not None:  # no magic yet: being created, or its creator died creating it
        pid, started = creator
        ns = segment.pid_namespace_of(name)
        why = f"creator pid {pid} died while creating it, {segment.human(_size(name))}"
    else:
        try:
            h = segment.read_header(name)
        except ForeignBlock:
            raise
        except LayoutError as exc:
            return "unreadable", f"not readable: {exc}"
        pid, started, ns = h.creator_pid, h.creator_start, h.pid_ns
        why = f"creator pid {pid} is dead, {segment.human(h.size)}"
    if ns is not None and ns != segment.pid_namespace():
        return "other", f"creator pid {pid} in another pid namespace, liveness unknown"
    return ("alive", "") if segment.process_alive(pid, started) else ("dead", why)


def _gc(args: argparse.Namespace) -> int:
    verb = "would remove" if args.dry_run else "removed"
    names = args.names or segment.list_names()
    removed = kept = other = skipped = 0
    for name in names:
        try:
            ident = segment.identity(name)
            verdict, why = _judge(name)
        except SegmentNotFound:
            continue
        except ForeignBlock as exc:
            print(f"skipped {name}: {exc}")
            skipped += 1
            continue
        if verdict == "alive":
            kept += 1
            continue
        if verdict == "other" and not (args.force and args.names):
            print(f"kept {name}: its {why}; `shmbuffer gc --force {name}` removes it")
            other += 1
            continue
        if verdict == "unreadable" and not args.force:
            print(f"skipped {name}: not a readable shmbuffer block ({why}); --force removes it")
            skipped += 1
            continue
        removed += _remove(name, ident, why, args.dry_run)
    others = f", kept {other} of other pid namespaces" if other else ""
    print(f"{verb} {removed}, kept {kept} live, skipped {skipped} unreadable{others}")
    return 0


def _remove(name: str, ident: tuple[int, int], why: str, dry_run: bool) -> int:
    """Remove (or, in a dry run, name) one block, if its name still names the file judged; 1 if it
    was there."""
    if not dry_run and not segment.remove(name, ident):
        return 0
    print(f"{'would remove' if dry_run else 'removed'} {segment.path_of(name)} ({why})")
    return 1


# -- inspect, save, load: attach ---------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:

    h = segment.read_header(args.name)
    _, capacity, bounds = census.unmapped(h)
    buf = ReplayBuffer.attach(args.name, sampler=Unimported)  # the rows need no sampler class
    try:
        lc = buf.lane_capacity
        acc: dict[str, list[float]] = {}
        stored = buf.block.stored  # with next_of/stack: the frames as stored (``frames.py``)
        for piece in pieces(buf):
            for f in stored:
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
            for f in stored
        ]
        plain = sum(c.nbytes for c in columns(buf.schema, replace(buf.options, rows=PLAIN)))
        info: dict[str, Any] = {
            "name": h.name, "path": segment.path_of(h.name), "layout_version": h.version, "bytes": h.size,
            "creator_pid": h.creator_pid, "creator_alive": h.creator_alive, "fingerprint": h.fingerprint,
            "options": buf.options.to_json(), "stats": buf.stats, "rows": len(buf), "capacity": capacity,
            "lanes": [{"lane": i, "first": a, "stop": b, "rows": b - a, "capacity": lc} for i, (a, b) in enumerate(bounds)],
            "fields": fields, "sampler_not_imported": not_imported(buf.sampler),
            "bytes_per_row": h.size / capacity,
            "bytes_per_row_without_frames": plain / capacity,
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
    if info["sampler_not_imported"]:
        print(f"sampler {info['sampler_not_imported']}")
    print("stats " + "  ".join(f"{k} {v}" for k, v in info["stats"].items()))
    per, plain = info["bytes_per_row"], info["bytes_per_row_without_frames"]
    saving = f" ({plain / per:.1f}x less than the {segment.human(int(plain))} without next_of/stack)" if plain > per * 1.01 else ""
    print(f"bytes per row {segment.human(int(per))}{saving}")
    for ln in info["lanes"]:
        print(f"lane {ln['lane']}: rows [{ln['first']}, {ln['stop']})  {ln['rows']}/{lc} ({100 * ln['rows'] / lc:.0f}%)")
    print(f"{'FIELD':<16} {'SHAPE':<14} {'DTYPE':<10} {'MIN':>12} {'MEAN':>12} {'MAX':>12}")
    for row in fields:
        nums = [f"{row[k]:>12.6g}" if k in row else f"{'-':>12}" for k in ("min", "mean", "max")]
        print(f"{row['name']:<16} {row['shape']!s:<14} {row['dtype']:<10} {' '.join(nums)}")
    return 0


def _save(args: argparse.Namespace) -> int:
    buf = ReplayBuffer.attach(args.name, sampler=Unimported)  # the rows need no sampler class
    try:
        out = buf.save(args.path, progress=sys.stderr.isatty(), overwrite=args.force)
    except FileExistsError as exc:
        raise FileExistsError(f"{exc} (here: pass --force)") from None
    finally:
        buf.close()
    holes = f", {out['holes']} empty rows kept as holes" if out["holes"] else ""
    dropped = (f", {out['dropped']} dropped (overwritten by writers, or still being written, while the save ran)"
               if out["dropped"] else "")
    print(f"saved {out['rows']} rows of {args.name!r} to {out['path']} ({segment.human(out['bytes'])}, "
          f"{out['seconds']:.2f} s{dropped}{holes})")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    buf = ReplayBuffer.attach(args.name)
    try:
        out = buf.checkpoint(args.path, sync=not args.no_sync)
    finally:
        buf.close()
    what = "every row" if out["full"] else f"{out['new']} new rows, {out['edited']} edited"
    print(f"checkpoint {out['sequence']} of {args.name!r} in {out['path']}: {out['rows']} rows ({what}; "
          f"{segment.human(out['bytes'])} written, {segment.human(out['folder_bytes'])} in the folder, "
          f"{out['seconds']:.2f} s)")
    return 0


def _resume(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    return _hold(ReplayBuffer.resume(args.path, name=args.name), "resumed")


def _hold(buf: ReplayBuffer, how: str) -> int:
    """Keep ``buf`` (just made by ``how``) until interrupted, then remove it."""
    try:
        print(f"{how} {len(buf)} rows into {buf.name!r}; holding it until interrupted "
              "(Ctrl-C or SIGTERM removes it)", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        buf.close()
        buf.unlink()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _load(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    return _hold(ReplayBuffer.load(args.path, name=args.name, capacity=args.capacity), "loaded")


# -- top ---------------------------------------------------------------------------------------------
def _top(args: argparse.Namespace) -> int:
    from . import top

    return top.run(args.names, every=args.all, once=args.once, as_json=args.json, interval=args.interval)


def _command(sub: Any, name: str, text: str, **kwargs: Any) -> argparse.ArgumentParser:
    """Subcommand ``name``: ``text`` is its line in ``shmbuffer --help`` and opens its own ``--help``."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".", **kwargs)


def _add_top(sub: Any) -> None:
    p = _command(sub, "top", "a live view of the buffers on this host: fill, rows in and out per second, writers")
    p.add_argument("names", nargs="*", metavar="NAME", type=_name, help="only these buffers (default: yours)")
    p.add_argument("--all", action="store_true", help="every user's buffers, not only yours")
    p.add_argument("--once", action="store_true", help="measure once (two reads --interval apart), print, exit")
    p.add_argument("--json", action="store_true", help="print JSON (with --once one object; else one a line)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reads (default: 1.0)")
    p.set_defaults(run=_top)


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
           "row_bytes": schema.row_bytes, "cpus": os.cpu_count(), "path": native.ACTIVE}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"memcpy                  {out['memcpy_gb_s']:>10} GB/s")
        print(f"push, one row a call    {out['push_rows_s_one_at_a_time']:>10} rows/s  ({schema.row_bytes}-byte MuJoCo-like rows)")
        print(f"push, 256 rows a call   {out['push_rows_s_batches_of_256']:>10} rows/s")
        print(f"sample(256)             {out['sample_batches_s_of_256']:>10} batches/s")
        print(f"hot path                {out['path']:>10}  (native: the C extension; python: SHMBUFFER_PURE=1 or not built)")
    return 0


# -- info, --version ---------------------------------------------------------------------------------
OPTIONAL = ("gymnasium", "safetensors", "stable-baselines3", "torchrl", "tensordict", "ray", "ale-py", "cpprb")
"""Packages of the extras that ``shmbuffer info`` reports (read from their metadata, never imported)."""


def _version_line() -> str:
    from . import __version__

    return f"shmbuffer {__version__}"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _gpus() -> dict[str, Any]:
    """What torch sees: CUDA devices (name, memory) or why none."""
    try:
        import torch
    except ImportError as exc:
        return {"cuda": False, "why": f"torch cannot be imported ({exc})", "devices": []}
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        return {"cuda": False, "why": why, "devices": []}
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name, "memory_bytes": int(props.total_memory)})
    return {"cuda": True, "cuda_version": torch.version.cuda, "devices": devices}


def info_data() -> dict[str, Any]:
    """What ``shmbuffer info`` reports, as a dict: versions, the hot path and why, ``/dev/shm``,
    the CPU and the GPUs torch sees."""
    import platform

    from . import __version__

    try:
        st = os.statvfs(segment.SHM_DIR)
        shm: dict[str, Any] = {"path": segment.SHM_DIR, "size_bytes": st.f_blocks * st.f_frsize,
                               "free_bytes": st.f_bavail * st.f_frsize}
    except OSError as exc:
        shm = {"path": segment.SHM_DIR, "error": str(exc)}
    return {
        "shmbuffer": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "hot_path": native.ACTIVE,
        "hot_path_reason": native.REASON,
        "dependencies": {n: _dist_version(n) for n in ("numpy", "torch", "multiprocess", "psutil")},
        "optional": {n: _dist_version(n) for n in OPTIONAL},
        "shm": shm,
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "usable": len(os.sched_getaffinity(0))},
        "gpu": _gpus(),
    }


def _info(args: argparse.Namespace) -> int:
    out = info_data()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"shmbuffer   {out['shmbuffer']}")
    print(f"python      {out['python']}")
    print(f"platform    {out['platform']}")
    print(f"hot path    {'C extension' if out['hot_path'] == 'native' else 'pure Python'}: {out['hot_path_reason']}")
    deps = "  ".join(f"{k} {v or 'MISSING'}" for k, v in out["dependencies"].items())
    print(f"requires    {deps}")
    extras = "  ".join(f"{k} {v}" for k, v in out["optional"].items() if v) or "none installed"
    print(f"optional    {extras}")
    shm = out["shm"]
    if "error" in shm:
        print(f"/dev/shm    cannot be read: {shm['error']}")
    else:
        print(f"/dev/shm    {segment.human(shm['free_bytes'])} free of {segment.human(shm['size_bytes'])}")
    cpu = out["cpu"]
    print(f"cpu         {cpu['model']}, {cpu['count']} cores ({cpu['usable']} usable by this process)")
    gpu = out["gpu"]
    if gpu["cuda"]:
        for d in gpu["devices"]:
            print(f"gpu {d['index']}       {d['name']}, {segment.human(d['memory_bytes'])} (CUDA {gpu['cuda_version']})")
    else:
        print(f"gpu         none: {gpu['why']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``shmbuffer`` command: parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit
    status."""
    parser = argparse.ArgumentParser(prog="shmbuffer", description="A replay buffer in shared memory.")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    demo = _command(sub, "demo", "run the demo (shmbuffer demo --help: its settings)", add_help=False)
    demo.set_defaults(run=_demo)
    p = _command(sub, "ls", "list your buffers in /dev/shm (--all: every user's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--all", action="store_true", help="every user's buffers, not only yours")
    p.set_defaults(run=_ls)
    p = _command(sub, "inspect", "a buffer's header, options, counters, lanes and field statistics")
    p.add_argument("name", type=_name, help="a name, or /dev/shm/shmbuffer-NAME")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_inspect)
    p = _command(sub, "gc", "remove buffers whose creating process is dead")
    p.add_argument("names", nargs="*", metavar="NAME", type=_name, help="only these buffers (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument("--force", action="store_true",
                   help="also remove blocks of yours that cannot be read, and those named here whose "
                        "creator is in another pid namespace")
    p.set_defaults(run=_gc)
    p = _command(sub, "save", "save a live buffer to a directory")
    p.add_argument("name", type=_name, help="the live buffer's name, or /dev/shm/shmbuffer-NAME")
    p.add_argument("path", help="the directory to write (safetensors + JSON); refused if it holds a save")
    p.add_argument("--force", action="store_true", help="replace a save already in PATH")
    p.set_defaults(run=_save)
    p = _command(sub, "load", "load a saved buffer and hold it in shared memory until interrupted")
    p.add_argument("path", help="a directory written by `shmbuffer save` or buf.save()")
    p.add_argument("--name", required=True, type=_new_name, help="the name of the new buffer in /dev/shm")
    p.add_argument("--capacity", type=int, default=None,
                   help="rows the new buffer holds (default: the saved capacity; each lane must still hold its saved rows)")
    p.set_defaults(run=_load)
    p = _command(sub, "checkpoint", "checkpoint a live buffer to a folder: every row the first time, then what changed")
    p.add_argument("name", type=_name, help="the live buffer's name, or /dev/shm/shmbuffer-NAME")
    p.add_argument("path", help="the checkpoint folder (manifest + chunks); created if it does not exist")
    p.add_argument("--no-sync", action="store_true", help="skip the fsyncs (safe from a killed process, not a power cut)")
    p.set_defaults(run=_checkpoint)
    p = _command(sub, "resume", "resume a buffer from its last complete checkpoint and hold it until interrupted")
    p.add_argument("path", help="a folder written by `shmbuffer checkpoint` or buf.checkpoint()")
    p.add_argument("--name", type=_new_name, default=None,
                   help="the new buffer's name in /dev/shm (default: a new name; the checkpointed buffer's name "
                        "lets the next checkpoint to PATH add to it)")
    p.set_defaults(run=_resume)
    p = _command(sub, "bench", "a quick probe: memcpy, push and sample rates")
    p.add_argument("--seconds", type=float, default=0.5, help="seconds per measurement")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_bench)
    p = _command(sub, "info", "versions, the hot path (C extension or Python) and why, /dev/shm, CPU, GPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_info)
    _add_top(sub)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command == "demo":
        return int(args.run(args))
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a reader that went away (`| head`) is seen here, not at exit
        return code
    except BrokenPipeError:
        # the reader of our output closed it (`shmbuffer ls --json | head`): stop quietly, as
        # Unix tools do; point stdout at /dev/null so the interpreter's last flush does not fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except (ShmBufferError, FileNotFoundError, FileExistsError) as exc:
        print(f"shmbuffer {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
