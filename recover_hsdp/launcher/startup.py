"""Deaths during start-up, before the world forms (docs/faults.md "Start-up").

Until every rank has joined the rendezvous and built its groups, ULFM has nothing to recover: a
rank that dies there leaves the others blocked in the TCPStore rendezvous until its timeout
(120 s, ``topology.DEFAULT_STORE_TIMEOUT_S``), and the job is gone. The launcher watches instead:

* each rank writes ``ranks/start.rank{g}.json`` (pid, host, time) first thing in
  ``recover_hsdp.train --worker`` (:func:`mark_start`), before torch, MPI or the store;
* the world has FORMED when every rank's heartbeat ``ranks/rank{g}.json`` exists (written once
  its shard groups and world communicator are built) or a step was committed;
* each rank then rewrites that marker at every start-up phase it passes (:func:`mark_phase`:
  ``imported`` torch and the trainer, ``joined`` the rendezvous, built its shard ``groups``,
  ``wrapped`` the model): start-up PROGRESS the launcher can see;
* :class:`StartupWatch` (polled by the launcher every 0.2 s) reports a start-up failure when,
  before the world formed, a started rank on this host is dead (detected in < 1 s; a program
  that EXITED 0 is not, by its shim's exit record, e.g. one that never uses the manager), or no rank
  has made start-up progress for the start-up bound (a rank hung or dead before its marker, a
  remote one). Progress is a marker that appears or changes phase, or a local rank whose CPU
  time grew (importing torch alone took over 65 s per rank at load average 23 on 2 cores). A
  loaded machine that is slow but advancing is never cut off; a SIGSTOPped or blocked start is
  judged one bound after the last progress. A rank that spins without advancing is bounded by
  the ranks' own rendezvous timeout (``topology.DEFAULT_STORE_TIMEOUT_S``, 120 s): the others
  log an error and fail-stop, which the watch sees as a dead rank.

The launcher then stops the job and launches it again, up to ``run.start_retries`` times (a start
is cheap and nothing was committed), then fails with one line. A rank that logged an error
(``errors/``) is not retried: the same input would fail the same way; the launcher judges it.

The rank side (mark_start, mark_phase, the RECOVER_HSDP_STARTUP_FAULT test seam) is
faults/startup.py; this is the launcher's watch (moved from faults/startup.py).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from recover_hsdp.faults.failstop import RANKS_DIR
from recover_hsdp.faults.startup import PHASES  # noqa: F401  (the phases a rank marks)
from recover_hsdp.launcher.rank import EXIT_RECORD
from recover_hsdp.launcher.reaper import alive as _alive

#: the watch's default no-progress bound is derived from this (60 s + 5 s). The ranks' own
#: rendezvous timeout (topology.DEFAULT_STORE_TIMEOUT_S) is 120 s
STORE_TIMEOUT_S = 60.0


#: how long a gone program's shim may take to write its exit record (launcher/rank.py: it
#: waits up to 5 s for the program's stderr to drain, then writes it)
EXIT_RECORD_WAIT_S = 8.0


def _cpu_ticks(pid: int) -> Optional[int]:
    """utime + stime of a local process in clock ticks (/proc/<pid>/stat), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def startup_bound_s(store_timeout_s: float = STORE_TIMEOUT_S) -> float:
    """The default start-up bound (65 s): how long a start may go without progress."""
    return store_timeout_s + 5.0


def clear_startup_state(run_dir: os.PathLike | str) -> None:
    """Before a relaunch: forget the failed start's markers and heartbeats (nothing committed)."""
    d = Path(run_dir) / RANKS_DIR
    if d.is_dir():
        for p in d.iterdir():
            try:
                if p.is_dir():       # orders/ (faults/orders.py: kill orders to other nodes)
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink()
            except OSError:
                pass


class StartupWatch:
    """Launcher side: ``poll()`` -> None while the start is fine (or done), else why it failed."""

    def __init__(self, run_dir: os.PathLike | str, world_size: int,
                 bound_s: Optional[float] = None, *, now: Optional[float] = None):
        self.run_dir = Path(run_dir)
        self.world_size = int(world_size)
        self.bound_s = startup_bound_s() if not bound_s else float(bound_s)
        self.t0 = time.time() if now is None else now
        self.formed = False
        self.formed_after_s: Optional[float] = None
        #: when this watch last saw start-up progress (a marker appear or change phase): the
        #: launcher's clock only, so clock skew between hosts does not matter
        self.last_progress = self.t0
        self._seen: dict[str, str] = {}
        self._cpu: dict[str, int] = {}
        #: rank -> when its program was first seen gone without an exit record
        self._gone: dict[str, float] = {}
        self._host = socket.gethostname()

    def _formed(self) -> bool:
        d = self.run_dir / RANKS_DIR
        if all((d / f"rank{g}.json").exists() for g in range(self.world_size)):
            return True
        steps = self.run_dir / "steps"
        return steps.is_dir() and any(steps.iterdir())

    def errors_logged(self) -> bool:
        """A rank logged an error: errors/, the store or the fallback directory (read_errors)."""
        from recover_hsdp.launcher.errors import read_errors

        return bool(read_errors(self.run_dir))

    def _ended(self, d: Path, m: dict, now: float) -> Optional[bool]:
        """A local starting rank whose program is gone: True if it exited 0 (its exit record,
        launcher/rank.py), False if it died or failed, None while its shim still lives and has
        not yet written the record (at most :data:`EXIT_RECORD_WAIT_S` after first seen)."""
        try:
            rec = json.loads((d / EXIT_RECORD.format(g=int(m["rank"]))).read_text())
            if int(rec.get("pid", m["pid"])) == int(m["pid"]):
                return rec.get("code") == 0 and "signal" not in rec
        except (OSError, ValueError, TypeError):
            pass
        shim = m.get("shim")
        first = self._gone.setdefault(str(m["rank"]), now)
        if isinstance(shim, int) and _alive(shim) and now - first < EXIT_RECORD_WAIT_S:
            return None
        return False

    def poll(self, now: Optional[float] = None) -> Optional[str]:
        if self.formed:
            return None
        now = time.time() if now is None else now
        if self._formed():
            self.formed, self.formed_after_s = True, now - self.t0
            return None
        d = self.run_dir / RANKS_DIR
        phases: dict[str, int] = {}
        for p in sorted(d.glob("start.rank*.json")) if d.is_dir() else ():
            try:
                m = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            ph = str(m.get("phase", "start"))
            if self._seen.get(p.name) != ph:
                self._seen[p.name] = ph
                self.last_progress = now
            if m.get("host") == self._host:
                # a rank on this host that burns CPU is starting (importing torch can take a
                # minute on a loaded machine), one that is stopped or blocked is not
                cpu = _cpu_ticks(int(m["pid"]))
                if cpu is not None and cpu > self._cpu.get(p.name, cpu):
                    self.last_progress = now
                if cpu is not None:
                    self._cpu[p.name] = cpu
            phases[ph] = phases.get(ph, 0) + 1
            if m.get("host") == self._host and not _alive(int(m["pid"])):
                if (d / f"rank{int(m['rank'])}.json").exists():
                    continue          # it joined the world: a failure for ULFM, not start-up
                ended = self._ended(d, m, now)
                if ended is None:
                    continue          # its shim is writing the exit record: judged next poll
                if ended:
                    continue          # exited 0 (a program without the manager): not a death
                return (f"rank {m['rank']} (pid {m['pid']}) died during start-up, before the "
                        f"world formed")
        if now - self.last_progress > self.bound_s:
            started = sum(phases.values())
            where = ", ".join(f"{n} at {ph}" for ph, n in phases.items())
            return (f"no start-up progress for {self.bound_s:g} s, the world did not form "
                    f"(run.startup_timeout_s; {started}/{self.world_size} ranks started"
                    + (f": {where}" if where else "") + ")")
        return None


#: how long mpirun may outlive the last of its ranks before the launcher stops it (a stopped or
#: hung prterun / prted daemon: the ranks committed and exited, mpirun never returns)
END_GRACE_S = 10.0


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class EndWatch:
    """The other end of a job: every rank has ENDED (a clean exit marked in its heartbeat, or a
    local rank that is gone), yet mpirun still runs. After ``grace_s`` of that, :meth:`poll`
    returns the one line to stop mpirun with; the run is then judged from its record as usual.

    A rank on another host counts as ended when its heartbeat says done, or is older than
    ``stale_s`` (its node or daemon is gone; the hang watchdog judges live ones). With
    ``launch_id``, only heartbeats of that launch count (a previous segment's rank that beat
    once more after the relaunch cleared ranks/ is not this job's)."""

    def __init__(self, run_dir: os.PathLike | str, world_size: int,
                 stale_s: float, grace_s: float = END_GRACE_S, launch_id: Optional[str] = None,
                 deliver_s: Optional[float] = None):
        self.launch_id = launch_id
        #: a death the runtime did not deliver (see :meth:`_undelivered`); None: not judged
        self.deliver_s = None if deliver_s is None else float(deliver_s)
        self._death: Optional[tuple[float, dict]] = None
        self.run_dir = Path(run_dir)
        self.world_size = int(world_size)
        self.stale_s = float(stale_s)
        self.grace_s = float(grace_s)
        self._since: Optional[float] = None
        self._host = socket.gethostname()

    def _ended(self, hb: dict, now: float) -> bool:
        if hb.get("done"):
            return True
        if hb.get("host") == self._host:
            return not _alive(int(hb["pid"]))
        return now - float(hb.get("time", now)) > self.stale_s

    def poll(self, now: Optional[float] = None) -> Optional[str]:
        now = time.time() if now is None else now
        d = self.run_dir / RANKS_DIR
        hbs = []
        for g in range(self.world_size):
            try:
                hb = json.loads((d / f"rank{g}.json").read_text())
            except (OSError, ValueError):
                hb = None
            if hb is None or (self.launch_id and hb.get("launch") != self.launch_id):
                self._since = None       # not every rank of this launch joined (or rewriting)
                return None
            hbs.append(hb)
        if not all(self._ended(hb, now) for hb in hbs):
            self._since = None
            return self._undelivered(hbs, now)
        if self._since is None:
            self._since = now
        if now - self._since < self.grace_s:
            return None
        return (f"all {self.world_size} ranks have ended, but mpirun is still running "
                f"{now - self._since:.0f} s later (a stopped or hung daemon?): stopping it")

    def _undelivered(self, hbs: list[dict], now: float) -> Optional[str]:
        """A local rank died and its daemon has not reaped it (a zombie: the daemon is stopped
        or hung), and no live rank has moved for ``deliver_s`` + 3 median steps (outside
        announced phases). ULFM learns of a death from the runtime (the prted daemon that reaps
        the rank tells prterun, which tells the survivors): a stopped or hung daemon leaves the
        survivors waiting in their collective for good (they still finish the microbatches
        before it: the clock runs from the last move). A rank whose daemon died with it (a node
        loss) is reaped by init, not a zombie: node loss has its own path (faults/nodeloss.py). After a delivered death the survivors
        go on training and move every microbatch. Returns the one line that stops the job; the
        run is judged (or relaunched) from its record as usual."""
        if self.deliver_s is None:
            return None
        dead = sorted(int(hb["rank"]) for hb in hbs if not hb.get("done")
                      and hb.get("host") == self._host and _zombie(int(hb["pid"])))
        live = {int(hb["rank"]): hb for hb in hbs if not self._ended(hb, now)}
        if not dead or not live:
            self._death = None
            return None
        progress = {g: int(hb.get("progress", 0)) for g, hb in live.items()}
        if self._death is None or progress != self._death[1] or \
                any(hb.get("phase") is not None for hb in live.values()):
            self._death = (now, progress)            # moved, or in a phase: the clock restarts
            return None
        steps = [float(hb["step_s"]) for hb in live.values() if hb.get("step_s")]
        bound = self.deliver_s + 3 * max(steps, default=0.0)
        if now - self._death[0] < bound:
            return None
        return (f"rank(s) {dead} died and no survivor has moved for {now - self._death[0]:.0f} "
                f"s (bound {bound:.1f} s): the runtime did not deliver the death (a stopped or "
                f"hung mpirun / prted daemon?): stopping the job")
