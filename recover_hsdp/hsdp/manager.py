"""HSDPULFMTrainingManager: the microbatch state machine of ReCoVer-HSDP (paper appendix C, Path 3).

The only component that touches the module and the optimizer. One `train_step()` runs one
COMMITTED iteration:

    microbatch loop (FSDP HYBRID_SHARD; shard-group collectives only, no cross-replica traffic)
      -> reduction pass: snapshot each accumulated grad shard (epoch-tagged), reduce it on its
         ULFM replicate group (deferred: after the loop, never inside backward)
      -> consensus: replica-consistency gate + one agreed failure view over all S groups
      -> SKIP: divide by the FIXED divisor (B = W_init x G_init), optimizer step, record, commit
         BLOCKING: rewind stale buckets, re-reduce under the new membership, consensus again
         NON_BLOCKING: rewind, run the boundary extension microbatches, reduce again

Invariant: every committed step sums exactly the microbatches the policy assigns (B for the static
policy), each once, all reduced under ONE membership, divided by policy.divisor(). Steps are never
skipped or replayed. A rank whose replica lost a member leaves by SIGKILL (ULFM must notice it).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from recover_hsdp.faults import FailureInjector, replica_lost_exit
from recover_hsdp.hsdp import fsdp_hybrid as fh
from recover_hsdp.hsdp.cross_replica import HSDPCrossReplicaGroup, ReplicaResult
from recover_hsdp.policy import (AdaptiveWorldPolicy, DataAssignment, FailureEvent, RestoreMode,
                                 StaticWorldPolicy, contrib_total, elect)

MicrobatchFn = Callable[[int, int], tuple]  # (replica, microbatch id) -> (inputs, targets)


class _Buckets:
    """Per-bucket pre-reduce snapshots S(b), tagged with the epoch they were taken under.

    One fp32 buffer per bucket, allocated once and reused every iteration (no per-step
    allocation after the first). A bucket is stale when its last reduction is not known to have
    completed under the current epoch; stale buckets are rewound from S(b) before any re-reduce
    or extension, so nothing reduced under two memberships is ever mixed into one sum.
    """

    def __init__(self) -> None:
        self.snap: list[torch.Tensor] = []
        self.tag: list[int] = []          # epoch at snapshot time, -1 = no snapshot this iteration
        self.reduced_at: list[int] = []   # epoch of the last clean reduction, -1 = none

    def begin_iteration(self, n: int) -> None:
        self.tag = [-1] * n
        self.reduced_at = [-1] * n

    def snapshot(self, b: int, t: torch.Tensor, epoch: int) -> None:
        if len(self.snap) <= b:
            self.snap.append(torch.empty_like(t))
        elif self.snap[b].shape != t.shape:
            self.snap[b] = torch.empty_like(t)
        self.snap[b].copy_(t)
        self.tag[b] = epoch
        self.reduced_at[b] = -1

    def rewind(self, buckets: list[torch.Tensor], zero: bool = False) -> int:
        """Copy S(b) back into every bucket that has a snapshot (or zero it). Returns count."""
        n = 0
        with torch.no_grad():
            for b, t in enumerate(buckets):
                if self.tag[b] < 0:
                    continue
                if zero:
                    t.zero_()
                else:
                    t.copy_(self.snap[b])
                self.tag[b] = -1
                self.reduced_at[b] = -1
                n += 1
        return n

    def all_reduced_at(self, epoch: int) -> bool:
        return bool(self.reduced_at) and all(e == epoch for e in self.reduced_at)


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
    extra: dict = field(default_factory=dict)


class HSDPULFMTrainingManager:
    """Resilient HSDP training for a custom loop.

    model: an nn.Module initialised IDENTICALLY on every rank (same seed). auto_wrap_policy: the
    FSDP wrap policy (e.g. per decoder block). optimizer_factory(fsdp_module) -> Optimizer.
    microbatch_fn(replica, microbatch_id) -> (inputs, targets) for the replica's WHOLE microbatch
    (S * micro_batch_size rows); shard rank j trains on rows [j*mbs, (j+1)*mbs).
    loss_fn(module, inputs, targets) -> the MEAN loss over the given rows (the manager scales it by
    1/S so the S ranks of a replica add up to the microbatch mean).
    lr_fn(step) -> lr, optional; set into every param group before each optimizer step.
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
                 log: Optional[Callable[[str], None]] = None):
        fh.check_torch_version()
        if not dist.is_initialized():
            fh.init_distributed_from_env(backend="gloo")
        from recover_hsdp.collectives import UlfmGroup

        self.rank = dist.get_rank()
        self.topo = fh.HybridTopology.for_world(replicas, shard_size, self.rank,
                                                dist.get_world_size())
        self.S = shard_size
        self.replica = self.topo.replica
        self.shard_index = self.topo.shard_index
        self.device = device or fh.local_device()
        self.shard_pg = fh.new_shard_groups(self.topo, timeout_s=shard_timeout_s)
        self.world = UlfmGroup.world()
        self.module = fh.wrap_hybrid_shard(model, self.shard_pg, auto_wrap_policy=auto_wrap_policy,
                                           device=self.device, topology=self.topo)
        self.optimizer = optimizer_factory(self.module)
        self.acc = fh.MicrobatchAccumulator(self.module)
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
        self.log = log or (lambda s: None)
        self.step = 0
        self._buckets = _Buckets()
        self.cross = HSDPCrossReplicaGroup(
            world=self.world, replicas=replicas, shard_size=shard_size, global_rank=self.rank,
            make_group=UlfmGroup.from_ranks, shard_barrier=self._shard_barrier,
            elect=elect, contrib_total=contrib_total,
            checkpoint=lambda location: self.injector.check(location, self.step))
        self.failures_survived = 0
        self._tokens_per_mb: Optional[int] = None

    def set_failure_schedule(self, schedule, before_kill=None) -> None:
        """Install the failure simulator's schedule (validated by the caller)."""
        self.injector = FailureInjector(schedule or [], self.replica, self.shard_index,
                                        before_kill=before_kill, verbose=True)

    # --- helpers --------------------------------------------------------------------------
    def _shard_barrier(self) -> None:
        if self.S > 1:
            dist.barrier(group=self.shard_pg)

    def _replica_lost(self, exc: BaseException) -> None:
        replica_lost_exit(f"rank {self.rank} (replica {self.replica}): shard group failed: "
                          f"{str(exc).splitlines()[0][:200]}")

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        mbs = x.shape[0] // self.S
        return x[self.shard_index * mbs:(self.shard_index + 1) * mbs]

    @property
    def alive_replicas(self) -> tuple[int, ...]:
        return self.policy.alive

    # --- one committed iteration -----------------------------------------------------------
    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        step, pol = self.step, self.policy
        self.cross.set_roles(pol.roles())
        self.optimizer.zero_grad(set_to_none=False)
        self.acc.reset()
        base = pol.steps()
        m = 0
        loss_sum = torch.zeros((), dtype=torch.float64)
        first_pass = True
        modes: list[str] = []
        failures: list[dict] = []
        buckets: list[torch.Tensor] = []
        boundary = False
        while True:
            # 1. microbatches (the whole iteration, or the boundary extension)
            while m < pol.steps():
                ext = m >= base
                mb_id = self.data.microbatch_id(self.replica, m)
                keep = pol.keeps(self.replica, m)
                self.injector.check("extension" if ext else "forward", step,
                                    microbatch=(m - base) if ext else m)
                x, y = self.microbatch_fn(self.replica, mb_id)
                x, y = self._rows(x).to(self.device), self._rows(y).to(self.device)

                def closure(x=x, y=y, m=m, ext=ext):
                    loss = self.loss_fn(self.module, x, y) / self.S
                    if not ext:
                        self.injector.check("backward", step, microbatch=m)
                    return loss

                try:
                    loss = self.acc.microbatch(closure, contribute=keep)
                except RuntimeError as e:
                    if fh.shard_group_failure_kind(e) is None:
                        raise
                    self._replica_lost(e)
                if keep:
                    loss_sum += loss.double()
                if self._tokens_per_mb is None:
                    self._tokens_per_mb = int(y.numel()) * self.S
                m += 1
            self.cross.set_contributed(pol.kept_before(self.replica, m))
            self.cross.set_loss_sum(float(loss_sum))
            # 2. reduction pass (first pass = "reduce", any later one = "re_reduce")
            if not buckets:
                buckets = fh.grad_shards(self.module)
                if first_pass:
                    self._buckets.begin_iteration(len(buckets))
            self.cross.begin_pass()
            epoch = self.cross.epoch
            for b, t in enumerate(buckets):
                self.injector.check("reduce" if first_pass else "re_reduce", step, bucket=b)
                if self._buckets.tag[b] == epoch and self._buckets.reduced_at[b] == epoch:
                    continue  # already reduced cleanly under this membership
                self._buckets.snapshot(b, t, epoch)
                res = self.cross.allreduce(t)
                if res.ok and not res.quiesced:
                    self._buckets.reduced_at[b] = epoch
            first_pass = False
            # 3. gate + consensus: the only source of failure records
            res = self.cross.consensus()
            if res.ok:
                if self._buckets.all_reduced_at(self.cross.epoch):
                    modes.append(RestoreMode.SKIP.value)
                    break
                # a failed reduction that surfaced nowhere else (cannot happen without a death);
                # be safe: rewind and reduce again under this membership
                self._buckets.rewind(buckets)
                modes.append("retry")
                continue
            self.failures_survived += len(res.failed_replicas)
            event = FailureEvent.from_record(res, res.failed_replicas, self.cross.alive,
                                             microbatch=pol.steps())
            failures.append({"replicas": list(res.failed_replicas),
                             "ranks": list(res.failed_ranks), "epoch": res.epoch,
                             "at_boundary": bool(res.at_boundary), "all_clean": res.all_clean})
            if res.all_clean:
                # case (b): every bucket of every shard group was reduced under the old
                # membership: a valid sum of exactly this step's assignment. Commit it as is.
                pol.note_failure_after_commit(event)
                modes.append(RestoreMode.SKIP.value)
                break
            decision = pol.on_failure(event)
            boundary = boundary or decision.at_boundary
            modes.append(decision.restore_mode.value)
            self.cross.set_roles(pol.roles())
            if self.restore_enabled:
                self._buckets.rewind(buckets)
                if self.replica in getattr(decision, "discarded", ()):
                    with torch.no_grad():
                        for t in buckets:
                            t.zero_()
            else:
                # debug switch: no rewind; stale buckets are re-reduced on top of reduced sums
                self._buckets.tag = [-1] * len(buckets)
                self._buckets.reduced_at = [-1] * len(buckets)
            if decision.restore_mode is RestoreMode.NON_BLOCKING:
                buckets = []  # the extension pass produces new accumulations; re-read shards
            # BLOCKING: loop straight back to the reduction pass (no new microbatches)
        # 4. commit
        self.injector.check("pre_step", step)
        divisor = pol.divisor()
        with torch.no_grad():
            for t in buckets:
                t.div_(divisor)
        if self.lr_fn is not None:
            lr = float(self.lr_fn(step))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        self.optimizer.step()
        self.injector.check("optimizer_step", step)
        layout = pol.layout.as_dict()
        alive = list(pol.alive)
        contributions = self.data.commit(pol)
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
            divisor=divisor, epoch=self.cross.epoch, wall_s=time.perf_counter() - t0)
        pol.after_commit()
        self.step += 1
        return metrics
