"""The Timeline data model (recover_hsdp.record.timeline) and the readers every run kind shares:
JSON files, fault markers, the step files' commits, the processes step function, breakdown
dicts. Pure Python: no torch."""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover_hsdp.record.io import RecordError
from recover_hsdp.record.steps import merge_steps

MODES = ("resilient", "drop_and_go", "reference", "checkpoint_restart", "torchft_dynamic",
         "torchft_fixed", "plain_ddp")
CONSTANT_MODES = ("reference", "checkpoint_restart")   # W_init*S processes allocated throughout
BREAKDOWN_KEYS = ("save", "normal", "failure_handling", "restart_init", "load", "rerun",
                  "recovery")
ATTEMPTS_DIR = "attempts"
RESTARTS = "restarts.jsonl"


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
    standby: int = 0              # idle hot standbys launched too (docs/rejoin.md): allocated
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
        return (self.w_init + self.standby) * self.processes_per_replica

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
                "ckpt_interval": self.ckpt_interval, "standby": self.standby,
                "kills": self.kills,
                "kill_steps": self.kill_steps, "processes": self.process_changes,
                "breakdown": self.breakdown, "attempts": self.attempts}


# -- reading (every run kind) ---------------------------------------------------------------------

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


def _empty_breakdown() -> dict:
    d: dict[str, Any] = {k: 0.0 for k in BREAKDOWN_KEYS}
    d.update({k: None for k in "ABCDEFGH"})
    return d


def _finish(d: dict) -> dict:
    parts = [d[k] for k in BREAKDOWN_KEYS]
    d["total"] = None if any(p is None for p in parts) else sum(parts)
    return d
