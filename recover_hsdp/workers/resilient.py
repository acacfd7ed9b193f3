"""The per-rank worker behind `recover-hsdp train`: config -> model, data, manager, run record.

Started by mpirun (--with-ft ulfm), one process per rank. Every rank writes its own fsync'd record
of each committed step, so a kill of any rank (global rank 0 included) loses nothing; the progress
line is printed by the first rank of the lowest surviving replica, which moves when that replica
dies.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from recover_hsdp.config import config_dict
from recover_hsdp.workers.build import RankBuild


def run_worker(cfg: Any) -> int:
    """Train per the resolved config on this MPI rank. Returns 0 when every step committed.

    ``cfg``: the TrainConfig the launcher validated (or its file, or a DictConfig over it)."""
    from recover_hsdp.faults import FailuresConfig
    from recover_hsdp.optim import NonFiniteGradError
    from recover_hsdp.record import RunSummary, StepRecord
    from recover_hsdp.record.params import params_disk

    b = RankBuild.from_config(cfg)  # tokenizer, model, optimizer, data, loss, recorder
    cfg = b.cfg
    c = config_dict(cfg)            # what the run directory's config.yaml records
    par, run = cfg.parallel, cfg.run
    W, S, G = par.replicas, par.shard_size, par.grad_accum
    steps, seed = run.steps, run.seed
    run_dir = b.run_dir
    from recover_hsdp.faults import failstop
    from recover_hsdp.hsdp.topology import CKPT_SAVE_BOUND_S

    failstop.configure(run_dir)  # errors/rank{g}.json + traceback before a fail-stop
    torch.set_num_threads(run.omp_num_threads)

    model = b.model()
    n_params = sum(p.numel() for p in model.parameters())     # as built, before sharding
    w0 = _source_width(W)       # sources by INITIAL slice (a resume may change W)

    device = rank_device(run.gpus_per_node, S, run.device)
    model_line = b.model_line(model)   # the parameter count as built (before wrapping)
    mgr = b.manager(model, width=w0, device=device)   # every config keyword: build.py
    if _is_logger(mgr):
        print(model_line, flush=True)
    n_buckets = len(mgr.substrate.bucket_names(mgr.module))
    schedule = FailuresConfig.from_mapping(c["failures"]).build(
        W + mgr.standby, S, G, n_buckets, steps=steps, base_dir=None)
    from recover_hsdp.record.params import snapshot_every, snapshots_kept

    shard_bytes = sum(t.numel() * t.element_size()
                      for t in mgr.substrate.param_shards(mgr.module))
    every = snapshot_every(run.save_params_every, shard_bytes)
    keep_params = snapshots_kept(cfg.checkpoint.keep_params, shard_bytes * W * S)
    recorder = b.recorder(mgr.rank, mgr.replica, mgr.shard_index, params_every=every,
                          params_keep=keep_params)
    mgr.set_failure_schedule(schedule, before_kill=recorder.fault_fired)
    # meta.json must be byte-identical on every rank: describe the layout as seen by shard 0
    # (its shard_from_full derives any shard j; hsdp/layout.py)
    layout = [fl.for_shard0() for fl in mgr.substrate.layout(mgr.module)]
    fp_slice = 0 if mgr.is_standby else mgr.replica % w0   # a standby has no slice until promoted
    fingerprint = b.source(fp_slice, w0).fingerprint
    meta = {"w_init": W, "g_init": G, "B": W * G, "shard_size": S, "seed": seed,
            "torch": torch.__version__, "data_fingerprint": fingerprint, "param_layout": layout,
            **mgr.substrate.describe(mgr.module),   # fsdp=2: what was built
            "policy": cfg.policy.name,
            "restore_enabled": mgr.restore_enabled, "save_params_every": every,
            "keep_params": keep_params, "processes_per_replica": S,
            **({"standby": mgr.standby} if mgr.standby else {}),   # idle standby replicas
            "mixed_precision": mgr.mixed_precision if isinstance(mgr.mixed_precision, str)
            else "custom", "device": mgr.device.type,
            "deterministic": mgr.deterministic,   # False: verify's nondeterministic tolerance
            "mode": "drop_and_go" if cfg.policy.name == "adaptive" else "resilient"}
    snaps = ParamSnapshots(mgr, recorder)
    mgr.before_optimizer_step = snaps.before_optimizer_step
    ck = _ckpt_setup(mgr, c, run_dir, fingerprint)                 # None when off
    if ck is not None and ck.resumed is not None:
        recorder.resume_segment(ck.segment)
        if not ck.params_comparable():      # another S than meta.json's: no snapshots to compare
            recorder.params.every, recorder.params.final_step = 0, None
        mgr.set_failure_schedule(_ckpt_schedule(schedule, run_dir, mgr.step),
                                 before_kill=recorder.fault_fired)
    else:
        recorder.start(meta, c, schedule)
        snaps.save_initial()
    if mgr.is_standby and not mgr.standby_wait():   # idle until promoted (docs/rejoin.md)
        snaps.close()
        recorder.close()
        failstop.mark_done()
        os._exit(0)
    log_every = run.log_every
    from recover_hsdp.workers.progress import Progress, flops_per_token, peak_flops

    mc = b.model_cfg
    prog = Progress(steps, mgr.step, flops_per_token(n_params, mc.n_layers, mc.d_model,
                                                     par.seq_len), peak_flops(mgr.device))
    t_start = time.perf_counter()
    tokens = 0
    last = None
    tb = None  # TensorBoard writer of the current logging rank, when tensorboard is installed
    for step in range(mgr.step, steps):
        try:
            mt = mgr.train_step()
        except NonFiniteGradError as e:
            snaps.close()
            if _is_logger(mgr):
                print(f"recover-hsdp train: {e}", file=sys.stderr, flush=True)
            failstop.mark_done()            # every rank stops here alike (an agreed flag)
            os._exit(1)
        tokens += mt.tokens
        el = time.perf_counter() - t_start
        # lr, grad norm (finite only), ETA, MFU where the device's peak is known (progress.py)
        pf = prog.fields(mt.step, mgr.optimizer.param_groups[0]["lr"], mt.grad_norm, tokens, el,
                         len(mt.alive) * S)
        local = {"wall_s": round(mt.wall_s, 6), "rank": mgr.rank, **step_resources(),
                 "bucket_epochs": mgr.orch.bucket_epochs(), **pf}
        if mgr.overlap.enabled:   # buckets posted from inside a backward so far (overlap)
            local["posted_early"] = mgr.overlap.posted_early
        if mgr.orch.iteration_log.exposed_s:   # end of the loop -> every bucket reduced (s)
            local["reduce_exposed_s"] = round(mgr.orch.iteration_log.exposed_s[0], 6)
        local["consensus_s"] = round(mgr.orch.iteration_log.consensus_s, 6)  # gate + control
        local.update(getattr(mgr, "join_transfer", None) or {})   # a join's broadcasts (standby.py)
        mgr.join_transfer = None
        recorder.commit(StepRecord(
            step=mt.step, loss=mt.loss if math.isfinite(mt.loss) else None, tokens=mt.tokens,
            alive=mt.alive, layout=mt.layout,
            boundary=mt.boundary,
            restore_mode=None if mt.restore_modes == ["skip"] else ",".join(mt.restore_modes),
            failures=mt.failures, divisor=mt.divisor,
            contributions=ck.contributions(mt.contributions) if ck else mt.contributions,
            epoch=mt.epoch, extra={**({"skipped": True} if mt.skipped else {}),
                                   **({"joins": mt.joins} if mt.joins else {}),
                                   **({"standbys_lost": mt.standbys_lost}
                                      if mt.standbys_lost else {})}, local=local))
        snaps.after_commit(mt.step)  # only when due; on CUDA an async copy to pinned memory
        last = mt
        if _is_logger(mgr):
            tb = tb if tb is not None else _tensorboard(run_dir, mgr.rank)
            if tb:
                tb.add_scalar("loss", mt.loss, mt.step)
                tb.add_scalar("alive_replicas", len(mt.alive), mt.step)
                tb.add_scalar("tokens_per_s", mt.tokens / mt.wall_s if mt.wall_s else 0.0, mt.step)
                for k in ("lr", "grad_norm", "mfu"):
                    if k in pf:
                        tb.add_scalar(k, pf[k], mt.step)
                tb.flush()
        if _is_logger(mgr) and (step % log_every == 0 or mt.failures or mt.standbys_lost
                                or step == steps - 1):
            ev = "".join(f" | lost standby {p}" for p in mt.standbys_lost or ())
            if mt.failures:
                ev += " | lost replicas " + ",".join(str(r) for f in mt.failures
                                                   for r in f["replicas"])
                ev += f" -> {'/'.join(mt.restore_modes)}" + (" (boundary)" if mt.boundary else "")
            print(prog.line(mt.step, mt.loss, pf, mt.grad_norm, tokens / el,
                            f"{len(mgr.policy.alive)}/{W}", mgr.policy.layout.g) + ev, flush=True)
        if ck is not None:      # after the step's line: a stop request exits here
            ck.after_commit(steps)                 # periodic save
        if mgr.standby and step < steps - 1:
            with failstop.long_phase("rejoin heal", CKPT_SAVE_BOUND_S):   # moves a state
                j = mgr.join_step()                # a standby into a lost slot (rejoin.md)
            if j and _is_logger(mgr):
                print(f"join before step {step + 1}: slot {j['replica']} <- standby "
                      f"{j['standby']}: {j['outcome']}", flush=True)
    mgr.release_standbys()
    with failstop.long_phase("final saves", CKPT_SAVE_BOUND_S):
        snaps.close()
        if ck is not None:
            ck.wait()          # the last save COMPLETE and pruned before summary.json says so
    wall = time.perf_counter() - t_start
    summary = RunSummary(
        steps_committed=mgr.step, first_step=0, last_step=mgr.step - 1, replicas_initial=W,
        replicas_alive=list(mgr.policy.alive),
        failures_survived=mgr.failures_survived if mgr.standby else W - len(mgr.policy.alive),
        wall_time_s=wall, tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else None,
        faults=mgr.injector.outcome(mgr.step, mgr.policy.alive),
        extra={**({"slot_blocks": {str(r): p for r, p in mgr.cross.phys.items() if r != p},
                   "standbys_lost": list(mgr.cross.standbys_lost),
                   "standbys_left": list(mgr.cross.pool)} if mgr.standby else {}),
               "final_loss": getattr(last, "loss", None)
               if math.isfinite(getattr(last, "loss", 0.0)) else None,
               **(ck.summary() if ck else {"disk": params_disk(run_dir)})})
    recorder.finish(summary)
    recorder.close()
    if _is_logger(mgr):
        print(f"done: {mgr.step}/{steps} steps committed, {summary.failures_survived} replica "
              f"failures survived, {wall:.1f} s, {summary.tokens_per_s or 0:.0f} tok/s; "
              f"run directory {run_dir}", flush=True)
    sys.stdout.flush()
    failstop.mark_done()
    # ULFM: a clean MPI_Finalize after failures may hang (ompi #11404); leave without it.
    os._exit(0 if mgr.step == steps else 1)


def _ckpt_setup(mgr, c: Mapping, run_dir: Path, fingerprint: str):
    """Checkpointing of this segment (recover_hsdp/hsdp/checkpoint.py), or None."""
    from recover_hsdp.hsdp.checkpoint import TrainerCheckpointing

    return TrainerCheckpointing.from_config(mgr, c, run_dir, fingerprint)


def _source_width(W: int) -> int:
    """W_init of the run: the first launch's width, read from the checkpoint a resumed segment
    starts from (its data slices stay the first launch's; docs/checkpoint.md)."""
    from recover_hsdp.hsdp.checkpoint import resume_w_init

    return resume_w_init() or W


def _ckpt_schedule(schedule, run_dir: Path, start: int):
    from recover_hsdp.hsdp.checkpoint import remaining_schedule

    return remaining_schedule(schedule, run_dir, start)


def step_resources() -> dict:
    """This process's peak host RSS and, on CUDA, its peak GPU memory (MiB), for the step record
    (`bench gpu` reads them; the writer adds the commit time `local.time` itself)."""
    import resource

    out = {"rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def rank_device(gpus_per_node: Any, shard_size: int = 1,
                device: Any = "auto") -> torch.device | None:
    """The device of this rank: ``run.device`` cpu -> cpu (even on a GPU machine: shard groups
    on gloo, verify on cpu); otherwise cuda:(local rank % gpus_per_node) when CUDA is available
    (topology.cuda_index, the one mapping; gpus_per_node null: every visible GPU).

    Several ranks may share one GPU; the S ranks of one replica must sit on S distinct GPUs
    (NCCL refuses two ranks of one communicator on one device): that is checked on the devices
    the ranks hold when the shard groups are made (topology.check_distinct_devices), not here
    on device_count() (a rank bound by CUDA_VISIBLE_DEVICES sees one GPU). ``shard_size`` is
    kept for callers. None on a machine without CUDA (the manager then picks cpu).
    """
    from recover_hsdp.hsdp.topology import local_device

    kind = str(device or "auto")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if kind == "cuda":
            raise ValueError("run.device=cuda but CUDA is not available on this machine")
        return None
    return local_device(gpus_per_node)


class ParamSnapshots:
    """The verifier's parameter snapshots, taken only for the steps the recorder says are due.

    Never a copy per step. On CUDA the copy goes to pinned host buffers (allocated once) on a
    side stream, ordered after the committed optimizer step by an event, and the file is written
    by a background thread; the next optimizer step waits (on the device, not the host) for the
    copy to finish before it may change the parameters. On CPU: a plain copy and write.
    """

    def __init__(self, mgr, recorder):
        self.mgr, self.recorder = mgr, recorder
        self._shards = lambda: mgr.substrate.param_shards(mgr.module)
        self.cuda = mgr.device is not None and torch.device(mgr.device).type == "cuda"
        self._host: list[torch.Tensor] = []
        self._stream = torch.cuda.Stream(device=mgr.device) if self.cuda else None
        self._done = None          # event: the last copy finished
        self._thread = None
        self.copies = 0            # snapshots taken (tests: == the due steps, never per step)

    def due(self, step: int) -> bool:
        return self.recorder.params.due(step)

    def save_initial(self) -> None:
        self._take(-1, force=True)

    def before_optimizer_step(self) -> None:
        # the parameters may change only after the copy of the last snapshot has finished: a
        # device-side wait (the host does not block), on the optimizer's stream
        if self._done is not None:
            torch.cuda.current_stream(self.mgr.device).wait_event(self._done)
            self._done = None

    def after_commit(self, step: int) -> None:
        if self.due(step):
            from recover_hsdp.faults import failstop

            # an announced long phase: the write (CPU) or the wait for the previous one (CUDA)
            # moves a shard of the parameters, bounded by bytes over a floor bandwidth
            with failstop.long_phase("parameter snapshot", self.bound_s()):
                self._take(step)

    def bound_s(self) -> float:
        """max(60 s, this rank's shard bytes / SNAPSHOT_FLOOR_BPS)."""
        n = sum(t.numel() * t.element_size() for t in self._shards())
        return max(60.0, n / SNAPSHOT_FLOOR_BPS)

    def _take(self, step: int, force: bool = False) -> None:
        self.copies += 1
        src = self._shards()
        if not self.cuda:
            # the writer copies them (a view of FSDP's flat parameter is cloned there)
            self._write(step, {f"flat{i}": t for i, t in enumerate(src)}, force)
            return
        self._join()  # the buffers are reused: the previous write must be done
        if len(self._host) != len(src) or any(h.numel() != t.numel() or h.dtype != t.dtype
                                              for h, t in zip(self._host, src)):
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
        self._stream.wait_stream(torch.cuda.current_stream(self.mgr.device))
        with torch.cuda.stream(self._stream):
            for h, t in zip(self._host, src):
                h.copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._done = done
        import threading

        host = {f"flat{i}": h for i, h in enumerate(self._host)}

        def write():
            done.synchronize()
            self._write(step, host, force)

        self._thread = threading.Thread(target=write, name=f"snapshot-{step}", daemon=True)
        self._thread.start()

    def _write(self, step: int, tensors: dict, force: bool) -> None:
        if step == -1:
            self.recorder.save_initial_params(tensors)
        else:
            self.recorder.save_params(step, tensors, force=force)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._join()


#: the floor bandwidth a parameter snapshot's announced bound is derived from (50 MB/s)
SNAPSHOT_FLOOR_BPS = 50e6


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


if __name__ == "__main__":  # mpirun ... python -m recover_hsdp.workers.resilient CONFIG.yaml
    if len(sys.argv) != 2:
        print("usage: python -m recover_hsdp.workers.resilient RESOLVED_CONFIG.yaml", file=sys.stderr)
        sys.exit(2)
    from recover_hsdp.faults import failstop

    failstop.install_hooks()  # an error in a rank is a fail-stop the survivors see
    sys.exit(failstop.run_failstop(run_worker, sys.argv[1], where="trainer"))
