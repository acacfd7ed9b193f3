"""What crosses the recovery <-> policy boundary: the failure event and the policy's decision."""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from recover_hsdp.policy.election import contrib_total, elect
from recover_hsdp.policy.layout import PolicyError
from recover_hsdp.types import FailureRecord, Role, RoleCensus


class RestoreMode(enum.Enum):
    """How the orchestrator restores gradients after a failure (algorithm 5)."""

    SKIP = "skip"                  # nothing to restore: commit what was reduced (case (b))
    BLOCKING = "blocking"          # rewind stale buckets and re-reduce before the optimizer step
    NON_BLOCKING = "non_blocking"  # boundary: rewind overlapped with the extension pass


class EventMismatchError(PolicyError):
    """A failure event disagrees with the policy's own election/census: a protocol bug."""


@dataclass(frozen=True)
class FailureEvent:
    """One failure as the backend reported it, in replica ids.

    failed_replicas: initial replica ids (0..W_init-1) lost in this call.
    roles: post-election role of every surviving replica.
    census: RoleCensus of `roles`. contrib: C_cur as the backend counted it (`contrib_total`).
    at_boundary: some dead contributor could not be replaced by a spare of its role.
    epoch: the group's epoch after the repair.
    microbatch: microbatches every survivor has computed this iteration when the failure
    surfaced. Failures surface only in the collectives after the microbatch loop, so this equals
    the policy's steps() (the policy checks it).
    """

    failed_replicas: tuple[int, ...]
    roles: Mapping[int, Role]
    census: RoleCensus
    contrib: int
    at_boundary: bool
    epoch: int = 0
    microbatch: int = 0

    @classmethod
    def from_failed_roles(cls, roles: Mapping[int, Role], failed: Iterable[int],
                          accumulated: Mapping[int, int], *, epoch: int = 0,
                          microbatch: int = 0) -> "FailureEvent":
        """The event a correct backend reports when `failed` die while `roles` are in force and
        each replica has `accumulated` microbatches (runs `elect` and `contrib_total`)."""
        failed = tuple(sorted(set(failed)))
        after, at_boundary = elect(roles, failed)
        return cls(failed, after, RoleCensus.of(after.values()),
                   contrib_total(after, accumulated, at_boundary), at_boundary, epoch, microbatch)

    @classmethod
    def from_record(cls, record: FailureRecord, failed_replicas: Iterable[int],
                    survivors: Sequence[int], *, microbatch: int) -> "FailureEvent":
        """Translate a backend FailureRecord (group-rank order) into replica ids.

        `survivors` are the replica ids of the repaired group in group-rank order (= ascending
        replica id); `failed_replicas` the replica ids of record.failed_ranks.
        """
        if len(survivors) != len(record.roles):
            raise EventMismatchError(
                f"record has {len(record.roles)} roles for {len(survivors)} survivors")
        return cls(tuple(sorted(failed_replicas)),
                   {r: Role(int(x)) for r, x in zip(survivors, record.roles)},
                   record.census, record.contrib, record.at_boundary, record.epoch, microbatch)


@dataclass(frozen=True)
class PolicyDecision:
    """The policy's answer to a failure event.

    g_ext: microbatches added to P(major) by this event (boundary only).
    n_boundary_minor: survivors that are boundary minors after this event.
    discarded: replicas (former spares) whose gradient accumulated so far this iteration must be
    ZEROED instead of restored, because admitting it would push the step past B (the open case,
    docs/policy.md). Empty in every other case.
    """

    restore_mode: RestoreMode
    at_boundary: bool
    g_ext: int = 0
    n_boundary_minor: int = 0
    discarded: tuple[int, ...] = ()
