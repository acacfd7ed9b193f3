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
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recover_hsdp.record.io import RecordError, read_jsonl
from recover_hsdp.record.steps import merge_steps

MODES = ("resilient", "drop_and_go", "reference", "checkpoint_restart", "torchft_dynamic",
         "torchft_fixed", "plain_ddp")
CONSTANT_MODES = ("reference", "checkpoint_restart")   # W_init*S processes allocated throughout
BREAKDOWN_KEYS = ("save", "normal", "failure_handling", "restart_init", "load", "rerun",
                  "recovery")
ATTEMPTS_DIR = "attempts"
RESTARTS = "restarts.jsonl"
_EVENTS_FILE = re.compile(r"^events\.rank(\d+)\.jsonl$")
# events whose time across ranks is the EARLIEST rank's; all others take the LATEST rank's
_EARLIEST = ("launch_seen", "ckpt_load_start", "ckpt_save_start")


@dataclass(frozen=True)
class Commit:
    """The first commit of one step (for checkpoint-restart: reruns are not listed again)."""

    step: int
    time: float                  # unix time of the commit (latest rank's local.time)
    loss: float | None
    tokens: int                  # tokens of the step, all replicas
    alive_processes: int         # processes that committed it (alive replicas x processes/replica)
    divisor: int | None
    attempt: int | None = None   # checkpoint-restart: the attempt that first committed it


@dataclass
class Timeline:
    label: str
    mode: str
    run_dir: Path
    t0: float                     # unix time training started
    end: float                    # last commit time
    commits: list[Commit]
    kills: list[float]            # unix times, ascending
    breakdown: list[dict]         # one dict per failure (docs/report.md)
    w_init: int
    processes_per_replica: int
    ckpt_interval: int | None = None
    kill_steps: list[int | None] = field(default_factory=list)   # step each kill landed in
    attempts: list[dict] = field(default_factory=list)           # checkpoint-restart only
    meta: dict = field(default_factory=dict)
    summary: dict | None = None
    # processes(t) as a step function: value _proc_values[i] from _proc_times[i] on
    _proc_times: list[float] = field(default_factory=list, repr=False)
    _proc_values: list[int] = field(default_factory=list, repr=False)

    # -- processes allocated over time -------------------------------------------------------
    @property
    def initial_processes(self) -> int:
        return self.w_init * self.processes_per_replica

    def processes(self, t: float) -> int:
        """Processes allocated at unix time t (right-continuous step function)."""
        i = bisect.bisect_right(self._proc_times, t) - 1
        return self._proc_values[max(i, 0)] if self._proc_values else self.initial_processes

    def process_seconds(self, a: float, b: float) -> float:
        """Integral of processes(t) over [a, b] (0 if b <= a)."""
        if b <= a:
            return 0.0
        total, t = 0.0, a
        i = bisect.bisect_right(self._proc_times, a)
        while i < len(self._proc_times) and self._proc_times[i] < b:
            total += self.processes(t) * (self._proc_times[i] - t)
            t = self._proc_times[i]
            i += 1
        return total + self.processes(t) * (b - t)

    def process_hours_at(self, t: float) -> float:
        return self.process_seconds(self.t0, t) / 3600.0

    @property
    def process_changes(self) -> list[tuple[float, int]]:
        return list(zip(self._proc_times, self._proc_values))

    # -- totals -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return len(self.commits)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.commits)

    @property
    def wall_s(self) -> float:
        return self.end - self.t0

    @property
    def process_hours(self) -> float:
        return self.process_hours_at(self.end)

    def to_json(self) -> dict:
        return {"label": self.label, "mode": self.mode, "run_dir": str(self.run_dir),
                "t0": self.t0, "end": self.end, "wall_s": self.wall_s, "steps": self.steps,
                "first_step": self.commits[0].step if self.commits else None,
                "last_step": max(c.step for c in self.commits) if self.commits else None,
                "tokens": self.tokens, "process_hours": self.process_hours,
                "w_init": self.w_init, "processes_per_replica": self.processes_per_replica,
                "ckpt_interval": self.ckpt_interval, "kills": self.kills,
                "kill_steps": self.kill_steps, "processes": self.process_changes,
                "breakdown": self.breakdown, "attempts": self.attempts}


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

def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RecordError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise RecordError(f"{path}: not JSON: {' '.join(str(e).split())}") from None


def _mode(meta: dict, run_dir: Path) -> str:
    mode = meta.get("mode")
    if mode is None:
        return "drop_and_go" if meta.get("policy") == "adaptive" else "resilient"
    if mode not in MODES:
        raise RecordError(f"{run_dir}: unknown meta.json mode {mode!r} (known: {', '.join(MODES)})")
    return mode


def _int_or(value: Any, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def _fired(run_dir: Path) -> list[dict]:
    """Fault markers: faults/fired*.json and attempts/*/faults/fired*.json, deduplicated."""
    paths = sorted((run_dir / "faults").glob("fired*.json"))
    paths += sorted((run_dir / ATTEMPTS_DIR).glob("*/faults/fired*.json"))
    seen, out = set(), []
    for p in paths:
        d = _read_json(p)
        if not isinstance(d, dict) or not isinstance(d.get("time"), (int, float)):
            raise RecordError(f"{p}: fault marker without a numeric 'time'")
        key = (d.get("rank"), d["time"])
        if key not in seen:
            seen.add(key)
            out.append(d)
    out.sort(key=lambda d: d["time"])
    return out


def _kill_step(marker: dict) -> int | None:
    entry = marker.get("entry") or {}
    return _int_or(entry.get("step"), None) if isinstance(entry, dict) else None


def _commits_from(directory: Path, pps: int, default_alive: int, attempt: int | None = None
                  ) -> list[tuple[Commit, float | None]]:
    """(Commit, t_start) per step of the step files under ``directory``/steps."""
    merged = merge_steps(directory)
    out = []
    for step, rec in merged.steps.items():
        times, starts = [], []
        for loc in merged.local[step].values():
            t = loc.get("time") if isinstance(loc, dict) else None
            if isinstance(t, (int, float)):
                times.append(float(t))
                wall = loc.get("wall_s")
                if isinstance(wall, (int, float)):
                    starts.append(float(t) - float(wall))
        if not times:
            raise RecordError(f"{directory}: step {step} has no local.time on any rank")
        alive = len(rec.alive) * pps if rec.alive else default_alive
        out.append((Commit(step=step, time=max(times), loss=rec.loss, tokens=int(rec.tokens or 0),
                           alive_processes=alive, divisor=rec.divisor, attempt=attempt),
                    min(starts) if starts else None))
    return out


def _first_commits(pairs: list[tuple[Commit, float | None]]) -> list[Commit]:
    first: dict[int, Commit] = {}
    for c, _ in sorted(pairs, key=lambda p: p[0].time):
        if c.step not in first:
            first[c.step] = c
    return sorted(first.values(), key=lambda c: (c.time, c.step))


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
                  summary=summary if isinstance(summary, dict) else None)
    if mode == "checkpoint_restart":
        return _load_cr(markers, **kwargs)
    return _load_plain(markers, **kwargs)


def _set_processes(tl: Timeline, changes: list[tuple[float, int]]) -> None:
    times, values = [], []
    for t, v in sorted(changes, key=lambda c: c[0]):
        if values and v == values[-1]:
            continue
        if times and t == times[-1]:
            values[-1] = v
            continue
        times.append(t)
        values.append(v)
    tl._proc_times, tl._proc_values = times, values


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
    # a replica's processes are released at the first kill of one of its ranks
    dead: set = set()
    changes = [(tl.t0, full)]
    for m, r in zip(markers, replicas):
        if r in dead:
            continue
        dead.add(r)
        changes.append((max(float(m["time"]), tl.t0), full - len(dead) * tl.processes_per_replica))
    _set_processes(tl, changes)


def _commit_time(tl: Timeline, step: int) -> float | None:
    for c in tl.commits:
        if c.step == step:
            return c.time
    return None


def _steps_before(tl: Timeline, t: float) -> int | None:
    """The step a kill at time t landed in: one after the last step committed before t."""
    done = [c.step for c in tl.commits if c.time <= t]
    return (max(done) + 1) if done else (tl.commits[0].step if tl.commits else None)


def _empty_breakdown() -> dict:
    d: dict[str, Any] = {k: 0.0 for k in BREAKDOWN_KEYS}
    d.update({k: None for k in "ABCDEFGH"})
    return d


def _finish(d: dict) -> dict:
    parts = [d[k] for k in BREAKDOWN_KEYS]
    d["total"] = None if any(p is None for p in parts) else sum(parts)
    return d


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


def timeline_json(tl: Timeline) -> dict:
    """JSON-able dict of a Timeline (commits included)."""
    d = tl.to_json()
    d["commits"] = [asdict(c) for c in tl.commits]
    d["attempts"] = [{k: v for k, v in a.items() if k != "commit_times"} for a in tl.attempts]
    return d
