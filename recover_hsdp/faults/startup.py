"""Start-up, the rank side (docs/faults.md "Start-up"): each rank writes
``ranks/start.rank{g}.json`` (pid, host, time) first thing in ``recover_hsdp.train --worker``
(:func:`mark_start`), before torch, MPI or the store, and rewrites it at every start-up phase it
passes (:func:`mark_phase`). The launcher's watch over these markers (StartupWatch, EndWatch) is
launcher/startup.py.

Test seam: ``RECOVER_HSDP_STARTUP_FAULT=<g>[:exit]`` makes global rank g SIGKILL itself (or
``exit(1)``) at start-up, the first launch of a run directory only
(``launcher/startup_fault.done`` records it).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from recover_hsdp.faults.failstop import ENV_RUN_DIR, RANKS_DIR

ENV_STARTUP_FAULT = "RECOVER_HSDP_STARTUP_FAULT"
#: launcher/rank.py's pid, in its program's environment (launcher/rank.ENV_SHIM)
ENV_SHIM = "RECOVER_HSDP_RANK_SHIM"
FAULT_DONE = "launcher/startup_fault.done"


def _rank_env() -> Optional[int]:
    v = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK"))
    return int(v) if v and v.isdigit() else None


def mark_start(run_dir: Optional[os.PathLike | str] = None) -> None:
    """In a rank, first thing: write ranks/start.rank{g}.json; then the test seam, if set."""
    run_dir = run_dir or os.environ.get(ENV_RUN_DIR)
    g = _rank_env()
    if not run_dir or g is None:
        return
    d = Path(run_dir) / RANKS_DIR
    try:
        d.mkdir(parents=True, exist_ok=True)
        rec = {"rank": g, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        shim = os.environ.get(ENV_SHIM, "")
        if shim.isdigit():    # launched under launcher/rank.py, which writes our exit record
            rec["shim"] = int(shim)
        tmp = d / f".start.rank{g}.json.tmp"
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, d / f"start.rank{g}.json")
    except OSError:
        pass
    seam = os.environ.get(ENV_STARTUP_FAULT)
    if seam:
        who, _, how = seam.partition(":")
        done = Path(run_dir) / FAULT_DONE
        if who.isdigit() and int(who) == g and not done.exists():
            done.parent.mkdir(parents=True, exist_ok=True)
            done.write_text(f"rank {g} {how or 'kill'} at start-up\n")
            print(f"[recover_hsdp] rank {g}: test seam {ENV_STARTUP_FAULT}: "
                  f"{how or 'kill'} at start-up", file=sys.stderr, flush=True)
            if how == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)


#: the start-up phases a rank marks after ``start`` (in order); see :func:`mark_phase`
PHASES = ("imported", "joined", "groups", "wrapped")


def mark_phase(phase: str, run_dir: Optional[os.PathLike | str] = None) -> None:
    """In a rank: record that start-up reached ``phase`` (rewrites ranks/start.rank{g}.json,
    keeping its start time): the launcher's :class:`StartupWatch` counts its bound from the
    newest such mark. A no-op outside a launched run (no run dir or rank in the environment)
    and after the world formed; never raises."""
    run_dir = run_dir or os.environ.get(ENV_RUN_DIR)
    g = _rank_env()
    if not run_dir or g is None:
        return
    p = Path(run_dir) / RANKS_DIR / f"start.rank{g}.json"
    try:
        rec = json.loads(p.read_text())
        rec["phase"], rec["phase_time"] = phase, time.time()
        tmp = p.with_name(f".start.rank{g}.json.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, p)
    except (OSError, ValueError):
        pass
