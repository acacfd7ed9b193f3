"""Record-level invariants of a ReCoVer run (no torch, no replay).

What every committed run must satisfy (docs/interfaces.md, policy + DataAssignment):
  * steps 0 .. last are each committed exactly once (no gap; the merge already refuses a step
    recorded twice with different content);
  * a step's divisor is B for the static policy; for the adaptive policy it is the committed count
    (and never more than B);
  * the number of contributed ids equals the divisor;
  * every contributing replica is an initial replica (0 <= r < W_init) and every id it
    contributes is in its own slice (id % W_init == r, id >= 0);
  * no id is contributed twice in the whole run;
  * a replica's ids strictly increase over the run (its slice cursor never moves back).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    step: int
    message: str


def check_records(steps: Mapping[int, object], *, w_init: int, B: int, policy: str = "static",
                  first_only: bool = False) -> list[Violation]:
    """All violations, ascending step (``first_only``: stop at the first failing step)."""
    out: list[Violation] = []
    seen: dict[int, int] = {}            # id -> step that contributed it
    last_id: dict[int, tuple[int, int]] = {}  # replica -> (last id, its step)
    expected = 0
    for s in sorted(steps):
        rec = steps[s]
        bad: list[str] = []
        if s != expected:
            missing = f"{expected}" if s == expected + 1 else f"{expected}..{s - 1}"
            out.append(Violation(expected, f"step {missing} never committed (gap before "
                                           f"committed step {s})"))
            if first_only:
                return out
        expected = s + 1
        divisor = getattr(rec, "divisor", None)
        contributions = getattr(rec, "contributions", None) or {}
        count = sum(len(ids) for ids in contributions.values())
        if not isinstance(divisor, int) or isinstance(divisor, bool) or divisor < 1:
            bad.append(f"divisor {divisor!r} is not a positive integer")
        elif policy == "static" and divisor != B:
            bad.append(f"divisor {divisor} != B {B} (static policy)")
        elif policy == "adaptive" and divisor > B:
            bad.append(f"divisor {divisor} > B {B} (adaptive policy)")
        if isinstance(divisor, int) and count != divisor:
            bad.append(f"{count} microbatch ids contributed, divisor is {divisor}")
        for r in sorted(contributions):
            ids = contributions[r]
            if not isinstance(r, int) or not 0 <= r < w_init:
                bad.append(f"contribution from replica {r!r}, not an initial replica "
                           f"(w_init {w_init})")
                continue
            for i in ids:
                if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                    bad.append(f"replica {r}: microbatch id {i!r} is not a non-negative integer")
                    continue
                if i % w_init != r:
                    bad.append(f"replica {r} contributed id {i}, which is in replica "
                               f"{i % w_init}'s slice (id % {w_init})")
                if i in seen:
                    where = "this step" if seen[i] == s else f"step {seen[i]}"
                    bad.append(f"microbatch id {i} contributed twice (also in {where})")
                else:
                    seen[i] = s
                prev = last_id.get(r)
                if prev is not None and i <= prev[0] and i not in (prev[0],):
                    bad.append(f"replica {r}: id {i} after id {prev[0]} (step {prev[1]}): its "
                               f"slice cursor moved back")
                last_id[r] = (i, s) if prev is None or i > prev[0] else prev
        if bad:
            out.append(Violation(s, "; ".join(dict.fromkeys(bad))))
            if first_only:
                return out
    return out


def check_bucket_epochs(local: Mapping[int, Mapping[int, Mapping]], steps: Mapping[int, object]
                        | None = None, *, first_only: bool = False) -> tuple[list[Violation], int]:
    """Every bucket of a committed step must hold ONE reduction, all under ONE membership.

    ``local``: step -> global rank -> the rank-local dict of its step record, whose
    ``bucket_epochs`` (written by the trainer from the orchestrator) lists, per bucket, the
    membership epochs of the reductions its committed content holds (a rewind empties the list).
    An honest step has ``[[e], [e], ...]`` on every rank with e the step's epoch. A bucket
    re-reduced on top of a sum reduced under an older membership (restoration disabled: a missing
    rewind) holds two epochs; a bucket left reduced under the old membership (a stale bucket)
    disagrees with the others. Returns (violations, ranks-steps that carried the field).
    """
    out: list[Violation] = []
    checked = 0
    for s in sorted(local):
        rec = (steps or {}).get(s)
        step_epoch = getattr(rec, "epoch", None)
        if any(f.get("case_b") for f in (getattr(rec, "failures", None) or [])):
            step_epoch = None   # case (b): reduced under the membership BEFORE the repair
        bad = []
        for rank in sorted(local[s]):
            be = (local[s][rank] or {}).get("bucket_epochs")
            if be is None:
                continue
            checked += 1
            flat = set()
            for i, ep in enumerate(be):
                ep = list(ep or [])
                if len(ep) != 1:
                    what = ("no reduction" if not ep else
                            f"{len(ep)} reductions under epochs {ep}")
                    bad.append(f"rank {rank}, bucket {i}: {what} in its committed sum "
                               f"(reduced under more than one membership: a missing rewind)"
                               if len(set(ep)) > 1 else
                               f"rank {rank}, bucket {i}: {what} in its committed sum")
                flat.update(ep)
            if len(flat) > 1:
                bad.append(f"rank {rank}: buckets reduced under different memberships "
                           f"(epochs {sorted(flat)}; a stale bucket)")
            elif flat and step_epoch is not None and flat != {int(step_epoch)}:
                bad.append(f"rank {rank}: buckets reduced under epoch {min(flat)}, the step "
                           f"committed under epoch {step_epoch}")
        if bad:
            out.append(Violation(s, "; ".join(dict.fromkeys(bad))))
            if first_only:
                break
    return out, checked
