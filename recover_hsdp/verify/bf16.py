"""Replaying a bf16 mixed-precision run (parallel.mixed_precision=bf16; docs/verify.md, "bf16").

The run's recipe (hsdp/wrapping.py: bf16_mixed_precision): FSDP casts the fp32 master parameters
to bf16, runs forward and backward in bf16 (buffers keep their dtype), casts each rank's bf16
gradient to fp32 for the reduce-scatter, accumulates fp32 shards, reduces them across replicas in
fp32, and steps the fp32 master weights. The replay does the same arithmetic in one process: a
SHADOW copy of the model whose parameters are the bf16 rounding of the replay's fp32 parameters
computes each microbatch's gradient in bf16 AS THE RUN'S S RANKS DO: S row slices of mbs rows,
each loss the slice's mean / S (the manager's scaling), each slice's bf16 gradient cast to fp32 and
added (the reduce-scatter's fp32 sum). The fp32 gradients are accumulated and the fp32 optimizer
steps the fp32 parameters. What is left to differ is fp32 summation order, as for an fp32 run, so
the fp32 tolerances and the strict bound apply unchanged (measured: docs/verify.md, "bf16").
Without the row slices (one bf16 gradient per S*mbs-row microbatch) the per-coordinate gradient
difference at S=2 was up to 164 eps_bf16 sum_i |g_i| / B: a vacuous bound.
"""
from __future__ import annotations

import copy

BF16_EPS = 2.0 ** -8


class Bf16Shadow:
    """bf16 gradients of the fp32 ``model``'s parameters, FSDP MixedPrecision style."""

    def __init__(self, model, params, shard_size: int = 1, mbs: int | None = None):
        import torch

        self.torch = torch
        self.model = model
        self.params = list(params)
        self.S, self.mbs = int(shard_size), mbs
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
        """fp32 sum over the S row slices of the bf16 gradients of ``loss_fn(shadow(x_j), y_j)
        / S`` (``loss_fn`` the per-rank mean, as the manager's loss_fn)."""
        torch = self.torch
        mbs = self.mbs or x.shape[0] // self.S
        out = None
        for j in range(self.S):
            rows = slice(j * mbs, (j + 1) * mbs)
            loss = loss_fn(self.shadow(x[rows]), y[rows]) / self.S
            gs = torch.autograd.grad(loss, self.shadow_params, allow_unused=True)
            gs = [None if g is None else g.float() for g in gs]
            out = gs if out is None else [a if g is None else (g if a is None else a.add_(g))
                                          for a, g in zip(out, gs)]
        return out

def setup(meta, model, params, note, shard_size: int = 1, mbs: int | None = None):
    """A Bf16Shadow for a bf16 run (meta.mixed_precision), else None."""
    mp = (meta or {}).get("mixed_precision")
    if mp != "bf16":
        return None
    note("bf16 mixed-precision run: each microbatch's gradient is replayed in bf16 from the "
         "bf16 rounding of the fp32 parameters, as S row slices like the run's ranks "
         "(verify/bf16.py); fp32 reduction and optimizer")
    return Bf16Shadow(model, params, shard_size, mbs)
