"""Replaying a bf16 mixed-precision run (parallel.mixed_precision=bf16; docs/verify.md, "bf16").

The run's recipe (hsdp/wrapping.py: bf16_mixed_precision): FSDP casts the fp32 master parameters
to bf16, runs forward and backward in bf16 (buffers keep their dtype), casts each rank's bf16
gradient to fp32 for the reduce-scatter, accumulates fp32 shards, reduces them across replicas in
fp32, and steps the fp32 master weights. The replay does the same arithmetic in one process: a
SHADOW copy of the model whose parameters are the bf16 rounding of the replay's fp32 parameters
computes each microbatch's gradient in bf16; that gradient is cast to fp32 and accumulated, and
the fp32 optimizer steps the fp32 parameters. What differs from the run is what differs in fp32
(summation order) plus, for S > 1, the bf16 rounding of S row-slice gradients instead of one
whole-microbatch gradient: per coordinate ``|dg| <~ S * eps_bf16 * sum_i |g_i| / B``. The strict
check therefore uses ``eps_bf16 = 2^-8`` for the gradient term (STRICT_EPS) when S > 1.
"""
from __future__ import annotations

import copy

BF16_EPS = 2.0 ** -8


class Bf16Shadow:
    """bf16 gradients of the fp32 ``model``'s parameters, FSDP MixedPrecision style."""

    def __init__(self, model, params):
        import torch

        self.torch = torch
        self.model = model
        self.params = list(params)
        self.shadow = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        by_name = dict(self.shadow.named_parameters())
        self.shadow_params = [by_name[names[id(p)]] for p in self.params]
        for p in self.shadow_params:
            p.data = p.data.to(torch.bfloat16)

    def sync(self) -> None:
        """Round the replay's current fp32 parameters into the shadow (once per step)."""
        with self.torch.no_grad():
            for sp, p in zip(self.shadow_params, self.params):
                sp.data.copy_(p.data)           # fp32 -> bf16, round to nearest even

    def grads(self, x, y, loss_fn) -> list:
        """fp32 copies of the bf16 gradients of ``loss_fn(shadow(x), y)``."""
        torch = self.torch
        loss = loss_fn(self.shadow(x), y)
        gs = torch.autograd.grad(loss, self.shadow_params, allow_unused=True)
        return [None if g is None else g.float() for g in gs]


#: strict gradient bound of a bf16 run at S > 1: C_BF16 * eps_bf16 * sum_i |g_i| / B per
#: coordinate (the S row slices are computed in bf16 apart: |dg| measured <= 164 eps_bf16
#: sum_i |g_i| / B on the small chaos model, x ~6; docs/verify.md)
C_BF16 = 1024.0


def strict_c(c: float, shard_size: int) -> float:
    """The strict check's C (it multiplies eps32) for a bf16 run: unchanged at S = 1 (the run's
    and the replay's bf16 gradients are the same computation), C_BF16 * eps_bf16 / eps32 above."""
    from recover_hsdp.verify.strict import FP32_EPS

    return c if shard_size == 1 else max(c, C_BF16 * BF16_EPS / FP32_EPS)


def setup(meta, model, params, note):
    """A Bf16Shadow for a bf16 run (meta.mixed_precision), else None."""
    mp = (meta or {}).get("mixed_precision")
    if mp != "bf16":
        return None
    note("bf16 mixed-precision run: each microbatch's gradient is replayed in bf16 from the "
         "bf16 rounding of the fp32 parameters (verify/bf16.py); fp32 reduction and optimizer")
    return Bf16Shadow(model, params)
