"""The strict per-coordinate check: a float64 optimizer step with a DERIVED error bound.

The default tolerance (``tolerance.py``) is one number per step for all coordinates, calibrated
on AdamW, whose update hides a gradient's scale; under SGD it is orders of magnitude too loose
(an extra microbatch out of B moves the parameters by lr * |g_j| / B, far below 0.1 lr). The
strict check instead bounds every coordinate on its own, for one step at a time (it needs the
run's parameters before the step: a snapshot of the previous step, or the init):

* gradient: the run and the replay sum the same per-microbatch gradients in different fp32 orders
  (and split each microbatch into S row slices), so per coordinate
  ``|g_run - g_replay| <= delta = C_STRICT * eps32 * sum_i |g_i| / divisor`` (+ a 1e-30 floor),
  where ``sum_i |g_i|`` is accumulated by the replay microbatch by microbatch;
* optimizer state: the run's AdamW moments differ from the replay's by at most
  ``dm_t = b1 dm_{t-1} + (1 - b1) delta_t + eps32 |m_t|`` and
  ``dv_t = b2 dv_{t-1} + (1 - b2) (2 |g| delta_t + delta_t^2) + eps32 v_t``;
* the step: the expected parameters are computed in float64 from the run's previous parameters;
  the bound is the largest change of the update over the box [m +- dm] x [v +- dv] (the update
  is monotone in each), times the step size, plus the fp32 rounding of the run's own step
  (``2 eps32 (|p_new| + |step|)``). SGD: ``lr * delta`` plus the same rounding.

A step fails when some coordinate differs by more than its bound; the report gives the largest
ratio |diff| / bound and where. An honest run stays below 1 by the calibration's margin
(docs/verify.md, "Strict check"); a wrong gradient of one microbatch out of B is ~1/(C eps32 B)
times its bound in a typical coordinate, far more in a coordinate only that microbatch touches.

The gradient's norm (``gradient_norm`` / ``check_grad_norm``): the run records the global norm of
the gradient it DIVIDED (step records' ``local.grad_norm``, before clipping); the replay's is
``||sum_i g_i|| / divisor`` with the recorded divisor. Both norms come from gradients that differ
per coordinate by at most ``delta`` above, so ``| |g_run| - |g_replay| | <= ||delta||_2``, plus
the fp32 rounding of the replay's division (``4 eps32 |g|``). The parameters alone cannot tell a
wrong divisor under AdamW: its update ``m / (sqrt(v) + eps)`` is invariant under a gradient's
scale up to eps, exactly so at its first step and from then on when the scale is constant (a run
that divides by B + 1 from step 0 differs from the replay at step 0 by 1.7x the strict bound, at
steps 1-2 by 0.7x: it would pass). The norm sees the scale directly: dividing by B +- 1 moves it by
1/(B +- 1): ~1e3 x ``||delta||`` at B = 4 (docs/verify.md, "Wrong divisors"); the margin
shrinks as 1/B (``||delta|| / |g|`` ~ 1e-4 x ``||sum_i |g_i||| / |sum_i g_i|``).
"""
from __future__ import annotations

import math

FP32_EPS = 2.0 ** -23
#: honest |dg| / (eps32 * sum|g_i| / B) measured <= ~150 (docs/verify.md); x ~7
C_STRICT = 1024.0

# A NONDETERMINISTIC bf16 run (meta.deterministic false: CUDA's SDPA backward adds atomically;
# on CPU the test seam RECOVER_HSDP_TEST_NONDET): the run's bf16 gradients differ from the
# replay's by bf16 ulps, not fp32 roundings, and through the backward a few coordinates feel many
# of them. The bound's basis becomes eps_bf16 (2^-8) and the verdict a FRACTION: a step fails
# when more than ND_MAX_FRACTION of the coordinates exceed C_STRICT_ND x their bound. Measured
# (docs/verify.md, "Nondeterministic devices"; one ulp up or down on half the elements of dq, dk
# and dv, llama_debug, W=2 G=2, S=1 and 2): honest steps <= 2e-4 of the coordinates over the
# bound, each of the four seam faults >= 1.3e-2.
BF16_EPS = 2.0 ** -8
C_STRICT_ND = 8.0
ND_MAX_FRACTION = 2e-3


class StrictCheck:
    """Float64 shadow of the optimizer with per-coordinate bounds (one instance per replay)."""

    def __init__(self, params, names, optim_cfg, c: float = C_STRICT, *,
                 eps: float = FP32_EPS, max_fraction: float | None = None):
        import torch

        self.torch = torch
        self.params = list(params)
        self.names = list(names)
        self.c = float(c)
        self.eps_basis = float(eps)            # the gradient bound's unit: eps32, or eps_bf16
        self.max_fraction = max_fraction       # None: every coordinate within its bound
        self.last_fraction = 0.0               # of the last check(): coordinates over bound
        self.kind = str(getattr(optim_cfg, "name", "adamw") or "adamw")
        self.b1, self.b2 = (float(b) for b in optim_cfg.betas)
        self.eps = float(optim_cfg.eps)
        self.absacc = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
        self.state: dict[int, dict] = {}
        self.expected: list | None = None
        self.bound: list | None = None
        self.grad_norm: float | None = None         # the replay's |sum g_i / divisor| (a step)
        self.grad_norm_bound: float | None = None   # its derived bound |delta| + rounding

    def begin_step(self) -> None:
        for a in self.absacc:
            a.zero_()
        self.expected = self.bound = None
        self.grad_norm = self.grad_norm_bound = None

    def add_microbatch(self, grads) -> None:
        for a, g in zip(self.absacc, grads):
            if g is not None:
                a.add_(g.detach().double().abs())

    def gradient_norm(self, norm: float, divisor: int) -> None:
        """The replay's divided gradient's global norm (before clipping) and its bound (module
        docstring); call after the division, with the step's per-microbatch sums added."""
        d2 = sum(float(a.square().sum()) for a in self.absacc)
        delta = self.c * self.eps_basis * d2 ** 0.5 / float(divisor)
        self.grad_norm = float(norm)
        self.grad_norm_bound = delta + 4 * FP32_EPS * float(norm) + 1e-30

    def check_grad_norm(self, recorded) -> float | None:
        """|recorded - replay| / bound for the run's recorded norm of its divided gradient; None
        when there is nothing to compare (no record of it, a non-finite step, no replay norm)."""
        if recorded is None or self.grad_norm is None or not math.isfinite(self.grad_norm):
            return None
        try:
            rec = float(recorded)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(rec):
            return None
        return abs(rec - self.grad_norm) / self.grad_norm_bound

    def prepare(self, optimizer, divisor: int) -> None:
        """Before ``optimizer.step()`` (grads already divided): the expected float64 parameters
        and their bounds after this step, from the current (run's) parameters."""
        torch = self.torch
        group_of = {}
        for grp in optimizer.param_groups:
            for p in grp["params"]:
                group_of[id(p)] = (float(grp["lr"]), float(grp.get("weight_decay", 0.0)))
        exp, bnd = [], []
        e32 = FP32_EPS
        for k, p in enumerate(self.params):
            p0 = p.detach().double()
            if p.grad is None:
                exp.append(p0)
                bnd.append(torch.full_like(p0, 0.0) + 2 * e32 * p0.abs())
                continue
            lr, wd = group_of[id(p)]
            g = p.grad.detach().double()
            delta = self.c * self.eps_basis * self.absacc[k] / float(divisor) + 1e-30
            if self.kind == "sgd":
                d = g + wd * p0
                new = p0 - lr * d
                b = lr * delta + 2 * e32 * (new.abs() + lr * d.abs()) + lr * wd * e32 * p0.abs()
            else:
                st = self.state.setdefault(k, {"t": 0, "m": torch.zeros_like(p0),
                                               "v": torch.zeros_like(p0),
                                               "dm": torch.zeros_like(p0),
                                               "dv": torch.zeros_like(p0)})
                st["t"] += 1
                t = st["t"]
                m = st["m"].mul_(self.b1).add_(g, alpha=1 - self.b1)
                v = st["v"].mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
                dm = st["dm"].mul_(self.b1).add_((1 - self.b1) * delta + e32 * m.abs())
                dv = st["dv"].mul_(self.b2).add_((1 - self.b2) * (2 * g.abs() * delta + delta * delta)
                                                 + e32 * v)
                bc1 = 1 - self.b1 ** t
                bc2s = math.sqrt(1 - self.b2 ** t)
                step_size = lr / bc1
                den = v.sqrt() / bc2s + self.eps
                u = m / den
                den_lo = (v - dv).clamp_min(0).sqrt() / bc2s + self.eps
                den_hi = (v + dv).sqrt() / bc2s + self.eps
                du = torch.zeros_like(u)
                for mm in (m - dm, m + dm):
                    for dd in (den_lo, den_hi):
                        du = torch.maximum(du, (mm / dd - u).abs())
                decayed = p0 * (1 - lr * wd)
                new = decayed - step_size * u
                b = (step_size * du + 2 * e32 * (new.abs() + step_size * u.abs())
                     + e32 * lr * wd * p0.abs())
            exp.append(new)
            bnd.append(b + 1e-30)
        self.expected, self.bound = exp, bnd

    def check(self, run_params: dict) -> tuple[float, str | None, float]:
        """(max |diff| / bound, where, that |diff|) of the run's parameters (fqn -> tensor)."""
        torch = self.torch
        worst, where, wdiff = 0.0, None, 0.0
        over = total = 0
        for name, e, b in zip(self.names, self.expected, self.bound):
            got = run_params[name].double()
            diff = (got - e).abs()
            ratio = (diff / b).nan_to_num(math.inf, math.inf, math.inf)
            over += int((ratio > 1.0).sum())
            total += ratio.numel()
            k = int(ratio.argmax())
            r = float(ratio.reshape(-1)[k])
            if r > worst or where is None:
                idx = []
                kk = k
                for dim in reversed(tuple(e.shape)):
                    idx.append(kk % dim)
                    kk //= dim
                worst, where = r, f"{name}[{','.join(map(str, reversed(idx)))}]"
                wdiff = float(diff.reshape(-1)[k])
        self.last_fraction = over / max(total, 1)
        return worst, where, wdiff

    def fails(self, ratio: float) -> bool:
        """The verdict of the last check() (its max ratio): over 1, or over the fraction."""
        if self.max_fraction is None:
            return ratio > 1.0
        return self.last_fraction > self.max_fraction
