"""The ``failures`` config group (conf/failures/*.yaml) as a typed dataclass.

Plain dataclass, usable as a Hydra structured config (OmegaConf.structured / ConfigStore) and
from a plain dict. ``__post_init__`` rejects what can be checked without the parallel spec;
``build`` turns it into a validated FailureSchedule once W_init, S, G_init and the bucket count are
known. Every rank calls ``build`` with the same arguments and gets the same schedule.

No ``from __future__ import annotations`` here: OmegaConf reads the typing annotations.
"""
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from recover_hsdp.faults.schedule import (
    FailureSchedule,
    ScheduleError,
    _weights,
    generate,
)

KINDS = ("none", "schedule", "random")


@dataclass
class FailuresConfig:
    # none: no injected failures; schedule: entries inline (`schedule`) or from a file (`path`);
    # random: generate `count` kills from `seed` over `step_range` = [lo, hi)
    kind: str = "none"
    path: Optional[str] = None
    schedule: Optional[List[Dict[str, Any]]] = None
    seed: int = 0
    count: int = 0
    step_range: Optional[List[int]] = None
    # location -> relative weight; empty = equal weights over the always-reached locations
    location_weights: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"failures.kind: {self.kind!r} is not one of {', '.join(KINDS)}",
                                field="kind")
        if self.kind == "schedule":
            if (self.path is None) == (self.schedule is None):
                raise ScheduleError("failures: kind=schedule needs exactly one of failures.path "
                                    "(a YAML file) or failures.schedule (inline entries)",
                                    field="path")
            if self.schedule is not None:
                FailureSchedule.from_list(self.schedule)  # shape errors now, ranges in build()
        elif self.path is not None or self.schedule is not None:
            raise ScheduleError(f"failures: path/schedule are only used with kind=schedule "
                                f"(kind={self.kind})", field="kind")
        if self.kind == "random":
            if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
                raise ScheduleError(f"failures.count: must be an integer >= 0, got {self.count!r}",
                                    field="count")
            if self.step_range is None:
                raise ScheduleError("failures.step_range: kind=random needs [lo, hi)",
                                    field="step_range")
            _weights(dict(self.location_weights))

    @classmethod
    def from_mapping(cls, mapping: Optional[Mapping[str, Any]]) -> "FailuresConfig":
        """From a plain dict or an OmegaConf DictConfig; unknown keys are rejected by name."""
        if mapping is None:
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in mapping if k not in names)
        if unknown:
            raise ScheduleError(f"failures.{unknown[0]}: unknown key (allowed: "
                                f"{', '.join(sorted(names))})", field=unknown[0])
        values = {}
        for k in mapping:
            v = mapping[k]
            try:  # OmegaConf containers -> plain Python
                from omegaconf import OmegaConf

                if OmegaConf.is_config(v):
                    v = OmegaConf.to_container(v, resolve=True)
            except ImportError:  # pragma: no cover - omegaconf is a dependency
                pass
            values[str(k)] = v
        return cls(**values)

    def build(self, replicas: int, shard_size: int, grad_accum: int, n_buckets: int,
              start_step: int = 0, steps: Optional[int] = None,
              base_dir: Optional[str] = None) -> FailureSchedule:
        """The validated schedule for this run (identical on every rank, no communication).

        A relative ``path`` is resolved against ``base_dir`` (e.g. Hydra's original cwd).
        """
        if self.kind == "none":
            schedule = FailureSchedule.empty()
        elif self.kind == "schedule":
            if self.path is not None:
                path = self.path
                if base_dir is not None and not os.path.isabs(path):
                    path = os.path.join(base_dir, path)
                schedule = FailureSchedule.load(path)
            else:
                schedule = FailureSchedule.from_list(self.schedule)
        else:
            schedule = generate(replicas, shard_size, grad_accum, n_buckets, self.seed,
                                self.count, list(self.step_range),
                                dict(self.location_weights) or None)
        return schedule.validate(replicas, shard_size, start_step=start_step, steps=steps,
                                 n_buckets=n_buckets)
