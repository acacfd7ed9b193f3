"""HSDPULFMTrainingManager: the microbatch state machine of ReCoVer-HSDP (paper appendix C, Path 3).

The only component that touches the module and the optimizer. One `train_step()` runs one
COMMITTED iteration:

    microbatch loop (FSDP HYBRID_SHARD; shard-group collectives only, no cross-replica traffic)
      -> reduction pass: snapshot each grad shard (epoch-tagged), reduce it on the data plane
         (deferred after the loop; parallel.overlap: posted from inside the last backward)
      -> consensus: replica-consistency gate + one agreed failure view over all S groups
      -> SKIP: divide by the FIXED divisor (B = W_init x G_init), optimizer step, record, commit
         BLOCKING: rewind stale buckets, re-reduce under the new membership, consensus again
         NON_BLOCKING: rewind, run the boundary extension microbatches, reduce again

Invariant: every committed step sums exactly the microbatches the policy assigns (B for the static
policy), each once, all reduced under ONE membership, divided by policy.divisor(). Steps are never
skipped or replayed. A rank whose replica lost a member leaves by SIGKILL (ULFM must notice it).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from recover_hsdp.faults import FailureInjector, failstop, replica_lost_exit, startup
from recover_hsdp.hsdp import fsdp_hybrid as fh
from recover_hsdp.hsdp.cross_replica import HSDPCrossReplicaGroup
from recover_hsdp.hsdp.overlap import Overlap
from recover_hsdp.hsdp.step_hooks import HookedGroup, StepHooks
from recover_hsdp.hsdp.substrate import (make_substrate, resolve_mixed_precision,  # noqa: F401
                                         shard_group)
from recover_hsdp.policy import (AdaptiveWorldPolicy, DataAssignment, RestoreMode,
                                 StaticWorldPolicy, contrib_total, elect)
from recover_hsdp.recovery import StepTxnOrchestrator, Verdict

MicrobatchFn = Callable[[int, int], tuple]  # (replica, microbatch id) -> (inputs, targets)


@dataclass
class StepMetrics:
    step: int
    loss: float
    tokens: int
    alive: list[int]
    layout: dict
    boundary: bool
    restore_modes: list[str]
    failures: list[dict]
    contributions: dict[int, list[int]]
    divisor: int
    epoch: int
    wall_s: float
    grad_norm: Optional[float] = None  # global norm of the divided gradient, before clipping
    skipped: bool = False              # non-finite gradient: no optimizer update this step
    joins: list = None                 # standby joins before this step (docs/rejoin.md)
    standbys_lost: list = None         # idle standbys (rank blocks) lost in this step


class HSDPULFMTrainingManager:
    """Resilient HSDP training for a custom loop.

    model: an nn.Module initialised IDENTICALLY on every rank (same seed). auto_wrap_policy: the
    FSDP wrap policy (e.g. per decoder block). optimizer_factory(fsdp_module) -> Optimizer.
    microbatch_fn(replica, microbatch_id) -> (inputs, targets): the data OF THE ID, whichever replica
    computes it (S * micro_batch_size rows); shard rank j trains on rows [j*mbs, (j+1)*mbs).
    loss_fn(module, inputs, targets) -> the MEAN loss over the given rows (the manager scales it by
    1/S so the S ranks of a replica add up to the microbatch mean).
    lr_fn(step) -> lr, optional; set into every param group before each optimizer step.
    mixed_precision: "auto" (bf16 compute on CUDA, fp32 on CPU), "bf16", "fp32", None (= fp32)
    or an FSDP MixedPrecision (it must reduce in fp32: fsdp_hybrid.bf16_mixed_precision).
    grad_clip: clip the global gradient norm (after the cross-replica reduction and / B) to this;
    None or 0: off. A step whose reduced gradient holds NaN/inf (on any rank) is committed without
    an optimizer update (metrics.skipped; its microbatches are consumed); more than
    max_skipped_steps such steps in a row raise optim.NonFiniteGradError on every rank.
    replicate_data_plane: "ulfm" (default), "gloo" or "nccl" (async; docs/dataplane.md);
    overlap: post each bucket's reduction inside the last backward (async planes; hsdp/overlap.py).
    fsdp: 1 (FSDP1 HYBRID_SHARD) or 2 (fully_shard over the shard group; docs/fsdp2.md).
    """

    def __init__(self, model: nn.Module, *, optimizer_factory: Callable[[nn.Module], Any],
                 microbatch_fn: MicrobatchFn,
                 loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
                 replicas: int, shard_size: int, grad_accum: int,
                 auto_wrap_policy=None, policy: str = "static",
                 device: Optional[torch.device] = None,
                 lr_fn: Optional[Callable[[int], float]] = None,
                 failure_schedule=None, recorder=None,
                 restore_enabled: bool = True,
                 shard_timeout_s: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None,
                 mixed_precision: Any = "auto",
                 grad_clip: Optional[float] = None,
                 max_skipped_steps: int = 3, standby: int = 0,
                 replicate_data_plane: str = "ulfm", overlap: bool = False, fsdp: int = 1):
        fh.check_torch_version()
        from recover_hsdp.hsdp.topology import limit_core_dumps

        limit_core_dumps()      # also when the caller initialised torch.distributed itself
        if not dist.is_initialized():
            fh.init_distributed_from_env(backend="gloo")
        from recover_hsdp.collectives import UlfmGroup

        self.rank = dist.get_rank()
        self.standby = int(standby)  # hot standbys (docs/rejoin.md): extra replicas, idle
        self.topo = fh.HybridTopology.for_world(replicas + self.standby, shard_size, self.rank,
                                                dist.get_world_size())
        self.S = shard_size
        self.replica = self.topo.replica
        self.shard_index = self.topo.shard_index
        self.device = device or fh.local_device()
        self.shard_pg = shard_group(self.topo, timeout_s=shard_timeout_s, device=self.device)
        startup.mark_phase("groups")   # start-up progress (faults/startup.py)
        self.world = UlfmGroup.world()
        self.mixed_precision = resolve_mixed_precision(mixed_precision, self.device)
        self.substrate = make_substrate(fsdp)   # the one FSDP seam (hsdp/substrate/)
        self.module = self.substrate.wrap(
            model, self.shard_pg, auto_wrap_policy=auto_wrap_policy, device=self.device,
            topology=self.topo, mixed_precision=self.mixed_precision)
        startup.mark_phase("wrapped")
        self.grad_clip = float(grad_clip) if grad_clip else None
        self.max_skipped_steps = int(max_skipped_steps)
        self.skipped_in_a_row = 0
        self._buckets: list[torch.Tensor] = []
        #: called right before each optimizer step (e.g. wait for a parameter snapshot's copy)
        self.before_optimizer_step: Optional[Callable[[], None]] = None
        self.optimizer = optimizer_factory(self.module)
        self.acc = self.substrate.accumulator(self.module)
        if policy == "static":
            self.policy = StaticWorldPolicy(replicas, grad_accum)
        elif policy == "adaptive":
            self.policy = AdaptiveWorldPolicy(replicas, grad_accum)
        else:
            raise ValueError(f"policy must be 'static' or 'adaptive' (got {policy!r})")
        self.data = DataAssignment(replicas)
        self.microbatch_fn = microbatch_fn
        self.loss_fn = loss_fn
        self.lr_fn = lr_fn
        self.restore_enabled = restore_enabled
        self.recorder = recorder
        self.injector = FailureInjector(failure_schedule or [], self.replica, self.shard_index,
                                        before_kill=getattr(recorder, "fault_fired", None),
                                        verbose=True)
        #: fault injection, fail-stop context and the test seams: one call per point of the step
        self.hooks = StepHooks(self)
        self.log = log or (lambda s: None)
        self.step = 0
        # any error in this rank becomes a fail-stop the survivors see (docs/faults.md)
        failstop.configure(getattr(recorder, "run_dir", None), self.rank, self.replica)
        failstop.install_hooks()
        self._fail_kill: Optional[Callable[[], None]] = None  # tests: replaces the SIGKILL
        self.heartbeat = failstop.start_heartbeat(
            getattr(recorder, "run_dir", None) or os.environ.get(failstop.ENV_RUN_DIR), self.rank)
        # MPI answers its peers while this thread is in gloo (collectives/progress.py)
        if hasattr(self.world, "poll_failures"):
            from recover_hsdp.collectives.progress import MpiProgress

            self.mpi_progress = MpiProgress(self.world).start()
        self.cross = HSDPCrossReplicaGroup(
            world=self.world, replicas=replicas, shard_size=shard_size, global_rank=self.rank,
            make_group=UlfmGroup.from_ranks, shard_barrier=self._shard_barrier,
            elect=elect, contrib_total=contrib_total,
            checkpoint=lambda location: self.hooks.at(location, self.step),
            standby=self.standby, data_plane=replicate_data_plane,
            plane_options={"timeout_s": shard_timeout_s, "log": log})
        self.joins: list[dict] = []   # join entries for the next step's record (rejoin.md)
        self._lost_seen = 0           # cross.standbys_lost already in a step's metrics
        self.failures_survived = 0
        self._tokens_per_mb: Optional[int] = None
        self.orch = None if self.is_standby else self._make_orchestrator()
        self.overlap = Overlap(self, overlap)   # parallel.overlap (hsdp/overlap.py)
        from recover_hsdp.faults.gate import Gate
        from recover_hsdp.hsdp.fault_seam import RunFaults, install_nondeterminism

        seam = RunFaults.from_env()  # test only: None unless RECOVER_HSDP_TEST_FAULT allowed
        # False on CUDA (SDPA's backward adds atomically) unless torch's deterministic mode is
        # on, and under the test seam RECOVER_HSDP_TEST_NONDET (verify: docs/verify.md)
        self.deterministic = not install_nondeterminism() and (
            self.device.type == "cpu" or torch.are_deterministic_algorithms_enabled())
        self.hooks.seam, self.hooks.gate = seam, Gate.from_env(self.rank)  # gate: test only

    def _make_orchestrator(self) -> StepTxnOrchestrator:
        self.orch = StepTxnOrchestrator(
            HookedGroup(self.cross, self.hooks, lambda: self.step, self._set_grad_stats),
            self.policy,
            self.cross.replica_of_rank if self.standby else self.topo.replica_of_rank,
            restore_enabled=self.restore_enabled, log=self.log)
        return self.orch

    # --- hot standbys (recover_hsdp/hsdp/standby.py, docs/rejoin.md) --------------
    @property
    def is_standby(self) -> bool:
        """An idle standby replica (not promoted yet): call standby_wait(), not train_step()."""
        return self.cross.is_standby

    def standby_wait(self) -> bool:
        """On a standby rank: wait until promoted (True: train from self.step on) or released
        at the end of the run (False)."""
        from recover_hsdp.hsdp.standby import standby_wait

        return standby_wait(self)

    def join_step(self) -> Optional[dict]:
        """On every active rank after a committed step: promote a standby into a lost replica's
        slot if one is needed and left (one per boundary). The entry also goes into the next
        step's metrics (``joins``)."""
        from recover_hsdp.hsdp.standby import join_step

        entry = join_step(self) if self.standby else None
        if entry is not None:
            self.joins.append(entry)
        return entry

    def release_standbys(self) -> None:
        """On every active rank at the end of training: let the idle standbys exit."""
        from recover_hsdp.hsdp.standby import release_standbys

        if self.standby:
            release_standbys(self)

    # --- the rejoin policy (docs/rejoin.md): standbys first, then a full-width relaunch ------
    def relaunch_due(self) -> bool:
        """After a commit, on every active rank (agreed state, same answer everywhere): fewer
        than ``replicas`` slots alive and no standby left to take one. Then a custom loop calls
        ``save_for_relaunch(run_dir)`` and exits (os._exit(0)); its launcher starts the same
        job again at full width and every rank resumes with ``load(run_dir)``."""
        return (len(self.policy.alive) < self.policy.w_init
                and not (self.standby and self.cross.pool))

    def save_for_relaunch(self, run_dir) -> float:
        """Every active rank, at the same step boundary: release the idle standbys, then a
        synchronous checkpoint of the state before step ``self.step`` marked ``exit: rejoin``
        (what ``recover-hsdp train``'s launcher reads to count it against run.max_rejoins).
        Returns the seconds held."""
        self.release_standbys()
        ck = self.checkpointer(run_dir)
        ck.exit_reason = "rejoin"
        ck.note_commit()
        return ck.save(self.step, sync=True)

    def set_failure_schedule(self, schedule, before_kill=None) -> None:
        """Install the failure simulator's schedule: a FailureSchedule, or a list of entries
        ({step, replica, local_rank, location, microbatch|bucket}), validated here against this
        job (ScheduleError names the bad entry)."""
        from recover_hsdp.faults import FailureSchedule

        if not isinstance(schedule, FailureSchedule):
            schedule = FailureSchedule.from_list(list(schedule or []))
        schedule.validate(self.topo.replicas, self.S, start_step=self.step,
                          n_buckets=len(self.substrate.bucket_names(self.module)))
        self.injector = FailureInjector(schedule, self.replica, self.shard_index,
                                        before_kill=before_kill, verbose=True)

    # --- helpers --------------------------------------------------------------------------
    def _set_grad_stats(self) -> None:
        from recover_hsdp.optim import grad_sq_norm

        sq, nonfinite = grad_sq_norm(self._buckets)
        self.cross.set_grad_stats(sq, nonfinite)

    def _shard_barrier(self) -> None:
        if self.S > 1:
            from recover_hsdp.hsdp.topology import shard_barrier

            shard_barrier(self.shard_pg, self.device)   # device_ids on NCCL

    def exit_replica_lost(self, exc: BaseException) -> None:
        """A shard-group collective failed: this replica lost a member, so this rank leaves by
        SIGKILL (one line on stderr) for the survivors to see. Never returns."""
        replica_lost_exit(f"rank {self.rank} (replica {self.replica}): shard group failed: "
                          f"{str(exc).splitlines()[0][:200]}")

    def local_rows(self, x: torch.Tensor) -> torch.Tensor:   # rows [j*mbs, (j+1)*mbs)
        mbs = x.shape[0] // self.S
        return x[self.shard_index * mbs:(self.shard_index + 1) * mbs]

    def activate(self) -> None:
        """A standby just promoted into a slot (hsdp/standby.py), its state installed: the
        standbys lost so far are in the survivors' earlier records; build its orchestrator."""
        self._lost_seen = len(self.cross.standbys_lost)
        self._make_orchestrator()

    @property
    def alive_replicas(self) -> tuple[int, ...]:
        return self.policy.alive

    # --- one committed iteration -----------------------------------------------------------
    def train_step(self) -> StepMetrics:
        """Run one iteration to its commit (failures included) and return its metrics.

        Any exception inside (microbatch_fn, loss_fn, backward, the optimizer step, the
        protocol) is a fail-stop: logged to the run record, then this rank leaves by SIGKILL so
        that the survivors see a failure (a raised exception would exit non-zero, which ULFM does
        not notice). A shard-group collective error means this replica lost a member."""
        try:
            self.hooks.step_begins()   # progress: the step clock of the watchdog, start-up's end
            return self._train_step()
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, SystemExit) and e.code in (0, None):
                raise
            self.hooks.fail_stop(e, kill=self._fail_kill)
            raise

    def _train_step(self) -> StepMetrics:
        """The paper's step (appendix C): microbatch loop, snapshot + deferred reduce, consensus
        (recovery inside it: a rewind, or EXTEND with the boundary microbatches), optimizer."""
        hooks, step = self.hooks, self.step
        hooks.before_step(step)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)  # keep the bucket tensors (snapshot targets)
        self.acc.reset()
        self.orch.begin_iteration()
        base = self.policy.steps()
        m, loss_sum = 0, 0.0
        while True:   # one pass: the iteration's microbatches, then (boundary) its extension
            while m < self.policy.steps():
                loss_sum = self._microbatch(step, m, base, loss_sum)
                m += 1
                hooks.microbatch_done()
                self.orch.note_microbatch(m)
            buckets = self._reduce(step, loss_sum)
            if self._consensus(step) is Verdict.COMMIT:
                break
        hooks.pre_step(step)
        divisor = self.policy.divisor()   # fixed (B for the static policy), never the live world
        grad_norm, skipped = self._divide(buckets, divisor)
        self._optimizer_step(step, skipped)
        hooks.after_step(step)
        return self._commit(step, divisor, grad_norm, skipped, t0)

    def _microbatch(self, step: int, m: int, base: int, loss_sum):
        """Forward + backward of microbatch m of the pass (shard group only); its shard adds
        into the buckets when kept. -> the kept loss sum (device, float64: no host sync)."""
        hooks, ext = self.hooks, m >= base
        self.orch.wait_restore_before_backward()   # an extension pass's rewound buckets
        mb_id = self.data.microbatch_id(self.replica, m)
        keep = self.policy.keeps(self.replica, m)
        hooks.before_microbatch(step, m, base)
        x, y = self.microbatch_fn(self.replica, mb_id)
        x = fh.to_device(self.local_rows(x), self.device)   # no host sync on CUDA
        y = fh.to_device(self.local_rows(y), self.device)

        def closure():
            hooks.before_forward(step)
            loss = self.loss_fn(self.module, x, y) / self.S
            hooks.before_backward(step, m, ext)
            return loss

        try:
            c = hooks.contribute(step, m, keep)
            last = m == self.policy.steps() - 1   # the pass's last microbatch (so far)
            with self.overlap.microbatch(last, c):   # last backward: post final shards (overlap)
                loss = self.acc.microbatch(closure, contribute=c, last=last)
            hooks.after_microbatch(step, m, keep, mb_id)
        except RuntimeError as e:
            if fh.shard_group_failure_kind(e) is None:
                raise
            self.exit_replica_lost(e)
        if self._tokens_per_mb is None:
            self._tokens_per_mb = int(y.numel()) * self.S
        return loss_sum + loss.to(torch.float64) if keep else loss_sum

    def _reduce(self, step: int, loss_sum) -> list[torch.Tensor]:
        """The cross-replica reduction after the loop (overlap: what the last backward left)."""
        self.cross.set_loss_sum(float(loss_sum))
        buckets = self._buckets = self.substrate.buckets(self.module)
        self.hooks.before_reduce(step, buckets)
        for t in buckets:
            self.orch.enqueue_bucket(t)
        self.orch.fire_deferred_allreduces()
        return buckets

    def _consensus(self, step: int) -> Verdict:
        """Gate + one agreed failure view over the S replicate groups: COMMIT or EXTEND."""
        self.hooks.before_consensus(step)
        verdict = self.orch.consensus()
        self.hooks.after_consensus()
        return verdict

    def _divide(self, buckets: list[torch.Tensor], divisor: int) -> tuple[float, bool]:
        """bucket /= B, clipped; (the divided gradient's global norm, skipped: non-finite)."""
        from recover_hsdp.optim import clip_coef

        divisor = self.hooks.divisor(self.step, divisor)   # the test seam only (fault_seam.py)
        res = self.cross.last_result
        skipped = bool(res.grad_nonfinite)
        grad_norm = (res.grad_sq_norm ** 0.5) / divisor if not skipped else float("inf")
        coef = clip_coef(grad_norm, self.grad_clip)
        with torch.no_grad():
            for t in buckets:
                t.div_(divisor)
                if coef < 1.0:
                    t.mul_(coef)
        return grad_norm, skipped

    def _optimizer_step(self, step: int, skipped: bool) -> None:
        if self.lr_fn is not None:
            lr = float(self.lr_fn(step))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        if skipped:
            self.skipped_in_a_row += 1
            self.log(f"step {step}: non-finite gradient: optimizer update skipped "
                     f"({self.skipped_in_a_row} in a row)")
            return
        self.skipped_in_a_row = 0
        if self.before_optimizer_step is not None:
            self.before_optimizer_step()
        self.hooks.before_optimizer_step(step)
        self.optimizer.step()
        self.hooks.after_optimizer_step()

    def _commit(self, step: int, divisor: int, grad_norm: float, skipped: bool,
                t0: float) -> StepMetrics:
        """The step's record: contributions, loss, failures; then the iteration commits."""
        pol, orch, res = self.policy, self.orch, self.cross.last_result
        layout = pol.layout.as_dict()
        alive = list(pol.alive)
        boundary = bool(pol.at_boundary)
        contributions = self.data.commit(pol)  # before after_commit: case (b) keeps dead ids
        log = orch.iteration_log
        modes = list(log.modes) or [RestoreMode.SKIP.value]
        failures = [dict(f) for f in log.failures]
        self.failures_survived += sum(len(f.get("replicas", ())) for f in failures)
        # loss: the agreed per-replica kept-loss sums of the final consensus, over the replicas
        # that contributed (a case-(b) dead replica's share is committed but its loss is unknown)
        num = den = 0.0
        for r, ls in zip(self.cross.alive, res.loss_sums):
            if contributions.get(r):
                num += ls
                den += len(contributions[r])
        n_committed = sum(len(v) for v in contributions.values())
        metrics = StepMetrics(
            step=step, loss=(num / den) if den else float("nan"),
            tokens=n_committed * (self._tokens_per_mb or 0), alive=alive, layout=layout,
            boundary=boundary, restore_modes=modes, failures=failures,
            contributions={int(r): list(v) for r, v in contributions.items()},
            divisor=divisor, epoch=self.cross.epoch, wall_s=time.perf_counter() - t0,
            grad_norm=grad_norm, skipped=skipped, joins=self.joins or None,
            standbys_lost=self.cross.standbys_lost[self._lost_seen:] or None)
        self.joins = []
        self._lost_seen = len(self.cross.standbys_lost)
        orch.after_successful_commit()
        self.step += 1
        if skipped and self.skipped_in_a_row > self.max_skipped_steps:
            from recover_hsdp.optim import NonFiniteGradError

            raise NonFiniteGradError(
                f"{self.skipped_in_a_row} optimizer steps in a row (up to step {step}) had a "
                f"NaN/inf gradient: stopping (optim.max_skipped_steps={self.max_skipped_steps})")
        return metrics

    # --- checkpoint / resume for custom loops (recover_hsdp/hsdp/checkpoint.py) ------
    def checkpointer(self, run_dir, *, use_async: bool = True):
        """The DCP checkpointer of this manager under ``run_dir``. Its first call creates one gloo
        group per replica (a collective over the whole world): make it on EVERY rank right after
        the manager, before any failure."""
        from recover_hsdp.hsdp.checkpoint import ResilientCheckpointer

        if getattr(self, "_ckpt", None) is None:
            self._ckpt = ResilientCheckpointer(self, run_dir, use_async=use_async)
        return self._ckpt

    def save(self, run_dir, *, sync: bool = False) -> float:
        """Checkpoint the state after the last committed step into
        ``run_dir/checkpoints/step_{N}`` (N = self.step). Call on every rank at the same step;
        the lowest alive replica writes (asynchronously unless sync). Returns seconds held."""
        ck = self.checkpointer(run_dir)
        ck.note_commit()
        return ck.save(self.step, sync=sync)

    def wait_saved(self) -> None:
        """Wait for an asynchronous save to be complete on disk (call before exiting)."""
        if getattr(self, "_ckpt", None) is not None:
            self._ckpt.wait()

    def load(self, path) -> dict:
        """Resume from a checkpoint directory (``.../checkpoints/step_N``) or the newest complete
        one under a run directory: model, optimizer, step, data position, RNG. The world may
        have another replica count / shard size (B must be kept). Returns its state.json."""
        from pathlib import Path

        from recover_hsdp.record.checkpoint import latest_complete

        p = Path(path)
        if not (p / "COMPLETE").is_file():
            found = latest_complete(p, warn=self.log)
            if found is None:
                raise FileNotFoundError(f"{path}: no complete checkpoint")
            p = found[0]
        ck = self.checkpointer(p.parent.parent)
        return ck.load(p)
