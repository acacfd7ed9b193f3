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

Orders and answers carry the HMAC of the job's key (faults/signing.py; docs/security.md), bound
to the host and the file name: a rank carries out no order without it (one line, no kill, no
answer), and an answer without it is no answer (the watchdog ignores it; a rank of the host
removes it and serves the order).
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Optional

from recover_hsdp.faults import signing

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


def _kind(order: Path, what: str) -> str:
    """What an order's (or answer's) HMAC is bound to: its host folder and its file name."""
    return f"{what}:{order.parent.name}/{order.name}"


def order_kill(ranks_dir: os.PathLike | str, host: str, rank: int, pid: int,
               start: Optional[int], reason: str, now: Optional[float] = None,
               key: Any = "env") -> Path:
    """Write the order to SIGKILL rank ``rank`` (process ``pid`` started at ``start``) on
    ``host``, signed with ``key`` (the job's; default: the environment's; None: unsigned, which
    no rank carries out); returns the order's path (its answer: :func:`answer`)."""
    key = signing.env_key() if key == "env" else key
    d = host_dir(ranks_dir, host)
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"kill.rank{int(rank)}.{int(pid)}.json"
    tmp = p.with_name(p.name + ".tmp")
    doc = {"rank": int(rank), "pid": int(pid), "start": start, "reason": reason,
           "time": time.time() if now is None else now}
    tmp.write_text(json.dumps(signing.sign_doc(key, _kind(p, "order"), doc) if key else doc))
    os.replace(tmp, p)
    return p


def ack_path(order: Path) -> Path:
    return order.with_name(order.name[:-len(".json")] + ".ack.json")


def answer(order: Path, key: Any = "env") -> Optional[dict]:
    """The answer to an order (None while no rank of its host has served it). With ``key``
    (default: the environment's, signing.env_key) an answer without its HMAC is none (one line).
    ``key=None``: unchecked."""
    try:
        ans = json.loads(ack_path(order).read_text())
    except (OSError, ValueError):
        return None
    key = signing.env_key() if key == "env" else key
    if key is not None:
        try:
            signing.check_doc(key, _kind(order, "answer"), ans)
        except signing.ForgedValue as e:
            signing.say_once(("answer", str(order)), f"the answer to kill order {order.name} "
                             f"was ignored: {e} (a forged or altered answer)")
            return None
    return ans


def _forged_answer(order: Path, key: Optional[bytes]) -> bool:
    """The order's answer is there, whole, and without the HMAC of ``key`` (one being
    written, or any answer when this rank has no key, is not judged)."""
    try:
        ans = json.loads(ack_path(order).read_text())
    except (OSError, ValueError):
        return False
    return key is not None and answer(order, key) is None and isinstance(ans, dict)


def _refused(order: Path, why: str) -> None:
    signing.say_once(("order", str(order)), f"kill order {order.parent.name}/{order.name} "
                     f"refused: {why}; no rank killed (not the launcher's order)")


def serve_orders(ranks_dir: os.PathLike | str, host: str, my_rank: int,
                 key: Any = "env") -> list[dict]:
    """Carry out the kill orders of this host that no rank has answered yet and that carry
    the HMAC of ``key`` (default: the job's, from the environment; a rank without one carries
    out none), called by each rank's heartbeat thread on every beat; returns the answers
    written here."""
    key = signing.env_key() if key == "env" else key
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
            if not _forged_answer(order, key):
                continue
            try:        # an answer without the job's HMAC answers nothing: served anew
                os.unlink(ack_path(order))
            except OSError:
                continue
        try:
            o = json.loads(order.read_text())
            signing.check_doc(key, _kind(order, "order"), o)
            pid, start = int(o["pid"]), o.get("start")
        except signing.ForgedValue as e:
            _refused(order, str(e))
            continue
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
            f.write(json.dumps(signing.sign_doc(key, _kind(order, "answer"), rec)))
        out.append(rec)
        if result == "killed":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return out
