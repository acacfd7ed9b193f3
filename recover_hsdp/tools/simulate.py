"""`recover-hsdp simulate`: effective training time at 1k-100k GPUs from measured costs.

    recover-hsdp simulate                                   # 100k GPUs, Llama 3's failure rate
    recover-hsdp simulate --preset ft-hsdp                  # FT-HSDP's published inputs
    recover-hsdp simulate --gpus 16384 --job-mtbf-min 186 --spares 8 --json
    recover-hsdp simulate --calibrate RUN_DIR... --gpus 4 --gpus-per-replica 1 -G 8
    recover-hsdp simulate --validate docs/results           # predict runs not calibrated on
    recover-hsdp simulate --sweep --plot-dir DIR            # ETTR over scale and MTBF (PNG)

Modes, all under the same failures (seed): recover_hsdp in place (the policy's layouts, with
periodic checkpoints and a scale-back-up restart when alive replicas fall below a threshold),
the same with replaced replicas rejoining, checkpoint-restart at the Young/Daly interval (and at
--ckpt-interval-steps), drop-and-go (the batch shrinks), and for --preset ft-hsdp the stall model
behind FT-HSDP's published 44% / 80%. docs/simulate.md has the model and every default's source.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

from recover_hsdp.sim.calibrate import CalibrationError, calibrate, validate_throughput
from recover_hsdp.sim.costs import LLAMA3_GPU_HOURS_PER_FAILURE, CostModel, Scenario
from recover_hsdp.sim.failures import TraceError, TraceFailures, read_trace
from recover_hsdp.sim.plan import compare, plan_spares, plot_sweep, sweep
from recover_hsdp.tools._args import OneLineParser, UsageError

PROG = "recover-hsdp simulate"
PRESETS = {
    # FT-HSDP (arXiv 2602.00277) at ~100k GPUs; its failure interval (18 min) as the ReCoVer
    # paper quotes it from [29]; stall per failure 10 min synchronous vs 3 min FT-HSDP.
    "ft-hsdp": {"gpus": 100_000, "job_mtbf_min": 18.0, "restart": 600.0,
                "stalls": [("synchronous (stall 10 min)", 600.0),
                           ("FT-HSDP (stall 3 min)", 180.0)]},
    # Llama 3 405B: 419 interruptions / 54 days / 16,384 GPUs; 10-minute restart.
    "llama3": {"gpus": 100_000, "gpu_hours": LLAMA3_GPU_HOURS_PER_FAILURE, "restart": 600.0,
               "stalls": []},
}
COST_FLAGS = ("t_mb", "t_sync", "detect", "repair", "hang_timeout", "restart", "save", "load",
              "rejoin_after")


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), help="published inputs (default llama3's rate)")
    a("--gpus", type=int, help="GPUs of the job (default 100000)")
    a("--gpus-per-replica", type=int, help="GPUs per replica (default 128 = TP8 x PP16)")
    a("--shard-size", type=int, help="with --tp: GPUs per replica = shard size x tensor width")
    a("--tp", type=int, help="tensor (and pipeline) width per shard rank")
    a("--grad-accum", "-G", type=int, default=16, help="G_init microbatches per replica")
    a("--tokens-per-mb", type=int, default=8192, help="tokens per microbatch (default 8192)")
    a("--days", type=float, default=30.0, help="simulated days (default 30)")
    a("--gpu-hours-per-failure", type=float, help="per-GPU MTBF in hours (default 50677)")
    a("--job-mtbf-min", type=float, help="job MTBF at --gpus, minutes (sets the per-GPU MTBF)")
    a("--node-fraction", type=float, default=0.0, help="failures that take a whole node")
    a("--gpus-per-node", type=int, default=8)
    a("--hang-fraction", type=float, default=0.0, help="failures that hang (timeout)")
    a("--fatal-fraction", type=float, default=0.0, help="failures no replica scheme survives")
    a("--trace", help="failure trace (JSON lines / JSON list / CSV: t or step, kind, replicas)")
    a("--spares", default="auto", help="spare replicas for recover_hsdp, or 'auto' (planned)")
    a("--restart-below", default="auto",
      help="scale back up when alive < F x W_train (0..1), or 'auto' (planned)")
    a("--ckpt-interval-steps", type=int, help="also checkpoint-restart at this interval")
    a("--ckpt-interval-s", type=float, help="recover_hsdp's periodic checkpoints (default 3600)")
    a("--stall", type=float, nargs="*", default=[], metavar="S",
      help="extra stall-model lines: every failure stops the job S seconds")
    for name in COST_FLAGS:
        a(f"--{name.replace('_', '-')}", type=float, metavar="S", help=f"cost: {name} seconds")
    a("--calibrate", nargs="+", metavar="RUN_DIR", help="fit the cost model to measured runs")
    a("--calib-tokens-per-mb", type=int, default=512, help="microbatch tokens of those runs")
    a("--validate", nargs="?", const="docs/results", metavar="RESULTS_DIR",
      help="calibrate on RESULTS_DIR/throughput_N8, predict N=2,4,16 of the throughput experiment")
    a("--sweep", action="store_true", help="ETTR over 1k-100k GPUs and over MTBF")
    a("--plot-dir", help="write the sweep's PNGs here (implies --sweep)")
    a("--seed", type=int, default=0)
    a("--json", action="store_true", help="one JSON object on stdout")
    return p


def _check(args) -> None:
    def bad(flag: str, msg: str):
        raise UsageError(f"argument --{flag}: {msg}")
    for flag in ("gpus", "gpus_per_replica", "shard_size", "tp", "grad_accum", "tokens_per_mb",
                 "gpus_per_node", "ckpt_interval_steps", "calib_tokens_per_mb"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            bad(flag.replace("_", "-"), f"must be >= 1 (got {v})")
    for flag in ("days", "gpu_hours_per_failure", "job_mtbf_min", "ckpt_interval_s"):
        v = getattr(args, flag)
        if v is not None and not v > 0:
            bad(flag.replace("_", "-"), f"must be > 0 (got {v})")
    for flag in ("node_fraction", "hang_fraction", "fatal_fraction"):
        v = getattr(args, flag)
        if not 0.0 <= v <= 1.0:
            bad(flag.replace("_", "-"), f"must be in [0, 1] (got {v})")
    if args.node_fraction + args.hang_fraction + args.fatal_fraction > 1.0:
        bad("hang-fraction", "node + hang + fatal fractions exceed 1")
    for name in COST_FLAGS:
        v = getattr(args, name)
        if v is not None and v < 0:
            bad(name.replace("_", "-"), f"must be >= 0 (got {v})")
    if (args.shard_size is None) != (args.tp is None):
        bad("tp", "--shard-size and --tp go together")
    if args.shard_size is not None and args.gpus_per_replica is not None:
        bad("gpus-per-replica", "give it or --shard-size x --tp, not both")
    if args.gpu_hours_per_failure is not None and args.job_mtbf_min is not None:
        bad("job-mtbf-min", "give it or --gpu-hours-per-failure, not both")
    for s in args.stall:
        if s < 0:
            bad("stall", f"must be >= 0 (got {s})")
    if args.spares != "auto":
        try:
            if int(args.spares) < 0:
                raise ValueError
        except ValueError:
            bad("spares", f"an integer >= 0 or 'auto' (got {args.spares!r})")
    if args.restart_below != "auto":
        try:
            if not 0.0 <= float(args.restart_below) <= 1.0:
                raise ValueError
        except ValueError:
            bad("restart-below", f"a number in [0, 1] or 'auto' (got {args.restart_below!r})")


def scenario_and_cost(args) -> tuple[Scenario, CostModel, list, list[str]]:
    preset = PRESETS[args.preset or "llama3"]
    gpus = args.gpus or preset["gpus"]
    gpr = args.gpus_per_replica or (args.shard_size * args.tp if args.shard_size else 128)
    if gpr > gpus:
        raise UsageError(f"argument --gpus-per-replica: {gpr} GPUs per replica > --gpus {gpus}")
    if args.gpu_hours_per_failure:
        gh = args.gpu_hours_per_failure
    elif args.job_mtbf_min or "job_mtbf_min" in preset:
        gh = (args.job_mtbf_min or preset["job_mtbf_min"]) / 60.0 * gpus
    else:
        gh = preset["gpu_hours"]
    scn = Scenario(gpus=gpus, gpus_per_replica=gpr, grad_accum=args.grad_accum,
                   tokens_per_mb=args.tokens_per_mb, days=args.days, gpu_hours_per_failure=gh,
                   gpus_per_node=args.gpus_per_node, node_fraction=args.node_fraction,
                   hang_fraction=args.hang_fraction, fatal_fraction=args.fatal_fraction,
                   ckpt_interval_s=args.ckpt_interval_s, seed=args.seed)
    cost, notes = CostModel(), []
    cost.set("restart", preset["restart"], cost.sources["restart"])
    if args.calibrate:
        cost, notes = calibrate(args.calibrate, args.calib_tokens_per_mb, cost)
        if cost.t_mb_by_alive and gpus * 1 > max(cost.t_mb_by_alive):
            notes.append(f"calibrated at <= {max(cost.t_mb_by_alive)} processes: larger jobs "
                         f"take that count's per-microbatch time")
    for name in COST_FLAGS:
        v = getattr(args, name)
        if v is not None:
            cost.set(name, v, "command line")
            if name == "t_mb":
                cost.t_mb_by_alive = {}
    stalls = list(preset["stalls"]) + [(f"stall {s:g} s", s) for s in args.stall]
    return scn, cost, stalls, notes


def _failures_factory(args):
    if not args.trace:
        return None
    trace = read_trace(args.trace)
    return lambda: TraceFailures(list(trace))


def header(scn: Scenario, cost: CostModel, notes: list[str]) -> list[str]:
    w, b = scn.replicas, scn.replicas * scn.grad_accum
    lines = [f"{scn.gpus:,} GPUs = {w:,} replicas x {scn.gpus_per_replica} GPUs, G={scn.grad_accum}"
             f", B={b:,} microbatches ({b * scn.tokens_per_mb / 1e6:.1f}M tokens) per step, "
             f"{scn.days:g} days, seed {scn.seed}",
             f"failures: one per {scn.gpu_hours_per_failure:,.0f} GPU-hours -> job MTBF "
             f"{dataclasses.replace(scn, spares=0).job_mtbf_s / 60:.1f} min; node "
             f"{scn.node_fraction:.0%} (x{scn.gpus_per_node} GPUs), hang {scn.hang_fraction:.0%},"
             f" fatal {scn.fatal_fraction:.0%}", *notes, *_cost_lines(cost)]
    return ["# " + ln for ln in lines]


def _cost_lines(cost: CostModel) -> list[str]:
    lines = ["cost model (seconds; source):"]
    for name in ("t_mb", "t_sync", "detect", "repair", "hang_timeout", "cr_detect", "restart",
                 "load", "save", "rejoin_after", "rejoin_stall", "cr_step_factor"):
        lines.append(f"  {name:<14} {getattr(cost, name):>9.4g}  {cost.sources.get(name, '')}")
    return lines


def table(results, plan: dict | None) -> list[str]:
    out = [f"{'mode':<38} {'ETTR':>7} {'closed':>7} {'tokens/GPU-h':>13} {'steps':>9} "
           f"{'failures':>8} {'restarts':>8} {'bdry':>5}"]
    for r in results:
        cf = r.params.get("closed_form_ettr")
        label = r.label
        if r.mode == "inplace":
            label += f" (k={r.params['spares']}, <{r.params['restart_below']:g})"
        out.append(f"{label:<38} {100 * r.ettr:>6.1f}% "
                   f"{(f'{100 * cf:.1f}%' if cf is not None else '-'):>7} "
                   f"{r.tokens_per_gpu_hour:>13,.0f} {r.steps:>9,} {r.failures:>8} "
                   f"{r.restarts:>8} {r.boundaries:>5}")
    if plan:
        b = plan["best"]
        out.append(f"# spare plan: {b['spares']} spare replicas, scale back up below "
                   f"{b['restart_below']:g} x W_train (max tokens per GPU-hour over "
                   f"{len(plan['rows'])} candidates)")
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check(args)
        scn, cost, stalls, notes = scenario_and_cost(args)
        ff = _failures_factory(args)
        out: dict = {"scenario": scn.as_dict()}
        t0 = time.perf_counter()
        if args.validate:                        # only the validation: a small-scale question
            cost, v = _validate(args, cost if args.calibrate else None)
            out.update(cost=cost.as_dict(), validation=v, runtime_s=time.perf_counter() - t0)
            print(json.dumps(out, default=str) if args.json else "\n".join(
                ["# " + ln for ln in _cost_lines(cost)] + _validation_lines(v)))
            return 0
        plan = None
        if args.spares == "auto" or args.restart_below == "auto":
            plan = plan_spares(scn, cost,
                               None if args.spares == "auto" else [int(args.spares)],
                               None if args.restart_below == "auto"
                               else [float(args.restart_below)], ff)
            scn = dataclasses.replace(scn, spares=plan["best"]["spares"],
                                      restart_below=plan["best"]["restart_below"])
        else:
            scn = dataclasses.replace(scn, spares=int(args.spares),
                                      restart_below=float(args.restart_below))
        results = compare(scn, cost, ckpt_steps=args.ckpt_interval_steps, stalls=stalls,
                          failures_factory=ff)
        out.update(cost=cost.as_dict(), plan=plan, results=[r.summary() for r in results],
                   notes=notes)
        if args.sweep or args.plot_dir:
            out["sweep"] = sweep(scn, cost, gpus=[1024, 4096, 16384, 32768, 65536, 100_000],
                                 mtbf_hours=[h * scn.gpu_hours_per_failure
                                             for h in (0.25, 0.5, 1.0, 2.0, 4.0)])
            if args.plot_dir:
                out["plots"] = plot_sweep(out["sweep"], args.plot_dir)
        out["runtime_s"] = time.perf_counter() - t0
    except (UsageError, CalibrationError, TraceError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    print("\n".join(header(scn, cost, notes) + table(results, plan)))
    if "sweep" in out:
        print("\n".join(_sweep_lines(out["sweep"])))
    for p in out.get("plots", []):
        print(f"# wrote {p}")
    print(f"# simulated in {out['runtime_s']:.2f} s")
    return 0


def _validate(args, cost: CostModel | None) -> tuple[CostModel, dict]:
    """Calibrate on the first sweep's N=8 runs (unless --calibrate), predict every other
    measured interval ratio of both sweeps (N=2, 4, 16, and the second sweep's N=8)."""
    from pathlib import Path
    root = Path(args.validate)
    if cost is None:
        cost, _ = calibrate([str(root / "throughput_N8")], args.calib_tokens_per_mb)
    measured = [str(p) for p in sorted(root.glob("paper_throughput*.json"))]
    if not measured:
        raise CalibrationError(f"{root}: no paper_throughput*.json to compare with")
    return cost, validate_throughput(cost, measured, [2, 4, 8, 16],
                                     exclude=frozenset({(8, "paper_throughput.json")}))


def _validation_lines(v: dict) -> list[str]:
    out = ["# validation: ReCoVer / checkpoint-restart effective throughput per interval, "
           "predicted (calibrated on N=8 only) vs measured",
           f"{'N':>3} {'interval':>8} {'source':<28} {'measured':>9} {'predicted':>9} {'error':>7}"]
    for r in v["rows"]:
        out.append(f"{r['N']:>3} {r['interval']:>8} {r['source']:<28} {r['measured']:>9.2f} "
                   f"{r['predicted']:>9.2f} {100 * r['error']:>6.1f}%")
    n = sum(abs(r["error"]) <= 0.15 for r in v["rows"])
    out.append(f"# |error| mean {100 * v['mean_abs_error']:.1f}%, max "
               f"{100 * v['max_abs_error']:.1f}%, within 15%: {n}/{len(v['rows'])}; against the "
               f"mean of the measured sweeps: max {100 * v['vs_mean_max_abs_error']:.1f}%")
    return out


def _sweep_lines(s: dict) -> list[str]:
    out = []
    for name, key in (("scale", "gpus"), ("mtbf", "job_mtbf_min")):
        pts = s[name]
        modes = list(pts[0]["ettr"])
        out.append(f"# ETTR over {name}")
        out.append(f"{key:>13} {'spares':>6} " + " ".join(f"{m[:22]:>22}" for m in modes))
        for p in pts:
            out.append(f"{p[key]:>13,.1f} {p['spares']:>6} " +
                       " ".join(f"{100 * p['ettr'][m]:>21.1f}%" for m in modes))
    out.append(f"# sweep took {s['wall_s']:.1f} s")
    return out


if __name__ == "__main__":
    sys.exit(main())
