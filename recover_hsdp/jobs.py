"""A launched training job, below both `recover-hsdp train` and the checkpoint-restart baseline.

`recover_hsdp.train` composes and validates jobs, launches them and reports;
`recover_hsdp.baselines.checkpoint_restart` relaunches one job after every failure. Both need the
same job description, exit codes and mpirun line, which live here so that neither imports the
other (the layering test, tests/unit/test_layering.py, refuses the circle). The judging half of
the launcher lives here as well: `judge_run` (success from the run directory) and the summary,
the sweep table and the overall exit code.

Exit codes: 0 every job committed all run.steps; 1 a job did not (or could not start);
2 bad flags or config (nothing was started); 3 the run.time_limit_s stopped a job;
130 interrupted (Ctrl-C / SIGTERM; the job is stopped).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_TIME_LIMIT = 3
EXIT_PREEMPTED = 4      # issue 14: stopped on SIGTERM/SIGUSR1 after a checkpoint; resume it
EXIT_INTERRUPTED = 130

LAUNCHER_DIR = "launcher"        # <run dir>/launcher/{config.yaml, command.sh, output.log}
PROG = "recover-hsdp train"
ULFM_FLAGS = ("--with-ft", "ulfm")


def print_error(msg: str) -> None:
    """One line on stderr, prefixed with the program name."""
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)


@dataclass
class Job:
    index: int | None          # None: a single run (not a sweep)
    overrides: list[str]       # this job's overrides (sweeps expanded)
    swept: list[str]           # the overrides that vary across the sweep
    cfg: Any                   # the resolved DictConfig
    checked: Any               # recover_hsdp.config.CheckedConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.output_dir)

    @property
    def label(self) -> str:
        return " ".join(self.swept) if self.swept else "(defaults)" if not self.overrides \
            else " ".join(self.overrides)


@dataclass
class JobResult:
    job: Job
    status: str                    # ok | incomplete | failed | time_limit | interrupted
    exit_code: int
    steps_expected: int
    steps_committed: int = 0
    last_step: int | None = None
    failures_survived: int = 0
    replicas_alive: list[int] = field(default_factory=list)
    wall_time_s: float | None = None      # the run's own (summary.json)
    launcher_wall_s: float = 0.0          # mpirun start to end, start-up included
    tokens: int = 0
    tokens_per_s: float | None = None
    note: str = ""


def holds_run(path: Path) -> bool:
    """Whether ``path`` already holds (part of) a run directory."""
    return any((path / n).exists() for n in ("meta.json", "steps", "summary.json", LAUNCHER_DIR))


def baseline_name(cfg) -> str:
    """``baseline.name`` of a resolved config; "none" for the resilient trainer."""
    base = cfg.get("baseline") if hasattr(cfg, "get") else getattr(cfg, "baseline", None)
    if base is None:
        return "none"
    return str(base.get("name", "none") if hasattr(base, "get") else base.name)


def plain_mpirun(cmd: Sequence[str]) -> list[str]:
    """The launch line without ``--with-ft ulfm``: a plain job, which mpirun aborts as a whole
    as soon as one rank dies on a signal (measured in docs/baselines.md)."""
    out = list(cmd)
    for i in range(len(out) - 1):
        if out[i] == ULFM_FLAGS[0] and out[i + 1] == ULFM_FLAGS[1]:
            return out[:i] + out[i + 2:]
    return out


def job_command(job: Job, config_path: Path, env: dict[str, str]) -> list[str]:
    from recover_hsdp.launch import exported_vars, mpirun_command

    run = job.cfg.run
    cmd = mpirun_command(int(run.np), config_path, mpirun=run.mpirun,
                         mpirun_args=list(run.mpirun_args), export=exported_vars(env))
    if baseline_name(job.cfg) != "none":   # plain FSDP baselines: a plain job, no ULFM
        cmd = plain_mpirun(cmd)
    return cmd


def job_env(job: Job, store: str) -> dict[str, str]:
    from recover_hsdp.launch import rank_env

    import uuid

    from recover_hsdp.faults.failstop import ENV_HB_PERIOD, ENV_LAUNCH_ID, ENV_RUN_DIR

    run, wd = job.cfg.run, job.cfg.watchdog
    env = rank_env(store, omp_num_threads=int(run.omp_num_threads),
                   shard_timeout_s=float(wd.shard_timeout_s))
    env[ENV_RUN_DIR] = str(job.run_dir.resolve())  # errors/ and ranks/ (heartbeats) go here
    env[ENV_LAUNCH_ID] = uuid.uuid4().hex[:12]     # this launch's heartbeats (startup.EndWatch)
    if wd.hang_timeout_s:
        env[ENV_HB_PERIOD] = repr(float(wd.heartbeat_s))
    return env


# ---------------------------------------------------------------------------------------------
# Judging a finished job (from its run directory, not mpirun's exit code)
# ---------------------------------------------------------------------------------------------
def judge_run(job: Job, launcher_wall_s: float, stopped: str | None) -> JobResult:
    """Success from the run directory: all of [0, run.steps) committed (not mpirun's code)."""
    from recover_hsdp.record import RecordError, read_run

    steps = int(job.cfg.run.steps)
    res = JobResult(job, "failed", EXIT_FAILED, steps, launcher_wall_s=launcher_wall_s)
    try:  # a replica killed after the last consensus is alive in summary.json: its marker wins
        from recover_hsdp.faults.failstop import reconcile_summary

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
        from recover_hsdp.faults.failstop import common_error

        par = job.cfg.parallel
        common = common_error(job.run_dir, int(par.replicas), int(par.shard_size))
        if common is not None:
            res.status, res.note = "error", common[0]
            res.exit_code = EXIT_CONFIG if common[1] == 2 else EXIT_FAILED
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
    if 4 in codes:      # jobs.EXIT_PREEMPTED: checkpointed on SIGTERM/SIGUSR1 (issue 14)
        return 4
    if not codes or all(c == EXIT_OK for c in codes):
        return EXIT_OK
    if all(c in (EXIT_OK, EXIT_CONFIG) for c in codes):  # the same missing input on every rank
        return EXIT_CONFIG
    return EXIT_TIME_LIMIT if all(c in (EXIT_OK, EXIT_TIME_LIMIT) for c in codes) else EXIT_FAILED
