"""Launcher side of the fail-stop: what a finished job's run directory says about its deaths.

A rank that dies on purpose leaves a marker first (a scheduled kill: faults/fired.rank{g}.json; a
hung-rank verdict: faults/hung.rank{g}.json; an error fail-stop: errors/rank{g}.json). The
launcher reconciles summary.json with them (a replica killed after the last consensus is listed
alive by its peers); every replica that logged the same error is a user error (common_error);
judge_run reads the record for the verdict. Not mpirun's exit code: under ``--with-ft ulfm``
mpirun exits 0 after ranks were SIGKILLed.

Exit codes: the one table of every command, recover_hsdp/exit_codes.py (docs/cli.md).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from recover_hsdp.faults.failstop import ERRORS_DIR, RANKS_DIR
from recover_hsdp.launcher.errors import read_errors as _read_errors  # + its store hook
from recover_hsdp.launcher.job import PROG, Job, JobResult, baseline_name
from recover_hsdp.launcher.rank import EXIT_RECORD

from recover_hsdp import exit_codes

EXIT_OK = exit_codes.OK
EXIT_FAILED = exit_codes.FAILED
EXIT_CONFIG = exit_codes.USAGE
EXIT_TIME_LIMIT = exit_codes.TIME_LIMIT
EXIT_PREEMPTED = exit_codes.PREEMPTED      # stopped on SIGTERM/SIGUSR1 after a checkpoint
EXIT_UNAVAILABLE = exit_codes.UNAVAILABLE  # MPI / ULFM cannot run here
EXIT_INTERRUPTED = exit_codes.INTERRUPTED


# ---------------------------------------------------------------------------------------------
# Reconciling summary.json with the dying ranks' own markers
# ---------------------------------------------------------------------------------------------
def dead_replicas(run_dir: os.PathLike | str, shard_size: int) -> dict[int, str]:
    """{replica: evidence} for every replica a rank of which left a death marker: a scheduled
    kill (faults/fired.rank{g}.json), a hung-rank verdict (faults/hung.rank{g}.json) or an error
    fail-stop (errors/rank{g}.json, or where a rank put it when errors/ was unwritable:
    read_errors). Each of those ranks is SIGKILLed right after writing it."""
    d = Path(run_dir)
    out: dict[int, str] = {}
    for sub, pat, what in (("faults", "fired.rank*.json", "scheduled kill"),
                           ("faults", "hung.rank*.json", "hung")):
        for p in sorted((d / sub).glob(pat)) if (d / sub).is_dir() else ():
            try:
                g = int(p.name.split("rank")[1].split(".")[0])
            except (IndexError, ValueError):
                continue
            out.setdefault(g // max(1, int(shard_size)), f"{what} of rank {g}")
    for e in read_errors(d):          # errors/, the store, the fallback directory
        g = e.get("rank")
        if isinstance(g, int) and g >= 0:
            out.setdefault(g // max(1, int(shard_size)), f"error of rank {g}")
    return out


def reconcile_summary(run_dir: os.PathLike | str, shard_size: int) -> list[int]:
    """Rewrite summary.json when a replica it lists as alive left a death marker (e.g. killed
    after the last consensus: its peers committed the last step and wrote the summary before it
    died). Its scheduled entries move from `unreached` to `fired`. Returns the replicas moved."""
    from recover_hsdp.record.run import write_summary

    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    dead = dead_replicas(run_dir, shard_size)
    alive = list(summary.get("replicas_alive") or [])
    # a slot a standby took over (docs/rejoin.md) lives in another rank block
    blocks = {int(k): int(v) for k, v in
              ((summary.get("extra") or {}).get("slot_blocks") or {}).items()}
    moved = sorted(r for r in alive if blocks.get(r, r) in dead)
    if not moved:
        return []
    summary["replicas_alive"] = [r for r in alive if r not in moved]
    if isinstance(summary.get("failures_survived"), int):
        summary["failures_survived"] += len(moved)
    faults = summary.get("faults") or {}
    if isinstance(faults, dict) and faults.get("unreached"):
        keep = []
        for e in faults["unreached"]:
            (faults.setdefault("fired", []) if e.get("replica") in moved else keep).append(e)
        faults["unreached"] = keep
    summary.setdefault("extra", {})["reconciled"] = {str(r): dead[r] for r in moved}
    write_summary(run_dir, summary)
    return moved


# ---------------------------------------------------------------------------------------------
# The launcher's reading of errors/
# ---------------------------------------------------------------------------------------------
def read_errors(run_dir: os.PathLike | str) -> list[dict]:
    """The ranks' error records, from every place a rank may have put one: errors/, the job's
    store (a rank on any node whose errors/ was unwritable), the fallback directory on this node
    (launcher/errors.py ``read_errors``, the one reader)."""
    return _read_errors(run_dir)


def common_error(run_dir: os.PathLike | str, replicas: int, shard_size: int = 1
                 ) -> Optional[tuple[str, int]]:
    """(one line, exit code) when EVERY replica logged an error of the same class: a user error
    that hits every rank alike (bad config, a loss that always raises). Else None."""
    errs = read_errors(run_dir)
    if not errs:
        return None
    by_replica: dict[int, dict] = {}
    for e in sorted(errs, key=lambda e: (e.get("time") or 0)):
        r = e.get("replica")
        if r is None and isinstance(e.get("rank"), int) and e["rank"] >= 0:
            r = e["rank"] // max(1, shard_size)
        if r is not None:
            by_replica.setdefault(int(r), e)
    if set(by_replica) != set(range(replicas)):
        return None
    classes = {e["class"] for e in by_replica.values()}
    if len(classes) != 1:
        return None
    first = min(by_replica.values(), key=lambda e: e.get("time") or 0)
    where = f" in {first['where']}" if first.get("where") else ""
    where += f" at step {first['step']}" if first.get("step") is not None else ""
    if first["class"] == "UlfmUnavailableError":     # MPI without ULFM, extension missing
        code = EXIT_UNAVAILABLE
    elif all(e.get("exit_code_hint") == EXIT_CONFIG for e in by_replica.values()):
        code = EXIT_CONFIG                           # the same missing / unreadable input
    else:
        code = EXIT_FAILED
    tb = Path(run_dir) / ERRORS_DIR / f"rank{first['rank']}.traceback.txt"
    line = (f"every replica failed with the same error: {first['class']}: {first['message']}"
            f"{where} (rank {first['rank']}; traceback: "
            f"{first.get('traceback') or tb})")
    return line, code


# ---------------------------------------------------------------------------------------------
# Judging a finished job (from its run directory, not mpirun's exit code)
# ---------------------------------------------------------------------------------------------
def judge_run(job: Job, launcher_wall_s: float, stopped: str | None) -> JobResult:
    """Success from the run directory: all of [0, run.steps) committed (not mpirun's code)."""
    from recover_hsdp.record import RecordError, read_run

    steps = int(job.cfg.run.steps)
    res = JobResult(job, "failed", EXIT_FAILED, steps, launcher_wall_s=launcher_wall_s)
    try:  # a replica killed after the last consensus is alive in summary.json: its marker wins
        reconcile_summary(job.run_dir, int(job.cfg.parallel.shard_size))
    except Exception:  # noqa: BLE001 - judging must not fail on a bookkeeping problem
        pass
    try:
        rec = read_run(job.run_dir)
    except RecordError as e:
        res.note = f"no usable run record ({' '.join(str(e).split())})"
        rec = None
    if rec is not None:
        committed = [s for s in rec.steps if 0 <= s < steps]
        res.steps_committed = len(committed)
        res.last_step = rec.last_step
        summary = rec.summary or {}
        lost = sorted({r for s in rec.steps.values() for f in s.failures
                       for r in f.get("replicas", [])})
        res.failures_survived = int(summary.get("failures_survived", len(lost)))
        res.replicas_alive = list(summary.get("replicas_alive") or
                                  (rec.steps[rec.last_step].alive if rec.steps else []))
        res.tokens = int(summary.get("tokens") or sum(s.tokens for s in rec.steps.values()))
        res.wall_time_s = summary.get("wall_time_s")
        res.tokens_per_s = summary.get("tokens_per_s")
        if res.tokens_per_s is None and res.tokens and launcher_wall_s > 0:
            res.tokens_per_s = res.tokens / launcher_wall_s
        complete = set(committed) == set(range(steps))
        if complete:
            res.status, res.exit_code = "ok", EXIT_OK
            if not rec.summary:
                res.note = "summary.json missing (numbers recomputed from the step files)"
        else:
            res.status = "incomplete"
            if rec.gaps:
                res.note = f"gaps in the committed steps: {rec.gaps[:10]}"
    if res.exit_code != EXIT_OK:
        # every replica logged the same error: a user error that hits every rank alike
        par = job.cfg.parallel
        common = common_error(job.run_dir, int(par.replicas), int(par.shard_size))
        if common is not None:
            res.status, res.note = "error", common[0]
            res.exit_code = common[1]
            return res
    if res.exit_code != EXIT_OK and stopped == "time_limit":
        res.status, res.exit_code = "time_limit", EXIT_TIME_LIMIT
    elif res.exit_code != EXIT_OK and stopped == "interrupted":
        res.status, res.exit_code = "interrupted", EXIT_INTERRUPTED
    return res


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s"


def format_summary(res: JobResult) -> str:
    if res.status == "error":   # the same error on every replica: one line (run dir inside)
        return f"[{PROG}] error: {res.note}"
    tps = "-" if res.tokens_per_s is None else f"{res.tokens_per_s:,.0f} tokens/s"
    alive = f" (replicas alive: {res.replicas_alive})" if res.replicas_alive else ""
    lines = [
        f"[{PROG}] {res.status.upper()}: {res.job.label}",
        f"  steps committed    {res.steps_committed}/{res.steps_expected}",
        f"  failures survived  {res.failures_survived}{alive}",
        f"  wall time          {_fmt_s(res.wall_time_s)} (launcher, start-up included: "
        f"{_fmt_s(res.launcher_wall_s)})",
        f"  throughput         {tps} (committed tokens / run wall time; {res.tokens:,} tokens)",
        f"  run directory      {res.job.run_dir}",
    ]
    if res.status == "ok" and baseline_name(res.job.cfg) == "none":
        lines.append(f"  check it           recover-hsdp verify {res.job.run_dir}")
    if res.note:
        lines.append(f"  note               {res.note}")
    return "\n".join(lines)


def format_table(results: Sequence[JobResult]) -> str:
    head = ["job", "overrides", "status", "steps", "failures", "wall_s", "tok/s", "run_dir"]
    rows = [[str(r.job.index), r.job.label, r.status, f"{r.steps_committed}/{r.steps_expected}",
             str(r.failures_survived),
             "-" if r.wall_time_s is None else f"{r.wall_time_s:.1f}",
             "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}", str(r.job.run_dir)]
            for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [head] + rows)


def overall_exit(results: Sequence[JobResult]) -> int:
    codes = [r.exit_code for r in results]
    if EXIT_INTERRUPTED in codes:
        return EXIT_INTERRUPTED
    if EXIT_PREEMPTED in codes:   # checkpointed on SIGTERM/SIGUSR1
        return EXIT_PREEMPTED
    if not codes or all(c == EXIT_OK for c in codes):
        return EXIT_OK
    bad = {c for c in codes if c != EXIT_OK}
    return bad.pop() if len(bad) == 1 else EXIT_FAILED   # one cause: its code; several: 1


# ---------------------------------------------------------------------------------------------
# Judging a `recover-hsdp launch` (any rank program) from what its ranks left
# ---------------------------------------------------------------------------------------------
@dataclass
class LaunchVerdict:
    exit_code: int
    line: str                                   # the one-line verdict
    causes: list[str] = field(default_factory=list)   # one line per distinct rank failure cause
    replicas_done: list[int] = field(default_factory=list)
    replicas_lost: list[int] = field(default_factory=list)
    replicas: int = 1
    shard_size: int = 1
    common: bool = False     # every replica failed with the same error (``line`` says it)


def _read(p: Path) -> Optional[dict]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _signame(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def launch_shape(run_dir: os.PathLike | str, np: int) -> tuple[int, int]:
    """(W, S) of the loop as its ranks' heartbeats say (each names its replica); (1, np) for a
    program that wrote none (no manager: the world is its one replica)."""
    d = Path(run_dir) / RANKS_DIR
    reps = {hb["replica"] for g in range(np)
            if (hb := _read(d / f"rank{g}.json")) and isinstance(hb.get("replica"), int)}
    if not reps or np % len(reps):
        return 1, np
    return len(reps), np // len(reps)


def _cause(d: Path, g: int, errs: Optional[dict] = None) -> tuple[str, str]:
    """(cause, evidence file) of rank g's failure; ("", "") if it exited 0 with its done mark.
    ``errs``: rank -> error record (read_errors: errors/, the store, the fallback directory)."""
    if errs is None:
        errs = {e.get("rank"): e for e in read_errors(d)}
    err = errs.get(g)
    if err is not None:
        where = f"{ERRORS_DIR}/rank{g}.json"      # else where the launcher wrote it down
        if not (d / where).is_file() and err.get("traceback"):
            where = str(err["traceback"]).replace(".traceback.txt", ".json")
        return f"{err.get('class')}: {err.get('message')}", where
    for kind, what in (("hung", "judged hung by the watchdog (no heartbeat or no progress)"),
                       ("reaped", "reaped: a still mate of a rank that died"),
                       ("fired", "a scheduled kill (failure simulator)")):
        if (d / "faults" / f"{kind}.rank{g}.json").exists():
            return what, f"faults/{kind}.rank{g}.json"
    ex = _read(d / RANKS_DIR / EXIT_RECORD.format(g=g))
    if ex is None:
        return "ended without an exit record (never started, or its node was lost)", ""
    if "signal" in ex:
        return f"killed by {_signame(int(ex['signal']))}", f"{RANKS_DIR}/{EXIT_RECORD.format(g=g)}"
    if int(ex.get("code", 1)) != 0:
        return f"exited with code {ex['code']}", f"{RANKS_DIR}/{EXIT_RECORD.format(g=g)}"
    return "", ""


def judge_launch(run_dir: os.PathLike | str, np: int, stopped: Optional[str] = None
                 ) -> LaunchVerdict:
    """0 when every rank of at least one replica exited 0 with its done mark and none of them
    was judged; when every replica hit the same error, common_error's code (2 for an input or
    config error, or -n not the loop's W x S; 5 for ULFM unavailable; else 1), as under `train`;
    else 1 (3 / 130 when the time limit / an interrupt stopped a job that had not succeeded)."""
    d = Path(run_dir)
    W, S = launch_shape(d, np)
    errs = {e.get("rank"): e for e in read_errors(d)}
    bad: dict[int, tuple[str, str]] = {g: c for g in range(np) if (c := _cause(d, g, errs))[0]}
    done = [r for r in range(W) if not any(g in bad for g in range(r * S, r * S + S))]
    lost = [r for r in range(W) if r not in done]
    by_cause: dict[str, list[int]] = {}
    for g, (c, _) in sorted(bad.items()):
        by_cause.setdefault(c, []).append(g)
    causes = []
    for c, gs in by_cause.items():
        files = [bad[g][1] for g in gs if bad[g][1]]
        where = f" ({files[0]}" + (f", +{len(files) - 1} more" if len(files) > 1 else "") + ")" \
            if files else ""
        causes.append(f"rank{'s' if len(gs) > 1 else ''} {', '.join(map(str, gs))}: {c}{where}")
    v = LaunchVerdict(EXIT_OK, "", causes, done, lost, W, S)
    if done:
        v.line = (f"OK: replica{'s' if len(done) > 1 else ''} {done} of {W} finished (every rank "
                  f"exited 0)" + (f"; lost: {lost}" if lost else ""))
        return v
    common = common_error(d, W, S) if W > 1 else common_error(d, np, 1)
    if common is not None:
        # the same cause, the same code as under `recover-hsdp train` (common_error's)
        v.line, v.exit_code, v.common = common[0], common[1], True
        size = [e["message"] for e in read_errors(d) if "!= world size" in str(e.get("message"))]
        if size:            # -n is not the loop's W x S: a usage error
            v.exit_code = EXIT_CONFIG
            v.line = f"-n {np} is not W x S of the loop ({size[0]}; tracebacks: {d / ERRORS_DIR})"
        return v
    v.exit_code = {"time_limit": EXIT_TIME_LIMIT, "interrupted": EXIT_INTERRUPTED}.get(
        stopped or "", EXIT_FAILED)
    v.line = (f"FAILED: no replica finished ({len(bad)} of {np} ranks failed"
              + (f"; stopped: {stopped}" if stopped else "") + ")")
    return v
