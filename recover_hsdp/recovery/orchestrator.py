"""StepTxnOrchestrator: the per-iteration transaction of ReCoVer (paper appendix C, D.2-D.3).

The invariant it keeps: a COMMIT verdict means every bucket of this rank holds the sum, over ONE
membership of the cross-replica group, of exactly the contributions the policy assigns to this
iteration, and every survivor got the same verdict with the same sums. Steps are never skipped or
replayed; failures are recorded and repaired in place.

How (docs/recovery.md has the call sequence and the state diagram):

* Each bucket is snapshotted (S(b), tagged with the group epoch) right before its reduction, so a
  bucket whose content became stale can be rewound to this replica's own accumulation.
* A bucket is stale unless its last reduction completed cleanly under the CURRENT epoch: reduced
  under an older membership, or `reduce_failed` (content undefined; the failure surfaces at the
  next Detect on the group, possibly only at the consensus).
* `handle_work_completion(result, bucket)` is the single entry point for collective outcomes
  (algorithm 4): success marks the bucket reduced under the epoch; a failure record becomes a
  FailureEvent for the policy, the decision's roles are pushed to the group, a boundary quiesces
  the group, the restore mode is latched (max of SKIP < BLOCKING < NON_BLOCKING).
* `consensus()` runs algorithm 5 until the iteration either commits (COMMIT) or needs the
  boundary extension microbatches (EXTEND): BLOCKING rewinds and re-reduces every stale bucket
  (a failure inside re-enters failure handling: retried if a spare absorbed it, the boundary path
  if not), NON_BLOCKING rewinds (overlapped with the extension's forward) and clears the
  bookkeeping so the extension pass re-snapshots and re-reduces every bucket.
* Case (b): a failure seen only at the consensus after every bucket was reduced under the old
  membership commits as is (SKIP); the policy learns of it through note_failure_after_commit and
  applies it after the commit. Because a `reduce_failed` on the LAST bucket is not uniform (some
  survivors hold the sum, others garbage), case (b) needs agreement: the group's own
  (`result.all_clean`, provided by the HSDP cross-replica group) or, for a plain group, a vote
  plus a broadcast of the last bucket from a survivor that holds it (`_case_b_window`).

The group is duck-typed (UlfmGroup or a fake): allreduce, consensus, set_quiesce, set_roles,
set_contributed, epoch, rank, size, global_ranks; optionally broadcast (case-(b) repair),
begin_pass() and consensus results carrying all_clean / failed_replicas (HSDP cross-replica group).
Nothing here imports the collectives package.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from recover_hsdp.policy import RestoreMode
# algorithm 4 (a failure record -> the policy's decision) and case (b) live in failures.py
from recover_hsdp.recovery.failures import FailureHandling, RecoveryProtocolError
from recover_hsdp.recovery.snapshots import Bucket, Content, Rewinder, SnapshotStore


class Verdict(enum.Enum):
    """What the integration does after `consensus()`."""

    # divide by policy.divisor(), optimizer step, data.commit, after_successful_commit()
    COMMIT = "commit"
    EXTEND = "extend"  # run microbatches up to policy.steps(), enqueue + fire + consensus again


@dataclass
class TxnStats:
    """Counters over the orchestrator's lifetime (benchmarks, tests, logs)."""

    iterations: int = 0
    failures: int = 0              # failure records handled (each may name several replicas)
    case_b: int = 0                # iterations committed through case (b)
    blocking_restores: int = 0     # blocking re-reduce passes
    extensions: int = 0            # NON_BLOCKING dispatches
    re_reduces: int = 0            # bucket reductions issued by a blocking restore
    reduces: int = 0               # bucket allreduce calls that moved data or failed doing so
    quiesced_reduces: int = 0
    snapshot_s: float = 0.0        # wall time spent copying b -> S(b)
    rewind_s: float = 0.0          # wall time spent launching/doing rewinds (sync part)


@dataclass
class IterationLog:
    """What happened in the current/last iteration (for the manager's step record)."""

    modes: list[str] = field(default_factory=list)      # restore modes applied, in order
    failures: list[dict] = field(default_factory=list)  # one dict per failure record
    case_b: bool = False
    passes: int = 0
    #: per fire: seconds from the end of the pass's microbatch loop (the call) until every
    #: bucket's reduction completed here: the reduction's EXPOSED time (overlap shrinks it)
    exposed_s: list[float] = field(default_factory=list)
    #: seconds in consensus() this iteration (the gate, the control plane's rounds, restores)
    consensus_s: float = 0.0


class StepTxnOrchestrator(FailureHandling):
    """Per-iteration transaction over one cross-replica group (see the module docstring).

    group: UlfmGroup-like handle. policy: StaticWorldPolicy / AdaptiveWorldPolicy (this rank's
    replica of the replicated policy state). replica_of_rank(global_rank) -> replica id.
    restore_enabled=False is the debug switch that skips every rewind (and the discard zeroing):
    committed gradients are then WRONG after a failure inside synchronisation, which the tests
    and `recover-hsdp verify` must detect.
    rewind: "auto" | "copy" | "thread" | "cuda" (NON_BLOCKING engine; blocking rewinds are always
    synchronous). gate: called before every consensus (the replica-consistency barrier on the shard
    group when the group itself does not run it). log: optional callable(str).
    """

    def __init__(self, group: Any, policy: Any, replica_of_rank: Callable[[int], int], *,
                 restore_enabled: bool = True, rewind: str = "auto",
                 gate: Optional[Callable[[], None]] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.group = group
        self.policy = policy
        self.replica_of_rank = replica_of_rank
        self.restore_enabled = bool(restore_enabled)
        self.gate = gate
        self.log = log or (lambda s: None)
        self.replica = int(replica_of_rank(group.global_ranks[group.rank]))
        self.store = SnapshotStore()
        self.rewinder = Rewinder(rewind)
        self.stats = TxnStats()
        self.iteration_log = IterationLog()
        # per-iteration state
        self._queue: list[int] = []
        self._enqueued = 0                 # buckets enqueued in the current pass
        self._n_buckets: Optional[int] = None  # buckets in this iteration (fixed by the 1st pass)
        self._latch: Optional[RestoreMode] = None
        self._discard = False              # this replica is in a decision's `discarded`
        self._extension = False            # NON_BLOCKING dispatched, extension pass not fired yet
        self._computed: Optional[int] = None  # microbatches computed this iteration
        self._last_data_bucket: Optional[int] = None  # last bucket whose reduce moved data / failed
        self._in_iteration = False
        self._committable = False          # consensus() returned COMMIT in this iteration
        self._early: Optional[dict] = None  # overlap: bucket -> work posted inside the backward
        self._order: Optional[list] = None  # overlap: the pass's posting order (every rank's)
        #: the order in which a pass posts its buckets (None: index order). Set by an overlapping
        #: caller on EVERY rank: collectives pair up by order, whoever posted some early
        self.post_order: Optional[list] = None
        self._vote = torch.zeros(max(1, int(group.size)), dtype=torch.float32)

    # ---- public state --------------------------------------------------------------------------
    @property
    def restore_mode(self) -> Optional[RestoreMode]:
        """The latched restore mode of this iteration (None: no failure handled, nothing pending).
        BLOCKING becomes SKIP once the re-reduce pass has been issued (algorithm 5, line 13)."""
        return self._latch

    def needs_extension(self) -> bool:
        """True between a NON_BLOCKING dispatch and the extension pass's fire."""
        return self._extension

    def bucket_epochs(self) -> list[list[int]]:
        """Per bucket of this iteration: the membership epochs of the reductions its content
        holds (valid after a COMMIT verdict until the next begin_iteration). An honest commit
        has exactly one, the same for every bucket; the step record carries it so that
        `recover-hsdp verify` (records only too) rejects a step reduced under two memberships."""
        return [list(b.reductions) for b in self._buckets()]

    def snapshot_nbytes(self) -> int:
        """Extra memory the recovery layer holds: exactly one copy of the enqueued buckets."""
        return self.store.nbytes()

    # ---- the call sequence -------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Start a transaction: clear the per-iteration state and push roles (and contributed=0)."""
        self.rewinder.wait()
        self._queue.clear()
        self._enqueued = 0
        self._n_buckets = None
        self._latch = None
        self._discard = False
        self._extension = False
        self._computed = None
        self._last_data_bucket = None
        for b in self.store:
            b.content = Content.LOCAL
            b.snap_valid = False
            b.epoch = -1
            b.reductions = []
        self.iteration_log = IterationLog()
        self._committable = False
        self._early = self._order = None
        if getattr(self.group, "quiesced", False):
            self.group.set_quiesce(False)
        self._push_roles()
        self.group.set_contributed(0)
        self._in_iteration = True

    def note_microbatch(self, computed: int) -> None:
        """Optional progress report: `computed` microbatches of this iteration are done (forward
        and backward). Pushes the honest contribution count to the group."""
        self._computed = int(computed)
        self.group.set_contributed(self.policy.kept_before(self.replica, self._computed))

    def wait_restore_before_backward(self) -> None:
        """Call before the first backward of an extension pass (cheap otherwise): the rewound
        buckets must be in place before new gradients accumulate on top of them."""
        self.rewinder.wait()

    def enqueue_bucket(self, tensor: torch.Tensor) -> int:
        """Queue one bucket (in HSDP: one flat-parameter grad shard) for the deferred reduction.

        Enqueue the same buckets in the same order in every pass of an iteration. Returns the
        bucket's index. No collective here: the reduction happens in fire_deferred_allreduces().
        """
        self._require_iteration("enqueue_bucket")
        self.rewinder.wait()
        i = self._enqueued
        if self._n_buckets is not None and i >= self._n_buckets:
            raise RecoveryProtocolError(
                f"enqueue_bucket: bucket {i} but this iteration's first pass had {self._n_buckets}")
        if i < len(self.store) and self._n_buckets is not None:
            old = self.store[i].tensor
            if old.shape != tensor.shape or old.dtype != tensor.dtype:
                raise RecoveryProtocolError(
                    f"enqueue_bucket: bucket {i} changed from {tuple(old.shape)}/{old.dtype} to "
                    f"{tuple(tensor.shape)}/{tensor.dtype} within one iteration")
        early = self._early is not None and i in self._early
        if early and self.store[i].tensor.data_ptr() != tensor.data_ptr():
            raise RecoveryProtocolError(f"enqueue_bucket: bucket {i} was posted early from "
                                        "another tensor")
        b = self.store.bind(i, tensor)
        if self._n_buckets is None and not early:
            b.content, b.snap_valid, b.epoch = Content.LOCAL, False, -1
            b.reductions = []
        self._enqueued += 1
        self._queue.append(i)
        return i

    def begin_early_posts(self, order: list[int]) -> None:
        """Overlap (parallel.overlap): the pass's last microbatch is about to run backward;
        its final shards will be posted from inside it (post_early) in ``order``, the SAME order
        on every rank (a rank that posts none early posts them all at fire, in that order). Only
        once every bucket has been bound (from the second iteration of this orchestrator on)."""
        self._require_iteration("begin_early_posts")
        self.rewinder.wait()
        if len(self.store) < len(order):
            raise RecoveryProtocolError("begin_early_posts before every bucket was bound once")
        self._begin_pass()
        self._early, self._order = {}, list(order)

    def post_early(self, i: int, tensor: torch.Tensor) -> None:
        """Overlap: bucket i is final (its unit's last post-backward): snapshot it and post
        its reduction now; fire_deferred_allreduces waits for it."""
        b = self.store.bind(i, tensor)
        if self._n_buckets is None:
            b.content, b.snap_valid, b.epoch = Content.LOCAL, False, -1
            b.reductions = []
        work = self._post_bucket(i)
        self._early[i] = work if work is not None else DoneWork(None)

    def fire_deferred_allreduces(self) -> None:
        """Drain the deferred queue: snapshot each bucket, then reduce it on the group."""
        self._require_iteration("fire_deferred_allreduces")
        t_fire = time.perf_counter()
        self.rewinder.wait()
        if self._n_buckets is None:
            self._n_buckets = self._enqueued
        elif self._enqueued != self._n_buckets:
            raise RecoveryProtocolError(
                f"fire_deferred_allreduces: {self._enqueued} buckets enqueued, this iteration has "
                f"{self._n_buckets}")
        # the microbatch loop is done: every replica computed steps() (the sync point at which the
        # policy accepts failure events); the census must count exactly what was kept so far
        self._computed = self.policy.steps()
        self.group.set_contributed(self.policy.kept_before(self.replica, self._computed))
        self._extension = False
        early, order, self._early, self._order = self._early, self._order, None, None
        if early is None:
            self._begin_pass()
        queue, self._queue, self._enqueued = self._queue, [], 0
        # every bucket posted, then waited in order: on an async data plane (gloo, nccl) the
        # sums move together; on the ulfm plane each result is known at its post and handled
        # before the next post (a repair in Detect quiesces the rest of the pass)
        pending = []
        for i in (order or self.post_order or queue):
            work = early.pop(i) if early and i in early else self._post_bucket(i)
            if work is None or (isinstance(work, DoneWork) and work.result is None):
                continue
            if work.done() and not pending:
                self._complete_bucket(i, work)
            else:
                pending.append((i, work))
        for i, work in pending:
            self._complete_bucket(i, work)
        self.iteration_log.exposed_s.append(time.perf_counter() - t_fire)

    def handle_work_completion(self, result: Any, bucket: Optional[int]) -> None:
        """The unified entry point for the outcome of a collective (algorithm 4).

        bucket: the bucket index the result belongs to, None for a consensus.
        ok: the bucket is reduced under the result's epoch. quiesced: nothing happened (the
        bucket keeps its local content). reduce_failed: the bucket's content is undefined, no
        record yet (it surfaces at the next Detect). ok=False with a record: no reduction took
        place; the failure goes to the policy, and the decision is installed.
        """
        if bucket is not None:
            b = self.store[bucket]
            if getattr(result, "quiesced", False):
                self.stats.quiesced_reduces += 1
                return
            if result.ok:
                b.content, b.epoch = Content.REDUCED, int(result.epoch)
                b.reductions.append(b.epoch)
                self._last_data_bucket = bucket
                return
            if getattr(result, "reduce_failed", False):
                b.content, b.epoch = Content.UNDEFINED, int(self.group.epoch)
                b.reductions.append(b.epoch)
                self._last_data_bucket = bucket
                self.log(f"replica {self.replica}: bucket {bucket} reduce failed (undefined)")
                return
            # a repair in Detect: no reduction happened, the bucket still holds local content
        elif result.ok:
            return
        elif getattr(result, "reduce_failed", False):
            raise RecoveryProtocolError("a consensus result with reduce_failed")
        self._on_failure(result, where="consensus" if bucket is None else f"bucket {bucket}")

    def consensus(self) -> Verdict:
        """Algorithms 4-5 until the iteration commits or needs its extension pass.

        Runs the gate and the group's consensus (only when no restoration is pending), dispatches
        on the latched restore mode: BLOCKING rewinds and re-reduces the stale buckets and
        confirms with another consensus; NON_BLOCKING starts the rewind and returns EXTEND.
        """
        self._require_iteration("consensus")
        if self._queue:
            raise RecoveryProtocolError(
                f"consensus with {len(self._queue)} enqueued buckets not fired")
        if self._n_buckets is None:
            raise RecoveryProtocolError("consensus before the first fire_deferred_allreduces")
        t0 = time.perf_counter()
        try:
            return self._consensus_loop()
        finally:
            self.iteration_log.consensus_s += time.perf_counter() - t0

    def _consensus_loop(self) -> Verdict:
        while True:
            if self._latch is RestoreMode.NON_BLOCKING:
                self._start_extension()
                return Verdict.EXTEND
            if self._latch is RestoreMode.BLOCKING:
                self._blocking_restore()
                continue
            epoch_before = int(self.group.epoch)
            if self.gate is not None:
                self.gate()
            res = self.group.consensus()
            if res.ok:
                undefined = [b.index for b in self._buckets() if b.content is Content.UNDEFINED]
                if undefined and int(self.group.epoch) == epoch_before:
                    raise RecoveryProtocolError(
                        f"consensus passed while buckets {undefined} failed their reduction here "
                        "(a failed reduce must revoke the group)")
                epoch = int(self.group.epoch)
                stale = [b.index for b in self._buckets() if not b.reduced_at(epoch)]
                if stale:  # epoch moved with no record naming a loss: re-reduce, uniformly
                    self._latch = RestoreMode.BLOCKING
                    continue
                self.iteration_log.modes.append(RestoreMode.SKIP.value)
                self._committable = True
                return Verdict.COMMIT
            if self._try_case_b(res, epoch_before):
                self._committable = True
                return Verdict.COMMIT
            # the failure went to the policy: a mode is latched; dispatch on it

    def after_successful_commit(self) -> None:
        """After optimizer.step() and DataAssignment.commit(policy): policy advance (algorithm 7 if
        a boundary was crossed, case-(b) failures applied), roles and contribution counter pushed
        to the group, latches cleared."""
        if not self._committable:
            raise RecoveryProtocolError(
                "after_successful_commit without a COMMIT verdict from consensus()")
        self._committable = False
        self.rewinder.wait()
        self.policy.after_commit()
        if getattr(self.group, "quiesced", False):
            self.group.set_quiesce(False)
        self._push_roles()
        self.group.set_contributed(0)
        self._latch = None
        self._extension = False
        self._discard = False
        self._in_iteration = False
        self.stats.iterations += 1

    def close(self) -> None:
        self.rewinder.close()

    # ---- internals: reductions -----------------------------------------------------------------
    def _buckets(self) -> list[Bucket]:
        return self.store.buckets[: self._n_buckets or 0]

    def _begin_pass(self) -> None:
        self.iteration_log.passes += 1
        self._last_data_bucket = None
        begin = getattr(self.group, "begin_pass", None)
        if begin is not None:
            begin()

    def _reduce_bucket(self, i: int) -> None:
        work = self._post_bucket(i)
        if work is not None:
            self._complete_bucket(i, work)

    def _post_bucket(self, i: int):
        """Rewind a stale bucket, snapshot it, post its reduction: the work, or None when the
        bucket is already reduced under the current epoch."""
        b = self.store[i]
        epoch = int(self.group.epoch)
        if b.reduced_at(epoch):
            return None
        if b.content is not Content.LOCAL:
            # stale (reduced under an older membership, or undefined): back to the local content
            t0 = time.perf_counter()
            if self.restore_enabled:
                self.rewinder.run_sync([(b.tensor, b.snap)])
                b.reductions = []
            self.stats.rewind_s += time.perf_counter() - t0
            b.content = Content.LOCAL
        t0 = time.perf_counter()
        self.store.snapshot(b, epoch)  # before the collective (a spare is zeroed inside it)
        self.stats.snapshot_s += time.perf_counter() - t0
        post = getattr(self.group, "allreduce_async", None)
        return post(b.tensor) if post is not None else DoneWork(self.group.allreduce(b.tensor))

    def _complete_bucket(self, i: int, work) -> None:
        res = work.wait()
        if not getattr(res, "quiesced", False):
            self.stats.reduces += 1
        self.handle_work_completion(res, i)

    def _blocking_restore(self) -> None:
        """Algorithm 5, BLOCKING: rewind every stale bucket and re-reduce it under the current
        epoch. A failure inside is handled on the spot: non-boundary -> the latch is BLOCKING again
        and the caller retries; boundary -> NON_BLOCKING, the loop stops (the extension pass will
        re-reduce everything)."""
        self._latch = RestoreMode.SKIP
        self.iteration_log.modes.append(RestoreMode.BLOCKING.value)
        self.stats.blocking_restores += 1
        if getattr(self.group, "quiesced", False):
            self.group.set_quiesce(False)
        self._begin_pass()
        for b in self._buckets():
            if self._latch is RestoreMode.NON_BLOCKING:
                break
            if b.reduced_at(int(self.group.epoch)):
                continue
            self.stats.re_reduces += 1
            self._reduce_bucket(b.index)

    def _start_extension(self) -> None:
        """Algorithm 5, NON_BLOCKING: rewind (or zero, for a discarded spare) every bucket whose
        content is no longer local, overlapped with the extension's forward; clear the bookkeeping
        so the extension pass snapshots and reduces every bucket afresh."""
        copies, zeros = [], []
        for b in self._buckets():
            if self._discard:
                zeros.append(b.tensor)
            elif b.content is not Content.LOCAL:
                copies.append((b.tensor, b.snap))
            if self.restore_enabled and (self._discard or b.content is not Content.LOCAL):
                b.reductions = []
            b.content, b.snap_valid, b.epoch = Content.LOCAL, False, -1
        if getattr(self.group, "quiesced", False):
            self.group.set_quiesce(False)
        t0 = time.perf_counter()
        engine = "off"
        if self.restore_enabled:
            engine = self.rewinder.start(copies, zeros)
        self.stats.rewind_s += time.perf_counter() - t0
        self.log(f"replica {self.replica}: NON_BLOCKING rewind of {len(copies)} buckets, "
                 f"{len(zeros)} zeroed ({engine})")
        self.iteration_log.modes.append(RestoreMode.NON_BLOCKING.value)
        self.stats.extensions += 1
        self._latch = None
        self._discard = False
        self._extension = True
        self._last_data_bucket = None

    def _require_iteration(self, what: str) -> None:
        if not self._in_iteration:
            raise RecoveryProtocolError(f"{what} outside an iteration: call begin_iteration()")


class DoneWork:
    """A work whose result is known at the post: a synchronous group's result (groups without
    allreduce_async), the ulfm data plane's, a quiesced or one-member call (hsdp/dataplane)."""

    __slots__ = ("result",)

    def __init__(self, result: Any):
        self.result = result

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self.result
