"""A launched training job, below both `recover-hsdp train` and the checkpoint-restart baseline
(moved from recover_hsdp/jobs.py).

`recover_hsdp.train` composes and validates jobs, launches them and reports;
`recover_hsdp.baselines.checkpoint_restart` relaunches one job after every failure. Both need the
same job description, exit codes and mpirun line, which live here so that neither imports the
other (the layering test, tests/unit/test_layering.py, refuses the circle). The judging half
(`judge_run`, the summary, the exit codes) is launcher/judge.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

LAUNCHER_DIR = "launcher"        # <run dir>/launcher/{config.yaml, command.sh, output.log}
PROG = "recover-hsdp train"
ULFM_FLAGS = ("--with-ft", "ulfm")


def say(msg: str) -> None:
    """One progress line on stdout, prefixed as the launcher's lines are."""
    print(f"[{PROG}] {msg}", flush=True)


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
    from recover_hsdp.launcher.command import exported_vars, mpirun_command

    run = job.cfg.run
    cmd = mpirun_command(int(run.np), config_path, mpirun=run.mpirun,
                         mpirun_args=list(run.mpirun_args), export=exported_vars(env))
    if baseline_name(job.cfg) != "none":   # plain FSDP baselines: a plain job, no ULFM
        cmd = plain_mpirun(cmd)
    return cmd


def job_env(job: Job, store: str) -> dict[str, str]:
    from recover_hsdp.launcher.command import rank_env

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
