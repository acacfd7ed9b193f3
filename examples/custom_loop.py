"""A stock FSDP training loop adopting HSDPULFMTrainingManager.

Run on 4 ranks (2 replicas x 2 shard ranks), with replica 1 losing a rank at step 3, under the
supervisor of `recover-hsdp train` (store, heartbeats, watchdog, reaper, start-up retry, an exit
code judged from what the ranks left; `recover-hsdp launch --help`):

    recover-hsdp launch -n 4 -- python examples/custom_loop.py
    NP=4 launch/local.sh python examples/custom_loop.py      # the same, a thin wrapper

The diff against a plain FSDP HYBRID_SHARD loop is small (marked `# ReCoVer:` below):

    - model = FSDP(model, sharding_strategy=HYBRID_SHARD, auto_wrap_policy=wrap, ...)
    - opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    - for step in range(steps):
    -     for m in range(grad_accum):
    -         loss = loss_fn(model, *next(batches)) / grad_accum
    -         loss.backward()
    -     opt.step(); opt.zero_grad()
    + mgr = HSDPULFMTrainingManager(model, optimizer_factory=..., microbatch_fn=..., loss_fn=...,
    +                               replicas=2, shard_size=2, grad_accum=2, auto_wrap_policy=wrap)
    + for step in range(steps):
    +     metrics = mgr.train_step()      # one COMMITTED step, whatever dies meanwhile

What changes for the user: data is addressed by microbatch id (a pure function of the id, so a
replica's slice can be taken over and a run replayed); the loss is a per-row mean (the manager
divides by the fixed global microbatch count B, never by the live world size).
"""
from __future__ import annotations

import torch

from recover_hsdp import HSDPULFMTrainingManager
from recover_hsdp.data import DataConfig, build_microbatch_source
from recover_hsdp.model import build_model, fsdp_wrap_policy, get_config, next_token_loss

REPLICAS, SHARD_SIZE, GRAD_ACCUM, MBS, SEQ, STEPS = 2, 2, 2, 2, 64, 6


def main() -> None:
    torch.set_num_threads(1)
    data_cfg = DataConfig(seq_len=SEQ, micro_batch_size=MBS * SHARD_SIZE)  # a replica's rows
    sources: dict[int, object] = {}

    def microbatch_fn(replica: int, mb_id: int):  # ReCoVer: data addressed by id
        if replica not in sources:
            sources[replica] = build_microbatch_source(data_cfg, replica, REPLICAS)
        return sources[replica].get(mb_id)

    model = build_model(get_config("llama_debug", vocab_size=4096), seed=0)  # same on every rank
    mgr = HSDPULFMTrainingManager(  # ReCoVer: replaces FSDP(...) and the optimizer
        model,
        optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        microbatch_fn=microbatch_fn,
        loss_fn=lambda m, x, y: next_token_loss(m(x), y),  # mean over this rank's rows
        replicas=REPLICAS, shard_size=SHARD_SIZE, grad_accum=GRAD_ACCUM,
        auto_wrap_policy=fsdp_wrap_policy())
    # the failure simulator: global rank 3 (replica 1, shard rank 1) SIGKILLs itself at step 3
    mgr.set_failure_schedule([{"step": 3, "replica": 1, "local_rank": 1, "location": "reduce",
                               "bucket": 1}])
    for _ in range(STEPS):
        mt = mgr.train_step()  # ReCoVer: one committed step
        if mgr.shard_index == 0 and mgr.replica == min(mgr.alive_replicas):
            print(f"step {mt.step}: loss {mt.loss:.4f}, {mt.divisor} microbatches, "
                  f"alive replicas {mt.alive}, restore {mt.restore_modes}", flush=True)


if __name__ == "__main__":
    main()
    import os
    os._exit(0)  # ULFM: MPI_Finalize after failures may hang (Open MPI #11404)
