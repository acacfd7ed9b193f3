"""mpirun launcher helpers: the command line, the ranks' environment, running and stopping a job.

Used by `recover-hsdp train` (recover_hsdp/train.py) and launch/local.sh. Facts this relies on
(docs/cli.md, /work/shared/notes/feasibility.md):

* ULFM needs ``mpirun --with-ft ulfm``; direct ``srun`` launch of the ranks is NOT supported by
  ULFM (inside Slurm, run mpirun in the allocation). ``--oversubscribe`` lets more ranks than
  cores run (CPU tests); as root mpirun also needs ``--allow-run-as-root``.
* Under ``--with-ft ulfm`` mpirun exits 0 even after ranks were SIGKILLed: a run's success is
  read from its run directory, never from mpirun's exit code.
* mpirun puts every rank in its own process group; SIGTERM/SIGINT to mpirun tears the job down
  (measured: ~0.3 s). :func:`run_job` starts mpirun in its own session (a terminal Ctrl-C reaches
  only the launcher), stops it with SIGTERM, and SIGKILLs whatever of its process tree is left
  after a grace period.
* The rendezvous TCPStore is hosted by the launcher, outside the training ranks
  (``RECOVER_HSDP_STORE=host:port``), so rank 0 is not special. ``python -m recover_hsdp.launch
  store`` serves one for shell scripts (launch/local.sh).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping, Sequence

#: Env knobs every rank gets (exported to remote nodes with ``-x``).
ENV_STORE = "RECOVER_HSDP_STORE"                 # = fsdp_hybrid.ENV_STORE
ENV_SHARD_TIMEOUT = "RECOVER_HSDP_SHARD_TIMEOUT_S"   # = fsdp_hybrid.ENV_SHARD_TIMEOUT
ENV_OMP = "OMP_NUM_THREADS"
#: Test seam: "module:function" run by the worker instead of the trainer (default below).
ENV_WORKER_FN = "RECOVER_HSDP_WORKER_FN"
DEFAULT_WORKER_FN = "recover_hsdp.workers.resilient:run_worker"
#: Seconds between SIGTERM to mpirun and SIGKILL of what is left of the job.
STOP_GRACE_S = 10.0


def find_mpirun(explicit: str | None = None) -> str:
    """``explicit``, else the mpirun next to this Python (the venv's ULFM build), else PATH."""
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mpirun"
    if beside.exists():
        return str(beside)
    return shutil.which("mpirun") or "mpirun"


def base_mpirun_args(np: int, *, euid: int | None = None,
                     export: Sequence[str] = ()) -> list[str]:
    """``--with-ft ulfm --mca coll <FT_COLL> --mca pml ob1 --oversubscribe [--allow-run-as-root]
    -n NP [-x VAR ...]`` (FT_COLL: the failure-tested collective components, no ``han``; ob1:
    the only PML ULFM supports, never UCX)."""
    from recover_hsdp.collectives.launch import ft_coll_args, ft_pml_args

    euid = os.geteuid() if euid is None else euid
    args = ["--with-ft", "ulfm", *ft_coll_args(), *ft_pml_args(), "--oversubscribe"]
    if euid == 0:
        args.append("--allow-run-as-root")
    args += ["-n", str(int(np))]
    for var in export:
        args += ["-x", var]
    return args


def worker_command(config_path: str | os.PathLike, python: str | None = None) -> list[str]:
    """What every rank runs: ``<python> -m recover_hsdp.train --worker <resolved config>``."""
    return [python or sys.executable, "-m", "recover_hsdp.train", "--worker",
            os.fspath(config_path)]


def mpirun_command(np: int, config_path: str | os.PathLike, *, mpirun: str | None = None,
                   mpirun_args: Sequence[str] = (), export: Sequence[str] = (),
                   python: str | None = None, euid: int | None = None) -> list[str]:
    """The full launch line: mpirun, its base arguments, ``mpirun_args`` (run.mpirun_args), then
    the worker command."""
    return ([find_mpirun(mpirun)] + base_mpirun_args(np, euid=euid, export=export)
            + [str(a) for a in mpirun_args] + worker_command(config_path, python))


def rank_env(store: str, *, omp_num_threads: int = 1, shard_timeout_s: float | None = None,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment mpirun is started with (local ranks inherit it)."""
    env = dict(os.environ if base is None else base)
    env[ENV_STORE] = store
    env[ENV_OMP] = str(omp_num_threads)
    if shard_timeout_s is not None:
        env[ENV_SHARD_TIMEOUT] = repr(float(shard_timeout_s))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the ranks import this very tree, installed or not, whatever their working directory
    root = str(Path(__file__).resolve().parents[1])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return env


def exported_vars(env: Mapping[str, str]) -> list[str]:
    """The knobs to pass with ``-x`` (only those set: mpirun warns about unset ones)."""
    names = [ENV_STORE, ENV_OMP, ENV_SHARD_TIMEOUT, "PYTHONUNBUFFERED", "PYTHONPATH", ENV_WORKER_FN,
             "RECOVER_HSDP_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE",
             "RECOVER_HSDP_RUN_DIR", "RECOVER_HSDP_HEARTBEAT_S", "RECOVER_HSDP_RAISE_ON_SIGUSR1",
             "RECOVER_HSDP_STARTUP_FAULT", "RECOVER_HSDP_TEST_FAULT",
             "RECOVER_HSDP_ALLOW_TEST_FAULT", "RECOVER_HSDP_TEST_SHARD_WEDGE_S",
             "RECOVER_HSDP_TEST_GATE", "RECOVER_HSDP_CORE_DUMPS", "RECOVER_HSDP_LAUNCH_ID",
             "RECOVER_HSDP_TEST_ID"]   # the test suite's tag: a leaked rank is found by it
    return [n for n in names if n in env]


def default_store_host() -> str:
    """127.0.0.1 for a one-machine job; this host's name inside a multi-node Slurm allocation."""
    try:
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    except ValueError:
        nodes = 1
    if nodes > 1:
        import socket

        return socket.gethostname()
    return "127.0.0.1"


def store_host_problem(host: str) -> str | None:
    """None if the launcher can host the store at ``host`` (it must resolve to an address of
    THIS machine: the launcher binds there and the ranks connect to it), else why not."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"does not resolve ({getattr(e, 'strerror', None) or e})"
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return None
        except OSError:
            continue
    return "is not an address of this machine (the launcher hosts the store here)"


# ---------------------------------------------------------------------------------------------
# Running a job
# ---------------------------------------------------------------------------------------------
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
    every 0.2 s) returning a line stops it too: a start-up failure (faults/startup.py). So does
    ``ended`` (faults/startup.EndWatch): every rank ended, mpirun did not (outcome "ended")."""
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


# ---------------------------------------------------------------------------------------------
# `python -m recover_hsdp.launch ...` for shell launchers
# ---------------------------------------------------------------------------------------------
_USAGE = """usage: python -m recover_hsdp.launch store [HOST]
    serve a TCPStore for the ranks' rendezvous; prints "host:port" on the first line, then serves
    until SIGTERM/SIGINT/SIGHUP or until its parent exits (launch/local.sh exports the address
    as RECOVER_HSDP_STORE)
       python -m recover_hsdp.launch mpirun-args NP
    print the base mpirun arguments (one per line) for NP ranks as this user"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "mpirun-args" and len(argv) == 2 and argv[1].isdigit():
        print("\n".join([find_mpirun()] + base_mpirun_args(int(argv[1]))))
        return 0
    if argv[0] == "store" and len(argv) <= 2:
        from recover_hsdp.hsdp.topology import serve_store

        host = argv[1] if len(argv) == 2 else default_store_host()
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: done.set())
        parent = os.getppid()
        with serve_store(host) as address:
            print(address, flush=True)
            # until signalled, or until the script that started us is gone (no orphan store)
            while not done.wait(1.0) and os.getppid() == parent:
                pass
        return 0
    print(_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
