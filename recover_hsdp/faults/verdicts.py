"""Launcher side of the fail-stop: what a finished job's run directory says about its deaths.

A rank that dies on purpose leaves a marker first (a scheduled kill: faults/fired.rank{g}.json; a
hung-rank verdict: faults/hung.rank{g}.json; an error fail-stop: errors/rank{g}.json). The
launcher reconciles summary.json with them (a replica killed after the last consensus is listed
alive by its peers). Split from faults/failstop.py, which re-exports these names.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from recover_hsdp.faults.failstop import ERRORS_DIR


# ---------------------------------------------------------------------------------------------
# Reconciling summary.json with the dying ranks' own markers
# ---------------------------------------------------------------------------------------------
def dead_replicas(run_dir: os.PathLike | str, shard_size: int) -> dict[int, str]:
    """{replica: evidence} for every replica a rank of which left a death marker: a scheduled
    kill (faults/fired.rank{g}.json), a hung-rank verdict (faults/hung.rank{g}.json) or an error
    fail-stop (errors/rank{g}.json). Each of those ranks is SIGKILLed right after writing it."""
    d = Path(run_dir)
    out: dict[int, str] = {}
    for sub, pat, what in (("faults", "fired.rank*.json", "scheduled kill"),
                           ("faults", "hung.rank*.json", "hung"),
                           (ERRORS_DIR, "rank*.json", "error")):
        for p in sorted((d / sub).glob(pat)) if (d / sub).is_dir() else ():
            try:
                g = int(p.name.split("rank")[1].split(".")[0])
            except (IndexError, ValueError):
                continue
            out.setdefault(g // max(1, int(shard_size)), f"{what} of rank {g}")
    return out


def reconcile_summary(run_dir: os.PathLike | str, shard_size: int) -> list[int]:
    """Rewrite summary.json when a replica it lists as alive left a death marker (e.g. killed
    after the last consensus: its peers committed the last step and wrote the summary before it
    died). Its scheduled entries move from `unreached` to `fired`. Returns the replicas moved."""
    from recover_hsdp.record.run import write_summary

    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    dead = dead_replicas(run_dir, shard_size)
    alive = list(summary.get("replicas_alive") or [])
    # a slot a standby took over (docs/rejoin.md) lives in another rank block
    blocks = {int(k): int(v) for k, v in
              ((summary.get("extra") or {}).get("slot_blocks") or {}).items()}
    moved = sorted(r for r in alive if blocks.get(r, r) in dead)
    if not moved:
        return []
    summary["replicas_alive"] = [r for r in alive if r not in moved]
    if isinstance(summary.get("failures_survived"), int):
        summary["failures_survived"] += len(moved)
    faults = summary.get("faults") or {}
    if isinstance(faults, dict) and faults.get("unreached"):
        keep = []
        for e in faults["unreached"]:
            (faults.setdefault("fired", []) if e.get("replica") in moved else keep).append(e)
        faults["unreached"] = keep
    summary.setdefault("extra", {})["reconciled"] = {str(r): dead[r] for r in moved}
    write_summary(run_dir, summary)
    return moved
