"""`recover-hsdp report RUN_DIR...`: plots, CSVs, report.json and a text table (docs/report.md).

    recover-hsdp report runs/resilient runs/cr8 [--out DIR] [--label NAME ...] [--interval N]
                        [--band PREFIX ...] [--format png|svg|pdf]

Writes into --out (default ./report): loss.{png,csv}, throughput.{png,csv},
tokens_vs_process_hours.{png,csv}, breakdown.{png,csv}, report.json. User errors (a missing or
non-run directory, bad flags) are one line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from recover_hsdp.record.io import RecordError
from recover_hsdp.record.timeline import (
    BREAKDOWN_KEYS,
    Timeline,
    common_process_hours,
    effective_throughput_intervals,
    load_timeline,
    tokens_at_process_hours,
    tokens_vs_process_hours,
)
from recover_hsdp.tools._args import OneLineParser as _Parser
from recover_hsdp.tools._args import UsageError as _UsageError

PROG = "recover-hsdp report"
EXIT_USAGE = 2
FILES = ("loss", "throughput", "tokens_vs_process_hours", "breakdown")
COLORS = {"save": "#8c564b", "normal": "#7f7f7f", "failure_handling": "#d62728",
          "restart_init": "#ff7f0e", "load": "#9467bd", "rerun": "#e377c2", "recovery": "#2ca02c"}


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Plots and tables from run directories of any kind.")
    p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    p.add_argument("--out", default="report", help="output directory (default: ./report)")
    p.add_argument("--label", action="extend", nargs="+", default=[], metavar="NAME",
                   help="one label per RUN_DIR, in order (default: the directory name)")
    p.add_argument("--interval", type=int, default=None, metavar="N",
                   help="checkpoint interval N for resilient runs' breakdown (default: their "
                        "meta ckpt_interval, else the checkpoint-restart runs' N if they share one)")
    p.add_argument("--band", action="append", default=[], metavar="PREFIX",
                   help="loss plot: runs whose label starts with PREFIX become one min/max band")
    p.add_argument("--format", default="png", choices=("png", "svg", "pdf"))
    return p


# -- numbers ----------------------------------------------------------------------------------

def build_report(timelines: list[Timeline]) -> dict:
    """Every number the plots show, as one JSON-able dict (report.json)."""
    cph = common_process_hours(timelines)
    at = {tl.label: tokens_at_process_hours(tl, cph) for tl in timelines}
    first = timelines[0].label if timelines else None
    runs = []
    for tl in timelines:
        d = tl.to_json()
        d.pop("attempts", None)
        d["kills"] = len(tl.kills)
        d["kill_times_s"] = [k - tl.t0 for k in tl.kills]
        d["intervals"] = effective_throughput_intervals(tl)
        d["tokens_at_common_process_hours"] = at[tl.label]
        d["loss"] = [[c.step, c.loss] for c in tl.commits]
        d["tokens_vs_process_hours"] = tokens_vs_process_hours(tl)
        d["joins"] = _joins(tl)
        runs.append(d)
    ratios = {k: (v / at[first] if at[first] else None) for k, v in at.items()}
    return {"runs": runs, "common_process_hours": cph, "tokens_at_common_process_hours": at,
            "ratio_to_first": ratios, "first": first}


# -- CSVs -------------------------------------------------------------------------------------

def _write_csv(path: Path, header: Sequence[str], rows: list[Sequence]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def _csvs(out: Path, timelines: list[Timeline], rep: dict) -> None:
    _write_csv(out / "loss.csv", ["label", "mode", "step", "loss", "time_s", "tokens_cum"],
               [[tl.label, tl.mode, c.step, c.loss, round(c.time - tl.t0, 6), cum]
                for tl in timelines
                for c, cum in zip(tl.commits, _cumsum(c.tokens for c in tl.commits))])
    keys = ["interval", "start_s", "end_s", "duration_s", "new_tokens", "steps", "first_step",
            "last_step", "alive_processes", "mean_processes", "process_hours",
            "effective_throughput"]
    _write_csv(out / "throughput.csv", ["label", "mode", *keys],
               [[r["label"], r["mode"], *[iv[k] for k in keys]]
                for r in rep["runs"] for iv in r["intervals"]])
    _write_csv(out / "tokens_vs_process_hours.csv", ["label", "mode", "process_hours", "tokens"],
               [[r["label"], r["mode"], ph, tok] for r in rep["runs"]
                for ph, tok in r["tokens_vs_process_hours"]])
    bkeys = ["failure", "kill_step", "ckpt_interval", *BREAKDOWN_KEYS, "total",
             *"ABCDEFGH"]
    _write_csv(out / "breakdown.csv", ["label", "mode", *bkeys],
               [[r["label"], r["mode"], *[b.get(k) for k in bkeys]]
                for r in rep["runs"] for b in r["breakdown"]])


def _cumsum(values) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


# -- plots ------------------------------------------------------------------------------------

def _resume_steps(tl: Timeline) -> list[int]:
    """Steps at which later segments of a resumed run started (segments.jsonl)."""
    from recover_hsdp.record.checkpoint import read_segments

    try:
        segs = read_segments(tl.run_dir)
    except Exception:  # noqa: BLE001 - a marker is decoration; never fail the report on it
        return []
    return [int(g["resume_step"]) for g in segs
            if g.get("event") == "start" and g.get("resume_step") is not None]


def _joins(tl: Timeline) -> list[dict]:
    """Standby joins of a run (the step records' extra.joins), step = the first step
    that ran after the join attempt."""
    from recover_hsdp.record import read_run

    try:
        steps = read_run(tl.run_dir).steps
    except Exception:  # noqa: BLE001 - a marker is decoration; never fail the report on it
        return []
    return [{"step": s, **j} for s, r in steps.items()
            for j in ((r.extra or {}).get("joins") or ())]


def _plots(out: Path, timelines: list[Timeline], rep: dict, bands: list[str], fmt: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.{fmt}", dpi=120)
        plt.close(fig)

    # (a) loss vs step
    fig, ax = plt.subplots(figsize=(7, 4))
    banded = set()
    for prefix in bands:
        group = [tl for tl in timelines if tl.label.startswith(prefix)]
        if not group:
            continue
        banded.update(tl.label for tl in group)
        by_step: dict[int, list[float]] = {}
        for tl in group:
            for c in tl.commits:
                if c.loss is not None:
                    by_step.setdefault(c.step, []).append(c.loss)
        steps = sorted(by_step)
        lo = [min(by_step[s]) for s in steps]
        hi = [max(by_step[s]) for s in steps]
        mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        line, = ax.plot(steps, mean, lw=1, label=f"{prefix}* (mean of {len(group)}, min-max band)")
        ax.fill_between(steps, lo, hi, alpha=0.25, color=line.get_color(), lw=0)
    for tl in timelines:
        if tl.label in banded:
            continue
        pts = [(c.step, c.loss) for c in tl.commits if c.loss is not None]
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, label=f"{tl.label} ({tl.mode})")
        for ks in tl.kill_steps:
            if ks is not None:
                ax.axvline(ks, color="red", lw=0.5, alpha=0.3)
        for rs in _resume_steps(tl):          # segments of a resumed run
            ax.axvline(rs, color="black", ls=":", lw=1.0, alpha=0.7)
        for j in _joins(tl):                  # a standby joined before this step
            if j.get("outcome") == "joined":
                ax.axvline(j["step"], color="green", ls="--", lw=1.0, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss vs step (red: kills; black dotted: resumes; green dashed: joins)")
    ax.legend(fontsize=8)
    save(fig, "loss")

    # (b) effective throughput per failure interval
    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(rep["runs"])
    width = 0.8 / max(n, 1)
    for j, r in enumerate(rep["runs"]):
        xs = [iv["interval"] + (j - (n - 1) / 2) * width for iv in r["intervals"]]
        ax.bar(xs, [iv["effective_throughput"] for iv in r["intervals"]], width=width,
               label=f"{r['label']} ({r['mode']})")
    ax.set_xlabel("failure interval (0 = before the first kill)")
    ax.set_ylabel("effective throughput (tokens / s / process)")
    ax.set_title("Effective throughput across successive failures")
    ax.legend(fontsize=8)
    save(fig, "throughput")

    # (c) cumulative tokens vs process-hours
    fig, ax = plt.subplots(figsize=(7, 4))
    cph = rep["common_process_hours"]
    for r in rep["runs"]:
        pts = r["tokens_vs_process_hours"]
        ax.step([p for p, _ in pts], [t for _, t in pts], where="post",
                label=f"{r['label']} ({r['mode']})")
        tok = r["tokens_at_common_process_hours"]
        ax.plot([cph], [tok], "o", ms=4, color="black")
        ax.annotate(f"{tok:,}", (cph, tok), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(cph, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("process-hours")
    ax.set_ylabel("tokens committed")
    ax.set_title(f"Cumulative tokens vs process-hours (dashed: {cph:.4g} h, reached by all)")
    ax.legend(fontsize=8)
    save(fig, "tokens_vs_process_hours")

    # (d) single-failure wall-clock breakdown, grouped by checkpoint interval N
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = _breakdown_bars(rep)
    if not bars:
        ax.text(0.5, 0.5, "no failure with a complete breakdown", ha="center", va="center",
                transform=ax.transAxes)
    ticks, names = [], []
    shown = set()
    for x, (nval, r, b) in enumerate(bars):
        bottom = 0.0
        for k in BREAKDOWN_KEYS:
            v = b.get(k) or 0.0
            if v:
                ax.bar(x, v, bottom=bottom, color=COLORS[k], width=0.6,
                       label=k if k not in shown else None)
                shown.add(k)
            bottom += v
        ticks.append(x)
        names.append(f"{r['label']}\nN={nval if nval is not None else '?'}")
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title("Single-failure wall-clock breakdown (first kill of each run)")
    if shown:
        ax.legend(fontsize=8)
    save(fig, "breakdown")


def _breakdown_bars(rep: dict) -> list[tuple]:
    """(N, run, first breakdown) sorted by N then run order; runs without a failure left out."""
    bars = []
    for i, r in enumerate(rep["runs"]):
        if r["breakdown"]:
            n = r["breakdown"][0].get("ckpt_interval")
            bars.append((n if n is not None else math.inf, i, (n, r, r["breakdown"][0])))
    return [b for _, _, b in sorted(bars, key=lambda t: (t[0], t[1]))]


# -- text -------------------------------------------------------------------------------------

def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    return f"{x:,.{nd}f}" if isinstance(x, float) else f"{x:,}"


def text_table(rep: dict) -> str:
    rows = [("label", "mode", "steps", "kills", "wall_s", "tokens", "proc_h",
             "eff. throughput per interval (tok/s/proc)", "tokens@common")]
    for r in rep["runs"]:
        eff = " ".join(f"{iv['effective_throughput']:.1f}" for iv in r["intervals"])
        rows.append((r["label"], r["mode"], str(r["steps"]), str(r["kills"]),
                     _fmt(r["wall_s"]), _fmt(r["tokens"]), f"{r['process_hours']:.4g}", eff,
                     _fmt(r["tokens_at_common_process_hours"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    cph = rep["common_process_hours"]
    first = rep["first"]
    lines.append(f"common process-hours (largest reached by all runs): {cph:.6g}")
    for label, ratio in rep["ratio_to_first"].items():
        if label != first:
            lines.append(f"  {label}: {_fmt(rep['tokens_at_common_process_hours'][label])} "
                         f"tokens = {ratio:.3f}x {first}" if ratio is not None else
                         f"  {label}: {first} has no tokens at that point")
    for r in rep["runs"]:
        for j in r.get("joins") or ():
            lines.append(f"join {r['label']}: before step {j['step']}, slot {j.get('replica')} <- "
                         f"standby {j.get('standby')} ({j.get('outcome')})")
    for r in rep["runs"]:
        for b in r["breakdown"][:1]:
            parts = ", ".join(f"{k} {b[k]:.2f}" for k in BREAKDOWN_KEYS if b.get(k))
            lines.append(f"breakdown {r['label']} (kill step {b.get('kill_step')}, N="
                         f"{b.get('ckpt_interval')}): {parts or '-'}; total {_fmt(b.get('total'), 2)} s")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------

def _default_interval(timelines: list[Timeline], given: int | None) -> int | None:
    if given is not None:
        return given
    ns = {tl.ckpt_interval for tl in timelines if tl.mode == "checkpoint_restart"}
    ns.discard(None)
    return ns.pop() if len(ns) == 1 else None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if not args.run_dirs:
            raise _UsageError("no run directories given (usage: recover-hsdp report RUN_DIR...)")
        if args.label and len(args.label) != len(args.run_dirs):
            raise _UsageError(f"{len(args.label)} --label for {len(args.run_dirs)} run "
                              f"directories (give one per RUN_DIR, in order)")
        if args.interval is not None and args.interval < 1:
            raise _UsageError("--interval must be >= 1")
        labels = args.label or [None] * len(args.run_dirs)
        timelines = [load_timeline(d, label=lab) for d, lab in zip(args.run_dirs, labels)]
        seen = set()
        for tl in timelines:
            if tl.label in seen:
                raise _UsageError(f"two runs labelled {tl.label!r}; use --label")
            seen.add(tl.label)
        # N for the runs that do not checkpoint: --interval wins over their meta; otherwise the
        # checkpoint-restart runs' N (if they share one) fills in where their meta has none
        n = _default_interval(timelines, args.interval)
        if n is not None:
            timelines = [load_timeline(tl.run_dir, label=tl.label, interval=n)
                         if tl.mode != "checkpoint_restart" and tl.ckpt_interval != n and (
                             args.interval is not None or tl.ckpt_interval is None)
                         else tl for tl in timelines]
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise _UsageError(f"--out {out}: exists and is not a directory")
    except (_UsageError, RecordError) as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyError, TypeError, ValueError) as e:   # a malformed record: still one line
        print(f"{PROG}: error: malformed run record: {type(e).__name__}: "
              f"{' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    try:
        out.mkdir(parents=True, exist_ok=True)
        rep = build_report(timelines)
        _csvs(out, timelines, rep)
        _plots(out, timelines, rep, args.band, args.format)
        (out / "report.json").write_text(json.dumps(rep, indent=1, sort_keys=True,
                                                    allow_nan=False) + "\n")
    except OSError as e:
        print(f"{PROG}: error: {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    print(text_table(rep))
    print(f"wrote {', '.join(f'{f}.{args.format}' for f in FILES)}, "
          f"{', '.join(f'{f}.csv' for f in FILES)}, report.json to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
