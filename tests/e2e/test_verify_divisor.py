"""verify rejects a REAL trainer that divides by the wrong number, at the first wrong step.

The fault seam's divisor kinds (recover_hsdp/faults/seam.py; RECOVER_HSDP_TEST_FAULT with
RECOVER_HSDP_ALLOW_TEST_FAULT=1) make EVERY rank divide the reduced gradient, from the named step
on, by the live ``len(alive) x G_init`` (``live_divisor``: a no-op until a replica is lost), by
B + 1 (``divisor_plus1``) or by B - 1 (``divisor_minus1``), while the step records keep the
configured B (``--records-only`` passes every run here). W=2 G=2 (B=4), S=1, fp32, parameters saved
every step, a real SIGKILL of replica 1 where the kind needs a loss.

* SGD (no momentum: stateless, each step judged from the run's own parameters) carries the three
  kinds in ONE run: replica 1 killed at step 1, B+1 from step 2, B-1 from step 3, live from step 4
  (W x G = 1 x 2 then): verify fails at step 2, and with --keep-going exactly at 2, 3, 4.
* AdamW (default betas: a wrong step contaminates the moments of every later one) needs one run per
  kind: ``live_divisor@0`` with the kill at step 2 (fails at 2, not before), ``divisor_plus1@0``
  (the scale-blind case: AdamW's update hides a CONSTANT gradient scale up to eps, so the
  parameters of steps 1-2 agree with the replay within the strict bound; the recorded gradient
  norm betrays it, verify/strict.py) and ``divisor_minus1@1``.

Each step is checked twice: the parameters (strict ratio) and the recorded norm of the divided
gradient against the replay's (grad_norm_ratio); the honest steps pass both far below 1.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from recover_hsdp.record import read_run
from recover_hsdp.verify import verify_run
from tests.e2e._launch import one_thread
from tests.e2e.test_hsdp_kills import K
from tests.e2e.test_verify_seam import _run as seam_run

pytestmark = [pytest.mark.mpi]

B = 4


def _run(tmp: Path, *, steps: int, optim: dict, faults: str, kills=()) -> Path:
    """W=2 S=1 G=2 under the seam, the record checked honest (test_verify_seam's run)."""
    return seam_run(tmp, S=1, steps=steps, optim=optim, faults=faults, kills=kills)


def _check(run_dir: Path, first_bad: int, steps: int, *, sgd: bool) -> None:
    """verify fails at ``first_bad`` (the first wrong step, as reported), and --keep-going at
    exactly the steps from it on; every wrong step's gradient norm is far over its bound."""
    recs = read_run(run_dir).steps
    assert all(r.divisor == B for r in recs.values()), {s: r.divisor for s, r in recs.items()}
    with one_thread():
        res = verify_run(run_dir)
        assert res.exit_code == 1 and res.failed_step == first_bad, res.message
        print(res.message)
        kg = verify_run(run_dir, keep_going=True)
    bad = list(range(first_bad, steps))
    assert kg.exit_code == 1 and kg.failed_steps == bad, (kg.failed_steps, kg.message)
    by_step = {r.step: r for r in kg.reports}
    for s in bad:
        assert by_step[s].grad_norm_ratio > 100, (s, by_step[s].grad_norm_ratio)
        if sgd:     # SGD's update is linear in the gradient: the parameters tell it as well
            assert by_step[s].strict_ratio > 100, (s, by_step[s].strict_ratio)
    for s in range(first_bad):
        r = by_step[s]
        assert r.ok and r.strict_ratio < 1 and r.grad_norm_ratio < 0.5, (s, r)


@pytest.mark.timeout(300)
def test_sgd_three_wrong_divisors_after_a_loss_each_rejected_at_its_step(tmp_path):
    run_dir = _run(tmp_path, steps=5, optim={"name": "sgd", "lr": 0.1},
                   faults="divisor_plus1@2,divisor_minus1@3,live_divisor@4",
                   kills=[K(1, 1, "reduce", bucket=0)])
    assert read_run(run_dir).steps[4].alive == [0]     # live W x G = 2 at step 4, not B = 4
    _check(run_dir, 2, 5, sgd=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("faults,kills,first_bad,steps", [
    # the live divisor equals B while both replicas live: wrong from the loss at step 2 on
    ("live_divisor@0", [K(2, 1, "reduce", bucket=0)], 2, 3),
    # from step 0 on: a constant scale, which AdamW's update hides (see the module docstring)
    ("divisor_plus1@0", [], 0, 2),
    ("divisor_minus1@1", [], 1, 3),
], ids=["live", "plus1", "minus1"])
def test_adamw_wrong_divisor_rejected_at_its_step(tmp_path, faults, kills, first_bad, steps):
    run_dir = _run(tmp_path, steps=steps, optim={"name": "adamw"}, faults=faults, kills=kills)
    _check(run_dir, first_bad, steps, sgd=False)
