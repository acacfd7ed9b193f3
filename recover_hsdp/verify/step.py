"""One replayed step of ``verify_run`` (verify/replay.py): the recorded microbatches' gradient
sum / divisor and the optimizer step, as the run applied them; the envelope twin's HSDP summation
order; the replay-vs-twin difference (``--envelope``)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from recover_hsdp.verify.spec import VerifyInputError


class _Arm(NamedTuple):
    """One replayed model: the replay, or the envelope's HSDP-order twin."""
    model: Any
    optimizer: Any
    params: list


class _Replay(NamedTuple):
    """What every replayed step reads: the run's spec, its microbatch sources (replica ->
    source), the device, and the lr schedule (optim.lr_at, optim.set_lr)."""
    spec: Any
    source: Callable[[int], Any]
    dev: Any
    lr_at: Callable
    set_lr: Callable


def _replay_step(arm: _Arm, replay: _Replay, rec, step: int, *, hsdp_order: bool = False,
                 strict=None, bf16=None) -> None:
    """One committed step: sum of the recorded microbatches' gradients / divisor, AdamW step.

    Replay order: replica-ascending, id order, each microbatch's S*mbs rows at once, accumulated
    in ``.grad``. ``hsdp_order`` (the envelope twin): each microbatch as S row slices of mbs
    rows, summed per replica, the replicas' partial sums added in reverse order (as the run)."""
    import torch

    model, optimizer, params = arm
    spec, source, dev, lr_at, set_lr = replay

    from recover_hsdp.model import next_token_loss
    from recover_hsdp.optim import clip_grads_

    def get(r, mb_id):
        try:
            x, y = source(r).get(mb_id)
        except VerifyInputError:
            raise
        except Exception as e:  # noqa: BLE001
            raise VerifyInputError(f"step {step}: microbatch {mb_id} (replica {r}): "
                                   f"{type(e).__name__}: {e}") from None
        return x.to(dev), y.to(dev)

    norm = spec.tokens_per_microbatch
    custom = getattr(spec, "custom", None)     # a custom loop's loss (verify/custom.py)

    def loss_of(m, x, y, slices: int = 1):
        """The replica microbatch's loss (slices=S: one of its S row slices, as a rank's)."""
        if custom is not None:
            return custom.loss(m, x, y) / slices
        return next_token_loss(m(x), y, tokens_per_microbatch=norm)
    optimizer.zero_grad(set_to_none=True)
    if strict is not None:
        strict.begin_step()
    with torch.enable_grad():
        if not hsdp_order and (strict is not None or bf16 is not None):
            # per-microbatch gradients (for sum |g_i|), accumulated in .grad as backward() does
            if bf16 is not None:
                bf16.sync()     # bf16 mixed precision: the bf16 shadow computes (verify/bf16.py)
            for r in sorted(rec.contributions):
                for mb_id in rec.contributions[r]:
                    x, y = get(r, mb_id)
                    if bf16 is not None:
                        gs = bf16.grads(x, y, lambda o, t: next_token_loss(
                            o, t, tokens_per_microbatch=spec.mbs * spec.seq_len))
                    else:
                        loss = loss_of(model, x, y)
                        gs = torch.autograd.grad(loss, params, allow_unused=True)
                    if strict is not None:
                        strict.add_microbatch(gs)
                    for p, g in zip(params, gs):
                        if g is not None:
                            if p.grad is None:
                                p.grad = g
                            else:
                                p.grad.add_(g)
        elif not hsdp_order:
            for r in sorted(rec.contributions):
                for mb_id in rec.contributions[r]:
                    x, y = get(r, mb_id)
                    loss_of(model, x, y).backward()
        else:
            total = [torch.zeros_like(p) for p in params]
            for r in sorted(rec.contributions, reverse=True):
                acc = [torch.zeros_like(p) for p in params]
                for mb_id in rec.contributions[r]:
                    x, y = get(r, mb_id)
                    mbs = spec.mbs or x.shape[0] // spec.shard_size
                    for j in range(spec.shard_size):
                        rows = slice(j * mbs, (j + 1) * mbs)
                        loss = loss_of(model, x[rows], y[rows], spec.shard_size)
                        for a, g in zip(acc, torch.autograd.grad(loss, params,
                                                                 allow_unused=True)):
                            if g is not None:
                                a.add_(g)
                for t, a in zip(total, acc):
                    t.add_(a)
            for p, t in zip(params, total):
                p.grad = t
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(rec.divisor)
        # optim.grad_clip and the non-finite skip, as the run applied them
        norm, nonfinite = clip_grads_([p.grad for p in params], spec.optim_at(step).clip)
    if strict is not None and not hsdp_order:
        strict.gradient_norm(norm, rec.divisor)   # before the optimizer: the divisor's trace
    set_lr(optimizer, float(lr_at(step, spec.optim_at(step))))
    if (rec.extra or {}).get("skipped") or nonfinite:
        if strict is not None:
            strict.expected = None  # no update to bound: the tolerance comparison judges it
        return  # the run committed this step without an optimizer update
    if strict is not None:
        strict.prepare(optimizer, rec.divisor)
    optimizer.step()


def _envelope(model, twin, layout) -> tuple[float, float]:
    """(max |diff|, max over flat params of RMS diff) between the replay and its twin."""
    a = dict(model.state_dict(keep_vars=True))
    b = dict(twin.state_dict(keep_vars=True))
    max_abs, max_rms = 0.0, 0.0
    for fl in layout:
        sq, n = 0.0, 0
        for slot in fl.params:
            d = (a[slot.fqn].detach().float() - b[slot.fqn].detach().float()).abs()
            if d.numel():
                max_abs = max(max_abs, float(d.max()))
                sq += float(d.double().square().sum())
                n += d.numel()
        if n:
            max_rms = max(max_rms, math.sqrt(sq / n))
    return max_abs, max_rms
