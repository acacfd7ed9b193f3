"""Plain data shared by every layer: replica roles, the survivor census and the failure record.

Pure Python on purpose: the policy layer and the planner import this without torch.distributed.
Layers import downward only (collectives -> recovery -> hsdp); this module sits below them all.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Role(enum.IntEnum):
    """A replica's role for the current iteration (paper section 4.3).

    The integer values are the wire format shared with the C++ backend (csrc/ulfm_types.h).
    """

    MAJOR = 0           # contributes G_cur microbatches
    MINOR = 1           # contributes R_cur < G_cur microbatches
    MAJOR_SPARE = 2     # computes like a major, contributes 0 until promoted
    MINOR_SPARE = 3     # computes like a minor, contributes 0 until promoted
    BOUNDARY_MINOR = 4  # boundary step only: contributes G_ext - 1 extra instead of G_ext

    @property
    def is_spare(self) -> bool:
        return self in (Role.MAJOR_SPARE, Role.MINOR_SPARE)


@dataclass(frozen=True)
class RoleCensus:
    """How many survivors hold each role (after any spare promotion)."""

    major: int = 0
    minor: int = 0
    major_spare: int = 0
    minor_spare: int = 0
    boundary_minor: int = 0

    @property
    def total(self) -> int:
        return self.major + self.minor + self.major_spare + self.minor_spare + self.boundary_minor

    @classmethod
    def of(cls, roles) -> "RoleCensus":
        counts = [0] * 5
        for r in roles:
            counts[int(r)] += 1
        return cls(*counts)

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.major, self.minor, self.major_spare, self.minor_spare, self.boundary_minor)


@dataclass(frozen=True)
class FailureRecord:
    """What one ULFM collective call reports; identical on every survivor of that call.

    failed_ranks are global ids (MPI_COMM_WORLD ranks) of the members lost in this call;
    roles[k] is the role of the k-th member of the repaired group (group-rank order), after the
    spare election; contrib is the survivors' contribution total C_cur at the moment of failure.
    """

    ok: bool
    failed_ranks: tuple[int, ...] = ()
    epoch: int = 0
    census: RoleCensus = field(default_factory=RoleCensus)
    contrib: int = 0
    at_boundary: bool = False
    roles: tuple[Role, ...] = ()
    quiesced: bool = False  # the call was a no-op because the group is quiesced
