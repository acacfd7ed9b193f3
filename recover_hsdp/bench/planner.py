"""`recover-hsdp bench planner`: how long `recover-hsdp plan` takes at scale.

Default workload: W_init = 100,000, G_init = 8, 50,000 random failures, seed 0, JSON
output. Prints the median over --repeat runs of
  * model   the count-level policy alone (random_plan),
  * render  turning the trace into JSON lines,
  * main    recover_hsdp.tools.plan.main in this process, output to a null sink,
  * cli     a fresh `python -m recover_hsdp.cli plan ... --json > /dev/null` process (interpreter
            start and imports included: what a user waits for),
and writes them as JSON (--out, default bench/results/planner.json). Pure Python: no torch here.
"""
from __future__ import annotations

import io
import statistics
import subprocess
import sys
import time

from recover_hsdp.policy.counts import random_plan
import recover_hsdp.tools.plan as plan_tool
import recover_hsdp.bench.harness as H


class _Null(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def main(argv: list[str] | None = None) -> int:
    args = H.parser("planner", __doc__, out="planner.json", aliases={"repeats": "--repeat"},
                    replicas=(100_000, "W: replicas at the start (default 100000)"),
                    grad_accum=(8, "G: microbatches per replica per step (default 8)"),
                    failures=(50_000, "replica failures in the sequence planned (default 50000)"),
                    seed=(0, "seed of the failure sequence (default 0)"),
                    repeats=(3, "timed repetitions; the median is reported (default 3)"),
                    no_cli=(False, "skip the fresh-process measurement")).parse_args(argv)
    w, g, k, seed = args.replicas, args.grad_accum, args.failures, args.seed
    argv_plan = ["--replicas", str(w), "--grad-accum", str(g), "--failures", str(k),
                 "--seed", str(seed), "--json"]

    rows: dict[str, list[tuple[float, float]]] = {"model": [], "render": [], "main": [], "cli": []}
    iterations = 0
    for _ in range(max(1, args.repeats)):
        wall, cpu, outs = _timed(lambda: list(random_plan(w, g, k, seed)))
        rows["model"].append((wall, cpu))
        iterations = len(outs)
        assert all(o.committed == w * g for o in outs), "an iteration missed B"
        wall, cpu, _ = _timed(lambda: "".join(o.to_json() + "\n" for o in outs))
        rows["render"].append((wall, cpu))
        wall, cpu, rc = _timed(lambda: plan_tool.main(argv_plan, out=_Null()))
        assert rc == 0
        rows["main"].append((wall, cpu))
        if not args.no_cli:
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "recover_hsdp.cli", "plan", *argv_plan],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            wall = time.perf_counter() - t0
            if r.returncode:
                print(r.stderr.decode(), file=sys.stderr)
                return 1
            rows["cli"].append((wall, float("nan")))

    print(f"planner: W_init={w} G_init={g} failures={k} seed={seed} -> {iterations} iterations, "
          f"median of {args.repeats}")
    print(f"{'stage':<8} {'wall s':>8} {'cpu s':>8}")
    result = {"replicas": w, "grad_accum": g, "failures": k, "seed": seed,
              "iterations": iterations, "repeat": args.repeats,
              "command": "recover-hsdp plan " + " ".join(argv_plan)}
    for name, vals in rows.items():
        if not vals:
            continue
        wall = statistics.median(v[0] for v in vals)
        cpu = statistics.median(v[1] for v in vals)
        print(f"{name:<8} {wall:>8.3f} {cpu:>8.3f}")
        result[f"{name}_wall_s"] = round(wall, 4)
        if cpu == cpu:
            result[f"{name}_cpu_s"] = round(cpu, 4)
    result.update(H.machine())
    out = H.write_json(args.out, result, indent=2)
    print(f"wrote {out}")
    return 0

