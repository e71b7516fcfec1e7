"""From results to ratios, targets, a Markdown report and plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

OURS = "shmbuffer"


# -- ratios ---------------------------------------------------------------------------------------------
def _median(subject: dict[str, Any] | None, metric: str) -> float | None:
    if not subject or subject.get("status") != "ok":
        return None
    m = subject.get("metrics", {}).get(metric, {})
    return m.get("median")


def _best(case: dict[str, Any], metric: str, kind: str) -> tuple[str | None, float | None]:
    found: list[tuple[str, float]] = []
    for name, s in case["subjects"].items():
        v = _median(s, metric) if s.get("kind") == kind else None
        if v is not None:
            found.append((name, v))
    if not found:
        return None, None
    seconds = case["metrics"].get(metric, {}).get("unit") == "s"  # a time: the best is the shortest
    return (min if seconds else max)(found, key=lambda x: x[1])


def ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case and measure: ours, the best peer, the baseline and the best floor."""
    rows = []
    for name, case in results["cases"].items():
        if case.get("status") != "ok":
            continue
        for metric, meta in case["metrics"].items():
            ours = _median(case["subjects"].get(OURS), metric)
            row: dict[str, Any] = {"case": name, "metric": metric, "label": meta["label"], "unit": meta["unit"],
                                   "ours": ours}
            for kind in ("peer", "baseline", "floor"):
                who, value = _best(case, metric, kind)
                row[kind] = who
                row[f"{kind}_value"] = value
                row[f"ours_per_{kind}"] = None if ours is None or not value else (
                    value / ours if meta["unit"] == "s" else ours / value)  # seconds: fewer is faster
            if ours is not None:
                row["ours_gb_per_s"] = case["subjects"][OURS]["metrics"][metric].get("gb_per_s")
            rows.append(row)
    return rows


# -- targets --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    id: str
    text: str
    case: str
    metric: str
    against: str  # a subject's name, or "floor" for the case's best floor
    need: float
    profile: str | None = None  # what ``cases.profile`` shows when it is missed
    subject: str = OURS  # the subject measured against ``against`` (ours, unless a variant of ours)


TARGETS = [
    Target("mujoco-push64-sb3", "MuJoCo push 64 >= 2x SB3", "mujoco.push64", "push", "sb3.ReplayBuffer", 2.0,
           "mujoco.push64"),
    Target("mujoco-sample-cpprb", "MuJoCo sample 256 >= 2x cpprb", "mujoco.sample256", "numpy", "cpprb.ReplayBuffer",
           2.0, "mujoco.sample256"),
    Target("mujoco-sample-ring", "MuJoCo sample 256 >= 0.8x the in-process numpy ring", "mujoco.sample256", "numpy",
           "numpy ring", 0.8, "mujoco.sample256"),
    Target("atari-push-floor", "Atari push 64 >= 0.8x the np.copyto floor", "atari.push64", "push", "floor", 0.8,
           "atari.push64"),
    Target("atari-sample-floor", "Atari sample 256 >= 0.8x the np.take floor", "atari.sample256", "numpy", "floor",
           0.8, "atari.sample256"),
    Target("mujoco-mp-ingest", "multi-process MuJoCo ingest >= 5x cpprb MPReplayBuffer", "mujoco.multiproc", "ingest",
           "cpprb.MPReplayBuffer", 5.0, "mujoco.push8"),
    Target("mujoco-mp-learner", "... while our learner samples >= 1x as fast as cpprb's", "mujoco.multiproc",
           "learner", "cpprb.MPReplayBuffer", 1.0, "mujoco.sample256"),
    Target("mujoco-mp-integrity", "... with 0 torn and 0 lost rows", "mujoco.multiproc", "integrity", OURS, 0),
    Target("atari-mp-ingest", "multi-process Atari ingest >= 3x cpprb's", "atari.multiproc", "ingest",
           "cpprb.MPReplayBuffer", 3.0, "atari.push8"),
    Target("atari-mp-integrity", "(and 0 torn and 0 lost rows there too)", "atari.multiproc", "integrity", OURS, 0),
    Target("mujoco-per-cpprb", "MuJoCo prioritized sample 256 + update 256 >= 2x cpprb PrioritizedReplayBuffer",
           "mujoco.prioritized", "per", "cpprb.PrioritizedReplayBuffer", 2.0, "mujoco.prioritized"),
    # issue 24 (a sample is one C call): the same cases, the bars raised
    Target("mujoco-sample-ring-3x", "MuJoCo sample 256 >= 3x the in-process numpy ring (one C call)",
           "mujoco.sample256", "numpy", "numpy ring", 3.0, "mujoco.sample256"),
    Target("mujoco-per-cpprb-8x", "MuJoCo prioritized sample 256 + update 256 >= 8x cpprb (one C call)",
           "mujoco.prioritized", "per", "cpprb.PrioritizedReplayBuffer", 8.0, "mujoco.prioritized"),
    Target("atari-sample-take-1.5x", "Atari sample 256 >= 1.5x the single-thread np.take floor (both cores)",
           "atari.sample256", "numpy", "floor", 1.5, "atari.sample256"),
    Target("atari-stacked-cpprb", "stacked Atari sample 256, frames stored once, >= 1.5x cpprb next_of + stack_compress",
           "atari.compressed", "numpy", "cpprb.ReplayBuffer(next_of, stack_compress)", 1.5),
    Target("atari-stacked-uncompressed", "... and >= 1x our uncompressed buffer's sample", "atari.compressed", "numpy",
           "shmbuffer, uncompressed", 1.0),
    Target("mujoco-loader-thread", "CPU loader sampling in its thread >= 1.3x sample() in the loop", "mujoco.loader",
           "train", "shmbuffer sample().to('cpu'), no prefetch", 1.3, subject="shmbuffer loader(background=True)"),
    # several learners on one buffer (benchmarks/ranks.py): 2 rank processes against 1, total batches/s
    Target("ranks-uniform", "2 ranks / 1 rank, uniform sample 256, quiet, >= 1.9x", "ranks.mujoco", "uniform",
           "shmbuffer, 1 rank", 1.9),
    Target("ranks-per", "2 ranks / 1 rank, prioritized sample 256 + update, quiet, >= 1.8x", "ranks.mujoco", "per",
           "shmbuffer, 1 rank", 1.8),
    Target("ranks-uniform-busy", "... uniform, 2 busy processes beside: >= 1x", "ranks.mujoco", "uniform_busy",
           "shmbuffer, 1 rank", 1.0),
    Target("ranks-per-busy", "... prioritized, 2 busy processes beside: >= 1x", "ranks.mujoco", "per_busy",
           "shmbuffer, 1 rank", 1.0),
    Target("sb3-sample-1env", "shmbuffer.sb3.ReplayBuffer.sample(256) >= 1x SB3's own, 1 env", "sb3.sample256",
           "envs1", "sb3.ReplayBuffer", 1.0),
    Target("sb3-sample-4envs", "... and with 4 envs", "sb3.sample256", "envs4", "sb3.ReplayBuffer", 1.0),
    Target("mujoco-mp-learner-8x", "2 writers + learner: our learner samples >= 8x cpprb's", "mujoco.multiproc",
           "learner", "cpprb.MPReplayBuffer", 8.0, "mujoco.sample256"),
]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in TARGETS:
        row: dict[str, Any] = {"id": t.id, "text": t.text, "need": t.need, "profile": t.profile}
        case = results["cases"].get(t.case)
        ours = (case or {}).get("subjects", {}).get(t.subject)
        if not case or case.get("status") != "ok" or not ours or ours.get("status") != "ok":
            row.update(status="not measured", detail=f"{t.case} was not run or shmbuffer was not measured there")
        elif t.metric == "integrity":
            bad = {k: ours.get(k, 0) for k in ("torn", "lost", "corrupt")}
            row.update(status="met" if not any(bad.values()) else "missed",
                       detail=f"torn {bad['torn']} of {ours.get('sampled_rows', 0):,} sampled rows, lost {bad['lost']}, "
                              f"corrupt {bad['corrupt']} (all runs)")
        else:
            mine = _median(ours, t.metric)
            if t.against == "floor":
                who, other = _best(case, t.metric, "floor")
            else:
                who, other = t.against, _median(case["subjects"].get(t.against), t.metric)
            if mine is None or not other:
                why = case["subjects"].get(t.against, {}).get("status", "not measured")
                row.update(status="not measured", detail=f"{t.against}: {why}")
            else:
                r = mine / other
                row.update(ratio=r, against=who, status="met" if r >= t.need else "missed",
                           detail=f"{r:.2f}x {who} (needs {t.need:g}x)" + (
                               "" if r >= t.need else f": {r / t.need:.0%} of the target, short by {t.need / r:.2f}x"))
        out.append(row)
    return out


# -- Markdown -------------------------------------------------------------------------------------------
def num(v: float | None) -> str:
    if v is None:
        return "—"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def ratio(v: float | None) -> str:
    return "—" if v is None else f"**{v:.2f}x**"


def ratio_table(results: dict[str, Any]) -> str:
    lines = ["| case | measure | shmbuffer | best peer | ours / best peer | baseline | ours / baseline | floor | ours / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results.get("ratios") or ratios(results):
        gb = r.get("ours_gb_per_s")
        ours = "—" if r["ours"] is None else f"{num(r['ours'])} {r['unit']}" + (
            f" ({gb:.2f} GB/s)" if gb is not None and r["unit"] != "GB/s" else "")

        lines.append(f"| {r['case']} | {r['label']} | {ours} | {_who(r, 'peer')} | {ratio(r['ours_per_peer'])} | "
                     f"{_who(r, 'baseline')} | {ratio(r['ours_per_baseline'])} | {_who(r, 'floor')} | "
                     f"{ratio(r['ours_per_floor'])} |")
    return "\n".join(lines)


def _who(r: dict[str, Any], kind: str) -> str:
    return f"{r[kind]}: {num(r[f'{kind}_value'])}" if r[kind] else "—"


def target_table(results: dict[str, Any]) -> str:
    lines = ["| target | result | detail |", "|---|---|---|"]
    for t in results.get("targets", []):
        mark = {"met": "met", "missed": "**missed**"}.get(t["status"], t["status"])
        lines.append(f"| {t['text']} | {mark} | {t['detail']} |")
    return "\n".join(lines)


def machine_line(m: dict[str, Any]) -> str:
    p = m["packages"]
    return (f"{m['date']}: {m['cpu']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
            f"{m['memory_gib']} GiB RAM, {m['os']}, Python {m['python']}, numpy {p['numpy']}, torch {p['torch']}, "
            f"cpprb {p['cpprb']}, torchrl {p['torchrl']}, stable-baselines3 {p['stable-baselines3']}; GPU: {m['gpu']}; "
            f"load average at start {m['load_average']}; shmbuffer {m.get('shmbuffer_commit')}, hot path {m.get('shmbuffer_path', 'python')}")


def details(name: str, case: dict[str, Any]) -> str:
    head = f"### {name}: {case.get('title', '')}\n"
    if case.get("measured"):
        w = case["measured"]
        head += (f"\nMeasured {w['date'][:16].replace('T', ' ')} UTC at commit `{w['commit']}`, {w['rounds']} round{'s' if w['rounds'] != 1 else ''}, "
                 f"{case.get('elapsed_s', '?')} s; load average {w['load_average_start'][0]} at the start, "
                 f"{w['load_average_end'][0]} at the end.\n")
    if case.get("status") != "ok":
        return head + f"\n{case.get('status')}: {case.get('reason', '')}\n"
    mp = "seconds" in case
    cols = "| subject | " + " | ".join(f"{m['label']} ({m['unit']}), median [min-max], GB/s" for m in case["metrics"].values())
    cols += " | torn / lost / corrupt |" if mp else " |"
    lines = [head, cols, "|---" * (len(case["metrics"]) + 1 + mp) + "|"]
    for sname, s in case["subjects"].items():
        cells: list[str] = []
        for metric in case["metrics"]:
            if s.get("status") != "ok":
                cells.append(f"{s.get('status')}: {s.get('reason', '')}" if not cells else "")
                continue
            m = s["metrics"].get(metric, {})
            if "median" not in m:
                cells.append(f"{m.get('status', 'n/a')}: {m.get('reason', '')}")
            else:
                cells.append(f"{num(m['median'])} [{num(m['min'])}-{num(m['max'])}], {m.get('gb_per_s', 0):.2f}")
        if mp:
            cells.append(f"{s.get('torn', '—')} of {s.get('sampled_rows', 0):,} / {s.get('lost', '—')} / "
                         f"{s.get('corrupt', '—')}" if s.get("status") == "ok" else "")
        lines.append(f"| {sname} | " + " | ".join(cells) + " |")
    notes = [f"- {sname}: {s['note']}" for sname, s in case["subjects"].items() if s.get("note")]
    if notes:
        lines += ["", "How each subject is used:", "", *notes]
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any], plots: list[str]) -> str:
    cfg = results["config"]
    parts = [
        "# shmbuffer benchmark results\n",
        f"Machine: {machine_line(results['machine'])}.\n",
        f"Settings: {'--quick, ' if cfg['quick'] else ''}{cfg['repeat']} interleaved rounds per case, timed blocks "
        f"of ~{cfg['block_s']} s, multi-process runs of {cfg['mp_seconds']} s; capacities: "
        + ", ".join(f"{k} {v:,}" for k, v in cfg["capacities"].items())
        + f". Medians of the rounds; every ratio compares numbers measured side by side in this run. "
        f"Total time {results.get('elapsed_s', 0):.0f} s.\n",
        *(["**--quick run: tiny capacities, one short round. These numbers only show that the harness works; "
            "do not read anything into them.**\n"] if cfg["quick"] else []),
        "## Ratios\n",
        "Best peer: the fastest library (cpprb, TorchRL, Stable-Baselines3); baseline: the plain numpy ring "
        "(one process) or `multiprocessing.Queue` into a numpy ring (several); for sequences a plain numpy "
        "window gather, for the loader shmbuffer's own `sample()` without prefetch; floor: the fastest numpy "
        "floor for the same bytes (`np.copyto` for pushes, `np.take` for samples); for the loader the training "
        "step alone. Ratios above 1 mean shmbuffer is faster.\n",
        ratio_table(results) + "\n",
        "## Targets\n",
        target_table(results) + "\n",
    ]
    if plots:
        parts += ["## Plots\n", *(f"![{Path(p).stem}]({Path(p).name})\n" for p in plots)]
    parts.append("## Details\n")
    for name, case in results["cases"].items():
        parts.append(details(name, case))
    if results.get("profiles"):
        parts.append("## Profiles of shmbuffer where a target is missed\n")
        for what, lines in results["profiles"].items():
            parts.append(f"`{what}`:\n\n```text\n" + "\n".join(lines) + "\n```\n")
    if results.get("left_in_dev_shm"):
        parts.append(f"Segments of ours left in /dev/shm and removed: {results['left_in_dev_shm']}\n")
    return "\n".join(parts)


def load_range(results: dict[str, Any]) -> str:
    """The 1-minute load average's lowest and highest at the starts and ends of the cases (at the
    run's start and end, for a file from before cases recorded theirs): ``"2.1-12.3"``."""
    seen = [c["measured"][k][0] for c in results["cases"].values() if c.get("measured")
            for k in ("load_average_start", "load_average_end")]
    seen = seen or [x for x in (results["machine"].get("load_average", [None])[0],
                                (results.get("load_average_end") or [None])[0]) if x is not None]
    lo, hi = min(seen, default=0), max(seen, default=0)
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f}"



# -- plots ----------------------------------------------------------------------------------------------
KIND_COLORS = {"peer": "#1f77b4", "baseline": "#9a9a9a", "floor": "#2ca02c"}
CAP = 6.0
"""Where the ratio axis ends: a linear axis on which 0.5x and 1.5x read apart; a longer bar ends at the
edge and says its value."""


def _kinds(r: dict[str, Any]) -> list[str]:
    """The comparisons a plot shows for a ratio row: the best peer and the floor; the baseline where
    there is no floor (or nothing else)."""
    shown = [k for k in ("peer", "floor") if r[f"ours_per_{k}"] is not None]
    return shown if "floor" in shown or r["ours_per_baseline"] is None else [*shown, "baseline"]


def ratio_plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Draw ``rows`` (``ratios()`` rows, each with a ``what`` label) to ``path``: per row one bar per
    comparison, shmbuffer's median over the other's on a linear axis with the line at 1x, each bar
    saying its value and whom it compares with. False (nothing drawn) without matplotlib or rows."""
    import textwrap

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if _kinds(r)]
    if not rows:
        return False
    n = sum(len(_kinds(r)) for r in rows)
    fig, ax = plt.subplots(figsize=(10, 0.3 * n + 0.45 * len(rows) + 1.3))
    y, labels, ticks = 0.0, [], []
    for r in rows:
        shown = _kinds(r)
        for k in shown:
            v = r[f"ours_per_{k}"]
            ax.barh(y, min(v, CAP), color=KIND_COLORS[k], height=0.8)
            # the label starts right of the 1x line, so a short bar's label never crosses it
            ax.text(max(min(v, CAP), 1.0) + 0.05, y, f"{v:.2f}x {r[k]}" if v < CAP else f"{v:.1f}x {r[k]} (bar cut)",
                    va="center", fontsize=7.5)
            y += 1
        ticks.append(y - (len(shown) + 1) / 2)
        labels.append(textwrap.fill(r["what"], 36))
        y += 0.6
    ax.axvline(1, color="black", linewidth=1.2)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, CAP * 1.7)
    ax.set_xticks(range(int(CAP) + 1), [f"{i}x" for i in range(int(CAP) + 1)])
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel("shmbuffer's median / theirs: right of the 1x line, shmbuffer is faster", fontsize=8)
    used = {k for r in rows for k in _kinds(r)}
    legend = {"peer": "vs the best peer", "baseline": "vs the baseline (where no floor)",
              "floor": "vs the floor (np.copyto / np.take)"}
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for k, c in KIND_COLORS.items() if k in used],
              [legend[k] for k in KIND_COLORS if k in used], fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


PLOTS = {"push": {"push"}, "sample": {"sample", "prioritized", "sequence", "loader"}, "multiproc": {"multiproc"},
         "frameworks": {"frameworks", "distributed"}}
"""Which groups of cases each plot (``<stem>-<name>.png``) shows."""


def plots(results: dict[str, Any], out: Path) -> tuple[list[str], str | None]:
    """The ratio plots of ``PLOTS`` next to ``out`` (``<stem>-push.png`` ...); ``(files, why none)``."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return [], "matplotlib is not installed: no plots"
    rows = results.get("ratios") or ratios(results)
    m = results["machine"]
    files = []
    for name, groups in PLOTS.items():
        mine = [{**r, "what": f"{r['case']}: {r['label']}"} for r in rows
                if results["cases"][r["case"]].get("group") in groups]
        path = out.with_name(f"{out.stem}-{name}.png")
        if ratio_plot(mine, path, f"{name} cases: {m['date'][:10]}, {m['usable_cores']} cores, load average "
                                  f"{load_range(results)}, commit {m.get('shmbuffer_commit')}"):
            files.append(str(path))
    return files, None
