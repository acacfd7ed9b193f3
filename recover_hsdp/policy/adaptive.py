"""AdaptiveWorldPolicy: algorithm 8, the repair-and-continue strawman kept as a baseline.

Every replica is a major at G_init forever; a failure is repaired (BLOCKING restore, never a
boundary) and the iteration commits what the survivors accumulated, W_cur * G_init < B, divided
by that same count. The global batch shrinks with the world: this is what the versatile workload
of StaticWorldPolicy adds on top of the same collectives and the same in-step rollback.
"""
from __future__ import annotations

from recover_hsdp.policy._base import PolicyBase
from recover_hsdp.policy.events import FailureEvent, PolicyDecision, RestoreMode
from recover_hsdp.policy.layout import Layout, PolicyError
from recover_hsdp.types import Role


class AdaptiveWorldPolicy(PolicyBase):
    """Shrinking global batch: divisor() = microbatches actually committed."""

    has_boundaries = False

    def _prefix_quota(self, role: Role) -> int:
        if role != Role.MAJOR:
            raise PolicyError(f"adaptive policy has only majors (got {role.name})")
        return self.g_init

    def divisor(self) -> int:
        return len(self._alive) * self.g_init

    def _decide(self, event: FailureEvent, roles_after: dict[int, Role],
                at_boundary: bool) -> PolicyDecision:
        # The backend reports at_boundary=True (a major died, no spare exists); algorithm 8
        # ignores it: no extension, no layout change beyond dropping the dead.
        self._remove(event.failed_replicas, roles_after)
        self._layout = Layout(self.g_init, len(self._alive))
        return PolicyDecision(RestoreMode.BLOCKING, False)

    def _install_next_layout(self, boundary: bool) -> None:
        self._layout = Layout(self.g_init, len(self._alive))
