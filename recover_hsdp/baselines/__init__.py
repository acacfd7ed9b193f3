"""The baselines ReCoVer is compared with (issue 7; docs/baselines.md).

* ``baseline=reference``: plain PyTorch FSDP1 HYBRID_SHARD over torch's own process groups (gloo
  on CPU, NCCL on GPU), no ULFM, no recover_hsdp manager, failure-free. Same model, data, batch
  arithmetic (B = W x G microbatches, ids k*W + r), optimizer, lr schedule and seed as
  `recover-hsdp train`, so its losses match a failure-free resilient run step for step.
* ``baseline=checkpoint_restart``: the same training loop plus a torch.distributed.checkpoint
  (DCP) checkpoint every ``baseline.ckpt_interval`` steps; a scheduled SIGKILL aborts the whole
  mpirun job, and the launcher (:mod:`recover_hsdp.baselines.checkpoint_restart`) relaunches it
  from the last checkpoint until every step is committed.

:mod:`recover_hsdp.baselines.plain_worker` is the per-rank loop of both.
"""
from __future__ import annotations

MODE_REFERENCE = "reference"
MODE_CHECKPOINT_RESTART = "checkpoint_restart"
ENV_ATTEMPT = "RECOVER_HSDP_ATTEMPT"
ATTEMPTS_DIR = "attempts"
CKPT_DIR = "ckpt"
RESTARTS = "restarts.jsonl"
PLAIN_WORKER_FN = "recover_hsdp.baselines.plain_worker:run_plain_worker"


def attempt_dir(run_dir, attempt: int):
    from pathlib import Path

    return Path(run_dir) / ATTEMPTS_DIR / f"{int(attempt):02d}"
