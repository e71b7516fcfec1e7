"""``python -m benchmarks``: shmbuffer against its peers and the hardware floors, in one run.

    python -m benchmarks                      # everything (several minutes)
    python -m benchmarks --quick              # a few seconds a case: the CI smoke test
    python -m benchmarks --only mujoco push64 atari.multiproc --repeat 7 --out results/r.json
    python -m benchmarks --list

Writes the results as JSON (``--out``), a Markdown report next to it (same name, ``.md``) and,
with matplotlib, plots (``<name>-push.png`` ...). Written to the default file, the run also
rewrites the pages that state the current results (``page.py``). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).parent / "results" / "results.json"
GROUPS = ["floor", "push", "sample", "prioritized", "sequence", "loader", "multiproc", "frameworks", "distributed", "gpu"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small capacities, 1 round, short runs (the CI smoke test)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="cases to run: a name (mujoco.push64), a glob (atari.*) or one part of a name (push64, mujoco)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    p.add_argument("--repeat", type=int, help="interleaved rounds per case (default 5; --quick: 1)")
    p.add_argument("--seconds", type=float, help="length of each multi-process run (default 10; --quick: 2)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p.parse_args(argv)


def select(names: list[str], only: list[str] | None) -> list[str]:
    if not only:
        return names
    return [n for n in names if any(n == o or fnmatch.fnmatch(n, o) or o in n.split(".") for o in only)]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from . import (
        cases,
        compression,
        distributed,
        features,
        frameworks,
        harness,
        hindsight,
        machine,
        multiproc,
        peers,
        report,
    )
    from .data import SPECS

    cases.register(harness.CASES)
    features.register(harness.CASES)
    multiproc.register(harness.CASES)
    frameworks.register(harness.CASES)
    distributed.register(harness.CASES)
    compression.register(harness.CASES)
    hindsight.register(harness.CASES)
    order = sorted(harness.CASES, key=lambda n: GROUPS.index(harness.CASES[n].group))
    if args.list:
        for n in order:
            c = harness.CASES[n]
            print(f"{n:24} {c.title}" + (f"  [not available yet: {c.pending}]" if c.pending else ""))
        return 0
    chosen = select(order, args.only)
    if not chosen:
        print(f"no case matches {args.only}; cases: {', '.join(order)}", file=sys.stderr)
        return 2
    cfg = harness.quick_config(args.repeat) if args.quick else harness.Config(repeat=args.repeat or 5)
    if args.seconds:
        cfg.mp_seconds = args.seconds
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    results: dict[str, Any] = {
        "machine": machine.info(),
        "config": {**asdict(cfg), "capacities": {s.name: cfg.capacity(s) for s in SPECS.values()},
                   "argv": sys.argv[1:]},
        "cases": {},
    }
    print(f"shmbuffer benchmarks: {len(chosen)} cases, {cfg.repeat} rounds each"
          f"{' (quick)' if cfg.quick else ''}; {results['machine']['cpu']}, "
          f"{results['machine']['usable_cores']} cores", flush=True)
    try:
        for i, name in enumerate(chosen, 1):
            c = harness.CASES[name]
            print(f"[{i}/{len(chosen)}] {name}: {c.title}", flush=True)
            t = time.monotonic()
            if c.run is None:
                res: dict[str, Any] = {"status": "not available yet", "title": c.title, "reason": c.pending}
            else:
                try:
                    res = c.run(cfg)
                except Exception as e:
                    res = {"status": "error", "title": c.title, "reason": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc(limit=-8)}
            res["group"] = c.group
            res["elapsed_s"] = round(time.monotonic() - t, 1)
            results["cases"][name] = res
            _progress(res)
    finally:
        results["left_in_dev_shm"] = multiproc.sweep(peers.Ours.prefix)

    results["ratios"] = report.ratios(results)
    results["targets"] = report.targets(results)
    wanted = {t["profile"] for t in results["targets"] if t["status"] == "missed" and t.get("profile")}
    results["profiles"] = {}
    for what in sorted(wanted):
        try:
            results["profiles"][what] = harness.profile(what, cfg)
        except Exception as e:
            results["profiles"][what] = [f"profile failed: {type(e).__name__}: {e}"]
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    files, why = report.plots(results, out)
    results["plots"] = [Path(f).name for f in files] or why
    results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["left_in_dev_shm"] += multiproc.sweep(peers.Ours.prefix)
    out.write_text(json.dumps(results, indent=1, default=str))
    md = report.markdown(results, files)
    out.with_suffix(".md").write_text(md)
    print("\n" + report.ratio_table(results) + "\n\n" + report.target_table(results) + "\n")
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {len(files)} plots" if files else f" ({why})"))
    if out.resolve() == DEFAULT_OUT.resolve():  # the results file the pages state: rewrite them from it
        from . import page

        print("wrote " + ", ".join(str(p.relative_to(page.ROOT)) for p in page.write()))
    return 0


def _progress(res: dict[str, Any]) -> None:
    if res.get("status") != "ok":
        print(f"    {res.get('status')}: {res.get('reason', '')}", flush=True)
        return
    for name, s in res["subjects"].items():
        if s.get("status") != "ok":
            print(f"    {name:34} {s.get('status')}: {s.get('reason', '')}", flush=True)
            continue
        parts = []
        for metric, m in s["metrics"].items():
            unit = res["metrics"][metric]["unit"]
            parts.append(f"{metric} {m['median']:,.0f} {unit}" if "median" in m else f"{metric} n/a")
        print(f"    {name:34} " + ", ".join(parts), flush=True)
    print(f"    ({res['elapsed_s']} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
