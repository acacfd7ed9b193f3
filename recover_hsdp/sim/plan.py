"""What the simulator answers: the modes side by side, the spare count to plan, sweeps over scale
and MTBF. Every mode of one comparison sees the same seed (common random numbers)."""
from __future__ import annotations

import dataclasses
import time

from recover_hsdp.sim.costs import CostModel, Scenario, daly_ettr, daly_interval, stall_ettr
from recover_hsdp.sim.engine import SimResult, run_cr, run_inplace, run_stall

SPARE_FRACTIONS = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08)   # of W_train
THRESHOLDS = (0.9, 0.95, 0.98)                           # restart_below candidates


def step_time(scn: Scenario, cost: CostModel) -> float:
    return scn.grad_accum * cost.mb_time(scn.replicas * scn.gpus_per_replica) + cost.t_sync


def daly_steps(scn: Scenario, cost: CostModel) -> int:
    """Young/Daly's optimal checkpoint interval, in whole steps (>= 1)."""
    base = dataclasses.replace(scn, spares=0)
    tau = daly_interval(cost.save, base.job_mtbf_s)
    return max(1, round(tau / (step_time(scn, cost) * cost.cr_step_factor)))


def cr_closed_form(scn: Scenario, cost: CostModel, steps: int) -> float:
    base = dataclasses.replace(scn, spares=0)
    dt = step_time(scn, cost) * cost.cr_step_factor
    return daly_ettr(steps * dt, cost.save, cost.cr_detect + cost.restart + cost.load,
                     base.job_mtbf_s)


def plan_spares(scn: Scenario, cost: CostModel, spares: list[int] | None = None,
                thresholds: list[float] | None = None, failures_factory=None) -> dict:
    """Sweep spare replicas x scale-back-up threshold for recover_hsdp; the plan maximises
    tokens per GPU-hour (spares compute without contributing: they cost GPUs, not ETTR)."""
    w = scn.replicas
    ks = spares if spares is not None else sorted({round(f * w) for f in SPARE_FRACTIONS})
    ths = thresholds if thresholds is not None else list(THRESHOLDS)
    rows = []
    for th in ths:
        for k in ks:
            s = dataclasses.replace(scn, spares=k, restart_below=th)
            r = run_inplace(s, cost, failures=failures_factory() if failures_factory else None)
            rows.append({"spares": k, "restart_below": th, "ettr": r.ettr,
                         "tokens_per_gpu_hour": r.tokens_per_gpu_hour, "restarts": r.restarts,
                         "boundaries": r.boundaries})
    best = max(rows, key=lambda r: (r["tokens_per_gpu_hour"], r["ettr"]))
    return {"best": best, "rows": rows}


def compare(scn: Scenario, cost: CostModel, *, ckpt_steps: int | None = None,
            stalls: list[tuple[str, float]] = (), rejoin: bool = True,
            failures_factory=None) -> list[SimResult]:
    """recover_hsdp (scn.spares, scn.restart_below), with rejoin, checkpoint-restart at the
    Young/Daly interval (and at `ckpt_steps`), drop-and-go, and any stall-model lines."""
    ff = failures_factory or (lambda: None)
    out = [run_inplace(scn, cost, failures=ff())]
    if rejoin:
        out.append(run_inplace(scn, cost, rejoin=True, failures=ff()))
    base = dataclasses.replace(scn, spares=0)
    n = daly_steps(scn, cost)
    r = run_cr(base, cost, n, failures=ff(), label=f"checkpoint-restart (Daly, N={n})")
    r.params["closed_form_ettr"] = cr_closed_form(scn, cost, n)
    out.append(r)
    if ckpt_steps:
        out.append(run_cr(base, cost, ckpt_steps, failures=ff()))
    out.append(run_inplace(base, cost, adaptive=True, failures=ff()))
    for label, stall in stalls:
        r = run_stall(base, cost, stall, label)
        r.params["closed_form_ettr"] = stall_ettr(stall, base.job_mtbf_s)
        out.append(r)
    return out


def sweep(scn: Scenario, cost: CostModel, *, gpus: list[int], mtbf_hours: list[float]) -> dict:
    """ETTR per mode over scale (at scn's failure rate) and over per-GPU MTBF (at scn.gpus);
    recover_hsdp with its planned spares at each point."""
    def point(s: Scenario) -> dict:
        plan = plan_spares(s, cost)
        b = plan["best"]
        s = dataclasses.replace(s, spares=b["spares"], restart_below=b["restart_below"])
        res = compare(s, cost)
        return {"gpus": s.gpus, "gpu_hours_per_failure": s.gpu_hours_per_failure,
                "job_mtbf_min": dataclasses.replace(s, spares=0).job_mtbf_s / 60.0,
                "spares": b["spares"], "restart_below": b["restart_below"],
                "ettr": {_key(r): r.ettr for r in res},
                "tokens_per_gpu_hour": {_key(r): r.tokens_per_gpu_hour for r in res}}
    t0 = time.perf_counter()
    scale = [point(dataclasses.replace(scn, gpus=g)) for g in gpus]
    mtbf = [point(dataclasses.replace(scn, gpu_hours_per_failure=h)) for h in mtbf_hours]
    return {"scale": scale, "mtbf": mtbf, "wall_s": time.perf_counter() - t0}


def _key(r: SimResult) -> str:
    if r.mode == "checkpoint_restart":
        return "checkpoint_restart_daly" if "Daly" in r.label else "checkpoint_restart"
    if r.mode == "inplace":
        return "recover_hsdp_rejoin" if r.params.get("rejoin") else "recover_hsdp"
    return r.mode if r.mode != "stall" else r.label


def plot_sweep(data: dict, out_dir: str) -> list[str]:
    """ettr_vs_scale.png and ettr_vs_mtbf.png (matplotlib imported here only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, xkey, xlabel in (("scale", "gpus", "GPUs"),
                               ("mtbf", "job_mtbf_min", "job MTBF (min)")):
        pts = data[name]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for mode in pts[0]["ettr"]:
            ax.plot([p[xkey] for p in pts], [100 * p["ettr"][mode] for p in pts], marker="o",
                    label=mode)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ETTR (%)")
        ax.set_ylim(0, 100)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"effective training time vs {xlabel}")
        fig.tight_layout()
        path = out / f"ettr_vs_{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written
