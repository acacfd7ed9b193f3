"""Deaths INSIDE the recovery under real kills: two and three kills in one step that
land in the consensus closure, before the agreed vector, while the replicate groups are rebuilt
and during the re-reduce; groups of two (from W=3) and three (from W=4) kills, S=1 and S=2.

Same checks as tests/e2e/test_hsdp_kills.py: every step committed, exact contributions, every
scheduled kill fired (its replica is gone), `recover-hsdp verify` passes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import K, _cfg, _check_no_spares, _check_run, _verify

pytestmark = [pytest.mark.mpi]

# (id, W, S, G, schedule) -- each row is one mpirun job. Former rows of one S share a launch
# (CI time): their kills run one step after the other, each group in a step of its own, at a
# W and G whose layouts have no spare replica (so each group meets the roles it had alone).
CASES = [
    # W3S1-reduce-then-closure (step 1), W3S1-agreed-then-rebuild (step 2),
    # W4S1-three-reduce-closure-rebuild (step 3): W=8 G=2, B=16: 8 -> 6 -> 4 -> 1 alive
    ("W8S1-reduce-closure-agreed-rebuild-three-reduce-closure-rebuild", 8, 1, 2,
     [K(1, 7, "reduce", bucket=0), K(1, 6, "closure"),
      K(2, 5, "agreed"), K(2, 4, "rebuild"),
      K(3, 3, "reduce", bucket=0), K(3, 2, "closure"), K(3, 0, "rebuild")]),
    # (deaths at agreed/rebuild alone are case (b): every bucket was reduced, SKIP, no re-reduce;
    # the first death must hit the reduction for a re-reduce to exist)
    ("W4S1-three-reduce-rebuild-rereduce", 4, 1, 1,
     [K(2, 3, "reduce", bucket=1), K(2, 1, "rebuild"), K(2, 0, "re_reduce", bucket=0)]),
    # W3S2-reduce-then-rebuild (step 1), W3S2-agreed-then-closure (step 2): W=5 G=2, B=10
    ("W5S2-reduce-rebuild-agreed-closure", 5, 2, 2,
     [K(1, 4, "reduce", local_rank=0, bucket=1), K(1, 3, "rebuild", local_rank=1),
      K(2, 0, "agreed", local_rank=1), K(2, 2, "closure", local_rank=0)]),
    # W4S2-three-consensus-closure-agreed (step 1), W4S2-three-reduce-rebuild-rereduce (step 2):
    # W=7 G=2, B=14: 7 -> 4 -> 1 alive
    ("W7S2-three-consensus-closure-rebuild-three-reduce-rebuild-rereduce", 7, 2, 2,
     [K(1, 6, "consensus", local_rank=1), K(1, 5, "closure", local_rank=0),
      K(1, 4, "rebuild", local_rank=1),
      K(2, 0, "reduce", local_rank=0, bucket=0), K(2, 3, "rebuild", local_rank=0),
      K(2, 1, "re_reduce", local_rank=1, bucket=0)]),
]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,W,S,G,schedule", CASES, ids=[c[0] for c in CASES])
def test_kills_inside_recovery(tmp_path, name, W, S, G, schedule):
    cfg = _cfg(tmp_path, W=W, S=S, G=G, schedule=schedule)
    out = run_training(cfg)  # the test's one budget
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    summary = _check_run(run_dir, W, S, G, schedule, "static")
    assert not summary["faults"]["unreached"], summary["faults"]
    if name != "W4S1-three-reduce-rebuild-rereduce":    # G=1: a row of its own, as before
        _check_no_spares(run_dir, name)
    assert _verify(run_dir) == 0
