"""Deaths INSIDE the recovery under real kills (issue 12): two and three kills in one step that
land in the consensus closure, before the agreed vector, while the replicate groups are rebuilt
and during the re-reduce; W=3 and W=4, S=1 and S=2.

Same checks as tests/e2e/test_hsdp_kills.py: every step committed, exact contributions, every
scheduled kill fired (its replica is gone), `recover-hsdp verify` passes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import K, _cfg, _check_run, _verify

pytestmark = [pytest.mark.mpi]

# (id, W, S, G, schedule) -- each row is one mpirun job
CASES = [
    ("W3S1-reduce-then-closure", 3, 1, 2,
     [K(1, 2, "reduce", bucket=0), K(1, 1, "closure")]),
    ("W3S1-agreed-then-rebuild", 3, 1, 2,
     [K(1, 2, "agreed"), K(1, 1, "rebuild")]),
    ("W4S1-three-reduce-closure-rebuild", 4, 1, 2,
     [K(1, 3, "reduce", bucket=0), K(1, 2, "closure"), K(1, 0, "rebuild")]),
    # (deaths at agreed/rebuild alone are case (b): every bucket was reduced, SKIP, no re-reduce;
    # the first death must hit the reduction for a re-reduce to exist)
    ("W4S1-three-reduce-rebuild-rereduce", 4, 1, 1,
     [K(2, 3, "reduce", bucket=1), K(2, 1, "rebuild"), K(2, 0, "re_reduce", bucket=0)]),
    ("W3S2-reduce-then-rebuild", 3, 2, 2,
     [K(1, 2, "reduce", local_rank=0, bucket=1), K(1, 1, "rebuild", local_rank=1)]),
    ("W3S2-agreed-then-closure", 3, 2, 2,
     [K(1, 0, "agreed", local_rank=1), K(1, 2, "closure", local_rank=0)]),
    ("W4S2-three-consensus-closure-agreed", 4, 2, 2,
     [K(1, 3, "consensus", local_rank=1), K(1, 2, "closure", local_rank=0),
      K(1, 1, "rebuild", local_rank=1)]),
    ("W4S2-three-reduce-rebuild-rereduce", 4, 2, 2,
     [K(2, 0, "reduce", local_rank=0, bucket=0), K(2, 3, "rebuild", local_rank=0),
      K(2, 1, "re_reduce", local_rank=1, bucket=0)]),
]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,W,S,G,schedule", CASES, ids=[c[0] for c in CASES])
def test_kills_inside_recovery(tmp_path, name, W, S, G, schedule):
    cfg = _cfg(tmp_path, W=W, S=S, G=G, schedule=schedule)
    out = run_training(cfg, timeout=360)
    run_dir = Path(cfg["run"]["output_dir"])
    assert (run_dir / "summary.json").exists(), out.stdout[-6000:]
    summary = _check_run(run_dir, W, S, G, schedule, "static")
    assert not summary["faults"]["unreached"], summary["faults"]
    assert _verify(run_dir) == 0
