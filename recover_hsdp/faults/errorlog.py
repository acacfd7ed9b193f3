"""The ranks' error records, rank side: where a failing rank puts its record (the launcher's one
reader of them is launcher/errors.py).

A rank that leaves as a fail-stop (faults/failstop.py ``fail_stop``) writes its record (one JSON
line: class, message, where, step, rank, host, ...) and its traceback to the first of:

1. ``errors/rank{g}.json`` + ``errors/rank{g}.traceback.txt`` in the run directory;
2. the job's store (``RECOVER_HSDP_STORE``): the TCPStore the launcher serves in its OWN process
   (hsdp/topology.py ``serve_store``), outside the ranks, in memory (a full disk does not touch
   it) and reached over TCP from every node. :func:`post` connects, takes a number
   (``add(COUNT, 1)``) and sets ``PREFIX/{n}`` to the record plus the traceback, cut to
   ``MAX_TRACEBACK`` characters; the whole exchange is bounded by ``STORE_TIMEOUT_S`` (a thread
   joined with that timeout: a store that does not answer costs at most that);
3. :func:`fallback_dir`: /dev/shm on the rank's node (seen only by a launcher on that node);
4. nothing: the rank prints its traceback on the console (failstop.fail_stop).

The launcher reads them with launcher/errors.py ``read_errors`` alone: ``errors/``, the records
posted to the stores it serves (written down on ITS side first), then :func:`fallback_dir`.

No import of failstop here (failstop imports this module); torch only inside :func:`post`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

ERRORS_DIR = "errors"
ENV_STORE = "RECOVER_HSDP_STORE"           # = hsdp.topology.ENV_STORE ("host:port")
PREFIX = "recover_hsdp/errors/"
COUNT = PREFIX + "count"
#: a rank waits at most this long for the store (connect + number + record), then /dev/shm
STORE_TIMEOUT_S = 5.0
#: the traceback a record carries through the store: its head and its tail, this many chars
MAX_TRACEBACK = 16000


def run_tag(run_dir: os.PathLike | str) -> str:
    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def fallback_dir(run_dir: os.PathLike | str) -> Path:
    """Where an error record goes when ``errors/`` cannot be written (a full or read-only disk)
    and the store cannot be reached: /dev/shm (memory: writable on a full disk), else the temp
    directory, in a folder named after the run directory (the launcher on this node reads it)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"recover_hsdp-errors-{run_tag(run_dir)}"


def write_record(ed: Path, rec: dict, tb: str) -> Path:
    """rank{g}.traceback.txt, then rank{g}.json (atomic, fsync'd) in ``ed``. Raises OSError."""
    ed.mkdir(parents=True, exist_ok=True)
    g = rec["rank"]
    (ed / f"rank{g}.traceback.txt").write_text(tb)
    path = ed / f"rank{g}.json"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(dict(rec, traceback=str(ed / f"rank{g}.traceback.txt")),
                           sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _cut(tb: str) -> str:
    if len(tb) <= MAX_TRACEBACK:
        return tb
    head, tail = MAX_TRACEBACK // 8, MAX_TRACEBACK - MAX_TRACEBACK // 8
    return f"{tb[:head]}\n... ({len(tb) - head - tail} characters cut) ...\n{tb[-tail:]}"


def cause_of(rec: dict) -> str:
    """One cause: class, message with its numbers masked (the step or rank it names), where."""
    return f"{rec['class']}|{re.sub(r'[0-9]+', 'N', str(rec['message']))}|{rec['where']}"


def _cause_key(run_dir: Path, cause: str) -> str:
    return f"{PREFIX}cause/{run_tag(run_dir)}/{hashlib.sha1(cause.encode()).hexdigest()[:12]}"


def post(run_dir: os.PathLike | str, rec: dict, tb: str, cause: str,
         timeout_s: Optional[float] = None) -> Optional[dict]:
    """Rank side: send the record and the traceback to the job's store. Returns
    ``{"address": "host:port", "first": bool}`` (first: no rank of this run posted ``cause``
    before: it prints the traceback), or None when there is no store or it did not answer
    within ``timeout_s`` (then the caller uses :func:`fallback_dir`). Never raises."""
    timeout_s = STORE_TIMEOUT_S if timeout_s is None else float(timeout_s)
    address = os.environ.get(ENV_STORE)
    if not address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    payload = json.dumps({"run_dir": str(Path(run_dir).resolve()), "record": rec,
                          "traceback": _cut(tb)}, sort_keys=True)
    box: dict[str, Any] = {}

    def send() -> None:
        try:
            from recover_hsdp.faults.jobstore import open_store

            # the store's own timeout ends inside the join's (its retries log while fd 2 is off);
            # the record is sealed with the job's key (the launcher refuses one that is not)
            store = open_store(host, int(port), timeout_s=max(0.1, 0.8 * timeout_s),
                               wait_for_workers=False)
            n = store.add(COUNT, 1)
            store.set(f"{PREFIX}{n}", payload)
            box["first"] = store.add(_cause_key(Path(run_dir), cause), 1) == 1
            box["address"] = address
        except Exception as e:  # noqa: BLE001 - any failure: the next place
            box["error"] = e

    t = threading.Thread(target=send, name="error-record-post", daemon=True)
    saved = _quiet_stderr()     # a store that fails logs its C++ retries on fd 2: one line only
    try:
        t.start()
        t.join(timeout_s)
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
    if "address" not in box:
        return None
    return {"address": box["address"], "first": box["first"]}


def _quiet_stderr() -> Optional[int]:
    """fd 2 -> /dev/null for the post; returns the saved fd (None when it cannot)."""
    try:
        saved = os.dup(2)
    except OSError:
        return None
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
    except OSError:
        os.close(saved)
        return None
    return saved


#: the stores this process serves (hsdp/topology.py serve_store adds and removes them) and what
#: runs before one goes (launcher/errors.py: read the records ranks posted there). Here, in a
#: torch-free module below both, so that the launcher need not import torch to read them.
served_stores: list = []
store_close_hooks: list = []
