"""``recover-hsdp verify``: the exact oracle for a run directory (docs/verify.md).

* ``verify_run(run_dir, VerifyOptions(...)) -> VerifyResult`` replays every committed step in
  one process over exactly the recorded microbatch ids and compares the parameters with the
  run's snapshots (``VerifyOptions``: how; its defaults are the command line's).
* ``check_records(steps, w_init=, B=, policy=)``: the record-level invariants alone (no torch).
* synthetic run directories (tests, calibration), optionally with a wrong gradient committed
  under a correct record, are written by the checkout's experiments/verify_synthetic.py (not
  installed).

torch is imported only by the replay.
"""
from __future__ import annotations

from recover_hsdp.verify.options import VerifyOptions
from recover_hsdp.verify.records import Violation, check_records
from recover_hsdp.verify.spec import RunSpec, VerifyInputError
from recover_hsdp.verify.tolerance import DEFAULT_C, DEFAULT_REL_FLOOR, Tolerance


def verify_run(*args, **kwargs):
    from recover_hsdp.verify.replay import verify_run as _run

    return _run(*args, **kwargs)


__all__ = ["DEFAULT_C", "DEFAULT_REL_FLOOR", "RunSpec", "Tolerance", "VerifyInputError",
           "VerifyOptions", "Violation", "check_records", "verify_run"]
