"""Launcher side of the hang detector: judge the ranks' heartbeats (docs/faults.md, "Fault
classes"). The rank side (the heartbeat thread, ``tick``, ``long_phase``) is faults/failstop.py.

``HangWatchdog`` SIGKILLs a rank whose heartbeat is older than ``timeout_s`` (it cannot
run: SIGSTOP, a frozen node process) or whose PROGRESS stalled outside an announced long phase
(its main thread wedged while the heartbeat thread beats: a deadlocked loader, a stuck sync).
The progress bound is ``progress_timeout_s`` seconds, or with ``"auto"`` (the default of
``run.progress_timeout_s``) per rank ``max(floor_s, 3 x the median of its last step times)``,
the median carried by its heartbeat. A long phase that overran its announced bound is judged
as well. Progress verdicts are taken one at a time, with a grace after each: first the ranks
whose main thread is not blocked in a collective (the heartbeat says ``waiting``), the oldest
stall first. The mates a wedged rank keeps waiting in a shard collective stall with it, at
nearly the same moment; they wait on a peer, so it is judged first, and they move again (or
leave, their replica lost) once its death is seen. While a kill order for another node is out
the progress judge holds (at most the hang timeout), and its grace starts at the answer. A
waiting rank past its bound is not judged while a rank NOT waiting has stalled to within
``lead_s`` (2 heartbeats + 1 s) of its own bound: the same stall, seen a beat later. Each
verdict is written to faults/hung.rank{g}.json.

A rank of another host is judged alike, its heartbeat aged on this clock; its kill is an order
its own node carries out (faults/orders.py: any rank's heartbeat thread there), the verdict is
written when the order is answered "killed" (docs/faults.md "Ranks on other nodes").
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from recover_hsdp.faults import orders, signing
from recover_hsdp.faults.failstop import RANKS_DIR
from recover_hsdp.launcher.reaper import MateReaper, alive as _alive, kill_recorded, write_verdict

#: the progress floor of ``run.progress_timeout_s=auto`` (run.progress_floor_s)
PROGRESS_FLOOR_S = 30.0


class HangWatchdog:
    """Launcher side: SIGKILL a local rank whose heartbeat is stale (it cannot run: SIGSTOP,
    a frozen node process) or, with ``progress_timeout_s``, whose progress stalled outside an
    announced long phase. Each verdict is written to faults/hung.rank{g}.json."""

    def __init__(self, run_dir, timeout_s: float, period_s: float,
                 progress_timeout_s=None,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                 shard_size: int = 1, floor_s: float = PROGRESS_FLOOR_S,
                 launch_id: Optional[str] = None, key: Optional[bytes] = None):
        self.run_dir = Path(run_dir)
        #: the job's key, signing the kill orders (faults/orders.py): given, else the run's
        #: launcher/job.key, else this process's environment's (faults/signing.py)
        self.key = key if key is not None else (signing.read_key_file(self.run_dir)
                                                or signing.env_key())
        self.timeout_s = float(timeout_s)
        self.period_s = float(period_s)
        self.auto = progress_timeout_s == "auto"
        self.progress_timeout_s = None if self.auto else progress_timeout_s
        self.floor_s = float(floor_s)
        self._progress_grace_until = 0.0   # after a progress verdict: let the mates move again
        self.log = log
        self.killed: dict[int, dict] = {}
        self._progress: dict[int, tuple[int, float]] = {}
        self._hbs: dict[int, dict] = {}      # the last poll's heartbeats (_after_death)
        #: how far ahead of its bound a stalled rank not waiting on peers holds the verdict of
        #: one that is (the same stall, seen a heartbeat or two later)
        self.lead_s = 2 * self.period_s + 1.0
        self._grace_until = 0.0     # judging waits until then after a stall of the watchdog
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._host = socket.gethostname()
        self.launch_id = launch_id
        self._remote: dict[int, tuple] = {}     # rank -> ((pid, time), seen at, seen moving)
        self._orders: dict[int, tuple[Path, dict, str]] = {}   # kill orders not answered yet
        self.reaper = self.make_reaper(shard_size) if shard_size > 1 else None

    def make_reaper(self, shard_size: int) -> MateReaper:
        """The mate reaper of this watchdog (launcher/reaper.py): its grace is the hang timeout;
        a mate on another node is reaped through a kill order."""
        return MateReaper(self.run_dir, shard_size, self.timeout_s, self.log, host=self._host,
                          order=lambda g, pid, why, now, hb: self._order(
                              g, pid, why, now, hb, "reaped"), launch_id=self.launch_id)

    def start(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; then read the kill orders answered since the last poll once more, so
        a verdict whose answer came in the job's last half second is still written (seen: a
        wedged rank on another node served its own order 0.2 s before the job ended, and its
        faults/hung file was never written)."""
        self._stop.set()
        self._thread.join(5)
        if self._orders and not self._thread.is_alive():
            try:
                self._answers(time.time())
            except Exception as e:  # noqa: BLE001 - the end of a job must not raise here
                self.log(f"[recover-hsdp] hang watchdog: {e!r}")

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(min(self.period_s, 0.5)):
            last, t = time.monotonic(), last
            if self.stalled(last - t, time.time()):
                continue
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the watchdog must keep watching
                self.log(f"[recover-hsdp] hang watchdog: {e!r}")

    def stalled(self, gap_s: float, now: float) -> bool:
        """True while judging waits out a stall of the watchdog itself: its poll came ``gap_s``
        late (> 2 s; seen: a 19 s freeze of the whole machine, ranks included, whose stale
        heartbeats the watchdog then judged before the ranks could beat). Judging resumes two
        heartbeat periods + 0.5 s later, with the progress clocks restarted."""
        if gap_s > 2.0 + min(self.period_s, 0.5):
            self._grace_until = now + 2 * self.period_s + 0.5
            self._progress = {g: (p, self._grace_until) for g, (p, _) in self._progress.items()}
            self._remote = {g: (k, self._grace_until, m) for g, (k, _, m) in self._remote.items()}
            self.log(f"[recover-hsdp] hang watchdog: itself stalled for {gap_s:.1f} s; "
                     f"judging resumes in {2 * self.period_s + 0.5:g} s")
        return now < self._grace_until

    def poll(self, now: Optional[float] = None) -> list[int]:
        d = self.run_dir / RANKS_DIR
        if not d.is_dir():
            return []
        now = time.time() if now is None else now
        out, hbs, stalls, free_near = self._answers(now), {}, [], False
        for p in d.glob("rank*.json"):
            try:
                hb = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            g = int(hb["rank"])
            local = hb.get("host") == self._host
            hbs[g] = hb                 # the reaper sees the ranks judged hung die too
            if g in self.killed or g in self._orders or hb.get("done"):
                continue
            pid = int(hb["pid"])
            if local:
                if not _alive(pid):
                    continue
                age = now - float(hb["time"])
            else:
                age = self._remote_age(g, hb, now)
                if age is None:
                    continue
            why = None
            if age > self.timeout_s:
                why = f"no heartbeat for {age:.1f} s (run.hang_timeout_s={self.timeout_s:g})"
            elif self.auto or self.progress_timeout_s:
                stall = self._stall(g, hb, now)
                if stall is not None:
                    stalls.append((stall[0], g, pid, stall[1], hb))
                elif not hb.get("waiting") and hb.get("phase") is None and \
                        now - self._progress[g][1] > self.bound_s(hb) - self.lead_s:
                    free_near = True    # a rank not waiting on peers, about to be past its bound
            if why:
                if self._judge(g, pid, why, now, hb):
                    out.append(g)
        # a kill order out for another node (its mates stall with it, and are the reaper's
        # once it is answered) holds the progress judge, for at most the hang timeout
        ordered = any(now - rec["time"] < self.timeout_s for _, rec, _ in self._orders.values())
        # so does a death whose still mates the reaper takes within its grace (the survivors
        # wait on such a mate: seen on two nodes with run.hang_timeout_s=20, where a remote
        # death is known ~20 s after it and its mate reaped 20 s later, past the 30 s floor)
        ordered = ordered or (self.reaper is not None and self.reaper.pending(hbs, now))
        if stalls and now >= self._progress_grace_until and not ordered:
            # one verdict a round: the oldest stall of a rank not blocked on its peers (in a
            # collective: faults/failstop.main_waits_on_peers), else the oldest stall
            since, g, pid, why, hb = min(stalls, key=lambda t: (bool(t[4].get("waiting")), t[0]))
            # a rank waiting on peers waits for a stalled rank that is not, a beat or two
            # behind it (heartbeats arrive a period apart): that one is the culprit
            if not (hb.get("waiting") and free_near):
                if self._judge(g, pid, why, now, hb):
                    out.append(g)
                self._progress_grace_until = now + 2 * self.period_s + 3.0
        self._hbs = hbs
        return out + (self.reaper.poll(hbs, now) if self.reaper else [])

    def _after_death(self, now: float) -> None:
        """A verdict killed a rank: the ranks blocked on peers (heartbeat ``waiting``) get a full
        progress bound from now to react to the death. Seen in the gloo-plane soak: a rank
        SIGSTOPped inside the end-of-step ULFM agreement, judged by its heartbeat; its subtree
        of the agreement, stalled since before the stop, was judged "no progress" 5 s after the
        death (false verdicts, the run lost). A rank not waiting on peers (wedged) keeps its
        clock, so a second wedge is judged on time; each death defers a waiting rank by at most
        one bound."""
        for g, (p, t) in list(self._progress.items()):
            if (self._hbs.get(g) or {}).get("waiting"):
                self._progress[g] = (p, max(t, now))

    def _remote_age(self, g: int, hb: dict, now: float) -> Optional[float]:
        """The age of a heartbeat written on another host, on THIS clock: since this watchdog
        saw it change (no clock of two nodes is compared). None while it has not been seen to
        change at all (a file an earlier run left is never judged) unless it names this
        launch."""
        key = (hb.get("pid"), hb.get("time"))
        seen = self._remote.get(g)
        if seen is None or seen[0] != key:
            moved = seen is not None and seen[0][0] == key[0]     # the same process beat
            self._remote[g] = seen = (key, now, moved)
        if not seen[2] and not (self.launch_id and hb.get("launch") == self.launch_id):
            return None
        return now - seen[1]

    def _judge(self, g: int, pid: int, why: str, now: float, hb: dict) -> bool:
        """SIGKILL rank g here (this host), or order its node to (faults/orders.py)."""
        if hb.get("host") == self._host:
            self._kill(g, pid, why, now, hb)
            return g in self.killed
        self._order(g, pid, why, now, hb, "hung")
        return False

    def _order(self, g: int, pid: int, why: str, now: float, hb: dict, verdict: str) -> None:
        """Order rank g's node to SIGKILL it; the verdict (faults/{verdict}.rank{g}.json) is
        written when the order is answered "killed"."""
        path = orders.order_kill(self.run_dir / RANKS_DIR, str(hb.get("host")), g, pid,
                                 hb.get("start"), why, now, key=self.key)
        rec = {"rank": g, "pid": pid, "host": hb.get("host"), "reason": why, "time": now,
               "last_heartbeat": hb.get("time")}
        if "mate" in hb:
            rec["mate"] = hb["mate"]
        self._orders[g] = (path, rec, verdict)   # said on the console once answered "killed"

    def _answers(self, now: float) -> list[int]:
        """The kill orders its node has answered: "killed" is a verdict (faults/hung.rank{g})."""
        out = []
        for g, (path, rec, verdict) in list(self._orders.items()):
            ans = orders.answer(path, self.key)   # unsigned: no answer (one line)
            if ans is None:
                continue
            del self._orders[g]
            # as after a verdict here: the mates of the rank it took move again first
            self._progress_grace_until = max(self._progress_grace_until,
                                             now + 2 * self.period_s + 3.0)
            if ans.get("result") != "killed":
                self.killed[g] = dict(rec, result=ans.get("result"))   # not judged again
                if ans.get("result") == "gone" and self.reaper is not None:
                    # gone without its clean-exit mark (a done heartbeat is never judged): a
                    # death on its node, whose still mates the reaper takes
                    self.reaper.note_dead(g, rec["pid"], now)
                continue
            rec = dict(rec, killed_by=ans.get("by"), killed_time=ans.get("time"),
                       answered_after_s=round(now - rec["time"], 3))
            write_verdict(self.run_dir, f"{verdict}.rank{g}", rec)
            self.killed[g] = rec
            self._after_death(now)
            if self.reaper is not None:     # its still mates are the reaper's, as here
                self.reaper.note_dead(g, rec["pid"], now)
            what = "judged hung" if verdict == "hung" else "reaped"
            self.log(f"[recover-hsdp] rank {g} (pid {rec['pid']} on {rec['host']}) {what}: "
                     f"{rec['reason']}; SIGKILLed by rank {ans.get('by')} of its node")
            out.append(g)
        return out

    def bound_s(self, hb: dict) -> float:
        """The progress bound of one rank: fixed, or auto max(floor, 3 x its median step)."""
        if not self.auto:
            return float(self.progress_timeout_s)
        step = hb.get("step_s")
        return max(self.floor_s, 3.0 * float(step)) if step else self.floor_s

    def _stall(self, g: int, hb: dict, now: float):
        """(since when, why) when rank g is judged stalled: its progress counter has not moved
        for its bound outside an announced long phase, or its long phase overran its bound."""
        prog = int(hb.get("progress", 0))
        last = self._progress.get(g)
        if last is None or last[0] != prog:
            self._progress[g] = (prog, now)
            return None
        phase, until = hb.get("phase"), hb.get("phase_until")
        if phase is not None:
            if until is not None and now > float(until):
                return float(hb.get("progress_time") or last[1]), (
                    f"its announced phase {phase!r} overran its bound by "
                    f"{now - float(until):.1f} s")
            return None
        bound = self.bound_s(hb)
        if now - last[1] > bound:
            rule = (f"run.progress_timeout_s={self.progress_timeout_s:g}" if not self.auto else
                    f"auto: max({self.floor_s:g} s, 3 x median step "
                    f"{hb.get('step_s') or 0:.2f} s)")
            # the rank's own clock of its last progress orders the verdicts (the observed one is
            # a heartbeat late, the same for a wedged rank and the mate it keeps waiting)
            return (float(hb.get("progress_time") or last[1]),
                    f"no progress for {now - last[1]:.1f} s ({rule})")
        return None

    def _kill(self, g: int, pid: int, why: str, now: float, hb: dict) -> None:
        rec = {"rank": g, "pid": pid, "reason": why, "time": now,
               "last_heartbeat": hb.get("time")}
        if kill_recorded(self.run_dir, f"hung.rank{g}", pid, rec):
            self.killed[g] = rec
            self._after_death(now)
            self.log(f"[recover-hsdp] rank {g} (pid {pid}) judged hung: {why}; SIGKILLed")
