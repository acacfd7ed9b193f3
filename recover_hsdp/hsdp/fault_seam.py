"""The torch side of the test-only fault seam (recover_hsdp/faults/seam.py says what and why).

`RunFaults.from_env()` is None unless the seam is set AND allowed; the manager's step hooks
(hsdp/step_hooks.py) then call `contribute`, `after_microbatch`, `before_reduce` and `divisor` at
the four points a fault can enter.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from recover_hsdp.faults.seam import (ENV_NONDET, TestFault, from_env, nondet_probability,
                                      wrong_divisor)

#: mantissa bits by dtype: one ulp of x is 2 ** (floor(log2 |x|) - bits)
_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def jitter_ulp(g: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """``g`` with each nonzero element moved one ulp of its dtype up (probability p) or down
    (probability p), else left: the result of an atomic sum in another order."""
    bits = _MANTISSA.get(g.dtype)
    if bits is None or g.numel() == 0:
        return g
    u = torch.rand(g.shape, generator=gen, device="cpu").to(g.device)
    step = torch.where(u < p, 1.0, torch.where(u > 1.0 - p, -1.0, 0.0))
    x = g.double()
    ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-300))) - bits)
    return torch.where(g == 0, x, x + step * ulp).to(g.dtype)


class _Nondeterministic(torch.autograd.Function):
    """Identity forward on (q, k, v); the backward jitters the gradients SDPA produced."""

    p = 0.0
    gen: Optional[torch.Generator] = None

    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        c = _Nondeterministic
        return tuple(None if g is None else jitter_ulp(g, c.p, c.gen) for g in (gq, gk, gv))


def install_nondeterminism(p: Optional[float] = None) -> float:
    """RECOVER_HSDP_TEST_NONDET (seam.py): the model's attention backward becomes
    nondeterministic in this process; returns the probability (0.0: not installed)."""
    import os

    from recover_hsdp.model import llama

    p = nondet_probability() if p is None else float(p)
    if not p or getattr(llama.attention_fn, "_nondeterministic", False):
        return p
    _Nondeterministic.p = p
    _Nondeterministic.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
    kernel = llama.attention_fn

    def noisy(q, k, v, **kw):
        return kernel(*_Nondeterministic.apply(q, k, v), **kw)

    noisy._nondeterministic = True
    llama.attention_fn = noisy
    print(f"recover-hsdp: TEST SEAM {ENV_NONDET}={p}: the attention backward is "
          f"nondeterministic in this rank", file=sys.stderr, flush=True)
    return p


class RunFaults:
    def __init__(self, faults: list[TestFault]):
        self.faults = list(faults)
        self._prev: Optional[torch.Tensor] = None   # stale_bucket: last step's local bucket 0
        self.fired: list[tuple[str, int]] = []

    @classmethod
    def from_env(cls) -> Optional["RunFaults"]:
        faults = from_env()
        if not faults:
            return None
        print(f"recover-hsdp: TEST FAULT SEAM ACTIVE: {faults} (this run commits wrong steps)",
              file=sys.stderr, flush=True)
        return cls(faults)

    def _get(self, kind: str, step: int, replica: int) -> Optional[TestFault]:
        for f in self.faults:
            if f.kind == kind and f.step == step and f.replica == replica:
                return f
        return None

    def _first_kept(self, mgr, m: int) -> bool:
        return all(not mgr.policy.keeps(mgr.replica, k) for k in range(m))

    def contribute(self, mgr, step: int, m: int, keep: bool) -> bool:
        """drop_mb: the replica's first kept microbatch runs but is left out of the sum."""
        if keep and self._get("drop_mb", step, mgr.replica) and self._first_kept(mgr, m):
            self.fired.append(("drop_mb", step))
            return False
        return keep

    def after_microbatch(self, mgr, step: int, m: int, keep: bool, mb_id: int) -> None:
        """double_mb: train the same id again; extra_mb: train an unrecorded id of the slice."""
        if not keep or not self._first_kept(mgr, m):
            return
        if self._get("double_mb", step, mgr.replica):
            extra = mb_id
        elif self._get("extra_mb", step, mgr.replica):
            extra = mgr.data.microbatch_id(mgr.replica, mgr.policy.steps())  # next step's first
        else:
            return
        self.fired.append(("double_mb" if extra == mb_id else "extra_mb", step))
        x, y = mgr.microbatch_fn(mgr.replica, extra)
        x, y = mgr.local_rows(x).to(mgr.device), mgr.local_rows(y).to(mgr.device)
        mgr.acc.microbatch(lambda: mgr.loss_fn(mgr.module, x, y) / mgr.S, contribute=True)

    def before_reduce(self, mgr, step: int, buckets: list) -> None:
        """stale_bucket: bucket 0's local shard becomes the previous step's (then reduced)."""
        if not buckets:
            return
        if self._get("stale_bucket", step, mgr.replica) and self._prev is not None:
            self.fired.append(("stale_bucket", step))
            with torch.no_grad():
                buckets[0].copy_(self._prev)
        if self._get("stale_bucket", step + 1, mgr.replica):
            self._prev = buckets[0].detach().clone()

    def divisor(self, mgr, step: int, divisor: int) -> int:
        """live_divisor / divisor_plus1 / divisor_minus1 (from their step on, every rank): the
        divisor the reduced gradient is divided by; the step's record keeps ``divisor``."""
        d = wrong_divisor(self.faults, step, divisor, len(mgr.policy.alive), mgr.policy.g_init)
        if d != divisor:
            self.fired.append(("divisor", step))
            if not any(k == "divisor" for k, _ in self.fired[:-1]):
                print(f"recover-hsdp: TEST FAULT SEAM: step {step}: the gradient is divided by "
                      f"{d}, not {divisor} (recorded: {divisor})", file=sys.stderr, flush=True)
        return d
