"""`recover-hsdp bench gpu` section 4, the rank side: under `mpirun -n 2`, the ulfm all-reduce of
one fp32 bucket (staged through pinned host memory when MPI is not CUDA-aware) vs a plain pinned
round trip of the same bytes. Started by recover_hsdp.bench.gpu with --staging-worker."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def staging_worker(args: argparse.Namespace) -> int:
    """Under mpirun -n 2: ulfm all-reduce of one fp32 bucket vs a plain pinned round trip."""
    import torch

    from recover_hsdp.collectives import UlfmGroup

    cpu = args.cpu or not torch.cuda.is_available()
    g = UlfmGroup.world()
    rank = g.rank
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(dev)
    n = int(args.staging_mb * 2**20) // 4
    x = torch.ones(n, dtype=torch.float32, device=dev)
    host = torch.empty(n, dtype=torch.float32, pin_memory=not cpu)

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def timed(fn, reps=5):
        fn()
        sync()
        ts = []
        for _ in range(reps):
            g.barrier()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    def ulfm():
        res = g.allreduce(x)
        if not res.ok:
            raise RuntimeError(f"allreduce failed: {res}")

    def plain():
        host.copy_(x, non_blocking=True)
        sync()
        x.copy_(host, non_blocking=True)

    t_ulfm = timed(ulfm)
    t_copy = timed(plain)
    nbytes = n * 4
    res = {"ranks": g.size, "device": str(dev), "ulfm_s": t_ulfm, "copy_s": t_copy,
           "ulfm_gbps": nbytes / t_ulfm / 1e9, "copy_gbps": nbytes / t_copy / 1e9,
           "ulfm_over_copy": t_ulfm / t_copy}
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rank0.json").write_text(json.dumps(res) + "\n")
    sys.stdout.flush()
    os._exit(0)
