"""`recover-hsdp launch -n N [options] -- COMMAND ARGS...`: any rank program (a custom loop over
HSDPULFMTrainingManager) under the supervisor `recover-hsdp train` uses.

The store is served here, outside the ranks; every rank runs ``COMMAND`` under
``python -m recover_hsdp.launcher.rank`` (its exit and its errors recorded in the run directory);
the manager writes the heartbeats and the error records by itself (RECOVER_HSDP_RUN_DIR,
RECOVER_HSDP_HEARTBEAT_S); the hang watchdog, the reaper, the start-up watch and retry and the
end watch run here; the exit code is judged from what the ranks left (launcher/judge.py).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from recover_hsdp import exit_codes

PROG = "recover-hsdp launch"

HELP = f"""usage: {PROG} -n N [--hostfile F] [--run-dir D] [--overwrite] [--hang-timeout S]
                           [--heartbeat S] [--progress-timeout S|auto] [--start-retries K]
                           [--time-limit S] [--mpirun-arg ARG ...] -- COMMAND [ARGS...]

Run COMMAND on N ranks under `mpirun --with-ft ulfm`, supervised as `recover-hsdp train` is: the
rendezvous store served here (outside the ranks), heartbeats and errors in the run directory,
a watchdog that SIGKILLs a stopped or wedged rank (no heartbeat for --hang-timeout, or no
progress: --progress-timeout, default auto = max(30 s, 3 x the median step)), the still mates
of a dead rank reaped, a start that dies before the world forms launched again (--start-retries),
a hung mpirun stopped once every rank has ended. COMMAND is typically `python my_loop.py`, a
loop over HSDPULFMTrainingManager (examples/custom_loop.py); N must be its W x S.

options:
  -n N                  ranks to start (the loop's replicas x shard_size)
  --hostfile F          mpirun's hostfile (several nodes)
  --run-dir D           heartbeats (ranks/), errors (errors/), verdicts (faults/), the launcher's
                        log and verdict (launcher/); default runs/launch-<time>
  --overwrite           reuse a run directory that holds an earlier launch
  --hang-timeout S      no heartbeat for S seconds: the rank is judged hung (default 5)
  --heartbeat S         the ranks' heartbeat period (default 1)
  --progress-timeout S  no progress outside an announced long phase (default auto; 0: off)
  --start-retries K     launches again after a death before the world formed (default 1)
  --time-limit S        stop the job after S seconds
  --mpirun-arg ARG      one more mpirun argument (repeatable)

exit codes: (the table of every recover-hsdp command, recover_hsdp/exit_codes.py)
{exit_codes.table()}
  launch's 0: every rank of at least one replica exited 0 with its done mark, none of them
  judged (the replicas lost on the way are reported); its 2 also: no `--`, no such COMMAND, -n
  not W x S of the loop
"""


class UsageError(Exception):
    pass


@dataclass
class Options:
    np: int
    command: list[str]
    hostfile: Optional[str] = None
    run_dir: Optional[str] = None
    overwrite: bool = False
    hang_timeout_s: float = 5.0
    heartbeat_s: float = 1.0
    progress_timeout_s: object = "auto"
    start_retries: int = 1
    time_limit_s: Optional[float] = None
    mpirun_args: list[str] = field(default_factory=list)


def _number(flag: str, v: str, *, integer: bool = False, positive: bool = True):
    try:
        x = int(v) if integer else float(v)
    except ValueError:
        raise UsageError(f"{flag} {v!r}: not a{'n integer' if integer else ' number'}") from None
    if (x <= 0) if positive else (x < 0):
        raise UsageError(f"{flag} {v!r}: must be {'> 0' if positive else '>= 0'}")
    return x


def command_problem(cmd: Sequence[str]) -> Optional[str]:
    """None if ``cmd[0]`` can be run here, else why not (the ranks run the same path)."""
    exe = cmd[0]
    if os.sep in exe:
        if not os.path.isfile(exe):
            return f"{exe}: no such file"
        if not os.access(exe, os.X_OK):
            return f"{exe}: not executable"
        return None
    return None if shutil.which(exe) else f"{exe}: command not found"


def parse(argv: Sequence[str]) -> Options:
    argv = list(argv)
    if "--" not in argv:
        raise UsageError("missing `--` before the command (recover-hsdp launch -n N -- COMMAND "
                         "ARGS...)")
    cut = argv.index("--")
    own, cmd = argv[:cut], argv[cut + 1:]
    if not cmd:
        raise UsageError("no command after `--`")
    o = Options(np=0, command=cmd)
    takes = {"-n", "--hostfile", "--run-dir", "--hang-timeout", "--heartbeat",
             "--progress-timeout", "--start-retries", "--time-limit", "--mpirun-arg"}
    i = 0
    while i < len(own):
        flag = own[i]
        if flag == "--overwrite":
            o.overwrite, i = True, i + 1
            continue
        if flag not in takes:
            raise UsageError(f"unknown option {flag!r} (see --help)")
        if i + 1 >= len(own):
            raise UsageError(f"{flag} needs a value")
        v, i = own[i + 1], i + 2
        if flag == "-n":
            o.np = _number("-n", v, integer=True)
        elif flag == "--hostfile":
            if not os.path.isfile(v):
                raise UsageError(f"--hostfile {v}: no such file")
            o.hostfile = v
        elif flag == "--run-dir":
            o.run_dir = v
        elif flag == "--hang-timeout":
            o.hang_timeout_s = _number(flag, v)
        elif flag == "--heartbeat":
            o.heartbeat_s = _number(flag, v)
        elif flag == "--progress-timeout":
            o.progress_timeout_s = "auto" if v == "auto" else (
                _number(flag, v, positive=False) or None)
        elif flag == "--start-retries":
            o.start_retries = _number(flag, v, integer=True, positive=False)
        elif flag == "--time-limit":
            o.time_limit_s = _number(flag, v)
        else:
            o.mpirun_args.append(v)
    if not o.np:
        raise UsageError("-n N is required (the loop's replicas x shard_size)")
    why = command_problem(cmd)
    if why:
        raise UsageError(why)
    return o


def _log(msg: str) -> None:
    print(f"[{PROG}] {msg}", flush=True)


#: how long the other ranks may take to end after one failed with an error during start-up
ERROR_SETTLE_S = 15.0


def _holds_launch(d: Path) -> bool:
    return any((d / n).exists() for n in ("ranks", "errors", "faults", "launcher"))


def _clear(d: Path) -> None:
    for n in ("ranks", "errors", "faults", "launcher"):
        shutil.rmtree(d / n, ignore_errors=True)


def launch(o: Options) -> int:
    from recover_hsdp.faults.failstop import ENV_HB_PERIOD, ENV_LAUNCH_ID, ENV_RUN_DIR
    from recover_hsdp.launcher.command import base_mpirun_args, exported_vars, find_mpirun
    from recover_hsdp.launcher.command import rank_env
    from recover_hsdp.launcher.judge import EXIT_CONFIG, EXIT_FAILED, judge_launch
    from recover_hsdp.launcher.mpi_check import mpirun_problem
    from recover_hsdp.launcher.store import default_store_host
    from recover_hsdp.launcher.supervise import Watch, retry_notice, supervise

    mpirun = find_mpirun(os.environ.get("MPIRUN"))
    if os.environ.get("MPIRUN") and command_problem([mpirun]):   # a wrong path named: usage
        print(f"{PROG}: error: MPIRUN={mpirun}: {command_problem([mpirun])}", file=sys.stderr,
              flush=True)
        return exit_codes.USAGE
    why = mpirun_problem(mpirun, chosen_by="the MPIRUN environment variable")
    if why:                 # before anything is written: one line, the command that fixes it
        print(f"{PROG}: error: {why}", file=sys.stderr, flush=True)
        return exit_codes.UNAVAILABLE
    run_dir = Path(o.run_dir or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if not o.run_dir:       # a default name is never an earlier launch's
        base, k = run_dir, 1
        while _holds_launch(run_dir):
            k += 1
            run_dir = base.with_name(f"{base.name}-{k}")
    if _holds_launch(run_dir):
        if not o.overwrite:
            print(f"{PROG}: error: {run_dir} holds an earlier launch (--overwrite to reuse it)",
                  file=sys.stderr, flush=True)
            return EXIT_CONFIG
        _clear(run_dir)
    ldir = run_dir / "launcher"
    ldir.mkdir(parents=True, exist_ok=True)
    host = default_store_host()

    def prepare(store: str):
        env = rank_env(store, omp_num_threads=int(os.environ.get("OMP_NUM_THREADS") or 1))
        env[ENV_RUN_DIR] = str(run_dir)
        env[ENV_HB_PERIOD] = repr(float(o.heartbeat_s))
        env[ENV_LAUNCH_ID] = uuid.uuid4().hex[:12]
        cmd = ([mpirun]
               + base_mpirun_args(o.np, export=exported_vars(env))
               + (["--hostfile", o.hostfile] if o.hostfile else []) + o.mpirun_args
               + [sys.executable, "-m", "recover_hsdp.launcher.rank", "--", *o.command])
        (ldir / "command.sh").write_text(
            f"RECOVER_HSDP_STORE={shlex.quote(store)} \\\n  {shlex.join(cmd)}\n")
        _log(f"run directory {run_dir}")
        _log(shlex.join(o.command) + f" on {o.np} ranks")
        return cmd, env

    # the loop's W x S is its own: the reaper's S is told by the heartbeats (shard_size None)
    watch = Watch(float(o.hang_timeout_s), float(o.heartbeat_s), o.progress_timeout_s)
    try:
        launched = supervise(prepare, run_dir=run_dir, np=o.np, watch=watch,
                             log_path=ldir / "output.log", store_host=host,
                             deadline=None if o.time_limit_s is None
                             else time.monotonic() + float(o.time_limit_s),
                             start_retries=int(o.start_retries),
                             on_retry=retry_notice(_log, "--start-retries"),
                             settle_errors_s=ERROR_SETTLE_S)
    except (OSError, RuntimeError) as e:
        print(f"{PROG}: error: could not launch (store host {host!r}): "
              f"{' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    outcome = launched.outcome
    if launched.startup_failed:
        _log(f"FAILED: start-up failed {launched.tries} time(s), the last: {outcome.reason}; "
             f"see {ldir / 'output.log'}")
        return EXIT_FAILED
    v = judge_launch(run_dir, o.np, outcome.stopped)
    if v.common:            # the same error everywhere: one line
        print(f"{PROG}: error: {v.line}", file=sys.stderr, flush=True)
    else:
        for c in v.causes:              # one line per distinct rank failure cause
            _log(c)
        _log(v.line)
    _log(f"run directory {run_dir} ({outcome.wall_s:.1f} s)")
    import json

    (ldir / "verdict.json").write_text(json.dumps({
        "exit_code": v.exit_code, "line": v.line, "causes": v.causes,
        "replicas": v.replicas, "shard_size": v.shard_size, "replicas_done": v.replicas_done,
        "replicas_lost": v.replicas_lost, "stopped": outcome.stopped,
        "wall_s": outcome.wall_s}, indent=1) + "\n")
    return v.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv
    if not argv or "-h" in own or "--help" in own:
        print(HELP, end="", file=sys.stdout if argv else sys.stderr)
        return exit_codes.OK if argv else exit_codes.USAGE
    try:
        o = parse(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return exit_codes.USAGE
    return launch(o)


if __name__ == "__main__":
    sys.exit(main())
