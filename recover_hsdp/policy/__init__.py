"""The versatile-workload policy layer (top protocol layer). Pure Python: imports only
recover_hsdp.types, never torch.

  layout.py    Layout, algorithm 7 (advance_layout), algorithm 6's arithmetic (boundary_extension)
  election.py  the spare election, C_cur, and the layout -> replica-id mapping rule
  events.py    RestoreMode, FailureEvent, PolicyDecision
  static.py    StaticWorldPolicy (algorithms 6 + 7; constant global batch B)
  adaptive.py  AdaptiveWorldPolicy (algorithm 8; shrinking global batch, the baseline)
  data.py      DataAssignment (which microbatch ids each replica contributes to each step)
  counts.py    count-level twin of both policies: the capacity planner's engine
"""
from __future__ import annotations

from recover_hsdp.policy._base import ROLE_NAMES, PolicyBase, parse_role
from recover_hsdp.policy.adaptive import AdaptiveWorldPolicy
from recover_hsdp.policy.counts import CountModel, EventOutcome, IterationOutcome, plan, random_plan
from recover_hsdp.policy.data import DataAssignment
from recover_hsdp.policy.election import (boundary_roles, contrib_total, elect,
                                          roles_for_layout)
from recover_hsdp.policy.events import (EventMismatchError, FailureEvent, PolicyDecision,
                                        RestoreMode)
from recover_hsdp.policy.layout import (Layout, PolicyError, admitted_spares, advance_layout,
                                        boundary_extension)
from recover_hsdp.policy.static import StaticWorldPolicy

__all__ = [
    "ROLE_NAMES", "AdaptiveWorldPolicy", "CountModel", "DataAssignment", "EventMismatchError", "EventOutcome",
    "FailureEvent", "IterationOutcome", "Layout", "PolicyBase", "PolicyDecision", "PolicyError",
    "RestoreMode", "StaticWorldPolicy", "admitted_spares", "advance_layout", "boundary_extension",
    "boundary_roles", "contrib_total", "elect", "parse_role", "plan", "random_plan",
    "roles_for_layout",
]
