"""The baselines ReCoVer is compared with (docs/baselines.md).

* ``baseline=reference``: plain PyTorch FSDP1 HYBRID_SHARD over torch's own process groups (gloo
  on CPU, NCCL on GPU), no ULFM, no recover_hsdp manager, failure-free. Same model, data, batch
  arithmetic (B = W x G microbatches, ids k*W + r), optimizer, lr schedule and seed as
  `recover-hsdp train`, so its losses match a failure-free resilient run step for step.
* ``baseline=checkpoint_restart``: the same training loop plus a torch.distributed.checkpoint
  (DCP) checkpoint every ``baseline.ckpt_interval`` steps; a scheduled SIGKILL aborts the whole
  mpirun job, and the launcher (:mod:`recover_hsdp.baselines.checkpoint_restart`) relaunches it
  from the last checkpoint until every step is committed.

:mod:`recover_hsdp.workers.plain` is the per-rank loop of both (workers/: the rank side's entry
points); this package holds the launcher side, checkpoint_restart.py.
"""
from __future__ import annotations

RESTARTS = "restarts.jsonl"
#: the per-rank loop of both (the constants it shares with the launcher live there too:
#: MODE_*, ENV_ATTEMPT, CKPT_DIR, attempt_dir)
PLAIN_WORKER_FN = "recover_hsdp.workers.plain:run_plain_worker"
