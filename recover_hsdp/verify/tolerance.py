"""The default comparison tolerances, justified by fp32 reduction order (docs/verify.md).

The run and the replay compute the same step gradient (sum over the recorded microbatches /
divisor) in a different fp32 summation order: per shard rank, FSDP's reduce-scatter over S ranks,
per-replica accumulation and the cross-replica MPI sum, vs one process accumulating microbatch
after microbatch. The two gradients differ by a few fp32 roundings of the summed terms,
|dg| ~ eps32 * sum_i |g_i| per coordinate. AdamW maps a gradient to an update
lr * m/(sqrt(v)+eps): a ratio, bounded by ~lr, insensitive to a small RELATIVE change of g; only
coordinates with |g| ~ eps (1e-8) feel the absolute error, d(update) <~ lr * |dg| / eps. So the
replayed parameters differ from the run's by a small fraction of lr per step, in a handful of
coordinates, and barely at all in the bulk. Two statistics, both scaled by the learning rate:

    element:  max |diff|                  <= C_MAX * sqrt(sum_{s in window} lr_s^2) + floor
    bulk:     RMS |diff| per flat param   <= C_RMS * sqrt(sum_{s in window} lr_s^2) + floor

The window is every replayed step (or, with anchoring, the steps since the last snapshot the
replay was re-synchronised to). ``floor`` = a few fp32 ulps of the largest parameter (one rounding
of p - update). C_MAX and C_RMS are calibrated on synthetic runs trained in the HSDP summation
order (``python -m experiments.verify_calibrate`` in a checkout): the largest honest ratio times
a safety factor. A wrong gradient (a bucket re-reduced on top of its reduced sum, a microbatch
swapped or counted twice) moves a whole flat parameter by O(0.1 lr) RMS in one step: two to three
orders of magnitude above the honest bulk, which is why the bulk statistic is the sharp one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

FP32_EPS = 2.0 ** -23

#: Element tolerance constant (docs/verify.md "Tolerance": honest max <= 0.012 measured; x ~8).
DEFAULT_C = 0.1
#: Bulk (per-flat-parameter RMS) tolerance constant (honest max <= 1.2e-4 measured; x ~8).
DEFAULT_C_RMS = 1e-3

#: Relative differences are reported as |diff| / max(|expected|, REL_FLOOR).
DEFAULT_REL_FLOOR = 1e-3


def ulp_floor(max_abs_param: float, ulps: float = 4.0) -> float:
    """A few fp32 ulps of the largest parameter magnitude (>= those of 1.0)."""
    return ulps * FP32_EPS * max(1.0, float(max_abs_param))


class Tolerance:
    """Element and bulk tolerances over a window of replayed steps (see the module docstring).

    ``atol`` / ``rms_atol`` replace the derived element / bulk tolerance by a fixed value;
    ``rtol`` adds ``rtol * |expected|`` to the element tolerance.
    """

    def __init__(self, c: float = DEFAULT_C, c_rms: float = DEFAULT_C_RMS, floor: float = 0.0,
                 atol: float | None = None, rms_atol: float | None = None, rtol: float = 0.0):
        for name, v in (("c", c), ("c_rms", c_rms), ("floor", floor), ("atol", atol),
                        ("rms_atol", rms_atol), ("rtol", rtol)):
            if v is not None and not v >= 0:
                raise ValueError(f"tolerance {name}={v!r} must be >= 0")
        self.c, self.c_rms, self.floor = float(c), float(c_rms), float(floor)
        self.atol, self.rms_atol, self.rtol = atol, rms_atol, float(rtol)
        self._lr2 = 0.0

    def add_step(self, lr: float) -> None:
        self._lr2 += float(lr) ** 2

    def reset_window(self) -> None:
        """The replay was re-synchronised to the run's parameters: errors start from zero."""
        self._lr2 = 0.0

    @property
    def scale(self) -> float:
        return math.sqrt(self._lr2)

    @property
    def element(self) -> float:
        return float(self.atol) if self.atol is not None else self.c * self.scale + self.floor

    @property
    def bulk(self) -> float:
        return (float(self.rms_atol) if self.rms_atol is not None
                else self.c_rms * self.scale + self.floor)

    def describe(self) -> str:
        el = (f"atol={self.atol:.3g}" if self.atol is not None
              else f"{self.c:g}*sqrt(sum lr^2)+{self.floor:.2g}")
        if self.rtol:
            el += f"+{self.rtol:g}*|expected|"
        bulk = (f"{self.rms_atol:.3g}" if self.rms_atol is not None
                else f"{self.c_rms:g}*sqrt(sum lr^2)+{self.floor:.2g}")
        return f"element {el}; per-flat-param RMS {bulk}"


def tol_schedule(lrs: Iterable[float], c: float = DEFAULT_C, floor: float = 0.0) -> list[float]:
    """Element tolerance after each step of a window with learning rates ``lrs``."""
    tol = Tolerance(c=c, floor=floor)
    out = []
    for lr in lrs:
        tol.add_step(lr)
        out.append(tol.element)
    return out


#: A nondeterministic bf16 run (below): the element and bulk tolerances widened by this factor.
#: Measured with one bf16 ulp up or down on half the elements of dq, dk and dv (the test seam
#: RECOVER_HSDP_TEST_NONDET=0.5), honest AdamW steps reached 20x the fp32 element tolerance and
#: 57x the bulk one at step 0 (Adam's first update is the gradient's sign); x ~5. Both lose their
#: power there: the strict check's fraction (verify/strict.py) is the judge of such a run.
ND_WIDEN = 300.0


def run_is_nondeterministic(meta) -> bool:
    """meta.deterministic false; an older record without it: a CUDA run is."""
    meta = meta or {}
    det = meta.get("deterministic")
    if det is None:
        return str(meta.get("device") or "cpu").split(":")[0] == "cuda"
    return det is False


def nondeterministic_profile(meta, tol: Tolerance, note) -> dict | None:
    """The strict check's settings for a nondeterministic bf16 run (and ``tol`` widened by
    ND_WIDEN); None for a deterministic run, and for an fp32 one, whose one-ulp fp32 noise stays
    within the fp32 tolerances (docs/verify.md, "Nondeterministic devices")."""
    if not run_is_nondeterministic(meta):
        return None
    if (meta or {}).get("mixed_precision") != "bf16":
        note("nondeterministic run (meta.deterministic=false), fp32: its one-ulp fp32 noise is "
             "within the fp32 tolerances (docs/verify.md, \"Nondeterministic devices\")")
        return None
    from recover_hsdp.verify.strict import BF16_EPS, C_STRICT_ND, ND_MAX_FRACTION

    tol.c *= ND_WIDEN
    tol.c_rms *= ND_WIDEN
    note(f"nondeterministic bf16 run (meta.deterministic=false: CUDA's attention backward adds "
         f"atomically): element and RMS tolerances x{ND_WIDEN:g}; the strict check bounds each "
         f"coordinate by {C_STRICT_ND:g} eps_bf16 sum|g_i|/B and fails a step when more than "
         f"{ND_MAX_FRACTION:.1%} of the coordinates exceed it")
    return {"eps": BF16_EPS, "c_strict": C_STRICT_ND, "max_fraction": ND_MAX_FRACTION}
