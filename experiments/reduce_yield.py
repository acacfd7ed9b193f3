"""The W=2 step's bucket reductions with and without ``mpi_yield_when_idle`` (docs/results.md,
"Where the reduction time goes").

Run under mpirun with 2 ranks; each iteration: ``--compute-ms`` of busy compute (wall time),
then the llama_debug W=2 step's three buckets (2.0 + 0.7 + 0.7 MiB fp32) through
``UlfmGroup.allreduce`` on a replicate group (a Detect agreement + MPI_Allreduce each), then the
consensus's three world calls (agree, a 56-byte all-reduce, agree). Prints one JSON line per rank:
medians over the iterations after the first 3 of the buckets' time, the world calls' time, the
iteration.

    mpirun --with-ft ulfm --mca coll self,basic,tuned,libnbc,ftagree --mca pml ob1 \\
        --oversubscribe --prtemca pmix_tool_support 0 --mca mpi_yield_when_idle {0,1} -n 2 \\
        -x OMP_NUM_THREADS=1 .venv/bin/python experiments/reduce_yield.py --compute-ms 100

(add ``--allow-run-as-root`` as root). On 2 shared cores (load 10-15) the buckets took 4.9-101 ms
per rank-run median with 0 and 0.8-7.2 ms with 1 (7 alternating runs each).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from recover_hsdp.collectives.group import UlfmGroup

BUCKET_BYTES = (2097664, 738304, 738304)   # llama_debug, W=2 x S=1: the step records' buckets


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = torch.randn(256, 256)
    while time.perf_counter() < end:
        x = x @ x
        x /= x.norm()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--iters", type=int, default=25)
    a = ap.parse_args()
    world = UlfmGroup.world()
    group = UlfmGroup.from_ranks(range(world.size))
    bufs = [torch.ones(n // 4) for n in BUCKET_BYTES]
    vec = torch.zeros(14)
    red, cons, steps = [], [], []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        busy(a.compute_ms)
        t1 = time.perf_counter()
        for b in bufs:
            group.allreduce(b)
        t2 = time.perf_counter()
        world.consensus()
        world.allreduce(vec)
        world.consensus()
        t3 = time.perf_counter()
        red.append(t2 - t1)
        cons.append(t3 - t2)
        steps.append(t3 - t0)

    def med(v):
        return round(statistics.median(v[3:]) * 1e3, 2)

    print(json.dumps({"rank": group.rank, "buckets_ms": med(red), "world_calls_ms": med(cons),
                      "iteration_ms": med(steps)}), flush=True)


if __name__ == "__main__":
    main()
