"""Reveal the gradient divisor a data-parallel system actually applied, and who contributed.

Every replica's loss carries, besides the model's loss, three terms on scalar "probe" parameters
(all initialised to 0 and never stepped, so they change neither the loss value nor the model):

    2**replica * p_id  +  1 * p_count  +  loss.detach() * p_loss

so replica r's local gradients are (2**r, 1, its loss). After the system's all-reduce (sum over
the replicas that actually contributed a non-zero gradient, C, then divide by some d) every
survivor reads

    g_id = sum_{r in C} 2**r / d,    g_count = |C| / d,    g_loss = sum_{r in C} loss_r / d.

g_id / g_count = S / |C| with S = sum of 2**r over C: a subset is found whose (S, |C|) match both
numbers with one integer d; then the step's mean loss over contributors is g_loss * d / |C|.
Both numbers are needed: g_id alone cannot tell {1} / 1 from {2} / 2.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


class ProbeDecodeError(ValueError):
    """The probe gradients match no (contributors, divisor) pair within tolerance."""


def probe_weight(replica: int) -> float:
    return float(2 ** int(replica))


@dataclass(frozen=True)
class ProbeReading:
    contributors: tuple[int, ...]   # replica ids whose gradient was in the sum
    divisor: int                    # what the sum was divided by (replicas)
    loss: float | None              # mean loss over the contributors (None without g_loss)


def decode_probe(g_id: float, g_count: float, replicas: int, g_loss: float | None = None,
                 max_divisor: int | None = None, tol: float = 1e-4) -> ProbeReading:
    """(contributors, divisor, loss) from the probe gradients; ProbeDecodeError if none fits.

    ``replicas``: replica ids are 0..replicas-1. ``max_divisor``: largest divisor tried (default
    2 * replicas). A zero gradient (nobody contributed) raises.
    """
    if replicas < 1 or replicas > 30:
        raise ValueError(f"replicas({replicas}) must be in [1, 30]")
    if not (g_count > 0 and g_id > 0):
        raise ProbeDecodeError(f"probe gradients g_id={g_id!r} g_count={g_count!r}: no replica "
                               f"contributed")
    dmax = max_divisor or 2 * replicas
    best: tuple[float, tuple[int, ...], int] | None = None
    for n in range(1, replicas + 1):
        d = round(n / g_count)
        if d < 1 or d > dmax or abs(n / d - g_count) > tol * max(1.0, g_count):
            continue
        s = g_id * d
        S = round(s)
        if abs(s - S) > tol * max(1.0, s) or S < 1 or S >= 2 ** replicas:
            continue
        members = tuple(r for r in range(replicas) if S >> r & 1)
        if len(members) != n:
            continue
        err = abs(s - S) + abs(n / d - g_count)
        if best is None or err < best[0]:
            best = (err, members, d)
    if best is None:
        raise ProbeDecodeError(f"probe gradients g_id={g_id!r} g_count={g_count!r} match no set "
                               f"of replicas 0..{replicas - 1} with a divisor <= {dmax}")
    _, members, d = best
    loss = None if g_loss is None else g_loss * d / len(members)
    return ProbeReading(members, d, loss)


def all_readings(replicas: int, max_divisor: int | None = None):
    """Every (members, divisor) pair and its exact probe gradients (for tests)."""
    dmax = max_divisor or 2 * replicas
    for n in range(1, replicas + 1):
        for members in itertools.combinations(range(replicas), n):
            S = sum(2 ** r for r in members)
            for d in range(1, dmax + 1):
                yield members, d, S / d, n / d
