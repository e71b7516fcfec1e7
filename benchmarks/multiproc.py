"""Multi-process cases: 2 writer processes push 8-row batches while the learner samples 256.

One run of one subject, all in child processes (``spawn``), so a peer that hangs is killed after a
time-out and reported, and nothing it leaves running outlives the run:

1. The main process starts a learner process and waits for its result (``cfg.timeout`` plus the
   run's length); past that it kills the learner and everything under it.
2. The learner builds the buffer, fills it to capacity with rows of "writer 0" (so sampling starts
   from a full buffer and the writers overwrite), then starts 2 writer processes.
3. Once both writers are ready, all start together and stop at one deadline ``cfg.mp_seconds``
   later. Writers push self-verifying 8-row batches (``data.Stamper``) as fast as they can; the
   learner samples 256 rows in a loop and checks every sampled row (torn rows are counted; the
   time spent checking is left out of its batches/s).
4. Afterwards the learner reads every row left in the buffer and counts rows lost: for each writer,
   its rows still held must be exactly its newest ones, with no gap and nothing missing at the top
   (older ones were legitimately overwritten, since one ring keeps the newest ``capacity`` rows).
   Rows that fail verification in the final buffer are counted as corrupt.

Rows ingested count when a writer's push returns (for the queue baseline: when the learner has
taken them off the queue into its ring). ``torch.set_num_threads(1)`` is set in every child that
has torch loaded (OMP/MKL threads are limited through the environment too).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any

import numpy as np

from . import peers
from .data import ATARI, MUJOCO, SPECS, Fields, Spec, Stamper
from .harness import BATCH, Case, Config, Metric, case_result, summary
from .peers import Unavailable

WRITERS = 2
ROWS = Stamper.K


def limit_threads() -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


# -- the writer process -------------------------------------------------------------------------------
def _writer(subject: str, shared: Any, spec_name: str, w: int, ready: Any, go: Any, deadline: Any, results: Any) -> None:
    try:
        limit_threads()
        spec = SPECS[spec_name]
        stamper = Stamper(spec, w)
        writer = peers.MP_BY_NAME[subject].open_writer(shared, spec)
        limit_threads()
        ready.put(("ready", w, None))
        go.wait()
        end = deadline.value
        i = 0
        t0 = now = time.monotonic()
        while now < end:
            writer.push(stamper.batch(i))
            i += ROWS
            now = time.monotonic()
        writer.close()
        results.put(("done", w, i, t0, now))
    except BaseException as e:
        msg = f"writer {w}: {type(e).__name__}: {e}"
        ready.put(("error", w, msg))
        results.put(("error", w, msg))


# -- the learner process -------------------------------------------------------------------------------
def _learner(subject: str, spec_name: str, capacity: int, seconds: float, name: str, conn: Any) -> None:
    try:
        limit_threads()
        conn.send(_learn(subject, SPECS[spec_name], capacity, seconds, name))
    except BaseException as e:
        if isinstance(e, Unavailable):
            conn.send({"status": e.status, "reason": e.reason})
        else:
            conn.send({"status": "error", "reason": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=-6)})
    finally:
        conn.close()


def _wait(q: Any, procs: list[Any], what: str, timeout: float) -> tuple[Any, ...]:
    end = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode]
            if dead:
                raise RuntimeError(f"a writer died (exit code {dead[0].exitcode}) before {what}") from None
            if time.monotonic() > end:
                raise TimeoutError(f"no writer {what} after {timeout:.0f} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(msg[2])
        return tuple(msg)


def _prefill(subj: peers.MPSubject, spec: Spec, capacity: int) -> None:
    chunk = max(1, min(capacity, 8192, (16 << 20) // spec.row_bytes))
    for a in range(0, capacity, chunk):
        subj.push(spec.make(0, np.arange(a, min(capacity, a + chunk))))


def _learn(subject: str, spec: Spec, capacity: int, seconds: float, name: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    cls = peers.MP_BY_NAME[subject]
    subj = cls(spec, capacity, ctx, name)
    procs: list[Any] = []
    try:
        limit_threads()
        t = time.monotonic()
        _prefill(subj, spec, capacity)
        prefill_s = time.monotonic() - t
        ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        deadline = ctx.Value("d", 0.0)
        procs = [ctx.Process(target=_writer, args=(subject, subj.shared(), spec.name, w, ready, go, deadline, results),
                             daemon=True, name=f"bench-writer-{w}") for w in range(1, WRITERS + 1)]
        for p in procs:
            p.start()
        for _ in procs:
            _wait(ready, procs, "ready", 120)

        n = torn = learner_rows = 0
        check_s = sample_s = 0.0
        t_go = time.monotonic()
        end = deadline.value = t_go + seconds
        go.set()
        while True:
            now = time.monotonic()
            if now >= end:
                break
            learner_rows += subj.poll()
            t0 = time.perf_counter()
            out = subj.sample(BATCH)
            t1 = time.perf_counter()
            ok, _, _ = spec.check(subj.fields(out))
            torn += int(ok.size - np.count_nonzero(ok))
            del out
            check_s += time.perf_counter() - t1
            sample_s += t1 - t0
            n += 1
        window = time.monotonic() - t_go

        subj.finish(WRITERS, lambda: all(p.is_alive() or p.exitcode == 0 for p in procs))
        done = [_wait(results, procs, "result", 60 + seconds) for _ in procs]
        for p in procs:
            p.join(30)
        pushed = {0: capacity, **{int(d[1]): int(d[2]) for d in done}}
        writer_s = max(d[4] for d in done) - min(d[3] for d in done)
        ingest = learner_rows / window if cls.ingest_in_learner else sum(pushed[w] for w in pushed if w) / writer_s
        integrity = _integrity(spec, subj.dump(), pushed)
        return {
            "status": "ok",
            "ingest": ingest,
            "batches": n / max(window - check_s, 1e-9),
            "batches_wall": n / window,
            "torn": torn,
            "sampled_rows": n * BATCH,
            "window_s": window,
            "sample_s": sample_s,
            "check_s": check_s,
            "prefill_s": prefill_s,
            "pushed": {str(k): v for k, v in pushed.items()},
            **integrity,
            "stats": subj.stats(),
        }
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        subj.close()


def _integrity(spec: Spec, rows: Fields, pushed: dict[int, int]) -> dict[str, int]:
    """Rows lost, corrupt, duplicated or never pushed, from every row left in the buffer."""
    ok, w, seq = spec.check(rows)
    del rows
    lost = dup = phantom = 0
    for wid, count in pushed.items():
        mine = seq[ok & (w == wid)]
        held = np.unique(mine)
        dup += mine.size - held.size
        phantom += int(np.count_nonzero(held >= count))
        held = held[held < count]
        if held.size:
            lost += int(count - held[0] - held.size)  # a gap in, or a missing top of, its newest rows
    known = np.isin(w, list(pushed))
    return {"lost": lost, "corrupt": int(np.count_nonzero(~ok)), "duplicates": dup,
            "phantom": phantom + int(np.count_nonzero(ok & ~known)), "held": int(ok.size)}


# -- the main process's side -----------------------------------------------------------------------------
def kill_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def sweep(prefix: str) -> list[str]:
    """Remove and return our segments left in /dev/shm (a killed learner leaves its buffer)."""
    from shmbuffer.shm import segment

    left = [n for n in segment.list_names() if n.startswith(prefix)]
    for n in left:
        try:
            os.unlink(segment.path_of(n))
        except FileNotFoundError:
            pass
    return left


def run_once(cls: type[peers.MPSubject], spec: Spec, cfg: Config) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    prefix = peers.Ours.prefix
    name = peers.buffer_name(prefix)
    p = ctx.Process(target=_learner, args=(cls.name, spec.name, cfg.capacity(spec), cfg.mp_seconds, name, send),
                    name="bench-learner")
    limit = cfg.timeout + 3 * cfg.mp_seconds
    p.start()
    send.close()
    try:
        if recv.poll(limit):
            msg: dict[str, Any] = recv.recv()
        else:
            msg = {"status": "timeout", "reason": f"no result after {limit:.0f} s (hung): killed"}
    except EOFError:
        p.join(5)
        msg = {"status": "error", "reason": f"the learner process died (exit code {p.exitcode})"}
    except BaseException:  # interrupted: kill the learner and its writers before anything else
        kill_tree(p.pid)  # type: ignore[arg-type]
        raise
    finally:
        p.join(30)
        if p.is_alive():
            kill_tree(p.pid)  # type: ignore[arg-type]
        p.join(5)
        recv.close()
        left = sweep(name)
    if left:
        msg["left_in_dev_shm"] = left
    return msg


def _mp_case(spec: Spec) -> Any:
    def run(cfg: Config) -> dict[str, Any]:
        subjects: dict[str, dict[str, Any]] = {}
        avail: list[type[peers.MPSubject]] = []
        for cls in peers.MP:
            try:
                cls.available()
                avail.append(cls)
            except Unavailable as e:
                subjects[cls.name] = {"status": e.status, "reason": e.reason}
        runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in avail}
        for r in range(cfg.repeat):
            order = avail[r % len(avail):] + avail[:r % len(avail)] if avail else []
            for cls in order:
                if cls.name in subjects:
                    continue
                res = run_once(cls, spec, cfg)
                if res["status"] != "ok":
                    subjects[cls.name] = res
                else:
                    runs[cls.name].append(res)
                print(f"      {cls.name}: {_line(res)}", flush=True)
        for cls in avail:
            note = peers.MP_NOTES.get(cls.name) or peers.NOTES.get(cls.name, "")
            if cls.name in subjects:
                subjects[cls.name].update(kind=cls.kind, note=note)
                continue
            rs = runs[cls.name]
            subjects[cls.name] = {
                "status": "ok", "kind": cls.kind, "note": note,
                "metrics": {
                    "ingest": _summary([x["ingest"] for x in rs], spec.row_bytes),
                    "learner": _summary([x["batches"] for x in rs], BATCH * spec.row_bytes),
                },
                "torn": sum(x["torn"] for x in rs),
                "sampled_rows": sum(x["sampled_rows"] for x in rs),
                "lost": sum(x["lost"] for x in rs),
                "corrupt": sum(x["corrupt"] for x in rs),
                "duplicates": sum(x["duplicates"] for x in rs),
                "phantom": sum(x["phantom"] for x in rs),
                "runs": rs,
            }
        metrics = {"ingest": Metric(f"rows ingested from {WRITERS} writers (8-row pushes)", "rows/s", 1, spec.row_bytes),
                   "learner": Metric(f"learner sample {BATCH}, meanwhile", "batches/s", 1, BATCH * spec.row_bytes)}
        return case_result(f"{spec.title}: {WRITERS} writer processes push 8 rows while the learner samples "
                           f"{BATCH}, {cfg.mp_seconds:g} s", spec, cfg, metrics, subjects,
                           seconds=cfg.mp_seconds, writers=WRITERS)

    return run


def _summary(values: list[float], nbytes: int) -> dict[str, Any]:
    st = summary(values)
    st["gb_per_s"] = st["median"] * nbytes / 1e9
    return st


def _line(res: dict[str, Any]) -> str:
    if res["status"] != "ok":
        return f"{res['status']}: {res.get('reason', '')}"
    return (f"{res['ingest']:,.0f} rows/s in, {res['batches']:,.0f} batches/s out, torn {res['torn']}, "
            f"lost {res['lost']}, corrupt {res['corrupt']}")


def register(cases: dict[str, Case]) -> None:
    for spec in (MUJOCO, ATARI):
        cases[f"{spec.name}.multiproc"] = Case(f"{spec.name}.multiproc", "multi-process", "multiproc", _mp_case(spec),
                                               rounds=3)
