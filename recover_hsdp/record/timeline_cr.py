"""The checkpoint-restart run kind of recover_hsdp.record.timeline: attempts/{k}/steps,
attempts/{k}/events.rank*.jsonl and restarts.jsonl into one Timeline, and its per-failure
breakdown (docs/report.md)."""
from __future__ import annotations

import re
from pathlib import Path

from recover_hsdp.record.io import RecordError, read_jsonl
from recover_hsdp.record.timeline_base import (ATTEMPTS_DIR, RESTARTS, Timeline, _commits_from,
                                               _empty_breakdown, _finish, _first_commits,
                                               _int_or, _kill_step, _set_processes)

_EVENTS_FILE = re.compile(r"^events\.rank(\d+)\.jsonl$")
# events whose time across ranks is the EARLIEST rank's; all others take the LATEST rank's
_EARLIEST = ("launch_seen", "ckpt_load_start", "ckpt_save_start")


# -- checkpoint-restart -------------------------------------------------------------------------

def _attempt_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / ATTEMPTS_DIR
    if not root.is_dir():
        raise RecordError(f"{run_dir}: checkpoint-restart run without {ATTEMPTS_DIR}/")
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.isdigit():
            out.append((int(p.name), p))
    if not out:
        raise RecordError(f"{run_dir}: {ATTEMPTS_DIR}/ holds no attempt directories")
    return sorted(out)


def _events(attempt_dir: Path) -> list[dict]:
    """Events of one attempt merged across ranks: one per (event, step); see _EARLIEST."""
    merged: dict[tuple, dict] = {}
    for p in sorted(attempt_dir.iterdir()):
        if not _EVENTS_FILE.match(p.name):
            continue
        records, _ = read_jsonl(p)
        for n, e in enumerate(records, 1):
            if "event" not in e or not isinstance(e.get("time"), (int, float)):
                raise RecordError(f"{p}:{n}: event without 'event' and a numeric 'time'")
            key = (e["event"], e.get("step"))
            t = float(e["time"])
            if key not in merged:
                merged[key] = {"event": e["event"], "step": e.get("step"), "time": t}
            elif e["event"] in _EARLIEST:
                merged[key]["time"] = min(merged[key]["time"], t)
            else:
                merged[key]["time"] = max(merged[key]["time"], t)
    return sorted(merged.values(), key=lambda e: e["time"])


def _first_event(events: list[dict], name: str) -> float | None:
    return next((e["time"] for e in events if e["event"] == name), None)


def _load_cr(markers: list[dict], **kw) -> Timeline:
    run_dir, pps, w = kw["run_dir"], kw["processes_per_replica"], kw["w_init"]
    restarts_path = run_dir / RESTARTS
    restarts: dict[int, dict] = {}
    if restarts_path.exists():
        rows, _ = read_jsonl(restarts_path)
        for r in rows:
            k = _int_or(r.get("attempt"), None)
            if k is not None:
                restarts[k] = r
    attempts, pairs = [], []
    for k, d in _attempt_dirs(run_dir):
        ev = _events(d)
        ap = _commits_from(d, pps, w * pps, attempt=k) if (d / "steps").is_dir() else []
        pairs += ap
        r = restarts.get(k, {})
        attempts.append({"attempt": k, "dir": str(d), "events": ev,
                         "launch_time": r.get("launch_time"), "exit_time": r.get("exit_time"),
                         "rc": r.get("rc"), "resume_step": r.get("resume_step"),
                         "reason": r.get("reason"),
                         "steps": [c.step for c, _ in ap], "commit_times": [c.time for c, _ in ap]})
    if not pairs:
        raise RecordError(f"{run_dir}: no committed steps in any attempt")
    commits = _first_commits(pairs)
    t0 = _first_event(attempts[0]["events"], "train_start")
    if t0 is None:
        starts = [s for c, s in pairs if c.step == commits[0].step and s is not None]
        t0 = min(starts) if starts else commits[0].time
    end = max(c.time for c, _ in pairs)
    kills = [float(m["time"]) for m in markers]
    tl = Timeline(t0=t0, end=end, commits=commits, kills=kills, breakdown=[],
                  kill_steps=[_kill_step(m) for m in markers], attempts=attempts, **kw)
    _set_processes(tl, [(t0, tl.initial_processes)])
    tl.breakdown = _cr_breakdown(tl, markers)
    return tl


def _attempt_of(tl: Timeline, t: float) -> int | None:
    """Index in tl.attempts of the attempt running at time t (launch <= t <= exit)."""
    best = None
    for i, a in enumerate(tl.attempts):
        lo = a["launch_time"] if a["launch_time"] is not None else _first_event(a["events"],
                                                                                "launch_seen")
        hi = a["exit_time"]
        if lo is not None and lo <= t and (hi is None or t <= hi):
            best = i
    if best is None:   # no supervisor times: the last attempt with a commit or event before t
        for i, a in enumerate(tl.attempts):
            times = a["commit_times"] + [e["time"] for e in a["events"]]
            if times and min(times) <= t:
                best = i
    return best


def _cr_breakdown(tl: Timeline, markers: list[dict]) -> list[dict]:
    saves = []   # (start, end) of every checkpoint save, all attempts
    for a in tl.attempts:
        for e in a["events"]:
            if e["event"] == "ckpt_save_start":
                end = next((x["time"] for x in a["events"] if x["event"] == "ckpt_save_end"
                            and x.get("step") == e.get("step") and x["time"] >= e["time"]), None)
                saves.append((e["time"], end))
    saves.sort()
    out = []
    for i, m in enumerate(markers):
        c = float(m["time"])
        d = _empty_breakdown()
        d.update(failure=i, kill_step=None, ckpt_interval=tl.ckpt_interval, C=c)
        before = [s for s in saves if s[0] <= c]
        if before:
            d["A"], d["B"] = before[-1]
        k = _attempt_of(tl, c)
        cur = tl.attempts[k] if k is not None else None
        nxt = tl.attempts[k + 1] if k is not None and k + 1 < len(tl.attempts) else None
        step = _kill_step(m)
        if step is None and cur is not None:
            done = [s for s, t in zip(cur["steps"], cur["commit_times"]) if t <= c]
            step = (max(done) + 1) if done else cur["resume_step"]
        d["kill_step"] = step
        d["attempt"] = cur["attempt"] if cur else None
        d["D"] = cur["exit_time"] if cur else None
        if nxt is not None:
            d["E"] = _first_event(nxt["events"], "ckpt_load_start")
            d["F"] = _first_event(nxt["events"], "ckpt_load_end")
            d["G"] = _first_event(nxt["events"], "train_start")
            d["H"] = next((t for s, t in zip(nxt["steps"], nxt["commit_times"]) if s == step),
                          None)
        A, B, C, D, E, F, G, H = (d[x] for x in "ABCDEFGH")
        sub = lambda x, y: (x - y) if x is not None and y is not None else None  # noqa: E731
        d["save"] = sub(B, A)
        d["normal"] = sub(C, B)
        d["failure_handling"] = sub(D, C)
        d["load"] = sub(F, E) if E is not None or F is not None else 0.0
        ri = sub(G, D)
        d["restart_init"] = (ri - d["load"]) if ri is not None and d["load"] is not None else None
        d["rerun"] = sub(H, G)
        d["recovery"] = 0.0
        if A is None:   # no checkpoint before the kill: A = B = the attempt's train_start
            start = _first_event(cur["events"], "train_start") if cur else None
            d["A"] = d["B"] = start if start is not None else tl.t0
            d["save"], d["normal"] = 0.0, sub(C, d["B"])
        out.append(_finish(d))
    return out
