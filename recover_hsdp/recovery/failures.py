"""The failure phases of the step transaction (StepTxnOrchestrator, recovery/orchestrator.py):
algorithm 4 for one failure record (the policy's decision, its roles pushed to the group, the
restore mode latched) and case (b), a failure seen only at the consensus after every bucket was
reduced under the old membership (the module docstring of recovery/orchestrator.py has the
protocol). `FailureHandling` is a mixin: its methods read and write the orchestrator's state.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from recover_hsdp.policy import FailureEvent, PolicyDecision, RestoreMode
from recover_hsdp.recovery.snapshots import Content


class RecoveryProtocolError(RuntimeError):
    """The transaction reached a state the protocol says is impossible (a bug in a layer below,
    or an integration that calls the orchestrator out of order). Never raised for peer failures."""


_RANK = {None: 0, RestoreMode.SKIP: 1, RestoreMode.BLOCKING: 2, RestoreMode.NON_BLOCKING: 3}


def _max_mode(a: Optional[RestoreMode], b: Optional[RestoreMode]) -> Optional[RestoreMode]:
    return a if _RANK[a] >= _RANK[b] else b


class FailureHandling:
    """StepTxnOrchestrator's failure and case-(b) phases (mixed into it; uses its state)."""

    # ---- internals: failures -------------------------------------------------------------------
    def _members(self) -> tuple[int, ...]:
        return tuple(int(self.replica_of_rank(g)) for g in self.group.global_ranks)

    def _push_roles(self) -> None:
        members = self._members()
        alive = tuple(self.policy.alive)
        if tuple(sorted(members)) != alive:
            raise RecoveryProtocolError(
                f"group members (replicas {list(members)}) differ from the policy's alive set "
                f"{list(alive)}")
        self.group.set_roles([self.policy.role(r) for r in members])

    def _failed_replicas(self, record: Any) -> tuple[int, ...]:
        named = getattr(record, "failed_replicas", None)
        if named:
            return tuple(sorted({int(r) for r in named}))
        return tuple(sorted({int(self.replica_of_rank(g)) for g in (record.failed_ranks or ())}))

    def _event(self, record: Any, survivors: Sequence[int]) -> FailureEvent:
        return FailureEvent.from_record(record, self._failed_replicas(record), list(survivors),
                                        microbatch=self._computed if self._computed is not None
                                        else self.policy.steps())

    def _log_failure(self, record: Any, where: str, decision: Optional[PolicyDecision],
                     case_b: bool = False) -> None:
        self.stats.failures += 1
        entry = {"where": where, "replicas": list(self._failed_replicas(record)),
                 "ranks": [int(g) for g in (record.failed_ranks or ())],
                 "epoch": int(record.epoch), "at_boundary": bool(record.at_boundary),
                 "mode": decision.restore_mode.value if decision else None, "case_b": case_b}
        self.iteration_log.failures.append(entry)
        self.log(f"replica {self.replica}: failure at {where}: {entry}")

    def _on_failure(self, record: Any, where: str) -> None:
        """Algorithm 4 for one failure record."""
        if not self._failed_replicas(record):
            # the membership changed (epoch moved) but nobody we know of was lost: everything
            # reduced before is stale; re-reduce under the new epoch
            self._log_failure(record, where, None)
            self._latch = _max_mode(self._latch, RestoreMode.BLOCKING)
            return
        decision = self.policy.on_failure(self._event(record, self._members()))
        self._log_failure(record, where, decision)
        self._install(decision)

    def _install(self, decision: PolicyDecision) -> None:
        # the policy's roles (promotions, or the boundary-minor split) must be in the backend
        # before its next Record or Reduce
        self._push_roles()
        if decision.at_boundary:
            self.group.set_quiesce(True)  # the rest of this pass would be rolled back anyway
        if self.replica in tuple(decision.discarded):
            self._discard = True
        self._latch = _max_mode(self._latch, decision.restore_mode)

    # ---- internals: case (b) -------------------------------------------------------------------
    def _complete_under(self, epoch: int) -> bool:
        """Uniform part of the case-(b) test: every bucket's last reduction was attempted under
        `epoch` and nothing is pending. Only the last reduced bucket may be undefined here (a
        failed reduce on an earlier one would have surfaced at the next bucket's Detect)."""
        if self._latch is not None and self._latch is not RestoreMode.SKIP:
            return False
        if self._extension or not self._n_buckets:
            return False
        for b in self._buckets():
            if b.content is Content.REDUCED and b.epoch == epoch:
                continue
            if (b.content is Content.UNDEFINED and b.epoch == epoch
                    and b.index == self._last_data_bucket):
                continue
            return False
        return True

    def _try_case_b(self, res: Any, epoch_before: int) -> bool:
        """A failure record at the consensus. Commit as is if every survivor holds a sum of every
        bucket under the pre-failure membership; otherwise hand the failure to the policy."""
        if not self._complete_under(epoch_before):
            self._on_failure(res, where="consensus")
            return False
        agreed = getattr(res, "all_clean", None)
        if agreed is not None:  # the group ran the agreement itself (HSDP cross-replica group)
            if agreed:
                self._commit_case_b([(res, self._members())])
                return True
            self._on_failure(res, where="consensus")
            return False
        return self._case_b_window(res)

    def _case_b_window(self, first: Any) -> bool:
        """Case (b) on a plain group: agree whether somebody holds the old-membership sum of the
        last reduced bucket, make everybody hold it, confirm with a consensus.

        Every survivor runs the same calls: vote (allreduce of one flag per group rank; a spare's
        flag is zeroed by the backend, so spares are never picked as source), consensus (makes the
        vote uniform: a failed reduce anywhere revokes the group), then, unless everybody voted
        clean, broadcast of the last bucket from the lowest clean rank and a confirming consensus.
        A failure anywhere restarts the window; the policy hears of nothing until the outcome is
        known, so the backend's elections in between are exactly the policy's case-(b) chain.
        If no clean holder is left the window is abandoned: all failures go to the policy as one
        event and the iteration restores normally (every bucket is stale by then).
        """
        events: list[tuple[Any, tuple[int, ...]]] = [(first, self._members())]
        last_i = self._last_data_bucket
        last = self.store[last_i if last_i is not None else self._n_buckets - 1]
        if getattr(self.group, "quiesced", False):
            self.group.set_quiesce(False)
        clean = last.content is Content.REDUCED

        def note(r: Any) -> bool:
            if r.ok or getattr(r, "reduce_failed", False) or getattr(r, "quiesced", False):
                return r.ok
            events.append((r, self._members()))
            return False

        while True:
            n, me = int(self.group.size), int(self.group.rank)
            if self._vote.numel() < n:
                self._vote = torch.zeros(n, dtype=torch.float32)
            vote = self._vote[:n]
            vote.zero_()
            vote[me] = 1.0 if clean else 0.0
            voted = note(self.group.allreduce(vote))
            if not note(self.group.consensus()) or not voted:
                continue
            sources = [i for i, v in enumerate(vote.tolist()) if v > 0.5]
            if len(sources) == n:
                break  # everybody holds the sum (and nobody was zeroed: no spare present)
            if not sources or not hasattr(self.group, "broadcast"):
                self._abandon_case_b(events)
                return False
            src = sources[0]
            r = self.group.broadcast(last.tensor, src)
            if r.ok:
                clean = True
            elif getattr(r, "reduce_failed", False):
                clean = clean and me == src  # a broadcast root's buffer is only read
            moved = note(r)
            if not note(self.group.consensus()) or not moved:
                continue
            break
        last.content = Content.REDUCED  # the old-membership sum again (its epoch tag unchanged)
        self._commit_case_b(events)
        return True

    def _commit_case_b(self, events: Sequence[tuple[Any, Sequence[int]]]) -> None:
        for rec, survivors in events:
            decision = self.policy.note_failure_after_commit(self._event(rec, survivors))
            self._log_failure(rec, "consensus", decision, case_b=True)
        self._latch = RestoreMode.SKIP
        self.iteration_log.case_b = True
        self.iteration_log.modes.append(RestoreMode.SKIP.value)
        self.stats.case_b += 1

    def _abandon_case_b(self, events: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Nobody holds the old sum any more: treat everything seen as one failure at this
        synchronisation point (the backend reads several repairs in one call the same way)."""
        if len(events) == 1:
            self._on_failure(events[0][0], where="consensus")
            return
        failed: set[int] = set()
        for rec, _ in events:
            failed.update(self._failed_replicas(rec))
        event = self.policy.expected_event(sorted(failed), epoch=int(self.group.epoch))
        decision = self.policy.on_failure(event)
        for rec, _ in events:
            self._log_failure(rec, "consensus", decision)
        self._install(decision)
