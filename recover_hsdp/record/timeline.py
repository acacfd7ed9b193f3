"""One normalized timeline per run directory, whatever kind of run left it (docs/report.md).

    tl = load_timeline("runs/resilient", label="ReCoVer", interval=8)
    tl.commits            # first commit of each step, in time order (Commit)
    tl.kills              # unix times of the kills (fired markers)
    tl.processes(t)       # processes allocated at unix time t
    effective_throughput_intervals(tl)     # per interval between consecutive kills
    tokens_vs_process_hours(tl)            # [(process_hours, cumulative tokens)] step function
    tokens_at_process_hours(tl, ph)

Reads plain run directories (resilient, drop_and_go, reference, torchft_*, plain_ddp: steps/,
faults/, meta.json) and checkpoint-restart ones (attempts/{k}/steps, attempts/{k}/events.rank*,
restarts.jsonl). Pure Python + json/yaml: no torch, so ``recover-hsdp report`` starts fast.
Every problem with a directory is a one-line ``RecordError``.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict
from pathlib import Path

from recover_hsdp.record.io import RecordError
# the data model and the readers every run kind shares (timeline_base.py), the checkpoint-restart
# reader (timeline_cr.py); this module reads the plain run kinds and is the public face
from recover_hsdp.record.timeline_base import (ATTEMPTS_DIR, BREAKDOWN_KEYS,  # noqa: F401
                                               CONSTANT_MODES, MODES, RESTARTS, Commit, Timeline,
                                               _commits_from, _empty_breakdown, _finish, _fired,
                                               _first_commits, _int_or, _kill_step, _read_json,
                                               _set_processes)
from recover_hsdp.record.timeline_cr import _load_cr


# -- helpers over a Timeline ---------------------------------------------------------------------

def kill_boundaries(tl: Timeline) -> list[float]:
    """Interval boundaries: kill times inside (t0, end); kills with no commit between them (e.g.
    two kills during one step) are one boundary, at the first of them."""
    times = [c.time for c in tl.commits]
    out: list[float] = []
    for k in tl.kills:
        if not tl.t0 < k < tl.end:
            continue
        if out and bisect.bisect_right(times, out[-1]) == bisect.bisect_right(times, k):
            continue   # no commit between the previous boundary and this kill
        out.append(k)
    return out


def effective_throughput_intervals(tl: Timeline) -> list[dict]:
    """One dict per interval [t0, kill_1], [kill_1, kill_2], ..., [kill_k, end].

    new_tokens: tokens of the steps first committed in (start, end]; effective_throughput =
    new_tokens / (duration x mean processes allocated) = new_tokens / process-seconds, in tokens
    per second per process.
    """
    edges = [tl.t0, *kill_boundaries(tl), tl.end]
    out = []
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        if b <= a:
            continue
        inside = [c for c in tl.commits if a < c.time <= b or (i == 0 and c.time == a)]
        ps = tl.process_seconds(a, b)
        new = sum(c.tokens for c in inside)
        out.append({
            "interval": len(out), "start": a, "end": b, "start_s": a - tl.t0, "end_s": b - tl.t0,
            "duration_s": b - a, "new_tokens": new, "steps": len(inside),
            "first_step": min((c.step for c in inside), default=None),
            "last_step": max((c.step for c in inside), default=None),
            "alive_processes": tl.processes(a), "mean_processes": ps / (b - a),
            "process_hours": ps / 3600.0,
            "effective_throughput": new / ps if ps > 0 else 0.0,
        })
    return out


def tokens_vs_process_hours(tl: Timeline) -> list[tuple[float, int]]:
    """Cumulative committed tokens as a step function of process-hours since t0: the points
    (process_hours at commit, tokens committed so far), starting at (0.0, 0)."""
    pts = [(0.0, 0)]
    total = 0
    for c in tl.commits:
        total += c.tokens
        pts.append((tl.process_hours_at(c.time), total))
    return pts


def tokens_at_process_hours(tl: Timeline, ph: float) -> int:
    """Tokens committed by the time ``ph`` process-hours were spent (the paper samples the
    completed iteration at each GPU-hour boundary)."""
    pts = tokens_vs_process_hours(tl)
    i = bisect.bisect_right([p for p, _ in pts], ph + 1e-12) - 1
    return pts[max(i, 0)][1]


def common_process_hours(timelines: list[Timeline]) -> float:
    """The largest process-hours that every run reached (min over runs of its total)."""
    return min((tl.process_hours for tl in timelines), default=0.0)


# -- reading ----------------------------------------------------------------------------------

def _mode(meta: dict, run_dir: Path) -> str:
    mode = meta.get("mode")
    if mode is None:
        return "drop_and_go" if meta.get("policy") == "adaptive" else "resilient"
    if mode not in MODES:
        raise RecordError(f"{run_dir}: unknown meta.json mode {mode!r} (known: {', '.join(MODES)})")
    return mode


def load_timeline(run_dir: str | Path, label: str | None = None,
                  interval: int | None = None) -> Timeline:
    """Read any run directory into a Timeline; RecordError (one line) if it is not a run.

    ``interval``: checkpoint interval N for a resilient run's breakdown (default: meta
    ``ckpt_interval``; for checkpoint-restart the meta value wins).
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise RecordError(f"{run_dir}: no such directory")
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir}: not a directory")
    meta = _read_json(run_dir / "meta.json")
    has_steps = (run_dir / "steps").is_dir() or (run_dir / ATTEMPTS_DIR).is_dir()
    if meta is None:
        if not has_steps:
            raise RecordError(f"{run_dir}: not a run directory (no meta.json, no steps/ or "
                              f"attempts/)")
        meta = {}
    if not isinstance(meta, dict):
        raise RecordError(f"{run_dir}/meta.json: not a JSON object")
    mode = _mode(meta, run_dir)
    w_init = _int_or(meta.get("w_init"), None)
    if w_init is None:
        raise RecordError(f"{run_dir}/meta.json: no w_init")
    pps = _int_or(meta.get("processes_per_replica"), None) or _int_or(meta.get("shard_size"), 1)
    n = _int_or(meta.get("ckpt_interval"), None)
    if mode != "checkpoint_restart" and interval is not None:
        n = int(interval)
    elif n is None and interval is not None:
        n = int(interval)
    summary = _read_json(run_dir / "summary.json")
    markers = _fired(run_dir)
    kwargs = dict(label=label or run_dir.name, mode=mode, run_dir=run_dir, w_init=w_init,
                  processes_per_replica=pps, ckpt_interval=n, meta=meta,
                  standby=_int_or(meta.get("standby"), 0) or 0,
                  summary=summary if isinstance(summary, dict) else None)
    if mode == "checkpoint_restart":
        return _load_cr(markers, **kwargs)
    return _load_plain(markers, **kwargs)


def _load_plain(markers: list[dict], **kw) -> Timeline:
    run_dir, pps, w = kw["run_dir"], kw["processes_per_replica"], kw["w_init"]
    if not (run_dir / "steps").is_dir():
        raise RecordError(f"{run_dir}: not a run directory (no steps/)")
    pairs = _commits_from(run_dir, pps, w * pps)
    if not pairs:
        raise RecordError(f"{run_dir}: no committed steps")
    commits = _first_commits(pairs)
    starts = [s for c, s in pairs if c.step == commits[0].step and s is not None]
    t0 = min(starts) if starts else commits[0].time
    end = max(c.time for c in commits)
    kills = [float(m["time"]) for m in markers]
    tl = Timeline(t0=t0, end=end, commits=commits, kills=kills, breakdown=[],
                  kill_steps=[_kill_step(m) for m in markers], **kw)
    _plain_processes(tl, markers)
    tl.breakdown = _resilient_breakdown(tl, markers)
    return tl


def _plain_processes(tl: Timeline, markers: list[dict]) -> None:
    full = tl.initial_processes
    if tl.mode in CONSTANT_MODES:
        _set_processes(tl, [(tl.t0, full)])
        return
    replicas = [((m.get("entry") or {}).get("replica") if isinstance(m.get("entry"), dict)
                 else None) for m in markers]
    if tl.mode.startswith("torchft") or any(r is None for r in replicas):
        # from the commits: the processes that committed step i were allocated since commit i-1
        changes = [(tl.t0, tl.commits[0].alive_processes)]
        changes += [(a.time, b.alive_processes) for a, b in zip(tl.commits, tl.commits[1:])]
        _set_processes(tl, changes)
        return
    # a replica's processes are released at the first kill of one of its ranks (a marker's
    # replica is a rank block: a standby's block is >= w_init); an idle standby lost, or one
    # whose join was abandoned, at the commit of the step that records it (docs/rejoin.md)
    events = [(float(m["time"]), r) for m, r in zip(markers, replicas)]
    if tl.standby:
        events += _standby_releases(tl)
    dead: set = set()
    changes = [(tl.t0, full)]
    for t, r in sorted(events, key=lambda e: e[0]):
        if r in dead:
            continue
        dead.add(r)
        changes.append((max(t, tl.t0), full - len(dead) * tl.processes_per_replica))
    _set_processes(tl, changes)


def _standby_releases(tl: Timeline) -> list[tuple[float, int]]:
    """(commit time, rank block) of each standby a step record reports gone: extra.standbys_lost
    (lost while idle) and extra.joins with outcome abandoned (the standby leaves)."""
    from recover_hsdp.record.steps import merge_steps

    out = []
    for step, rec in merge_steps(tl.run_dir).steps.items():
        t = _commit_time(tl, step)
        ex = rec.extra or {}
        if t is None or not isinstance(ex, dict):
            continue
        out += [(t, _int_or(b, -1)) for b in ex.get("standbys_lost") or ()]
        out += [(t, _int_or(j.get("standby"), -1)) for j in ex.get("joins") or ()
                if isinstance(j, dict) and j.get("outcome") == "abandoned"]
    return out


def _commit_time(tl: Timeline, step: int) -> float | None:
    for c in tl.commits:
        if c.step == step:
            return c.time
    return None


def _steps_before(tl: Timeline, t: float) -> int | None:
    """The step a kill at time t landed in: one after the last step committed before t."""
    done = [c.step for c in tl.commits if c.time <= t]
    return (max(done) + 1) if done else (tl.commits[0].step if tl.commits else None)


def _resilient_breakdown(tl: Timeline, markers: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(markers):
        c = float(m["time"])
        step = _kill_step(m)
        if step is None:
            step = _steps_before(tl, c)
        d = _empty_breakdown()
        d.update(failure=i, kill_step=step, ckpt_interval=tl.ckpt_interval, C=c)
        h = _commit_time(tl, step) if step is not None else None
        d["H"] = h
        d["recovery"] = (h - c) if h is not None else None
        if tl.ckpt_interval and step is not None:
            last_mult = (step // tl.ckpt_interval) * tl.ckpt_interval
            a = _commit_time(tl, last_mult - 1) if last_mult - 1 >= tl.commits[0].step else tl.t0
            d["A"] = d["B"] = a
            d["normal"] = (c - a) if a is not None else None
        else:
            d["normal"] = None
        out.append(_finish(d))
    return out


def timeline_json(tl: Timeline) -> dict:
    """JSON-able dict of a Timeline (commits included)."""
    d = tl.to_json()
    d["commits"] = [asdict(c) for c in tl.commits]
    d["attempts"] = [{k: v for k, v in a.items() if k != "commit_times"} for a in tl.attempts]
    return d
