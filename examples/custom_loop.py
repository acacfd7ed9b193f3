"""A stock FSDP training loop adopting HSDPULFMTrainingManager, with a run record `recover-hsdp
verify` replays, checkpoints and a resume at another width (docs/custom_loop.md).

Run on 4 ranks (2 replicas x 2 shard ranks); the last rank (replica 1) SIGKILLs itself in the
reduction of step 3 and the survivors carry its microbatches; then verify the run:

    recover-hsdp launch -n 4 --run-dir runs/mine -- python examples/custom_loop.py
    recover-hsdp verify runs/mine

Resume the same run from its newest checkpoint at another width (B = 4 microbatches per step
is kept: 4 replicas x 1 microbatch, S = 1), then verify it as one run:

    recover-hsdp launch -n 4 --run-dir runs/mine --overwrite -- \\
        python examples/custom_loop.py --resume --replicas 4 --shard-size 1 --steps 10 --kill none
    recover-hsdp verify runs/mine

The diff against a plain FSDP HYBRID_SHARD loop is small (marked `# ReCoVer:` below):

    - model = FSDP(model, sharding_strategy=HYBRID_SHARD, auto_wrap_policy=wrap, ...)
    - opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    - for step in range(steps):
    -     for m in range(grad_accum):
    -         loss = loss_fn(model, *next(batches)) / grad_accum
    -         loss.backward()
    -     opt.step(); opt.zero_grad()
    + parts = CustomParts.build(make_parts, data_slices=W0, rows=ROWS)   # model, optim, loss, data
    + mgr = HSDPULFMTrainingManager(parts.model(), optimizer_factory=..., microbatch_fn=...,
    +                               loss_fn=..., replicas=2, shard_size=2, grad_accum=2, ...)
    + rec = record_run(mgr, run_dir, parts)           # the run record verify replays
    + for step in range(mgr.step, steps):
    +     metrics = mgr.train_step()                  # one COMMITTED step, whatever dies meanwhile

What changes for the user: data is addressed by microbatch id, a pure function of the id ALONE
(id k * W0 + s is the k-th microbatch of data slice s, W0 the run's first width, whichever
replica computes it: a survivor takes over a lost replica's ids, a resume at another width
serves the old slices, and the verifier replays the run in one process); the loss is a per-row
mean (the manager divides by the fixed global microbatch count B, never by the live world size).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from recover_hsdp import CustomParts, HSDPULFMTrainingManager, record_run
from recover_hsdp.model import fsdp_wrap_policy
from recover_hsdp.record.custom import data_slices

B0, ROWS, SEQ = 4, 4, 64      # microbatches per step; rows of one replica microbatch; tokens


def make_parts(data_slices: int, rows: int = ROWS, seq_len: int = SEQ, stream: bool = False,
               position_dir: str | None = None) -> CustomParts:
    """The loop's user code, built the same way by the loop and by `recover-hsdp verify` (the
    run record names this function and these arguments). ``data_slices``: W0, the run's FIRST
    width; ``rows``: rows of one replica microbatch (all S ranks together; fixed for the run);
    ``stream``: the sequential (streaming) source instead of the random-access one;
    ``position_dir``: where a stream saves its slices' positions (the run's ``data/``), so that
    a survivor, a standby or a resumed launch starts a slice at the nearest saved position, not
    at its start (docs/data.md)."""
    from recover_hsdp.data import DataConfig, build_microbatch_source
    from recover_hsdp.model import build_model, get_config, next_token_loss

    data_cfg = DataConfig(seq_len=seq_len, micro_batch_size=rows, streaming=stream)
    sources: dict[int, object] = {}

    def source(s: int):
        if s not in sources:
            sources[s] = build_microbatch_source(data_cfg, s, data_slices,
                                                 position_dir=position_dir)
        return sources[s]

    def microbatch(mb_id: int):   # ReCoVer: the data of an id, whoever computes it
        # random access: get(id) is a pure function of the id (any slice's source serves it);
        # a stream: id k * W0 + s is the k-th microbatch of slice s's stream, read in order
        return source(0 if data_cfg.random_access else mb_id % data_slices).get(mb_id)

    return CustomParts(
        model=lambda: build_model(get_config("llama_debug", vocab_size=4096), seed=0),
        optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        loss_fn=lambda m, x, y: next_token_loss(m(x), y),   # mean over the given rows
        microbatch=microbatch,
        lr_fn=lambda step: 3e-3 * min(1.0, (step + 1) / 3),  # a 3-step warm-up
        fingerprint=source(0).fingerprint, name="llama_debug")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2, help="checkpoint every N steps (0: off)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--stream", action="store_true", help="the streaming data source")
    p.add_argument("--fsdp", type=int, default=1, choices=(1, 2),
                   help="1: FSDP1 HYBRID_SHARD; 2: fully_shard over the shard group")
    p.add_argument("--kill", default="3", help="step at which the last rank SIGKILLs itself "
                                               "in the reduction ('none': no kill)")
    p.add_argument("--run-dir", default=None,
                   help="default: the launcher's (recover-hsdp launch --run-dir)")
    a = p.parse_args(argv)
    run_dir = a.run_dir or os.environ.get("RECOVER_HSDP_RUN_DIR") or "runs/custom_loop"
    if B0 % a.replicas or ROWS % a.shard_size:
        p.error(f"--replicas must divide B={B0} and --shard-size must divide rows={ROWS}")
    torch.set_num_threads(1)
    # ReCoVer: the data slices are the FIRST launch's width, a resume at another width included
    w0 = data_slices(run_dir, default=a.replicas) if a.resume else a.replicas
    pos = str(Path(run_dir).resolve() / "data") if a.stream else None   # stream positions
    parts = CustomParts.build(make_parts, data_slices=w0, stream=a.stream, position_dir=pos)
    mgr = HSDPULFMTrainingManager(  # ReCoVer: replaces FSDP(...) and the optimizer
        parts.model(),              # same init on every rank (seed 0)
        optimizer_factory=parts.optimizer_factory, microbatch_fn=parts.microbatch_fn,
        loss_fn=parts.loss_fn, lr_fn=parts.lr_fn, grad_clip=parts.grad_clip,
        replicas=a.replicas, shard_size=a.shard_size, grad_accum=B0 // a.replicas,
        auto_wrap_policy=fsdp_wrap_policy(),   # one FSDP unit (a gradient bucket) per block
        mixed_precision="fp32",     # bf16 custom loops are not replayed by verify yet
        fsdp=a.fsdp)
    mgr.checkpointer(run_dir)       # every rank, before any failure (makes DCP's groups)
    if a.resume:
        st = mgr.load(run_dir)      # newest complete checkpoint; W / S may differ, B kept
        if mgr.rank == 0:
            print(f"resumed at step {st['step']} (W0={w0} slices)", flush=True)
    if a.kill != "none":            # the failure simulator: the last rank (replica W-1)
        mgr.set_failure_schedule([{"step": int(a.kill), "replica": a.replicas - 1,
                                   "local_rank": a.shard_size - 1, "location": "reduce",
                                   "bucket": 1}])
    rec = record_run(mgr, run_dir, parts)  # ReCoVer: the run record, every rank
    for _ in range(mgr.step, a.steps):
        mt = mgr.train_step()       # ReCoVer: one committed step
        if mgr.shard_index == 0 and mgr.replica == min(mgr.alive_replicas):
            print(f"step {mt.step}: loss {mt.loss:.4f}, {mt.divisor} microbatches, "
                  f"alive replicas {mt.alive}, restore {mt.restore_modes}", flush=True)
        if a.save_every and mgr.step % a.save_every == 0:
            mgr.save(run_dir)       # lowest alive replica writes checkpoints/step_N (async)
    mgr.wait_saved()
    rec.finish()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # ULFM: MPI_Finalize after failures may hang (Open MPI #11404)
