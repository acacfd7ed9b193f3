"""The record checks ``verify_run`` runs before it replays anything (steps 1-2 of
recover_hsdp/verify/replay.py's docstring): the run's spec and step records load, the record
invariants hold, every contribution's ids are the ones the protocol derives from the failure
events, each step was reduced under one membership, and a resumed run continues exactly at its
checkpoints' cursors. A violation ends the verification at once (exit 1) without a replay."""
from __future__ import annotations

from pathlib import Path

from recover_hsdp.verify.expected import check_expected
from recover_hsdp.verify.records import check_bucket_epochs, check_records
from recover_hsdp.verify.result import VerifyResult, _Failed
from recover_hsdp.verify.spec import RunSpec, VerifyInputError


def check_before_replay(run_dir: Path, result: VerifyResult, note) -> tuple:
    """The pre-replay checks; (spec, record, steps, n_epochs) when they pass, else _Failed or
    VerifyInputError. ``n_epochs``: steps whose records carry per-bucket membership epochs."""
    spec = RunSpec.load(run_dir)
    record = spec.record
    steps = record.steps
    result.steps_committed = len(steps)
    if not steps:
        raise VerifyInputError(f"{run_dir}: no committed step to verify")
    if record.torn:
        note(f"torn last line in the step files of ranks {record.torn} (dropped; a rank was "
             f"killed while writing)")
    for v in check_records(steps, w_init=spec.w_init, B=spec.B, policy=spec.policy,
                           first_only=True):
        raise _Failed(v.step, f"step {v.step}: {v.message}",
                      {"kind": "record", "step": v.step, "message": v.message})
    # a run resumed from checkpoints (segments.jsonl) verifies as one run; across each
    # resume every continued slice starts exactly at the checkpoint's cursor
    from recover_hsdp.record.checkpoint import contiguous_resume_violations, read_segments

    segs = [g for g in read_segments(run_dir) if g.get("event") == "start"]
    # The independent id derivation starts from the initial layout and knows failures only, not
    # a relaunch at another width: it judges the steps before the first resume; the cursor check
    # below judges every resume (a slice continues exactly at its checkpointed cursor).
    resumes = [int(g["resume_step"]) for g in segs[1:] if g.get("resume_step") is not None]
    first_resume = min(resumes) if resumes else None
    derive = steps if first_resume is None else {k: v for k, v in steps.items()
                                                 if k < first_resume}
    for v in check_expected(derive, w_init=spec.w_init, g_init=spec.g_init, policy=spec.policy,
                            first_only=True):
        raise _Failed(v.step, v.message, {"kind": "expected_ids", "step": v.step,
                                          "replica": v.replica, "message": v.message})
    if first_resume is not None:
        note(f"protocol ids re-derived for steps < {first_resume} (the first resume); later "
             f"segments are checked by their checkpoint cursors")
    bad_epochs, n_epochs = check_bucket_epochs(record.local, steps, first_only=True)
    for v in bad_epochs:
        raise _Failed(v.step, f"step {v.step}: {v.message}",
                      {"kind": "bucket_epochs", "step": v.step, "message": v.message})
    for s, msg in contiguous_resume_violations(steps, segs, spec.w_init)[:1]:
        raise _Failed(s, f"step {s}: {msg}", {"kind": "record", "step": s, "message": msg})
    if len(segs) > 1:
        note(f"{len(segs)} segments (resumed at steps "
             f"{[g.get('resume_step') for g in segs[1:]]}); verified as one run")
    return spec, record, steps, n_epochs
