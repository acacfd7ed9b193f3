"""VerifyOptions: what ``recover-hsdp verify`` can be asked, in one object (docs/verify.md).

``verify_run(run_dir, VerifyOptions(anchor=False))`` or, the same,
``verify_run(run_dir, anchor=False)``; the defaults are the command line's. No torch here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from recover_hsdp.verify.tolerance import (DEFAULT_C, DEFAULT_C_RMS, DEFAULT_REL_FLOOR,
                                           Tolerance)


@dataclass(frozen=True)
class VerifyOptions:
    """How a run is verified.

    atol / rms_atol: fixed element / per-flat-parameter RMS tolerances instead of the derived
    ones (c, c_rms; ``tolerance.py``); rtol: a relative term on top; rel_floor: the floor of the
    relative difference reported. device: where the replay runs (a run trained on CUDA needs
    ``cuda``). until: replay steps 0..until only. records_only: the record checks alone, no
    replay. anchor (default): after each snapshot that passes, continue the replay from the run's
    saved parameters (the optimizer state stays the replay's) and restart the tolerance window,
    so honest fp32 divergence is never amplified by the training dynamics over more than one
    snapshot interval (docs/verify.md, "Anchoring"); anchor=False replays the whole run from
    the initial parameters alone. all_copies=False: compare only the lowest replica's copy of
    each shard (large runs). envelope=K: also replay a twin in the HSDP summation order (S row
    slices per microbatch, per-replica partial sums, reverse replica order) and widen each
    tolerance to K times the twin-vs-replay difference: an empirical envelope of honest
    divergence (twice the compute). strict: the per-coordinate check (verify/strict.py), with
    its constant c_strict (None: the default, or the nondeterministic device's). keep_going: a
    step whose parameters fail is listed (failed_steps), the replay re-anchors at the run's
    parameters and goes on; the verdict names the first and counts them all. steps ("A:B":
    steps A..B-1, "A:" to the end) / sample (K windows between kept anchors, chosen with seed):
    replay only those windows, each from the nearest start (the init or a DCP checkpoint,
    parameters and optimizer state); checkpoints=False: ignore checkpoints/ (snapshots only;
    verify/windows.py, docs/verify.md "Verify at scale").
    """

    atol: Optional[float] = None
    rtol: float = 0.0
    c: float = DEFAULT_C
    c_rms: float = DEFAULT_C_RMS
    rms_atol: Optional[float] = None
    rel_floor: float = DEFAULT_REL_FLOOR
    device: str = "cpu"
    until: Optional[int] = None
    records_only: bool = False
    anchor: bool = True
    all_copies: bool = True
    envelope: Optional[float] = None
    strict: bool = True
    c_strict: Optional[float] = None
    keep_going: bool = False
    steps: Optional[str] = None
    sample: Optional[int] = None
    seed: int = 0
    checkpoints: bool = True

    def tolerance(self) -> Tolerance:
        """A fresh tolerance of these constants (it keeps a window's state as the replay runs)."""
        return Tolerance(c=self.c, c_rms=self.c_rms, atol=self.atol, rms_atol=self.rms_atol,
                         rtol=self.rtol)

    def replace(self, **changes) -> "VerifyOptions":
        """These options with some changed; an unknown name is a TypeError naming it."""
        return dataclasses.replace(self, **changes)
