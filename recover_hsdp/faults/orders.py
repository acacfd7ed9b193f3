"""Kill orders: how the launcher's hang watchdog judges a rank on ANOTHER node.

The launcher's watchdog (launcher/watchdog.py) reads every rank's heartbeat from the run
directory (a filesystem every node shares: the run directory already is one, for the checkpoints
and the record). A rank on its own host it SIGKILLs itself. A rank on another host it cannot
signal, so it writes an order ``ranks/orders/<host>/kill.rank{g}.{pid}.json`` naming the process
(pid and its start time, so a recycled pid is never hit) and why. Every rank's heartbeat thread
serves the orders of its own host on each beat (:func:`serve_orders`): the first to see an order
SIGKILLs the process if it is still the one named, and answers with
``kill.rank{g}.{pid}.ack.json``: ``{"result": "killed", "by": rank}`` or ``"gone"``. The watchdog
writes its verdict (faults/hung.rank{g}.json, with ``killed_by``) only on "killed".

A stopped rank cannot serve, but any other rank of its node does (its mates of the replica, the
other replicas on the node); a wedged rank's own heartbeat thread serves its own order. A node
whose every rank is stopped is not reached (docs/faults.md): it is a lost node.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Optional

ORDERS_DIR = "orders"        # under ranks/


def host_dir(ranks_dir: os.PathLike | str, host: str) -> Path:
    return Path(ranks_dir) / ORDERS_DIR / re.sub(r"[^A-Za-z0-9._-]", "_", host or "unknown")


def proc_start(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks after boot, /proc/<pid>/stat field 22),
    None when there is no such process (or it is a zombie: already dead, only not reaped)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None
    if rest[0] == "Z":
        return None
    return int(rest[19])


def order_kill(ranks_dir: os.PathLike | str, host: str, rank: int, pid: int,
               start: Optional[int], reason: str, now: Optional[float] = None) -> Path:
    """Write the order to SIGKILL rank ``rank`` (process ``pid`` started at ``start``) on
    ``host``; returns the order's path (its answer: :func:`answer`)."""
    d = host_dir(ranks_dir, host)
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"kill.rank{int(rank)}.{int(pid)}.json"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"rank": int(rank), "pid": int(pid), "start": start,
                               "reason": reason, "time": time.time() if now is None else now}))
    os.replace(tmp, p)
    return p


def ack_path(order: Path) -> Path:
    return order.with_name(order.name[:-len(".json")] + ".ack.json")


def answer(order: Path) -> Optional[dict]:
    """The answer to an order (None while no rank of its host has served it)."""
    try:
        return json.loads(ack_path(order).read_text())
    except (OSError, ValueError):
        return None


def serve_orders(ranks_dir: os.PathLike | str, host: str, my_rank: int) -> list[dict]:
    """Carry out the kill orders of this host that no rank has answered yet (called by each
    rank's heartbeat thread on every beat); returns the answers written here."""
    d = host_dir(ranks_dir, host)
    try:
        names = [e.name for e in os.scandir(d)]
    except OSError:
        return []           # no order for this host (the common case: one failed stat)
    done = set(names)
    out = []
    for name in names:
        if not (name.startswith("kill.rank") and name.endswith(".json")) \
                or name.endswith(".ack.json") or name.endswith(".tmp"):
            continue
        order = d / name
        if ack_path(order).name in done:
            continue
        try:
            o = json.loads(order.read_text())
            pid, start = int(o["pid"]), o.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        now_start = proc_start(pid)
        result = "gone"
        if now_start is not None and (start is None or int(start) == now_start):
            try:
                os.kill(pid, 0)
                result = "killed"
            except ProcessLookupError:
                pass
            except PermissionError:
                result = "refused"
        rec = {"rank": o.get("rank"), "pid": pid, "result": result, "by": int(my_rank),
               "time": time.time()}
        # the answer is written BEFORE the kill (the order may name this very process: a wedged
        # rank's heartbeat thread serves its own), and the first answer stands: another rank of
        # the host may be serving it at the same moment
        try:
            fd = os.open(ack_path(order), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(rec))
        out.append(rec)
        if result == "killed":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return out
