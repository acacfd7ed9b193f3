"""What ``verify_run`` returns: the per-step reports and the run's verdict (exit codes 0 OK,
1 FAILED, 2 error), and the internal failure that ends a replay at its first bad step."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from recover_hsdp import exit_codes

# the table of every command (recover_hsdp/exit_codes.py): a mismatch is FAILED, a run directory
# that cannot be replayed (not a run, unreadable, bad options) is USAGE
EXIT_OK, EXIT_FAILED, EXIT_ERROR = exit_codes.OK, exit_codes.FAILED, exit_codes.USAGE


@dataclass
class StepReport:
    step: int
    microbatches: int = 0
    replicas: int = 0
    divisor: int = 0
    lr: float = 0.0
    compared: bool = False
    max_abs: float | None = None
    max_rel: float | None = None
    tol: float | None = None
    copies: int = 0                       # (shard, replica) files compared
    copies_max_diff: float | None = None  # largest difference between replicas' copies
    max_rms: float | None = None          # largest RMS difference of one flat parameter
    rms_tol: float | None = None
    reason: str | None = None             # element | rms | copies | strict | grad_norm
    envelope: tuple | None = None         # (max_abs, max_rms) of the HSDP-order twin (--envelope)
    strict_ratio: float | None = None     # strict check: max over coordinates of |diff| / bound
    strict_fraction: float | None = None  # strict check: coordinates over their bound (share)
    grad_norm_ratio: float | None = None  # |recorded - replayed| grad norm / its derived bound
    ok: bool = True
    where: str | None = None              # location of max_abs: "shard j, param fqn[idx]"
    seconds: float = 0.0


@dataclass
class VerifyResult:
    run_dir: str
    ok: bool
    exit_code: int
    message: str
    steps_committed: int = 0
    steps_replayed: int = 0
    steps_compared: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_rms: float = 0.0
    max_strict: float | None = None       # largest strict |diff| / bound (None: never applied)
    steps_strict: int = 0                 # steps judged by the strict per-coordinate bound
    max_grad_norm: float | None = None    # largest grad-norm |diff| / bound (None: never)
    steps_grad_norm: int = 0              # steps whose recorded gradient norm was compared
    tol: float | None = None              # element tolerance at the last replayed step
    rms_tol: float | None = None          # per-flat-parameter RMS tolerance at the last step
    tolerance: str = ""
    failed_step: int | None = None
    failure: dict | None = None
    failed_steps: list[int] = field(default_factory=list)   # keep_going: every failing step
    compared: dict[int, str] = field(default_factory=dict)  # step -> snapshot | checkpoint
    windows: list[dict] = field(default_factory=list)       # replayed: start, end, from, points
    header: str = ""
    notes: list[str] = field(default_factory=list)
    reports: list[StepReport] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        """A JSON-safe dict (non-finite floats as strings); the per-step reports as ``steps``."""
        d = asdict(self)
        d["steps"] = d.pop("reports")
        return _json_safe(d)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class _Failed(Exception):
    def __init__(self, step: int, message: str, failure: dict):
        super().__init__(message)
        self.step, self.message, self.failure = step, message, failure


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
