"""Count-level arithmetic of the versatile workload: layouts, algorithm 6's extension, algorithm 7.

Everything here works on counts (how many replicas hold each role), never on replica ids, so it
costs O(1) per call whatever the world size. The id-level role map (which replica holds which
role) lives in `election.py` and is built on top of these functions; both are checked against each
other by the property tests.
"""
from __future__ import annotations

from dataclasses import dataclass


class PolicyError(RuntimeError):
    """A request the policy cannot honour (bad input, no survivor left, an invariant broken)."""


@dataclass(frozen=True)
class Layout:
    """Steady-state role layout (G_cur, n_major, n_minor, R_cur, n_major_spare, n_minor_spare).

    Majors and major-spares accumulate `g` microbatches per iteration, the minor and the
    minor-spares `r` (< g). Spares compute but contribute nothing until promoted.
    """

    g: int
    n_major: int
    n_minor: int = 0
    r: int = 0
    n_major_spare: int = 0
    n_minor_spare: int = 0

    def __post_init__(self) -> None:
        if self.g < 1:
            raise PolicyError(f"Layout.g must be >= 1 (got {self.g})")
        for name in ("n_major", "n_minor", "n_major_spare", "n_minor_spare"):
            if getattr(self, name) < 0:
                raise PolicyError(f"Layout.{name} must be >= 0 (got {getattr(self, name)})")
        if not 0 <= self.r < self.g:
            raise PolicyError(f"Layout.r must be in [0, g) (got r={self.r}, g={self.g})")

    @property
    def replicas(self) -> int:
        return self.n_major + self.n_minor + self.n_major_spare + self.n_minor_spare

    @property
    def committed(self) -> int:
        """Microbatches a failure-free iteration under this layout commits."""
        return self.n_major * self.g + self.n_minor * self.r

    @classmethod
    def initial(cls, w_init: int, g_init: int) -> "Layout":
        """Every replica a major at G_init: commits B = W_init * G_init."""
        if w_init < 1 or g_init < 1:
            raise PolicyError(f"W_init and G_init must be >= 1 (got {w_init}, {g_init})")
        return cls(g=g_init, n_major=w_init)

    def as_dict(self) -> dict[str, int]:
        """The planner's JSON form."""
        return {"g": self.g, "major": self.n_major, "minor": self.n_minor, "r": self.r,
                "major_spare": self.n_major_spare, "minor_spare": self.n_minor_spare}

    def __str__(self) -> str:
        return (f"g={self.g} major={self.n_major} minor={self.n_minor} r={self.r} "
                f"major_spare={self.n_major_spare} minor_spare={self.n_minor_spare}")


def advance_layout(w_cur: int, b: int, g_prev: int = 1) -> Layout:
    """Algorithm 7 (POLICY_ADVANCEMENT), run after a boundary step has committed.

    G_cur grows (from g_prev) until W_cur * G_cur >= B; N = floor(B / G_cur) majors; one minor
    with R_cur = B - N * G_cur if that is non-zero; the rest spares, one of them a minor-spare
    when there is a minor and at least two are left, all others major-spares.
    """
    if w_cur < 1:
        raise PolicyError("no replica survives: the invariant cannot be kept with W_cur = 0")
    if b < 1:
        raise PolicyError(f"B must be >= 1 (got {b})")
    g = max(g_prev, -(-b // w_cur))  # ceil(B / W_cur): the smallest G with W_cur * G >= B
    n_major = b // g
    r = b - n_major * g
    n_minor = 1 if r else 0
    rest = w_cur - n_major - n_minor
    n_minor_spare = 1 if (n_minor == 1 and rest >= 2) else 0
    return Layout(g, n_major, n_minor, r, rest - n_minor_spare, n_minor_spare)


def boundary_extension(c_cur: int, w_cur: int, b: int) -> tuple[int, int]:
    """Algorithm 6, boundary branch: (G_ext, n_boundary_minor).

    G_ext is the smallest integer >= 1 with C_cur + W_cur * G_ext >= B; W_cur * G_ext - (B - C_cur)
    survivors become boundary minors (G_ext - 1 extra microbatches), the rest majors (G_ext extra),
    so the step lands on exactly B. Requires C_cur <= B (see `admitted_spares`).
    """
    if w_cur < 1:
        raise PolicyError("no replica survives: the invariant cannot be kept with W_cur = 0")
    if c_cur > b:
        raise PolicyError(f"C_cur = {c_cur} exceeds B = {b}: the boundary step cannot land on B")
    missing = b - c_cur
    g_ext = max(1, -(-missing // w_cur))
    return g_ext, w_cur * g_ext - missing


def admitted_spares(c_contributors: int, spares: list[tuple[int, int]], b: int) -> list[int]:
    """How many spares of each accumulation class a boundary step admits.

    `spares` lists (accumulated microbatches, count) per class, in admission order (most
    accumulated first). Every spare is admitted as long as C_cur stays <= B; a spare that would push
    C_cur past B is discarded (its accumulated gradient is zeroed, its ids are consumed but
    unused). Returns the admitted count per class. See docs/policy.md, "the open case".
    """
    room = b - c_contributors
    out = []
    for acc, count in spares:
        take = count if acc == 0 else max(0, min(count, room // acc))
        room -= take * acc
        out.append(take)
    return out
