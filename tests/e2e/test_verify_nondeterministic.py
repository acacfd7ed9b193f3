"""verify on a NONDETERMINISTIC device, proven on CPU with the nondeterminism
injected: CUDA's SDPA backward adds atomically, so a bf16 run's gradients differ from the
replay's by bf16 ulps. The test seam RECOVER_HSDP_TEST_NONDET=0.5 moves each element of dq, dk
and dv one ulp up or down with probability 0.5 each (a generator seeded anew in every rank: the
runs are not repeatable); the run records meta.deterministic=false and verify judges it at the
nondeterministic tolerance (verify/tolerance.py nondeterministic_profile, verify/strict.py). An
honest run passes; the four seam faults are still each rejected at their step, at S=1 and S=2,
and by the strict check's fraction alone (not only by the element / RMS checks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover_hsdp.verify import verify_run
from recover_hsdp.verify.strict import ND_MAX_FRACTION
from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import _cfg

pytestmark = [pytest.mark.mpi]

NOISY = {"RECOVER_HSDP_ALLOW_TEST_FAULT": "1", "RECOVER_HSDP_TEST_NONDET": "0.5"}
FAULTS = "extra_mb@1:0,drop_mb@2:1,double_mb@3:0,stale_bucket@4:1"


def _noisy_run(tmp: Path, *, S: int, optim: dict, faults: str = "") -> Path:
    cfg = _cfg(tmp, W=2, S=S, G=2, steps=6)
    cfg["optim"].update(optim)
    cfg["parallel"]["mixed_precision"] = "bf16"
    env = dict(NOISY, **({"RECOVER_HSDP_TEST_FAULT": faults} if faults else {}))
    out = run_training(cfg, env=env)
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    assert "attention backward is nondeterministic" in out.stdout, out.stdout[-3000:]
    assert json.loads((run_dir / "meta.json").read_text())["deterministic"] is False
    return run_dir


def _noted(res) -> None:
    assert any("nondeterministic bf16 run" in n for n in res.notes), res.notes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("S", [1, 2])
def test_four_faults_rejected_at_the_nondeterministic_tolerance(tmp_path, S):
    """AdamW with betas (0, 0): no moments carry a fault into the next step, so one run carries
    all four (as tests/e2e/test_verify_seam.py)."""
    run_dir = _noisy_run(tmp_path, S=S, optim={"name": "adamw", "betas": [0.0, 0.0]},
                         faults=FAULTS)
    res = verify_run(run_dir, keep_going=True)
    _noted(res)
    assert res.exit_code == 1 and res.failed_steps == [1, 2, 3, 4], (res.failed_steps,
                                                                     res.message)
    by = {r.step: r for r in res.reports}
    for s in (1, 2, 3, 4):      # the strict fraction alone rejects each fault, with margin
        assert by[s].strict_fraction > 3 * ND_MAX_FRACTION, (s, by[s].strict_fraction)
    for s in (0, 5):            # the honest steps of the same noisy run pass, with margin
        assert by[s].ok and by[s].strict_fraction < ND_MAX_FRACTION / 3, (s, by[s])


@pytest.mark.timeout(240)
def test_honest_noisy_bf16_run_with_default_adamw_verifies(tmp_path):
    """The false-FAIL side: default AdamW betas (moments carry the noise along), S=2. At the
    fp32 (deterministic) tolerance the same run FAILS: the noise is real."""
    run_dir = _noisy_run(tmp_path, S=2, optim={})
    res = verify_run(run_dir)
    _noted(res)
    assert res.exit_code == 0, res.message
    assert all(r.strict_fraction is not None and r.strict_fraction < ND_MAX_FRACTION / 3
               for r in res.reports if r.compared), [(r.step, r.strict_fraction)
                                                      for r in res.reports]
    meta = run_dir / "meta.json"
    m = json.loads(meta.read_text())
    m["deterministic"] = True                  # judged as if deterministic: it cannot pass
    meta.write_text(json.dumps(m))
    strict_judge = verify_run(run_dir, until=1)
    assert strict_judge.exit_code == 1, strict_judge.message
