"""What `python -m experiments.paper` makes of its run directories (experiments/paper.py):
the timelines, the deviation and throughput figures, and the tables of each experiment.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp.bench import harness as H


def _timelines(dirs: dict[str, Path], interval: int | None = None) -> dict[str, Any]:
    from recover_hsdp.record.timeline import load_timeline

    return {name: load_timeline(d, label=name, interval=interval) for name, d in dirs.items()}


def _report(out: Path, tls: Sequence[Any], bands: Sequence[str] = ()) -> None:
    """The standard `recover-hsdp report` plots/CSV/JSON for these runs into out/."""
    from recover_hsdp.tools import report

    args = [str(tl.run_dir) for tl in tls] + ["--label", *[tl.label for tl in tls],
                                              "--out", str(out)]
    if bands:
        args += ["--band", *bands]
    with contextlib.redirect_stdout(io.StringIO()):
        rc = report.main(args)
    if rc:
        raise RuntimeError(f"recover-hsdp report {' '.join(args)} exited {rc}")


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _losses(tl: Any) -> dict[int, float]:
    return {c.step: float(c.loss) for c in tl.commits if c.loss is not None}


def analyze_trajectory(args: argparse.Namespace, dirs: dict[str, Path], out: Path) -> dict:
    """Is the resilient curve inside the band of failure-free runs that differ in data order?"""
    tls = _timelines(dirs)
    _report(out / "trajectory", list(tls.values()), bands=["reference-"])
    refs = [n for n in tls if n.startswith("reference-")]
    steps = sorted(set.intersection(*(set(_losses(tls[n])) for n in tls)))
    window = args.window
    sm = {n: dict(zip(steps, _smooth([_losses(tls[n])[s] for s in steps], window))) for n in tls}
    lo = {s: min(sm[r][s] for r in refs) for s in steps}
    hi = {s: max(sm[r][s] for r in refs) for s in steps}
    mid = {s: statistics.fmean(sm[r][s] for r in refs) for s in steps}
    first_kill = min((k for k in tls["resilient"].kill_steps if k is not None), default=0)
    after = [s for s in steps if s >= first_kill + window]   # smoothing windows fully after it
    res: dict[str, Any] = {"steps": len(steps), "window": window, "references": refs,
                           "first_kill_step": first_kill,
                           "kill_steps": tls["resilient"].kill_steps,
                           "band_halfwidth_median": statistics.median((hi[s] - lo[s]) / 2
                                                                      for s in after),
                           "runs": {}}
    for n in tls:
        dev = [sm[n][s] - mid[s] for s in after]
        outside = [s for s in after if not (lo[s] <= sm[n][s] <= hi[s])]
        excess = [max(sm[n][s] - hi[s], lo[s] - sm[n][s], 0.0) for s in after]
        last = steps[-20:]
        res["runs"][n] = {
            "mode": tls[n].mode, "kills": len(tls[n].kills),
            "divisors": sorted({c.divisor for c in tls[n].commits if c.divisor is not None}),
            "inside_band_fraction": 1 - len(outside) / len(after),
            "max_excursion_outside_band": max(excess),
            "mean_dev_from_ref_mean": statistics.fmean(dev),
            "mean_abs_dev_from_ref_mean": statistics.fmean(abs(d) for d in dev),
            "final20_mean_loss": statistics.fmean(_losses(tls[n])[s] for s in last),
            "wall_s": tls[n].wall_s, "process_hours": tls[n].process_hours}
    _plot_deviation(out / "trajectory_deviation.png", tls, refs, steps, sm, lo, hi, mid, window)
    # Leave-one-out: a held-out reference seed against the band of the OTHER references is what
    # "statistically the same as another data order" looks like; score every run the same way.
    loo: dict[str, list[tuple[float, float]]] = {"reference (held out)": []}
    for held in refs:
        others = [r for r in refs if r != held]
        if len(others) < 2:
            break
        blo = {s: min(sm[r][s] for r in others) for s in after}
        bhi = {s: max(sm[r][s] for r in others) for s in after}
        bmid = {s: statistics.fmean(sm[r][s] for r in others) for s in after}
        for n in [held] + [x for x in tls if x not in refs]:
            key = "reference (held out)" if n == held else n
            inside = sum(blo[s] <= sm[n][s] <= bhi[s] for s in after) / len(after)
            mad = statistics.fmean(abs(sm[n][s] - bmid[s]) for s in after)
            loo.setdefault(key, []).append((inside, mad))
    res["leave_one_out"] = {k: {"inside_band_fraction": statistics.fmean(v[0] for v in vals),
                                "mean_abs_dev_from_band_mean": statistics.fmean(v[1] for v in vals)}
                            for k, vals in loo.items() if vals}
    return res


def _plot_deviation(path: Path, tls: dict, refs: list[str], steps: list[int], sm: dict,
                    lo: dict, hi: dict, mid: dict, window: int) -> None:
    with H.figure(path, figsize=(9, 4)) as (_, ax):
        ax.fill_between(steps, [lo[s] - mid[s] for s in steps], [hi[s] - mid[s] for s in steps],
                        color="tab:blue", alpha=0.25, label=f"failure-free band ({len(refs)} data orders)")
        colors = {"resilient": "tab:orange", "drop-and-go": "tab:green"}
        for n in tls:
            if n in refs:
                continue
            ax.plot(steps, [sm[n][s] - mid[s] for s in steps], color=colors.get(n), label=n)
        for k in tls.get("resilient", next(iter(tls.values()))).kill_steps:
            if k is not None:
                ax.axvline(k, color="red", lw=0.6, alpha=0.6)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("step (red: a replica killed mid-reduction)")
        ax.set_ylabel(f"loss - reference mean ({window}-step mean)")
        ax.set_title("Trajectory: deviation from the failure-free references")
        ax.legend(fontsize=8)


def analyze_throughput(args: argparse.Namespace, dirs: dict[str, Path], out: Path) -> dict:
    from recover_hsdp.record.timeline import (common_process_hours, effective_throughput_intervals,
                                              tokens_at_process_hours)

    control = None
    cpath = out / "paper_control.json"
    if cpath.exists():
        control = json.loads(cpath.read_text())
    res: dict[str, Any] = {"per_N": {}, "control_factor": control and control.get("factor")}
    all_tls = []
    for n in args.Ns:
        tls = _timelines({f"cr-N{n}": dirs[f"cr-N{n}"], f"resilient-N{n}": dirs[f"resilient-N{n}"]},
                         interval=n)
        cr, rs = tls[f"cr-N{n}"], tls[f"resilient-N{n}"]
        all_tls += [cr, rs]
        _report(out / f"throughput_N{n}", [rs, cr])
        ci, ri = effective_throughput_intervals(cr), effective_throughput_intervals(rs)
        rows = []
        for k in range(max(len(ci), len(ri))):
            c = ci[k] if k < len(ci) else None
            r = ri[k] if k < len(ri) else None
            row = {"interval": k,
                   "cr": c and c["effective_throughput"], "resilient": r and r["effective_throughput"],
                   "alive_processes": r and r["alive_processes"]}
            if c and r and c["effective_throughput"]:
                row["ratio"] = r["effective_throughput"] / c["effective_throughput"]
                f = (control or {}).get("factor", {}).get(str(r["alive_processes"]))
                row["ratio_net_of_contention"] = row["ratio"] / f if f else None
            rows.append(row)
        ph = common_process_hours([cr, rs])
        tok_cr, tok_rs = tokens_at_process_hours(cr, ph), tokens_at_process_hours(rs, ph)
        res["per_N"][str(n)] = {
            "intervals": rows,
            "ratio_after_last_failure": rows[-1].get("ratio"),
            "ratio_after_last_failure_net": rows[-1].get("ratio_net_of_contention"),
            "common_process_hours": ph, "tokens_cr": tok_cr, "tokens_resilient": tok_rs,
            "tokens_gain": (tok_rs / tok_cr - 1) if tok_cr else None,
            "breakdown_cr": cr.breakdown[0] if cr.breakdown else None,
            "breakdown_resilient": rs.breakdown[0] if rs.breakdown else None,
            "wall_s": {"cr": cr.wall_s, "resilient": rs.wall_s},
            "restarts": len(cr.attempts) - 1 if cr.attempts else None}
    extra = [k for k in dirs if k.startswith("cr-async-")]
    for name in extra:
        n = int(name.rsplit("N", 1)[1])
        tl = _timelines({name: dirs[name]}, interval=n)[name]
        all_tls.append(tl)
        res[name] = {"breakdown": tl.breakdown[0] if tl.breakdown else None,
                     "intervals": [i["effective_throughput"]
                                   for i in effective_throughput_intervals(tl)],
                     "wall_s": tl.wall_s}
    _report(out / "throughput_all", all_tls)
    _plot_vs_n(res, args.Ns, out)
    return res


def _plot_vs_n(res: dict, Ns: Sequence[int], out: Path) -> None:
    comps = ("save", "normal", "failure_handling", "restart_init", "load", "rerun", "recovery")
    with H.figure(out / "paper_vs_N.png", 1, 2, figsize=(12, 4.2)) as (_, axes):
        ax = axes[0]
        xs = list(range(len(Ns)))
        for j, who in enumerate(("cr", "resilient")):
            bottom = [0.0] * len(Ns)
            for ci, comp in enumerate(comps):
                vals = [((res["per_N"][str(n)].get(f"breakdown_{who}") or {}).get(comp) or 0.0)
                        for n in Ns]
                if not any(vals):
                    continue
                ax.bar([x + (j - 0.5) * 0.38 for x in xs], vals, 0.36, bottom=bottom,
                       color=f"C{ci}", label=comp if j == 0 or who == "resilient" and
                       comp == "recovery" else None, edgecolor="black" if who == "resilient" else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(xs, [f"N={n}\nCR | ReCoVer" for n in Ns])
        ax.set_ylabel("seconds")
        ax.set_title("single failure at step 1.5N: wall-clock breakdown")
        ax.legend(fontsize=8)
        ax = axes[1]
        for n in Ns:
            rows = res["per_N"][str(n)]["intervals"]
            ax.plot([r["interval"] for r in rows if r.get("ratio")],
                    [r["ratio"] for r in rows if r.get("ratio")], marker="o", label=f"N={n}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("interval between consecutive failures (0 = before the first)")
        ax.set_ylabel("effective throughput ReCoVer / checkpoint-restart")
        ax.set_title("effective throughput ratio across successive failures")
        ax.legend(fontsize=8)


def analyze_control(args: argparse.Namespace, dirs: dict[str, Path], out: Path) -> dict:
    """Per-process throughput of failure-free runs at W = 4..1: contention factor vs W = 4."""
    tls = _timelines(dirs)
    per = {}
    for name, tl in tls.items():
        w = int(name.rsplit("W", 1)[1])
        cs = tl.commits[2:]   # skip 2 warm-up steps
        dt = cs[-1].time - tl.commits[1].time
        per[w] = sum(c.tokens for c in cs) / dt / (w * tl.processes_per_replica)
    base = per[max(per)]
    return {"per_process_tokens_per_s": {str(w): v for w, v in sorted(per.items())},
            "factor": {str(w * 1): per[w] / base for w in sorted(per)}}


ANALYZERS = {"trajectory": analyze_trajectory, "throughput": analyze_throughput,
             "control": analyze_control}


def _na(x: float | None, nd: int = 2) -> str:
    return H.fmt(x, nd, none="n/a")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def format_trajectory(r: dict) -> str:
    lines = [f"trajectory: {r['steps']} steps, kills at {r['kill_steps']}, loss smoothed over "
             f"{r['window']} steps; band = min..max of {', '.join(r['references'])} "
             f"(median half-width {r['band_halfwidth_median']:.4f})",
             f"  {'run':18s} {'inside band':>11s} {'max out':>8s} {'mean dev':>9s} "
             f"{'mean|dev|':>9s} {'final20':>8s} {'divisors':>14s} {'wall s':>7s}"]
    for n, v in r["runs"].items():
        lines.append(f"  {n:18s} {100 * v['inside_band_fraction']:10.1f}% "
                     f"{v['max_excursion_outside_band']:8.4f} {v['mean_dev_from_ref_mean']:+9.4f} "
                     f"{v['mean_abs_dev_from_ref_mean']:9.4f} {v['final20_mean_loss']:8.4f} "
                     f"{str(v['divisors']):>14s} {v['wall_s']:7.1f}")
    lines.append("  leave-one-out (band of the other references; averaged over which one is held out):")
    for n, v in r.get("leave_one_out", {}).items():
        lines.append(f"    {n:22s} inside {100 * v['inside_band_fraction']:5.1f}%   mean|dev| "
                     f"{v['mean_abs_dev_from_band_mean']:.4f}")
    return "\n".join(lines)


def format_throughput(r: dict) -> str:
    lines = ["throughput: effective throughput (tokens / s / allocated process) per interval "
             "between kills; ratio = ReCoVer / checkpoint-restart"]
    for n, v in r["per_N"].items():
        iv = "  ".join(f"[{x['interval']}] {_na(x['resilient'], 0)}/{_na(x['cr'], 0)}="
                       f"{_na(x.get('ratio'))}" for x in v["intervals"])
        b_cr, b_rs = v["breakdown_cr"] or {}, v["breakdown_resilient"] or {}
        lines.append(f"  N={n:>2s}: {iv}")
        net = v["ratio_after_last_failure_net"]
        lines.append(f"        after last failure {_na(v['ratio_after_last_failure'])}x "
                     f"(net of contention {'n/a: no control run' if net is None else f'{net:.2f}x'});"
                     f" tokens at "
                     f"{v['common_process_hours'] * 3600:.0f} process-s: {v['tokens_resilient']} vs "
                     f"{v['tokens_cr']} ({_pct(v['tokens_gain'])}); first failure: CR "
                     f"{_na(b_cr.get('total'))} s vs ReCoVer {_na(b_rs.get('total'))} s")
    return "\n".join(lines)


def format_control(r: dict) -> str:
    return ("control (failure-free, per-process tokens/s by alive processes): "
            + ", ".join(f"W={w}: {v:.0f} (x{r['factor'][w]:.2f})"
                        for w, v in r["per_process_tokens_per_s"].items()))


FORMATTERS = {"trajectory": format_trajectory, "throughput": format_throughput,
              "control": format_control}
