"""A custom FSDP2 loop that shards its OWN model with ``fully_shard`` and trains it with
HSDPULFMTrainingManager (docs/fsdp2.md, docs/custom_loop.md).

Run on 4 ranks (2 replicas x 2 shard ranks), replica 1 losing a rank in the reduction of step 3,
under the supervisor of `recover-hsdp launch`, then replay it:

    recover-hsdp launch -n 4 --run-dir runs/custom_fsdp2 -- python examples/custom_loop_fsdp2.py
    recover-hsdp verify runs/custom_fsdp2

The diff against a torchtitan-style FSDP2 loop (marked `# ReCoVer:` below): the mesh comes from
``recover_hsdp.shard_mesh`` (a 1-D mesh over the replica's shard group only: FSDP2 reduce-scatters
inside the replica, the manager reduces across replicas), and the model goes to the manager:

    - mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    + mesh = recover_hsdp.shard_mesh(replicas=R, shard_size=S)        # ReCoVer
      for block in model.layers:
          fully_shard(block, mesh=mesh, mp_policy=mp)
      fully_shard(model, mesh=mesh, mp_policy=mp)
    + mgr = HSDPULFMTrainingManager(model, fsdp=2, replicas=R, shard_size=S, ...)  # ReCoVer
      for step in range(steps):
    -     for m in range(G): loss_fn(model(x), y).backward()
    -     opt.step(); opt.zero_grad()
    +     mgr.train_step()          # one COMMITTED step, whatever dies meanwhile

The manager puts FSDP2 in plain-SUM mode (no divide, no average) on every FSDPModule, keeps the
gradients in buckets of its own (each ``param.grad`` a view into one), and divides once by the
fixed B. The user code (model, loss, data by microbatch id) is examples/custom_loop.py's.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # custom_loop.make_parts

import recover_hsdp  # noqa: E402
from recover_hsdp import CustomParts, HSDPULFMTrainingManager, record_run  # noqa: E402

from custom_loop import B0, ROWS, make_parts  # noqa: E402


def shard_my_model(model, mesh):
    """What a torchtitan user writes: fully_shard each decoder block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()      # fp32 here; on GPU param_dtype=torch.bfloat16 with
    for block in model.layers:       # reduce_dtype=torch.float32 (the buckets stay fp32)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill", default="3", help="step at which the last rank SIGKILLs itself "
                                               "in the reduction ('none': no kill)")
    p.add_argument("--run-dir", default=None,
                   help="default: the launcher's (recover-hsdp launch --run-dir)")
    a = p.parse_args(argv)
    run_dir = a.run_dir or os.environ.get("RECOVER_HSDP_RUN_DIR") or "runs/custom_fsdp2"
    if B0 % a.replicas or ROWS % a.shard_size:
        p.error(f"--replicas must divide B={B0} and --shard-size must divide rows={ROWS}")
    torch.set_num_threads(1)
    parts = CustomParts.build(make_parts, data_slices=a.replicas)
    mesh = recover_hsdp.shard_mesh(replicas=a.replicas, shard_size=a.shard_size)   # ReCoVer
    model = shard_my_model(parts.model(), mesh)   # same init on every rank (seed 0)
    mgr = HSDPULFMTrainingManager(                # ReCoVer: the model as the user sharded it
        model, fsdp=2, optimizer_factory=parts.optimizer_factory,
        microbatch_fn=parts.microbatch_fn, loss_fn=parts.loss_fn, lr_fn=parts.lr_fn,
        replicas=a.replicas, shard_size=a.shard_size, grad_accum=B0 // a.replicas,
        mixed_precision="fp32")
    if a.kill != "none":            # the failure simulator: the last rank (replica W-1)
        mgr.set_failure_schedule([{"step": int(a.kill), "replica": a.replicas - 1,
                                   "local_rank": a.shard_size - 1, "location": "reduce",
                                   "bucket": 1}])
    rec = record_run(mgr, run_dir, parts)   # ReCoVer: the run record, every rank
    for _ in range(mgr.step, a.steps):
        mt = mgr.train_step()               # ReCoVer: one committed step
        if mgr.shard_index == 0 and mgr.replica == min(mgr.alive_replicas):
            print(f"step {mt.step}: loss {mt.loss:.4f}, {mt.divisor} microbatches, "
                  f"alive replicas {mt.alive}", flush=True)
    rec.finish()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # ULFM: MPI_Finalize after failures may hang (Open MPI #11404)
