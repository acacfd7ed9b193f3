"""The paper's section 5 / appendix A.1 experiments at this box's scale (`python -m
experiments.paper` from the repository root).

Every run is a real `recover-hsdp train` job (mpirun, real SIGKILLs), one after the other, each
with a time limit; the run directories are kept under --runs and read back with
recover_hsdp.record.timeline; plots and the numbers behind them go to --out (docs/results/ in the
repository). docs/results.md has the reading. Experiments (``--exp``, default all, in this order):

trajectory  llama_debug on the embedded corpus, W=8 S=1 G=2 (B=16), --steps (200) steps:
            failure-free references with data.seed 0..--ref-seeds-1 (the data-order band), the resilient
            run (data.seed 0) with 6 replicas killed at reduce bucket 1, spread across the run,
            and drop-and-go (policy=adaptive) with the same kills.
throughput  W=4 S=1 G=8 (the paper's grad-accum for this comparison); for each checkpoint
            interval N in --intervals (2,4,8,16): checkpoint-restart (DCP every N steps; kills
            at steps 1.5N, 2.5N, 3.5N, the whole job relaunched after each) and the resilient
            run with the same kills (replicas 3, 2, 1 at reduce bucket 1), 4.5N steps each; plus
            one asynchronous-checkpoint run at --async-interval. Effective throughput per
            interval between consecutive kills, cumulative tokens vs process-hours, and the
            single-failure breakdown of the first kill (kill at 1.5N, as in appendix A.1).
control     oversubscription control: failure-free references at W = 4, 3, 2, 1 (G=8) for a few
            steps. On 2 cores, 4 ranks each get half a core, 2 ranks a whole one: per-process
            throughput rises when ranks die for a reason that has nothing to do with the method;
            this measures by how much, so the throughput comparison can be read net of it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from recover_hsdp.bench import harness as H
from experiments.paper_analysis import (  # noqa: F401 (the analysis is part of the API)
    ANALYZERS, FORMATTERS, _smooth, analyze_trajectory, format_trajectory)

EXPERIMENTS = ("control", "trajectory", "throughput")
KILL_BUCKET = 1

TRAJ = {"replicas": 8, "grad_accum": 2, "kills_at_fraction": (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)}
THRU = {"replicas": 4, "grad_accum": 8}


PROG = "python -m experiments.paper"
_log = functools.partial(H.say, "paper", stream=sys.stdout, with_load=False)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = H.parser("paper", __doc__.split("\n\n")[0])
    p.prog = PROG
    p.add_argument("--exp", dest="exps", type=H.choice_list(EXPERIMENTS, what="experiment"),
                   default=EXPERIMENTS,
                   help="comma-separated subset of " + ",".join(EXPERIMENTS) + " (default all)")
    p.add_argument("--out", default=str(H.REPO / "docs" / "results"),
                   help="plots + CSV/JSON (default docs/results)")
    p.add_argument("--runs", default=str(H.REPO / "bench" / "runs" / "paper"),
                   help="run directories (default bench/runs/paper)")
    H.options(
        p, steps=(200, "trajectory steps (default 200)"),
        async_interval=(4, "N of the extra asynchronous-checkpoint run (0: none; default 4)"),
        ref_seeds=(3, "trajectory: failure-free references with data.seed 0..K-1 (default 3)"),
        window=(10, "trajectory: steps in the trailing loss mean that is scored (default 10)"),
        reuse=(False, "keep a run directory whose summary.json says every step committed"),
        run_timeout_s=(900.0, "time limit of each training job (default 900)"),
        analyze_only=(False, "run nothing; read the run directories already under --runs"))
    p.add_argument("--intervals", dest="Ns", type=H.int_list, default=[2, 4, 8, 16],
                   help="checkpoint intervals N for the throughput sweep (default 2,4,8,16)")
    a = p.parse_args(list(argv))
    if min(a.Ns) < 2 or any(n % 2 for n in a.Ns):
        p.error(f"--intervals: {a.Ns}: each N must be an even integer >= 2 (kills at 1.5N)")
    if a.ref_seeds < 2:
        p.error(f"--ref-seeds: {a.ref_seeds} must be >= 2 (a band needs two references)")
    if a.window < 1:
        p.error(f"--window: {a.window} must be >= 1")
    if a.steps < 40:
        p.error(f"--steps: {a.steps} is too short for 6 spread kills (>= 40)")
    return a


# ------------------------------------------------------------------------------------ running
def _complete(run_dir: Path, steps: int) -> bool:
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return int(s.get("steps_committed", -1)) >= steps


def write_schedule(path: Path, kills: Sequence[tuple[int, int]]) -> Path:
    """kills: (step, replica) pairs -> a schedule file of kills at reduce bucket KILL_BUCKET."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [{"step": int(s), "replica": int(r), "local_rank": 0, "location": "reduce",
                "bucket": KILL_BUCKET} for s, r in kills]
    path.write_text(yaml.safe_dump(entries, sort_keys=False, default_flow_style=None))
    return path


def train(run_dir: Path, overrides: Sequence[str], steps: int, args: argparse.Namespace) -> float:
    """One `recover-hsdp train` job into run_dir; returns its wall time. Raises on failure."""
    if args.reuse and _complete(run_dir, steps):
        _log(f"{run_dir.name}: reused (complete)")
        return 0.0
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "recover_hsdp.cli", "train", *overrides,
           f"run.steps={steps}", f"run.output_dir={run_dir}", "run.overwrite=true",
           "run.save_params_every=0", "run.log_every=20",
           f"run.time_limit_s={args.run_timeout_s}"]
    log = run_dir.parent / f"{run_dir.name}.log"
    _log(f"{run_dir.name}: {' '.join(overrides)}")
    rc, wall = H.run_logged(cmd, log, args.run_timeout_s + 120,
                            env=H.child_env(int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if rc == 124:
        raise RuntimeError(f"{run_dir.name}: no result after {args.run_timeout_s + 120:.0f} s "
                           f"(log: {log})")
    if rc != 0:
        raise RuntimeError(f"{run_dir.name}: exit {rc} after {wall:.0f} s (log: {log}): "
                           + " | ".join(H.tail(log, 3).splitlines()))
    _log(f"{run_dir.name}: done in {wall:.0f} s")
    return wall


def _shape(replicas: int, grad_accum: int) -> list[str]:
    return ["model=llama_debug", f"parallel.replicas={replicas}", "parallel.shard_size=1",
            f"parallel.grad_accum={grad_accum}"]


def trajectory_kills(steps: int, replicas: int) -> list[tuple[int, int]]:
    fr = TRAJ["kills_at_fraction"]
    # the last replicas die first; replicas 0 and 1 survive (2 ranks keep both cores busy)
    return [(int(round(f * steps)), replicas - 1 - i) for i, f in enumerate(fr)]


def throughput_kills(n: int, replicas: int) -> list[tuple[int, int]]:
    """Appendix A.1: kills at 1.5N, 2.5N, 3.5N, ... (replicas W-1, W-2, ...; one survives)."""
    return [(int(1.5 * n) + i * n, replicas - 1 - i) for i in range(replicas - 1)]


def _train_all(args: argparse.Namespace, root: Path,
               plan: Sequence[tuple[str, list[str], int]]) -> dict[str, Path]:
    """(name, overrides, steps) -> one training job into root/name each (none with
    --analyze-only); the run directories by name."""
    for name, overrides, steps in plan:
        if not args.analyze_only:
            train(root / name, overrides, steps, args)
    return {name: root / name for name, _, _ in plan}


def run_trajectory(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    W, G = TRAJ["replicas"], TRAJ["grad_accum"]
    sched = write_schedule(root / "kills.yaml", trajectory_kills(args.steps, W))
    runs = {}
    for seed in range(args.ref_seeds):
        runs[f"reference-seed{seed}"] = ["baseline=reference", f"data.seed={seed}"]
    runs["resilient"] = ["data.seed=0", f"failures.schedule={sched}"]
    runs["drop-and-go"] = ["data.seed=0", "policy=adaptive", f"failures.schedule={sched}"]
    return _train_all(args, root, [(n, _shape(W, G) + x, args.steps) for n, x in runs.items()])


def run_throughput(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    W, G = THRU["replicas"], THRU["grad_accum"]
    plan = []
    for n in args.Ns:
        steps = int(4.5 * n)
        sched = write_schedule(root / f"kills-N{n}.yaml", throughput_kills(n, W))
        plan.append((f"cr-N{n}", _shape(W, G) + ["baseline=checkpoint_restart",
                     f"baseline.ckpt_interval={n}", f"failures.schedule={sched}"], steps))
        plan.append((f"resilient-N{n}", _shape(W, G) + [f"failures.schedule={sched}"], steps))
    if args.async_interval:
        n = args.async_interval
        sched = write_schedule(root / f"kills-N{n}.yaml", throughput_kills(n, W))
        plan.append((f"cr-async-N{n}", _shape(W, G) + [
            "baseline=checkpoint_restart", f"baseline.ckpt_interval={n}",
            "baseline.ckpt_async=true", f"failures.schedule={sched}"], int(4.5 * n)))
    return _train_all(args, root, plan)


def run_control(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    return _train_all(args, root, [(f"reference-W{w}", _shape(w, THRU["grad_accum"])
                                    + ["baseline=reference"], 8) for w in (4, 3, 2, 1)])


RUNNERS = {"trajectory": run_trajectory, "throughput": run_throughput, "control": run_control}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs_root, out = Path(args.runs), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for exp in args.exps:
        t = time.perf_counter()
        try:
            dirs = RUNNERS[exp](args, runs_root / exp)
        except RuntimeError as e:
            print(f"{PROG}: {exp}: {e}", file=sys.stderr)
            return 1
        results[exp] = ANALYZERS[exp](args, dirs, out)
        results[exp]["bench_wall_s"] = round(time.perf_counter() - t, 1)
        H.write_json(out / f"paper_{exp}.json", results[exp], indent=2, sort_keys=True)
        print(FORMATTERS[exp](results[exp]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
