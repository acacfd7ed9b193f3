"""Independent expected microbatch ids: which ids every committed step MUST sum.

``records.check_records`` checks that a step's ids look valid (count == divisor, unique, own
slice, increasing per replica). That cannot catch a policy bug that commits a DIFFERENT set of
valid-looking ids (a dead replica's partial microbatch kept, a boundary minor's extension id off
by one). This module re-derives, from the recorded failure events alone (which replicas died, in
which step, and whether the failure surfaced after every bucket was reduced: the paper's case
(b)) and the initial layout (W_init, G_init), the exact ids each replica must contribute to each
committed step, and compares them with the record.

It is deliberately a SECOND implementation of the paper's rules (appendix D, algorithms 6-8 and
the boundary extension, plus the decisions of docs/policy.md): it imports nothing from
``recover_hsdp.policy`` (a unit test scans the imports), only the standard library. The rules,
restated from the paper and docs/policy.md:

* Positions. Every alive replica computes P positions per iteration; replica r's position p of an
  iteration consumes id ``(k_r + p) * W_init + r`` where k_r counts the positions r computed in
  committed iterations. A major / major-spare keeps positions 0..G-1, a minor / minor-spare
  0..R-1 (it computes G); spares contribute nothing.
* A failure event (failures surface at the synchronisation after the microbatch loop). Election:
  every dead major or boundary minor needs a surviving major-spare, every dead minor a surviving
  minor-spare (lowest ids promoted). If every need is met: no boundary, restore BLOCKING, P
  unchanged. Otherwise a BOUNDARY with no promotion: every surviving spare is admitted with what
  it accumulated, most-accumulated first (ties: lowest id), while the committed count stays <= B;
  a spare that does not fit is discarded (keeps nothing before the boundary). With C the kept
  count and W the survivors: G_ext = max(1, ceil((B - C) / W)); W*G_ext - (B - C) survivors
  (most accumulated first, ties: HIGHEST id) become boundary minors computing G_ext - 1 more kept
  positions, everybody else G_ext more; P grows by G_ext; restore NON_BLOCKING.
* Case (b) (the record says ``case_b``): the step commits as reduced, the dead replicas' ids
  included; the election is applied after the commit; restore SKIP.
* After a step with a boundary (algorithm 7): G = max(G, ceil(B / W)); B // G majors, one minor
  with R = B - (B // G) G if non-zero, the rest spares, one of them a minor-spare when there is a
  minor and at least two are left; ascending ids take majors, the minor, major-spares,
  minor-spares.
* Adaptive policy (algorithm 8): every replica a major at G_init; the dead are dropped (BLOCKING),
  the step divides by what it commits.
* A join (hot standby, docs/rejoin.md; the step record's ``extra.joins`` entries with outcome
  ``joined``), applied before the step it is recorded in: the slot is alive again and resumes
  its slice at the cursor its lost replica left (so no committed id can come back); then
  algorithm 7 for the new width with G restarting from ceil(B / W).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

MAJOR, MINOR, MAJOR_SPARE, MINOR_SPARE, BOUNDARY_MINOR = (
    "major", "minor", "major_spare", "minor_spare", "boundary_minor")
_SPARES = (MAJOR_SPARE, MINOR_SPARE)
_REPLACED_BY = {MAJOR: MAJOR_SPARE, BOUNDARY_MINOR: MAJOR_SPARE, MINOR: MINOR_SPARE}


@dataclass(frozen=True)
class Event:
    """One failure event as recorded: the replicas lost, and whether it was case (b)."""

    replicas: tuple[int, ...]
    case_b: bool = False
    at_boundary: bool | None = None     # as recorded (checked), None if not recorded
    mode: str | None = None             # as recorded (checked), None if not recorded


@dataclass
class ExpectedStep:
    step: int
    contributions: dict[int, list[int]]
    divisor: int
    alive: list[int]                  # alive at commit (case-(b) dead included)
    boundary: bool
    events: list[dict] = field(default_factory=list)   # per event: at_boundary, mode, g_ext, ...


@dataclass(frozen=True)
class Mismatch:
    step: int
    message: str
    replica: int | None = None


class DerivationError(ValueError):
    """The recorded events cannot happen (a replica dies twice, nobody survives, ...)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ExpectedIds:
    """The protocol's state machine at id level, driven only by failure events."""

    def __init__(self, w_init: int, g_init: int, policy: str = "static"):
        if w_init < 1 or g_init < 1:
            raise DerivationError(f"W_init and G_init must be >= 1 (got {w_init}, {g_init})")
        if policy not in ("static", "adaptive"):
            raise DerivationError(f"unknown policy {policy!r}")
        self.W, self.G0, self.policy = w_init, g_init, policy
        self.B = w_init * g_init
        self.g, self.r = g_init, 0
        self.roles: dict[int, str] = {i: MAJOR for i in range(w_init)}
        self.cursor: dict[int, int] = {i: 0 for i in range(w_init)}
        self.abandoned: dict[int, int] = {}        # a lost slot's cursor, for a later join
        self.step = 0

    def join(self, slot: int) -> None:
        """A standby took ``slot`` between the previous step and this one."""
        if slot in self.roles or not 0 <= slot < self.W:
            raise DerivationError(f"step {self.step}: a join into slot {slot}, which is alive "
                                  f"or out of range (alive {sorted(self.roles)})")
        if slot not in self.cursor:
            if slot not in self.abandoned:
                raise DerivationError(f"step {self.step}: a join into slot {slot}, never lost")
            self.cursor[slot] = self.abandoned.pop(slot)
        self.g = 1
        self._advance(sorted([*self.roles, slot]))

    # ---- one iteration ---------------------------------------------------------------------
    def _prefix(self, role: str) -> int:
        if self.policy == "adaptive":
            return self.G0
        return self.g if role in (MAJOR, MAJOR_SPARE) else self.r

    def run_step(self, events: Sequence[Event]) -> ExpectedStep:
        adaptive = self.policy == "adaptive"
        roles = dict(self.roles)                    # roles in force (changes with events)
        segs: dict[int, list[tuple[int, int]]] | None = None
        P = self.G0 if adaptive else self.g
        crossed = False
        pending: dict[int, str] | None = None       # case (b): roles after the held events
        pending_dead: list[int] = []
        info: list[dict] = []

        def kept(rid: int) -> int:
            if segs is None:
                return self._prefix(roles[rid])
            return sum(b - a for a, b in segs[rid])

        for ev in events:
            dead = sorted(set(ev.replicas))
            basis = pending if pending is not None else roles
            if not dead:
                raise DerivationError(f"step {self.step}: an event names no replica")
            unknown = [d for d in dead if d not in basis]
            if unknown:
                raise DerivationError(f"step {self.step}: event names replicas {unknown} that "
                                      f"are not alive (alive {sorted(basis)})")
            if len(dead) == len(basis):
                raise DerivationError(f"step {self.step}: no replica survives {dead}")
            if not ev.case_b and pending is not None:
                raise DerivationError(f"step {self.step}: a failure handled after a case-(b) "
                                      f"failure of the same step")
            survivors = {i: basis[i] for i in sorted(basis) if i not in dead}
            need = Counter(_REPLACED_BY[basis[d]] for d in dead if basis[d] in _REPLACED_BY)
            pools = {s: [i for i, x in survivors.items() if x == s] for s in _SPARES}
            at_boundary = any(need[s] > len(pools[s]) for s in _SPARES)
            after = dict(survivors)
            if not at_boundary:
                for s in _SPARES:
                    for i in pools[s][:need[s]]:
                        after[i] = MAJOR if s == MAJOR_SPARE else MINOR
            entry = {"replicas": dead, "at_boundary": at_boundary, "case_b": ev.case_b}
            if ev.case_b:
                pending = after
                pending_dead.extend(dead)
                if not adaptive:
                    crossed = crossed or at_boundary
                entry["mode"] = "skip"
                info.append(entry)
                continue
            acc = {i: kept(i) for i in after}
            if segs is not None:
                for d in dead:
                    segs.pop(d, None)
            roles = after
            if adaptive or not at_boundary:
                entry["mode"] = "blocking"
                info.append(entry)
                continue
            # boundary: admit spares while the count stays <= B, then extend
            if segs is None:
                segs = {i: ([(0, q)] if q else []) for i, q in acc.items()}
            room = self.B - sum(a for i, a in acc.items() if after[i] not in _SPARES)
            discarded = []
            for i in sorted((i for i in after if after[i] in _SPARES), key=lambda i: (-acc[i], i)):
                if acc[i] <= room:
                    room -= acc[i]
                else:
                    discarded.append(i)
                    acc[i] = 0
                    segs[i] = []
            w_cur = len(after)
            g_ext = max(1, _ceil_div(room, w_cur))
            n_bm = w_cur * g_ext - room
            order = sorted(acc, key=lambda i: (-acc[i], -i))
            bms = set(order[:n_bm])
            roles = {i: (BOUNDARY_MINOR if i in bms else MAJOR) for i in after}
            for i in roles:
                extra = g_ext - (1 if i in bms else 0)
                if extra:
                    segs[i].append((P, P + extra))
            P += g_ext
            crossed = True
            entry.update(mode="non_blocking", g_ext=g_ext, n_boundary_minor=n_bm,
                         discarded=discarded)
            info.append(entry)

        # commit: ids at kept positions of every contributing replica (case-(b) dead included)
        contributions: dict[int, list[int]] = {}
        for i in sorted(roles):
            if roles[i] in _SPARES:
                contributions[i] = []
                continue
            if segs is None:
                positions: Iterable[int] = range(self._prefix(roles[i]))
            else:
                positions = [p for a, b in segs[i] for p in range(a, b)]
            contributions[i] = [(self.cursor[i] + p) * self.W + i for p in positions]
        count = sum(len(v) for v in contributions.values())
        divisor = count if adaptive else self.B
        if count != divisor:
            raise DerivationError(f"step {self.step}: the rules commit {count} microbatches, "
                                  f"B = {self.B} (events {[e.replicas for e in events]})")
        alive = sorted(roles)
        for i in list(self.cursor):
            if i in roles:
                self.cursor[i] += P
            else:
                self.abandoned[i] = self.cursor.pop(i)
        out = ExpectedStep(self.step, contributions, divisor, alive,
                           bool(crossed) and not adaptive, info)
        # after the commit: case-(b) deaths take effect, algorithm 7 after a boundary
        if pending is not None:
            roles = pending
            for d in pending_dead:
                if d in self.cursor:
                    self.abandoned[d] = self.cursor.pop(d)
        if crossed and not adaptive:
            self._advance(sorted(roles))
        else:
            self.roles = dict(roles)
            if not adaptive and any(x == BOUNDARY_MINOR for x in roles.values()):
                raise DerivationError("boundary minors outside a boundary step")
        self.step += 1
        return out

    def _advance(self, alive: list[int]) -> None:
        """Algorithm 7 for the survivors, mapped onto ascending ids."""
        w = len(alive)
        g = max(self.g, _ceil_div(self.B, w))
        n_major = self.B // g
        r = self.B - n_major * g
        n_minor = 1 if r else 0
        rest = w - n_major - n_minor
        n_minor_spare = 1 if (n_minor and rest >= 2) else 0
        seq = ([MAJOR] * n_major + [MINOR] * n_minor + [MAJOR_SPARE] * (rest - n_minor_spare)
               + [MINOR_SPARE] * n_minor_spare)
        self.g, self.r = g, r
        self.roles = dict(zip(alive, seq))


# ---- reading events from step records ---------------------------------------------------------
def events_of(record) -> list[Event]:
    """The failure events of one step record (entries naming no replica are no events)."""
    out = []
    for f in (getattr(record, "failures", None) or []):
        reps = tuple(int(r) for r in (f.get("replicas") or ()))
        if not reps:
            continue
        ab = f.get("at_boundary")
        out.append(Event(reps, bool(f.get("case_b", False)),
                         None if ab is None else bool(ab), f.get("mode")))
    return out


def joins_of(record) -> list[int]:
    """Slots a standby joined before this step (``extra.joins``, outcome ``joined``)."""
    extra = getattr(record, "extra", None) or {}
    return [int(j["replica"]) for j in (extra.get("joins") or ())
            if j.get("outcome") == "joined"]


def _mode_name(x) -> str | None:
    return None if x is None else str(x).lower()


def check_expected(steps: Mapping[int, object], *, w_init: int, g_init: int,
                   policy: str = "static", first_only: bool = False,
                   expected_out: list | None = None) -> list[Mismatch]:
    """Re-derive every step's ids from its failure events and compare with the record.

    Checks, per committed step: the multiset of ids of every replica (missing and unexpected ids
    named), the divisor, the alive set, the boundary flag, and each event's ``at_boundary`` and
    restore ``mode`` where recorded. Steps must be 0..last (``check_records`` reports gaps).
    """
    out: list[Mismatch] = []
    machine = ExpectedIds(w_init, g_init, policy)
    for s in sorted(steps):
        if s != machine.step:
            out.append(Mismatch(s, f"step {s}: expected ids cannot be derived past a gap "
                                   f"(next derivable step {machine.step})"))
            return out
        rec = steps[s]
        try:
            for slot in joins_of(rec):
                machine.join(slot)
            exp = machine.run_step(events_of(rec))
        except DerivationError as e:
            out.append(Mismatch(s, f"step {s}: recorded failure events are impossible: {e}"))
            return out
        if expected_out is not None:
            expected_out.append(exp)
        bad: list[tuple[str, int | None]] = []
        got = {int(r): list(v) for r, v in (getattr(rec, "contributions", None) or {}).items()}
        for r in sorted(set(got) | set(exp.contributions)):
            want, have = Counter(exp.contributions.get(r, [])), Counter(got.get(r, []))
            if want != have:
                missing = sorted((want - have).elements())
                extra = sorted((have - want).elements())
                bad.append((f"replica {r}: ids differ from the protocol's derivation: "
                            f"missing {_short(missing)}, unexpected {_short(extra)} "
                            f"(expected {_short(sorted(want.elements()))})", r))
        div = getattr(rec, "divisor", None)
        if div != exp.divisor:
            bad.append((f"divisor {div} != {exp.divisor} derived ({policy} policy)", None))
        alive = getattr(rec, "alive", None)
        if alive and sorted(int(a) for a in alive) != exp.alive:
            bad.append((f"alive {sorted(alive)} != {exp.alive} derived", None))
        boundary = getattr(rec, "boundary", None)
        if boundary is not None and bool(boundary) != exp.boundary:
            bad.append((f"boundary={bool(boundary)} but the derivation says {exp.boundary}", None))
        for k, (ev, d) in enumerate(zip(events_of(rec), exp.events)):
            # (the adaptive policy ignores the backend's boundary flag; records differ on it)
            if (policy == "static" and ev.at_boundary is not None
                    and ev.at_boundary != d["at_boundary"]):
                bad.append((f"failure {k} (replicas {list(ev.replicas)}): at_boundary="
                            f"{ev.at_boundary}, derived {d['at_boundary']}", None))
            if ev.mode is not None and _mode_name(ev.mode) != d["mode"]:
                bad.append((f"failure {k} (replicas {list(ev.replicas)}): restore mode "
                            f"{_mode_name(ev.mode)}, derived {d['mode']}", None))
        if bad:
            out.append(Mismatch(s, f"step {s}: " + "; ".join(m for m, _ in bad), bad[0][1]))
            if first_only:
                return out
    return out


def derive(w_init: int, g_init: int, events: Mapping[int, Sequence[Event]], steps: int,
           policy: str = "static") -> list[ExpectedStep]:
    """Expected steps 0..steps-1 for the given events per step (tests, tools)."""
    m = ExpectedIds(w_init, g_init, policy)
    return [m.run_step(list(events.get(s, ()))) for s in range(steps)]


def _short(ids: list[int], n: int = 12) -> str:
    return str(ids) if len(ids) <= n else f"{ids[:n]}... ({len(ids)} ids)"
