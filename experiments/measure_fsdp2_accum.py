"""The microbatch-accumulation decision at parallel.fsdp=2 (docs/fsdp2.md). Not a CI test.

    RECOVER_HSDP_MEASURE=1 .venv/bin/python -m pytest experiments/measure_fsdp2_accum.py -s

The FSDP1 twin is experiments/measure_fsdp_accum.py (same model, shapes and G). 2 ranks, one
replica of shard size 2, gloo on CPU, G=8 microbatches per step, the fsdp=2 substrate's wrapping
(hsdp/substrate/fsdp2.py: plain SUM, the toolkit's buckets). Two ways of accumulating:
(a) gradient sync on every microbatch: a reduce-scatter per microbatch, FSDP2 adds each sharded
result into the buckets (what the substrate does); (b) ``set_requires_gradient_sync(False)`` on
all but the last microbatch: FSDP2 keeps the UNSHARDED gradients between microbatches and
reduce-scatters their sum once. Reported: seconds per step (median of steps 1..), the gradient
bytes held between microbatches (buckets + FSDP2's unsharded accumulators), and the error of the
accumulated gradient against an fp64 single-process reference.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spawn import run_workers  # noqa: E402
from measure_fsdp_accum import BLOCKS, G, ROWS, STEPS, Block, data, loss_of, make_model  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("RECOVER_HSDP_MEASURE") != "1",
                                reason="measurement, run with RECOVER_HSDP_MEASURE=1")


def _held(model, buckets) -> int:
    n = sum(b.numel() * b.element_size() for b in buckets)
    for m in model.modules():
        st = getattr(m, "_get_fsdp_state", None)
        pg = st()._fsdp_param_group if st else None
        for fp in (pg.fsdp_params if pg else ()):
            for g in (getattr(fp, "unsharded_accumulated_grad", None),
                      getattr(getattr(fp, "_unsharded_param", None), "grad", None)):
                if g is not None:   # an unsharded gradient FSDP2 keeps until the sync
                    n += g.numel() * g.element_size()
    return n


def worker(rank, nprocs):
    import torch.distributed as dist

    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.hsdp.substrate import make_substrate

    os.environ["OMPI_COMM_WORLD_RANK"] = str(rank)
    torch.set_num_threads(1)
    fh.init_distributed_from_env(backend="gloo", timeout_s=60)
    topo = fh.HybridTopology(1, 2, rank)
    pg = fh.new_shard_groups(topo, backend="gloo", timeout_s=60)
    sub = make_substrate(2)
    out = {}
    for no_sync in (False, True):
        model = sub.wrap(make_model(), pg, auto_wrap_policy={Block}, device="cpu",
                         topology=topo, mixed_precision="fp32")
        held, times = 0, []
        for step in range(STEPS):
            for b in sub.buckets(model):
                b.zero_()
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            for g in range(G):
                x, y = data(g, step)
                if no_sync:
                    model.set_requires_gradient_sync(g == G - 1)
                loss_of(model, x, y, rank, 2).backward()
                if g == 0:
                    held = _held(model, sub.buckets(model))
            times.append(time.perf_counter() - t0)
        out[no_sync] = {"s_per_step": sorted(times[1:])[len(times[1:]) // 2],
                        "held": held,
                        "grads": {fqn: p.grad.to_local().clone()
                                  for b in model._recover_buckets for fqn, p, _, _ in b.params},
                        "layout": [fl.to_dict() for fl in sub.layout(model)]}
    return out


@pytest.mark.timeout(600)
def test_measure_fsdp2_accumulation_modes():
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.hsdp.layout import row_range

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
    print(f"\nmodel {n_params} params ({4 * n_params} fp32 bytes), 1x2 gloo, G={G}, fsdp=2")
    for no_sync in (False, True):
        rows = []
        for rank in (0, 1):
            r = res[rank][no_sync]
            err = 0.0
            for fqn, got in r["grads"].items():
                full = ref_grads[fqn]
                a, b = row_range(full.shape[0], 2, rank)
                exp = full[a:b]
                if exp.numel():
                    err = max(err, float((got - exp).abs().max() / full.abs().max()))
            rows.append((r["s_per_step"], r["held"], err))
        mode = "no sync until the last (b)" if no_sync else "sync every microbatch (a)"
        print(f"fp32 {mode}: {max(x[0] for x in rows) * 1e3:.1f} ms/step, grad bytes held "
              f"between microbatches {rows[0][1]}, max rel err vs fp64 "
              f"{max(x[2] for x in rows):.2e}")
        assert max(x[2] for x in rows) < 1e-4
