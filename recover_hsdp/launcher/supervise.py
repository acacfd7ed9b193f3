"""One supervised launch: the supervisor every launcher of the toolkit shares.

`recover-hsdp train` (one run; the resilient trainer's relaunch / resume policy, launcher/
resume.py; the checkpoint-restart baseline's relaunch-everything policy, baselines/
checkpoint_restart.py) and `recover-hsdp launch` (launcher/launch_cmd.py) start every mpirun
through :func:`supervise`, so each gets the same supervisor:

    the rendezvous store served here, outside the ranks
    the hang / progress watchdog and the mate reaper (launcher/watchdog.py, reaper.py)
    the start-up watch, and a start that died before the world formed launched again
       (launcher/startup.StartupWatch; up to ``start_retries`` times), as is an mpirun that
       exits non-zero before it started any rank (a runtime that failed to come up)
    the end watch: an mpirun that outlives every one of its ranks is stopped
       (launcher/startup.EndWatch)

What to do once a launch has ended (judge it, relaunch it, resume it) is each caller's POLICY;
how a launch is watched is not theirs to copy. The watchers read the ranks' heartbeats
(faults/failstop.py), so ``Watch.hang_timeout_s == 0`` turns all three off.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from recover_hsdp.launcher.rank import EXIT_RECORD
from recover_hsdp.launcher.watchdog import PROGRESS_FLOOR_S


@dataclass(frozen=True)
class Watch:
    """How the ranks of one launch are watched (docs/faults.md, "Fault classes")."""
    hang_timeout_s: float                 # no heartbeat for this long: hung; 0: no watching
    heartbeat_s: float = 1.0
    progress_timeout_s: Any = "auto"      # seconds, "auto" (max(floor, 3 x median step)), None
    floor_s: float = PROGRESS_FLOOR_S
    #: the ranks per replica (the mate reaper's groups); None: told by the heartbeats once the
    #: world has formed (a custom loop's W x S is the loop's own)
    shard_size: Optional[int] = None
    startup_timeout_s: Optional[float] = None     # None: startup.startup_bound_s()
    #: EndWatch's bound on a death the runtime did not deliver; None: not judged
    deliver_s: Optional[float] = None

    @classmethod
    def of(cls, cfg) -> "Watch":
        """The watch a `recover-hsdp train` config asks for (the ``watchdog`` group)."""
        wd = cfg.watchdog
        hang = float(wd.hang_timeout_s or 0)
        return cls(hang, float(wd.heartbeat_s), wd.progress_timeout_s,
                   float(wd.progress_floor_s), int(cfg.parallel.shard_size),
                   wd.startup_timeout_s, hang + 2 * float(wd.heartbeat_s))


@dataclass
class Launched:
    """What one :func:`supervise` call saw: the last mpirun's outcome, its start-up watch."""
    outcome: Any                       # launcher/run.JobOutcome of the last mpirun
    start: Any = None                  # its StartupWatch (None when not watched)
    tries: int = 1                     # mpiruns started: 1 + the start-up retries used

    @property
    def startup_failed(self) -> bool:
        """The last mpirun died before its world formed, with no rank error to blame."""
        return (self.outcome.stopped == "startup" and self.start is not None
                and not self.start.errors_logged())


#: (store address) -> (the mpirun line, the ranks' environment) of one try
Prepare = Callable[[str], "tuple[Sequence[str], Mapping[str, str]]"]


def retry_notice(log: Callable[[str], None], key: str, what: str = ""
                 ) -> Callable[[int, int, Any], None]:
    """The ``on_retry`` of every launcher: one line naming the failed start and ``key``, the
    setting whose retries it uses (``what``: the launch retried, e.g. "segment 2")."""
    def notice(n: int, of: int, out) -> None:
        log(f"start-up failed ({out.reason}) after {out.wall_s:.1f} s: launching "
            f"{what + ' ' if what else ''}again ({n}/{of} of {key})")
    return notice


def _no_rank_started(run_dir: Path) -> bool:
    """Not one rank of this try left a mark (start marker, heartbeat, exit record)."""
    from recover_hsdp.faults.failstop import RANKS_DIR

    d = run_dir / RANKS_DIR
    return not d.is_dir() or not any(
        p.name.endswith(".json") and not p.name.startswith(".") for p in d.iterdir())


def _all_exited(run_dir: Path, np: int) -> bool:
    from recover_hsdp.faults.failstop import RANKS_DIR

    d = run_dir / RANKS_DIR
    return all((d / EXIT_RECORD.format(g=g)).exists() for g in range(np))


def supervise(prepare: Prepare, *, run_dir: Path, np: int, watch: Optional[Watch],
              log_path: Path, store_host: str, deadline: Optional[float] = None,
              start_retries: int = 0,
              on_retry: Callable[[int, int, Any], None] = lambda k, n, outcome: None,
              settle_errors_s: float = 0.0, in_thread: bool = False) -> Launched:
    """Serve a store, start ``prepare(store)``'s mpirun under the watchers, run it to its end.

    ``deadline`` (time.monotonic()) stops the job (outcome "time_limit"). A try whose world did
    not form, with no rank error logged, is started again (``on_retry(k, start_retries, outcome)``
    first) up to ``start_retries`` times. ``settle_errors_s``: when a rank has logged an error
    before the world formed, the others get that long to reach theirs (the same error
    everywhere is a user error) before the start is judged. ``in_thread``: run mpirun from a
    thread, leaving this thread's signal handlers to the caller (a stop request).
    OSError / RuntimeError (the store cannot bind, no mpirun) propagate."""
    from recover_hsdp.faults.failstop import ENV_LAUNCH_ID
    from recover_hsdp.faults.signing import served_keys, write_key_file
    from recover_hsdp.hsdp.topology import serve_store
    from recover_hsdp.launcher.run import run_job
    from recover_hsdp.launcher.startup import EndWatch, StartupWatch, clear_startup_state
    from recover_hsdp.launcher.watchdog import HangWatchdog

    run_dir = Path(run_dir)
    watching = watch is not None and watch.hang_timeout_s > 0
    tries = 1 + max(0, int(start_retries))
    for k in range(1, tries + 1):
        if watching:
            clear_startup_state(run_dir)   # an earlier launch's heartbeats are not this one's
        with serve_store(store_host) as store:
            key = served_keys[store]           # this launch's job key (docs/security.md)
            write_key_file(run_dir, key)       # launcher/job.key, mode 0600
            cmd, env = prepare(store)
            wd = start = end = None
            if watching:
                wd = HangWatchdog(run_dir, watch.hang_timeout_s, watch.heartbeat_s,
                                  watch.progress_timeout_s, floor_s=watch.floor_s,
                                  shard_size=watch.shard_size or 1, key=key,
                                  launch_id=env.get(ENV_LAUNCH_ID)).start()
                start = StartupWatch(run_dir, np, watch.startup_timeout_s)
                end = EndWatch(run_dir, np, stale_s=3 * watch.hang_timeout_s,
                               launch_id=env.get(ENV_LAUNCH_ID), deliver_s=watch.deliver_s)
            settle: dict[str, Optional[float]] = {"since": None}

            def poll_start() -> Optional[str]:
                if wd.reaper is None and watch.shard_size is None and start.formed:
                    # the reaper needs S, which the loop's heartbeats tell once they all beat
                    from recover_hsdp.launcher.judge import launch_shape

                    S = launch_shape(run_dir, np)[1]
                    if 1 < S < np:
                        wd.reaper = wd.make_reaper(S)
                why = start.poll()
                if (why and settle_errors_s > 0 and start.errors_logged()
                        and not _all_exited(run_dir, np)):
                    settle["since"] = settle["since"] or time.monotonic()
                    if time.monotonic() - settle["since"] < settle_errors_s:
                        return None
                return why

            limit = None if deadline is None else max(1.0, deadline - time.monotonic())
            kw = dict(log_path=log_path, time_limit_s=limit,
                      watch=poll_start if watching else None,
                      ended=end.poll if watching else None)
            try:
                if in_thread:
                    box: dict[str, Any] = {}
                    th = threading.Thread(target=lambda: box.update(
                        out=run_job(cmd, env, **kw)), name="mpirun")
                    th.start()
                    while th.is_alive():
                        th.join(0.2)
                    if "out" not in box:
                        raise RuntimeError("the launch thread ended without an outcome")
                    outcome = box["out"]
                else:
                    outcome = run_job(cmd, env, **kw)
            finally:
                if wd is not None:
                    wd.stop()
        if (watching and outcome.stopped is None and outcome.returncode not in (0, None)
                and _no_rank_started(run_dir) and not start.errors_logged()):
            # mpirun gave up before it started a single rank (seen here on a loaded machine:
            # "The PMIx server's listener thread failed to start"): a failed start, retried
            outcome = dataclasses.replace(
                outcome, stopped="startup",
                reason=f"mpirun exited with code {outcome.returncode} before any rank started")
        got = Launched(outcome, start, k)
        if not got.startup_failed or k == tries:
            return got
        on_retry(k, tries - 1, outcome)
    raise AssertionError("unreachable")
