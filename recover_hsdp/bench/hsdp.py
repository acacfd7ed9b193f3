"""`recover-hsdp bench hsdp`: failure-free overhead and recovery time of the resilient HSDP path.

The HSDP benchmark. Every number comes from real `mpirun --with-ft ulfm` jobs started
here, one after the other (never two at once), each with a time limit; docs/bench_hsdp.md has the
definitions, the last figures and their reading. Phases (``--phases``, default all, in this order):

overhead     one job per G in --grad-accum (default 2, then 1) of W x S ranks (default 2 x 2)
             running recover_hsdp.workers.bench_hsdp:
             plain FSDP HYBRID_SHARD (gloo shard group + gloo replicate group, FSDP's own
             all-reduce inside every backward and its own divide) and the resilient
             ``HSDPULFMTrainingManager.train_step`` in the SAME processes, same model, data ids,
             optimizer and lr schedule, steps interleaved ABBA. Per step: median over ranks;
             reported: median over the timed steps of each arm, their ratio (target <= 1.05),
             the median and quartiles of the per-step ratio, and the max parameter difference
             between the arms at the end (same work => float rounding only).
trainer      the real trainer (``python -m recover_hsdp.workers.resilient``) with the config of the
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
exposed      the gloo data plane (docs/dataplane.md), deferred vs overlapped: per G in
             --grad-accum, two failure-free trainer jobs of W x S ranks on the 8-layer model
             (most bytes in the non-root units, so most buckets can be posted inside the last
             backward), parallel.replicate_data_plane=gloo with parallel.overlap=false, then
             true. Per step: ``local.reduce_exposed_s`` (end of the pass's microbatch loop ->
             every bucket reduced at this rank), median over ranks; reported: the median over
             the timed steps of each job and their ratio overlapped / deferred (target <= 0.5),
             with the step's wall_s beside it and the load.

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
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from recover_hsdp.bench import harness as H
from recover_hsdp.bench.hsdp_analysis import (OVERHEAD_TARGET, RECOVERY_TARGET_S, analyze_kills,
                                              format_table, summarize_kills, summarize_overhead,
                                              trainer_steps)

KILL_BUCKET = 1
KILL_STEPS = (5, 10, 15)

MODELS = {
    # conf/model/llama_debug.yaml (the 2-core CPU demo model, 0.89 M parameters)
    "debug": {"name": "llama_debug", "d_model": 128, "n_layers": 2, "n_heads": 4,
              "n_kv_heads": 2, "ffn_dim": 352, "max_seq_len": 128, "tie_embeddings": True},
    # tests/e2e/test_hsdp_kills.py::_cfg
    "tiny": {"name": "llama_debug", "d_model": 64, "n_layers": 2, "n_heads": 4,
             "n_kv_heads": 2, "ffn_dim": 160, "max_seq_len": 64, "tie_embeddings": True},
    # the exposed phase: 8 decoder blocks, most bytes outside the root (embeddings, norm)
    "deep": {"name": "llama_debug", "d_model": 128, "n_layers": 8, "n_heads": 4,
             "n_kv_heads": 2, "ffn_dim": 352, "max_seq_len": 128, "tie_embeddings": True},
}
PHASES = ("overhead", "trainer", "nonboundary", "boundary", "exposed")
EXPOSED_TARGET = 0.5


# ------------------------------------------------------------------------------------------
# arguments and configs
# ------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = H.parser(
        "hsdp", "Failure-free overhead (vs plain FSDP HYBRID_SHARD) and recovery time of the "
        "resilient HSDP trainer; see docs/bench_hsdp.md.", out="hsdp.json", timeout=180.0,
        phases=(list(PHASES), f"comma list of {','.join(PHASES)} (default: all)",
                H.choice_list(PHASES, what="phase")),
        replicas=(2, "W of the overhead jobs", H.positive_int),
        shard_size=(2, "S of the overhead jobs (>= 2: with S = 1 FSDP turns HYBRID_SHARD into "
                    "NO_SHARD and the baseline would not reduce across replicas)", H.positive_int),
        grad_accum=([2, 1], "G of the overhead jobs, one job per value (default 2,1); the first "
                    "is the headline and the trainer phase's G", H.int_list),
        micro_batch_size=(2, "rows per rank", H.positive_int),
        seq_len=(64, "tokens per sequence (default 64)", H.positive_int),
        steps=(40, "timed steps per arm", H.positive_int),
        warmup=(3, "untimed steps first", H.nonneg_int),
        kills=(5, "at least this many kills per recovery kind (default 5)", H.positive_int),
        work_dir=(None, "where run directories go (default: a temporary one, removed at the end)",
                  str), keep=(False, "keep the run directories"))
    p.add_argument("--model", choices=sorted(MODELS), default="debug",
                   help="debug = conf/model/llama_debug.yaml (default); tiny = the e2e tests'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="a config override for the jobs of the overhead / trainer / "
                        "nonboundary / boundary phases (repeatable), e.g. --set "
                        "parallel.replicate_data_plane=gloo, --set parallel.fsdp=2 (overhead: "
                        "against plain FSDP2 HSDP); dotted keys, YAML values")
    args = p.parse_args(list(argv) if argv is not None else None)
    for s in args.sets:
        if "=" not in s or not s.split("=", 1)[0]:
            p.error(f"--set {s!r}: expected KEY=VALUE")
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
        "run": {"steps": steps, "output_dir": str(run_dir), "seed": 0, "omp_num_threads": 1,
                "save_params_every": 0},
        "watchdog": {"shard_timeout_s": 30},
        "debug": {"restore_enabled": True},
    }


def apply_sets(cfg: dict, sets: Sequence[str]) -> dict:
    """``--set a.b=v`` overrides into the resolved config (YAML values: true, 3, gloo)."""
    import yaml

    for s in sets:
        key, value = s.split("=", 1)
        node = cfg
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = yaml.safe_load(value)
    return cfg


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


_say = functools.partial(H.say, "hsdp")


# ------------------------------------------------------------------------------------------
# jobs
# ------------------------------------------------------------------------------------------
def launch(name: str, module: str, cfg: dict, work: Path, timeout: float,
           extra_args: Sequence[str] = ()) -> dict:
    """Run one mpirun job of W x S ranks (``python -m module CFG [extra]``) with a store served
    here; output goes to WORK/NAME.log. Returns {ok?, wall_s, load, log, returncode, stopped}."""
    import yaml

    from recover_hsdp.launcher import command as L
    from recover_hsdp.launcher.run import run_job
    from recover_hsdp.launcher.store import default_store_host
    from recover_hsdp.hsdp.topology import serve_store

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    n = int(cfg["parallel"]["replicas"]) * int(cfg["parallel"]["shard_size"])
    log = work / f"{name}.log"
    with serve_store(default_store_host()) as addr:
        env = L.rank_env(addr, omp_num_threads=1,
                         shard_timeout_s=cfg.get("watchdog", {}).get("shard_timeout_s"))
        cmd = ([L.find_mpirun()] + L.base_mpirun_args(n, export=L.exported_vars(env))
               + [sys.executable, "-m", module, str(cfg_path), *extra_args])
        with open(os.devnull, "wb") as sink:
            o = run_job(cmd, env, log_path=log, time_limit_s=timeout, stdout=sink)
    return {"name": name, "wall_s": o.wall_s, "returncode": o.returncode, "stopped": o.stopped,
            "log": str(log), "load": H.load()}


def _failed(result: dict, what: str, job: dict) -> None:
    result["errors"].append(f"{what} (stopped={job['stopped']}); log {job['log']}:\n"
                            + H.tail(job["log"]))


def run_overhead(args, work: Path, result: dict, G: int) -> None:
    W, S = args.replicas, args.shard_size
    name = f"overhead_g{G}"
    cfg = apply_sets(make_config(args, work / name / "run", W=W, S=S, G=G,
                                 steps=args.warmup + args.steps), args.sets)
    cfg["bench"] = {"warmup": args.warmup, "steps": args.steps}
    out_dir = work / name / "ranks"
    _say(f"overhead: {W}x{S} ranks, G={G}, {args.warmup}+{args.steps} steps per arm")
    job = launch(name, "recover_hsdp.workers.bench_hsdp", cfg, work, args.timeout,
                 [str(out_dir)])
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    if len(ranks) != W * S:
        _failed(result, f"{name} job: {len(ranks)}/{W * S} ranks reported", job)
        return
    s = summarize_overhead(ranks)
    s.update(config={"W": W, "S": S, "G": G, "model": args.model, "seq_len": args.seq_len,
                     "mbs": args.micro_batch_size,
                     "fsdp": int(cfg["parallel"].get("fsdp", 1))}, load=job["load"], job=job,
             raw=[{k: r[k] for k in ("rank", "baseline_s", "resilient_s", "first",
                                     "baseline_phases", "resilient_phases")}
                  for r in ranks])
    result.setdefault("overhead", []).append(s)


def run_trainer(args, work: Path, result: dict) -> None:
    from recover_hsdp.record import read_run

    W, S, G = args.replicas, args.shard_size, args.grad_accum[0]
    run_dir = work / "trainer" / "run"
    cfg = apply_sets(make_config(args, run_dir, W=W, S=S, G=G, steps=args.warmup + args.steps),
                     args.sets)
    _say(f"trainer: {W}x{S} ranks, {args.warmup + args.steps} steps, no failures")
    job = launch("trainer", "recover_hsdp.workers.resilient", cfg, work, args.timeout)
    if not (run_dir / "summary.json").exists():
        _failed(result, "trainer job did not finish", job)
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
        cfg = apply_sets(make_config(args, run_dir, W=W, S=S, G=G, steps=KILL_STEPS[-1] + 1,
                                     schedule=schedule), args.sets)
        _say(f"{kind} run {i + 1}/{len(schedules)}: W={W} S={S} G={G}, kills at steps "
             f"{','.join(str(e['step']) for e in schedule)}")
        job = launch(name, "recover_hsdp.workers.resilient", cfg, work, args.timeout)
        if not (run_dir / "summary.json").exists():
            _failed(result, f"{name} did not finish", job)
            continue
        rec = read_run(run_dir)
        for r in analyze_kills(rec, W, G):
            r.update(run=name, G_init=G, load=job["load"])
            rows.append(r)
    result.setdefault("kills", []).extend(rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        b = kind == "boundary" if "error" in r else r["boundary"]
        groups.setdefault(f"{'boundary' if b else 'nonboundary'} (W=4 G={G})", []).append(r)
    rec_out = result.setdefault("recovery", {})
    for label, rs in groups.items():
        rec_out[label] = summarize_kills(rs, boundary=not label.startswith("nonboundary"))


def run_exposed(args, work: Path, result: dict) -> None:
    """The exposed reduction on the gloo plane, deferred vs overlapped (module docstring)."""
    from statistics import median

    from recover_hsdp.record import read_run

    W, S = args.replicas, args.shard_size
    rows = []
    for G in args.grad_accum:
        row: dict = {"config": {"W": W, "S": S, "G": G, "model": "deep", "plane": "gloo"}}
        for overlap in (False, True):
            arm = "overlapped" if overlap else "deferred"
            name = f"exposed_g{G}_{arm}"
            run_dir = work / name / "run"
            cfg = make_config(args, run_dir, W=W, S=S, G=G, steps=args.warmup + args.steps)
            cfg["model"] = dict(MODELS["deep"])
            cfg["parallel"].update(replicate_data_plane="gloo", overlap=overlap)
            _say(f"exposed: {W}x{S} ranks, G={G}, gloo, {arm}, {args.warmup + args.steps} steps")
            job = launch(name, "recover_hsdp.workers.resilient", cfg, work, args.timeout)
            if not (run_dir / "summary.json").exists():
                _failed(result, f"{name} did not finish", job)
                break
            rec = read_run(run_dir)
            steps = [s for s in rec.committed if s >= max(1, args.warmup)]
            exp = [median(v["reduce_exposed_s"] for v in rec.local[s].values()) for s in steps]
            wall = [median(v["wall_s"] for v in rec.local[s].values()) for s in steps]
            row[arm] = {"exposed_s": median(exp), "wall_s": median(wall), "steps": len(steps),
                        "load": job["load"],
                        "posted_early": max(int(v.get("posted_early", 0))
                                            for v in rec.local[rec.committed[-1]].values())}
        if "deferred" in row and "overlapped" in row:
            row["ratio"] = row["overlapped"]["exposed_s"] / row["deferred"]["exposed_s"]
            row["ratio_wall"] = row["overlapped"]["wall_s"] / row["deferred"]["wall_s"]
        rows.append(row)
    result["exposed"] = rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    import torch

    result = H.result("hsdp", argv, args, torch=torch.__version__, targets={
        "overhead_ratio_max": OVERHEAD_TARGET, "recovery_s_max": RECOVERY_TARGET_S})
    with H.work_dir(args.work_dir, "bench_hsdp_", args.keep) as work:
        result["work_dir"] = str(work)
        try:
            for phase in args.phases:
                if phase == "overhead":
                    for G in args.grad_accum:
                        run_overhead(args, work, result, G)
                elif phase == "trainer":
                    run_trainer(args, work, result)
                elif phase == "exposed":
                    run_exposed(args, work, result)
                else:
                    run_recovery(args, work, result, phase)
        finally:
            result["load_end"] = H.load()
            result["wall_s"] = time.time() - t0
            result["out"] = str(H.write_json(args.out, result))
    print(format_table(result), flush=True)
    for row in result.get("exposed") or []:
        c, d, o = row["config"], row.get("deferred"), row.get("overlapped")
        if d and o:
            print(f"exposed reduction (gloo, W={c['W']} S={c['S']} G={c['G']}, 8-layer model): "
                  f"deferred {d['exposed_s'] * 1e3:.1f} ms, overlapped {o['exposed_s'] * 1e3:.1f}"
                  f" ms, ratio {row['ratio']:.2f} (target <= {EXPOSED_TARGET}); step wall "
                  f"{d['wall_s'] * 1e3:.0f} -> {o['wall_s'] * 1e3:.0f} ms; load {o['load']}",
                  flush=True)
    return 1 if result["errors"] else 0
