"""`recover-hsdp bench hsdp`: failure-free overhead and recovery time of the resilient HSDP path.

Project issue 5, "Benchmark". Every number comes from real `mpirun --with-ft ulfm` jobs started
here, one after the other (never two at once), each with a time limit; docs/bench_hsdp.md has the
definitions, the last figures and their reading. Phases (``--phases``, default all, in this order):

overhead     one job per G in --grad-accum (default 2, then 1) of W x S ranks (default 2 x 2)
             running recover_hsdp.bench.hsdp_worker:
             plain FSDP HYBRID_SHARD (gloo shard group + gloo replicate group, FSDP's own
             all-reduce inside every backward and its own divide) and the resilient
             ``HSDPULFMTrainingManager.train_step`` in the SAME processes, same model, data ids,
             optimizer and lr schedule, steps interleaved ABBA. Per step: median over ranks;
             reported: median over the timed steps of each arm, their ratio (target <= 1.05),
             the median and quartiles of the per-step ratio, and the max parameter difference
             between the arms at the end (same work => float rounding only).
trainer      the real trainer (``python -m recover_hsdp.hsdp.trainer``) with the config of the
             first overhead job and no failures: median ``local.wall_s`` (what train_step
             measures) and the median commit-to-commit interval (adds the per-step record line),
             against that overhead job's baseline median (another job: noisier than the A/B).
nonboundary  W=4, S=1, G=1 trainer runs, each killing replica 3 at step 5 (a boundary: 4 -> 3
             replicas, layout becomes 2 majors + 1 major-spare), replica 0 at step 10 (the spare
             absorbs it: BLOCKING, not a boundary) and replica 1 at step 15 (a boundary again);
             enough runs for ``--kills`` non-boundary kills.
boundary     W=4, S=1, G=2 trainer runs killing replicas 3, 2, 1 at steps 5, 10, 15 (three
             boundaries: 4 -> 3, 3 -> 2, 2 -> 1 replicas); enough runs for ``--kills`` kills.
Every kill is a scheduled SIGKILL at ``reduce`` bucket 1 (partly reduced gradients).

Recovery of one kill, from the run record (classified by the record's own ``boundary`` flag):
  k             the step whose record lists the victim's replica among its failures
  kill->commit  the last survivor's commit time of k (``local.time``) minus the victim's marker
                time (faults/fired.rank*.json, taken just before the SIGKILL). THE HEADLINE:
                SIGKILL -> next commit. The kill sits at reduce bucket 1, after the whole
                microbatch loop, so the only normal work left in k after it is the tail
                (remaining buckets' reduce, consensus, optimizer step: ~10-20 ms, see the overhead
                phases): kill->commit over-states the recovery by that tail, never under-states it
  T_normal      median ``wall_s`` of the normal steps of the same layout before k (the steps since
                the previous failure minus the first one after it, never steps 0-1), per step
                the median over the ranks that commit k
  paper         kill->commit - T_normal (the paper's "minus a normal step"; with a late kill point
                it subtracts work that was already done before the kill: a lower bound)
  excess        median wall_s(k) over those ranks - T_normal (also picks up any pre-kill noise)
  ext           extension microbatches each boundary replica computes (the policy's g_ext, replayed
                from the recorded failures): the boundary step's extra critical-path compute
  protocol      kill->commit - ext * T_normal / g (T_normal / g, one microbatch, includes the
                step's fixed costs / g: generous by ~10-20 ms / g)
Targets (medians over kills, min/max and the count of kills under target shown):
non-boundary kill->commit < 1 s; boundary protocol < 1 s, i.e. kill->commit < 1 s + the
extension microbatches.

Output: a table on stdout and JSON (--out, default bench/results/hsdp.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.harness import median, quartiles, spread

OVERHEAD_TARGET = 1.05
RECOVERY_TARGET_S = 1.0
KILL_BUCKET = 1
KILL_STEPS = (5, 10, 15)
WARM_STEPS = 2          # steps 0 and 1 (allocation, first-touch) never count as normal

MODELS = {
    # conf/model/llama_debug.yaml (the 2-core CPU demo model, 0.89 M parameters)
    "debug": {"name": "llama_debug", "d_model": 128, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_dim": 352, "max_seq_len": 128, "tie_embeddings": True},
    # tests/e2e/test_hsdp_kills.py::_cfg
    "tiny": {"name": "llama_debug", "d_model": 64, "n_layers": 2, "n_heads": 4,
             "n_kv_heads": 2, "ffn_dim": 160, "max_seq_len": 64, "tie_embeddings": True},
}
PHASES = ("overhead", "trainer", "nonboundary", "boundary")


# ------------------------------------------------------------------------------------------
# arguments and configs
# ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = H.parser("hsdp", "Failure-free overhead (vs plain FSDP HYBRID_SHARD) and recovery time "
                 "of the resilient HSDP trainer; see docs/bench_hsdp.md.", out="hsdp.json",
                 timeout=180.0)
    p.add_argument("--phases", type=H.choice_list(PHASES, what="phase"), default=list(PHASES),
                   help=f"comma list of {','.join(PHASES)} (default: all)")
    p.add_argument("--model", choices=sorted(MODELS), default="debug",
                   help="debug = conf/model/llama_debug.yaml (default); tiny = the e2e tests'")
    p.add_argument("--replicas", type=H.positive_int, default=2, help="W of the overhead jobs")
    p.add_argument("--shard-size", type=H.positive_int, default=2,
                   help="S of the overhead jobs (>= 2: with S = 1 FSDP turns HYBRID_SHARD into "
                        "NO_SHARD and the baseline would not reduce across replicas)")
    p.add_argument("--grad-accum", type=H.int_list, default=[2, 1],
                   help="G of the overhead jobs, one job per value (default 2,1); the first is "
                        "the headline and the trainer phase's G")
    p.add_argument("--micro-batch-size", type=H.positive_int, default=2, help="rows per rank")
    p.add_argument("--seq-len", type=H.positive_int, default=64)
    p.add_argument("--steps", type=H.positive_int, default=40, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--kills", type=H.positive_int, default=5,
                   help="at least this many kills per recovery kind (default 5)")
    p.add_argument("--work-dir", default=None,
                   help="where run directories go (default: a temporary one, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.shard_size < 2 and "overhead" in args.phases:
        p.error("--shard-size must be >= 2 for the overhead phase (S = 1 is NO_SHARD in FSDP)")
    if args.seq_len > MODELS[args.model]["max_seq_len"]:
        p.error(f"--seq-len {args.seq_len} > max_seq_len {MODELS[args.model]['max_seq_len']} "
                f"of model {args.model}")
    return args


def make_config(args: argparse.Namespace, run_dir: Path, *, W: int, S: int, G: int, steps: int,
                schedule: Iterable[dict] = ()) -> dict:
    """The resolved config the trainer (and the A/B worker) read; same keys as the e2e tests."""
    schedule = [dict(e) for e in schedule]
    return {
        "model": dict(MODELS[args.model]),
        "data": {"source": "embedded", "seed": 0},
        "parallel": {"replicas": W, "shard_size": S, "grad_accum": G,
                     "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len},
        "policy": {"name": "static"},
        "failures": ({"kind": "schedule", "schedule": schedule} if schedule
                     else {"kind": "none"}),
        "optim": {"lr": 0.003, "warmup_steps": 1},
        "run": {"steps": steps, "output_dir": str(run_dir), "seed": 0, "threads": 1,
                "save_params_every": 0, "shard_timeout_s": 30},
        "debug": {"restore_enabled": True},
    }


def kill(step: int, replica: int) -> dict:
    return {"step": step, "replica": replica, "local_rank": 0, "location": "reduce",
            "bucket": KILL_BUCKET}


def recovery_runs(kind: str, n_kills: int) -> tuple[int, list[list[dict]]]:
    """(G, one schedule per run) for a recovery kind with at least ``n_kills`` of that kind."""
    if kind == "nonboundary":  # one spare-absorbed kill per run
        return 1, [[kill(KILL_STEPS[0], 3), kill(KILL_STEPS[1], 0), kill(KILL_STEPS[2], 1)]
                   for _ in range(n_kills)]
    if kind == "boundary":     # three boundaries per run
        return 2, [[kill(KILL_STEPS[0], 3), kill(KILL_STEPS[1], 2), kill(KILL_STEPS[2], 1)]
                   for _ in range(math.ceil(n_kills / 3))]
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------
def summarize_overhead(rank_results: Sequence[dict]) -> dict:
    """Per step: median over ranks of each arm; then medians, ratios and quartiles."""
    if not rank_results:
        raise ValueError("no rank results")
    w = int(rank_results[0]["warmup"])
    n = min(len(r["baseline_s"]) for r in rank_results)
    base = [median(r["baseline_s"][i] for r in rank_results) for i in range(w, n)]
    res = [median(r["resilient_s"][i] for r in rank_results) for i in range(w, n)]
    per_step = [b and r / b for b, r in zip(base, res)]
    phases: dict[str, dict[str, float | None]] = {}
    for arm in ("baseline", "resilient"):
        keys = sorted({k for r in rank_results for p in r.get(f"{arm}_phases", [])[w:] for k in p})
        phases[arm] = {k: median(median(p[i].get(k, 0.0) for p in
                                        (r[f"{arm}_phases"] for r in rank_results))
                                 for i in range(w, n)) for k in keys}
    mb, mr = median(base), median(res)
    q1, q3 = quartiles(per_step)
    sb, sr = spread(base), spread(res)
    cb, cr = phases["baseline"].get("cpu"), phases["resilient"].get("cpu")
    return {"steps": len(base), "warmup": w, "baseline_s": sb,
            "resilient_s": sr, "ratio": (mr / mb) if mb else None,
            "ratio_p25": (sr["p25"] / sb["p25"]) if sb["p25"] else None,
            "ratio_cpu": (cr / cb) if cb and cr is not None else None,
            "ratio_per_step": {"median": median(per_step), "p25": q1, "p75": q3},
            "phases_s": phases,
            "max_param_diff": max((r.get("max_param_diff") or 0.0) for r in rank_results),
            "param_rel_rms_diff": max((r.get("param_rel_rms_diff") or 0.0)
                                      for r in rank_results),
            "grad_rel_diff_step0": max((r.get("grad_rel_diff_step0") or 0.0)
                                       for r in rank_results),
            "met": bool(mb and mr / mb <= OVERHEAD_TARGET)}


def trainer_steps(rec: Any, warmup: int) -> dict:
    """Median wall_s and commit interval of a failure-free trainer run (per step: over ranks)."""
    steps = [s for s in rec.committed if s >= warmup]
    wall = [median(v.get("wall_s") for v in rec.local[s].values()) for s in steps]
    commit = {s: max(v.get("time", 0.0) for v in rec.local[s].values()) for s in rec.committed}
    gaps = [commit[s] - commit[s - 1] for s in steps if s - 1 in commit and s > 0]
    return {"steps": len(steps), "wall_s": spread(wall), "commit_interval_s": spread(gaps)}


def analyze_kills(rec: Any, w_init: int, g_init: int) -> list[dict]:
    """One dict per fired kill of a run record (see the module docstring for the definitions)."""
    out: list[dict] = []
    fired = sorted((f for f in rec.fired if f), key=lambda f: f.get("time", 0.0))
    failure_steps = sorted(s for s in rec.committed if rec.steps[s].failures)
    g_ext = _replay_extensions(rec, w_init, g_init, failure_steps)
    prev = -1
    for f in fired:
        e = f["entry"]
        victim = int(e["replica"])
        k = next((s for s in failure_steps if s >= int(e["step"]) and any(
            victim in fl.get("replicas", []) for fl in rec.steps[s].failures)), None)
        row: dict[str, Any] = {"kill_step": int(e["step"]), "replica": victim,
                               "location": e.get("location"), "bucket": e.get("bucket"),
                               "handled_step": k}
        if k is None:
            row["error"] = "no committed step records this failure"
            out.append(row)
            continue
        s_rec = rec.steps[k]
        ranks = rec.ranks(k)
        normal = [s for s in range(max(prev + 2, WARM_STEPS), k)
                  if s in rec.steps and not rec.steps[s].failures]
        if len(normal) < 2:
            normal = [s for s in range(max(prev + 1, 1), k)
                      if s in rec.steps and not rec.steps[s].failures]
        t_norm = median(median(rec.local[s][r]["wall_s"] for r in ranks if r in rec.local[s])
                        for s in normal)
        wall_k = median(rec.local[k][r]["wall_s"] for r in ranks)
        t_commit = max(rec.local[k][r]["time"] for r in ranks)
        g = (rec.steps[normal[-1]].layout or {}).get("g") if normal else None
        ext = g_ext.get(victim)
        if ext is None:
            ext = _extension(rec, k, normal[-1] if normal else None)
        k2c = t_commit - float(f["time"])
        row.update({
            "boundary": bool(s_rec.boundary), "restore_mode": s_rec.restore_mode,
            "alive_after": len(s_rec.alive), "g": g, "ext_microbatches": ext,
            "normal_steps": normal, "t_normal_s": t_norm, "wall_s": wall_k,
            "kill_to_commit_s": k2c,
            "excess_s": (wall_k - t_norm) if t_norm is not None else None,
            "paper_s": (k2c - t_norm) if t_norm is not None else None,
        })
        if t_norm is not None and g:
            row["ext_compute_s"] = ext * t_norm / g
            row["protocol_s"] = k2c - row["ext_compute_s"]
        out.append(row)
        prev = k
    return out


def _replay_extensions(rec: Any, w_init: int, g_init: int, failure_steps: list[int]
                       ) -> dict[int, int]:
    """victim replica -> extension microbatches every boundary replica COMPUTED (the policy's
    g_ext), by replaying the recorded failures through the policy the run used. Failures at
    `reduce` come after the whole microbatch loop, which is what ``policy.fail`` assumes."""
    from recover_hsdp.policy import AdaptiveWorldPolicy, StaticWorldPolicy

    name = ((rec.config or {}).get("policy") or {}).get("name", "static")
    pol = (AdaptiveWorldPolicy if name == "adaptive" else StaticWorldPolicy)(w_init, g_init)
    out: dict[int, int] = {}
    try:
        for s in failure_steps:
            for fl in rec.steps[s].failures:
                d = pol.fail(fl["replicas"])
                for r in fl["replicas"]:
                    out[int(r)] = int(d.g_ext) if d.at_boundary else 0
            pol.after_commit()
    except Exception:  # a record the replay cannot follow: fall back to the contributions
        return {}
    return out


def _extension(rec: Any, k: int, before: int | None) -> int:
    """Extension microbatches per replica in step k (0 unless a boundary): the most ids any
    replica contributed in k beyond the per-replica count of the normal step ``before``."""
    if not rec.steps[k].boundary:
        return 0
    g = (rec.steps[before].layout or {}).get("g", 0) if before is not None else 0
    most = max((len(v) for v in rec.steps[k].contributions.values()), default=0)
    return max(0, most - int(g))


def summarize_kills(rows: Sequence[dict], boundary: bool) -> dict:
    ok = [r for r in rows if "error" not in r and r.get("kill_to_commit_s") is not None]
    key = "protocol_s" if boundary else "kill_to_commit_s"
    judged = [r.get(key) for r in ok if r.get(key) is not None]
    head = median(judged)
    return {"kills": len(rows), "measured": len(ok), "boundary": boundary,
            "kill_to_commit_s": spread([r["kill_to_commit_s"] for r in ok]),
            "protocol_s": spread([r.get("protocol_s") for r in ok]),
            "excess_s": spread([r.get("excess_s") for r in ok]),
            "paper_s": spread([r.get("paper_s") for r in ok]),
            "t_normal_s": spread([r.get("t_normal_s") for r in ok]),
            "ext_compute_s": spread([r.get("ext_compute_s") for r in ok]),
            "ext_microbatches": sorted({r["ext_microbatches"] for r in ok}),
            "target": f"median {key} < {RECOVERY_TARGET_S} s",
            "under_target": sum(1 for x in judged if x < RECOVERY_TARGET_S),
            "met": None if head is None else head < RECOVERY_TARGET_S,
            "errors": [r for r in rows if "error" in r]}


# ------------------------------------------------------------------------------------------
# table
# ------------------------------------------------------------------------------------------
def _f(x: float | None, unit: str = "", nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}{unit}"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("MET" if ok else "NOT MET")


def format_table(result: dict) -> str:
    lines = [f"recover-hsdp bench hsdp   ({result.get('command', '')})",
             f"host {result.get('host', '?')}, {result.get('cpus', '?')} cpus, torch "
             f"{result.get('torch', '?')}; load (1/5/15 min) at start "
             f"{_load(result.get('load_start'))}, at end {_load(result.get('load_end'))}; "
             f"wall {_f(result.get('wall_s'), ' s', 0)}"]
    for ov in result.get("overhead") or []:
        c = ov["config"]
        lines += ["", f"failure-free step time: W={c['W']} S={c['S']} G={c['G']}, model "
                  f"{c['model']} seq {c['seq_len']} x {c['mbs']} rows/rank, {ov['steps']} "
                  f"interleaved steps per arm (+{ov['warmup']} warm-up), load "
                  f"{_load(ov.get('load'))}",
                  f"  {'arm':<50} {'median':>8} {'p25':>8} {'p75':>8}"]
        for key, label in (("baseline_s", "plain FSDP HYBRID_SHARD (gloo + gloo)"),
                           ("resilient_s", "resilient HSDPULFMTrainingManager.train_step")):
            s = ov[key]
            lines.append(f"  {label:<50} {_f(s['median'], ' s'):>8} {_f(s['p25'], ' s'):>8} "
                         f"{_f(s['p75'], ' s'):>8}")
        rp = ov["ratio_per_step"]
        lines.append(f"  {'ratio resilient / baseline':<50} {_f(ov['ratio']):>8} "
                     f"{_f(ov.get('ratio_p25')):>8}   target <= {OVERHEAD_TARGET} (medians): "
                     f"{_verdict(ov.get('met'))}")
        lines.append(f"  per-step ratio (same step, both arms): median {_f(rp['median'])} "
                     f"[p25 {_f(rp['p25'])}, p75 {_f(rp['p75'])}]; CPU time ratio (medians) "
                     f"{_f(ov.get('ratio_cpu'))}")
        for arm, ph in ov.get("phases_s", {}).items():
            lines.append(f"  {arm} phases (median s): " + ", ".join(
                f"{k} {_f(v)}" for k, v in ph.items()))
        lines.append(f"  same work: step-0 gradient max rel diff "
                     f"{ov.get('grad_rel_diff_step0') or 0.0:.1e}; params at the end: max abs "
                     f"diff {ov.get('max_param_diff') or 0.0:.1e}, rel RMS "
                     f"{ov.get('param_rel_rms_diff') or 0.0:.1e}")
    tr = result.get("trainer")
    if tr:
        lines += ["", f"real trainer run (separate job, config of the G={tr['config']['G']} "
                  f"overhead job, no failures): "
                  f"wall_s median {_f(tr['wall_s']['median'], ' s')}, commit interval median "
                  f"{_f(tr['commit_interval_s']['median'], ' s')}; vs the overhead job's "
                  f"baseline: {_f(tr.get('ratio_wall'))} (wall_s), "
                  f"{_f(tr.get('ratio_commit'))} (commit interval); load {_load(tr.get('load'))}"]
    kinds = result.get("recovery") or {}
    if kinds:
        lines += ["", "recovery: SIGKILL at reduce bucket 1 -> commit of that step (kill->commit, "
                  "conservative); protocol = kill->commit - ext x T_normal/g; excess = "
                  "wall(step) - T_normal; paper = kill->commit - T_normal",
                  f"  {'kind':<24} {'n':>3} {'kill->commit med [min, max]':>29} "
                  f"{'protocol':>9} {'excess':>8} {'paper':>8} {'T_normal':>9} {'ext mb':>7}"
                  f"  target"]
        for name, s in kinds.items():
            k = s["kill_to_commit_s"]
            tgt = (("protocol" if s.get("boundary") else "kill->commit") + " < 1 s: "
                   f"{_verdict(s.get('met'))} ({s.get('under_target', 0)}/{k['n']} kills)")
            rng = f"{_f(k['median'])} [{_f(k['min'])}, {_f(k['max'])}] s"
            lines.append(
                f"  {name:<24} {k['n']:>3} {rng:>29} {_f(s['protocol_s']['median'], ' s'):>9} "
                f"{_f(s['excess_s']['median'], ' s'):>8} {_f(s['paper_s']['median'], ' s'):>8} "
                f"{_f(s['t_normal_s']['median'], ' s'):>9} "
                f"{','.join(str(x) for x in s['ext_microbatches']) or '-':>7}  {tgt}")
            for e in s.get("errors", []):
                lines.append(f"    ! kill {e}")
    for err in result.get("errors", []):
        lines.append(f"! {err}")
    if result.get("out"):
        lines += ["", f"JSON: {result['out']}"]
    return "\n".join(lines)


def _load(x: Sequence[float] | None) -> str:
    return "-" if not x else "/".join(f"{v:.1f}" for v in x)


def _say(msg: str) -> None:
    H.say("hsdp", msg)


# ------------------------------------------------------------------------------------------
# jobs
# ------------------------------------------------------------------------------------------
def launch(name: str, module: str, cfg: dict, work: Path, timeout: float,
           extra_args: Sequence[str] = ()) -> dict:
    """Run one mpirun job of W x S ranks (``python -m module CFG [extra]``) with a store served
    here; output goes to WORK/NAME.log. Returns {ok?, wall_s, load, log, returncode, stopped}."""
    import yaml

    from recover_hsdp import launch as L
    from recover_hsdp.hsdp.fsdp_hybrid import serve_store

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    n = int(cfg["parallel"]["replicas"]) * int(cfg["parallel"]["shard_size"])
    log = work / f"{name}.log"
    with serve_store(L.default_store_host()) as addr:
        env = L.rank_env(addr, omp_num_threads=1,
                         shard_timeout_s=cfg["run"].get("shard_timeout_s"))
        cmd = ([L.find_mpirun()] + L.base_mpirun_args(n, export=L.exported_vars(env))
               + [sys.executable, "-m", module, str(cfg_path), *extra_args])
        with open(os.devnull, "wb") as sink:
            o = L.run_job(cmd, env, log_path=log, time_limit_s=timeout, stdout=sink)
    return {"name": name, "wall_s": o.wall_s, "returncode": o.returncode, "stopped": o.stopped,
            "log": str(log), "load": H.load()}


def run_overhead(args, work: Path, result: dict, G: int) -> None:
    W, S = args.replicas, args.shard_size
    name = f"overhead_g{G}"
    cfg = make_config(args, work / name / "run", W=W, S=S, G=G,
                      steps=args.warmup + args.steps)
    cfg["bench"] = {"warmup": args.warmup, "steps": args.steps}
    out_dir = work / name / "ranks"
    _say(f"overhead: {W}x{S} ranks, G={G}, {args.warmup}+{args.steps} steps per arm")
    job = launch(name, "recover_hsdp.bench.hsdp_worker", cfg, work, args.timeout,
                 [str(out_dir)])
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    if len(ranks) != W * S:
        result["errors"].append(f"{name} job: {len(ranks)}/{W * S} ranks reported "
                                f"(stopped={job['stopped']}); log {job['log']}:\n"
                                + H.tail(job["log"]))
        return
    s = summarize_overhead(ranks)
    s.update(config={"W": W, "S": S, "G": G, "model": args.model, "seq_len": args.seq_len,
                     "mbs": args.micro_batch_size}, load=job["load"], job=job,
             raw=[{k: r[k] for k in ("rank", "baseline_s", "resilient_s", "first",
                                     "baseline_phases", "resilient_phases")}
                  for r in ranks])
    result.setdefault("overhead", []).append(s)


def run_trainer(args, work: Path, result: dict) -> None:
    from recover_hsdp.record import read_run

    W, S, G = args.replicas, args.shard_size, args.grad_accum[0]
    run_dir = work / "trainer" / "run"
    cfg = make_config(args, run_dir, W=W, S=S, G=G, steps=args.warmup + args.steps)
    _say(f"trainer: {W}x{S} ranks, {args.warmup + args.steps} steps, no failures")
    job = launch("trainer", "recover_hsdp.hsdp.trainer", cfg, work, args.timeout)
    if not (run_dir / "summary.json").exists():
        result["errors"].append(f"trainer job did not finish (stopped={job['stopped']}); log "
                                f"{job['log']}:\n" + H.tail(job["log"]))
        return
    s = trainer_steps(read_run(run_dir), args.warmup)
    ref = [o for o in result.get("overhead") or [] if o["config"]["G"] == G]
    base = ref[0]["baseline_s"]["median"] if ref else None
    s.update(load=job["load"], job=job, config={"W": W, "S": S, "G": G},
             ratio_wall=(s["wall_s"]["median"] / base) if base else None,
             ratio_commit=(s["commit_interval_s"]["median"] / base) if base else None)
    result["trainer"] = s


def run_recovery(args, work: Path, result: dict, kind: str) -> None:
    from recover_hsdp.record import read_run

    G, schedules = recovery_runs(kind, args.kills)
    W, S = 4, 1
    rows: list[dict] = []
    for i, schedule in enumerate(schedules):
        name = f"{kind}{i}"
        run_dir = work / name / "run"
        cfg = make_config(args, run_dir, W=W, S=S, G=G, steps=KILL_STEPS[-1] + 1,
                          schedule=schedule)
        _say(f"{kind} run {i + 1}/{len(schedules)}: W={W} S={S} G={G}, kills at steps "
             f"{','.join(str(e['step']) for e in schedule)}")
        job = launch(name, "recover_hsdp.hsdp.trainer", cfg, work, args.timeout)
        if not (run_dir / "summary.json").exists():
            result["errors"].append(f"{name} did not finish (stopped={job['stopped']}); log "
                                    f"{job['log']}:\n" + H.tail(job["log"]))
            continue
        rec = read_run(run_dir)
        for r in analyze_kills(rec, W, G):
            r.update(run=name, G_init=G, load=job["load"])
            rows.append(r)
    result.setdefault("kills", []).extend(rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "error" in r:
            groups.setdefault(f"{'boundary' if kind == 'boundary' else 'nonboundary'} (W=4 G={G})",
                              []).append(r)
            continue
        label = (f"boundary (W=4 G={G})" if r["boundary"] else f"nonboundary (W=4 G={G})")
        groups.setdefault(label, []).append(r)
    rec_out = result.setdefault("recovery", {})
    for label, rs in groups.items():
        rec_out[label] = summarize_kills(rs, boundary=not label.startswith("nonboundary"))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    import torch

    shown = " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    result: dict[str, Any] = {
        "command": ("recover-hsdp bench hsdp " + shown).strip(),
        **H.machine(torch=torch.__version__), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "errors": [],
        "targets": {"overhead_ratio_max": OVERHEAD_TARGET, "recovery_s_max": RECOVERY_TARGET_S},
        "args": {k: v for k, v in vars(args).items()},
    }
    own_tmp = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="bench_hsdp_") if own_tmp else args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    result["work_dir"] = str(work)
    try:
        for phase in args.phases:
            if phase == "overhead":
                for G in args.grad_accum:
                    run_overhead(args, work, result, G)
            elif phase == "trainer":
                run_trainer(args, work, result)
            else:
                run_recovery(args, work, result, phase)
    finally:
        result["load_end"] = H.load()
        result["wall_s"] = time.time() - t0
        result["out"] = str(H.write_json(args.out, result))
        if own_tmp and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(format_table(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
