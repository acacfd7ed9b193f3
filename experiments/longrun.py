"""`python -m experiments.longrun` (from the repository root): the long run of docs/results.md
section 7.

One resilient run of --steps (300) steps, SMALL model (recover_hsdp/tools/chaos.py), W=4 S=1 G=2
(B=8), a DCP checkpoint every --ckpt-interval steps, elastic.min_replicas=2, and every way a long run
is interrupted, all real (SIGKILL of ranks by the fault schedule, SIGUSR1 to the launcher):

segment 0  W=4: replicas 3, 2 killed (in-place recovery goes on with W=3, then 2); replica 1
           killed -> 1 alive < elastic.min_replicas -> the ranks checkpoint, the launcher relaunches
segment 1  at FULL width (W=4) from that checkpoint (the scale-back-up); at --stop-at the
           launcher gets SIGUSR1: checkpoint, exit 4
segment 2  forced resume at ANOTHER replica count: checkpoint.resume=true with W=2 G=4 (B kept),
           elastic.min_replicas=0; replica 1 killed (W=1 to the end)

Then failure-free references (baseline=reference, data.seed 0..--ref-seeds-1, same shape as
segment 0) make the data-order band, and the resilient run is scored against it exactly as
section 1's trajectory (smoothed loss inside the band; leave-one-out). `recover-hsdp verify`
runs over the whole run directory (every step committed once, ids exactly once across the
resumes). Writes --out/longrun.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import yaml

from recover_hsdp.bench import harness as H
from experiments.paper_analysis import analyze_trajectory

REPO = H.REPO   # the checkout
PROG = "python -m experiments.longrun"
SMALL = ["model.d_model=64", "model.n_layers=2", "model.ffn_dim=160", "parallel.seq_len=32",
         "parallel.micro_batch_size=2", "optim.warmup_steps=1"]


def _log(msg: str) -> None:
    print(f"[longrun {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-interval", type=int, default=25)
    p.add_argument("--ref-seeds", type=int, default=3, help="failure-free references (>= 2)")
    p.add_argument("--window", type=int, default=10, help="loss smoothing window (steps)")
    p.add_argument("--runs", default="runs/longrun", help="run directories go here")
    p.add_argument("--out", default="docs/results", help="longrun.json goes here")
    p.add_argument("--timeout-s", type=float, default=1800, help="bound on each launch")
    p.add_argument("--reuse", action="store_true", help="keep complete runs found under --runs")
    a = p.parse_args(argv)
    if a.ref_seeds < 2:
        p.error(f"--ref-seeds: {a.ref_seeds} must be >= 2 (a band needs two references)")
    if a.steps < 40:
        p.error(f"--steps: {a.steps} must be >= 40 (the kills are spread over the run)")
    return a


def plan(steps: int) -> dict:
    """The kill steps (fractions of the run) and the SIGUSR1 moment."""
    f = lambda x: int(round(x * steps))  # noqa: E731
    return {"kills_seg0": [(f(0.12), 3), (f(0.24), 2), (f(0.36), 1)],
            "stop_at": f(0.55), "kill_seg2": (f(0.75), 1)}


def _cmd(run_dir: Path, overrides: Sequence[str], steps: int) -> list[str]:
    return [sys.executable, "-m", "recover_hsdp.cli", "train", *SMALL, *overrides,
            "parallel.shard_size=1", f"run.steps={steps}", f"run.output_dir={run_dir}",
            "run.save_params_every=0", "run.log_every=25"]


def _committed(run_dir: Path) -> int:
    best = -1
    for p in (run_dir / "steps").glob("rank*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                best = max(best, int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                pass
    return best


def _complete(run_dir: Path, steps: int) -> bool:
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["steps_committed"]) >= steps
    except (OSError, ValueError, KeyError):
        return False


def _launch(cmd: list[str], log: Path, timeout: float, stop_at: int | None = None,
            run_dir: Path | None = None) -> tuple[int, float]:
    """Run one launcher (its own session); SIGUSR1 it once `stop_at` is committed."""
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=H.child_env(1), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"no result after {timeout:.0f} s (log: {log})")
                if stop_at is not None and _committed(run_dir) >= stop_at:
                    _log(f"step {stop_at} committed: SIGUSR1 to the launcher")
                    proc.send_signal(signal.SIGUSR1)
                    stop_at = None
                time.sleep(0.5)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return proc.returncode, time.monotonic() - t0


def run_resilient(args: argparse.Namespace, root: Path) -> tuple[Path, dict]:
    run_dir, pl = root / "resilient", plan(args.steps)
    root.mkdir(parents=True, exist_ok=True)

    def sched(name: str, kills) -> list[str]:
        entries = [{"step": s, "replica": r, "local_rank": 0, "location": "reduce", "bucket": 1}
                   for s, r in kills]
        (root / name).write_text(yaml.safe_dump(entries, sort_keys=False,
                                                default_flow_style=None))
        return ["failures.kind=schedule", f"failures.path={root / name}"]

    # one schedule per launcher: a replica index names another process after the relaunch
    common = ["data.seed=0", f"checkpoint.interval={args.ckpt_interval}"]
    if args.reuse and _complete(run_dir, args.steps):
        _log("resilient: reused (complete)")
        return run_dir, {"plan": pl}
    log = root / "resilient.log"
    log.unlink(missing_ok=True)
    _log(f"resilient: segments 0-1 (W=4 G=2, kills {pl['kills_seg0']}, relaunch, SIGUSR1 at "
         f"step {pl['stop_at']})")
    rc1, w1 = _launch(_cmd(run_dir, ["parallel.replicas=4", "parallel.grad_accum=2",
                                     "elastic.min_replicas=2", "run.overwrite=true", *common,
                                     *sched("kills_seg01.yaml", pl["kills_seg0"])],
                           args.steps), log, args.timeout_s, pl["stop_at"], run_dir)
    if rc1 != 4:
        raise RuntimeError(f"segments 0-1 exited {rc1}, expected 4 (log: {log})")
    _log(f"resilient: segment 2 (resume at W=2 G=4, kill {pl['kill_seg2']})")
    rc2, w2 = _launch(_cmd(run_dir, ["parallel.replicas=2", "parallel.grad_accum=4",
                                     "elastic.min_replicas=0", "checkpoint.resume=true", *common,
                                     *sched("kills_seg2.yaml", [pl["kill_seg2"]])],
                           args.steps), log, args.timeout_s)
    if rc2 != 0:
        raise RuntimeError(f"segment 2 exited {rc2} (log: {log})")
    return run_dir, {"plan": pl, "launcher_wall_s": [round(w1, 1), round(w2, 1)]}


def run_references(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    dirs = {}
    for seed in range(args.ref_seeds):
        d = root / f"reference-seed{seed}"
        log = root / f"reference-seed{seed}.log"
        dirs[f"reference-seed{seed}"] = d
        if args.reuse and _complete(d, args.steps):
            continue
        log.unlink(missing_ok=True)
        _log(f"reference data.seed={seed}")
        rc, _ = _launch(_cmd(d, ["baseline=reference", f"data.seed={seed}",
                                 "parallel.replicas=4", "parallel.grad_accum=2",
                                 "run.overwrite=true"], args.steps), log, args.timeout_s)
        if rc != 0:
            raise RuntimeError(f"reference seed {seed} exited {rc} (log: {log})")
    return dirs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    root, out = Path(args.runs).resolve(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        run_dir, info = run_resilient(args, root)
        dirs = {**run_references(args, root), "resilient": run_dir}
    except RuntimeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    v = subprocess.run([sys.executable, "-m", "recover_hsdp.cli", "verify", str(run_dir)],
                       cwd=REPO, env=H.child_env(1), capture_output=True, text=True,
                       timeout=args.timeout_s)
    segs = [json.loads(x) for x in (run_dir / "segments.jsonl").read_text().splitlines()]
    res = analyze_trajectory(args, dirs, out / "longrun")
    res.update(info, verify_rc=v.returncode, verify_tail=v.stdout.strip().splitlines()[-3:],
               segments=segs, bench_wall_s=round(time.perf_counter() - t0, 1))
    H.write_json(out / "longrun.json", res, indent=2, sort_keys=True)
    print(format_longrun(res), flush=True)
    return 0 if v.returncode == 0 else 1


def format_longrun(r: dict) -> str:
    starts = [s for s in r["segments"] if s["event"] == "start"]
    ends = {s["segment"]: s for s in r["segments"] if s["event"] == "end"}
    lines = [f"long run: {r['steps']} steps, {len(starts)} segments; verify rc={r['verify_rc']}"]
    for s in starts:
        e = ends.get(s["segment"], {})
        lines.append(f"  segment {s['segment']}: W={s['replicas']} G={s['grad_accum']} from step "
                     f"{s['resume_step'] or 0} ({s['reason']}) -> {e.get('outcome')} "
                     f"(rc {e.get('rc')}, resume time {e.get('resume_time_s')} s)")
    lines.append(f"  loss smoothed over {r['window']} steps, scored from step "
                 f"{r['first_kill_step'] + r['window']} (median band half-width "
                 f"{r['band_halfwidth_median']:.4f})")
    for n, v in r["runs"].items():
        lines.append(f"  {n:20s} inside band {100 * v['inside_band_fraction']:5.1f}%  mean dev "
                     f"{v['mean_dev_from_ref_mean']:+.4f}  final-20 loss "
                     f"{v['final20_mean_loss']:.4f}")
    for n, v in r.get("leave_one_out", {}).items():
        lines.append(f"  leave-one-out {n:22s} inside {100 * v['inside_band_fraction']:5.1f}%  "
                     f"mean|dev| {v['mean_abs_dev_from_band_mean']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
