"""Per-rank worker of `recover-hsdp bench hsdp`'s overhead phase (the arms: that module's
docstring): plain FSDP HYBRID_SHARD (gloo on both groups, FSDP's own all-reduce and divide) and
``HSDPULFMTrainingManager.train_step`` built as ``resilient.run_worker`` builds it (the same
builder, workers/build.py), in the same processes, same seed and microbatch ids, steps
interleaved ABBA. Per step and arm: wall time, phase times and process CPU time (less exposed to
other tenants). Same work: the step-0 gradient shards' max relative difference and the
parameters' difference at the end. Each rank writes ``OUT_DIR/rank{g}.json`` and leaves with
``os._exit`` (MPI_Finalize under ULFM may hang).

    mpirun --with-ft ulfm -n W*S python -m recover_hsdp.workers.bench_hsdp CFG.yaml OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run(cfg_path: str, out_dir: str) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    import yaml

    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager
    from recover_hsdp.model import fsdp_wrap_policy
    from recover_hsdp.optim import lr_at
    from recover_hsdp.workers.build import RankBuild

    with open(cfg_path) as f:
        c = yaml.safe_load(f)
    bench = c.pop("bench", None) or {}    # this worker's own keys; the rest is a TrainConfig
    warmup, steps = int(bench.get("warmup", 3)), int(bench.get("steps", 20))
    total = warmup + steps
    b = RankBuild.from_config(c, steps=total)   # the trainer's builder (workers/build.py)
    cfg = b.cfg
    par = cfg.parallel
    W, S, G = par.replicas, par.shard_size, par.grad_accum
    seed = cfg.run.seed
    torch.set_num_threads(cfg.run.omp_num_threads)

    fh.init_distributed_from_env(backend="gloo")
    rank = dist.get_rank()
    topo = fh.HybridTopology.for_world(W, S, rank, dist.get_world_size())

    optim_cfg = b.optim
    source = b.source(topo.replica, W)
    mbs = par.micro_batch_size
    loss_fn = b.loss_fn

    def rows(x):
        return x[topo.shard_index * mbs:(topo.shard_index + 1) * mbs]

    # --- resilient arm: exactly the trainer's construction --------------------------------
    mgr = HSDPULFMTrainingManager(
        b.model(), optimizer_factory=b.optimizer_factory, microbatch_fn=b.microbatch_fn(W),
        loss_fn=loss_fn, replicas=W, shard_size=S, grad_accum=G,
        auto_wrap_policy=fsdp_wrap_policy(), policy=cfg.policy.name, lr_fn=b.lr_fn,
        restore_enabled=True, shard_timeout_s=cfg.watchdog.shard_timeout_s, fsdp=par.fsdp)

    # where the resilient step spends its time (wrappers only add a perf_counter pair per call)
    phases: dict[str, float] = {}

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(mgr.acc, "microbatch", "microbatches")
    timed(mgr.cross, "allreduce", "reduce")
    timed(mgr.cross, "consensus", "consensus")
    timed(mgr.optimizer, "step", "optimizer")

    # --- baseline arm: plain FSDP HYBRID_SHARD, gloo on both groups -------------------------
    shard_pg = rep_pg = None
    for r in range(W):  # new_group is collective over the world, same order everywhere
        g = dist.new_group(topo.replica_ranks(r), backend="gloo")
        if r == topo.replica:
            shard_pg = g
    for j in range(S):
        g = dist.new_group(topo.replicate_ranks(j), backend="gloo")
        if j == topo.shard_index:
            rep_pg = g
    if par.fsdp == 2:   # plain FSDP2 HSDP: a 2-D (replicate, shard) mesh, SUM then / (W*S)
        base = _plain_fsdp2_hsdp(b.model(seed), topo, shard_pg, rep_pg)
    else:
        base = FSDP(b.model(seed), process_group=(shard_pg, rep_pg),
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                    auto_wrap_policy=fsdp_wrap_policy(), device_id=torch.device("cpu"),
                    use_orig_params=True, sync_module_states=False)
    base_opt = b.optimizer(base)

    def baseline_step(step: int) -> tuple[float, dict]:
        c0 = time.process_time()
        t0 = time.perf_counter()
        base_opt.zero_grad()
        for m in range(G):
            x, y = source.get((step * G + m) * W + topo.replica)  # DataAssignment's ids
            loss = loss_fn(base, rows(x), rows(y)) / G
            loss.backward()  # FSDP: reduce-scatter (shard group) + all-reduce (replicate group)
        t1 = time.perf_counter()
        lr = float(lr_at(step, optim_cfg))
        for pg in base_opt.param_groups:
            pg["lr"] = lr
        base_opt.step()
        t2 = time.perf_counter()
        return t2 - t0, {"microbatches": t1 - t0, "optimizer": t2 - t1,
                         "cpu": time.process_time() - c0}

    def resilient_step(step: int) -> tuple[float, dict]:
        phases.clear()
        c0 = time.process_time()
        mt = mgr.train_step()
        cpu = time.process_time() - c0
        assert mt.step == step and not mt.failures, (mt.step, step, mt.failures)
        p = dict(phases)
        # gate barrier, bucket snapshots, zero_grad, divide, bookkeeping
        p["other"] = mt.wall_s - sum(p.values())
        p["cpu"] = cpu
        return mt.wall_s, p

    t_base, t_res, p_base, p_res, order = [], [], [], [], []

    def one(arm: str, step: int) -> None:
        t, p = baseline_step(step) if arm == "baseline" else resilient_step(step)
        (t_base if arm == "baseline" else t_res).append(t)
        (p_base if arm == "baseline" else p_res).append(p)

    def rel_diff(xs, ys) -> float:
        num = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(xs, ys))
        den = max(float(b.detach().abs().max()) for b in ys)
        return num / den if den else num

    grad_diff = None
    dist.barrier()
    for step in range(total):
        first, second = (("baseline", "resilient") if step % 2 == 0
                         else ("resilient", "baseline"))
        order.append(first)
        one(first, step)
        one(second, step)
        if step == 0:
            # same work: from identical parameters, the same data gives the same step gradient
            # (both arms leave the reduced, divided gradient shard in flat_param.grad)
            grad_diff = rel_diff(_local(base, "grad"), _local(mgr.module, "grad"))

    # after many AdamW steps rounding differences (G > 1 sums in another order) are amplified
    # where a gradient is near 0 (the update is ~sign(g) * lr there): report, do not judge
    pa, pb = _local(base, "param"), _local(mgr.module, "param")
    diffs = [float((a.detach() - b.detach()).abs().max()) for a, b in zip(pa, pb)]
    num = sum(float((a.detach() - b.detach()).double().pow(2).sum()) for a, b in zip(pa, pb))
    den = sum(float(b.detach().double().pow(2).sum()) for b in pb)
    out = {"rank": rank, "replica": topo.replica, "shard_index": topo.shard_index,
           "warmup": warmup, "steps": steps, "baseline_s": t_base, "resilient_s": t_res,
           "first": order, "baseline_phases": p_base, "resilient_phases": p_res, "max_param_diff": max(diffs) if diffs else None,
           "param_rel_rms_diff": (num / den) ** 0.5 if den else None,
           "grad_rel_diff_step0": grad_diff, "n_buckets": len(diffs), "load": os.getloadavg()}
    from recover_hsdp.record.io import atomic_write

    atomic_write(Path(out_dir) / f"rank{rank}.json",
                 (json.dumps(out, default=str) + "\n").encode(), fsync=False)
    return 0


def _plain_fsdp2_hsdp(model, topo, shard_pg, rep_pg):
    """The fsdp=2 baseline: FSDP2's own HSDP (``fully_shard`` per decoder block and at the root
    over a 2-D mesh, replicate x shard, its all-reduce inside every backward) with the SUM
    settings the resilient arm uses (gloo refuses PREMUL_SUM) and FSDP's divide by W*S ranks."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from recover_hsdp.model.fsdp import decoder_blocks

    ranks = torch.tensor([topo.replica_ranks(r) for r in range(topo.replicas)])
    mesh = DeviceMesh.from_group([rep_pg, shard_pg], "cpu", mesh=ranks,
                                 mesh_dim_names=("replicate", "shard"))
    for blk in decoder_blocks(model):
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(float(topo.replicas * topo.shard_size))
    return model


def _local(module, what: str) -> list:
    """This rank's parameter (``what="param"``) or gradient shards, parameter order, as plain
    tensors (FSDP1: the flat shards, padding included; FSDP2: DTensors' local shards)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from recover_hsdp.hsdp import fsdp_hybrid as fh

    if isinstance(module, FSDP):
        return fh.local_flat_shards(module) if what == "param" else fh.grad_shards(module)
    out = []
    for p in module.parameters():
        t = p if what == "param" else p.grad
        if t is None:
            continue
        out.append((t.to_local() if hasattr(t, "to_local") else t).detach().reshape(-1))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m recover_hsdp.workers.bench_hsdp CFG.yaml OUT_DIR",
              file=sys.stderr)
        sys.exit(2)
    rc = 1
    try:
        rc = run(sys.argv[1], sys.argv[2])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
