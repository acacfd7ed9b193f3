"""Measurements behind the microbatch-accumulation decision (docs/hsdp.md). Not a CI test.

    RECOVER_HSDP_MEASURE=1 .venv/bin/python -m pytest experiments/measure_fsdp_accum.py -s

2 ranks, one replica of shard size 2 (1x2), gloo on CPU, G=8 microbatches per step. For each way
of accumulating -- (a) reduce-scatter every microbatch into the sharded fp32 accumulator,
(b) ``no_sync`` on all but the last microbatch -- it reports: seconds per step, the gradient bytes
FSDP holds between microbatches, shard-group collectives per step, and, with bf16 mixed precision
(fp32 reduce), the error of the accumulated gradient against an fp64 single-process reference.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from recover_hsdp.hsdp import fsdp_hybrid as fh

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from _spawn import run_workers  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("RECOVER_HSDP_MEASURE") != "1",
                                reason="measurement, run with RECOVER_HSDP_MEASURE=1")

D, H, BLOCKS, ROWS, G, STEPS = 256, 1024, 4, 8, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def data(g, step):
    gen = torch.Generator().manual_seed(10 * step + g)
    return torch.randn(ROWS, D, generator=gen), torch.randn(ROWS, D, generator=gen)


def loss_of(model, x, y, j, s):
    n = ROWS // s
    return ((model(x[j * n:(j + 1) * n]) - y[j * n:(j + 1) * n]) ** 2).sum() / (ROWS * D)


def worker(rank, nprocs):
    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ["OMPI_COMM_WORLD_RANK"] = str(rank)
    torch.set_num_threads(1)
    fh.init_distributed_from_env(backend="gloo", timeout_s=60)
    topo = fh.HybridTopology(1, 2, rank)
    pg = fh.new_shard_groups(topo, backend="gloo", timeout_s=60)
    out = {}
    for mp_name, mp in (("fp32", None), ("bf16", fh.bf16_mixed_precision())):
        for no_sync in (False, True):
            fsdp = fh.wrap_hybrid_shard(make_model(), pg, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        device="cpu", topology=topo, mixed_precision=mp)
            acc = fh.MicrobatchAccumulator(fsdp, no_sync=no_sync)
            held, times = 0, []
            for step in range(STEPS):
                for p in fsdp.parameters():
                    p.grad = None
                dist.barrier(group=pg)
                t0 = time.perf_counter()
                for g in range(G):
                    x, y = data(g, step)
                    acc.microbatch(lambda: loss_of(fsdp, x, y, rank, 2), last=g == G - 1)
                    if g == 0:
                        held = sum(h.flat_param.grad.numel() * h.flat_param.grad.element_size()
                                   for _, h in fh.flat_param_handles(fsdp) if h.flat_param.grad is not None)
                times.append(time.perf_counter() - t0)
            out[(mp_name, no_sync)] = {
                "s_per_step": sorted(times[1:])[len(times[1:]) // 2],
                "grad_bytes_between_microbatches": held,
                "grads": [t.clone() for t in fh.grad_shards(fsdp)],
                "layout": [fl.to_dict() for fl in fh.parameter_layout(fsdp)],
                "noop_allreduce": fsdp._recover_noop_pg.calls["allreduce"],
            }
    return out


@pytest.mark.timeout(600)
def test_measure_accumulation_modes():
    with fh.serve_store("127.0.0.1") as addr:
        res = run_workers(worker, 2, timeout_s=550,
                          env={"OMPI_COMM_WORLD_SIZE": "2", fh.ENV_STORE: addr,
                               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    ref = make_model().double()
    for g in range(G):  # last step's microbatches, fp64
        x, y = data(g, STEPS - 1)
        loss_of(ref, x.double(), y.double(), 0, 1).backward()
    ref_grads = {n: p.grad.float() for n, p in ref.named_parameters()}
    n_params = sum(p.numel() for p in ref.parameters())
    print(f"\nmodel {n_params} params ({4 * n_params} fp32 bytes), 1x2 gloo, G={G}")
    for key in res[0]:
        rows = []
        for rank in (0, 1):
            r = res[rank][key]
            layout = [fh.FlatParamLayout.from_dict(d) for d in r["layout"]]
            exp = fh.flat_shard_from_full(ref_grads, layout, rank)
            err = max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(r["grads"], exp))
            rows.append((r["s_per_step"], r["grad_bytes_between_microbatches"], err,
                         r["noop_allreduce"]))
        mode = "no_sync (b)" if key[1] else "sharded (a)"
        print(f"{key[0]} {mode}: {max(x[0] for x in rows) * 1e3:.1f} ms/step, "
              f"grad bytes held between microbatches {rows[0][1]}, "
              f"max rel err vs fp64 {max(x[2] for x in rows):.2e}, "
              f"reduce-scatters/unit/step {rows[0][3] // (BLOCKS * STEPS)}")
