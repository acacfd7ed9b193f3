"""The deterministic failure simulator (paper appendix C, "Failure simulator").

A schedule is a YAML list of ``{step, replica, local_rank, location}`` entries (plus
``microbatch`` or ``bucket`` where the location takes one), read from a file or generated from
(parallel spec, seed, count, step range, location weights) identically on every rank with no
communication. The scheduled rank SIGKILLs itself when the loop reaches that point; see
docs/faults.md for the exact position of every location in an iteration (the manager's contract).

Pure Python (PyYAML only): no torch, no MPI.
"""
from __future__ import annotations

from recover_hsdp.faults.config import KINDS, FailuresConfig
from recover_hsdp.faults.injector import FailureInjector, replica_lost_exit, sigkill_self
from recover_hsdp.faults.locations import (
    AGREED,
    ALWAYS_REACHED,
    BACKWARD,
    BUCKET_LOCATIONS,
    CLOSURE,
    CONDITIONAL,
    CONSENSUS,
    EXTENSION,
    FORWARD,
    GATE,
    LOCATIONS,
    MICROBATCH_LOCATIONS,
    OPTIMIZER_STEP,
    PRE_STEP,
    RE_REDUCE,
    REBUILD,
    RECOVERY,
    REDUCE,
)
from recover_hsdp.faults.schedule import (
    DEFAULT_WEIGHTS,
    FailureEntry,
    FailureSchedule,
    ScheduleError,
    generate,
    load_schedule,
)

__all__ = [
    "AGREED", "ALWAYS_REACHED", "BACKWARD", "BUCKET_LOCATIONS", "CLOSURE", "CONDITIONAL",
    "CONSENSUS", "REBUILD", "RECOVERY",
    "DEFAULT_WEIGHTS", "EXTENSION", "FORWARD", "FailureEntry", "FailureInjector",
    "FailureSchedule", "FailuresConfig", "GATE", "KINDS", "LOCATIONS", "MICROBATCH_LOCATIONS",
    "OPTIMIZER_STEP", "PRE_STEP", "RE_REDUCE", "REDUCE", "ScheduleError", "generate",
    "load_schedule", "replica_lost_exit", "sigkill_self",
]
