"""Per-step records: what every committing rank writes, and how rank files merge.

Invariants:
- Every rank that commits step s appends exactly one line for s to its own
  ``steps/rank{global}.jsonl``, fsync'd before it starts step s + 1. Steps in one file strictly
  increase.
- All fields except ``local`` are SHARED: every rank that commits s writes the same values (they
  come from agreed state: the policy, the agreed failure record, the globally reduced loss).
  Rank-local facts (wall time, where this rank's shard group first saw a failure, ...) go in
  ``local``. The merge checks the shared fields agree and names the step and field if not.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover_hsdp.record.io import JsonlAppender, RecordError, read_jsonl

STEPS_DIR = "steps"
_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


def step_file(run_dir: str | Path, global_rank: int) -> Path:
    return Path(run_dir) / STEPS_DIR / f"rank{global_rank}.jsonl"


def jsonable(value: Any) -> Any:
    """JSON-able form of dataclasses (the policy's Layout), enums (RestoreMode, Role), tuples."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()  # 0-d tensor / numpy scalar
    return value


@dataclass
class StepRecord:
    """One committed optimizer step.

    contributions: replica -> the microbatch ids it contributed (DataAssignment ids), in the order
    accumulated; their total count is the number of microbatches summed (== divisor).
    failures: the agreed failure events handled in this step, e.g. ``{"replicas": [2],
    "ranks": [4, 5], "epoch": 1, "at_boundary": true}``. restore_mode: the mode latched for the
    step ("SKIP" / "BLOCKING" / "NON_BLOCKING"), None if no failure was handled.
    """

    step: int
    loss: float | None = None
    tokens: int = 0
    alive: list[int] = field(default_factory=list)
    layout: dict | None = None
    boundary: bool = False
    restore_mode: str | None = None
    failures: list[dict] = field(default_factory=list)
    contributions: dict[int, list[int]] = field(default_factory=dict)
    divisor: int | None = None
    epoch: int = 0
    extra: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)

    _SHARED = ("step", "loss", "tokens", "alive", "layout", "boundary", "restore_mode",
               "failures", "contributions", "divisor", "epoch", "extra")

    def to_json(self) -> dict:
        d = {k: jsonable(getattr(self, k)) for k in self._SHARED}
        d["contributions"] = {str(int(r)): [int(i) for i in ids]
                              for r, ids in sorted(self.contributions.items(), key=lambda kv: int(kv[0]))}
        d["alive"] = sorted(int(r) for r in self.alive)
        d["local"] = jsonable(self.local)
        return d

    def shared(self) -> dict:
        d = self.to_json()
        del d["local"]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "StepRecord":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RecordError(f"step record: unknown field {unknown[0]!r}")
        if "step" not in d:
            raise RecordError("step record: missing field 'step'")
        kw = dict(d)
        kw["contributions"] = {int(r): list(ids) for r, ids in (d.get("contributions") or {}).items()}
        return cls(**kw)

    @property
    def microbatches(self) -> int:
        return sum(len(ids) for ids in self.contributions.values())

    def check_contributions(self) -> None:
        """The invariant one step can check on its own: every id once, count == divisor."""
        seen: dict[int, int] = {}
        for r, ids in self.contributions.items():
            for i in ids:
                if i in seen:
                    raise RecordError(f"step {self.step}: microbatch {i} contributed twice "
                                      f"(replicas {seen[i]} and {r})")
                seen[i] = r
        if self.divisor is not None and len(seen) != self.divisor:
            raise RecordError(f"step {self.step}: {len(seen)} microbatches contributed, "
                              f"divisor is {self.divisor}")


class StepWriter:
    """``steps/rank{global}.jsonl`` of one rank: ``write`` returns after the line is on disk."""

    def __init__(self, run_dir: str | Path, global_rank: int, fsync: bool = True):
        self.global_rank = global_rank
        self.path = step_file(run_dir, global_rank)
        self._out = JsonlAppender(self.path, fsync=fsync, fresh=True)
        self.last_step: int | None = None

    def write(self, record: StepRecord | Mapping) -> dict:
        if not isinstance(record, StepRecord):
            record = StepRecord.from_json(record)
        if self.last_step is not None and record.step <= self.last_step:
            raise RecordError(f"{self.path}: step {record.step} written after step "
                              f"{self.last_step} (steps are never replayed or rolled back)")
        line = record.to_json()
        line["local"].setdefault("rank", self.global_rank)
        line["local"].setdefault("time", time.time())
        self._out.append(line)
        self.last_step = record.step
        return line

    def close(self) -> None:
        self._out.close()


def _agree(a: Any, b: Any, rel_tol: float, abs_tol: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool) or not all(
                isinstance(x, (int, float)) for x in (a, b)):
            return False
        return a == b or math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_agree(a[k], b[k], rel_tol, abs_tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_agree(x, y, rel_tol, abs_tol) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def rank_files(run_dir: str | Path) -> dict[int, Path]:
    d = Path(run_dir) / STEPS_DIR
    out = {}
    if d.is_dir():
        for p in d.iterdir():
            m = _RANK_FILE.match(p.name)
            if m:
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


@dataclass
class MergedSteps:
    steps: dict[int, StepRecord]            # step -> record (``local`` of the lowest rank)
    local: dict[int, dict[int, dict]]       # step -> global rank -> that rank's local dict
    lines: dict[int, int]                   # global rank -> complete lines in its file
    torn: list[int]                         # global ranks whose file ends in a torn line


def merge_steps(run_dir: str | Path, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> MergedSteps:
    """Merge every rank's step file; raise RecordError if ranks disagree on a shared field.

    Floats (the loss) may differ by ``rel_tol``/``abs_tol`` (reduction order); everything else
    must be equal.
    """
    shared: dict[int, tuple[int, dict]] = {}
    steps: dict[int, StepRecord] = {}
    local: dict[int, dict[int, dict]] = {}
    lines: dict[int, int] = {}
    torn: list[int] = []
    for rank, path in rank_files(run_dir).items():
        records, was_torn = read_jsonl(path)
        lines[rank] = len(records)
        if was_torn:
            torn.append(rank)
        prev = None
        for n, raw in enumerate(records, 1):
            rec = StepRecord.from_json(raw)
            if prev is not None and rec.step <= prev:
                raise RecordError(f"{path}:{n}: step {rec.step} after step {prev}")
            prev = rec.step
            mine = rec.shared()
            if rec.step in shared:
                other_rank, theirs = shared[rec.step]
                for key in mine.keys() | theirs.keys():
                    if not _agree(mine.get(key), theirs.get(key), rel_tol, abs_tol):
                        raise RecordError(
                            f"step {rec.step}: field {key!r} disagrees between rank {other_rank} "
                            f"({_short(theirs.get(key))}) and rank {rank} ({_short(mine.get(key))})")
            else:
                shared[rec.step] = (rank, mine)
                steps[rec.step] = rec
            local.setdefault(rec.step, {})[rank] = rec.local
    order = sorted(steps)
    return MergedSteps({s: steps[s] for s in order}, {s: local[s] for s in order}, lines, torn)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
