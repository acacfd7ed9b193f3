"""Measure the rejoin policy (docs/rejoin.md "The policy") from a run directory: for each
SIGKILL, the seconds to the first step committed at full width again (in place by a standby, or
by the relaunch), the steps lost, and the step time before / degraded / after.

    recover-hsdp train parallel.replicas=3 parallel.grad_accum=2 run.rejoin=true \\
        run.rejoin_backoff_s=0.5 run.steps=8 run.output_dir=/tmp/rj0 \\
        "failures.schedule=[{step: 3, replica: 1, local_rank: 0, location: reduce, bucket: 1}]" \\
        model.d_model=64 model.n_layers=2 model.ffn_dim=160 parallel.seq_len=32 \\
        parallel.micro_batch_size=2 optim.warmup_steps=1
    python experiments/probes/rejoin_restart_timing.py /tmp/rj0

A step's commit time is the latest of its ranks' commit times (`local.time`); its step time the
longest `wall_s` of its ranks. "Steps lost" = steps never committed + step lines discarded by a
resume (committed by a segment after the checkpoint it was relaunched from): both must be 0.
"""
import json
import statistics
import sys
from pathlib import Path

from recover_hsdp.record import read_run

run_dir = Path(sys.argv[1])
rec = read_run(run_dir)
W = int(rec.meta["w_init"])
fired = sorted((json.loads(p.read_text()) for p in (run_dir / "faults").glob("fired.rank*.json")),
               key=lambda f: f["time"])
segs = [json.loads(x) for x in (run_dir / "segments.jsonl").read_text().splitlines()] \
    if (run_dir / "segments.jsonl").exists() else []
steps = sorted(rec.steps)


def commit_t(s):
    return max(v["time"] for v in rec.local[s].values())


def wall(s):
    return max(v["wall_s"] for v in rec.local[s].values())


full = [s for s in steps if len(rec.steps[s].alive) == W]
degraded = [s for s in steps if len(rec.steps[s].alive) < W]
resumed = {int(g["resume_step"]) for g in segs if g.get("event") == "start"
           and g.get("resume_step") is not None}
for f in fired:
    k = int(f["entry"]["step"])
    back = next((s for s in full if s > k), None)
    how = "?" if back is None else ("relaunch" if any(k < r <= back for r in resumed)
                                    else "in place (standby)")
    print(f"kill at step {k} (block {f['entry']['replica']}): first full-width step "
          f"{back} committed {commit_t(back) - f['time']:.2f} s later, {how}"
          if back is not None else f"kill at step {k}: never back at full width")
discarded = sum(len(p.read_text().splitlines())
                for p in (run_dir / "steps" / "discarded").glob("*.jsonl")) \
    if (run_dir / "steps" / "discarded").is_dir() else 0
missing = sorted(set(range(int(rec.summary.get("steps_committed", len(steps)) or 0)))
                 - set(steps)) if rec.summary else []
print(f"steps committed {len(steps)}, never committed {missing}, discarded step lines "
      f"{discarded} -> steps lost: {len(missing) + discarded}")
for g in segs:
    if g.get("event") == "start":
        print(f"segment {g['segment']}: {g['reason']}, resume_step {g.get('resume_step')}")
    else:
        print(f"  end: {g['outcome']}, resume_time_s (launch -> first commit) "
              f"{g.get('resume_time_s')}")
first_kill = min((int(f["entry"]["step"]) for f in fired), default=len(steps))
before = [wall(s) for s in steps if s < first_kill and s not in resumed and s > 0]
after = [wall(s) for s in full if s > first_kill and s not in resumed
         and s - 1 not in degraded]


def med(x):
    return f"{statistics.median(x):.3f} x{len(x)}" if x else "-"


print(f"median step wall s: before {med(before)}  degraded {med([wall(s) for s in degraded])}  "
      f"after (full width, not a segment's first step) {med(after)}  "
      f"segment first steps {med([wall(s) for s in sorted(resumed)])}")
