"""Calibrate the cost model from MEASURED runs, and check it on runs it was not fitted to.

Inputs (`--calibrate PATH...`): run directories of any kind (read by
recover_hsdp.record.timeline.load_timeline) or `recover-hsdp report` output folders
(report.json + loss.csv, e.g. docs/results/throughput_N8). What is fitted:

* per-microbatch time by alive processes (this box shares 2 cores: a dead rank speeds its peers
  up, so the fit is per alive count): the median step duration of a resilient run between kills,
  divided by P = microbatches per survivor, which the policy gives (algorithm 7 for the alive
  count); t_sync is folded into it (0);
* repair: the first kill's recovery (kill -> commit of that step) minus the extension the policy
  orders (G_ext x per-microbatch time); detect = 0 (a SIGKILL is seen at once here);
* checkpoint-restart: medians of the measured breakdowns: failure_handling -> cr_detect,
  restart_init -> restart, load, save; and the plain run's step time relative to ours.
"""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from recover_hsdp.policy.counts import CountModel
from recover_hsdp.policy.election import roles_for_layout
from recover_hsdp.policy.layout import advance_layout
from recover_hsdp.record.io import RecordError
from recover_hsdp.record.timeline import (Commit, Timeline, effective_throughput_intervals,
                                          load_timeline)
from recover_hsdp.sim.costs import CostModel, Scenario
from recover_hsdp.sim.engine import SimResult, run_cr, run_inplace
from recover_hsdp.sim.failures import Failure, TraceFailures


class CalibrationError(ValueError):
    """A path that is neither a run directory nor a report folder: one line, exit 2."""


@dataclass
class MeasuredRun:
    label: str
    mode: str
    w_init: int
    processes_per_replica: int
    tokens_per_step: int
    times: dict[int, float]              # step -> commit time (s since t0)
    kill_steps: list[int]
    breakdown: list[dict] = field(default_factory=list)
    ckpt_interval: int | None = None
    source: str = ""
    g_init: int | None = None            # from meta.json when known, else from the tokens


def load_measured(path: str | Path) -> list[MeasuredRun]:
    p = Path(path)
    if (p / "report.json").is_file():
        return _from_report(p)
    try:
        tl = load_timeline(p)
    except RecordError as e:
        raise CalibrationError(f"{path}: not a run directory or report folder ({e})") from None
    if not tl.commits:
        raise CalibrationError(f"{path}: no committed step")
    return [MeasuredRun(tl.label, tl.mode, tl.w_init, tl.processes_per_replica,
                        tl.commits[0].tokens, {c.step: c.time - tl.t0 for c in tl.commits},
                        [s for s in tl.kill_steps if s is not None], tl.breakdown,
                        tl.ckpt_interval, str(p), tl.meta.get("g_init"))]


def _from_report(p: Path) -> list[MeasuredRun]:
    try:
        rep = json.loads((p / "report.json").read_text())
        times: dict[str, dict[int, float]] = {}
        with open(p / "loss.csv", newline="") as fh:
            for row in csv.DictReader(fh):
                times.setdefault(row["label"], {})[int(row["step"])] = float(row["time_s"])
        out = []
        for r in rep["runs"]:
            out.append(MeasuredRun(r["label"], r["mode"], int(r["w_init"]),
                                   int(r.get("processes_per_replica") or 1),
                                   int(r["tokens"]) // max(int(r["steps"]), 1),
                                   times.get(r["label"], {}),
                                   [s for s in r.get("kill_steps") or [] if s is not None],
                                   r.get("breakdown") or [], r.get("ckpt_interval"), str(p)))
        return out
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CalibrationError(f"{p}: unreadable report folder ({e})") from None


def _p_of(alive: int, w: int, g: int) -> int:
    """Microbatches per survivor with `alive` of `w` replicas left (algorithm 7), no spares."""
    return g if alive >= w else advance_layout(alive, w * g, g).g


def calibrate(paths: list[str], tokens_per_mb: int, cost: CostModel | None = None
              ) -> tuple[CostModel, list[str]]:
    cost = cost or CostModel()
    runs = [r for p in paths for r in load_measured(p)]
    names = ", ".join(sorted({r.label for r in runs}))
    per_alive: dict[int, list[float]] = {}
    repairs, cr_mb, ours_mb = [], [], []
    cr = {"failure_handling": [], "restart_init": [], "load": [], "save": []}
    for r in runs:
        g = int(r.g_init or r.tokens_per_step // tokens_per_mb // r.w_init)
        if g < 1:
            raise CalibrationError(f"{r.source}: {r.label}: {r.tokens_per_step} tokens per step "
                                   f"< one {tokens_per_mb}-token microbatch per replica")
        kills = sorted(r.kill_steps)
        steps = sorted(r.times)
        durs = {s: r.times[s] - r.times[s - 1] for s in steps if s - 1 in r.times}
        if r.mode == "checkpoint_restart":
            first = kills[0] if kills else max(steps, default=0) + 1
            cr_mb += [d / g for s, d in durs.items() if s < first]
            for b in r.breakdown[:1]:
                for k in cr:
                    if b.get(k) is not None:
                        cr[k].append(float(b[k]))
            continue
        if r.mode != "resilient":
            continue
        for s, d in durs.items():
            if s in kills:
                continue
            alive = r.w_init - sum(1 for k in kills if k < s)
            if alive < 1:
                continue
            per_alive.setdefault(alive * r.processes_per_replica, []).append(
                d / _p_of(alive, r.w_init, g))
            if alive == r.w_init:
                ours_mb.append(d / g)
        if kills and r.breakdown and r.breakdown[0].get("recovery") is not None:
            m = CountModel(r.w_init, g)
            out = m.fail_roles(["major"])
            repairs.append((r, float(r.breakdown[0]["recovery"]), out.g_ext,
                            (r.w_init - 1) * r.processes_per_replica))
    notes = [f"calibrated on {len(runs)} measured run(s): {names}"]
    if per_alive:
        t = {a: statistics.median(v) for a, v in sorted(per_alive.items())}
        cost.t_mb_by_alive = t
        cost.set("t_sync", 0.0, "calibration: folded into the per-microbatch time")
        cost.sources["t_mb"] = ("calibration: median step / P by alive processes: " +
                                ", ".join(f"{a}: {v:.4f} s" for a, v in t.items()))
    if repairs:
        vals = [rec - ge * cost.mb_time(ap) for _, rec, ge, ap in repairs]
        cost.set("repair", max(0.0, statistics.median(vals)),
                 f"calibration: recovery - G_ext x t_mb over {len(vals)} first kill(s)")
        cost.set("detect", 0.0, "calibration: a SIGKILL is seen at once on one machine")
    for key, name in (("failure_handling", "cr_detect"), ("restart_init", "restart"),
                      ("load", "load"), ("save", "save")):
        if cr[key]:
            cost.set(name, statistics.median(cr[key]),
                     f"calibration: median {key} of {len(cr[key])} checkpoint-restart kill(s)")
    if cr_mb and ours_mb:
        cost.cr_step_factor = statistics.median(cr_mb) / statistics.median(ours_mb)
        cost.sources["cr_step_factor"] = "calibration: plain step / ours at the full world"
    return cost, notes


# ---- validation: the throughput experiment of docs/results.md, section 2 -------------------
def throughput_kills(n: int, w: int, g: int) -> list[Failure]:
    """Kills at steps 1.5N, 2.5N, ... of replicas W-1, W-2, ... (experiments/paper.py), as the role that
    replica holds under the policy (roles_for_layout after each algorithm 7)."""
    model, out = CountModel(w, g), []
    for i in range(w - 1):
        alive = tuple(range(w - i))
        role = roles_for_layout(alive, model.layout)[alive[-1]]
        model.fail_roles([role])
        model.commit()
        out.append(Failure(0.0, "gpu", 1, role.name.lower(), int(1.5 * n) + i * n))
    return out


def _timeline(res: SimResult, steps: int, w: int, ppr: int) -> Timeline:
    commits = [Commit(s, t, None, tok, procs, None) for s, t, tok, procs in res.commits
               if s < steps]
    end = commits[-1].time
    tl = Timeline(res.label, res.mode, Path("sim"), 0.0, end, commits,
                  [k for k in res.kills if k <= end], [], w, ppr)
    pts = [(t, p) for t, p in res.proc_changes if t <= end]
    if res.mode == "checkpoint_restart":
        pts = [(0.0, w * ppr)]
    tl._proc_times = [t for t, _ in pts]
    tl._proc_values = [p for _, p in pts]
    return tl


def predict_throughput(cost: CostModel, n: int, w: int = 4, g: int = 8,
                       tokens_per_mb: int = 512) -> list[dict]:
    """Simulated effective throughput per interval (ours and checkpoint-restart) for interval N."""
    steps = int(4.5 * n)
    scn = Scenario(gpus=w, gpus_per_replica=1, grad_accum=g, tokens_per_mb=tokens_per_mb,
                   days=3600.0 / 86400, restart_below=0.0)
    ours = run_inplace(scn, cost, failures=TraceFailures(throughput_kills(n, w, g)), record=True)
    base = run_cr(scn, cost, n, failures=TraceFailures(throughput_kills(n, w, g)), record=True)
    a = effective_throughput_intervals(_timeline(ours, steps, w, 1))
    b = effective_throughput_intervals(_timeline(base, steps, w, 1))
    return [{"interval": x["interval"], "resilient": x["effective_throughput"],
             "cr": y["effective_throughput"],
             "ratio": x["effective_throughput"] / y["effective_throughput"]}
            for x, y in zip(a, b)]


def validate_throughput(cost: CostModel, measured: list[str], ns: list[int],
                        exclude: frozenset = frozenset()) -> dict:
    """Predicted vs measured ReCoVer / checkpoint-restart throughput ratio per interval.
    `exclude`: (N, file name) pairs not to compare with (the runs calibrated on)."""
    rows = []
    for n in ns:
        pred = predict_throughput(cost, n)
        for path in measured:
            if (n, Path(path).name) in exclude:
                continue
            try:
                meas = json.loads(Path(path).read_text())["per_N"][str(n)]["intervals"]
            except (OSError, KeyError, ValueError) as e:
                raise CalibrationError(f"{path}: no measured intervals for N={n} ({e})") from None
            for p, m in zip(pred, meas):
                rows.append({"N": n, "interval": p["interval"], "source": Path(path).name,
                             "measured": m["ratio"], "predicted": p["ratio"],
                             "error": p["ratio"] / m["ratio"] - 1.0})
    errs = [abs(r["error"]) for r in rows]
    pooled: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        pooled.setdefault((r["N"], r["interval"]), []).append(r)
    vs_mean = [{"N": n, "interval": i, "measured": statistics.mean(x["measured"] for x in rs),
                "predicted": rs[0]["predicted"]} for (n, i), rs in pooled.items()]
    for r in vs_mean:
        r["error"] = r["predicted"] / r["measured"] - 1.0
    return {"rows": rows, "max_abs_error": max(errs, default=0.0),
            "mean_abs_error": statistics.mean(errs) if errs else 0.0,
            "vs_mean_of_sweeps": vs_mean,
            "vs_mean_max_abs_error": max((abs(r["error"]) for r in vs_mean), default=0.0)}
