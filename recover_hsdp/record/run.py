"""The run directory: what a run leaves behind for ``recover-hsdp verify`` and ``report``.

    run_dir/
      meta.json                  run facts identical on every rank (W_init, S, G_init, B, seed...)
      config.yaml                the resolved config
      schedule.yaml              the resolved failure schedule (a YAML list; [] if none)
      steps/rank{g}.jsonl        one fsync'd line per step committed by global rank g
      params/step{s:06d}/shard{j}.replica{r}.pt, params/init/...   (ParamWriter)
      faults/fired.rank{g}.json  written by rank g just before its scheduled SIGKILL
      summary.json               written at the end (by the lowest alive rank)

Rank 0 is not special: every rank writes meta/config/schedule (atomic rename of identical
bytes, so the race is harmless) and its own step file, so a kill of any rank loses no committed
step. ``read_run`` merges whatever files exist.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recover_hsdp.record.io import RecordError, atomic_write, write_shared
from recover_hsdp.record.params import ParamWriter
from recover_hsdp.record.steps import StepRecord, StepWriter, jsonable, merge_steps

RECORD_FORMAT = 1
META = "meta.json"
CONFIG = "config.yaml"
SCHEDULE = "schedule.yaml"
SUMMARY = "summary.json"
FAULTS_DIR = "faults"


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(jsonable(obj), sort_keys=True, indent=2, allow_nan=False) + "\n").encode()


def _schedule_dicts(schedule: Any) -> list[dict]:
    if schedule is None:
        return []
    if hasattr(schedule, "as_dicts"):
        return list(schedule.as_dicts())
    return [dict(jsonable(e)) if not hasattr(e, "to_dict") else e.to_dict() for e in schedule]


def write_run_files(run_dir: str | Path, meta: Mapping, config: Mapping | str | None = None,
                    schedule: Any = None, fsync: bool = True) -> None:
    """meta.json, config.yaml, schedule.yaml: call on EVERY rank with identical arguments.

    ``meta`` must hold only rank-independent facts (no hostname, pid or local clock: put those
    in the step records' ``local``). Different content already on disk raises RecordError.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(jsonable(meta))
    meta.setdefault("record_format", RECORD_FORMAT)
    write_shared(run_dir / META, _json_bytes(meta), fsync=fsync)
    if config is not None:
        text = config if isinstance(config, str) else yaml.safe_dump(jsonable(config), sort_keys=True)
        write_shared(run_dir / CONFIG, text.encode(), fsync=fsync)
    items = _schedule_dicts(schedule)
    text = yaml.safe_dump(items, sort_keys=False, default_flow_style=None) if items else "[]\n"
    write_shared(run_dir / SCHEDULE, text.encode(), fsync=fsync)


def write_fault_fired(run_dir: str | Path, global_rank: int, entry: Any,
                      fsync: bool = True) -> Path:
    """Marker left by a rank just before its scheduled SIGKILL (direct evidence it fired)."""
    data = {"rank": global_rank, "pid": os.getpid(), "time": time.time(),
            "entry": entry.to_dict() if hasattr(entry, "to_dict") else jsonable(entry)}
    path = Path(run_dir) / FAULTS_DIR / f"fired.rank{global_rank}.json"
    atomic_write(path, _json_bytes(data), fsync=fsync)
    return path


@dataclass
class RunSummary:
    """summary.json: the manager fills the numbers; tokens_per_s is derived if left None."""

    steps_committed: int
    first_step: int | None = None
    last_step: int | None = None
    replicas_initial: int | None = None
    replicas_alive: list[int] = field(default_factory=list)
    failures_survived: int = 0          # replicas lost during the run
    wall_time_s: float = 0.0
    tokens: int = 0
    tokens_per_s: float | None = None
    faults: dict = field(default_factory=dict)   # FailureInjector.outcome(...)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens_per_s is None and self.wall_time_s > 0:
            self.tokens_per_s = self.tokens / self.wall_time_s


def write_summary(run_dir: str | Path, summary: RunSummary | Mapping, fsync: bool = True) -> Path:
    """Atomically (re)write summary.json; a later call replaces an earlier one."""
    path = Path(run_dir) / SUMMARY
    atomic_write(path, _json_bytes(summary), fsync=fsync)
    return path


class RunRecorder:
    """One rank's handle on the run directory: the only record object the manager needs.

        rec = RunRecorder(run_dir, global_rank, replica, shard_index, params_every=10,
                          final_step=steps - 1)
        rec.start(meta, config, schedule)        # every rank, identical arguments
        injector = FailureInjector(schedule, replica, local_rank, before_kill=rec.fault_fired)
        ...each step: optimizer.step(); rec.commit(StepRecord(...)); rec.save_params(step, shard)
        rec.finish(RunSummary(...))              # lowest alive rank only
    """

    def __init__(self, run_dir: str | Path, global_rank: int, replica: int, shard_index: int,
                 params_every: int = 1, final_step: int | None = None, fsync: bool = True,
                 params_keep: int = 0):
        self.run_dir = Path(run_dir)
        self.global_rank = global_rank
        self.fsync = fsync
        self.params = ParamWriter(self.run_dir, global_rank, replica, shard_index,
                                  every=params_every, final_step=final_step, fsync=fsync,
                                  keep=params_keep)
        self._steps: StepWriter | None = None

    def start(self, meta: Mapping, config: Mapping | str | None = None,
              schedule: Any = None) -> None:
        write_run_files(self.run_dir, meta, config, schedule, fsync=self.fsync)
        self._steps = StepWriter(self.run_dir, self.global_rank, fsync=self.fsync)

    def resume_segment(self, segment: int) -> None:
        """A resumed launch: keep meta/config of the first launch, append this rank's
        steps to steps/rank{1000*segment + g}.jsonl (recover_hsdp/record/checkpoint.py)."""
        from recover_hsdp.record.checkpoint import rank_file_offset

        self._steps = StepWriter(self.run_dir, rank_file_offset(segment) + self.global_rank,
                                 fsync=self.fsync)

    def commit(self, record: StepRecord | Mapping) -> dict:
        """Append this rank's line for a committed step; on disk when this returns."""
        if self._steps is None:
            raise RecordError("RunRecorder.commit before start()")
        return self._steps.write(record)

    def save_params(self, step: int, tensors: Mapping, force: bool = False) -> Path | None:
        return self.params.save(step, tensors, force=force)

    def save_initial_params(self, tensors: Mapping) -> Path | None:
        return self.params.save_initial(tensors)

    def fault_fired(self, entry: Any) -> None:
        write_fault_fired(self.run_dir, self.global_rank, entry, fsync=self.fsync)

    def finish(self, summary: RunSummary | Mapping) -> Path:
        return write_summary(self.run_dir, summary, fsync=self.fsync)

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()


@dataclass
class RunRecord:
    """A run directory as read back (``read_run``)."""

    run_dir: Path
    meta: dict | None
    config: dict | None
    schedule: list[dict] | None
    steps: dict[int, StepRecord]          # merged, ascending step
    local: dict[int, dict[int, dict]]     # step -> global rank -> rank-local fields
    lines: dict[int, int]                 # global rank -> complete lines in its step file
    torn: list[int]                       # ranks whose step file ends in a torn line
    fired: list[dict]                     # fault markers (rank, pid, time, entry), by rank
    summary: dict | None

    @property
    def committed(self) -> list[int]:
        return list(self.steps)

    @property
    def first_step(self) -> int | None:
        return next(iter(self.steps), None)

    @property
    def last_step(self) -> int | None:
        return next(reversed(self.steps), None) if self.steps else None

    @property
    def gaps(self) -> list[int]:
        """Steps missing between the first and last committed step (must be empty)."""
        if not self.steps:
            return []
        have = set(self.steps)
        return [s for s in range(self.first_step, self.last_step + 1) if s not in have]

    def ranks(self, step: int) -> list[int]:
        """Global ranks whose file records ``step``."""
        return sorted(self.local.get(step, {}))


def _read_optional(path: Path, parse) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return parse(text)
    except Exception as e:
        raise RecordError(f"{path}: cannot parse: {' '.join(str(e).split())}") from None


def read_run(run_dir: str | Path, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> RunRecord:
    """Read and merge a run directory; RecordError if it is not one or ranks disagree."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RecordError(f"{run_dir}: no such run directory")
    meta = _read_optional(run_dir / META, json.loads)
    merged = merge_steps(run_dir, rel_tol=rel_tol, abs_tol=abs_tol)
    if meta is None and not merged.lines:
        raise RecordError(f"{run_dir}: not a run directory (no {META}, no steps/rank*.jsonl)")
    config = _read_optional(run_dir / CONFIG, yaml.safe_load)
    schedule = _read_optional(run_dir / SCHEDULE, yaml.safe_load)
    summary = _read_optional(run_dir / SUMMARY, json.loads)
    fired = []
    faults = run_dir / FAULTS_DIR
    if faults.is_dir():
        for p in sorted(faults.glob("fired.rank*.json")):
            fired.append(_read_optional(p, json.loads))
        fired.sort(key=lambda d: d.get("rank", 0))
    return RunRecord(run_dir, meta, config, schedule, merged.steps, merged.local, merged.lines,
                     merged.torn, fired, summary)
