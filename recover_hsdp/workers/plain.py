"""The per-rank loop of the baselines: plain PyTorch FSDP1 HYBRID_SHARD, no ULFM, no manager.

Started by mpirun (WITHOUT ``--with-ft ulfm``), one process per rank, through
``python -m recover_hsdp.train --worker FILE`` when ``baseline.name`` is ``reference`` or
``checkpoint_restart``. What it shares with the resilient trainer (recover_hsdp/workers/resilient.py),
so that a failure-free resilient run and this loop compute the same steps:

* model: ``build_model(model_cfg, seed=run.seed)``, wrapped per decoder block
  (``fsdp_wrap_policy()``), fp32, ``use_orig_params=True``;
* data: replica r's microbatch source (``micro_batch_size * shard_size`` rows, shard rank j takes
  rows ``[j*mbs, (j+1)*mbs)``); at step s replica r consumes ids ``(s*G + m) * W + r``,
  m = 0..G-1 -- exactly what ``DataAssignment`` hands out under the static policy without failures;
* loss: ``next_token_loss(..., tokens_per_microbatch=mbs*seq_len)`` per rank;
* gradient: the mean over the B = W*G replica microbatches. FSDP (default divide factors) averages
  over its S*W ranks, and each microbatch's loss is divided by G (standard gradient
  accumulation), so the step gradient is (1/(S*W*G)) * sum of the per-rank gradients -- the
  manager's (1/B) * sum of (loss/S) gradients;
* optimizer: ``build_optimizer`` (AdamW, no decay on norms) and ``lr_at(step)`` before each step.

Process groups are torch's own: one shard group per replica and one replicate group per shard
index (``dist.new_group``, gloo on CPU, NCCL on GPU). ``shard_size == 1``: FSDP1 turns HYBRID_SHARD
into NO_SHARD over the size-1 shard group and would then never reduce across replicas, so the
S=1 baseline is FSDP NO_SHARD over the replicate group (all ranks) -- what HSDP with S=1 means.

Gradient accumulation: ``no_sync()`` for microbatches 0..G-2, so the gradient synchronization
(reduce-scatter on the shard group, then all-reduce on the replicate group; NO_SHARD: one
all-reduce) happens once, inside the LAST microbatch's backward, unit by unit as each unit's
backward finishes (last decoder block first, the root -- bucket 0 -- last).

Kill points (``failures.schedule`` entries, checkpoint_restart only; docs/baselines.md):
``forward`` m (before microbatch m's forward), ``backward`` m (after its forward, before its
backward), ``reduce`` b (inside the last microbatch's backward, just before FSDP reduces unit b's
gradient: units reduced earlier in backward order are already synchronized, the rest are not),
``pre_step`` (gradients synchronized, before the optimizer step), ``optimizer_step`` (after the
optimizer step, before the step is recorded). A rank writes ``faults/fired.rank{g}.json`` before
it SIGKILLs itself; a relaunched rank skips every entry whose marker exists, so a fault fires once.

Checkpoint-restart: after the step that makes ``N * ckpt_interval`` steps committed (and before
the last step) every rank saves ``ckpt/step{N*ckpt_interval:06d}`` (model + optimizer state +
the step to resume from) with ``dcp.save`` (or ``dcp.async_save``; one save in flight at most)
over a dedicated gloo group. At start every rank loads the newest COMPLETE checkpoint (its DCP
``.metadata`` exists) and resumes there: microbatch ids are a pure function of the step.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from recover_hsdp.record.timeline_base import ATTEMPTS_DIR   # <run dir>/attempts, as read back

MODE_REFERENCE = "reference"
MODE_CHECKPOINT_RESTART = "checkpoint_restart"
ENV_ATTEMPT = "RECOVER_HSDP_ATTEMPT"   # the launcher's attempt number (checkpoint_restart)
CKPT_DIR = "ckpt"


def attempt_dir(run_dir, attempt: int) -> Path:
    """<run dir>/attempts/NN: one checkpoint-restart attempt's step files and events."""
    return Path(run_dir) / ATTEMPTS_DIR / f"{int(attempt):02d}"


_CKPT_PREFIX = "step"


# ---------------------------------------------------------------------------------------------
# Checkpoints on disk (also used by the supervisor)
# ---------------------------------------------------------------------------------------------
def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """ckpt/step{s:06d}: the state after ``step`` committed steps (resume at step ``step``)."""
    return Path(run_dir) / CKPT_DIR / f"{_CKPT_PREFIX}{int(step):06d}"


def latest_checkpoint(run_dir: str | os.PathLike) -> int | None:
    """The resume step of the newest complete checkpoint (DCP wrote its .metadata last), or None."""
    root = Path(run_dir) / CKPT_DIR
    best = None
    if root.is_dir():
        for p in root.iterdir():
            name = p.name
            if name.startswith(_CKPT_PREFIX) and name[len(_CKPT_PREFIX):].isdigit() \
                    and (p / ".metadata").is_file():
                s = int(name[len(_CKPT_PREFIX):])
                best = s if best is None or s > best else best
    return best


def fired_entries(run_dir: str | os.PathLike) -> list[dict]:
    """The schedule entries (dicts) whose fault markers exist: they never fire again."""
    out = []
    d = Path(run_dir) / "faults"
    if d.is_dir():
        for p in sorted(d.glob("fired.rank*.json")):
            try:
                out.append(json.loads(p.read_text())["entry"])
            except (OSError, ValueError, KeyError):
                continue
    return out


class EventLog:
    """attempts/{k:02d}/events.rank{g}.jsonl: {"event", "time", "step"?}, fsync'd, thread-safe
    (the async checkpoint's completion callback writes from DCP's thread)."""

    def __init__(self, path: Path | None):
        from recover_hsdp.record import JsonlAppender

        self._out = JsonlAppender(path, fresh=True) if path is not None else None
        self._lock = threading.Lock()

    def __call__(self, event: str, step: int | None = None, t: float | None = None) -> None:
        if self._out is None:
            return
        rec: dict[str, Any] = {"event": event, "time": time.time() if t is None else t}
        if step is not None:
            rec["step"] = int(step)
        with self._lock:
            self._out.append(rec)

    def close(self) -> None:
        if self._out is not None:
            with self._lock:
                self._out.close()


# ---------------------------------------------------------------------------------------------
# FSDP without the resilient machinery
# ---------------------------------------------------------------------------------------------
def wrap_plain(model: torch.nn.Module, shard_pg, replicate_pg, shard_size: int,
               device: torch.device, auto_wrap_policy: Any, mixed_precision: Any = None):
    """FSDP1 HYBRID_SHARD over (shard_pg, replicate_pg); NO_SHARD over replicate_pg when S=1.
    mixed_precision: an FSDP MixedPrecision (the resilient trainer's, for a like-for-like arm)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    common = dict(auto_wrap_policy=auto_wrap_policy, device_id=device, use_orig_params=True,
                  sync_module_states=False, mixed_precision=mixed_precision)
    if shard_size > 1:
        return FSDP(model, process_group=(shard_pg, replicate_pg),
                    sharding_strategy=ShardingStrategy.HYBRID_SHARD, **common)
    import warnings

    with warnings.catch_warnings():   # NO_SHARD is deprecated in favour of DDP; same math here
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*", category=FutureWarning)
        return FSDP(model, process_group=replicate_pg,
                    sharding_strategy=ShardingStrategy.NO_SHARD, **common)


class _ReducePoints:
    """The ``reduce`` kill point: FSDP's per-unit gradient reduction (``_reduce_grad`` for
    HYBRID_SHARD, ``_reduce_grad_no_shard`` for NO_SHARD), called from each unit's post-backward
    hook in the synchronizing (last) backward. Bucket b = the b-th FSDP unit in pre-order, as in
    ``fsdp_hybrid.grad_shard_names``."""

    def __init__(self, module, check):
        from torch.distributed.fsdp import _runtime_utils as ru

        from recover_hsdp.hsdp import fsdp_hybrid as fh

        self._bucket = {id(h): i for i, (_, h) in enumerate(fh.flat_param_handles(module))}
        self._check = check
        self.step = 0
        for name in ("_reduce_grad", "_reduce_grad_no_shard"):
            orig = getattr(ru, name)
            if getattr(orig, "_recover_reduce_point", False):
                orig = orig._recover_orig  # type: ignore[attr-defined]

            def hooked(state, handle, _orig=orig):
                self._check("reduce", self.step, bucket=self._bucket.get(id(handle), 0))
                return _orig(state, handle)

            hooked._recover_reduce_point = True  # type: ignore[attr-defined]
            hooked._recover_orig = orig  # type: ignore[attr-defined]
            setattr(ru, name, hooked)


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------
def run_plain_worker(cfg: Any) -> int:
    """One rank of a ``reference`` or ``checkpoint_restart`` job. Returns (by os._exit) 0 when
    this attempt committed every remaining step."""
    t_launch = time.time()
    import contextlib
    import warnings

    # FSDP NO_SHARD (S=1) returns full state dicts for DCP: expected, not worth a warning per save
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*full_state_dict.*")

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from recover_hsdp.config import config_dict
    from recover_hsdp.faults import failstop
    from recover_hsdp.workers.build import RankBuild
    from recover_hsdp.faults import FailureInjector, FailureSchedule, FailuresConfig
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.model import fsdp_wrap_policy, next_token_loss
    from recover_hsdp.optim import lr_at
    from recover_hsdp.record import (ParamWriter, RunSummary, StepRecord,
                                     StepWriter, write_fault_fired, write_run_files)

    b = RankBuild.from_config(cfg)  # tokenizer, model, optimizer, data, loss (workers/build.py)
    cfg = b.cfg
    c = config_dict(cfg)            # what the run directory's config.yaml records
    par, run, base = cfg.parallel, cfg.run, cfg.baseline
    mode = base.name
    if mode not in (MODE_REFERENCE, MODE_CHECKPOINT_RESTART):
        raise ValueError(f"baseline.name({mode!r}) is not a plain-FSDP baseline")
    cr = mode == MODE_CHECKPOINT_RESTART
    W, S, G = par.replicas, par.shard_size, par.grad_accum
    B = W * G
    steps, seed = run.steps, run.seed
    run_dir = b.run_dir
    attempt = int(os.environ.get(ENV_ATTEMPT, "0")) if cr else 0
    interval, use_async = base.ckpt_interval, base.ckpt_async
    torch.set_num_threads(run.omp_num_threads)
    timeout_s = float(cfg.watchdog.shard_timeout_s)

    # --- process groups: torch's own ------------------------------------------------------
    fh.init_distributed_from_env(backend="gloo", timeout_s=timeout_s)
    rank = dist.get_rank()
    topo = fh.HybridTopology.for_world(W, S, rank, dist.get_world_size())
    replica, shard_index = topo.replica, topo.shard_index
    # the heartbeat the launcher's watchdog judges (launcher/supervise.py): no heartbeat for
    # watchdog.hang_timeout_s, or no progress outside a long phase, and this rank is SIGKILLed,
    # which aborts this plain job like any death
    hb_dir = os.environ.get(failstop.ENV_RUN_DIR) or run_dir
    failstop.configure(hb_dir, rank, replica)
    failstop.start_heartbeat(hb_dir, rank)
    events = EventLog(attempt_dir(run_dir, attempt) / f"events.rank{rank}.jsonl" if cr else None)
    events("launch_seen", t=t_launch)
    from recover_hsdp.hsdp.manager import resolve_mixed_precision
    from recover_hsdp.workers.resilient import rank_device, step_resources

    device = rank_device(run.gpus_per_node, S, run.device) \
        or fh.local_device()
    mp = resolve_mixed_precision(par.mixed_precision, device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    shard_pg = fh.new_shard_groups(topo, backend=backend, timeout_s=timeout_s)
    replicate_pg = None
    for j in range(S):
        g = dist.new_group(topo.replicate_ranks(j), backend=backend, group_desc=f"replicate{j}",
                           timeout=timedelta(seconds=fh.shard_group_timeout_s(backend, timeout_s)))
        if j == shard_index:
            replicate_pg = g
    # DCP's own coordination group (async_save runs its collectives on a background thread)
    ckpt_pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, 300.0)),
                             group_desc="checkpoint") if cr else None

    # --- model, data, optimizer: as the resilient trainer ---------------------------------
    model = b.model()
    model_line = b.model_line(model)   # the parameter count as built (before wrapping)
    module = wrap_plain(model, shard_pg, replicate_pg, S, device, fsdp_wrap_policy(),
                        mixed_precision=fh.bf16_mixed_precision() if mp == "bf16" else None)
    optimizer = b.optimizer(module)
    optim_cfg = b.optim
    from recover_hsdp.hsdp.topology import CKPT_SAVE_BOUND_S
    from recover_hsdp.workers.resilient import SNAPSHOT_FLOOR_BPS

    # a checkpoint save or load moves the parameters and two optimizer moments: its long-phase
    # bound scales with those bytes over a floor bandwidth
    ckpt_bound_s = max(CKPT_SAVE_BOUND_S, 3 * sum(
        t.numel() * t.element_size() for t in module.parameters()) / SNAPSHOT_FLOOR_BPS)
    source = b.source(replica, W)
    mbs = par.micro_batch_size
    tpm = b.tokens_per_microbatch          # tokens of this rank's rows
    tokens_per_step = B * S * tpm

    # --- failure schedule (checkpoint_restart): entries that already fired are dropped ------
    n_buckets = len(fh.flat_param_handles(module))
    schedule = FailuresConfig.from_mapping(c["failures"]).build(
        W, S, G, n_buckets, steps=steps, base_dir=None)
    fired = fired_entries(run_dir)
    pending = FailureSchedule.from_list([e.to_dict() for e in schedule.entries
                                         if e.to_dict() not in fired]) if cr else \
        FailureSchedule.from_list([])
    injector = FailureInjector(pending, replica, shard_index,
                               before_kill=lambda e: write_fault_fired(run_dir, rank, e),
                               verbose=True)
    reduce_points = _ReducePoints(module, injector.check)

    # --- the record ---------------------------------------------------------------------
    layout = []
    for fl in fh.parameter_layout(module):
        d = fl.to_dict()
        d.update(shard_index=0, start=0, end=fl.padded_numel // fl.shard_size)
        layout.append(d)
    meta = {"w_init": W, "g_init": G, "B": B, "shard_size": S, "seed": seed,
            "torch": torch.__version__, "data_fingerprint": source.fingerprint,
            "param_layout": layout, "policy": "static", "restore_enabled": True,
            "mode": mode, "processes_per_replica": S}
    if cr:
        meta.update(ckpt_interval=interval, ckpt_async=use_async,
                    max_restarts=base.max_restarts)
        write_run_files(run_dir, meta, c, schedule)
        steps_out = StepWriter(attempt_dir(run_dir, attempt), rank)
        params = ParamWriter(run_dir, rank, replica, shard_index, every=10**9,
                             final_step=steps - 1)
        recorder = None
    else:
        recorder = b.recorder(rank, replica, shard_index)
        recorder.start(meta, c, schedule)
        steps_out, params = None, recorder.params
    events("init_done")

    # --- resume (checkpoint_restart) -----------------------------------------------------
    start = 0
    if cr:
        resume = latest_checkpoint(run_dir)
        if resume is not None:
            events("ckpt_load_start", resume)
            msd, osd = get_state_dict(module, optimizer)
            state = {"model": msd, "optim": osd, "progress": {"step": torch.tensor(-1)}}
            with failstop.long_phase("checkpoint load", ckpt_bound_s):
                dcp.load(state, checkpoint_id=str(checkpoint_path(run_dir, resume)),
                         process_group=ckpt_pg)
            set_state_dict(module, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            start = int(state["progress"]["step"])
            if start != resume:
                raise RuntimeError(f"{checkpoint_path(run_dir, resume)} holds step {start}")
            events("ckpt_load_end", resume)
    is_logger = rank == 0
    if is_logger:
        print(model_line, flush=True)
        print(f"[{mode}] attempt {attempt}: " + (f"resuming at step {start} from "
                                                   f"{checkpoint_path(run_dir, start)}"
                                                   if start else "starting at step 0"),
              flush=True)

    pending_save: list[Any] = []   # the async save in flight (at most one)

    def wait_pending() -> None:
        while pending_save:
            pending_save.pop().result()

    def save_checkpoint(resume_step: int) -> None:
        path = str(checkpoint_path(run_dir, resume_step))
        with failstop.long_phase("checkpoint save", ckpt_bound_s):
            _save(path, resume_step)

    def _save(path: str, resume_step: int) -> None:
        wait_pending()                      # one save in flight at most
        events("ckpt_save_start", resume_step)
        msd, osd = get_state_dict(module, optimizer)
        state = {"model": msd, "optim": osd,
                 "progress": {"step": torch.tensor(resume_step)}}
        if use_async:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=ckpt_pg)
            events("ckpt_save_end", resume_step)
            fut.add_done_callback(lambda f, s=resume_step: events("ckpt_persisted", s))
            pending_save.append(fut)
        else:
            dcp.save(state, checkpoint_id=path, process_group=ckpt_pg)
            events("ckpt_save_end", resume_step)
            events("ckpt_persisted", resume_step)

    # --- the loop ---------------------------------------------------------------------------
    events("train_start", start)
    t_start = time.perf_counter()
    tokens = 0
    loss = float("nan")
    skipped_in_a_row = 0
    for step in range(start, steps):
        failstop.step_begins()      # progress, and the median step the auto bound scales with
        t0 = time.perf_counter()
        reduce_points.step = step
        optimizer.zero_grad(set_to_none=True)
        local_loss = torch.zeros((), dtype=torch.float64, device=device)  # no per-mb sync
        ids = [(step * G + m) * W + replica for m in range(G)]
        for m, mb_id in enumerate(ids):
            injector.check("forward", step, microbatch=m)
            x, y = source.get(mb_id)
            x = fh.to_device(x[shard_index * mbs:(shard_index + 1) * mbs], device)
            y = fh.to_device(y[shard_index * mbs:(shard_index + 1) * mbs], device)
            ctx = module.no_sync() if m < G - 1 else contextlib.nullcontext()
            with ctx:
                lm = next_token_loss(module(x), y, tokens_per_microbatch=tpm)
                injector.check("backward", step, microbatch=m)
                (lm / G).backward()      # the last one synchronizes (the `reduce` points)
            local_loss += lm.detach().double()
            failstop.tick()
        injector.check("pre_step", step)
        lr = float(lr_at(step, optim_cfg))
        for grp in optimizer.param_groups:
            grp["lr"] = lr
        # global norm after the reduction (FSDP all-reduces it on the shard group; replicas hold
        # the same grads); max_norm inf when clipping is off: a factor of exactly 1, and the norm
        # still tells a non-finite gradient, whose step is skipped as the resilient trainer does
        gnorm = float(module.clip_grad_norm_(optim_cfg.clip or float("inf")))
        skipped = not math.isfinite(gnorm)
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        if not skipped:
            optimizer.step()
        elif skipped_in_a_row > optim_cfg.max_skipped_steps:
            print(f"recover-hsdp train: {skipped_in_a_row} optimizer steps in a row (up to step "
                  f"{step}) had a NaN/inf gradient: stopping (optim.max_skipped_steps="
                  f"{optim_cfg.max_skipped_steps})", file=sys.stderr, flush=True)
            os._exit(1)
        injector.check("optimizer_step", step)
        # the step loss as the resilient trainer reports it: sum over ranks of loss/S, over B
        local_loss = local_loss.cpu()   # one host sync per step (the world group is gloo)
        dist.all_reduce(local_loss)
        failstop.tick()
        loss = float(local_loss) / (S * B)
        tokens += tokens_per_step
        rec = StepRecord(step=step, loss=loss if math.isfinite(loss) else None, tokens=tokens_per_step, alive=list(range(W)),
                         contributions={r: [(step * G + m) * W + r for m in range(G)]
                                        for r in range(W)},
                         divisor=B, extra={"skipped": True} if skipped else {},
                         local={"wall_s": round(time.perf_counter() - t0, 6), **step_resources(),
                                           "rank": rank, **({"attempt": attempt} if cr else {})})
        (steps_out.write(rec) if cr else recorder.commit(rec))
        if params.due(step):  # never a per-step copy (the writer copies the due ones)
            params.save(step, {f"flat{i}": t for i, t in enumerate(fh.local_flat_shards(module))})
        if is_logger and (step % run.log_every == 0 or step == steps - 1):
            el = time.perf_counter() - t_start
            print(f"step {step:5d}  loss {loss:7.4f}  tok/s {tokens / el:9.0f}  "
                  f"attempt {attempt}  [{mode}]", flush=True)
        if cr and (step + 1) % interval == 0 and step + 1 < steps:
            save_checkpoint(step + 1)
    with failstop.long_phase("checkpoint save", ckpt_bound_s):
        wait_pending()
    wall = time.perf_counter() - t_start
    if not cr and is_logger:
        recorder.finish(RunSummary(
            steps_committed=steps, first_step=0, last_step=steps - 1, replicas_initial=W,
            replicas_alive=list(range(W)), failures_survived=0, wall_time_s=wall,
            tokens=tokens, extra={"final_loss": loss, "mode": mode}))
    if is_logger:
        print(f"done: attempt {attempt} committed steps {start}..{steps - 1}, {wall:.1f} s; "
              f"run directory {run_dir}", flush=True)
    events("attempt_done", steps)
    events.close()
    if recorder is not None:
        recorder.close()
    if steps_out is not None:
        steps_out.close()
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    failstop.mark_done()        # a clean exit: the reaper spares the mates
    os._exit(0)
