"""The relaunch / resume policy of the resilient trainer (docs/checkpoint.md; moved
from recover_hsdp/resume.py).

`recover-hsdp train` hands a job here (instead of one plain launch) when checkpoint.interval
> 0, checkpoint.resume=true, elastic.min_replicas > 0 or elastic.rejoin=true. One policy decides
what happens when a segment (one mpirun) ends:

    every step committed                  -> done (exit 0)
    a stop request was served             -> exit 4 (EXIT_PREEMPTED): SIGTERM / SIGUSR1 / SIGINT
       (the launcher wrote checkpoints/STOP, the ranks saved at that step and left cleanly)
    the ranks left for a rejoin (elastic.rejoin: fewer than W alive, no standby left; their
       checkpoint's state.json says exit=rejoin)
                                          -> after elastic.rejoin_backoff_s * 2**(n-1), relaunch at
                                             FULL width (W + K standbys) from it, up to
                                             elastic.max_rejoins times; the last segment is told
                                             "no rejoin left" and goes on degraded
    otherwise (all replicas lost, alive < elastic.min_replicas, a crash)
                                          -> relaunch at FULL width (this job's shape) from the
                                             newest complete checkpoint, up to elastic.max_restarts
                                             times; then exit 1

Each segment's mpirun runs under the supervisor every launcher shares (launcher/supervise.py:
the watchdog and reaper, the start-up watch and its elastic.start_retries, the end watch); a
start retried there stays one segment. Each launch is a segment: segments.jsonl gets a "start"
line before mpirun (shape, resume step, checkpoint, cursors) and an "end" line after it (rc,
outcome, resume time launch -> first commit). Before a resume, step lines past the checkpoint
are moved to steps/discarded/ so every step is committed once in the run record.
"""
from __future__ import annotations

import json
import shlex
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from recover_hsdp.launcher.job import (LAUNCHER_DIR, PROG, JobResult,  # noqa: F401
                                       baseline_name, holds_run, job_command, job_env,
                                       print_error, say)
from recover_hsdp.optim import RESUME_MUTABLE
from recover_hsdp.launcher.judge import (EXIT_CONFIG, EXIT_FAILED, EXIT_OK,  # noqa: F401
                                         EXIT_PREEMPTED, EXIT_TIME_LIMIT)



def wants_supervisor(cfg) -> bool:
    ck, el = cfg.checkpoint, cfg.elastic
    return baseline_name(cfg) == "none" and (int(ck.interval) > 0 or bool(ck.resume)
                                             or int(el.min_replicas) > 0 or bool(el.rejoin))


#: optimizer settings a resume may change: named next to their dataclass (optim.py), so this
#: file names no optim key (the walk of a key, docs/architecture.md)
RESUME_MUTABLE_OPTIM = RESUME_MUTABLE


def resume_changes(cfg, st: dict) -> list[str]:
    """What this config changes, as a resume may, against checkpoint ``st``: 'key: a -> b'."""
    from recover_hsdp.config import plain_config

    out = []
    if "steps" in st and int(st["steps"]) != int(cfg.run.steps):
        out.append(f"run.steps: {st['steps']} -> {int(cfg.run.steps)}")
    mine = plain_config(cfg.get("optim") or {})
    for k in RESUME_MUTABLE_OPTIM:
        if k in (st.get("optim") or {}) and st["optim"].get(k) != mine.get(k):
            out.append(f"optim.{k}: {_short(st['optim'].get(k), 30)} -> {_short(mine.get(k), 30)}")
    return out


def check_resume(cfg, st: dict, path: Path) -> str | None:
    """Why this config cannot resume from checkpoint ``st`` (one line), or None. A resume may
    train longer (run.steps, optim.total_steps) and change RESUME_MUTABLE_OPTIM; the model,
    B, tokens per step, the seed, the data and the optimizer's kind and moments' settings stay."""
    from recover_hsdp.config import plain_config

    par = cfg.parallel
    W, S, G = int(par.replicas), int(par.shard_size), int(par.grad_accum)
    mbs, L = int(par.micro_batch_size), int(par.seq_len)
    B = W * G
    K = int(par.get("standby") or 0)
    if K and W != int(st.get("w_init", W)):
        return (f"cannot resume from {path} with parallel.standby({K}): a run with standbys "
                f"resumes at its first width (parallel.replicas={st['w_init']}, got {W})")
    if B != int(st["B"]):
        return (f"cannot resume from {path}: it was saved with B={st['B']} microbatches per step "
                f"(W_init x G_init), this config has parallel.replicas({W}) x "
                f"parallel.grad_accum({G}) = {B}")
    tps = B * mbs * S * L
    if tps != int(st.get("tokens_per_step", tps)):
        return (f"cannot resume from {path}: it was saved with {st['tokens_per_step']} tokens per "
                f"step, this config has B({B}) x parallel.micro_batch_size({mbs}) x "
                f"parallel.shard_size({S}) x parallel.seq_len({L}) = {tps} (keep "
                f"micro_batch_size x shard_size constant)")
    if "steps" in st and int(cfg.run.steps) <= int(st["step"]):
        return (f"cannot resume from {path}: run.steps({int(cfg.run.steps)}) must exceed the "
                f"step it resumes at ({st['step']}): nothing would be trained")
    fixed = {k: v for k, v in (plain_config(cfg.get("optim") or {})).items()
             if k not in RESUME_MUTABLE_OPTIM}
    saved_fixed = {k: v for k, v in (st.get("optim") or {}).items()
                   if k not in RESUME_MUTABLE_OPTIM}
    for key, mine, theirs in (("model", plain_config(cfg.model), st.get("model")),
                              ("optim", fixed, saved_fixed if "optim" in st else None),
                              ("run_seed", int(cfg.run.seed), st.get("run_seed"))):
        if theirs is not None and theirs != mine:
            st = {**st, key: theirs}
            name = {"run_seed": "run.seed", "steps": "run.steps"}.get(key, key)
            if isinstance(mine, dict) and isinstance(st[key], dict):
                diff = [f"{name}.{k}: {_short(st[key].get(k), 30)} -> {_short(mine.get(k), 30)}"
                        for k in sorted(set(st[key]) | set(mine)) if st[key].get(k) != mine.get(k)]
                return (f"cannot resume from {path}: the config changes what the run trained "
                        f"({'; '.join(diff[:4])})")
            return (f"cannot resume from {path}: {name} differs from the run that saved it "
                    f"({_short(st[key])} -> {_short(mine)})")
    return None


def _segment_optim(cfg) -> dict:
    """The optimizer settings this segment trains with, total_steps resolved."""
    from recover_hsdp.config import plain_config

    o = dict(plain_config(cfg.get("optim") or {}))
    if o.get("total_steps") is None:
        o["total_steps"] = int(cfg.run.steps)
    return o


def check_resume_dir(cfg, run_dir: Path) -> None:
    """Before anything starts: checkpoint.resume=true needs a complete, compatible checkpoint
    (TrainConfigError, one line, exit 2). A broken newer checkpoint is skipped with a warning."""
    from recover_hsdp.config import TrainConfigError
    from recover_hsdp.record.checkpoint import latest_complete

    found = latest_complete(run_dir, warn=lambda m: print(f"[{PROG}] warning: {m}", flush=True))
    if found is None:
        raise TrainConfigError(f"checkpoint.resume=true: {run_dir} holds no complete checkpoint "
                               f"(checkpoints/step_N/COMPLETE); nothing to resume")
    why = check_resume(cfg, found[1], found[0])
    if why:
        raise TrainConfigError(why)


def _short(v: Any, n: int = 80) -> str:
    t = json.dumps(v, sort_keys=True, default=str)
    return t if len(t) <= n else t[:n - 3] + "..."


def _last_step(run_dir: Path) -> int:
    from recover_hsdp.record import read_jsonl
    from recover_hsdp.record.steps import rank_files

    last = -1
    for p in rank_files(run_dir).values():
        recs, _ = read_jsonl(p)
        if recs:
            last = max(last, int(recs[-1]["step"]))
    return last


def request_stop(run_dir: Path, signame: str) -> int:
    """Ask the ranks to checkpoint and leave: checkpoints/STOP = {"step": last committed + 3}
    (ranks are at most one step apart; the margin covers a rank between two boundaries)."""
    from recover_hsdp.record import atomic_write

    target = _last_step(run_dir) + 3
    atomic_write(run_dir / "checkpoints" / "STOP",
                 (json.dumps({"step": target, "signal": signame, "time": time.time()}) + "\n"
                  ).encode())
    print(f"[{PROG}] {signame}: the ranks checkpoint at step {target} and exit "
          f"(exit code {EXIT_PREEMPTED}; resume with checkpoint.resume=true)", flush=True)
    return target


def _first_commit_time(run_dir: Path, segment: int) -> float | None:
    from recover_hsdp.record import read_jsonl
    from recover_hsdp.record.checkpoint import rank_file_offset
    from recover_hsdp.record.steps import rank_files

    lo, hi = rank_file_offset(segment), rank_file_offset(segment + 1)
    ts = []
    for g, p in rank_files(run_dir).items():
        if lo <= g < hi:
            recs, _ = read_jsonl(p)
            if recs:
                ts.append(float(recs[0].get("local", {}).get("time", 0.0)))
    return min(ts) if ts else None


def node_loss_config(cfg, log_text: str, ldir: Path, k: int):
    """(config for the relaunch, message) after a segment whose mpirun output says a remote
    daemon was lost (launcher/nodeloss.py); (None, message) if it cannot be planned; (None, "")
    if no node was lost. The relaunch keeps B: W' replicas x G' = B on the hostfile minus the
    lost node (written to launcher/hosts.seg{k+1})."""
    from omegaconf import OmegaConf

    from recover_hsdp.launcher.nodeloss import (hostfile_in, lost_daemon_vpid, lost_node,
                                              parse_hostfile, plan_after_node_loss,
                                              relaunch_args)

    node = lost_node(log_text)
    if node is None:
        return None, ""
    args = [str(a) for a in cfg.run.mpirun_args]
    found = hostfile_in(args)
    if found is None:
        return None, f"node {node or '?'} lost (PRTE lost a daemon); no --hostfile to exclude it from"
    try:
        hosts = parse_hostfile(Path(found[1]).read_text())
    except OSError as e:
        return None, f"node {node or '?'} lost; hostfile {found[1]} unreadable ({e.strerror})"
    par = cfg.parallel
    plan, why = plan_after_node_loss(hosts, node, int(par.replicas), int(par.shard_size),
                                     int(par.grad_accum), vpid=lost_daemon_vpid(log_text))
    if plan is None:
        return None, f"node {node or '?'} lost (PRTE lost a daemon): {why}"
    hostfile = ldir / f"hosts.seg{k + 1}"
    hostfile.write_text(plan.hostfile_text())
    new = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    new.parallel.replicas, new.parallel.grad_accum = plan.replicas, plan.grad_accum
    new.run.np = plan.replicas * int(par.shard_size)
    new.run.mpirun_args = relaunch_args(args, hostfile)
    return new, (f"node {plan.lost} lost (PRTE lost a daemon): relaunch without it at W'="
                 f"{plan.replicas} x G'={plan.grad_accum} (B={plan.replicas * plan.grad_accum})")


def _rejoin_left(cfg, used: int) -> bool:
    """elastic.rejoin and fewer than elastic.max_rejoins rejoin relaunches used: the next
    segment's ranks checkpoint and leave for a relaunch when a replica is lost and no standby is
    left."""
    el = cfg.elastic
    return bool(el.rejoin) and used < int(el.max_rejoins)


def run_resilient(job) -> JobResult:
    """Launch (and relaunch, and resume) one resilient job; see the module docstring."""
    from recover_hsdp.config import save_config
    from recover_hsdp.hsdp.checkpoint import ENV_REJOIN, ENV_RESUME_FROM, ENV_SEGMENT
    from recover_hsdp.launcher.store import default_store_host
    from recover_hsdp.launcher.supervise import Watch, retry_notice, supervise
    from recover_hsdp.record import RecordError, read_run
    from recover_hsdp.record.checkpoint import (append_segment, latest_complete,
                                                read_segments, truncate_steps)

    cfg, run_dir = job.cfg, job.run_dir
    steps = int(cfg.run.steps)
    res = JobResult(job, "failed", EXIT_FAILED, steps)
    if cfg.run.overwrite and not cfg.checkpoint.resume and holds_run(run_dir):
        shutil.rmtree(run_dir)

    def warn(m: str) -> None:
        print(f"[{PROG}] warning: {m}", flush=True)

    resume = None
    if cfg.checkpoint.resume:
        resume = latest_complete(run_dir, warn=warn)
        if resume is None:
            print_error(f"checkpoint.resume=true: {run_dir} holds no complete checkpoint "
                        f"(checkpoints/step_N/COMPLETE); nothing to resume")
            res.exit_code, res.note = EXIT_CONFIG, "no checkpoint to resume from"
            return res
        why = check_resume(cfg, resume[1], resume[0])
        if why:
            print_error(why)
            res.exit_code, res.note = EXIT_CONFIG, why
            return res
        changes = resume_changes(cfg, resume[1])
        if changes:
            print(f"[{PROG}] resume at step {resume[1]['step']} with changes: "
                  f"{'; '.join(changes)} (recorded in segments.jsonl; the lr schedule is "
                  f"recomputed over the new horizon: docs/checkpoint.md)", flush=True)
    ldir = run_dir / LAUNCHER_DIR
    ldir.mkdir(parents=True, exist_ok=True)
    host = cfg.run.store_host or default_store_host()
    stop: dict[str, Any] = {}

    def on_signal(signum, frame):  # noqa: ARG001
        if "target" not in stop:
            stop["target"] = request_stop(run_dir, signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    restarts, rejoins, t_begin = 0, 0, time.monotonic()
    reason = "resume" if resume else "start"
    try:
        while True:
            (run_dir / "checkpoints" / "STOP").unlink(missing_ok=True)
            segs = [s for s in read_segments(run_dir) if s.get("event") == "start"]
            k = len(segs) if segs or not (run_dir / "steps").is_dir() else 1
            start_step, cursors = 0, None
            if resume is not None:
                start_step = int(resume[1]["step"])
                cursors = {s: v["cursor"] for s, v in resume[1]["slices"].items()}
                moved = truncate_steps(run_dir, start_step, k)
                if moved:
                    print(f"[{PROG}] resume at step {start_step}: {moved} step lines past the "
                          f"checkpoint moved to steps/discarded/", flush=True)
            seg_cfg = ldir / (f"config.seg{k}.yaml" if k else "config.yaml")
            save_config(cfg, seg_cfg)
            launch_time = time.time()
            append_segment(run_dir, {
                "event": "start", "segment": k, "launch_time": launch_time, "reason": reason,
                "resume_step": start_step if resume is not None else None,
                "checkpoint": str(resume[0]) if resume is not None else None,
                "cursors": cursors, "replicas": int(cfg.parallel.replicas),
                "shard_size": int(cfg.parallel.shard_size),
                "grad_accum": int(cfg.parallel.grad_accum),
                "micro_batch_size": int(cfg.parallel.micro_batch_size),
                "standby": int(cfg.parallel.get("standby") or 0),
                "rejoin": _rejoin_left(cfg, rejoins),
                # this segment's schedule (verify replays each segment under its own)
                "steps": steps, "optim": _segment_optim(cfg)})

            def prepare(store: str, k=k, resume=resume, seg_cfg=seg_cfg):
                env = job_env(job, store)
                env[ENV_SEGMENT] = str(k)
                env[ENV_REJOIN] = "1" if _rejoin_left(cfg, rejoins) else "0"
                extra = ["-x", ENV_SEGMENT, "-x", ENV_REJOIN]
                if resume is not None:
                    env[ENV_RESUME_FROM] = str(resume[0])
                    extra += ["-x", ENV_RESUME_FROM]
                cmd = job_command(job, seg_cfg, env)
                cmd = cmd[:1] + extra + cmd[1:]
                (ldir / f"command.seg{k}.sh").write_text(shlex.join(cmd) + "\n")
                print(f"[{PROG}] segment {k} ({reason}): {shlex.join(cmd)}", flush=True)
                return cmd, env

            log = ldir / "output.log"
            log_off = log.stat().st_size if log.exists() else 0
            deadline = (None if cfg.run.time_limit_s is None else
                        t_begin + float(cfg.run.time_limit_s))
            launched = supervise(prepare, run_dir=run_dir, np=int(cfg.run.np),
                                 watch=Watch.of(cfg), log_path=log, store_host=host,
                                 deadline=deadline, start_retries=int(cfg.elastic.start_retries),
                                 on_retry=retry_notice(say, "elastic.start_retries",
                                                       f"segment {k}"),
                                 in_thread=True)   # this thread's signals: a stop request
            outcome = launched.outcome
            # ranks of this host that outlived mpirun (a node loss): gone before the record is
            # read and the checkpoint picked (a survivor trained on, saved and pruned: reap.py)
            from recover_hsdp.launcher.reap import outliving, reap
            elsewhere = outliving(run_dir)[1]
            reaped = reap(run_dir)
            if reaped:
                print(f"[{PROG}] segment {k}: {len(reaped)} rank(s) outlived mpirun on this host "
                      f"(ranks {[g for g, _ in reaped]}): SIGKILLed"
                      + (f"; heartbeats of ranks {elsewhere} on other hosts still say running"
                         if elsewhere else ""), flush=True)
            first = _first_commit_time(run_dir, k)
            try:
                committed = set(read_run(run_dir).steps)
            except RecordError as e:
                committed = set()
                res.note = f"no usable run record ({' '.join(str(e).split())})"
            done = set(range(steps)) <= committed
            status = ("completed" if done else "stopped" if "target" in stop else
                      (outcome.stopped if outcome and outcome.stopped else "incomplete"))
            append_segment(run_dir, {
                "event": "end", "segment": k, "end_time": time.time(),
                "rc": getattr(outcome, "returncode", None), "outcome": status,
                "start_tries": launched.tries,
                "steps_committed": len(committed),
                "resume_time_s": None if first is None else round(first - launch_time, 3)})
            res.steps_committed = len(committed & set(range(steps)))
            res.last_step = max(committed) if committed else None
            res.launcher_wall_s = time.monotonic() - t_begin
            if done:
                res.status, res.exit_code = "ok", EXIT_OK
                res.note = (f"{k + 1} segment(s); {restarts} automatic relaunch(es)"
                            + (f", {rejoins} rejoin relaunch(es)" if rejoins else ""))
                break
            if "target" in stop:
                got = latest_complete(run_dir, warn=warn)
                ok = got is not None and int(got[1]["step"]) >= stop["target"] - 3
                res.status, res.exit_code = ("preempted", EXIT_PREEMPTED) if ok else \
                    ("interrupted", EXIT_FAILED)
                res.note = (f"stopped on request; checkpoint {got[0] if got else None}: "
                            f"resume with checkpoint.resume=true")
                break
            if outcome is not None and outcome.stopped == "time_limit":
                res.status, res.exit_code = "time_limit", EXIT_TIME_LIMIT
                break
            resume = latest_complete(run_dir, warn=warn)
            with open(log, "rb") as f:       # node loss: mpirun's own words
                f.seek(log_off)
                lost_cfg, lost_msg = node_loss_config(
                    cfg, f.read().decode(errors="replace"), ldir, k)
            if lost_msg:
                print(f"[{PROG}] {lost_msg}", flush=True)
            if (lost_cfg is None and resume is not None and _rejoin_left(cfg, rejoins)
                    and resume[1].get("exit") == "rejoin"
                    and int(resume[1].get("segment", -1)) == k):
                rejoins += 1        # the rejoin policy (docs/rejoin.md): back to full width
                wait = float(cfg.elastic.rejoin_backoff_s) * 2 ** (rejoins - 1)
                reason = (f"rejoin {rejoins}/{cfg.elastic.max_rejoins} at full width "
                          f"(W={cfg.parallel.replicas}, back-off {wait:g} s)")
                print(f"[{PROG}] segment {k} ended with {len(committed)}/{steps} steps committed "
                      f"and fewer than {cfg.parallel.replicas} replicas alive: {reason} from "
                      f"{resume[0]}", flush=True)
                time.sleep(wait)
                if "target" in stop:    # a stop request during the back-off: it is saved
                    res.status, res.exit_code = "preempted", EXIT_PREEMPTED
                    res.note = (f"stopped on request during the rejoin back-off; checkpoint "
                                f"{resume[0]}: resume with checkpoint.resume=true")
                    break
                continue
            from recover_hsdp.launcher.judge import common_error
            common = common_error(run_dir, int(cfg.parallel.replicas), int(cfg.parallel.shard_size))
            if common is not None:      # the same error on every replica (a full disk): a
                res.status, res.note = "error", common[0]   # relaunch would meet it again
                res.exit_code = common[1]
                break
            if restarts >= int(cfg.elastic.max_restarts) or resume is None:
                res.status = "incomplete" if committed else "failed"
                res.note = (f"segment {k} ended with {len(committed)}/{steps} steps committed; "
                            + ("no complete checkpoint to relaunch from" if resume is None else
                               f"elastic.max_restarts({cfg.elastic.max_restarts}) relaunches used"))
                break
            restarts += 1
            reason = f"relaunch {restarts} at full width"
            if lost_cfg is not None:
                cfg = job.cfg = lost_cfg
                reason = (f"relaunch {restarts} without the lost node at W'="
                          f"{cfg.parallel.replicas}")
            print(f"[{PROG}] segment {k} ended with {len(committed)}/{steps} steps committed: "
                  f"{reason} from {resume[0]}", flush=True)
    except (OSError, RuntimeError) as e:
        res.note = f"could not launch: {' '.join(str(e).split())}"
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return res
