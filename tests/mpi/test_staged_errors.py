"""Csrc/UlfmComm.cpp: An error inside the staged all-reduce loop syncs and
revokes (RAII guard), so the peers return a failure while the erring rank still lives instead
of blocking in MPI_Allreduce until a fail-stop; and the chunking is agreed by every member at world creation,
so ranks with another RECOVER_HSDP_STAGE_CHUNK_MB, or on another path (staged vs direct), post
the same MPI_Allreduce sequence. Run on CPU through a test-only hook (workers/staged_error_worker.py)."""
from __future__ import annotations

import pytest
from _mpi import WORKERS, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("ulfm_ready")]


@pytest.mark.timeout(240)
def test_staged_loop_error_revokes_and_peers_fail_fast():
    run = run_mpi(2, WORKERS / "staged_error_worker.py", timeout=120)
    assert run.survivors == [0, 1], run.tail()
    r0, r1 = run.results[0], run.results[1]
    assert r0["chunk_bytes"] == r1["chunk_bytes"] == 4096, run.results   # MIN of 4 and 8 KiB
    assert r0["a_ok"] and r0["a_exact"] and r1["a_ok"] and r1["a_exact"], run.results
    assert "test error at chunk 3" in r0.get("b_error", ""), run.results
    assert r1.get("b_ok") is False, run.results
    # the order, not a wall-clock bound: rank 1 returned its failure while rank 0 (the rank
    # with the error) still lived and waited for it - so the revoke freed it, not a death
    assert r0.get("peer_returned_first") is True, run.results
