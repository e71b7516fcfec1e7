"""Cases for the framework drop-ins: Stable-Baselines3 learning on ``shmbuffer.sb3.ReplayBuffer``,
and TorchRL's ``ReplayBuffer`` on ``shmbuffer.torchrl.ShmStorage``.

* ``sb3.dqn``, ``sb3.sac``: env steps/s and gradient updates/s of ``model.learn(N)`` (DQN on
  CartPole-v1, SAC on Pendulum-v1; SB3's default hyperparameters except a 64-64 network,
  ``buffer_size`` 50,000 and ``learning_starts``; ``N`` fixed, smaller with ``--quick``) with SB3's
  own ``ReplayBuffer``, with ``shmbuffer.sb3.ReplayBuffer`` (same seeds: the same training run;
  whether the trained policies' parameters came out equal is recorded per round as
  ``same_training``), and with ours while 2 extra collector processes
  (``shmbuffer.Collector``, random actions) push their own env steps into the same buffer for the
  whole ``learn()``; for those, the env steps/s the extra processes collected meanwhile. One
  learn() per subject per round, the subjects' order rotating; a fresh model every time (its
  construction and the collectors' start are not timed). Torch runs with 1 thread (a core is left
  to the collectors; SB3 on the CPU gains little from a second one at this size).
* ``sb3.sample256``: ``ReplayBuffer.sample(256)`` of ``shmbuffer.sb3`` against SB3's own (the
  drop-in must be at least as fast as what it replaces), full of MuJoCo-like rows, with 1 and 4
  envs, timed in alternating blocks by ``cases.measure``, torch on 1 thread; ``ratios``: the median
  of the rounds' ours / SB3's.
* ``torchrl.extend_sample``: TorchRL's ``ReplayBuffer`` on our ``ShmStorage``, on its
  ``LazyTensorStorage`` and on its ``LazyMemmapStorage``, full of MuJoCo-like rows
  (``data.MUJOCO``): ``extend`` of 64 rows (a TensorDict) and ``sample(256)`` (TorchRL's
  ``RandomSampler``), timed by ``cases.measure`` with torch on 1 thread (on this shared 2-core VM,
  torch's default 2 threads made TorchRL's gather 10-50x slower whenever the other core was busy:
  66-102 instead of thousands of batches/s in one run).
* ``torchrl.multiproc``: 2 writer processes ``extend`` 8 self-verifying rows at a time
  (``data.Stamper``: every value of a row derives from (writer, sequence number)) into one
  TorchRL ``ReplayBuffer`` while the learner samples 256 and checks every sampled row (torn rows);
  afterwards every row left is read and each writer's rows must be exactly its newest ones (rows
  lost, corrupt), as in ``multiproc.py``. The buffer is made and filled (rows of "writer 0") by the
  learner and handed to the writers by pickling it into new processes, as TorchRL's docs on
  sharing replay buffers show (``forkserver`` with torchrl preloaded: pickled exactly as for
  ``spawn``, without each writer spending seconds importing torchrl). Subjects: our ``ShmStorage`` (no lock: the shared ring gives every
  extend its own slots); ``LazyMemmapStorage`` with ``shared=True`` (TorchRL's documented way: one
  ``multiprocessing.Lock`` around every ``extend`` and ``sample``); and ``LazyMemmapStorage`` and
  ``LazyTensorStorage`` without it (``shared=False``: the storage's memory and the writer's cursor
  still travel as shared memory and ``mp.Value``, but nothing orders the writers' cursor updates
  nor a reader against a writer).
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import multiproc, peers
from .data import MUJOCO, Fields, Stamper
from .features import torch_threads
from .harness import BATCH, Case, Config, Metric, Op, Subject, case_result, measure, summary, time_limit
from .peers import Unavailable, need, tensordict

COLLECTORS = 2
START = "forkserver"
"""How the TorchRL writers start: the buffer is pickled into them as for spawn, and the fork
server imports torchrl once for all of them."""
EXTEND = 64
FILL = 8192


# -- Stable-Baselines3 ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Algo:
    name: str
    env: str
    steps: int
    quick_steps: int
    kwargs: dict[str, Any]


ALGOS = {
    "dqn": Algo("DQN", "CartPole-v1", 4_000, 1_000, {"learning_starts": 200}),
    "sac": Algo("SAC", "Pendulum-v1", 600, 300, {"learning_starts": 100}),
}


def collector_transition(obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
                         terminated: np.ndarray, truncated: np.ndarray) -> dict[str, np.ndarray]:
    """A collector's env step as the SB3 adapter's fields: SB3 stores ``done`` for both ends of an
    episode and ``timeouts`` for the time-limit ones (masked at sampling)."""
    n = len(obs)
    return {"obs": obs, "action": np.asarray(action).reshape(n, -1), "reward": reward, "next_obs": next_obs,
            "done": (terminated | truncated).astype(np.float32), "timeouts": truncated.astype(np.float32)}


def _make_env(env_id: str) -> Any:
    import gymnasium as gym

    return gym.make(env_id)


def _learn_once(algo: Algo, steps: int, ours: bool, collectors: int, seed: int) -> dict[str, Any]:
    """One ``model.learn(steps)`` from a fresh model: its rates, and the trained parameters."""

    import stable_baselines3

    import shmbuffer as sb
    from shmbuffer import sb3 as ours_sb3

    kwargs: dict[str, Any] = {"buffer_size": 50_000, "policy_kwargs": {"net_arch": [64, 64]}, **algo.kwargs}
    if ours:
        kwargs.update(replay_buffer_class=ours_sb3.ReplayBuffer,
                      replay_buffer_kwargs={"name": peers.buffer_name(peers.Ours.prefix)})
    model = getattr(stable_baselines3, algo.name)("MlpPolicy", algo.env, seed=seed, device="cpu", **kwargs)
    col = None
    try:
        if collectors:
            col = sb.Collector(functools.partial(_make_env, algo.env), model.replay_buffer.buffer, workers=collectors,
                               transition=collector_transition, seed=seed + 1)
            col.warm(50 * collectors, timeout=120)  # the workers are up and pushing
            before = col.stats()["env_steps"]
        updates = model._n_updates
        t0 = time.perf_counter()
        model.learn(steps)
        dt = time.perf_counter() - t0
        out: dict[str, Any] = {"steps": steps / dt, "updates": (model._n_updates - updates) / dt, "seconds": dt}
        if col is not None:
            out["collected"] = (col.stats()["env_steps"] - before) / dt
            col.check()
            out["rows"] = int(model.replay_buffer.buffer.stats["inserted"])
        out["params"] = {k: v.detach().clone() for k, v in model.policy.state_dict().items()}
        return out
    finally:
        if col is not None:
            col.stop()
        if ours:
            model.replay_buffer.close()


def _sb3_case(key: str) -> Callable[[Config], dict[str, Any]]:
    algo = ALGOS[key]

    def run(cfg: Config) -> dict[str, Any]:
        steps = algo.quick_steps if cfg.quick else algo.steps
        metrics = {"steps": Metric(f"{algo.name} model.learn() env steps", "steps/s", 1, 0),
                   "updates": Metric("gradient updates, meanwhile", "updates/s", 1, 0),
                   "collected": Metric(f"env steps collected by {COLLECTORS} extra processes, meanwhile",
                                       "steps/s", 1, 0)}
        # (name, kind, ours, collectors, note)
        subjects = [
            ("sb3.ReplayBuffer", "peer", False, 0, f"{algo.name}(..., replay_buffer_class=None): SB3's own buffer"),
            ("shmbuffer", "ours", True, 0, f"{algo.name}(..., replay_buffer_class=shmbuffer.sb3.ReplayBuffer)"),
            (f"shmbuffer + {COLLECTORS} collectors", "ours", True, COLLECTORS,
             f"as above, while {COLLECTORS} shmbuffer.Collector processes (random actions, 1 env each) push "
             "their env steps into model.replay_buffer.buffer"),
        ]
        try:
            need("stable_baselines3")
            need("gymnasium")
        except Unavailable as e:
            return {"status": "skipped", "reason": e.reason}
        runs: dict[str, list[dict[str, Any]]] = {s[0]: [] for s in subjects}
        failed: dict[str, dict[str, Any]] = {}
        same: list[bool] = []
        with torch_threads(1):
            for r in range(cfg.repeat):
                params: dict[str, Any] = {}
                for name, _, ours, collectors, _ in subjects[r % 3:] + subjects[:r % 3]:
                    if name in failed:
                        continue
                    try:
                        with time_limit(cfg.timeout * 3, f"{name} learn"):
                            got = _learn_once(algo, steps, ours, collectors, seed=r)
                    except Exception as e:
                        failed[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
                        continue
                    params[name] = got.pop("params")
                    runs[name].append(got)
                if "sb3.ReplayBuffer" in params and "shmbuffer" in params:
                    a, b = params["sb3.ReplayBuffer"], params["shmbuffer"]
                    same.append(a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a))
        out: dict[str, dict[str, Any]] = {}
        for name, kind, _, collectors, note in subjects:
            if name in failed:
                out[name] = {**failed[name], "kind": kind, "note": note}
                continue
            rs = runs[name]
            m: dict[str, Any] = {k: summary([x[k] for x in rs]) for k in ("steps", "updates")}
            m["collected"] = summary([x["collected"] for x in rs]) if collectors else {
                "status": "n/a", "reason": "no extra collector processes"}
            out[name] = {"status": "ok", "kind": kind, "note": note, "metrics": m, "runs": rs}
        return case_result(f"SB3 {algo.name} on {algo.env}: model.learn({steps:,}) with SB3's buffer, ours, and ours "
                           f"fed by {COLLECTORS} extra collector processes", None, cfg, metrics, out,
                           learn_steps=steps, same_training=same)

    return run


# -- SB3: the drop-in's sample against SB3's own ------------------------------------------------------
SB3_ENVS = (1, 4)


def _sb3_buffer(ours: bool, capacity: int, n_envs: int) -> Any:
    """A full SB3 ``ReplayBuffer`` of MuJoCo-like rows (``data.MUJOCO``'s shapes, ``n_envs`` envs):
    SB3's own, its arrays written as its ``add`` would fill them, or ours, the same rows pushed
    into the shared buffer (lane ``e`` env ``e``'s)."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer

    from shmbuffer import sb3 as ours_sb3

    obs_space = spaces.Box(-np.inf, np.inf, MUJOCO.shape("obs"), np.float32)
    act_space = spaces.Box(-1, 1, MUJOCO.shape("action"), np.float32)
    rng = np.random.default_rng(0)
    steps = capacity // n_envs
    obs = rng.standard_normal((steps, n_envs, *obs_space.shape), np.float32)
    nxt = rng.standard_normal((steps, n_envs, *obs_space.shape), np.float32)
    act = rng.uniform(-1, 1, (steps, n_envs, *act_space.shape)).astype(np.float32)
    reward = rng.standard_normal((steps, n_envs), np.float32)
    done = (rng.random((steps, n_envs)) < 0.01).astype(np.float32)
    if not ours:
        rb = ReplayBuffer(capacity, obs_space, act_space, device="cpu", n_envs=n_envs)
        rb.observations[:], rb.next_observations[:], rb.actions[:] = obs, nxt, act
        rb.rewards[:], rb.dones[:], rb.full = reward, done, True
        return rb
    rb = ours_sb3.ReplayBuffer(capacity, obs_space, act_space, device="cpu", n_envs=n_envs,
                               name=peers.buffer_name(peers.Ours.prefix))
    try:  # step-major: row i of a push goes to lane i % n_envs
        rb.buffer.push({"obs": obs.reshape(capacity, -1), "next_obs": nxt.reshape(capacity, -1),
                        "action": act.reshape(capacity, -1), "reward": reward.reshape(-1), "done": done.reshape(-1),
                        "timeouts": np.zeros(capacity, np.float32)})
        assert rb.full and np.array_equal(rb.observations, obs)
    except BaseException:
        rb.close()
        raise
    return rb


def _sb3_sample_subject(ours: bool, capacity: int) -> Subject:
    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        made = [_sb3_buffer(ours, capacity, n) for n in SB3_ENVS]
        ops = {f"envs{n}": functools.partial(rb.sample, BATCH) for n, rb in zip(SB3_ENVS, made, strict=True)}
        return ops, (lambda: [rb.close() for rb in made]) if ours else (lambda: None)

    def check() -> None:
        need("stable_baselines3")
        need("gymnasium")

    what = "shmbuffer.sb3.ReplayBuffer" if ours else "stable_baselines3.common.buffers.ReplayBuffer"
    return Subject("shmbuffer" if ours else "sb3.ReplayBuffer", "ours" if ours else "peer", setup,
                   capacity * MUJOCO.row_bytes * 3, f"{what}(..., n_envs=1 or 4).sample(256) (torch tensors)", check)


def sb3_sample_case(cfg: Config) -> dict[str, Any]:
    """``sb3.sample256``: the drop-in's ``sample(256)`` against SB3's own, the two timed in
    alternating blocks (``measure``), torch on 1 thread; ``ratios``: the median over the rounds of
    each round's ours / SB3's (batches/s; above 1 when ours is faster)."""
    capacity = 20_000 if cfg.quick else 200_000
    metrics = {f"envs{n}": Metric(f"sample {BATCH}, {n} env{'s' if n > 1 else ''}", "batches/s", 1,
                                  BATCH * MUJOCO.row_bytes) for n in SB3_ENVS}
    with torch_threads(1):
        res = measure([_sb3_sample_subject(True, capacity), _sb3_sample_subject(False, capacity)], metrics, cfg)
    ratios = {}
    a, b = res["shmbuffer"], res["sb3.ReplayBuffer"]
    if a["status"] == b["status"] == "ok":
        for m in metrics:
            ratios[m] = statistics.median(x / y for x, y in zip(a["metrics"][m]["runs"], b["metrics"][m]["runs"],
                                                                  strict=True))
    return case_result(f"{MUJOCO.title}, capacity {capacity:,}: SB3 ReplayBuffer.sample({BATCH}), "
                       "shmbuffer.sb3's and SB3's own", MUJOCO, cfg, metrics, res, ratios=ratios)


# -- TorchRL: extend and sample, one process ----------------------------------------------------------
@dataclass(frozen=True)
class RB:
    """A TorchRL ``ReplayBuffer`` to measure: ``make(capacity, name)`` builds it."""

    name: str
    kind: str
    make: Callable[[int, str], Any]
    note: str


def _ours_rb(capacity: int, name: str, shared: bool = False) -> Any:
    from torchrl.data import ReplayBuffer

    from shmbuffer.torchrl import ShmStorage, identity

    return ReplayBuffer(storage=ShmStorage(capacity, name=name), collate_fn=identity, shared=shared)


def _torchrl_rb(storage: str, shared: bool) -> Callable[[int, str], Any]:
    def make(capacity: int, name: str) -> Any:
        data = need("torchrl.data")
        return data.ReplayBuffer(storage=getattr(data, storage)(capacity), shared=shared)

    return make


def close_rb(rb: Any) -> None:
    """Close a buffer of ours (the creator also unlinks it); TorchRL's own need nothing."""
    from shmbuffer.torchrl import ShmStorage

    if isinstance(rb.storage, ShmStorage):
        rb.storage.close()


ONE_PROCESS = [
    RB("shmbuffer", "ours", _ours_rb, "`ReplayBuffer(storage=ShmStorage(capacity), collate_fn=identity)`"),
    RB("torchrl LazyTensorStorage", "peer", _torchrl_rb("LazyTensorStorage", False),
       "`ReplayBuffer(storage=LazyTensorStorage(capacity))`"),
    RB("torchrl LazyMemmapStorage", "peer", _torchrl_rb("LazyMemmapStorage", False),
       "`ReplayBuffer(storage=LazyMemmapStorage(capacity))` (anonymous memory map: no scratch_dir)"),
]


def rows_of(td: Any) -> Fields:
    """A sampled TensorDict's fields as canonical numpy arrays."""
    return MUJOCO.canonical({n: td[n] for n in MUJOCO.fields})


def fill_rb(rb: Any, capacity: int, w: int = 0) -> None:
    for a in range(0, capacity, FILL):
        rb.extend(tensordict(MUJOCO.make(w, np.arange(a, min(capacity, a + FILL))), False))


def rb_subject(spec: RB, capacity: int) -> Subject:
    def check() -> None:
        need("torchrl.data")
        need("tensordict")

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        rb = spec.make(capacity, peers.buffer_name(peers.Ours.prefix))
        try:
            fill_rb(rb, capacity)
            ok, _, _ = MUJOCO.check(rows_of(rb.sample(BATCH)), full=True)
            if not ok.all():
                raise Unavailable("wrong data", f"{(~ok).sum()} of {ok.size} sampled rows differ from the rows extended")
            batches = [tensordict(MUJOCO.make(0, np.arange(j * EXTEND, (j + 1) * EXTEND)), False) for j in range(4)]
            nxt = itertools.cycle(batches).__next__
            extend, sample = rb.extend, rb.sample

            def push() -> Any:
                return extend(nxt())

            return {"extend": push, "sample": lambda: sample(BATCH)}, lambda: close_rb(rb)
        except BaseException:
            close_rb(rb)
            raise

    return Subject(spec.name, spec.kind, setup, capacity * MUJOCO.row_bytes, spec.note, check)


def extend_sample_case(cfg: Config) -> dict[str, Any]:
    spec = MUJOCO
    cap = cfg.capacity(spec)
    metrics = {"extend": Metric(f"extend {EXTEND} rows (a TensorDict)", "rows/s", EXTEND, spec.row_bytes),
               "sample": Metric(f"sample {BATCH} (RandomSampler)", "batches/s", 1, BATCH * spec.row_bytes)}
    subjects = [rb_subject(s, cap) for s in ONE_PROCESS]
    with torch_threads(1):  # TorchRL gathers with torch indexing: 2 threads crawl when the other core is busy
        res = measure(subjects, metrics, cfg)
    return case_result(f"{spec.title}: TorchRL ReplayBuffer.extend({EXTEND}) and sample({BATCH}) on each storage, "
                       f"full at {cap:,}", spec, cfg, metrics, res)


# -- TorchRL: 2 writer processes and a reader -------------------------------------------------------------
MULTI_PROCESS = [
    RB("shmbuffer", "ours", _ours_rb,
       "`ReplayBuffer(storage=ShmStorage(capacity), collate_fn=identity)` pickled to the writers; no lock"),
    RB("torchrl LazyMemmapStorage, shared=True", "peer", _torchrl_rb("LazyMemmapStorage", True),
       "`ReplayBuffer(storage=LazyMemmapStorage(capacity), shared=True)` pickled to the writers: one "
       "multiprocessing.Lock around every extend and sample (TorchRL's documented way)"),
    RB("torchrl LazyMemmapStorage, no lock", "peer", _torchrl_rb("LazyMemmapStorage", False),
       "`ReplayBuffer(storage=LazyMemmapStorage(capacity))` (shared=False) pickled to the writers: shared memory "
       "and a shared cursor (mp.Value), no lock"),
    RB("torchrl LazyTensorStorage, no lock", "peer", _torchrl_rb("LazyTensorStorage", False),
       "`ReplayBuffer(storage=LazyTensorStorage(capacity))` (shared=False) pickled to the writers: torch moves the "
       "storage to shared memory; a shared cursor (mp.Value), no lock"),
]
MP_BY_NAME = {s.name: s for s in MULTI_PROCESS}


def _mp_writer(rb: Any, w: int, ready: Any, go: Any, deadline: Any, results: Any) -> None:
    try:
        multiproc.limit_threads()
        stamper = Stamper(MUJOCO, w)
        cache: dict[int, Any] = {}  # the Stamper's batches are reused: one TensorDict view of each
        ready.put(("ready", w, None))
        go.wait()
        end = deadline.value
        i = 0
        t0 = now = time.monotonic()
        while now < end:
            b = stamper.batch(i)
            td = cache.get(id(b))
            if td is None:
                td = cache[id(b)] = tensordict(b, False)
            rb.extend(td)
            i += Stamper.K
            now = time.monotonic()
        close_rb(rb)
        results.put(("done", w, i, t0, now))
    except BaseException as e:
        msg = f"writer {w}: {type(e).__name__}: {e}"
        ready.put(("error", w, msg))
        results.put(("error", w, msg))


@contextmanager
def default_start_method(method: str) -> Iterator[None]:
    """multiprocessing's default start method set to ``method`` inside the block, as it was after.
    TorchRL makes its shared cursor and length (``mp.Value``) and its lock with the default
    context, which importing torchrl sets to spawn, unless something used the default context
    first (an earlier case in this run): then it is fork, and pickling those into the writers
    raises "A SemLock created in a fork context is being shared with a process in a spawn
    context"."""
    before = mp.get_start_method(allow_none=True)
    mp.set_start_method(method, force=True)
    try:
        yield
    finally:
        mp.set_start_method(before, force=True)


def _mp_run_once(spec: RB, capacity: int, cfg: Config, seconds: float) -> dict[str, Any]:
    """One run: this process is the learner (it has torch and torchrl loaded already, which a
    fresh learner process would spend seconds importing), under an alarm that ends a run stuck
    on a lock; the writers are killed, and our buffer removed, whatever happens."""
    name = peers.buffer_name(peers.Ours.prefix)
    limit = cfg.timeout + 3 * seconds
    try:
        with torch_threads(1), default_start_method(START), time_limit(limit, f"{spec.name} run"):
            return _mp_learn(spec, capacity, seconds, name)
    except Unavailable as e:
        return {"status": e.status, "reason": e.reason}
    except Exception as e:
        return {"status": "error", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6)}
    finally:
        multiproc.sweep(name)


def _mp_learn(spec: RB, capacity: int, seconds: float, name: str) -> dict[str, Any]:
    ctx: Any = mp.get_context(START)
    ctx.set_forkserver_preload(["torchrl.data", "shmbuffer.torchrl", __name__])
    rb = spec.make(capacity, name)
    procs: list[Any] = []
    try:
        fill_rb(rb, capacity)
        ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        deadline = ctx.Value("d", 0.0)
        procs = [ctx.Process(target=_mp_writer, args=(rb, w, ready, go, deadline, results), daemon=True,
                             name=f"bench-writer-{w}") for w in range(1, multiproc.WRITERS + 1)]
        for p in procs:
            p.start()
        for _ in procs:
            multiproc._wait(ready, procs, "ready", 120)
        n = torn = 0
        check_s = 0.0
        t_go = time.monotonic()
        end = deadline.value = t_go + seconds
        go.set()
        while time.monotonic() < end:
            out = rb.sample(BATCH)
            t1 = time.perf_counter()
            ok, _, _ = MUJOCO.check(rows_of(out))
            torn += int(ok.size - np.count_nonzero(ok))
            check_s += time.perf_counter() - t1
            n += 1
        window = time.monotonic() - t_go
        done = [multiproc._wait(results, procs, "result", 60 + seconds) for _ in procs]
        for p in procs:
            p.join(30)
        pushed = {0: capacity, **{int(d[1]): int(d[2]) for d in done}}
        writer_s = max(d[4] for d in done) - min(d[3] for d in done)
        integrity = multiproc._integrity(MUJOCO, rows_of(rb[:]), pushed)
        return {"status": "ok", "ingest": sum(v for w, v in pushed.items() if w) / writer_s,
                "batches": n / max(window - check_s, 1e-9), "torn": torn, "sampled_rows": n * BATCH,
                "window_s": window, "pushed": {str(k): v for k, v in pushed.items()}, **integrity}
    finally:
        for p in procs:
            if p.pid is None:  # never started (an earlier one failed to)
                continue
            if p.is_alive():
                p.kill()
            p.join(5)
        close_rb(rb)


def multiproc_case(cfg: Config) -> dict[str, Any]:
    spec = MUJOCO
    cap = min(cfg.capacity(spec), 100_000)
    seconds = cfg.mp_seconds / 2 if cfg.quick else max(2.0, cfg.mp_seconds / 2)  # --quick: 1 s, a smoke run
    out: dict[str, dict[str, Any]] = {}
    avail: list[RB] = []
    for s in MULTI_PROCESS:
        try:
            need("torchrl.data")
            avail.append(s)
        except Unavailable as e:
            out[s.name] = {"status": e.status, "reason": e.reason}
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in avail}
    for r in range(cfg.repeat):
        for s in avail[r % len(avail):] + avail[:r % len(avail)] if avail else []:
            if s.name in out:
                continue
            res = _mp_run_once(s, cap, cfg, seconds)
            if res["status"] != "ok":
                out[s.name] = res
            else:
                runs[s.name].append(res)
            print(f"      {s.name}: {multiproc._line(res)}", flush=True)
    for s in MULTI_PROCESS:
        if s.name in out:
            out[s.name].update(kind=s.kind, note=s.note)
            continue
        rs = runs[s.name]
        out[s.name] = {
            "status": "ok", "kind": s.kind, "note": s.note,
            "metrics": {"ingest": multiproc._summary([x["ingest"] for x in rs], spec.row_bytes),
                        "learner": multiproc._summary([x["batches"] for x in rs], BATCH * spec.row_bytes)},
            **{k: sum(x[k] for x in rs) for k in ("torn", "sampled_rows", "lost", "corrupt", "duplicates", "phantom")},
            "runs": rs,
        }
    metrics = {"ingest": Metric(f"rows extended by {multiproc.WRITERS} writers (8-row extends)", "rows/s", 1,
                                spec.row_bytes),
               "learner": Metric(f"learner sample {BATCH}, meanwhile", "batches/s", 1, BATCH * spec.row_bytes)}
    return case_result(f"{spec.title}: {multiproc.WRITERS} writer processes extend one TorchRL ReplayBuffer 8 rows "
                       f"at a time while the learner samples {BATCH}, {seconds:g} s, capacity {cap:,}", spec, cfg,
                       metrics, out, seconds=seconds, writers=multiproc.WRITERS, capacity=cap)


def register(cases: dict[str, Case]) -> None:
    for key, algo in ALGOS.items():
        cases[f"sb3.{key}"] = Case(f"sb3.{key}", f"SB3 {algo.name} learn() on its buffer, ours, ours + collectors",
                                   "frameworks", _sb3_case(key))
    cases["sb3.sample256"] = Case("sb3.sample256", "SB3 ReplayBuffer.sample(256): shmbuffer.sb3's and SB3's own",
                                  "frameworks", sb3_sample_case)
    cases["torchrl.extend_sample"] = Case("torchrl.extend_sample", "TorchRL ReplayBuffer extend 64 / sample 256 per "
                                          "storage", "frameworks", extend_sample_case)
    cases["torchrl.multiproc"] = Case("torchrl.multiproc", "TorchRL ReplayBuffer, 2 writer processes + a reader: "
                                      "torn / lost per storage", "frameworks", multiproc_case, rounds=3)
