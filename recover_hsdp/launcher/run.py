"""Running a job: start mpirun in its own session, stream its output, stop it (SIGTERM, then
SIGKILL of what is left of its process tree). Moved from recover_hsdp/launch.py.

mpirun puts every rank in its own process group; SIGTERM/SIGINT to mpirun tears the job down
(measured: ~0.3 s). Under ``--with-ft ulfm`` mpirun exits 0 even after ranks were SIGKILLed: a
run's success is read from its run directory (launcher/judge.py), never from mpirun's exit code.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Mapping, Sequence

#: Seconds between SIGTERM to mpirun and SIGKILL of what is left of the job.
STOP_GRACE_S = 10.0


@dataclass
class JobOutcome:
    returncode: int | None     # mpirun's (None if it had to be killed without reaping)
    wall_s: float
    stopped: str | None        # None, "interrupted" (Ctrl-C / SIGTERM), "time_limit" or
                               # "startup" (``watch`` reported a failed start-up)
    reason: str | None = None  # ``watch``'s one line when stopped == "startup"


class _Stop(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc); [] where /proc is unavailable."""
    if not os.path.isdir("/proc"):
        return []
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def stop_job(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM mpirun (it tears its ranks down), then SIGKILL anything of its tree still alive."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid] + tree + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _pump(src: IO[bytes], sinks: Sequence[IO[bytes]]) -> None:
    for line in iter(src.readline, b""):
        for s in sinks:
            try:
                s.write(line)
                s.flush()
            except (OSError, ValueError):
                pass
    src.close()


def run_job(cmd: Sequence[str], env: Mapping[str, str], *, log_path: str | os.PathLike | None
            = None, time_limit_s: float | None = None, stdout: IO[bytes] | None = None,
            grace_s: float = STOP_GRACE_S,
            watch: Callable[[], str | None] | None = None,
            ended: Callable[[], str | None] | None = None) -> JobOutcome:
    """Run ``cmd`` (mpirun ...) to completion, streaming its merged stdout/stderr to ``stdout``
    (default: this process's stdout) and ``log_path``. Ctrl-C, SIGTERM to the launcher, or
    ``time_limit_s`` stop the job (:func:`stop_job`); the outcome says which. ``watch`` (polled
    every 0.2 s) returning a line stops it too: a start-up failure (launcher/startup.py). So does
    ``ended`` (launcher/startup.EndWatch): every rank ended, mpirun did not (outcome "ended")."""
    out = stdout if stdout is not None else sys.stdout.buffer
    log = open(log_path, "ab") if log_path is not None else None
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, [s for s in (out, log) if s]),
                            daemon=True)
    pump.start()

    def on_term(signum, frame):  # noqa: ARG001
        raise _Stop("interrupted")

    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, on_term)
    stopped, reason = None, None
    try:
        deadline = None if time_limit_s is None else t0 + time_limit_s
        while proc.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise _Stop("time_limit")
            if watch is not None:
                reason = watch()
                if reason:
                    raise _Stop("startup")
            if ended is not None:
                reason = ended()
                if reason:
                    print(f"[recover-hsdp] {reason}", file=sys.stderr, flush=True)
                    raise _Stop("ended")
            try:
                proc.wait(0.2)
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        stopped = "interrupted"
    except _Stop as s:
        stopped = s.why
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if proc.poll() is None:   # every rank ended: nothing left for mpirun to tear down
            stop_job(proc, 0.5 if stopped == "ended" else grace_s)
        pump.join(5)
        if log is not None:
            log.close()
    return JobOutcome(proc.returncode, time.monotonic() - t0, stopped, reason)
