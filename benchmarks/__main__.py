"""``python -m benchmarks``: shmbuffer against its peers and the hardware floors, in one run.

    python -m benchmarks                      # everything: 25-35 minutes on the 2-core VM (benchmarks/README.md)
    python -m benchmarks --quick              # a few seconds a case: the CI smoke test
    python -m benchmarks --only mujoco push64 atari.multiproc --repeat 7 --out results/r.json
    python -m benchmarks --update-pages       # into benchmarks/results/results.json, and the pages from it
    python -m benchmarks --list

Writes the results as JSON (``--out``; by default a scratch file in the temporary directory, so a
reproduction leaves the tracked pages alone), a Markdown report next to it (same name, ``.md``)
and, with matplotlib, plots (``<name>-push.png`` ...). With ``--update-pages`` (or ``--out`` the
committed results file) the run writes the committed results file and rewrites the pages that
state it (``page.py``). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

PAGES_OUT = Path(__file__).parent / "results" / "results.json"
"""The committed results file, which README.md and benchmarks/README.md state (``--update-pages``)."""
DEFAULT_OUT = Path(tempfile.gettempdir()) / "shmbuffer-benchmarks" / "results.json"
"""Where a run writes unless told: a scratch file, so reproducing a result rewrites no tracked file."""
GROUPS = ["floor", "push", "sample", "prioritized", "sequence", "loader", "multiproc", "frameworks", "distributed", "gpu"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small capacities, 1 round, short runs (the CI smoke test)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="cases to run: a name (mujoco.push64), a glob (atari.*) or one part of a name (push64, mujoco)")
    p.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT}, a scratch file)")
    p.add_argument("--update-pages", action="store_true",
                   help=f"write {PAGES_OUT.relative_to(PAGES_OUT.parents[2])} and rewrite README.md's and "
                        "benchmarks/README.md's results from it")
    p.add_argument("--repeat", type=int, help="interleaved rounds per case (default 5; --quick: 1)")
    p.add_argument("--seconds", type=float, help="length of each multi-process run (default 6; --quick: 2)")
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
        ranks,
        report,
    )
    cases.register(harness.CASES)
    features.register(harness.CASES)
    multiproc.register(harness.CASES)
    frameworks.register(harness.CASES)
    distributed.register(harness.CASES)
    compression.register(harness.CASES)
    hindsight.register(harness.CASES)
    ranks.register(harness.CASES)
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
    if args.update_pages and args.out is not None and args.out.resolve() != PAGES_OUT.resolve():
        print(f"--update-pages writes {PAGES_OUT}: leave out --out {args.out}", file=sys.stderr)
        return 2
    out: Path = PAGES_OUT if args.update_pages else args.out or DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    run = {"date": machine.now(), "commit": machine.git_commit(), "argv": sys.argv[1:], "load_average_start": _load()}
    results = _start(out, args, cfg, machine.info(), run)
    print(f"shmbuffer benchmarks: {len(chosen)} cases, {cfg.repeat} rounds each"
          f"{' (quick)' if cfg.quick else ''}; {results['machine']['cpu']}, "
          f"{results['machine']['usable_cores']} cores; writing {out} after each case", flush=True)
    try:
        for i, name in enumerate(chosen, 1):
            c = harness.CASES[name]
            print(f"[{i}/{len(chosen)}] {name}: {c.title}", flush=True)
            t = time.monotonic()
            # a case whose rounds are long takes fewer, unless --repeat asks for a number
            ccfg = replace(cfg, repeat=min(cfg.repeat, c.rounds)) if c.rounds and args.repeat is None else cfg
            measured = {"date": machine.now(), "commit": run["commit"], "rounds": ccfg.repeat,
                        "load_average_start": _load()}
            if c.run is None:
                res: dict[str, Any] = {"status": "not available yet", "title": c.title, "reason": c.pending}
            else:
                try:
                    res = c.run(ccfg)
                except Exception as e:
                    res = {"status": "error", "title": c.title, "reason": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc(limit=-8)}
            res["group"] = c.group
            res["elapsed_s"] = round(time.monotonic() - t, 1)
            res["measured"] = {**measured, "load_average_end": _load()}
            results["cases"][name] = res
            run["cases"].append(name)
            _progress(res)
            _write(results, out, report)  # a crash or a stop later keeps every case measured so far
    finally:
        results["left_in_dev_shm"] = multiproc.sweep(peers.Ours.prefix)

    results["profiles"] = {}
    for what in sorted({t["profile"] for t in report.targets(results) if t["status"] == "missed" and t.get("profile")}):
        try:
            results["profiles"][what] = harness.profile(what, cfg)
        except Exception as e:
            results["profiles"][what] = [f"profile failed: {type(e).__name__}: {e}"]
    run["elapsed_s"] = round(time.monotonic() - started, 1)
    run["load_average_end"] = _load()
    results["elapsed_s"] = sum(r.get("elapsed_s") or 0 for r in results["runs"])
    results["load_average_end"] = run["load_average_end"]
    files, why = report.plots(results, out)
    results["plots"] = [Path(f).name for f in files] or why
    results["left_in_dev_shm"] += multiproc.sweep(peers.Ours.prefix)
    _write(results, out, report, files)
    print("\n" + report.ratio_table(results) + "\n\n" + report.target_table(results) + "\n")
    print(f"wrote {out}, {out.with_suffix('.md')}" + (f", {len(files)} plots" if files else f" ({why or 'no ratio to plot'})"))
    if out.resolve() == PAGES_OUT.resolve():  # the results file the pages state: rewrite them from it
        from . import page

        print("wrote " + ", ".join(str(p.relative_to(page.ROOT)) for p in page.write()))
    return 0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _start(out: Path, args: argparse.Namespace, cfg: Any, mach: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The results this run adds to: with ``--only``, the file at ``out`` when it was made with the same
    settings (its other cases stay, each with its own date and commit); otherwise a new file."""
    from .data import SPECS

    config = {**asdict(cfg), "capacities": {s.name: cfg.capacity(s) for s in SPECS.values()}, "argv": sys.argv[1:]}
    run["cases"] = []
    old: dict[str, Any] = {}
    if args.only and out.exists():
        try:
            old = json.loads(out.read_text())
        except ValueError as e:
            print(f"{out} is not a results file ({e}): starting a new one", file=sys.stderr)
        same = {k: v for k, v in old.get("config", {}).items() if k not in ("argv", "repeat")} == \
            {k: v for k, v in config.items() if k not in ("argv", "repeat")}
        if old and not same:
            print(f"{out} was made with other settings ({old.get('config')}): starting a new one", file=sys.stderr)
            old = {}
    if old:
        old["runs"] = [*old.get("runs", [_first_run(old)]), run]
        old["machine"] = mach  # the newest run's; each case says when it was measured
        return old
    return {"machine": mach, "config": config, "runs": [run], "cases": {}}


def _first_run(old: dict[str, Any]) -> dict[str, Any]:
    """The run that made a results file written before files recorded their runs."""
    m = old.get("machine", {})
    return {"date": m.get("date"), "commit": m.get("shmbuffer_commit"), "argv": old.get("config", {}).get("argv", []),
            "cases": list(old.get("cases", {})), "elapsed_s": old.get("elapsed_s"),
            "load_average_start": m.get("load_average"), "load_average_end": old.get("load_average_end")}


def _write(results: dict[str, Any], out: Path, report: Any, plots: list[str] | None = None) -> None:
    """The results file and its Markdown report, each replaced whole (a reader never sees half a file)."""
    results["ratios"] = report.ratios(results)
    results["targets"] = report.targets(results)
    for path, text in ((out, json.dumps(results, indent=1, default=str)),
                       (out.with_suffix(".md"), report.markdown(results, plots or []))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


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
