"""`recover-hsdp train [flags] [overrides]`: compose, validate, launch, and judge a training run.

Two modes, one file:

* Launcher (a plain process, no MPI): compose conf/ + overrides with Hydra's compose API,
  resolve and VALIDATE every job before anything starts (a bad config is one line on stderr and
  exit code 2), write ``<run dir>/launcher/config.yaml``, host the rendezvous TCPStore outside
  the ranks (``serve_store``), run
  ``mpirun --with-ft ulfm --oversubscribe [--allow-run-as-root] -n <W*S> -x ... <python> -m
  recover_hsdp.train --worker <run dir>/launcher/config.yaml`` with RECOVER_HSDP_STORE,
  OMP_NUM_THREADS and RECOVER_HSDP_SHARD_TIMEOUT_S set, stream its output (also to
  ``launcher/output.log``), and decide success from the RUN DIRECTORY (mpirun exits 0 even
  after ranks were killed under ULFM): every step in [0, run.steps) committed.
* Worker (``--worker FILE``, inside each MPI rank): load the resolved config as the dataclasses
  (``recover_hsdp.config.load_train_config`` -> ``TrainConfig``), check it against the MPI world
  size, call ``recover_hsdp.workers.resilient.run_worker(cfg) -> int``.

Sweeps (``-m``/``--multirun``): Hydra's sweep syntax (``parallel.replicas=2,4``,
``range(1,4)``, ``choice(a,b)``), the cartesian product, run one job at a time, each in
``<run.output_dir>/<i>_<swept overrides>``; a table at the end.

Hydra never writes into the working directory here: the compose API has no output directory,
logging set-up or chdir. ``hydra_app`` (an importable ``@hydra.main`` app over the same conf/)
exists for code that wants Hydra's own entry point; conf/config.yaml disables its output dir.

Exit codes: the one table of every command (recover_hsdp/exit_codes.py, printed by --help).
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from recover_hsdp import exit_codes
# the job description, exit codes and mpirun line live below this module and the
# checkpoint-restart baseline, which both launch jobs (re-exported here for callers)
from recover_hsdp.launcher.job import (LAUNCHER_DIR, PROG, Job, JobResult,  # noqa: F401
                                       baseline_name, holds_run, job_command, job_env,
                                       print_error, say)
# judging a finished job from its run directory, the exit codes, and reporting it
from recover_hsdp.launcher.judge import (EXIT_CONFIG, EXIT_FAILED,  # noqa: F401
                                         EXIT_INTERRUPTED, EXIT_OK, EXIT_TIME_LIMIT,
                                         format_summary, format_table, judge_run, overall_exit)

USAGE = f"""usage: {PROG} [-m|--multirun] [--dry-run] [--print-config] [KEY=VALUE|GROUP=OPTION ...]

Compose conf/config.yaml with the overrides, validate it, launch replicas*shard_size ranks under
`mpirun --with-ft ulfm`, and report from the run directory.

  GROUP=OPTION    model=llama_debug|llama_1b  data=embedded|c4|local  policy=static|adaptive
                  failures=none|demo|random|readme  debug=default|no_restore  optim=adamw|llama
                  baseline=none|reference|checkpoint_restart  (your own presets: a folder with
                  model/my_model.yaml, hydra.searchpath=[file:///abs/dir] or RECOVER_HSDP_CONFIG_PATH)
  KEY=VALUE       parallel.replicas=4 parallel.shard_size=2 parallel.grad_accum=2 run.steps=20
                  run.output_dir=runs/x failures.schedule=my_kills.yaml  (all keys: docs/cli.md)
  -m, --multirun  sweep: parallel.replicas=2,4 parallel.shard_size=1,2 runs 4 jobs, one by one
  --dry-run       validate and print the mpirun command of each job; start nothing
  --print-config  print the resolved config of each job (YAML) and exit

exit codes (the same for every recover-hsdp command; a sweep: 130 if interrupted, 4 if a job was
preempted, else the code every failed job shares, 1 if they differ):
{exit_codes.table()}"""


class UsageError(Exception):
    pass


@dataclass
class Flags:
    multirun: bool = False
    dry_run: bool = False
    print_config: bool = False
    help: bool = False
    worker: str | None = None
    overrides: list[str] = field(default_factory=list)


def parse_args(argv: Sequence[str]) -> Flags:
    flags = Flags()
    it = iter(argv)
    for a in it:
        if a in ("-m", "--multirun"):
            flags.multirun = True
        elif a == "--dry-run":
            flags.dry_run = True
        elif a in ("--print-config", "--cfg"):
            flags.print_config = True
        elif a in ("-h", "--help"):
            flags.help = True
        elif a == "--worker" or a.startswith("--worker="):
            flags.worker = a.partition("=")[2] if "=" in a else next(it, None)
            if not flags.worker:
                raise UsageError("--worker needs the path of a resolved config file")
        elif a.startswith("-"):
            raise UsageError(f"unknown flag {a!r}")
        else:
            flags.overrides.append(a)
    return flags


# ---------------------------------------------------------------------------------------------
# Jobs: sweep expansion, composition, run directories
# ---------------------------------------------------------------------------------------------
def expand_sweep(overrides: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """Hydra's basic-sweeper expansion: (one override list per job, the swept keys).

    ``a=1,2 b=x,y`` -> [a=1 b=x], [a=1 b=y], [a=2 b=x], [a=2 b=y] (the first key varies
    slowest). ``range(..)`` and ``choice(..)`` work; ``glob(..)`` is refused (list the options).
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from recover_hsdp.config import TrainConfigError, one_line

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:  # noqa: BLE001 - OverrideParseException
        raise TrainConfigError(f"cannot parse override: {one_line(e)}") from None
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    for o in parsed:
        if o.is_sweep_override() and "glob(" in o.input_line:
            raise TrainConfigError(f"{o.input_line}: glob() sweeps are not supported; list the "
                                   f"options (e.g. model=llama_debug,llama_1b)")
    try:
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception as e:  # noqa: BLE001
        raise TrainConfigError(f"cannot expand sweep: {one_line(e)}") from None
    jobs = [list(j) for batch in batches for j in batch]
    return jobs or [list(overrides)], swept


def _unique(path: Path) -> Path:
    """An automatic (timestamp) run directory that does not exist yet: path, path-1, ..."""
    if not path.exists():
        return path
    for i in range(1, 10000):
        cand = path.with_name(f"{path.name}-{i}")
        if not cand.exists():
            return cand
    raise RuntimeError(f"no free run directory next to {path}")


def prepare_jobs(overrides: Sequence[str], *, multirun: bool, cwd: str | os.PathLike | None = None,
                 now: datetime.datetime | None = None) -> list[Job]:
    """Compose, resolve and validate every job (nothing is started or written)."""
    from recover_hsdp.config import compose_config, override_dirname, resolve_config, validate

    cwd = Path(cwd or os.getcwd())
    now = now or datetime.datetime.now()
    if multirun:
        job_overrides, swept_keys = expand_sweep(overrides)
    else:
        job_overrides, swept_keys = [list(overrides)], []
    jobs = []
    for i, ovs in enumerate(job_overrides):
        swept = [o for o in ovs if o.split("=", 1)[0].lstrip("+~") in swept_keys]
        cfg = compose_config(ovs)
        explicit = cfg.run.output_dir or cfg.run.name
        base = resolve_config(cfg, cwd=cwd, now=now).run.output_dir
        if not explicit:
            base = str(_unique(Path(base)))
        run_dir = Path(base, f"{i}_{override_dirname(swept)}") if multirun else Path(base)
        cfg = resolve_config(cfg, cwd=cwd, run_dir=run_dir, now=now)
        checked = validate(cfg)
        _check_inputs(checked)
        if holds_run(run_dir) and not cfg.run.overwrite and not cfg.checkpoint.resume:
            from recover_hsdp.config import TrainConfigError

            raise TrainConfigError(f"run.output_dir({str(run_dir)!r}) already holds a run: "
                                   f"choose another run.output_dir/run.name or set "
                                   f"run.overwrite=true")
        if cfg.checkpoint.resume:   # a checkpoint to resume from, compatible
            from recover_hsdp.launcher.resume import check_resume_dir
            check_resume_dir(cfg, run_dir)
        jobs.append(Job(i if multirun else None, list(ovs), swept, cfg, checked))
    dirs = [j.run_dir for j in jobs]
    if len(set(dirs)) != len(dirs):
        from recover_hsdp.config import TrainConfigError

        raise TrainConfigError("two sweep jobs would share one run directory: give "
                               "run.output_dir per job or sweep fewer keys")
    return jobs


def _check_inputs(checked) -> None:
    """The dataset every rank opens, checked here once: one line, exit 2, fast."""
    from recover_hsdp.config import TrainConfigError
    from recover_hsdp.data.preflight import InputUnavailable, check_inputs

    try:
        check_inputs(checked.data)
    except InputUnavailable as e:
        raise TrainConfigError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Launching one job
# ---------------------------------------------------------------------------------------------
def worker_fn_spec() -> str:
    """RECOVER_HSDP_WORKER_FN under its gate (launcher/command.worker_fn_override: RuntimeError
    when set and not honoured), else the trainer."""
    from recover_hsdp.launcher.command import DEFAULT_WORKER_FN, worker_fn_override

    return worker_fn_override() or DEFAULT_WORKER_FN


def check_worker_available() -> str | None:
    """None if the worker function's module can be found, else why not (one line)."""
    try:
        spec = worker_fn_spec()
    except RuntimeError as e:       # the seam named without its gate
        return str(e)
    module = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (f"{module} is not available in this tree: the training manager "
            f"(run_worker) is not written yet")


def launch_job(job: Job) -> JobResult:
    """Write the resolved config, host the store, run mpirun, judge the run directory."""
    from recover_hsdp.config import save_config
    from recover_hsdp.launcher.store import default_store_host
    from recover_hsdp.launcher.supervise import Watch, retry_notice, supervise

    if baseline_name(job.cfg) == "checkpoint_restart":   # relaunches the job after every failure
        from recover_hsdp.baselines.checkpoint_restart import run_checkpoint_restart

        return run_checkpoint_restart(job)
    from recover_hsdp.launcher.resume import run_resilient, wants_supervisor
    if wants_supervisor(job.cfg):
        return run_resilient(job)
    run_dir = job.run_dir
    if job.cfg.run.overwrite and holds_run(run_dir):
        shutil.rmtree(run_dir)
    ldir = run_dir / LAUNCHER_DIR
    ldir.mkdir(parents=True, exist_ok=True)
    config_path = ldir / "config.yaml"
    save_config(job.cfg, config_path)      # the ranks load it as the dataclasses
    host = job.cfg.run.store_host or default_store_host()

    def prepare(store: str):
        env = job_env(job, store)
        cmd = job_command(job, config_path, env)
        knobs = " ".join(f"{k}={shlex.quote(env[k])}" for k in
                         ("RECOVER_HSDP_STORE", "OMP_NUM_THREADS", "RECOVER_HSDP_SHARD_TIMEOUT_S"))
        (ldir / "command.sh").write_text(f"{knobs} \\\n  {shlex.join(cmd)}\n")
        print(f"[{PROG}] run directory {run_dir}", flush=True)
        print(f"[{PROG}] {shlex.join(cmd)}", flush=True)
        return cmd, env

    limit = job.cfg.run.time_limit_s
    try:
        launched = supervise(prepare, run_dir=run_dir, np=int(job.cfg.run.np),
                             watch=Watch.of(job.cfg), log_path=ldir / "output.log",
                             store_host=host,
                             deadline=None if limit is None else time.monotonic() + float(limit),
                             start_retries=int(job.cfg.elastic.start_retries),
                             on_retry=retry_notice(say, "elastic.start_retries"))
    except (OSError, RuntimeError) as e:   # store cannot bind (run.store_host), no mpirun, ...
        res = JobResult(job, "failed", EXIT_FAILED, int(job.cfg.run.steps))
        res.note = (f"could not launch (run.store_host={host!r}, run.mpirun="
                    f"{job.cfg.run.mpirun!r}): {' '.join(str(e).split())}")
        return res
    outcome = launched.outcome
    if launched.startup_failed:
        tries = launched.tries
        res = JobResult(job, "failed", EXIT_FAILED, int(job.cfg.run.steps),
                        launcher_wall_s=outcome.wall_s)
        res.note = (f"start-up failed {tries} time(s), the last: {outcome.reason} "
                    f"(elastic.start_retries={tries - 1}); see {ldir / 'output.log'}")
        return res
    res = judge_run(job, outcome.wall_s, outcome.stopped)
    if outcome.stopped == "time_limit" and not res.note:
        res.note = f"stopped by run.time_limit_s={job.cfg.run.time_limit_s}"
    if res.status != "ok" and not res.note:
        res.note = f"mpirun exit code {outcome.returncode}; see {ldir / 'output.log'}"
    return res



def mpi_problem(jobs: Sequence[Job]) -> str | None:
    """None if every job's mpirun is there (and has ULFM where the job needs it), else why."""
    from recover_hsdp.launcher.command import find_mpirun
    from recover_hsdp.launcher.mpi_check import mpirun_problem

    for job in jobs:
        why = mpirun_problem(find_mpirun(job.cfg.run.mpirun), chosen_by="run.mpirun",
                             ulfm=baseline_name(job.cfg) == "none")
        if why:
            return why
    return None


def run_jobs(jobs: Sequence[Job], *, sweep: bool) -> int:
    why = check_worker_available()
    if why:
        print_error(why)
        return EXIT_FAILED
    why = mpi_problem(jobs)
    if why:                  # before anything is written: one line naming the fix
        print_error(why)
        return exit_codes.UNAVAILABLE
    results = []
    for job in jobs:
        if sweep:
            print(f"[{PROG}] job {job.index + 1}/{len(jobs)}: {job.label}", flush=True)
        res = launch_job(job)
        results.append(res)
        print(format_summary(res), flush=True)
        if res.status == "interrupted":
            break
    if sweep:
        print(f"\n[{PROG}] sweep: {len(results)}/{len(jobs)} jobs run", flush=True)
        print(format_table(results), flush=True)
    return overall_exit(results)


# ---------------------------------------------------------------------------------------------
# Worker (inside each MPI rank)
# ---------------------------------------------------------------------------------------------
def load_worker_fn(cfg=None):
    """The worker function: RECOVER_HSDP_WORKER_FN if set, else the plain-FSDP loop for
    ``baseline`` reference/checkpoint_restart, else the resilient trainer."""
    from recover_hsdp.launcher.command import ENV_WORKER_FN

    spec = worker_fn_spec()
    if cfg is not None and not os.environ.get(ENV_WORKER_FN) and baseline_name(cfg) != "none":
        from recover_hsdp.baselines import PLAIN_WORKER_FN

        spec = PLAIN_WORKER_FN
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise RuntimeError(f"{module_name} is not available in this tree: the training "
                               f"manager (run_worker) is not written yet") from None
        raise
    fn = getattr(module, attr or "run_worker", None)
    if fn is None:
        raise RuntimeError(f"{module_name} has no {attr or 'run_worker'}(cfg) yet")
    return fn


def worker_main(path: str) -> int:
    """Inside a rank: load the resolved config, check the world size, run the trainer.

    The launcher validated everything else before mpirun started; the worker re-checks only what
    can differ from the launcher's view (the ranks actually launched), without importing torch.
    """
    from recover_hsdp.faults.startup import mark_phase, mark_start

    mark_start()    # ranks/start.rank{g}.json: the launcher sees a death before the world forms
    from recover_hsdp.config import TrainConfigError, check_world, load_train_config

    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "?"))
    world = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
    from recover_hsdp.faults import failstop

    try:
        cfg = load_train_config(path)     # the dataclasses, as the launcher validated them
        check_world(cfg, int(world) if world else None)
        fn = load_worker_fn(cfg)
        mark_phase("imported")      # torch and the trainer are in: start-up progress
        from recover_hsdp.faults.seam import refusal

        if refusal():
            raise RuntimeError(refusal())
    except (TrainConfigError, RuntimeError) as e:
        print(f"{PROG} --worker [rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    # any exception or error exit from here on is a fail-stop the survivors see (a non-zero
    # exit is not noticed by ULFM): logged to <run dir>/errors/, then SIGKILL
    failstop.configure(os.environ.get(failstop.ENV_RUN_DIR) or cfg.run.output_dir)
    failstop.install_hooks()
    return int(failstop.run_failstop(fn, cfg, where="trainer") or 0)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        flags = parse_args(argv)
    except UsageError as e:
        print_error(f"{e}\n{USAGE}")
        return EXIT_CONFIG
    if flags.help:
        print(USAGE)
        return EXIT_OK
    if flags.worker is not None:
        return worker_main(flags.worker)
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        print_error("started inside an MPI job: `recover-hsdp train` launches mpirun itself "
                    "(run it outside mpirun; ranks run `python -m recover_hsdp.train --worker "
                    "FILE`)")
        return EXIT_CONFIG
    from recover_hsdp.faults.seam import refusal

    if refusal():               # the verifier's test-only fault seam (recover_hsdp/faults/seam.py)
        print_error(refusal())
        return EXIT_CONFIG

    from recover_hsdp.config import TrainConfigError

    try:
        jobs = prepare_jobs(flags.overrides, multirun=flags.multirun)
    except TrainConfigError as e:
        print_error(str(e))
        return EXIT_CONFIG
    if flags.print_config or flags.dry_run:
        from omegaconf import OmegaConf

        for job in jobs:
            if flags.multirun:
                print(f"# job {job.index}: {job.label}")
            if flags.print_config:
                print(OmegaConf.to_yaml(job.cfg, resolve=True), end="")
            if flags.dry_run:
                env = job_env(job, "<host:port>")
                cfg_path = job.run_dir / LAUNCHER_DIR / "config.yaml"
                print(f"# run directory: {job.run_dir}")
                print(f"RECOVER_HSDP_STORE=<served by the launcher> OMP_NUM_THREADS="
                      f"{env['OMP_NUM_THREADS']} RECOVER_HSDP_SHARD_TIMEOUT_S="
                      f"{env['RECOVER_HSDP_SHARD_TIMEOUT_S']} "
                      f"{shlex.join(job_command(job, cfg_path, env))}")
        return EXIT_OK
    try:
        return run_jobs(jobs, sweep=flags.multirun)
    except KeyboardInterrupt:     # between jobs (a running job is stopped by run_job itself)
        print_error("interrupted")
        return EXIT_INTERRUPTED


def _hydra_task(cfg) -> None:
    """Body of ``hydra_app``: one job from the config Hydra composed (same checks and launch)."""
    from hydra.core.hydra_config import HydraConfig

    from recover_hsdp.config import TrainConfigError, resolve_config, validate

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        overrides = []
    try:
        resolved = resolve_config(cfg)
        job = Job(None, overrides, [], resolved, validate(resolved))
        _check_inputs(job.checked)
        if holds_run(job.run_dir) and not resolved.run.overwrite:
            raise TrainConfigError(f"run.output_dir({str(job.run_dir)!r}) already holds a run: "
                                   f"choose another or set run.overwrite=true")
    except TrainConfigError as e:
        print_error(str(e))
        raise SystemExit(EXIT_CONFIG) from None
    rc = run_jobs([job], sweep=False)
    if rc:
        raise SystemExit(rc)


def __getattr__(name: str):
    # `from recover_hsdp.train import hydra_app` builds the @hydra.main app on first use, so the
    # worker path (python -m recover_hsdp.train --worker) does not import Hydra's app machinery.
    if name == "hydra_app":
        import hydra

        from recover_hsdp.config import CONF_DIR, CONFIG_NAME, register_configs

        register_configs()
        app = hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME,
                         version_base="1.3")(_hydra_task)
        globals()["hydra_app"] = app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
