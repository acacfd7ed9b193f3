"""A custom loop like examples/custom_loop.py with the README's checkpoint calls, for
tests/mpi/test_custom_loop_checkpoint_mpi.py. Run on 2 ranks (2 replicas x 1 shard):

    NP=2 launch/local.sh python tests/mpi/custom_loop_ckpt_worker.py RUN_DIR STEPS SAVE_EVERY [resume]

Every committed step is written to RUN_DIR/progress.rank{g}; at the end each rank saves its
local flat parameters (the whole model at S=1) to RUN_DIR/final.rank{g}.pt.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from recover_hsdp import HSDPULFMTrainingManager
from recover_hsdp.data import DataConfig, build_microbatch_source
from recover_hsdp.model import build_model, fsdp_wrap_policy, next_token_loss
from recover_hsdp.model.config import ModelConfig

REPLICAS, SHARD_SIZE, GRAD_ACCUM, MBS, SEQ = 2, 1, 2, 2, 32


def main(run_dir: Path, steps: int, save_every: int, resume: bool) -> None:
    torch.set_num_threads(1)
    data_cfg = DataConfig(seq_len=SEQ, micro_batch_size=MBS * SHARD_SIZE)
    sources: dict[int, object] = {}

    def microbatch_fn(replica: int, mb_id: int):
        if replica not in sources:
            sources[replica] = build_microbatch_source(data_cfg, replica, REPLICAS)
        return sources[replica].get(mb_id)

    cfg = ModelConfig(d_model=64, n_layers=2, ffn_dim=160, max_seq_len=SEQ, vocab_size=4096)
    mgr = HSDPULFMTrainingManager(
        build_model(cfg, seed=0),
        optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        microbatch_fn=microbatch_fn, loss_fn=lambda m, x, y: next_token_loss(m(x), y),
        replicas=REPLICAS, shard_size=SHARD_SIZE, grad_accum=GRAD_ACCUM,
        auto_wrap_policy=fsdp_wrap_policy())
    mgr.checkpointer(run_dir)                  # every rank, before any failure
    if resume:
        st = mgr.load(run_dir)                 # newest complete checkpoint
        print(f"[rank {mgr.rank}] resumed at step {mgr.step} from {st['step']}", flush=True)
    g = mgr.rank
    for _ in range(mgr.step, steps):
        mgr.train_step()
        (run_dir / f"progress.rank{g}").write_text(f"{mgr.step}\n")
        if save_every and mgr.step % save_every == 0 and mgr.step < steps:
            mgr.save(run_dir)                  # async: the lowest alive replica writes
    mgr.wait_saved()
    torch.save([p.detach().cpu().clone() for p in mgr.module.parameters()],
               run_dir / f"final.rank{g}.pt")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(Path(a[0]), int(a[1]), int(a[2]), len(a) > 3 and a[3] == "resume")
    sys.stdout.flush()
    os._exit(0)  # ULFM: MPI_Finalize after failures may hang (Open MPI #11404)
