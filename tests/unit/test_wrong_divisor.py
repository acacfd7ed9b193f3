"""The fault seam's wrong-divisor kinds (faults/seam.py) and the verifier's gradient-norm check
that catches them where AdamW's parameters cannot (verify/strict.py)."""
from __future__ import annotations

import types

import pytest
import torch

from recover_hsdp.faults import seam

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_divisor_kinds_parse_and_apply_from_their_step_on():
    env = {seam.ENV_FAULT: "divisor_plus1@2, divisor_minus1@4,live_divisor@6", seam.ENV_ALLOW: "1"}
    faults = seam.from_env(env)
    assert [f.kind for f in faults] == ["divisor_plus1", "divisor_minus1", "live_divisor"]
    # B = 8 = 4 x 2; 3 replicas alive from step 5 on
    got = [seam.wrong_divisor(faults, s, 8, 4 if s < 5 else 3, 2) for s in range(8)]
    assert got == [8, 8, 9, 9, 7, 7, 6, 6]        # the latest started kind decides
    live = seam.parse("live_divisor@0")
    assert seam.wrong_divisor(live, 3, 8, 4, 2) == 8   # no replica lost: live W x G == B
    assert seam.wrong_divisor(seam.parse("divisor_minus1@0"), 0, 1, 1, 1) == 1   # never 0
    assert seam.wrong_divisor(seam.parse("extra_mb@0"), 0, 8, 4, 2) == 8   # not a divisor kind


def test_divisor_kinds_take_no_replica_and_are_refused_unless_allowed():
    why = seam.refusal({seam.ENV_FAULT: "divisor_plus1@2:1", seam.ENV_ALLOW: "1"})
    assert why and "applies on every rank" in why and "\n" not in why
    assert "test-only" in seam.refusal({seam.ENV_FAULT: "live_divisor@1"})


def test_step_hooks_divisor_is_the_policys_without_the_seam():
    from recover_hsdp.hsdp.fault_seam import RunFaults
    from recover_hsdp.hsdp.step_hooks import StepHooks

    mgr = types.SimpleNamespace(policy=types.SimpleNamespace(alive=(0, 2), g_init=3))
    hooks = StepHooks(mgr)
    assert hooks.divisor(5, 12) == 12
    hooks.seam = RunFaults(seam.parse("live_divisor@5"))
    assert hooks.divisor(4, 12) == 12 and hooks.divisor(5, 12) == 6
    assert hooks.seam.fired == [("divisor", 5)]


def _strict(grads_per_mb, divisor):
    """A StrictCheck over one parameter fed these per-microbatch gradients, with the replay's
    divided gradient's norm noted (as verify/step.py does)."""
    from recover_hsdp.verify.strict import StrictCheck

    p = torch.nn.Parameter(torch.zeros(grads_per_mb[0].shape))
    chk = StrictCheck([p], ["w"], types.SimpleNamespace(name="sgd", betas=(0.9, 0.95), eps=1e-8))
    chk.begin_step()
    for g in grads_per_mb:
        chk.add_microbatch([g])
    total = torch.stack(grads_per_mb).sum(0) / divisor
    chk.gradient_norm(float(total.double().norm()), divisor)
    return chk, float(torch.stack(grads_per_mb).sum(0).double().norm())


def test_grad_norm_check_rejects_a_wrong_divisor_and_passes_fp32_noise():
    gen = torch.Generator().manual_seed(0)
    B = 4
    gs = [torch.randn(1000, generator=gen) for _ in range(B)]
    chk, raw = _strict(gs, B)
    # honest: the run summed the same gradients in another fp32 order
    run = (gs[3] + gs[2]) + (gs[1] + gs[0])
    assert chk.check_grad_norm(float(run.double().norm() / B)) < 0.01
    for wrong in (B + 1, B - 1, 2):       # B +- 1, the live W x G after a loss
        assert chk.check_grad_norm(raw / wrong) > 100
    assert chk.check_grad_norm(None) is None and chk.check_grad_norm(float("inf")) is None
    chk.begin_step()
    assert chk.check_grad_norm(raw / B) is None      # no replay norm for this step yet
