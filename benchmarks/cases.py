"""The single-process cases: push and sample of MuJoCo-like and Atari rows (against the peers, a
baseline and the floors), the large-memcpy floor, and sampling to the GPU. They register with
``@case`` (``harness.py``, which also times them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import peers
from .data import ATARI, MUJOCO, Spec
from .harness import (
    BATCH,
    Case,
    Config,
    Metric,
    Op,
    Pool,
    Subject,
    case,
    case_result,
    copyto_floor,
    fill,
    measure,
    store_subject,
    take_floor,
)


# -- single-process cases -------------------------------------------------------------------------------
def _push_case(spec: Spec, k: int) -> Callable[[Config], dict[str, Any]]:
    def run(cfg: Config) -> dict[str, Any]:
        cap = cfg.capacity(spec)
        metrics = {"push": Metric(f"push {k}", "rows/s", k, spec.row_bytes)}
        pool = Pool(spec, cap)
        subjects = [store_subject(c, spec, cap, k, {"push": "push"}) for c in peers.STORES]
        subjects += [copyto_floor(pool, k, True), copyto_floor(pool, k, False)]
        try:
            res = measure(subjects, metrics, cfg)
        finally:
            pool.free()
        return case_result(f"{spec.title}: push {k} row{'s' if k > 1 else ''}, one process", spec, cfg, metrics, res)

    return run


def _sample_case(spec: Spec) -> Callable[[Config], dict[str, Any]]:
    def run(cfg: Config) -> dict[str, Any]:
        cap = cfg.capacity(spec)
        b = BATCH * spec.row_bytes
        metrics = {"numpy": Metric(f"sample {BATCH} as numpy", "batches/s", 1, b),
                   "torch": Metric(f"sample {BATCH} as torch tensors", "batches/s", 1, b)}
        variants = {"numpy": "sample", "torch": "sample_torch"}
        pool = Pool(spec, cap)
        subjects = [store_subject(c, spec, cap, 64, variants) for c in peers.STORES]
        subjects += [take_floor(pool, True, ("numpy", "torch")), take_floor(pool, False, ("numpy", "torch"))]
        try:
            res = measure(subjects, metrics, cfg)
        finally:
            pool.free()
        return case_result(f"{spec.title}: uniform sample of {BATCH} from a full buffer", spec, cfg, metrics, res)

    return run


def register(cases: dict[str, Case]) -> None:
    """Add the push and sample cases of each schema (the ``@case`` ones are in from the import)."""
    for spec in (MUJOCO, ATARI):
        for k in (1, 64):
            cases[f"{spec.name}.push{k}"] = Case(f"{spec.name}.push{k}", f"push {k}", "push", _push_case(spec, k))
        cases[f"{spec.name}.sample256"] = Case(f"{spec.name}.sample256", "sample 256", "sample", _sample_case(spec))


@case("floor.memcpy", "large memcpy (np.copyto of 256 MiB)", "floor")
def memcpy_case(cfg: Config) -> dict[str, Any]:
    size = (16 if cfg.quick else 256) << 20

    def setup() -> tuple[dict[str, Op], Callable[[], None]]:
        src = np.ones(size, np.uint8)
        dst = np.ones(size, np.uint8)
        return {"copy": lambda: np.copyto(dst, src)}, lambda: None

    metrics = {"copy": Metric(f"memcpy {size >> 20} MiB", "GB/s", size, 1)}
    res = measure([Subject("np.copyto", "floor", setup, 2 * size)], metrics, cfg)
    for s in res.values():  # units are bytes: report GB/s
        for m in s.get("metrics", {}).values():
            for key in ("median", "min", "max"):
                m[key] /= 1e9
            m["runs"] = [v / 1e9 for v in m["runs"]]
            m["gb_per_s"] = m["median"]
    return case_result(f"memcpy of {size >> 20} MiB (the machine's copy bandwidth)", None, cfg, metrics, res)


@case("gpu.sample256", "sample 256 to the GPU", "gpu")
def gpu_case(cfg: Config) -> dict[str, Any]:
    return _gpu(cfg, MUJOCO)


@case("gpu.atari.sample256", "sample 256 Atari rows to the GPU", "gpu")
def gpu_atari_case(cfg: Config) -> dict[str, Any]:
    return _gpu(cfg, ATARI)


def _gpu(cfg: Config, spec: Spec) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"status": "skipped", "reason": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no GPU (torch.cuda.is_available() is False)"}
    dev = torch.device("cuda")
    cap = cfg.capacity(spec)
    metrics = {"cuda": Metric(f"sample {BATCH} to cuda", "batches/s", 1, BATCH * spec.row_bytes)}

    def store(cls: type[peers.Store]) -> Subject:
        def setup() -> tuple[dict[str, Op], Callable[[], None]]:
            cls.available()
            s = cls(spec, cap, 64)
            fill(s, spec, cap)
            if cls is peers.Ours:
                def op() -> Any:
                    out = s.buf.sample(BATCH).to(dev)  # type: ignore[attr-defined]
                    torch.cuda.synchronize()
                    return out
            else:
                def op() -> Any:
                    raw = s.raw(s.sample_torch(BATCH))
                    out = {k: v.to(dev) for k, v in raw.items()}
                    torch.cuda.synchronize()
                    return out
            return {"cuda": op}, s.close

        return Subject(cls.name, cls.kind, setup, cap * spec.row_bytes)

    def loader(background: bool) -> Subject:
        def setup() -> tuple[dict[str, Op], Callable[[], None]]:
            from shmbuffer import Loader

            s = peers.Ours(spec, cap, 64)
            fill(s, spec, cap)
            load = Loader(s.buf, BATCH, device=dev, prefetch=2, background=background)
            it = iter(load)

            def op() -> Any:
                out = next(it)
                torch.cuda.synchronize()
                return out

            def close() -> None:
                load.close()
                s.close()

            return {"cuda": op}, close

        how = "prefetched in a thread" if background else "in the caller's thread"
        return Subject(f"shmbuffer Loader ({how})", "ours", setup, cap * spec.row_bytes,
                       "gathered into reused pinned staging memory, copied on a side stream")

    def floor() -> tuple[dict[str, Op], Callable[[], None]]:
        host = torch.ones((BATCH, spec.row_bytes), dtype=torch.uint8).pin_memory()

        def op() -> Any:
            out = host.to(dev, non_blocking=True)
            torch.cuda.synchronize()
            return out

        return {"cuda": op}, lambda: None

    subjects = [store(c) for c in (peers.Ours, peers.Cpprb, peers.TorchRLTensor, peers.NumpyRing)]
    subjects += [loader(True), loader(False)]
    subjects.append(Subject("floor pinned copy to GPU", "floor", floor, 0, "one pinned 256-row block .to('cuda')"))
    return case_result(f"{spec.title}: sample {BATCH} and move it to {torch.cuda.get_device_name()}", spec, cfg,
                       metrics, measure(subjects, metrics, cfg))
