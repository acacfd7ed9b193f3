"""The per-rank worker behind `recover-hsdp train`: config -> model, data, manager, run record.

Started by mpirun (--with-ft ulfm), one process per rank. Every rank writes its own fsync'd record
of each committed step, so a kill of any rank (global rank 0 included) loses nothing; the progress
line is printed by the first rank of the lowest surviving replica, which moves when that replica
dies.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch


def _plain(cfg: Any) -> dict:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg, (str, Path)):
        import yaml

        with open(cfg) as f:
            return yaml.safe_load(f)
    return dict(cfg)


def _model_config(c: Mapping, vocab: int):
    from recover_hsdp.model import ModelConfig

    fields = {k: v for k, v in c.items() if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**fields).with_vocab(vocab)


def _data_config(c: Mapping, par: Mapping):
    from recover_hsdp.data import DataConfig

    fields = {k: v for k, v in c.items() if k in DataConfig.__dataclass_fields__}
    if isinstance(fields.get("paths"), list):
        fields["paths"] = tuple(fields["paths"])
    fields["seq_len"] = int(par["seq_len"])
    # a replica microbatch holds the rows of all S shard ranks (docs/interfaces.md)
    fields["micro_batch_size"] = int(par["micro_batch_size"]) * int(par["shard_size"])
    return DataConfig(**fields)


def _optim_config(c: Mapping, steps: int):
    from recover_hsdp import optim

    cls = getattr(optim, "OptimConfig")
    fields = {k: v for k, v in c.items() if k in cls.__dataclass_fields__}
    if "total_steps" in cls.__dataclass_fields__ and fields.get("total_steps") is None:
        fields["total_steps"] = steps
    if isinstance(fields.get("betas"), list):
        fields["betas"] = tuple(fields["betas"])
    return cls(**fields)


def run_worker(cfg: Any) -> int:
    """Train per the resolved config on this MPI rank. Returns 0 when every step committed."""
    from recover_hsdp.data import build_microbatch_source, load_tokenizer
    from recover_hsdp.faults import FailuresConfig
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager
    from recover_hsdp.model import build_model, fsdp_wrap_policy, next_token_loss
    from recover_hsdp.optim import build_optimizer, lr_at
    from recover_hsdp.record import RunRecorder, RunSummary, StepRecord

    c = _plain(cfg)
    par, run = c["parallel"], c["run"]
    W, S, G = int(par["replicas"]), int(par["shard_size"]), int(par["grad_accum"])
    steps = int(run["steps"])
    seed = int(run.get("seed", 0))
    run_dir = Path(run["output_dir"])
    torch.set_num_threads(int(run.get("omp_num_threads", 1) or 1))

    data_cfg = _data_config(c["data"], par)
    tok = load_tokenizer(data_cfg.tokenizer)
    model_cfg = _model_config(c["model"], tok.vocab_size)
    optim_cfg = _optim_config(c.get("optim", {}), steps)
    model = build_model(model_cfg, seed=seed)
    sources: dict[int, Any] = {}

    def microbatch_fn(replica: int, mb_id: int):
        if replica not in sources:
            sources[replica] = build_microbatch_source(data_cfg, replica, W)
        return sources[replica].get(mb_id)

    tpm = int(par["micro_batch_size"]) * int(par["seq_len"])  # tokens of this rank's rows

    def loss_fn(module, x, y):
        return next_token_loss(module(x), y, tokens_per_microbatch=tpm)

    mgr = HSDPULFMTrainingManager(
        model, optimizer_factory=lambda m: build_optimizer(m.named_parameters(), optim_cfg),
        microbatch_fn=microbatch_fn, loss_fn=loss_fn, replicas=W, shard_size=S, grad_accum=G,
        auto_wrap_policy=fsdp_wrap_policy(), policy=str(c.get("policy", {}).get("name", "static")),
        lr_fn=lambda step: lr_at(step, optim_cfg),
        restore_enabled=bool(c.get("debug", {}).get("restore_enabled", True)),
        shard_timeout_s=run.get("shard_timeout_s"))
    n_buckets = len(fh.grad_shard_names(mgr.module))
    schedule = FailuresConfig.from_mapping(c.get("failures")).build(
        W, S, G, n_buckets, steps=steps, base_dir=None)
    recorder = RunRecorder(run_dir, mgr.rank, mgr.replica, mgr.shard_index,
                           params_every=int(run.get("save_params_every", 1) or 0) or 10**9,
                           final_step=steps - 1)
    mgr.set_failure_schedule(schedule, before_kill=recorder.fault_fired)
    # meta.json must be byte-identical on every rank: describe the layout as seen by shard 0
    # (flat_shard_from_full derives any shard j from padded_numel and shard_size)
    layout = []
    for l in fh.parameter_layout(mgr.module):
        d = l.to_dict()
        d.update(shard_index=0, start=0, end=l.padded_numel // l.shard_size)
        layout.append(d)
    sources[mgr.replica] = build_microbatch_source(data_cfg, mgr.replica, W)
    fingerprint = sources[mgr.replica].fingerprint
    meta = {"w_init": W, "g_init": G, "B": W * G, "shard_size": S, "seed": seed,
            "torch": torch.__version__, "data_fingerprint": fingerprint, "param_layout": layout,
            "policy": str(c.get("policy", {}).get("name", "static")),
            "restore_enabled": mgr.restore_enabled, "processes_per_replica": S,
            "device": mgr.device.type,
            "mode": "drop_and_go" if meta_policy(c) == "adaptive" else "resilient"}
    recorder.start(meta, c, schedule)
    recorder.save_initial_params(_shards(mgr))
    log_every = int(run.get("log_every", 1) or 1)
    t_start = time.perf_counter()
    tokens = 0
    last = None
    tb = None  # TensorBoard writer of the current logging rank, when tensorboard is installed
    for step in range(steps):
        mt = mgr.train_step()
        tokens += mt.tokens
        recorder.commit(StepRecord(
            step=mt.step, loss=mt.loss, tokens=mt.tokens, alive=mt.alive, layout=mt.layout,
            boundary=mt.boundary,
            restore_mode=None if mt.restore_modes == ["skip"] else ",".join(mt.restore_modes),
            failures=mt.failures, contributions=mt.contributions, divisor=mt.divisor,
            epoch=mt.epoch, local={"wall_s": round(mt.wall_s, 6), "rank": mgr.rank,
                                   "bucket_epochs": mgr.orch.bucket_epochs()}))
        recorder.save_params(mt.step, _shards(mgr))
        last = mt
        if _is_logger(mgr):
            tb = tb if tb is not None else _tensorboard(run_dir, mgr.rank)
            if tb:
                tb.add_scalar("loss", mt.loss, mt.step)
                tb.add_scalar("alive_replicas", len(mt.alive), mt.step)
                tb.add_scalar("tokens_per_s", mt.tokens / mt.wall_s if mt.wall_s else 0.0, mt.step)
                tb.flush()
        if _is_logger(mgr) and (step % log_every == 0 or mt.failures or step == steps - 1):
            ev = ""
            if mt.failures:
                ev = " | lost replicas " + ",".join(str(r) for f in mt.failures
                                                   for r in f["replicas"])
                ev += f" -> {'/'.join(mt.restore_modes)}" + (" (boundary)" if mt.boundary else "")
            el = time.perf_counter() - t_start
            print(f"step {mt.step:5d}  loss {mt.loss:7.4f}  tok/s {tokens / el:9.0f}  "
                  f"alive {len(mgr.policy.alive)}/{W}  G {mgr.policy.layout.g}{ev}", flush=True)
    wall = time.perf_counter() - t_start
    summary = RunSummary(
        steps_committed=mgr.step, first_step=0, last_step=mgr.step - 1, replicas_initial=W,
        replicas_alive=list(mgr.policy.alive), failures_survived=W - len(mgr.policy.alive),
        wall_time_s=wall, tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else None,
        faults=mgr.injector.outcome(mgr.step, mgr.policy.alive),
        extra={"final_loss": getattr(last, "loss", None)})
    recorder.finish(summary)
    recorder.close()
    if _is_logger(mgr):
        print(f"done: {mgr.step}/{steps} steps committed, {summary.failures_survived} replica "
              f"failures survived, {wall:.1f} s, {summary.tokens_per_s or 0:.0f} tok/s; "
              f"run directory {run_dir}", flush=True)
    sys.stdout.flush()
    # ULFM: a clean MPI_Finalize after failures may hang (ompi #11404); leave without it.
    os._exit(0 if mgr.step == steps else 1)


def meta_policy(c: Mapping) -> str:
    return str(c.get("policy", {}).get("name", "static"))


def _shards(mgr) -> dict[str, torch.Tensor]:
    from recover_hsdp.hsdp import fsdp_hybrid as fh

    return {f"flat{i}": t.detach().cpu().clone() for i, t in enumerate(fh.local_flat_shards(mgr.module))}


def _tensorboard(run_dir: Path, rank: int):
    """A SummaryWriter under run_dir/tensorboard/rank{r} if tensorboard is installed, else False.

    Metrics are always in the run record (steps/rank*.jsonl); this is a convenience view. The
    writer lives on the logging rank, which moves to the next replica when its replica dies.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return False
    return SummaryWriter(log_dir=str(run_dir / "tensorboard" / f"rank{rank}"))


def _is_logger(mgr) -> bool:
    return mgr.replica == min(mgr.policy.alive) and mgr.shard_index == 0


if __name__ == "__main__":  # mpirun ... python -m recover_hsdp.hsdp.trainer RESOLVED_CONFIG.yaml
    if len(sys.argv) != 2:
        print("usage: python -m recover_hsdp.hsdp.trainer RESOLVED_CONFIG.yaml", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_worker(sys.argv[1]))
