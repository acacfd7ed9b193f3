"""A custom loop over HSDPULFMTrainingManager in which the named ranks' user code raises.

    python tests/e2e/_raising_loop.py OUT_DIR W S FAULTS STEPS
FAULTS: comma-separated RANK:WHERE:STEP (global rank, where it raises, at which step), WHERE:
microbatch_fn | loss_fn | optimizer (the optimizer step raises) | kill (SIGKILLs itself in
microbatch_fn) | wedge (blocks for good in microbatch_fn: the main thread stuck, the heartbeat
thread beating on, as a deadlocked loader); "-" for none. Every rank that finishes writes
OUT_DIR/result.rank{g}.json; errors go to OUT_DIR/errors/ (RECOVER_HSDP_RUN_DIR).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

import torch

from recover_hsdp import HSDPULFMTrainingManager
from recover_hsdp.data import DataConfig, build_microbatch_source
from recover_hsdp.model import ModelConfig, build_model, fsdp_wrap_policy, next_token_loss


def main() -> None:
    out, W, S, faults, steps = (sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4],
                                int(sys.argv[5]))
    os.environ["RECOVER_HSDP_RUN_DIR"] = out
    torch.set_num_threads(1)
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    data_cfg = DataConfig(seq_len=32, micro_batch_size=2 * S)
    sources: dict[int, object] = {}
    state = {"step": 0}
    mine = {w: int(st) for g, w, st in (f.split(":") for f in faults.split(",") if f != "-")
            if int(g) == rank}
    me = bool(mine)
    where, bad_step = (next(iter(mine.items())) if me else ("", -1))

    def microbatch_fn(replica: int, mb_id: int):
        if me and where == "microbatch_fn" and state["step"] == bad_step:
            raise KeyError(f"microbatch {mb_id} missing (injected)")
        if me and where == "kill" and state["step"] == bad_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if me and where == "wedge" and state["step"] == bad_step:
            threading.Event().wait()        # never set: the watchdog's progress rule ends it
        if replica not in sources:
            sources[replica] = build_microbatch_source(data_cfg, replica, W)
        return sources[replica].get(mb_id)

    def loss_fn(m, x, y):
        if me and where == "loss_fn" and state["step"] == bad_step:
            raise ValueError("bad batch (injected)")
        return next_token_loss(m(x), y)

    class Opt(torch.optim.SGD):
        def step(self, closure=None):
            if me and where == "optimizer" and state["step"] == bad_step:
                raise MemoryError("out of memory (injected)")
            return super().step(closure)

    from recover_hsdp.data import load_tokenizer

    vocab = load_tokenizer(data_cfg.tokenizer).vocab_size
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160,
                      max_seq_len=64, vocab_size=vocab)
    model = build_model(cfg, seed=0)
    mgr = HSDPULFMTrainingManager(
        model, optimizer_factory=lambda m: Opt(m.parameters(), lr=1e-2),
        microbatch_fn=microbatch_fn, loss_fn=loss_fn, replicas=W, shard_size=S, grad_accum=2,
        auto_wrap_policy=fsdp_wrap_policy())
    for s in range(steps):
        state["step"] = s
        mt = mgr.train_step()
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
        json.dump({"steps": mgr.step, "alive": list(mt.alive)}, f)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # ULFM: MPI_Finalize after failures may hang (Open MPI #11404)
