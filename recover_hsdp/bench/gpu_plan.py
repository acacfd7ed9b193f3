"""`recover-hsdp bench gpu`'s time plan and hard deadline (docs/gpu.md, "Time").

A GPU window is short (about 15 minutes of device time, start-ups included, at most 10 minutes a
command), so the default command must fit ``DEFAULT_BUDGET_S`` (360 s) from the start of
``launch/bench_gpu.sh``, venv included, and leave time for a rerun. Each section has an estimate:
a fixed part (start-ups, verify) plus a per-step part, taken from the newest recorded run of the
same device kind (``<runs>/bench_gpu/*/<n>_<name>.json``: its wall time, rescaled to the planned
steps) or else from the figures measured on the lent H200 (docs/gpu.md,
2026-11-30) and, where that page has none, a stated assumption. The plan keeps the sections in
order of value (1 the README kill schedule + verify, fp32 and bf16; 2 llama_1b failure-free,
resilient vs plain; 3 llama_1b W=2 with a kill mid-reduction, and the reduction's share of its
steps before the kill; 4 staging bandwidth at llama_1b's bucket sizes, ulfm vs nccl; 5 S = 2;
8 the data plane's abort + rebuild) and, while the
total is over the budget, first cuts steps (lowest value first, down to each section's minimum),
then defers whole sections (lowest value first; one that fits what is left then comes back).
Explicit ``--steps`` are never cut.

The plan is advice; the deadline is the law: every child process gets at most the time left (of
the budget and of its section's cap, ``SECTION_CAP_S``), a child still running then is SIGKILLed
with its whole process tree (every process carrying the bench's id in its environment), and the
section is recorded as killed.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Optional

#: the default command's budget, from the start of launch/bench_gpu.sh (venv included)
DEFAULT_BUDGET_S = 360.0
#: no one section runs longer than this (a section alone reruns within it)
SECTION_CAP_S = 180.0
#: launch/bench_gpu.sh exports the epoch time it started at: the budget counts from there
ENV_T0 = "RECOVER_HSDP_BENCH_T0"
#: every child of one bench carries this id in its environment (the sweep that kills leftovers)
ENV_ID = "RECOVER_HSDP_BENCH_ID"
#: the sections the default command runs (section 6 is derived; 7 waits for a later window)
DEFAULT_SECTIONS = "1,2,3,4,5,8"

SHARED = "docs/gpu.md (the first H200 run, one GPU, 2026-11-30)"


@dataclass(frozen=True)
class Estimate:
    """Seconds of one section: ``fixed_s + per_step_s * steps``."""
    section: int
    name: str
    fixed_s: float
    per_step_s: float
    steps: int          # the default steps
    min_steps: int      # the fewest that still give the section's figure
    source: str

    def seconds(self, steps: Optional[int] = None) -> float:
        return self.fixed_s + self.per_step_s * (self.steps if steps is None else steps)


# The lent H200's figures (SHARED), with the parts it does not give stated as assumptions.
GPU_ESTIMATES = {
    1: Estimate(1, "readme", 72.0, 0.0, 22, 22,
                "assumed: 2 runs (fp32, bf16) x (~15 s start-up of 4 ranks + 22 llama_debug "
                "steps + 3 recoveries) + verify ~10 s each (80 s for the 30 steps run before; "
                "-8 s for 8 fewer steps x 2 runs at an assumed 0.5 s per step, train + "
                f"snapshot + verify replay); {SHARED}: 30/30 steps, verify OK"),
    2: Estimate(2, "1b_failure_free", 80.0, 2.26 + 6.9, 4, 3,
                f"{SHARED}: plain 2.26 s/step, resilient 6.2-6.9 s in train_step (no "
                "snapshots here); assumed 40 s start-up per arm"),
    3: Estimate(3, "1b_kill", 40.0, 30.0, 4, 3,
                f"{SHARED}: ~30 s commit to commit at W=2 on one GPU; assumed 40 s start-up"),
    4: Estimate(4, "staging", 20.0, 0.0, 1, 1,
                "assumed: 2 ranks (sharing the GPU when there is one), start-up ~15 s, "
                "llama_1b's 232 MiB block and 32 MiB root buckets x 6 ulfm all-reduces + 6 "
                "pinned round trips each (one 256 MB bucket before; the same bytes within 12 %)"),
    5: Estimate(5, "s2", 210.0, 0.0, 1, 1,
                "assumed (S >= 2 on NCCL and the nccl data plane have never run): llama_debug "
                "2x2 + verify, the nccl plane W=2 overlapped with a kill + verify, 1B 1x2"),
    7: Estimate(7, "g8_overhead", 80.0, 4 * 6.9 + 4 * 30.0, 4, 3,
                f"{SHARED}: section 2 and 3 step times x 4 (G=8); assumed 40 s start-ups"),
    8: Estimate(8, "abort_rebuild", 20.0, 0.0, 1, 1,
                "assumed (the nccl plane has never run): min(GPUs, 4) ranks, NCCL init twice, "
                "ranks - 2 kills"),
}
#: section 4's nccl column with >= 2 GPUs: the same sizes once more on the nccl plane
NCCL_STAGING_S = 10.0
#: section 8 with one GPU: the gloo plane on CPU tensors, the same job as the CPU shape's
GLOO_ABORT_ON_GPU_MACHINE = Estimate(
    8, "abort_rebuild", 10.0, 0.0, 1, 1,
    "measured here (the 2-core CPU box, load 9): 9.6 s; the same CPU job (gloo, 3 ranks, one "
    "kill) on the GPU machine, nccl needing >= 2 GPUs")
# The CPU shape (llama_debug, seq 32): measured on the 2-core CI machine kind.
CPU_ESTIMATES = {
    1: Estimate(1, "readme", 45.0, 0.0, 22, 22,
                "measured here: the README schedule on 4 replicas, 22 steps, + verify"),
    2: Estimate(2, "1b_failure_free", 20.0, 0.1, 5, 3,
                "measured here: two ~9 s start-ups, 0.04 s/step"),
    3: Estimate(3, "1b_kill", 12.0, 0.1, 5, 3, "measured here: one start-up + a recovery"),
    4: Estimate(4, "staging", 8.0, 0.0, 1, 1,
                "measured here: 6.4 s at load 9 (2 ranks, llama_debug's buckets, ulfm + gloo)"),
    5: Estimate(5, "s2", 0.0, 0.0, 1, 1, "skipped without 2 GPUs"),
    7: Estimate(7, "g8_overhead", 20.0, 0.3, 5, 3, "measured here: two start-ups"),
    8: Estimate(8, "abort_rebuild", 10.0, 0.0, 1, 1,
                "measured here: 9.6 s at load 9 (gloo, 3 ranks, one kill)"),
}
#: section 1 under --quick: one fp32 run, one kill on 2 replicas, 3 steps, + verify
QUICK_S1 = {False: Estimate(1, "readme", 35.0, 0.0, 3, 3, "assumed: one ~15 s start-up of 2 "
                            "ranks, 3 steps, one recovery, verify ~10 s"),
            True: Estimate(1, "readme", 25.0, 0.0, 3, 3, "measured here: --cpu --quick "
                           "section 1 ~20-25 s (one kill on 2 replicas, + verify)")}
#: launch/bench_gpu.sh before the bench: a venv from the carried wheels and the import check
#: (+ ~60 s when no carried _C imports and it must build one)
SETUP_S = 15.0


def recorded(runs: Path, est: Estimate, cpu: bool) -> Optional[Estimate]:
    """``est`` rescaled to the newest recorded run of this section on this device kind."""
    best = None
    for f in sorted(runs.glob(f"*/{est.section}_{est.name}.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        dev = r.get("device") or {}
        wall, steps = r.get("section_wall_s"), r.get("planned_steps")
        if (bool(dev.get("cuda")) == (not cpu) and wall and steps and not r.get("killed")
                and r.get("ok") is not False):
            best = (f, float(wall), int(steps))
    if best is None:
        return None
    f, wall, steps = best
    scale = wall / max(est.seconds(steps), 1e-9)
    return replace(est, fixed_s=est.fixed_s * scale, per_step_s=est.per_step_s * scale,
                   source=f"recorded {f} ({wall:.0f} s at {steps} steps)")


@dataclass
class Planned:
    est: Estimate
    steps: int
    included: bool = True

    @property
    def seconds(self) -> float:
        return self.est.seconds(self.steps) if self.included else 0.0


def make_plan(sections: Iterable[int], budget_s: float, *, cpu: bool, gpus: int,
              steps: Optional[int] = None, runs: Optional[Path] = None,
              setup_s: float = 0.0, quick: bool = False) -> tuple[list[Planned], float]:
    """(the planned sections in order of value, total seconds incl. ``setup_s``)."""
    table = dict(CPU_ESTIMATES if cpu else GPU_ESTIMATES)
    if quick:
        table[1] = QUICK_S1[cpu]
    plan = []
    for n in sorted(set(sections)):
        if n not in table:
            continue
        est = table[n]
        if n == 5 and gpus < 2:
            est = replace(est, fixed_s=0.0, per_step_s=0.0,
                          source=f"skipped at once: needs >= 2 GPUs (planned for {gpus}): S = 2 "
                                 "on NCCL and the nccl data plane (one GPU cannot hold two "
                                 "ranks of one NCCL communicator)")
        elif n == 8 and gpus < 2 and not cpu:
            est = GLOO_ABORT_ON_GPU_MACHINE
        elif n == 4 and gpus >= 2 and not cpu:
            est = (runs is not None and recorded(runs, est, cpu)) or replace(
                est, fixed_s=est.fixed_s + NCCL_STAGING_S,
                source=est.source + f"; + {NCCL_STAGING_S:.0f} s assumed for the nccl column "
                                    "(never run: one rank per GPU, NCCL init)")
        elif runs is not None:
            est = recorded(runs, est, cpu) or est
        fixed = steps is not None and est.per_step_s > 0
        plan.append(Planned(est, steps if fixed else est.steps))

    def total() -> float:
        return setup_s + sum(p.seconds for p in plan)

    if steps is None:
        for p in plan:                              # a section alone fits its cap
            while p.seconds > SECTION_CAP_S and p.steps > p.est.min_steps:
                p.steps -= 1
        for p in reversed(plan):                    # cut steps, lowest value first
            while total() > budget_s and p.steps > p.est.min_steps and p.est.per_step_s > 0:
                p.steps -= 1
        for p in reversed(plan):                    # then defer sections, lowest value first
            if total() > budget_s and p.included and p.seconds > 0:
                p.included = False
        for p in plan:                              # what fits the time left comes back
            if not p.included and total() + p.est.seconds(p.steps) <= budget_s:
                p.included = True
    return plan, total()


def format_plan(plan: list[Planned], total: float, budget_s: float, setup_s: float,
                kind: str) -> str:
    lines = [f"bench gpu plan for {kind}: budget {budget_s:.0f} s"]
    if setup_s:
        lines.append(f"  setup              {setup_s:5.0f} s  launch/bench_gpu.sh: venv from the "
                     "carried wheels, import check, the carried _C")
    for p in plan:
        what = f"{p.est.section} {p.est.name}"
        if not p.included:
            lines.append(f"  {what:<18} deferred (~{p.est.seconds(p.est.min_steps):.0f} s at "
                         f"{p.est.min_steps} steps does not fit): {p.est.source}")
            continue
        st = f"{p.steps} steps" if p.est.per_step_s > 0 else ""
        cap = (f"OVER the {SECTION_CAP_S:.0f} s section cap (killed there): "
               if p.seconds > SECTION_CAP_S else "")
        lines.append(f"  {what:<18} {p.seconds:5.0f} s  {st:<9} {cap}{p.est.source}")
    verdict = "within" if total <= budget_s else f"OVER by {total - budget_s:.0f} s:"
    lines.append(f"  total              {total:5.0f} s  {verdict} the {budget_s:.0f} s budget")
    return "\n".join(lines)


def start_time() -> float:
    """perf_counter() value of the bench's start: launch/bench_gpu.sh's (ENV_T0) when given."""
    now_perf, now_wall = time.perf_counter(), time.time()
    try:
        t0 = float(os.environ[ENV_T0])
    except (KeyError, ValueError):
        return now_perf
    return now_perf - max(0.0, now_wall - t0)


def kill_marked(bench_id: str) -> list[int]:
    """SIGKILL every process (not this one) whose environment carries ``ENV_ID=bench_id``: the
    ranks of an mpirun job live in sessions of their own, so a process-group kill misses them."""
    import signal

    mark = f"{ENV_ID}={bench_id}".encode()
    killed = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if mark in env.split(b"\0"):
            try:
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
            except OSError:
                pass
    return killed


def print_plan(args, want: set, runs_default: Path) -> int:
    """--plan: each section's estimate and its source, the total; 1 when over the budget."""
    cpu = bool(args.cpu)
    gpus = args.gpus
    if gpus is None:
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
        except ImportError:
            gpus = 1
    runs = Path(args.out).resolve().parent if args.out else runs_default
    setup = 0.0 if cpu else SETUP_S
    plan, total = make_plan(want, args.budget_s, cpu=cpu, gpus=0 if cpu else gpus,
                            steps=args.steps, runs=runs, setup_s=setup, quick=args.quick)
    kind = "the CPU shape" if cpu else f"{gpus} GPU{'s' if gpus != 1 else ''} (bf16, llama_1b)"
    print(format_plan(plan, total, args.budget_s, setup, kind), flush=True)
    return 0 if total <= args.budget_s else 1
