"""Measure a rejoin from a run directory: kill -> the newcomer's first contributing step.

    recover-hsdp train parallel.replicas=3 parallel.standby=1 parallel.grad_accum=2 run.steps=10 \\
        run.output_dir=/tmp/rejoin failures.schedule=KILLS.yaml model.d_model=64 model.n_layers=2 \\
        model.ffn_dim=160 parallel.seq_len=32 parallel.micro_batch_size=2 optim.warmup_steps=1
    python experiments/probes/rejoin_timing.py /tmp/rejoin

(KILLS.yaml: ``- {step: 3, replica: 1, local_rank: 0, location: reduce, bucket: 1}``.) Prints the
kill time, the join, the seconds from the SIGKILL to the commit of the first step the newcomer
contributed to, the survivors' stall and the median step time before / degraded / after.
"""
import json
import statistics
import sys
from pathlib import Path

from recover_hsdp.record import read_run

run_dir = Path(sys.argv[1])
rec = read_run(run_dir)
S = int(rec.meta["shard_size"])
fired = [json.loads(p.read_text()) for p in (run_dir / "faults").glob("fired.rank*.json")]
kill = min(fired, key=lambda f: f["time"])
kill_step = int(kill["entry"]["step"])
joins = [(s, j) for s, r in rec.steps.items() for j in ((r.extra or {}).get("joins") or ())]
first, j = next((s, j) for s, j in joins if j["outcome"] == "joined")
lowest = min(rec.local[first])                   # a survivor's rank
t_first = rec.local[first][int(j["standby"]) * S]["time"]
t_prev = rec.local[first - 1][lowest]["time"]    # survivors' commit of the step before the join


def wall(step):
    return max(v["wall_s"] for v in rec.local[step].values())


before = [wall(s) for s in rec.steps if s < kill_step]
degraded = [wall(s) for s in rec.steps if kill_step <= s < first]
after = [wall(s) for s in rec.steps if s > first]
print(f"kill: step {kill_step} (replica {kill['entry']['replica']}) at t=0")
print(f"join: slot {j['replica']} <- standby {j['standby']}, before step {first}; {joins}")
print(f"kill -> newcomer's first contributing step ({first}) committed: "
      f"{t_first - kill['time']:.2f} s")
print(f"boundary (survivors' commit of step {first - 1} -> newcomer's commit of step {first}): "
      f"{t_first - t_prev:.2f} s, of which step {first} itself {wall(first):.2f} s")
print(f"median step wall s: before {statistics.median(before):.3f}  degraded(kill step incl.) "
      f"{statistics.median(degraded):.3f} x{len(degraded)}  after "
      f"{statistics.median(after) if after else float('nan'):.3f}")
print(f"layout after the join: {rec.steps[max(rec.steps)].layout}")
