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
watchdog saw alive count: a heartbeat file left by an earlier run or segment is never a death.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Callable


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
    """Called by ``HangWatchdog.poll`` with this host's heartbeats ({rank: record})."""

    def __init__(self, run_dir: os.PathLike | str, shard_size: int, grace_s: float,
                 log: Callable[[str], None]):
        self.run_dir = Path(run_dir)
        self.S = int(shard_size)
        self.grace_s = float(grace_s)
        self.log = log
        self.seen: dict[int, int] = {}                  # rank -> pid seen alive
        self.dead: dict[int, tuple[int, float]] = {}    # rank -> (pid, time seen gone uncleanly)
        self.still: dict[int, tuple[int, int, float]] = {}  # mate -> (pid, progress, since)
        self.reaped: dict[int, dict] = {}

    def poll(self, hbs: dict[int, dict], now: float) -> list[int]:
        for g, hb in hbs.items():
            pid = int(hb["pid"])
            if hb.get("done") and self.dead.get(g, (None,))[0] == pid:
                self.dead.pop(g)        # its last beat says it left cleanly: no death
            if alive(pid):
                self.seen[g] = pid
                if self.dead.get(g, (pid,))[0] != pid:      # a new process holds the rank
                    self.dead.pop(g, None)
            elif self.seen.get(g) == pid and not hb.get("done") and g not in self.dead:
                self.dead[g] = (pid, now)
        out = []
        for d, (_, t_dead) in sorted(self.dead.items()):
            b = d // self.S
            for m in range(b * self.S, (b + 1) * self.S):
                hb = hbs.get(m)
                if m == d or m in self.reaped or hb is None or hb.get("done"):
                    continue
                pid, prog = int(hb["pid"]), int(hb.get("progress", 0))
                if not alive(pid):
                    continue
                last = self.still.get(m)
                if last is None or last[:2] != (pid, prog):
                    self.still[m] = (pid, prog, now)
                    continue
                phase = (hb.get("phase") not in (None, "start-up")    # start-up: no excuse here
                         and (hb.get("phase_until") or now + 1) >= now)
                if not phase and now - max(last[2], t_dead) >= self.grace_s:
                    self._reap(m, pid, d, now, now - t_dead)
                    out.append(m)
        return out

    def _reap(self, g: int, pid: int, mate: int, now: float, after_s: float) -> None:
        why = (f"its replica lost rank {mate} {after_s:.1f} s ago and it has not moved since "
               f"(a shard collective on a dead peer, as NCCL's, blocks; run.hang_timeout_s="
               f"{self.grace_s:g})")
        rec = {"rank": g, "pid": pid, "mate": mate, "reason": why, "time": now}
        if kill_recorded(self.run_dir, f"reaped.rank{g}", pid, rec):
            self.reaped[g] = rec
            self.log(f"[recover-hsdp] rank {g} (pid {pid}) reaped: {why}; SIGKILLed")


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
