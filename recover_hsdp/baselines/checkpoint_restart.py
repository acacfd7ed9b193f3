"""The checkpoint-restart supervisor: relaunch the whole job after every failure (docs/baselines.md).

Runs in the launcher (the process running ``recover-hsdp train baseline=checkpoint_restart``):

    for attempt k = 0, 1, ...:
        host a NEW TCPStore, run a NEW plain ``mpirun`` (no ``--with-ft ulfm``: a rank that dies
        on a signal makes mpirun abort the whole job) with RECOVER_HSDP_ATTEMPT=k
        -> the ranks (workers/plain.py) load the newest complete checkpoint and train on
        under the supervisor every launch shares (launcher/supervise.py): the watchdog
        SIGKILLs a rank with no heartbeat or no progress (the ranks beat and tick as the
        resilient trainer's do), which aborts the attempt as any death does; a start whose
        world never formed is launched again (elastic.start_retries); an mpirun that outlives
        its ranks is stopped
        when mpirun exits: append restarts.jsonl; stop when [0, run.steps) is committed,
        relaunch when the attempt died (a fault marker newer than its launch, a watchdog
        verdict, or progress and a non-zero exit), give up after baseline.max_restarts
        relaunches (exit 1, one line)
    write summary.json (steps, attempts, the A-H breakdown of every failure)

Breakdown of a failure (paper appendix A.1), from the events of the killed attempt k and of
attempt k+1: A = ckpt_save_start of the last checkpoint started before the kill (earliest rank),
B = its ckpt_save_end (latest rank), C = the kill (fired marker ``time``), D = attempt k's
``exit_time`` (mpirun reaped), E = attempt k+1's ckpt_load_start (earliest rank), F = its
ckpt_load_end (latest rank), G = its train_start (latest rank), H = the commit (latest rank's
``local.time``) in attempt k+1 of the step the kill landed in. save = B-A, normal = C-B,
failure_handling = D-C, load = F-E, restart_init = G-D-(F-E), rerun = H-G. With no checkpoint
before the kill, A = B = attempt k's train_start (save = 0) and E = F (load = 0).
"""
from __future__ import annotations

import json
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from recover_hsdp.baselines import PLAIN_WORKER_FN, RESTARTS
from recover_hsdp.workers.plain import ENV_ATTEMPT, attempt_dir, latest_checkpoint
from recover_hsdp.launcher.job import (LAUNCHER_DIR, PROG, ULFM_FLAGS,  # noqa: F401
                                       JobResult, holds_run, job_command, job_env,
                                       plain_mpirun, print_error, say)
from recover_hsdp.launcher.judge import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK,  # noqa: F401
                                         EXIT_TIME_LIMIT)



def read_events(run_dir: Path, attempt: int) -> dict[int, list[dict]]:
    """rank -> events of one attempt."""
    from recover_hsdp.record import read_jsonl

    out: dict[int, list[dict]] = {}
    d = attempt_dir(run_dir, attempt)
    for p in sorted(d.glob("events.rank*.jsonl")):
        out[int(p.name[len("events.rank"):-len(".jsonl")])] = read_jsonl(p)[0]
    return out


def read_attempt_steps(run_dir: Path, attempt: int) -> dict[int, dict]:
    """step -> {"loss", "time" (latest rank's commit), "ranks"} committed by one attempt."""
    from recover_hsdp.record import read_jsonl

    out: dict[int, dict] = {}
    for p in sorted((attempt_dir(run_dir, attempt) / "steps").glob("rank*.jsonl")):
        for rec in read_jsonl(p)[0]:
            s = int(rec["step"])
            t = float(rec.get("local", {}).get("time", 0.0))
            cur = out.setdefault(s, {"loss": rec.get("loss"), "time": t, "ranks": 0})
            cur["time"] = max(cur["time"], t)
            cur["ranks"] += 1
    return out


def _ev(events: dict[int, list[dict]], name: str, agg, step: int | None = None,
        before: float | None = None) -> float | None:
    ts = [e["time"] for evs in events.values() for e in evs if e.get("event") == name
          and (step is None or e.get("step") == step) and (before is None or e["time"] <= before)]
    return agg(ts) if ts else None


def breakdown(run_dir: Path, restarts: list[dict], fired: list[dict],
              world: int | None = None) -> list[dict]:
    """The A-H breakdown of every failure (module docstring); one dict per killed attempt."""
    out = []
    for k, r in enumerate(restarts[:-1]):
        kills = [f for f in fired if r["launch_time"] <= f["time"] <= r["exit_time"]]
        if not kills:
            continue
        C = min(f["time"] for f in kills)
        kill_step = min(int(f["entry"]["step"]) for f in kills)
        ev_k, ev_n = read_events(run_dir, k), read_events(run_dir, k + 1)
        # the last checkpoint started before the kill (its step: ckpt_save_start's "step")
        starts = [(e["time"], e.get("step")) for evs in ev_k.values() for e in evs
                  if e.get("event") == "ckpt_save_start" and e["time"] <= C]
        if starts:
            ck = max(s for _, s in starts)
            A = _ev(ev_k, "ckpt_save_start", min, ck)
            Bt = _ev(ev_k, "ckpt_save_end", max, ck) or A
        else:
            ck = None
            A = Bt = _ev(ev_k, "train_start", max)
        D = r["exit_time"]
        E = _ev(ev_n, "ckpt_load_start", min)
        F = _ev(ev_n, "ckpt_load_end", max)
        G = _ev(ev_n, "train_start", max)
        if E is None or F is None:
            E = F = G
        H = read_attempt_steps(run_dir, k + 1).get(kill_step, {}).get("time")
        row: dict[str, Any] = {"attempt": k, "kill_step": kill_step, "ckpt_step": ck,
                               "resume_step": restarts[k + 1].get("resume_step"),
                               "A": A, "B": Bt, "C": C, "D": D, "E": E, "F": F, "G": G, "H": H}

        def d(a, b):
            return None if a is None or b is None else round(a - b, 6)

        row.update(save=d(Bt, A), normal=d(C, Bt), failure_handling=d(D, C), load=d(F, E),
                   restart_init=None if None in (G, D, F, E) else round(G - D - (F - E), 6),
                   rerun=d(H, G))
        row["total"] = d(H, A)
        out.append(row)
    return out


def run_checkpoint_restart(job) -> Any:
    """Run a ``baseline=checkpoint_restart`` job to completion; return launcher.job.JobResult."""
    from omegaconf import OmegaConf

    from recover_hsdp.launcher.command import ENV_WORKER_FN
    from recover_hsdp.launcher.store import default_store_host
    from recover_hsdp.launcher.supervise import Watch, retry_notice, supervise
    from recover_hsdp.record import JsonlAppender, write_summary

    cfg = job.cfg
    run_dir = job.run_dir
    steps = int(cfg.run.steps)
    max_restarts = int(cfg.baseline.max_restarts)
    if cfg.run.overwrite and holds_run(run_dir):
        shutil.rmtree(run_dir)
    ldir = run_dir / LAUNCHER_DIR
    ldir.mkdir(parents=True, exist_ok=True)
    config_path = ldir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    host = cfg.run.store_host or default_store_host()
    restarts_out = JsonlAppender(run_dir / RESTARTS, fresh=True)
    restarts: list[dict] = []
    committed: dict[int, dict] = {}
    res = JobResult(job, "failed", EXIT_FAILED, steps)
    t_begin = time.monotonic()
    deadline = None if cfg.run.time_limit_s is None else t_begin + float(cfg.run.time_limit_s)
    attempt = 0
    stopped = None
    try:
        while True:
            resume = latest_checkpoint(run_dir) or 0

            def prepare(store: str, attempt=attempt, resume=resume):
                env = job_env(job, store)
                env[ENV_ATTEMPT] = str(attempt)
                env.setdefault(ENV_WORKER_FN, PLAIN_WORKER_FN)
                cmd = job_command(job, config_path, env)   # plain_mpirun: no ULFM
                cmd = cmd[:1] + ["-x", ENV_ATTEMPT] + cmd[1:]
                if attempt == 0:
                    (ldir / "command.sh").write_text(
                        f"RECOVER_HSDP_STORE={shlex.quote(store)} {ENV_ATTEMPT}=<k> "
                        f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} \\\n  {shlex.join(cmd)}\n")
                    print(f"[{PROG}] run directory {run_dir}", flush=True)
                    print(f"[{PROG}] {shlex.join(cmd)}", flush=True)
                print(f"[{PROG}] checkpoint_restart: attempt {attempt} from step {resume}",
                      flush=True)
                return cmd, env

            launch_time = time.time()
            # the supervisor of every launch (launcher/supervise.py): a hung or wedged rank is
            # SIGKILLed by the watchdog, which aborts this plain job -> a failure relaunched here
            launched = supervise(prepare, run_dir=run_dir, np=int(cfg.run.np),
                                 watch=Watch.of(cfg), log_path=ldir / "output.log",
                                 store_host=host, deadline=deadline,
                                 start_retries=int(cfg.elastic.start_retries),
                                 on_retry=retry_notice(say, "elastic.start_retries",
                                                       f"attempt {attempt}"))
            outcome = launched.outcome
            exit_time = time.time()
            new = read_attempt_steps(run_dir, attempt)
            for s, v in new.items():
                committed.setdefault(s, v)
            fired = [f for f in _fired(run_dir) if launch_time <= f["time"] <= exit_time]
            hung = [v for v in _fault_records(run_dir, "hung")   # the watchdog's verdicts
                    if launch_time <= v["time"] <= exit_time]
            done = set(range(steps)) <= set(committed)
            # "ended" (mpirun outlived its ranks) and "startup" (the world never formed) are
            # attempts that ended; a time limit or an interrupt stops the run
            halted = outcome.stopped if outcome.stopped in ("time_limit", "interrupted") else None
            if halted:
                reason = halted
            elif done:
                reason = "completed"
            elif fired:
                reason = "killed: " + "; ".join(
                    f"rank {f['rank']} at step {f['entry']['step']} {f['entry']['location']}"
                    + (f" ({f['entry']['kind']})" if f["entry"].get("kind", "kill") != "kill"
                       else "") for f in fired)
            elif hung:
                reason = "judged by the watchdog: " + "; ".join(
                    f"rank {v['rank']} ({v['reason']})" for v in hung)
            else:
                reason = (f"exited rc={outcome.returncode} without a scheduled kill"
                          + (f" ({outcome.stopped}: {outcome.reason})" if outcome.stopped
                             else ""))
            if fired and hung:
                reason += "; judged by the watchdog: " + "; ".join(
                    f"rank {v['rank']}" for v in hung)
            rec = {"attempt": attempt, "launch_time": launch_time, "exit_time": exit_time,
                   "rc": outcome.returncode, "resume_step": resume, "reason": reason,
                   "steps_committed": sorted(new)}
            restarts_out.append(rec)
            restarts.append(rec)
            print(f"[{PROG}] checkpoint_restart: attempt {attempt} ended after "
                  f"{exit_time - launch_time:.1f} s (mpirun rc {outcome.returncode}): {reason}",
                  flush=True)
            if halted or done:
                stopped = halted
                break
            if not fired and not hung and not new:
                res.note = (f"attempt {attempt} made no progress and no scheduled kill fired "
                            f"(mpirun rc {outcome.returncode}); see {ldir / 'output.log'}")
                break
            if attempt >= max_restarts:
                print_error(f"baseline.max_restarts({max_restarts}) exceeded: {len(committed)}/{steps} "
                     f"steps committed after {attempt + 1} attempts")
                res.note = f"baseline.max_restarts({max_restarts}) exceeded"
                break
            attempt += 1
    except (OSError, RuntimeError) as e:
        res.note = f"could not launch: {' '.join(str(e).split())}"
    finally:
        restarts_out.close()
    fired_all = _fired(run_dir)
    rows = breakdown(run_dir, restarts, fired_all)
    tokens_per_step = (int(cfg.parallel.replicas) * int(cfg.parallel.grad_accum)
                       * int(cfg.parallel.micro_batch_size) * int(cfg.parallel.shard_size)
                       * int(cfg.parallel.seq_len))
    ok_steps = sorted(s for s in committed if 0 <= s < steps)
    wall = (restarts[-1]["exit_time"] - restarts[0]["launch_time"]) if restarts else 0.0
    summary = {
        "steps_committed": len(ok_steps), "first_step": ok_steps[0] if ok_steps else None,
        "last_step": ok_steps[-1] if ok_steps else None,
        "replicas_initial": int(cfg.parallel.replicas),
        "replicas_alive": list(range(int(cfg.parallel.replicas))), "failures_survived": 0,
        "wall_time_s": wall, "tokens": len(ok_steps) * tokens_per_step,
        "tokens_per_s": (len(ok_steps) * tokens_per_step / wall) if wall > 0 else None,
        "faults": {"fired": [f["entry"] for f in fired_all]},
        "extra": {"mode": "checkpoint_restart", "attempts": len(restarts),
                  "restarts": max(0, len(restarts) - 1), "failures": len(rows),
                  "ckpt_interval": int(cfg.baseline.ckpt_interval),
                  "ckpt_async": bool(cfg.baseline.ckpt_async),
                  "final_loss": committed.get(steps - 1, {}).get("loss"),
                  "rerun_steps": sum(len(r["steps_committed"]) for r in restarts)
                  - len(ok_steps),
                  "breakdown": rows},
    }
    write_summary(run_dir, summary)
    res.steps_committed = len(ok_steps)
    res.last_step = summary["last_step"]
    res.replicas_alive = summary["replicas_alive"]
    res.tokens = summary["tokens"]
    res.wall_time_s = wall
    res.tokens_per_s = summary["tokens_per_s"]
    res.launcher_wall_s = time.monotonic() - t_begin
    res.failures_survived = len(rows)
    if set(range(steps)) <= set(committed):
        res.status, res.exit_code = "ok", EXIT_OK
        res.note = (f"checkpoint_restart: {len(restarts)} attempts, {len(rows)} failures; "
                    f"breakdown in {run_dir / 'summary.json'} (extra.breakdown)")
    elif stopped == "time_limit":
        res.status, res.exit_code = "time_limit", EXIT_TIME_LIMIT
    elif stopped == "interrupted":
        res.status, res.exit_code = "interrupted", EXIT_INTERRUPTED
    else:
        res.status = "incomplete" if committed else "failed"
    return res


def _fault_records(run_dir: Path, kind: str) -> list[dict]:
    """faults/{kind}.rank{g}.json of every rank: "fired" (a scheduled fault, written by the rank
    before it fires) or "hung" (the watchdog's verdict, launcher/watchdog.py)."""
    out = []
    d = run_dir / "faults"
    for p in sorted(d.glob(f"{kind}.rank*.json")) if d.is_dir() else ():
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _fired(run_dir: Path) -> list[dict]:
    return _fault_records(run_dir, "fired")
