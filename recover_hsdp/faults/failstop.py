"""Every error in a rank becomes a fail-stop that ULFM sees; hung ranks are found from outside.

Two halves (docs/faults.md, "Fault classes"):

* **Errors -> fail-stop.** A Python exception (or ``sys.exit(n != 0)``) in a rank would exit it
  non-zero, which ULFM does NOT see as a failure: the survivors would wait forever
  (feasibility.md). :func:`fail_stop` writes ``errors/rank{g}.json`` and the traceback, prints one
  line on stderr and SIGKILLs the process (:func:`run_failstop` wraps a worker; :func:`install_hooks`
  routes uncaught exceptions there for custom loops). An error in a shard-group collective (gloo
  "Connection closed by peer", NCCL "remote process exited", a timeout) is not the rank's own:
  :func:`is_peer_failure` says "my replica lost a member" and it leaves by ``replica_lost_exit``.
* **Hung ranks.** :class:`Heartbeat` is a daemon thread rewriting ``ranks/rank{g}.json`` (pid,
  host, time, progress counter, announced long phase, clean-exit mark) every ``period_s``;
  ``launcher/watchdog.py`` ``HangWatchdog`` (in the launcher; a rank on another node through a
  kill order its node's heartbeat threads serve, faults/orders.py) SIGKILLs a rank
  whose heartbeat is older than ``timeout_s`` (a waiting rank still beats: collectives release
  the GIL), one whose progress stalled outside a long phase (``progress_timeout_s``, on by
  default: ``auto``), and, through launcher/reaper.py, the mates of a rank that died that do not
  notice it (NCCL).

The launcher judges a job whose replicas all logged an error of the same class as a user error:
one line, non-zero exit (launcher/judge.py ``common_error``, which reads errors/).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from recover_hsdp.faults import errorlog, orders
from recover_hsdp.faults.errorlog import ERRORS_DIR, fallback_dir  # noqa: F401 - re-exported
from recover_hsdp.faults.errorlog import write_record as _write_record
from recover_hsdp.faults.injector import replica_lost_exit, sigkill_self

RANKS_DIR = "ranks"
ENV_RUN_DIR = "RECOVER_HSDP_RUN_DIR"
ENV_HB_PERIOD = "RECOVER_HSDP_HEARTBEAT_S"
ENV_LAUNCH_ID = "RECOVER_HSDP_LAUNCH_ID"   # per launch (launcher/job.job_env): heartbeats name it
ENV_RAISE_ON_SIGUSR1 = "RECOVER_HSDP_RAISE_ON_SIGUSR1"   # chaos: SIGUSR1 -> InjectedFault;
#   with the test-fault allow variable also SIGUSR2 -> wedge (the main thread blocks for good)
#: a heartbeat starts inside the announced phase "start-up" (world formation, the model's
#: sharding, a checkpoint load, the initial snapshot), ended by the first step (step_begins):
#: the progress watchdog judges it only past this bound
STARTUP_PHASE_S = 600.0


class InjectedFault(RuntimeError):
    """Raised in a rank's main thread by SIGUSR1 (chaos soak: "make a rank raise")."""

#: exception classes that mean "the input / configuration is missing or wrong": exit 2
CONFIG_ERRORS = ("FileNotFoundError", "PermissionError", "NotADirectoryError",
                 "IsADirectoryError", "TrainConfigError", "ScheduleError", "DataConfigError",
                 "DataUnavailableError", "ConnectionError", "OfflineModeIsEnabled",
                 "LocalEntryNotFoundError", "DatasetNotFoundError")

# wording of a lost shard-group peer, whatever the backend (lower case substrings)
_PEER_PATTERNS = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "timed out waiting", "timed out", "timeout", "remote process exited",
    "nccl communicator was aborted", "ncclremoteerror", "ncclsystemerror",
    "socket closed", "connection refused", "read error", "write error",
    "process group watchdog", "collective operation timeout",
)

_state: dict[str, Any] = {"run_dir": None, "rank": None, "replica": None, "where": None,
                          "step": None, "hooked": False,
                          "unwritable": None, "posted": None}


def configure(run_dir: Optional[os.PathLike | str] = None, rank: Optional[int] = None,
              replica: Optional[int] = None) -> None:
    """Where this rank's error record goes (run_dir None: RECOVER_HSDP_RUN_DIR, else stderr only)."""
    if run_dir is not None:
        _state["run_dir"] = Path(run_dir)
    if rank is not None:
        _state["rank"] = int(rank)
    if replica is not None:
        _state["replica"] = int(replica)


def set_context(where: Optional[str] = None, step: Optional[int] = None) -> None:
    """What the rank is doing (reported with an error): e.g. where="loss_fn", step=3."""
    _state["where"] = where
    if step is not None:
        _state["step"] = int(step)


def context() -> Optional[str]:
    """What the rank is doing now (the ``where`` of the last set_context; None: nothing named)."""
    return _state["where"]


def _rank() -> int:
    if _state["rank"] is not None:
        return _state["rank"]
    for v in ("OMPI_COMM_WORLD_RANK", "RANK"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return -1


def _run_dir() -> Optional[Path]:
    if _state["run_dir"] is not None:
        return _state["run_dir"]
    d = os.environ.get(ENV_RUN_DIR)
    return Path(d) if d else None


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` reads as a lost or hung shard-group peer (gloo, NCCL, timeouts)."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError,
                          TimeoutError)):
            return True
        if isinstance(e, RuntimeError) or type(e).__name__ in ("DistBackendError",
                                                               "DistNetworkError"):
            msg = str(e).lower()
            if any(p in msg for p in _PEER_PATTERNS):
                return True
        e = e.__cause__ or e.__context__
    return False


def error_record(exc: BaseException, where: Optional[str] = None) -> dict:
    msg = " ".join(str(exc).split())[:300]
    name = type(exc).__name__
    code = exc.code if isinstance(exc, SystemExit) else None
    return {"rank": _rank(), "replica": _state["replica"], "pid": os.getpid(),
            "host": socket.gethostname(), "time": time.time(), "class": name, "message": msg,
            "where": where or _state["where"], "step": _state["step"],
            "exit_code_hint": 2 if name in CONFIG_ERRORS or code == 2 else 1}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"


_cause = errorlog.cause_of      # one cause: class, message with its numbers masked, where


def write_error(exc: BaseException, where: Optional[str] = None) -> Optional[Path]:
    """Write errors/rank{g}.json (one line) and errors/rank{g}.traceback.txt; when errors/
    cannot be written (``_state["unwritable"]`` says why), post both to the launcher's store
    (``_state["posted"]``; bounded wait), else write them into :func:`fallback_dir`
    (faults/errorlog.py). Returns the file written, None when none was. Never raises."""
    rec = error_record(exc, where)
    d = _run_dir()
    _state["unwritable"] = _state["posted"] = None
    if d is None:
        return None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        return _write_record(d / ERRORS_DIR, rec, tb)
    except Exception as e:  # noqa: BLE001 - a full disk must not keep a failed rank alive
        _state["unwritable"] = _one_line(e)
    _state["posted"] = errorlog.post(d, rec, tb, _cause(rec))
    if _state["posted"] is not None:
        return None
    try:
        return _write_record(errorlog.fallback_dir(d), rec, tb)
    except Exception:  # noqa: BLE001
        return None


def _first_of_cause(path: Path, rec: dict) -> bool:
    """True for the first rank (on this node) to fail with this cause (class, message with its
    numbers masked, where): it alone prints the traceback on the console, the others one line."""
    mark = path.parent / f"cause-{hashlib.sha1(_cause(rec).encode()).hexdigest()[:12]}"
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError:
        return False


def fail_stop(exc: BaseException, where: Optional[str] = None,
              kill: Optional[Callable[[], None]] = None) -> None:
    """Log ``exc`` (one line on stderr + the run record), then leave by SIGKILL. Never returns
    (unless ``kill`` returns, in tests). A peer failure leaves as "replica lost" instead.

    When errors/ cannot be written the record goes to the launcher's store, else to the
    fallback directory (faults/errorlog.py), and the line says so; the traceback is then printed
    once per distinct cause (by the first rank with it: the store counts causes across nodes),
    never by every rank; only when nothing at all can be written does the rank print its own."""
    if is_peer_failure(exc):
        replica_lost_exit(f"rank {_rank()}: shard group failed: "
                          f"{' '.join(str(exc).split())[:200]}", kill=kill)
        return
    path = write_error(exc, where)
    rec = error_record(exc, where)
    unwritable = _state.get("unwritable")
    at = f" in {rec['where']}" if rec["where"] else ""
    at += f" at step {rec['step']}" if rec["step"] is not None else ""
    posted = _state.get("posted")
    tail = (f" (traceback: {path.with_suffix('').as_posix()}.traceback.txt)" if path else
            f"; record and traceback sent to the launcher's store ({posted['address']})"
            if posted else "")
    if unwritable:
        tail = f"; {ERRORS_DIR}/ unwritable ({unwritable})" + tail
    try:
        print(f"[recover_hsdp] rank {rec['rank']}: {rec['class']}: {rec['message']}{at}; "
              f"leaving by SIGKILL{tail}", file=sys.stderr, flush=True)
        if path is None and not posted:          # nowhere: its own traceback, always
            first = True
        elif unwritable:                         # one traceback per cause (store: all nodes)
            first = posted["first"] if posted else _first_of_cause(path, rec)
        else:
            first = False
        if first:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    except Exception:
        pass
    (kill or sigkill_self)()


def run_failstop(fn: Callable[..., Any], *args, where: str = "worker", **kw) -> Any:
    """Run ``fn``; any exception, or a SystemExit with a non-zero code, becomes a fail-stop."""
    try:
        out = fn(*args, **kw)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        fail_stop(e, where)
        raise
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included: leave seen
        fail_stop(e, where)
        raise
    return out


def install_hooks() -> None:
    """Route uncaught exceptions (any thread) to :func:`fail_stop`. Idempotent."""
    if _state["hooked"]:
        return
    _state["hooked"] = True

    def hook(tp, value, tb):  # noqa: ARG001
        if issubclass(tp, SystemExit) and value.code in (0, None):
            return
        fail_stop(value, _state["where"])

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        fail_stop(args.exc_value, f"thread {getattr(args.thread, 'name', '?')}")

    sys.excepthook = hook
    threading.excepthook = thread_hook
    if os.environ.get(ENV_RAISE_ON_SIGUSR1) == "1" and \
            threading.current_thread() is threading.main_thread():
        def on_usr1(signum, frame):  # noqa: ARG001
            raise InjectedFault("injected by SIGUSR1 (chaos)")

        signal.signal(signal.SIGUSR1, on_usr1)
        if os.environ.get("RECOVER_HSDP_ALLOW_TEST_FAULT") == "1":
            def on_usr2(signum, frame):  # noqa: ARG001
                # chaos's wedge: the main thread blocks here for good, the heartbeat beats on;
                # only the launcher's progress watchdog can judge it. A phase it interrupts (the
                # test gate's hold) is abandoned: the wedge is judged by the progress bound.
                from recover_hsdp.faults.injector import wedge

                hb = _hb["hb"]
                if hb is not None:
                    hb.phase = hb.phase_until = None
                    hb.beat()
                wedge()

            signal.signal(signal.SIGUSR2, on_usr2)


# ---------------------------------------------------------------------------------------------
# Heartbeats (ranks) and the hang watchdog (launcher)
# ---------------------------------------------------------------------------------------------
#: where a main thread blocked in a collective waits: on its peers, not on itself
_PEER_WAITS = (f"{os.sep}torch{os.sep}distributed{os.sep}",
               f"{os.sep}recover_hsdp{os.sep}collectives{os.sep}",
               f"{os.sep}recover_hsdp{os.sep}hsdp{os.sep}dataplane{os.sep}")


def main_waits_on_peers() -> bool:
    """True when the main thread's innermost Python frame is in torch.distributed or our
    collectives: a rank blocked there waits on a peer. When every rank of a replica stalls (one
    wedged, its mates blocked on it in a shard collective), the watchdog judges first the ranks
    that are NOT waiting on peers: the wedged one, not its mates."""
    try:
        f = sys._current_frames().get(threading.main_thread().ident)
    except Exception:  # noqa: BLE001 - the heartbeat must keep beating
        return False
    # an async data plane waits in threading's Event.wait, called from hsdp/dataplane: look
    # through the threading frames to their caller
    for _ in range(4):
        if f is None or not f.f_code.co_filename.endswith(f"{os.sep}threading.py"):
            break
        f = f.f_back
    return f is not None and any(w in f.f_code.co_filename for w in _PEER_WAITS)


class Heartbeat:
    """A daemon thread rewriting ranks/rank{g}.json every ``period_s`` (atomic replace)."""

    def __init__(self, run_dir: os.PathLike | str, rank: int, period_s: float = 1.0):
        self.path = Path(run_dir) / RANKS_DIR / f"rank{int(rank)}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = int(rank)
        self.period_s = float(period_s)
        self.progress = 0
        self.phase: Optional[str] = "start-up"
        self.phase_until: Optional[float] = time.time() + STARTUP_PHASE_S
        self._starts: list[float] = []     # the last step starts: the median step time
        self.progress_time = time.time()   # of the last progress (orders the watchdog's verdicts)
        self.step_s: Optional[float] = None
        self.done = False          # a clean exit (mark_done): the reaper must not take it for a death
        self._lock = threading.Lock()   # one writer of the file at a time (thread, mark_done)
        self.host = socket.gethostname()
        self.start_ticks = orders.proc_start(os.getpid())   # names this process in kill orders
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover_hsdp-heartbeat",
                                        daemon=True)

    def start(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        return self

    def stop(self, join_s: float = 0.0) -> None:
        """Stop beating; ``join_s`` > 0: also wait (at most that long) for the thread to end."""
        self._stop.set()
        t = self._thread
        if join_s > 0 and t.is_alive() and t is not threading.current_thread():
            t.join(join_s)

    def tick(self) -> None:
        """The main thread made progress (a microbatch, a collective returned, a commit)."""
        self.progress += 1
        self.progress_time = time.time()

    def step_begins(self) -> None:
        """A step (or a standby's world round) begins: progress, the end of "start-up", and
        the median of the last 20 step times the watchdog's auto bound scales with."""
        now = time.time()
        if self.phase == "start-up":
            self.phase = self.phase_until = None
        self._starts = (self._starts + [now])[-21:]
        gaps = sorted(b - a for a, b in zip(self._starts, self._starts[1:]))
        self.step_s = gaps[len(gaps) // 2] if gaps else None
        self.progress += 1
        self.progress_time = now

    @contextmanager
    def long_phase(self, name: str, expected_s: Optional[float] = None) -> Iterator[None]:
        """Announce a phase that may make no progress for long (a checkpoint save, a heal)."""
        self.phase, self.phase_until = name, (time.time() + expected_s if expected_s else None)
        self.beat()
        try:
            yield
        finally:
            self.phase = self.phase_until = None
            self.tick()
            self.beat()

    def beat(self) -> None:
        with self._lock:    # the record is read and written whole: a later beat has a later state
            rec = {"rank": self.rank, "replica": _state["replica"], "pid": os.getpid(),
                   "host": self.host, "start": self.start_ticks,
                   "time": time.time(), "progress": self.progress, "phase": self.phase, "done":
                   self.done, "phase_until": self.phase_until, "period_s": self.period_s,
                   "step_s": self.step_s, "progress_time": self.progress_time,
                   "waiting": main_waits_on_peers(),
                   "launch": os.environ.get(ENV_LAUNCH_ID)}
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.write_text(json.dumps(rec))
                os.replace(tmp, self.path)
            except OSError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.beat()
            try:    # the launcher's kill orders for this host (faults/orders.py): another node's
                orders.serve_orders(self.path.parent, self.host, self.rank)   # watchdog's arm
            except Exception:  # noqa: BLE001 - the heartbeat must keep beating
                pass


_hb: dict[str, Optional[Heartbeat]] = {"hb": None}


def start_heartbeat(run_dir: os.PathLike | str | None, rank: int,
                    period_s: Optional[float] = None) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (once). period_s None: RECOVER_HSDP_HEARTBEAT_S, else off."""
    if _hb["hb"] is not None:
        return _hb["hb"]
    if period_s is None:
        v = os.environ.get(ENV_HB_PERIOD)
        period_s = float(v) if v else None
    if not run_dir or not period_s or period_s <= 0:
        return None
    _hb["hb"] = Heartbeat(run_dir, rank, period_s).start()
    atexit.register(mark_done)          # a custom loop's normal interpreter exit
    if os.environ.get("OMPI_COMM_WORLD_RANK") is not None:
        from recover_hsdp.faults import console

        console.never_block()           # a daemon that stops reading cannot wedge this rank
    return _hb["hb"]


def mark_done() -> None:
    """A clean exit (before each os._exit that is no failure): the reaper spares the mates. The
    thread is joined first (bounded: a period + 5 s): the file's LAST write is this, done=true."""
    hb = _hb["hb"]
    if hb is not None and not hb.done:
        hb.stop(join_s=hb.period_s + 5.0)
        with hb._lock:
            hb.done = True
        hb.beat()


def tick() -> None:
    hb = _hb["hb"]
    if hb is not None:
        hb.tick()


def step_begins() -> None:
    """Call as each step (a standby: each world round) begins: Heartbeat.step_begins."""
    hb = _hb["hb"]
    if hb is not None:
        hb.step_begins()


@contextmanager
def long_phase(name: str, expected_s: Optional[float] = None) -> Iterator[None]:
    hb = _hb["hb"]
    if hb is None:
        yield
    else:
        with hb.long_phase(name, expected_s):
            yield


# ---------------------------------------------------------------------------------------------
# The chain of bounded waits
# ---------------------------------------------------------------------------------------------
#: how often the launcher's watchdog reads the heartbeats (at most)
WATCH_POLL_S = 0.5
#: ULFM detection of a SIGKILLed rank + revoke + shrink + Record (measured 7-13 ms + 0.1-2 ms on
#: this machine), plus the rest of a reduction pass after a repair (quiesced: no traffic), with
#: two orders of magnitude of slack for a loaded machine
REPAIR_MARGIN_S = 5.0


def gate_bound_s(hang_timeout_s: float, heartbeat_s: float) -> float:
    """The longest a healthy rank can wait at the replica-consistency gate for a healthy mate.

    A mate is late at the gate only while it sits in a cross-replica call (its reduction pass)
    waiting for a rank of ANOTHER replica; the microbatch loop has no cross-replica traffic, and
    both run the same microbatches. That rank is either dead (ULFM detects it: ms) or hung: its
    last heartbeat is at most heartbeat_s old when it stops, the watchdog sees it stale after
    hang_timeout_s and reads every WATCH_POLL_S, then the SIGKILL is an ordinary death (repair:
    REPAIR_MARGIN_S). The shard-group timeout must exceed this, or a healthy replica could time
    out at the gate first and be killed.
    """
    return float(hang_timeout_s) + float(heartbeat_s) + WATCH_POLL_S + REPAIR_MARGIN_S
