"""Launcher side: a replica that lost a rank is lost; its mates that do not notice are reaped.

On gloo, a rank whose shard-group mate died sees "Connection closed by peer" within ms and leaves
(``replica_lost_exit``). On NCCL it does not: a shard collective on a dead peer blocks until the
process-group timeout (``run.shard_timeout_s``, 60 s) and only then does the NCCL watchdog abort
the process. All that time its heartbeat beats (a separate thread), so the hang watchdog leaves
it alone, and the survivors' ULFM repair waits for it (it is alive, so the agreement needs it).

The reaper bounds that wait. When a local rank's process is gone without its clean-exit mark
(heartbeat ``done``, written by ``failstop.mark_done`` on every normal exit), every mate of its
replica block (ranks ``b*S .. b*S+S-1``; standby blocks alike) whose progress counter has not
moved for ``grace_s`` since, and which is not inside an announced long phase, is SIGKILLed;
``faults/reaped.rank{g}.json`` says why. ``grace_s`` is ``run.hang_timeout_s``: a mate that has not
moved for that long after its replica lost a member is as good as hung. A mate that notices on its
own (gloo, or the ULFM consensus naming its replica) has left long before. Only processes this
watchdog saw alive, or whose heartbeat names this launch (``launch_id``: a rank that died between
two polls of its first beats), count: a heartbeat file left by an earlier run or segment is never
a death.
On another node the watchdog reports the death (its kill order for the stale heartbeat answered
"gone") and the mate is reaped by a kill order too (faults/orders.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Callable, Optional


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class MateReaper:
    """Called by ``HangWatchdog.poll`` with every heartbeat ({rank: record}). A rank of this
    host is seen dead here (/proc); a rank of another host is reported dead by the watchdog
    (:meth:`note_dead`: its kill order was answered "gone" by its node), and a mate there is
    reaped through ``order`` (a kill order its node serves, faults/orders.py)."""

    def __init__(self, run_dir: os.PathLike | str, shard_size: int, grace_s: float,
                 log: Callable[[str], None], host: Optional[str] = None,
                 order: Optional[Callable[[int, int, str, float, dict], None]] = None,
                 launch_id: Optional[str] = None):
        self.run_dir = Path(run_dir)
        self.launch_id = launch_id
        self.S = int(shard_size)
        self.grace_s = float(grace_s)
        self.log = log
        self.host = socket.gethostname() if host is None else host
        self.order = order
        self.seen: dict[int, int] = {}                  # rank -> pid seen alive
        self.dead: dict[int, tuple[int, float]] = {}    # rank -> (pid, time seen gone uncleanly)
        self.still: dict[int, tuple[int, int, float]] = {}  # mate -> (pid, progress, since)
        self.reaped: dict[int, dict] = {}

    def note_dead(self, g: int, pid: int, now: float) -> None:
        """Rank g (pid) of another host is gone without its clean-exit mark."""
        if g not in self.dead:
            self.dead[g] = (int(pid), now)

    def _this_launch(self, hb: dict) -> bool:
        """The heartbeat was written by a rank of this launch (a death, even if no poll saw the
        process alive: the watchdog polls every half second, a rank can die sooner)."""
        return bool(self.launch_id) and hb.get("launch") == self.launch_id

    def _local(self, hb: dict) -> bool:
        return hb.get("host") in (None, self.host)

    def poll(self, hbs: dict[int, dict], now: float) -> list[int]:
        for g, hb in hbs.items():
            if not self._local(hb):
                continue                # its death is reported by the watchdog (note_dead)
            pid = int(hb["pid"])
            if hb.get("done") and self.dead.get(g, (None,))[0] == pid:
                self.dead.pop(g)        # its last beat says it left cleanly: no death
            if alive(pid):
                self.seen[g] = pid
                if self.dead.get(g, (pid,))[0] != pid:      # a new process holds the rank
                    self.dead.pop(g, None)
            elif (self.seen.get(g) == pid or self._this_launch(hb)) and not hb.get("done") \
                    and g not in self.dead:
                self.dead[g] = (pid, now)
        out = []
        for d, (_, t_dead) in sorted(self.dead.items()):
            b = d // self.S
            for m in range(b * self.S, (b + 1) * self.S):
                hb = hbs.get(m)
                if m == d or m in self.reaped or hb is None or hb.get("done"):
                    continue
                pid, prog = int(hb["pid"]), int(hb.get("progress", 0))
                local = self._local(hb)
                if (local and not alive(pid)) or (not local and self.order is None):
                    continue
                last = self.still.get(m)
                if last is None or last[:2] != (pid, prog):
                    self.still[m] = (pid, prog, now)
                    continue
                phase = (hb.get("phase") not in (None, "start-up")    # start-up: no excuse here
                         and (hb.get("phase_until") or now + 1) >= now)
                if not phase and now - max(last[2], t_dead) >= self.grace_s:
                    if self._reap(m, pid, d, now, now - t_dead, hb):
                        out.append(m)
        return out

    def pending(self, hbs: dict[int, dict], now: float) -> bool:
        """True while a death seen less than ``2 x grace_s`` ago has a mate not reaped, not
        done and not known gone: its mates' stall has a cause the reaper ends (the progress
        judge waits for it rather than judge the survivors that wait on that mate). The reaper
        takes a mate ``grace_s`` after it was last seen to move, not after the death: a mate
        still in its own backward when the death was seen blocks later, so a hold of only
        ``grace_s`` from the death left a window in which the survivors, waiting since the
        death, were judged hung before their replica's mate was reaped (seen in the three-node
        chaos under load: a survivor judged at +14 s, the mate reaped after it). At most
        ``2 x grace_s`` after each death: a mate that moves for longer is not blocked on it."""
        for d, (_, t_dead) in self.dead.items():
            if now - t_dead >= 2 * self.grace_s:
                continue
            b = d // self.S
            for m in range(b * self.S, (b + 1) * self.S):
                hb = hbs.get(m)
                if m == d or m in self.reaped or hb is None or hb.get("done"):
                    continue
                if self._local(hb) and not alive(int(hb["pid"])):
                    continue
                return True
        return False

    def _reap(self, g: int, pid: int, mate: int, now: float, after_s: float,
              hb: dict) -> bool:
        why = (f"its replica lost rank {mate} {after_s:.1f} s ago and it has not moved since "
               f"(a shard collective on a dead peer, as NCCL's, blocks; run.hang_timeout_s="
               f"{self.grace_s:g})")
        rec = {"rank": g, "pid": pid, "mate": mate, "reason": why, "time": now}
        if not self._local(hb):         # on its node, by a kill order; the verdict on "killed"
            self.reaped[g] = rec
            self.order(g, pid, why, now, dict(rec, host=hb.get("host"), start=hb.get("start")))
            return False
        if kill_recorded(self.run_dir, f"reaped.rank{g}", pid, rec):
            self.reaped[g] = rec
            self.log(f"[recover-hsdp] rank {g} (pid {pid}) reaped: {why}; SIGKILLed")
            return True
        return False


def kill_recorded(run_dir: Path, name: str, pid: int, rec: dict) -> bool:
    """SIGKILL ``pid`` and write ``rec`` to ``faults/{name}.json`` (the launcher's verdicts: hung,
    reaped). False when the process was already gone (nothing written)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    write_verdict(run_dir, name, rec)
    return True


def write_verdict(run_dir: os.PathLike | str, name: str, rec: dict) -> None:
    """``faults/{name}.json`` (best effort: a full disk must not stop the watchdog)."""
    try:
        fd = Path(run_dir) / "faults"
        fd.mkdir(parents=True, exist_ok=True)
        (fd / f"{name}.json").write_text(json.dumps(rec) + "\n")
    except OSError:
        pass
