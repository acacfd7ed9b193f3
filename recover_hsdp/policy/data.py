"""Data assignment: which microbatch ids each replica computes and contributes to each step.

Replica r owns the disjoint slice r, W_init + r, 2 W_init + r, ... (ids k * W_init + r). Every
microbatch a replica COMPUTES consumes the next id of its slice (so spares, a minor's zeroed
tail and a discarded spare consume ids they do not contribute); the ids it contributes to a step
are those at its kept positions (policy.kept_positions: the first accumulate_quota outside a
boundary step), if policy.contributes(r). A dead replica's slice is simply dropped. Hence no id is
ever used twice, and every id a replica contributes comes from its own slice.
"""
from __future__ import annotations

from recover_hsdp.policy._base import PolicyBase
from recover_hsdp.policy.layout import PolicyError


class DataAssignment:
    """Per-replica cursor into its slice; deterministic, identical on every rank."""

    def __init__(self, w_init: int) -> None:
        if w_init < 1:
            raise PolicyError(f"w_init must be >= 1 (got {w_init})")
        self.w_init = w_init
        self._cursor: dict[int, int] = {r: 0 for r in range(w_init)}  # k of the next id
        self.abandoned: dict[int, int] = {}   # dead replica -> its last cursor (checkpoints)

    def owner(self, microbatch_id: int) -> int:
        return microbatch_id % self.w_init

    def cursor(self, replica: int) -> int:
        """Microbatches `replica` has computed in committed iterations (its next k)."""
        return self._cursor[replica]

    def microbatch_id(self, replica: int, position: int) -> int:
        """The id `replica` computes at `position` (0-based) of the current iteration."""
        if replica not in self._cursor:
            raise PolicyError(f"replica {replica} has no slice (dead or out of range)")
        if position < 0:
            raise PolicyError(f"position must be >= 0 (got {position})")
        return (self._cursor[replica] + position) * self.w_init + replica

    def contributed(self, policy: PolicyBase) -> dict[int, tuple[int, ...]]:
        """Ids each alive replica contributes to the step being committed (no state change)."""
        out = {}
        for r in policy.alive:
            if not policy.contributes(r):
                out[r] = ()
                continue
            out[r] = tuple(self.microbatch_id(r, p)
                           for rg in policy.kept_positions(r) for p in rg)
        return out

    def commit(self, policy: PolicyBase) -> dict[int, tuple[int, ...]]:
        """Record the step: call after the optimizer step and BEFORE policy.after_commit().

        Returns the contributed ids per alive replica; every alive replica's cursor advances by
        policy.steps() (what it computed); replicas no longer alive lose their slice.
        """
        out = self.contributed(policy)
        n = policy.steps()
        alive = set(policy.alive)
        for r in list(self._cursor):
            if r in alive:
                self._cursor[r] += n
            else:
                self.abandoned[r] = self._cursor.pop(r)
        return out

    def adopt(self, replica: int) -> int:
        """A promoted standby takes over ``replica``'s slice (docs/rejoin.md): it resumes at the
        cursor the slice was left at, past every id of it ever committed. Returns that cursor."""
        if replica in self._cursor:        # case (b): dropped at the next commit, not yet
            return self._cursor[replica]
        if replica not in self.abandoned:
            raise PolicyError(f"replica {replica} has no abandoned slice to adopt")
        self._cursor[replica] = self.abandoned.pop(replica)
        return self._cursor[replica]

    def drop(self, replicas) -> None:
        """Forget dead replicas' slices (commit() also does this)."""
        for r in replicas:
            if r in self._cursor:
                self.abandoned[r] = self._cursor.pop(r)
