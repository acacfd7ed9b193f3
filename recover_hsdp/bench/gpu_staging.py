"""`recover-hsdp bench gpu` section 4, the rank side: under `mpirun -n 2`, for each bucket size
(``--staging-buckets name:numel,...``, the sizes of the model's FSDP units: bench/gpu_report.py
``fsdp_unit_buckets``), the median time of the ulfm all-reduce of one fp32 bucket (staged
through pinned host memory when MPI is not CUDA-aware), of a plain pinned round trip of the same
bytes, and, with ``--staging-plane gloo|nccl``, of the same all-reduce on that data plane
(hsdp/dataplane/: posted, then waited under its monitor). Started by recover_hsdp.bench.gpu with
--staging-worker; the parent serves the plane's store and derives every rate
(gpu_report.staging_figures)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

#: timed repetitions per bucket and path (each after one untimed one)
REPS = 5


def parse_buckets(spec: str) -> list[tuple[str, int]]:
    """``"block:60821504,root:8390656"`` -> [("block", 60821504), ("root", 8390656)]."""
    out = []
    for part in spec.split(","):
        name, _, n = part.partition(":")
        out.append((name, int(n)))
    return out


def staging_worker(args: argparse.Namespace) -> int:
    import torch

    from recover_hsdp.bench.plane_rig import PlaneCross, rank_device
    from recover_hsdp.collectives import UlfmGroup

    cpu = args.cpu or not torch.cuda.is_available()
    g = UlfmGroup.world()
    rank = g.rank
    plane_name = args.staging_plane if args.staging_plane != "none" else None
    if cpu:
        dev = torch.device("cpu")
    elif plane_name == "nccl":     # one rank per GPU (the parent starts nccl with >= 2 only)
        dev = rank_device("nccl")
    else:                          # one GPU: both ranks share it (the staged path)
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    plane = None
    if plane_name:
        from recover_hsdp.hsdp.dataplane import make_data_plane

        plane = make_data_plane(plane_name, PlaneCross(g), timeout_s=60.0,
                                log=lambda s: print(s, file=sys.stderr))
        plane.membership_changed()

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def timed(fn):
        fn()
        sync()
        ts = []
        for _ in range(REPS):
            g.barrier()
            t = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    times = {}
    for name, n in parse_buckets(args.staging_buckets):
        x = torch.ones(n, dtype=torch.float32, device=dev)
        host = torch.empty(n, dtype=torch.float32, pin_memory=not cpu)

        def ulfm():
            res = g.allreduce(x)
            if not res.ok:
                raise RuntimeError(f"ulfm allreduce failed: {res}")

        def copy():
            host.copy_(x, non_blocking=True)
            sync()
            x.copy_(host, non_blocking=True)

        def on_plane():
            res = plane.allreduce(x).wait()
            if not res.ok:
                raise RuntimeError(f"{plane_name} plane allreduce failed: {res}")

        times[name] = {"ulfm": timed(ulfm), "copy": timed(copy),
                       "plane": timed(on_plane) if plane is not None else None}
        del x, host
    res = {"ranks": g.size, "device": str(dev), "plane": plane_name, "reps": REPS,
           "times": times}
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rank0.json").write_text(json.dumps(res) + "\n")
    g.barrier()
    sys.stdout.flush()
    os._exit(0)
