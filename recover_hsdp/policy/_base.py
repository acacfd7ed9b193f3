"""State shared by both policies: alive set, role map, per-iteration microbatch bookkeeping,
event cross-checking and the case-(b) hand-over. The concrete policies only decide."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from recover_hsdp.policy.election import contrib_total, elect
from recover_hsdp.policy.events import (EventMismatchError, FailureEvent, PolicyDecision,
                                        RestoreMode)
from recover_hsdp.policy.layout import Layout, PolicyError
from recover_hsdp.types import Role, RoleCensus

ROLE_NAMES: dict[str, Role] = {r.name.lower(): r for r in Role}


def parse_role(name: "str | Role | int") -> Role:
    """'major', 'minor_spare', 'boundary-minor', Role.MAJOR or 0 -> Role."""
    if isinstance(name, (Role, int)):
        try:
            return Role(int(name))
        except ValueError:
            raise PolicyError(f"unknown role {name!r}") from None
    key = name.strip().lower().replace("-", "_")
    if key not in ROLE_NAMES:
        raise PolicyError(f"unknown role {name!r} (known: {', '.join(ROLE_NAMES)})")
    return ROLE_NAMES[key]


class PolicyBase:
    """Iteration state machine common to StaticWorldPolicy and AdaptiveWorldPolicy.

    Positions: microbatches of one iteration are numbered 0 .. steps()-1 in computation order; a
    replica keeps (accumulates) the loss of the positions in kept_positions(replica) and zeroes
    the others. Outside a boundary step that is the prefix [0, accumulate_quota); a boundary
    step appends a range for the extension pass (and empties it for a discarded spare).
    """

    has_boundaries = True  # False for the adaptive strawman (algorithm 8 never crosses one)

    def __init__(self, w_init: int, g_init: int) -> None:
        if not isinstance(w_init, int) or w_init < 1:
            raise PolicyError(f"w_init must be an int >= 1 (got {w_init!r})")
        if not isinstance(g_init, int) or g_init < 1:
            raise PolicyError(f"g_init must be an int >= 1 (got {g_init!r})")
        self.w_init = w_init
        self.g_init = g_init
        self.B = w_init * g_init
        self.iteration = 0  # committed steps so far
        self._layout = Layout.initial(w_init, g_init)
        self._roles: dict[int, Role] = {r: Role.MAJOR for r in range(w_init)}
        self._alive: tuple[int, ...] = tuple(range(w_init))
        self._new_iteration()

    # ---- per-iteration state -------------------------------------------------------------
    def _new_iteration(self) -> None:
        self._steps = self._layout.g
        self._segments: dict[int, list[tuple[int, int]]] | None = None  # set by a boundary
        self._boundary_crossed = False
        self._discarded: set[int] = set()
        # case (b): failures seen after the step's reduction completed, applied in after_commit
        self._pending_dead: list[int] = []
        self._pending_roles: dict[int, Role] | None = None
        self._pending_boundary = False

    def _prefix_quota(self, role: Role) -> int:
        raise NotImplementedError

    # ---- queries -------------------------------------------------------------------------
    @property
    def alive(self) -> tuple[int, ...]:
        """Alive replica ids, ascending (= group-rank order of the cross-replica group)."""
        return self._alive

    @property
    def layout(self) -> Layout:
        """The steady-state layout of this iteration (spare promotions and spare deaths included;
        frozen during a boundary step, whose roles are MAJOR/BOUNDARY_MINOR)."""
        return self._layout

    def role(self, replica: int) -> Role:
        try:
            return self._roles[replica]
        except KeyError:
            raise PolicyError(f"replica {replica} is not alive") from None

    def roles(self) -> dict[int, Role]:
        return dict(self._roles)

    def roles_in_group_order(self) -> tuple[Role, ...]:
        """Roles of the alive replicas in group-rank order, for UlfmGroup.set_roles."""
        return tuple(self._roles[r] for r in self._alive)

    def census(self) -> RoleCensus:
        return RoleCensus.of(self._roles.values())

    @property
    def at_boundary(self) -> bool:
        """A boundary was crossed this iteration (algorithm 7 runs in after_commit)."""
        return self._boundary_crossed or self._pending_boundary

    def steps(self) -> int:
        """P(major): microbatches every alive replica computes this iteration (extensions too)."""
        return self._steps

    def kept_positions(self, replica: int) -> tuple[range, ...]:
        if self._segments is None:
            q = self._prefix_quota(self.role(replica))
            return (range(0, q),) if q else ()
        self.role(replica)
        return tuple(range(a, b) for a, b in self._segments[replica])

    def keeps(self, replica: int, position: int) -> bool:
        """Does `replica` accumulate the loss of microbatch `position` (0-based) this iteration?"""
        return any(position in rg for rg in self.kept_positions(replica))

    def kept_before(self, replica: int, computed: int) -> int:
        """Microbatches `replica` has accumulated after computing the first `computed` positions
        of this iteration: what UlfmGroup.set_contributed must report at that point."""
        return sum(max(0, min(rg.stop, computed) - rg.start) for rg in self.kept_positions(replica))

    def accumulate_quota(self, replica: int) -> int:
        """Microbatches `replica` accumulates this iteration (its contribution if it has one)."""
        if self._segments is None:
            return self._prefix_quota(self.role(replica))
        self.role(replica)
        return sum(b - a for a, b in self._segments[replica])

    def contributes(self, replica: int) -> bool:
        return not self.role(replica).is_spare

    def committed(self) -> int:
        """Microbatches this iteration commits if nothing else fails."""
        return sum(self.accumulate_quota(r) for r in self._alive if self.contributes(r))

    def discarded(self) -> frozenset[int]:
        """Former spares whose pre-boundary accumulation was dropped this iteration."""
        return frozenset(self._discarded)

    def divisor(self) -> int:
        raise NotImplementedError

    # ---- building events (tests, fake backends, the planner's id-level cross-check) -------
    def accumulated(self) -> dict[int, int]:
        """Microbatches each alive replica has accumulated at the synchronisation point."""
        return {r: self.accumulate_quota(r) for r in self._alive}

    def expected_event(self, failed: Iterable[int], *, epoch: int = 0) -> FailureEvent:
        """The event a correct backend reports if `failed` die at this synchronisation point."""
        basis = self._pending_roles if self._pending_roles is not None else self._roles
        acc = self.accumulated()
        return FailureEvent.from_failed_roles(basis, failed, {r: acc[r] for r in basis},
                                              epoch=epoch, microbatch=self._steps)

    def victims_for_roles(self, roles: Iterable["str | Role"]) -> tuple[int, ...]:
        """Pick one replica per named role: the holder with the most microbatches accumulated
        (ties: lowest id), the same choice the count-level planner makes."""
        basis = self._pending_roles if self._pending_roles is not None else self._roles
        acc = self.accumulated()
        chosen: list[int] = []
        for name in roles:
            role = parse_role(name)
            best = None
            for r, held in basis.items():
                if held == role and r not in chosen:
                    if best is None or (-acc[r], r) < (-acc[best], best):
                        best = r
            if best is None:
                raise PolicyError(f"no alive replica holds role {role.name.lower()}")
            chosen.append(best)
        return tuple(chosen)

    # ---- failures ------------------------------------------------------------------------
    def _check_event(self, event: FailureEvent,
                     basis: Mapping[int, Role]) -> tuple[dict[int, Role], bool]:
        """Re-run the election on our own state and refuse an event that disagrees."""
        failed = tuple(event.failed_replicas)
        if not failed:
            raise PolicyError("failure event names no failed replica")
        if len(set(failed)) != len(failed):
            raise EventMismatchError(f"failure event repeats a replica: {failed}")
        unknown = [r for r in failed if r not in basis]
        if unknown:
            raise EventMismatchError(f"failure event names replicas {unknown} that are not alive")
        if len(failed) == len(basis):
            raise PolicyError("no replica survives: the invariant cannot be kept with W_cur = 0")
        if event.microbatch != self._steps:
            raise EventMismatchError(
                f"failure event at microbatch {event.microbatch}, but failures surface only at "
                f"the synchronisation after all {self._steps} microbatches of this iteration")
        expected, at_boundary = elect(basis, failed)
        got = {int(r): Role(int(x)) for r, x in event.roles.items()}
        if got != expected:
            missing = sorted(expected.keys() - got.keys())
            extra = sorted(got.keys() - expected.keys())
            diff = [(r, got[r].name, expected[r].name) for r in sorted(expected.keys() & got.keys())
                    if got[r] != expected[r]]
            raise EventMismatchError(
                "failure event roles disagree with the policy's election: "
                f"missing survivors {missing[:8]}, unexpected {extra[:8]}, "
                f"(replica, event role, policy role) {diff[:8]}")
        if bool(event.at_boundary) != at_boundary:
            raise EventMismatchError(
                f"failure event says at_boundary={event.at_boundary}, the policy's election says "
                f"{at_boundary} (failed {failed})")
        census = RoleCensus.of(expected.values())
        if tuple(event.census.as_tuple()) != census.as_tuple():
            raise EventMismatchError(
                f"failure event census {event.census.as_tuple()} != policy census "
                f"{census.as_tuple()} (major, minor, major_spare, minor_spare, boundary_minor)")
        acc = self.accumulated()
        contrib = contrib_total(expected, acc, at_boundary)
        if event.contrib != contrib:
            raise EventMismatchError(
                f"failure event contrib {event.contrib} != policy C_cur {contrib} "
                f"(at_boundary={at_boundary})")
        return expected, at_boundary

    def _remove(self, dead: Iterable[int], roles_after: dict[int, Role]) -> None:
        dead = set(dead)
        self._alive = tuple(r for r in self._alive if r not in dead)
        self._roles = roles_after
        if self._segments is not None:
            for r in dead:
                self._segments.pop(r, None)

    def on_failure(self, event: FailureEvent, *, committed_already: bool = False) -> PolicyDecision:
        """Algorithm 6 / 8. With committed_already=True this is note_failure_after_commit."""
        if committed_already:
            return self.note_failure_after_commit(event)
        if self._pending_roles is not None:
            raise PolicyError("on_failure after note_failure_after_commit: this iteration has "
                              "already committed; call after_commit() first")
        roles_after, at_boundary = self._check_event(event, self._roles)
        return self._decide(event, roles_after, at_boundary)

    def _decide(self, event: FailureEvent, roles_after: dict[int, Role],
                at_boundary: bool) -> PolicyDecision:
        raise NotImplementedError

    def note_failure_after_commit(self, event: FailureEvent) -> PolicyDecision:
        """Case (b): the failure surfaced after every bucket was reduced under the old membership.

        The step's sum is already a valid sum of exactly what this iteration's contributors
        accumulated (the dead replica's share included), so it commits as it is: SKIP. The event
        is checked against the roles in force (after any earlier case-(b) event) and held; it
        takes effect in after_commit(), which drops the dead replicas and, if the event was at a
        boundary, installs algorithm 7's layout for the survivors. This iteration's queries
        (alive, roles, quotas, contributes) keep describing the step being committed, so the data
        record of that step (DataAssignment.commit) still includes the dead replica's ids.
        """
        basis = self._pending_roles if self._pending_roles is not None else self._roles
        roles_after, at_boundary = self._check_event(event, basis)
        self._pending_dead.extend(event.failed_replicas)
        self._pending_roles = roles_after
        at_boundary = at_boundary and self.has_boundaries
        self._pending_boundary = self._pending_boundary or at_boundary
        return PolicyDecision(RestoreMode.SKIP, at_boundary)

    def after_commit(self) -> None:
        """Close the iteration: check it committed its target, apply case-(b) failures, install
        the next layout, reset iteration state."""
        total = self.committed()
        if total != self.divisor():
            raise PolicyError(f"iteration {self.iteration} commits {total} microbatches, "
                              f"divisor is {self.divisor()}: invariant broken")
        if self._pending_roles is not None:
            self._remove(self._pending_dead, self._pending_roles)
        self._install_next_layout(self._boundary_crossed or self._pending_boundary)
        self.iteration += 1
        self._new_iteration()

    def _install_next_layout(self, boundary: bool) -> None:
        raise NotImplementedError

    # convenience for tests and tools: fail replicas by id or by role at this synchronisation
    def fail(self, failed: Iterable[int], *, after_commit: bool = False) -> PolicyDecision:
        return self.on_failure(self.expected_event(failed), committed_already=after_commit)

    def fail_roles(self, roles: Iterable["str | Role"]) -> PolicyDecision:
        return self.fail(self.victims_for_roles(roles))

