"""Hot standbys (docs/rejoin.md): the policy side of a join. Pure Python.

A promoted standby takes the SLOT of a lost replica: its replica id in the record, its data slice
(ids k * W_init + slot) and the slice's cursor where the lost replica left it. Every id of that
slice committed before has k < that cursor (a replica's cursor advances past every position it
computed at each commit), so the newcomer reads only ids never committed: exactly-once holds.
After the join the layout grows back: algorithm 7 for the new width with G restarting from
ceil(B / W) (not from the degraded G), so B = W_init * G_init is kept and G goes back down.
"""
from __future__ import annotations

from typing import Any, Optional

from recover_hsdp.policy._base import PolicyBase
from recover_hsdp.policy.data import DataAssignment
from recover_hsdp.policy.election import roles_for_layout
from recover_hsdp.policy.layout import PolicyError, advance_layout


def standby_config_problem(standby: int, policy: str, baseline: str, run: Any) -> Optional[str]:
    """Why parallel.standby > 0 cannot run with these settings (one line), or None. Standbys
    combine with checkpoint.interval / checkpoint.resume / elastic.min_replicas / elastic.rejoin (the
    checkpoint groups are per rank block; only the W active slots' slices are saved; docs/rejoin.md)."""
    if policy != "static":
        return (f"parallel.standby({standby}) needs policy.name=static (the adaptive policy "
                f"shrinks B; a join would have to grow it back)")
    if baseline != "none":
        return f"parallel.standby({standby}) runs only with baseline.name=none (got {baseline!r})"
    return None


def rejoin_config_problem(policy: str, baseline: str) -> Optional[str]:
    """Why elastic.rejoin=true cannot run with these settings (one line), or None."""
    if policy != "static":
        return (f"elastic.rejoin=true needs policy.name=static (got {policy!r}: the adaptive policy "
                f"shrinks B, a relaunch at full width would have to grow it back)")
    if baseline != "none":
        return (f"elastic.rejoin=true runs only with baseline.name=none (got {baseline!r}: the "
                f"baselines restart by their own rules)")
    return None


def vacant_slots(w_init: int, alive) -> list[int]:
    """Slots of lost replicas, ascending: the next join fills the lowest."""
    return sorted(set(range(w_init)) - set(alive))


def rejoin(policy: PolicyBase, data: DataAssignment, slot: int) -> None:
    """Between two iterations: slot joins (alive again, its slice resumed), layout re-grown."""
    if slot in policy.alive:
        raise PolicyError(f"slot {slot} is alive: nothing to join")
    if not 0 <= slot < policy.w_init:
        raise PolicyError(f"slot {slot} not in [0, {policy.w_init})")
    if policy._pending_roles is not None or policy._segments is not None:
        raise PolicyError("rejoin inside an iteration: join only between committed steps")
    data.adopt(slot)
    alive = tuple(sorted(policy.alive + (slot,)))
    policy._alive = alive
    policy._layout = advance_layout(len(alive), policy.B, 1)
    policy._roles = roles_for_layout(alive, policy._layout)
    policy._new_iteration()
