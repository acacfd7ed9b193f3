"""Id-level role map: the spare election, the census contribution and layout -> replica ids.

Pure functions of agreed inputs (the role of every replica, the failed set, the layout), so every
rank computes the same answer without talking to anyone. The C++ backend performs the same
election inside the collective; the policy re-runs `elect` on every failure event and refuses an
event that disagrees (a protocol bug must not pass silently).

The mapping rule (documented in docs/policy.md):
  * after algorithm 7 (`roles_for_layout`): ascending alive replica ids take, in order, the
    n_major majors, the minor, the major-spares, then the minor-spares;
  * promotions keep ids: the lowest-id surviving spare of the dead contributor's role takes over;
  * at a boundary step (`boundary_roles`): survivors are ordered by microbatches accumulated so
    far this iteration (most first), ties by replica id (highest first); the first
    n_boundary_minor of that order become boundary minors, everybody else a major. With equal
    accumulations (the common case: everyone finished its quota) that is simply the LAST
    n_boundary_minor alive ids. Ordering by accumulation (not by id alone) keeps the rule
    computable from counts, so the count-level planner reproduces it exactly.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from recover_hsdp.policy.layout import Layout, PolicyError
from recover_hsdp.types import Role

# The spare role that replaces a dead contributor of each role.
SPARE_FOR: dict[Role, Role] = {
    Role.MAJOR: Role.MAJOR_SPARE,
    Role.BOUNDARY_MINOR: Role.MAJOR_SPARE,
    Role.MINOR: Role.MINOR_SPARE,
}


def elect(roles: Mapping[int, Role], failed: Iterable[int]) -> tuple[dict[int, Role], bool]:
    """Spare election after `failed` died; returns (post-election roles of survivors, at_boundary).

    For each dead MAJOR or BOUNDARY_MINOR the lowest-id surviving MAJOR_SPARE becomes a MAJOR; for
    each dead MINOR the lowest-id surviving MINOR_SPARE becomes a MINOR; dead spares need nothing.
    at_boundary: some dead contributor cannot be replaced by a spare of its role; then NO
    promotion happens at all (the boundary step re-assigns every survivor anyway).
    """
    dead = set(failed)
    unknown = dead - roles.keys()
    if unknown:
        raise PolicyError(f"failed replicas {sorted(unknown)} are not alive")
    survivors = {r: Role(int(roles[r])) for r in sorted(roles) if r not in dead}
    need = {Role.MAJOR_SPARE: 0, Role.MINOR_SPARE: 0}
    for r in dead:
        spare = SPARE_FOR.get(Role(int(roles[r])))
        if spare is not None:
            need[spare] += 1
    pools = {spare: [r for r, role in survivors.items() if role == spare] for spare in need}
    if any(need[s] > len(pools[s]) for s in need):
        return survivors, True
    for spare, n in need.items():
        promoted = Role.MAJOR if spare == Role.MAJOR_SPARE else Role.MINOR
        for r in pools[spare][:n]:  # pools are in ascending id order
            survivors[r] = promoted
    return survivors, False


def contrib_total(roles_after: Mapping[int, Role], accumulated: Mapping[int, int],
                  at_boundary: bool) -> int:
    """The census contribution C_cur the backend reports with a failure.

    At a boundary every survivor's accumulated microbatches count (spares are admitted, Algorithm 2
    line 8 read literally); otherwise only the non-spares' (after the election).
    """
    return sum(accumulated[r] for r, role in roles_after.items()
               if at_boundary or not Role(int(role)).is_spare)


def roles_for_layout(alive: Iterable[int], layout: Layout) -> dict[int, Role]:
    """Algorithm 7's layout -> ids: ascending ids take majors, minor, major-, minor-spares."""
    ids = sorted(alive)
    if len(ids) != layout.replicas:
        raise PolicyError(f"layout holds {layout.replicas} replicas but {len(ids)} are alive")
    out: dict[int, Role] = {}
    i = 0
    for role, n in ((Role.MAJOR, layout.n_major), (Role.MINOR, layout.n_minor),
                    (Role.MAJOR_SPARE, layout.n_major_spare),
                    (Role.MINOR_SPARE, layout.n_minor_spare)):
        for r in ids[i:i + n]:
            out[r] = role
        i += n
    return out


def boundary_roles(accumulated: Mapping[int, int], n_boundary_minor: int) -> dict[int, Role]:
    """Boundary-step roles: the n_boundary_minor survivors with most accumulated (ties: highest id)
    become BOUNDARY_MINOR, every other survivor MAJOR. `accumulated` is after any spare discard."""
    order = sorted(accumulated, key=lambda r: (-accumulated[r], -r))
    if not 0 <= n_boundary_minor <= len(order):
        raise PolicyError(f"n_boundary_minor = {n_boundary_minor} with {len(order)} survivors")
    out = {r: Role.MAJOR for r in accumulated}
    for r in order[:n_boundary_minor]:
        out[r] = Role.BOUNDARY_MINOR
    return out
