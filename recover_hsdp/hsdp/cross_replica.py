"""The S cross-replica groups of HSDP presented as ONE replica-level fault-tolerant group.

With shard size S > 1 there are S replicate groups (one per shard index j, members r*S + j), each
on its own ULFM communicator. A replica dies rank by rank: group 0 may see the loss during bucket
k while group 1 finishes every bucket under the old membership. This module makes all survivors
agree on ONE failed-replica set and ONE epoch before anyone commits (docs/hsdp.md):

* `allreduce(bucket)` goes to this rank's replicate group j. Its outcome is NOT authoritative: any
  failure (a repair in Detect, or a failed Reduce) is returned as `reduce_failed=True` with no
  record; the bucket is undefined and will be rewound. After a repair in Detect every member of
  group j got the same record in the same call, so the group is quiesced uniformly for the rest of
  the pass (a failed Reduce is NOT uniform, so it must not quiesce: peers would wait in Detect).
* `consensus()` is the iteration's gate and the only source of failure records:
  1. the replica-consistency gate: a barrier on this replica's shard group. A rank whose replica
     lost a member sees the gloo error there (or earlier in FSDP's own collectives) and leaves by
     SIGKILL, so ULFM notices it (feasibility.md: a non-zero exit is not noticed).
  2. a closure loop of ULFM_CONSENSUS on the world "failure domain" communicator (all ranks):
     failed replicas = {global_rank // S}; a live rank of a failed replica kills itself; the loop
     repeats until the world communicator holds exactly the ranks of the surviving replicas. Each
     call's record is identical on every survivor, so every survivor leaves the loop with the
     same failed set and the same epoch.
  3. one allreduce on the closed world communicator of [clean, contributed per replica]: `clean`
     is 1 iff this rank reduced every bucket of the pass under the pre-failure membership; its
     global AND decides the paper's case (b) for everyone at once. A failure during it (detected by
     a confirming consensus) restarts from step 2.
  4. after a failure, every replicate group is repaired in place down to the surviving
     replicas, so all S groups run under the same membership (snapshots are tagged with the world
     epoch, which every survivor shares).
  The replica-level record (election, census, contrib, at_boundary) is then computed locally from
  agreed inputs with the policy's pure functions: identical on every survivor by construction.
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from recover_hsdp.types import FailureRecord, Role, RoleCensus


def _die() -> None:
    """Leave so that ULFM notices: SIGKILL ourselves (a non-zero exit is not seen as a failure)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class ReplicaResult(FailureRecord):
    """A FailureRecord at replica granularity plus the HSDP-specific agreement bits.

    failed_replicas: initial replica ids lost since the previous consensus.
    all_clean: every survivor reduced every bucket of the pass under the pre-failure membership
      (the global AND), i.e. the paper's case (b) when failed_replicas is non-empty.
    reduce_failed: for allreduce results, the bucket is undefined (no record attached).
    """

    failed_replicas: tuple[int, ...] = ()
    all_clean: bool = True
    reduce_failed: bool = False
    contributed: tuple[int, ...] = ()  # per surviving replica (ascending id), from the collective
    loss_sums: tuple[float, ...] = ()  # per surviving replica: sum of its kept microbatch losses
    grad_sq_norm: float = 0.0  # squared global norm of the reduced gradient (see set_grad_stats)
    grad_nonfinite: bool = False  # NaN/inf in some rank's reduced gradient


class HSDPCrossReplicaGroup:
    """Replica-level face over S replicate UlfmGroups and a world UlfmGroup.

    `make_group(world_ranks)` builds a UlfmGroup over the given MPI world ranks (collective over
    exactly those ranks); `shard_barrier()` is the replica-consistency gate (raises on a lost
    peer); `elect(roles, failed)` is the policy's pure election (dict replica->Role, failed ids) ->
    (new roles, at_boundary); `checkpoint(location)` is the failure simulator's hook.
    """

    def __init__(self, *, world, replicas: int, shard_size: int, global_rank: int,
                 make_group: Callable[[Sequence[int]], object],
                 shard_barrier: Callable[[], None],
                 elect: Callable, contrib_total: Callable,
                 checkpoint: Callable[..., None] = lambda location, **kw: None,
                 die: Callable[[], None] = _die, standby: int = 0,
                 data_plane: str = "ulfm", plane_options: Optional[dict] = None):
        self.world = world
        self.S = shard_size
        self.w_init = replicas
        self.global_rank = global_rank
        self.my_phys = global_rank // shard_size   # my rank block (a standby's is >= W)
        self.shard_index = global_rank % shard_size
        # hot standbys (docs/rejoin.md): slot -> rank block; a promoted standby takes the slot
        # (data slice, replica id in the record) of the replica it replaces
        self.n_standby = int(standby)
        self.phys: dict[int, int] = {r: r for r in range(replicas)}
        self.pool: list[int] = list(range(replicas, replicas + self.n_standby))
        self.standbys_lost: list[int] = []   # idle standbys' blocks lost (in order)
        self.is_standby = self.my_phys >= replicas
        self.replica = -1 if self.is_standby else self.my_phys
        self.flags = [0.0, 0.0, 0.0, 0.0]  # join request, join confirm, my join part ok, done
        self.agreed_flags: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self._carried: set[int] = set()
        self._make_group = make_group
        self._shard_barrier = shard_barrier
        self._elect = elect
        self._contrib_total = contrib_total
        self._checkpoint = checkpoint
        self._die = die
        self.alive: list[int] = list(range(replicas))
        self._roles: dict[int, Role] = {r: Role.MAJOR for r in self.alive}
        self._contributed = 0
        self._loss_sum = 0.0
        self._clean = True  # no failure seen in any bucket of this pass
        self._group_quiesced = False  # uniform within my replicate group (repair in Detect)
        self._quiesce_flag = False
        self.rg = None if self.is_standby else make_group(self._replicate_ranks())
        self.last_result: ReplicaResult = ReplicaResult(ok=True)
        # the bytes of the bucket sums (hsdp/dataplane): ulfm (the default: on self.rg), gloo,
        # nccl; the control plane (this class's consensus, self.world, self.rg) stays on ULFM
        from recover_hsdp.hsdp.dataplane import make_data_plane

        self.plane = make_data_plane(data_plane, self, **(plane_options or {}))
        self.plane.membership_changed()

    # --- the UlfmGroup-like surface the orchestrator drives ---------------------------------
    @property
    def epoch(self) -> int:
        return self.world.epoch

    @property
    def rank(self) -> int:
        return self.alive.index(self.replica)

    @property
    def size(self) -> int:
        return len(self.alive)

    @property
    def global_ranks(self) -> list[int]:
        """World ranks of my replicate group's members, group-rank order (ascending replica)."""
        return self._replicate_ranks()

    def replica_of_rank(self, global_rank: int) -> int:
        p = global_rank // self.S
        for slot, q in self.phys.items():
            if q == p:
                return slot
        return p if p < self.w_init else -1 - p   # never a live slot

    @property
    def quiesced(self) -> bool:
        return self._quiesce_flag or self._group_quiesced

    def set_quiesce(self, flag: bool) -> None:
        self._quiesce_flag = bool(flag)
        if not flag:
            self._group_quiesced = False
        self.rg.set_quiesce(self.quiesced)

    def set_roles(self, roles) -> None:
        """roles: dict replica->Role, or a sequence in ascending alive-replica order."""
        if not isinstance(roles, dict):
            roles = dict(zip(self.alive, roles))
        self._roles = dict(roles)
        self.rg.set_roles([self._roles[r] for r in self._rg_order()])

    # --- the membership a join changes (hsdp/standby.py) --------------------------------------
    def view(self) -> dict:
        """The agreed membership: alive slots, slot -> rank block, the standby pool, roles."""
        return {"alive": list(self.alive), "phys": dict(self.phys), "pool": list(self.pool),
                "roles": dict(self._roles)}

    def load_view(self, view: dict) -> None:
        """Take over a ``view()`` sent by an active replica (a standby being promoted)."""
        self.alive, self.phys, self.pool = list(view["alive"]), dict(view["phys"]), \
            list(view["pool"])
        self._roles = dict(view["roles"])

    def seat(self, p: int, d: int) -> None:
        """Everybody's view after a committed join: standby block p holds slot d (a major)."""
        self.phys[d] = p
        self.pool = [x for x in self.pool if x != p]
        self.alive = sorted(self.alive + [d])
        self._roles[d] = Role.MAJOR

    def die(self) -> None:
        """Leave as a failure the others see (SIGKILL of this rank; never returns)."""
        self._die()

    def set_contributed(self, n: int) -> None:
        self._contributed = int(n)
        self.rg.set_contributed(int(n))

    def set_loss_sum(self, x: float) -> None:
        """This rank's share of its replica's kept-loss sum (carried by the consensus)."""
        self._loss_sum = float(x)

    # --- gradient statistics carried by the consensus vector -------------------
    #: extra slots at the END of the consensus vector: [sum of squared norms, non-finite count]
    GRAD_STAT_SLOTS = 2

    def set_grad_stats(self, sq_norm: float, nonfinite: bool) -> None:
        """This rank's squared norm of its reduced gradient shards and a NaN/inf flag.

        Summed over all ranks by the consensus allreduce: every replica holds the same reduced
        shards, so the sum over ranks divided by the live replicas is the global squared norm
        (shards of one replica partition the parameters). No extra collective.
        """
        self._grad_sq = 0.0 if nonfinite else float(sq_norm)
        self._grad_nonfinite = bool(nonfinite)

    def _grad_stats_into(self, vec: torch.Tensor) -> None:
        vec[-2] = getattr(self, "_grad_sq", 0.0)
        vec[-1] = 1.0 if getattr(self, "_grad_nonfinite", False) else 0.0

    def _grad_stats_from(self, vec: torch.Tensor, n_ranks: int) -> dict:
        replicas = max(1, n_ranks // self.S)
        return {"grad_sq_norm": float(vec[-2].item()) / replicas,
                "grad_nonfinite": bool(vec[-1].item() > 0)}

    def begin_pass(self) -> None:
        """Start of a bucket pass (after a microbatch loop or before a blocking re-reduce)."""
        self._clean = True

    def allreduce(self, tensor: torch.Tensor) -> ReplicaResult:
        """The bucket's SUM over my replicate group, waited for (see allreduce_async)."""
        return self.allreduce_async(tensor).wait()

    def allreduce_async(self, tensor: torch.Tensor):
        """Post the bucket's SUM on the data plane; ``.wait()`` gives its ReplicaResult. Not
        authoritative: a failure is ``reduce_failed`` (the bucket is undefined, rewound later),
        the records come from consensus() only."""
        if self.quiesced:
            from recover_hsdp.hsdp.dataplane import DoneWork

            return DoneWork(self.result(ok=True, quiesced=True))
        return self.plane.allreduce(tensor)

    # --- what a data plane reports back (hsdp/dataplane) ------------------------------------
    def result(self, *, ok: bool, quiesced: bool = False,
               reduce_failed: bool = False) -> ReplicaResult:
        return ReplicaResult(ok=ok, quiesced=quiesced, reduce_failed=reduce_failed,
                             epoch=self.epoch)

    def note_unclean(self, quiesce_group: bool = False) -> None:
        """A bucket of this pass was not reduced under the pre-failure membership here.
        quiesce_group: the failure was seen uniformly by my replicate group (a repair in the
        ulfm plane's Detect): its later buckets of the pass are skipped."""
        self._clean = False
        if quiesce_group:
            self._group_quiesced = True
            self.rg.set_quiesce(True)

    def my_role(self) -> Role:
        return self._roles.get(self.replica, Role.MAJOR)

    def consensus(self) -> ReplicaResult:
        self.last_result = self._consensus()
        return self.last_result

    def _consensus(self) -> ReplicaResult:
        self._checkpoint("gate")
        try:
            self._shard_barrier()
        except Exception:  # a member of my replica is gone: my replica is lost
            self._die()
            raise  # only reached with an injected die() in tests
        self._checkpoint("consensus")
        epoch_before = self.world.epoch
        # Every failed rank this call learns of, from WORLD calls only (their records are
        # identical on every survivor; a replicate group's record is not seen by the other S-1
        # groups). It only grows: a death at any point of the recovery (closure, agreed vector,
        # rebuild) is absorbed by one more round of the loop with the same view everywhere.
        failed_ranks: set[int] = set(self._carried)  # deaths seen in a join round (rejoin.md)
        self._carried = set()
        while True:
            self._closure(failed_ranks)
            vec = self._agreed_vector()
            self._checkpoint("agreed")
            red = self.world.allreduce(vec)
            failed_ranks |= _failed(red)
            confirm = self.world.consensus()
            failed_ranks |= _failed(confirm)
            if not (red.ok and confirm.ok):
                continue  # a death during the agreed vector: close again, reduce it again
            dead_phys = {g // self.S for g in failed_ranks}
            failed_replicas = sorted(r for r in self.alive if self.phys[r] in dead_phys)
            if self.n_standby:
                self.agreed_flags = tuple(float(x) for x in vec[1 + 2 * self.w_init:
                                                                5 + 2 * self.w_init].tolist())
                if any(f > 0.5 for f in self.agreed_flags):  # a join/done round between steps
                    return self._carry(failed_ranks, epoch_before)
                self.standbys_lost += [p for p in self.pool if p in dead_phys]
                self.pool = [p for p in self.pool if p not in dead_phys]
            if not failed_replicas and self.world.epoch == epoch_before:
                break
            if self.is_standby:   # no replicate group; one world round as the others do
                after = self.world.consensus()
                failed_ranks |= _failed(after)
                if after.ok:
                    break
                continue
            self._rebuild_groups([r for r in self.alive if r not in failed_replicas])
            # A death during the rebuild is seen by one replicate group only: one world round
            # makes it everyone's (the dead rank is still a member of the world communicator).
            after = self.world.consensus()
            failed_ranks |= _failed(after)
            if after.ok:
                break
        w = self.w_init
        n = len(self.world.global_ranks)
        all_clean = int(round(vec[0].item())) == n
        contributed = {r: int(round(vec[1 + r].item() / self.S)) for r in self.alive
                       if r not in failed_replicas}
        losses = {r: float(vec[1 + w + r].item()) for r in contributed}
        gstats = self._grad_stats_from(vec, n - self.S * len(self.pool))
        if not failed_replicas and (self.world.epoch == epoch_before or self.n_standby
                                    or self.plane.is_async):
            # (with standbys: only a standby was lost; on an async data plane: a suspected
            # failure revoked the world and nobody died. The moved epoch makes every bucket
            # stale, so the orchestrator re-reduces them: no policy event)
            if self.world.epoch != epoch_before and not self.is_standby:
                self.plane.membership_changed()
            return ReplicaResult(ok=True, epoch=self.epoch, all_clean=all_clean, **gstats,
                                 census=RoleCensus.of(self._roles.values()),
                                 roles=tuple(self._roles[r] for r in self.alive),
                                 contributed=tuple(contributed[r] for r in self.alive),
                                 loss_sums=tuple(losses[r] for r in self.alive))
        new_roles, at_boundary = self._elect(self._roles, failed_replicas)
        self.alive = [r for r in self.alive if r not in failed_replicas]
        contrib = self._contrib_total(new_roles, contributed, at_boundary)
        self._roles = dict(new_roles)
        if not self.is_standby:
            self._finish_rebuild()
        return ReplicaResult(
            ok=False, failed_ranks=tuple(sorted(failed_ranks)), epoch=self.epoch,
            census=RoleCensus.of(new_roles[r] for r in self.alive), contrib=contrib,
            at_boundary=at_boundary, roles=tuple(new_roles[r] for r in self.alive),
            failed_replicas=tuple(failed_replicas), all_clean=all_clean, **gstats,
            contributed=tuple(contributed[r] for r in self.alive),
            loss_sums=tuple(losses[r] for r in self.alive))

    def _agreed_vector(self) -> torch.Tensor:
        """This rank's row of the agreed vector, summed over the closed world communicator.

        Layout (float64): [0] clean (1 iff every bucket of the pass was reduced under the
        pre-failure membership at this rank; the sum == world size is the global AND),
        [1 + r] contributed microbatches of replica r (each of its S ranks adds it),
        [1 + W + r] replica r's kept-loss sum (its S ranks add their shares).
        """
        w = self.w_init
        flags = 4 if self.n_standby else 0  # [1 + 2W ...]: join, confirm, join ok, done
        vec = torch.zeros(1 + 2 * w + flags + self.GRAD_STAT_SLOTS, dtype=torch.float64)
        vec[0] = 1.0 if self._clean else 0.0
        if flags:
            vec[1 + 2 * w:1 + 2 * w + flags] = torch.tensor(self.flags, dtype=torch.float64)
        if self.is_standby:
            return vec
        vec[1 + self.replica] = float(self._contributed)
        vec[1 + w + self.replica] = self._loss_sum
        self._grad_stats_into(vec)  # [1 + 2W ...]: squared grad norm, non-finite flag
        return vec

    # --- internals ------------------------------------------------------------------------
    def _replicate_ranks(self) -> list[int]:
        return [self.phys[r] * self.S + self.shard_index for r in self.alive]

    def _rg_order(self) -> list[int]:
        """Alive slots in my replicate group's rank order (ascending rank block)."""
        return sorted(self.alive, key=lambda r: self.phys[r])

    def _carry(self, failed_ranks: set[int], epoch_before: int) -> ReplicaResult:
        """A join/done round between steps: its deaths are not applied here (no iteration is
        open to hear them) but carried into the next step's consensus, which sees them as if
        they had happened in its own microbatch loop."""
        self._carried = set(failed_ranks)
        ok = not failed_ranks and self.world.epoch == epoch_before
        return ReplicaResult(ok=ok, epoch=self.epoch, failed_ranks=tuple(sorted(failed_ranks)))

    def _closure(self, failed: set[int]) -> None:
        """ULFM_CONSENSUS on the world until it holds exactly the surviving replicas' ranks.

        `failed` holds every failed rank the caller already knows of (it is updated in place):
        the surviving replicas are `self.alive` minus the replicas of those ranks, never a stale
        set. A rank the world communicator no longer holds is dead (the world only shrinks by
        repairs), whatever record reported it: it is added too, so a dropped report cannot make
        `expected` unreachable.
        """
        blocks = [self.phys[r] for r in self.alive] + list(self.pool)
        while True:
            res = self.world.consensus()
            new = _failed(res)
            failed |= new
            failed |= {g for p in blocks for g in self._block(p)} - set(self.world.global_ranks)
            dead = {g // self.S for g in failed}
            if self.my_phys in dead:
                self._die()  # my replica lost a member: leave so the others can close
                raise RuntimeError("die() returned")  # only with an injected die() in tests
            if new:
                self._checkpoint("closure")  # a death right after a round that saw one
            expected = sorted(g for p in blocks if p not in dead for g in self._block(p))
            if sorted(self.world.global_ranks) == expected:
                return

    def _ranks_of(self, replica: int) -> range:
        return self._block(self.phys[replica])

    def _block(self, phys: int) -> range:
        return range(phys * self.S, (phys + 1) * self.S)

    def _rebuild_groups(self, alive: Sequence[int]) -> None:
        """Bring my replicate group to the replicas `alive` (the agreed survivors), if it can.

        After the world closure every rank of a failed replica is dead, so a ULFM_CONSENSUS on
        the group (Detect -> Repair) shrinks it to the survivors; every member of the group gets
        here with the same `alive`, so the calls pair up. (MPI_Comm_create_group on
        MPI_COMM_WORLD is refused once a process has failed, hence repair-in-place rather than
        rebuild.) A member that dies meanwhile shrinks the group below `alive`: that is not an
        error here. The group stops (uniformly: every member got the same record) and the
        caller's world round reports the death to everyone.
        """
        expected = sorted(self.phys[r] * self.S + self.shard_index for r in alive)
        if self.is_standby:
            return
        # reached in every round that agreed a failure, whether or not my group still needs a
        # repair (it may have repaired itself in a Detect of the reduction pass)
        self._checkpoint("rebuild")
        for _ in range(len(expected) + self.w_init + 2):
            have = sorted(self.rg.global_ranks)
            if have == expected or not set(expected) <= set(have):
                return
            self.rg.consensus()
        raise RuntimeError(f"replicate group {self.shard_index} did not converge to ranks "
                           f"{expected} (has {sorted(self.rg.global_ranks)})")

    def _finish_rebuild(self) -> None:
        """The agreed membership is final and my group holds exactly it: reset its state."""
        expected = self._replicate_ranks()
        if sorted(self.rg.global_ranks) != expected:  # cannot happen after a clean world round
            raise RuntimeError(f"replicate group {self.shard_index} holds ranks "
                               f"{sorted(self.rg.global_ranks)}, agreed {expected}")
        self._group_quiesced = False
        self._quiesce_flag = False
        self.rg.set_quiesce(False)
        self.rg.set_roles([self._roles[r] for r in self._rg_order()])
        self.rg.set_contributed(self._contributed)
        self.plane.membership_changed()


def _failed(res) -> set[int]:
    """The failed world ranks a record reports (none for an ok call or a failed data phase)."""
    return set(getattr(res, "failed_ranks", ()) or ())
