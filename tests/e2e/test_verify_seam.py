"""verify rejects a REAL trainer that commits one wrong step (the B = 4 rows).

The test-only fault seam (recover_hsdp/faults/seam.py: RECOVER_HSDP_TEST_FAULT, honoured only with
RECOVER_HSDP_ALLOW_TEST_FAULT=1) makes the running ranks add one microbatch, drop one, count one
twice or reduce a stale bucket 0 at the named step, while the record lists exactly what the policy
assigned. W=2 G=2 (B=4), parameters saved every step. SGD (no momentum: stateless) carries all four
faults in ONE fp32 run at S=1, and `verify --keep-going` must fail exactly the four faulty steps
and pass the honest ones; so does AdamW with betas (0, 0) (stateless) in a bf16 run at S=2. (With
the default betas a fault contaminates the moments of every later step, so each kind needs its
own run: the table in docs/verify.md, `python -m experiments.verify_seam_table`.) The record
alone cannot tell (--records-only passes).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from recover_hsdp.verify import verify_run
from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import _cfg

pytestmark = [pytest.mark.mpi]

ALLOW = {"RECOVER_HSDP_ALLOW_TEST_FAULT": "1"}


def _run(tmp: Path, *, S: int, steps: int, optim: dict, faults: str, mp: str = "fp32",
         kills=()) -> Path:
    cfg = _cfg(tmp, W=2, S=S, G=2, steps=steps, schedule=kills)
    cfg["optim"].update(optim)
    cfg["parallel"]["mixed_precision"] = mp
    out = run_training(cfg, env={"RECOVER_HSDP_TEST_FAULT": faults, **ALLOW})
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    assert "TEST FAULT SEAM ACTIVE" in out.stdout, out.stdout[-3000:]
    rec = verify_run(run_dir, records_only=True)
    assert rec.exit_code == 0, rec.message      # the record is honest: only the run is wrong
    return run_dir


@pytest.mark.timeout(300)
def test_sgd_four_faults_in_one_run_each_rejected_at_its_step(tmp_path):
    faults = "extra_mb@1:0,drop_mb@2:1,double_mb@3:0,stale_bucket@4:1"
    run_dir = _run(tmp_path, S=1, steps=6, optim={"name": "sgd", "lr": 0.1}, faults=faults)
    res = verify_run(run_dir, keep_going=True)
    assert res.exit_code == 1 and res.failed_steps == [1, 2, 3, 4], (res.failed_steps,
                                                                     res.message)
    by_step = {r.step: r for r in res.reports}
    for s in (1, 2, 3, 4):
        assert by_step[s].strict_ratio > 10, (s, by_step[s].strict_ratio)   # far over its bound
    for s in (0, 5):
        assert by_step[s].ok and by_step[s].strict_ratio < 1, (s, by_step[s].strict_ratio)


@pytest.mark.timeout(300)
def test_adamw_bf16_four_faults_in_one_run_each_rejected_at_its_step(tmp_path):
    """AdamW with betas (0, 0): no moments carry a fault into the next step (the update is
    g / (|g| + eps): AdamW at its most scale-blind), so one run carries all four faults. The run
    is bf16 mixed precision at S=2 on CPU/gloo: verify replays each microbatch in bf16 as the S
    ranks do (row slices; verify/bf16.py) and judges with the fp32 tolerances; the honest steps
    agree to ~1e-9, and the same run judged as if it were fp32 fails at step 0."""
    import recover_hsdp.verify.bf16 as bf16

    faults = "stale_bucket@1:0,double_mb@2:1,drop_mb@3:0,extra_mb@4:1"
    run_dir = _run(tmp_path, S=2, steps=6, optim={"name": "adamw", "betas": [0.0, 0.0]},
                   faults=faults, mp="bf16")
    res = verify_run(run_dir, keep_going=True)
    assert res.exit_code == 1 and res.failed_steps == [1, 2, 3, 4], (res.failed_steps,
                                                                     res.message)
    assert any("bf16 mixed-precision run" in n for n in res.notes), res.notes
    by_step = {r.step: r for r in res.reports}
    for s in (0, 5):
        assert by_step[s].ok and by_step[s].strict_ratio < 1, (s, by_step[s].strict_ratio)
        assert by_step[s].max_abs < 1e-6, (s, by_step[s].max_abs)
    real = bf16.setup
    try:
        bf16.setup = lambda *a, **k: None       # the fp32 replay of a bf16 run cannot pass
        plain = verify_run(run_dir, until=0)
    finally:
        bf16.setup = real
    assert plain.exit_code == 1 and plain.failed_step == 0, plain.message
