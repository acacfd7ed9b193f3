"""Two ranks: the staged (CUDA) all-reduce loop run on CPU through the test hook.

A: rank 0 staged, rank 1 direct, each with ANOTHER RECOVER_HSDP_STAGE_CHUNK_MB: the chunking
   agreed at world creation makes them post the same MPI_Allreduce sequence (exact sum).
B: rank 0's staged loop raises before chunk 3 (as a CUDA error would): its guard revokes, so
   rank 1 returns a failure record at once (time measured), while rank 0 stays alive until then:
   not after a fail-stop, whose death ULFM would see.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _worker import mark, wait_marks, world_rank, write_result  # noqa: E402

ME = world_rank()
# per-process chunk sizes that differ (4 KiB vs 8 KiB): read by the extension at world creation
os.environ["RECOVER_HSDP_STAGE_CHUNK_MB"] = "0.00390625" if ME == 0 else "0.0078125"

import torch  # noqa: E402

from recover_hsdp.collectives import UlfmGroup  # noqa: E402

N = 16384                                      # 64 KiB of fp32: 16 chunks of the agreed 4 KiB
g = UlfmGroup.world()
out = {"rank": ME, "chunk_bytes": int(g._comm._stage_chunk_bytes())}
if ME == 0:
    g._debug_stage_cpu(True, -1)
x = torch.arange(N, dtype=torch.float32) + ME
res = g.allreduce(x)
out["a_ok"] = bool(res.ok)
out["a_exact"] = bool(torch.equal(x, 2 * torch.arange(N, dtype=torch.float32) + 1))
if ME == 0:
    g._debug_stage_cpu(True, 3)
y = torch.ones(N, dtype=torch.float32)
t0 = time.monotonic()
try:
    res = g.allreduce(y)
    out["b_ok"] = bool(res.ok)
    out["b_reduce_failed"] = bool(getattr(res, "reduce_failed", False))
except RuntimeError as e:
    out["b_error"] = str(e).splitlines()[0][:200]
out["b_s"] = time.monotonic() - t0
if ME == 1:
    mark("b_done")
else:
    # stay alive (as a rank whose error is still being handled) until the peer has returned:
    # without the revoke the peer would block in MPI_Allreduce all this time, and no mark would
    # come while this rank lives. Seeing the mark is the event order the test checks (the peer
    # was freed by the revoke, not by a death); the bound (90 s, within run_mpi's 120 s) only
    # fails the run: TimeoutError, no result written.
    wait_marks("b_done", [1], timeout=90.0)
    out["peer_returned_first"] = True
write_result(out)
sys.stdout.flush()
os._exit(0)
