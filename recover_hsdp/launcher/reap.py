"""Ranks that outlive their segment's mpirun: found by their heartbeats, SIGKILLed before the next
segment starts.

When PRTE loses a remote daemon it ends the job (docs/faults.md "Node loss"), but a rank on the
launcher's node can go on: it survived the lost node's ranks as any rank death (ULFM), and
mpirun's exit did not take it down. Seen in the three-node chaos soak (2026-12-04): segment 0's
rank 0, alone after a raise on node 1 and the loss of node 2, trained on to the last step in 3 s
after mpirun had ended, wrote checkpoints 9-15 and pruned step 3, the one the relaunch had been
told to resume from; every rank of the relaunch then failed on its missing state.json. The
launcher now SIGKILLs, before it reads the record and picks the checkpoint, every rank whose
heartbeat (ranks/rank*.json) names this host and a live process with the same start time (a
reused pid is left alone). Ranks on other hosts cannot be signalled from here: they are named
in the line (their node's daemon is gone with mpirun, and a kill order needs a live rank there).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

from recover_hsdp.faults.orders import proc_start

#: how often the wait for a SIGKILLed rank's end looks again (pacing only: its death decides)
PACE_S = 0.02


def outliving(run_dir: Path, host: Optional[str] = None) -> tuple[list[tuple[int, int]], list[int]]:
    """([(rank, pid)] alive on this host, [ranks alive elsewhere as far as their heartbeat
    says: not done]) from the heartbeats of the segment that just ended."""
    host = host or socket.gethostname()
    here, elsewhere = [], []
    d = Path(run_dir) / "ranks"
    for f in sorted(d.glob("rank*.json")) if d.is_dir() else ():
        try:
            hb = json.loads(f.read_text())
            g, pid, start = int(hb["rank"]), int(hb["pid"]), hb.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if hb.get("host") not in (None, host):
            if not hb.get("done"):
                elsewhere.append(g)
            continue
        now = proc_start(pid)
        if now is not None and start is not None and int(start) == now:
            here.append((g, pid))
    return here, elsewhere


def reap(run_dir: Path, wait_s: float = 10.0, host: Optional[str] = None) -> list[tuple[int, int]]:
    """SIGKILL this host's outliving ranks; wait (bounded) until they are gone; return them."""
    here, _ = outliving(run_dir, host)
    for _, pid in here:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + wait_s
    while here and time.monotonic() < end and any(proc_start(p) is not None for _, p in here):
        time.sleep(PACE_S)
    return here
