"""StaticWorldPolicy: the versatile workload (algorithms 6 and 7). Pure Python, no torch.

Invariant: every committed step sums exactly B = W_init * G_init microbatches and divides by B.

Algorithm 6 (on_failure), given an event whose election the policy has re-run and checked:
  * not at a boundary (every dead contributor was replaced by a spare of its role, or only spares
    died): P is unchanged, the promoted spares carry the vacated quota; restore BLOCKING.
  * at a boundary: G_ext is the smallest integer >= 1 with C_cur + W_cur * G_ext >= B;
    W_cur * G_ext - (B - C_cur) survivors become boundary minors (G_ext - 1 extra microbatches),
    every other survivor a major (G_ext extra); P(major) grows by G_ext; restore NON_BLOCKING.
Algorithm 7 (after_commit, only if a boundary was crossed this iteration): the count-level
`advance_layout` for the survivors, mapped onto ids by `roles_for_layout`.

The case the paper leaves open -- what happens to surviving spares at a boundary -- is decided
as: every surviving spare (of either role) is ADMITTED with the microbatches it has accumulated
(Algorithm 2 line 8 read literally: a spare zeroes its buffer only when not at a boundary), and
the boundary step makes every survivor a MAJOR or BOUNDARY_MINOR. Why: the spare's work is
already done and snapshotted, so admitting it costs nothing and shortens the extension; the
backend counts it in C_cur, and the rewind is uniform (every survivor restores its snapshot).
One refinement keeps the invariant: when a MINOR dies with no minor-spare while a major-spare
survives, admitting that spare's G_cur microbatches would push C_cur past B (B - R_cur + G_cur
> B) and no extension can subtract. So spares are admitted most-accumulated first (ties: lowest
id) while C_cur stays <= B; a spare that does not fit is DISCARDED: its accumulated gradient is
zeroed instead of restored (PolicyDecision.discarded), its ids are consumed but unused, and it
then computes the extension like everyone else. In every other reachable case all spares fit.
See docs/policy.md.
"""
from __future__ import annotations

from recover_hsdp.policy._base import PolicyBase
from recover_hsdp.policy.election import boundary_roles, roles_for_layout
from recover_hsdp.policy.events import FailureEvent, PolicyDecision, RestoreMode
from recover_hsdp.policy.layout import (Layout, PolicyError, advance_layout,
                                        boundary_extension)
from recover_hsdp.types import Role, RoleCensus


def layout_from_census(census: RoleCensus, g: int, r: int) -> Layout:
    if census.boundary_minor:
        raise PolicyError("a steady-state layout has no boundary minors")
    return Layout(g, census.major, census.minor, r, census.major_spare, census.minor_spare)


class StaticWorldPolicy(PolicyBase):
    """Constant global batch B through failures (the ReCoVer policy)."""

    def _prefix_quota(self, role: Role) -> int:
        if role in (Role.MAJOR, Role.MAJOR_SPARE):
            return self._layout.g
        if role in (Role.MINOR, Role.MINOR_SPARE):
            return self._layout.r
        raise PolicyError(f"role {role.name} outside a boundary step")

    def divisor(self) -> int:
        return self.B

    def _decide(self, event: FailureEvent, roles_after: dict[int, Role],
                at_boundary: bool) -> PolicyDecision:
        acc = {r: self.accumulate_quota(r) for r in roles_after}  # before any role changes
        if self._segments is None and at_boundary:
            self._segments = {r: ([(0, q)] if q else []) for r, q in acc.items()}
        self._remove(event.failed_replicas, roles_after)
        if not at_boundary:
            if not self._boundary_crossed:
                self._layout = layout_from_census(self.census(), self._layout.g, self._layout.r)
            return PolicyDecision(RestoreMode.BLOCKING, False)

        # Boundary: admit spares while C_cur <= B (most accumulated first, then lowest id).
        room = self.B - sum(a for r, a in acc.items() if not roles_after[r].is_spare)
        discarded = []
        for r in sorted((r for r in roles_after if roles_after[r].is_spare),
                        key=lambda r: (-acc[r], r)):
            if acc[r] <= room:
                room -= acc[r]
            else:
                discarded.append(r)
                acc[r] = 0
                self._segments[r] = []
        w_cur = len(self._alive)
        g_ext, n_bm = boundary_extension(self.B - room, w_cur, self.B)
        roles = boundary_roles(acc, n_bm)
        start = self._steps
        for r, role in roles.items():
            extra = g_ext - (1 if role == Role.BOUNDARY_MINOR else 0)
            if extra:
                self._segments[r].append((start, start + extra))
        self._roles = roles
        self._steps += g_ext
        self._boundary_crossed = True
        self._discarded.update(discarded)
        return PolicyDecision(RestoreMode.NON_BLOCKING, True, g_ext, n_bm, tuple(discarded))

    def _install_next_layout(self, boundary: bool) -> None:
        if boundary:
            self._layout = advance_layout(len(self._alive), self.B, self._layout.g)
            self._roles = roles_for_layout(self._alive, self._layout)
        else:  # keep the role map (promotions included); counts follow the census
            self._layout = layout_from_census(self.census(), self._layout.g, self._layout.r)
