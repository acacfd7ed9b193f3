"""The crash-safe run record that ``recover-hsdp verify`` and ``report`` read.

Every committing rank appends its own fsync'd JSONL line per committed step; shared files are
written atomically by every rank with identical content; parameter snapshots are atomic per
(step, shard index, replica). A SIGKILL of any rank, rank 0 included, loses no committed step.
See docs/faults.md ("Run directory") and recover_hsdp/record/run.py for the layout.

Plain Python + PyYAML; torch only for parameter snapshots (imported lazily).
"""
from __future__ import annotations

from recover_hsdp.record.io import (
    JsonlAppender,
    RecordError,
    atomic_write,
    read_jsonl,
    write_shared,
)
from recover_hsdp.record.params import (
    INIT_STEP,
    ParamWriter,
    load_params,
    param_copies,
    param_file,
    param_steps,
)
from recover_hsdp.record.run import (
    RunRecord,
    RunRecorder,
    RunSummary,
    read_run,
    write_fault_fired,
    write_run_files,
    write_summary,
)
from recover_hsdp.record.steps import StepRecord, StepWriter, merge_steps, step_file

__all__ = [
    "INIT_STEP", "JsonlAppender", "ParamWriter", "RecordError", "RunRecord", "RunRecorder",
    "RunSummary", "StepRecord", "StepWriter", "atomic_write", "load_params", "merge_steps",
    "param_copies", "param_file", "param_steps", "read_jsonl", "read_run", "step_file",
    "write_fault_fired", "write_run_files", "write_shared", "write_summary",
]
