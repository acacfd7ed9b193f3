"""The launcher's ONE reader of the ranks' error records (docs/faults.md, "Fault classes").

A failing rank puts its record in errors/, else the job's store, else /dev/shm on its node
(faults/errorlog.py). :func:`read_errors` reads all three: ``errors/``; the records posted to
every store this process serves (hsdp/topology.py ``serve_store`` lists them in
``errorlog.served_stores`` and calls :func:`harvest` before a store goes), each first written down on the LAUNCHER's side:
``errors/`` when it can write it (a rank on another node could not), else its own
``fallback_dir``, else kept in memory; then ``fallback_dir``. A record found in two places
counts once (by its file name, rank{g}.json). No torch here. launcher/judge.py (``read_errors``,
``common_error``, ``dead_replicas``, ``judge_launch``) and launcher/startup.py
(``errors_logged``) read through it.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from recover_hsdp.faults import errorlog
from recover_hsdp.faults.errorlog import COUNT, ERRORS_DIR, PREFIX, run_tag, write_record
from recover_hsdp.faults.signing import ForgedValue

_lock = threading.Lock()
_read: dict[int, set] = {}                   # id(store) -> the numbers already read
_memory: dict[str, dict[str, dict]] = {}     # run tag -> rank{g}.json -> record (nowhere to write)


def _materialize(item: dict) -> None:
    rec, run_dir = dict(item["record"], via="store"), Path(item["run_dir"])
    name = f"rank{rec['rank']}.json"
    for d in (run_dir / ERRORS_DIR, errorlog.fallback_dir(run_dir)):
        if (d / name).is_file():
            return
        try:
            write_record(d, rec, item.get("traceback") or "")
            return
        except (OSError, KeyError, TypeError):
            continue
    _memory.setdefault(run_tag(run_dir), {}).setdefault(
        name, dict(rec, traceback="not written down: no writable place on the launcher's node"))


def harvest(stores: Any = None) -> None:
    """Read the records posted to ``stores`` (default: every store this process serves) that
    were not read yet (a number taken but not set yet is read at a later call). No wait:
    check() does not block."""
    with _lock:
        for store in list(errorlog.served_stores) if stores is None else stores:
            done = _read.setdefault(id(store), set())
            try:
                n = int(store.add(COUNT, 0))
                for i in range(1, n + 1):
                    key = f"{PREFIX}{i}"
                    if i in done or not store.check([key]):
                        continue
                    try:
                        item = json.loads(store.get(key).decode())
                    except (ValueError, ForgedValue):   # not this job's: said in one line
                        done.add(i)
                        continue
                    done.add(i)
                    _materialize(item)
            except Exception:  # noqa: BLE001 - a store going away: what was read stays
                continue


def read_errors(run_dir: os.PathLike | str) -> list[dict]:
    """Every rank's error record of ``run_dir``, by file name (rank{g}.json), from errors/, the
    stores this process serves, and the fallback directory (module docstring)."""
    harvest()
    out: dict[str, dict] = {}
    for d in (Path(run_dir) / ERRORS_DIR, errorlog.fallback_dir(run_dir)):
        for p in sorted(d.glob("rank*.json")) if d.is_dir() else ():
            try:
                out.setdefault(p.name, json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
    with _lock:
        for name, rec in _memory.get(run_tag(run_dir), {}).items():
            out.setdefault(name, rec)
    return [out[k] for k in sorted(out)]


def _closing(store: Any) -> None:
    harvest([store])
    with _lock:
        _read.pop(id(store), None)


errorlog.store_close_hooks.append(_closing)   # read what was posted before a store goes
