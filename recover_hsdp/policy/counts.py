"""Count-level model of both policies: the planner's engine, O(1)-ish per failure.

Survivors are tracked as classes (role, microbatches accumulated at the synchronisation point)
-> how many replicas; a victim is named by its class. This reproduces exactly what the id-level
policies (static.py, adaptive.py) compute -- census, C_cur, at_boundary, G_ext, the number of
boundary minors and discarded spares, the committed count and the next layout -- because every
rule they use (the election, spare admission, the boundary-minor choice, algorithm 7) depends on
roles and accumulations only, never on which id holds them. The property tests drive both with
the same failures and compare.

A failure here happens at a synchronisation point: after every survivor accumulated its quota
(the first pass or an extension pass), which is the only place ReCoVer detects one.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from recover_hsdp.policy._base import parse_role
from recover_hsdp.policy.layout import (Layout, PolicyError, admitted_spares, advance_layout,
                                        boundary_extension)
from recover_hsdp.types import Role, RoleCensus

# Classes are keyed by (int(role), accumulated): plain ints hash faster than the enum, and the
# planner runs tens of thousands of events. _ROLES[i] turns a key back into a Role.
_MAJ, _MIN, _MS, _MIS, _BM = (int(r) for r in (Role.MAJOR, Role.MINOR, Role.MAJOR_SPARE,
                                               Role.MINOR_SPARE, Role.BOUNDARY_MINOR))
_ROLES = tuple(sorted(Role))
_SPARE_SET = frozenset((_MS, _MIS))
_SPARE_FOR = {_MAJ: _MS, _BM: _MS, _MIN: _MIS}  # election.SPARE_FOR in ints


@dataclass(slots=True)
class EventOutcome:
    """One failure event at count level."""

    victims: tuple[Role, ...]       # roles of the dead before the election
    at_boundary: bool
    census: RoleCensus              # after the election (before any boundary re-assignment)
    contrib: int                    # C_cur as the backend reports it (contrib_total)
    c_cur: int                      # C_cur the policy extends from (after discarding spares)
    g_ext: int = 0
    n_boundary_minor: int = 0
    discarded: int = 0

    def as_dict(self) -> dict:
        return {"victims": [v.name.lower() for v in self.victims],
                "boundary": self.at_boundary, "contrib": self.contrib, "c_cur": self.c_cur,
                "g_ext": self.g_ext, "n_boundary_minor": self.n_boundary_minor,
                "discarded_spares": self.discarded}


@dataclass(slots=True)
class IterationOutcome:
    """One committed iteration. `layout` is the layout the iteration STARTED with (before any
    failure and before advance); `next_layout` the one installed by after_commit (algorithm 7
    after a boundary, else the census after promotions)."""

    iteration: int                  # 1-based: the first planned iteration is 1
    layout: Layout
    next_layout: Layout
    events: tuple[EventOutcome, ...]
    boundary: bool
    g_ext: int                      # total extension this iteration (sum over its events)
    n_boundary_minor: int           # boundary minors at commit time
    discarded: int
    committed: int
    divisor: int
    steps: int                      # P(major): microbatches every survivor computed
    alive: int                      # survivors at commit
    g_init: int = field(repr=False, default=1)

    @property
    def step_time(self) -> float:
        """Relative step time of the survivors: max microbatches per replica / G_init."""
        return self.steps / self.g_init

    def as_dict(self) -> dict:
        return {"iteration": self.iteration, "alive": self.alive, "boundary": self.boundary,
                "g_ext": self.g_ext, "n_boundary_minor": self.n_boundary_minor,
                "discarded_spares": self.discarded, "committed": self.committed,
                "divisor": self.divisor, "steps": self.steps,
                "step_time": round(self.step_time, 6),
                "failures": [e.as_dict() for e in self.events],
                "layout": self.layout.as_dict(), "next_layout": self.next_layout.as_dict()}

    def to_json(self) -> str:
        """json.dumps(self.as_dict(), separators=(",", ":")), several times faster (the planner
        prints tens of thousands of these; a test checks the two agree)."""
        ev = ",".join(
            '{"victims":[%s],"boundary":%s,"contrib":%d,"c_cur":%d,"g_ext":%d,'
            '"n_boundary_minor":%d,"discarded_spares":%d}'
            % (",".join(_ROLE_JSON[v] for v in e.victims), _BOOL[e.at_boundary], e.contrib,
               e.c_cur, e.g_ext, e.n_boundary_minor, e.discarded) for e in self.events)
        return ('{"iteration":%d,"alive":%d,"boundary":%s,"g_ext":%d,"n_boundary_minor":%d,'
                '"discarded_spares":%d,"committed":%d,"divisor":%d,"steps":%d,"step_time":%s,'
                '"failures":[%s],"layout":%s,"next_layout":%s}'
                % (self.iteration, self.alive, _BOOL[self.boundary], self.g_ext,
                   self.n_boundary_minor, self.discarded, self.committed, self.divisor,
                   self.steps, json.dumps(round(self.step_time, 6)), ev,
                   _layout_json(self.layout), _layout_json(self.next_layout)))


_BOOL = {True: "true", False: "false"}
_ROLE_JSON = {r: '"%s"' % r.name.lower() for r in Role}


def _layout_json(lay: Layout) -> str:
    return ('{"g":%d,"major":%d,"minor":%d,"r":%d,"major_spare":%d,"minor_spare":%d}'
            % (lay.g, lay.n_major, lay.n_minor, lay.r, lay.n_major_spare, lay.n_minor_spare))


class CountModel:
    """Count-level twin of StaticWorldPolicy (adaptive=False) or AdaptiveWorldPolicy (True)."""

    def __init__(self, w_init: int, g_init: int, *, adaptive: bool = False) -> None:
        if w_init < 1 or g_init < 1:
            raise PolicyError(f"W_init and G_init must be >= 1 (got {w_init}, {g_init})")
        self.w_init, self.g_init, self.B = w_init, g_init, w_init * g_init
        self.adaptive = adaptive
        self.iteration = 0  # committed iterations so far
        self.layout = Layout.initial(w_init, g_init)
        self.alive = w_init
        self._start_iteration()

    # ---- state ---------------------------------------------------------------------------
    def _start_iteration(self) -> None:
        lay = self.layout
        self.start_layout = lay
        self.steps = lay.g
        self.classes: dict[tuple[int, int], int] = {}  # (int(role), accumulated) -> count
        for role, acc, n in ((_MAJ, lay.g, lay.n_major), (_MIN, lay.r, lay.n_minor),
                             (_MS, lay.g, lay.n_major_spare), (_MIS, lay.r, lay.n_minor_spare)):
            if n:
                self.classes[(role, acc)] = n
        self.boundary = False
        self.events: list[EventOutcome] = []
        self.g_ext_total = 0
        self.discarded = 0

    def count(self, role: "Role | int") -> int:
        role = int(role)
        return sum(n for (r, _), n in self.classes.items() if r == role)

    def census(self) -> RoleCensus:
        c = [0, 0, 0, 0, 0]
        for (r, _), n in self.classes.items():
            c[r] += n
        return RoleCensus(*c)

    def committed(self) -> int:
        return sum(a * n for (r, a), n in self.classes.items() if r not in _SPARE_SET)

    def divisor(self) -> int:
        return self.alive * self.g_init if self.adaptive else self.B

    # ---- failures ------------------------------------------------------------------------
    def fail_roles(self, roles: Iterable["Role | str"]) -> EventOutcome:
        """One failure event killing one replica per named role (simultaneously)."""
        victims = []
        taken: dict[tuple[int, int], int] = {}
        for name in roles:
            role = int(parse_role(name))
            accs = [a for (r, a), n in self.classes.items()
                    if r == role and n - taken.get((r, a), 0) > 0]
            if not accs:
                raise PolicyError(f"no replica holds role {_ROLES[role].name.lower()}")
            key = (role, max(accs))
            taken[key] = taken.get(key, 0) + 1
            victims.append(key)
        return self.fail(victims)

    def fail(self, victims: Sequence[tuple["Role | int", int]]) -> EventOutcome:
        """One failure event: victims given as (role, accumulated) classes."""
        if not victims:
            raise PolicyError("a failure event needs at least one victim")
        dead: dict[tuple[int, int], int] = {}
        for role, acc in victims:
            key = (int(role), acc)
            dead[key] = dead.get(key, 0) + 1
        classes = self.classes
        for key, n in dead.items():
            if classes.get(key, 0) < n:
                raise PolicyError(f"no {n} alive replica(s) of role "
                                  f"{_ROLES[key[0]].name.lower()} with {key[1]} accumulated")
        if len(victims) >= self.alive:
            raise PolicyError("no replica survives: the invariant cannot be kept with W_cur = 0")
        for key, n in dead.items():
            left = classes[key] - n
            if left:
                classes[key] = left
            else:
                del classes[key]
        self.alive -= len(victims)
        victim_roles = tuple(_ROLES[k[0]] for k in victims)

        # One pass over the (few) classes: census, non-spare contribution, spare pools.
        c = [0, 0, 0, 0, 0]
        contrib = 0
        pools: dict[int, list[tuple[int, int]]] = {_MS: [], _MIS: []}
        for key, n in classes.items():
            role = key[0]
            c[role] += n
            if role in _SPARE_SET:
                pools[role].append(key)
            else:
                contrib += key[1] * n
        # The election (election.elect at count level).
        need = {_MS: 0, _MIS: 0}
        for (role, _), n in dead.items():
            spare = _SPARE_FOR.get(role)
            if spare is not None:
                need[spare] += n
        at_boundary = need[_MS] > c[_MS] or need[_MIS] > c[_MIS]
        if not at_boundary:
            for spare, n in need.items():
                if not n:
                    continue
                if len(pools[spare]) != 1:  # spares exist only before any boundary: one class
                    raise PolicyError(
                        f"internal: {len(pools[spare])} classes of {_ROLES[spare].name}")
                key = pools[spare][0]
                promoted = (_MAJ if spare == _MS else _MIN, key[1])
                left = classes[key] - n
                if left:
                    classes[key] = left
                else:
                    del classes[key]
                classes[promoted] = classes.get(promoted, 0) + n
                c[spare] -= n
                c[promoted[0]] += n
                contrib += key[1] * n
            census = RoleCensus(*c)
            out = EventOutcome(victim_roles, False, census, contrib, contrib)
            if not self.boundary and not self.adaptive:
                self.layout = Layout(self.layout.g, c[0], c[1], self.layout.r, c[2], c[3])
            self.events.append(out)
            return out

        census = RoleCensus(*c)
        c_contrib = contrib  # the contributors' share; at a boundary spares count too:
        contrib += sum(k[1] * classes[k] for k in pools[_MS] + pools[_MIS])
        if self.adaptive:  # algorithm 8 ignores the boundary: repair and continue
            out = EventOutcome(victim_roles, False, census, contrib, contrib)
            self.layout = Layout(self.g_init, self.alive)
            self.events.append(out)
            return out

        # Boundary: admit spares (most accumulated first) while C_cur <= B.
        spare_keys = sorted((k for k in self.classes if k[0] in _SPARE_SET), key=lambda k: -k[1])
        taken = admitted_spares(c_contrib, [(k[1], self.classes[k]) for k in spare_keys], self.B)
        hist: dict[int, int] = {}
        discarded = 0
        for (role, a), n in self.classes.items():
            if role not in _SPARE_SET:
                hist[a] = hist.get(a, 0) + n
        for key, t in zip(spare_keys, taken):
            n = self.classes[key]
            hist[key[1]] = hist.get(key[1], 0) + t
            if n - t:
                hist[0] = hist.get(0, 0) + n - t
                discarded += n - t
        c_cur = sum(a * n for a, n in hist.items())
        g_ext, n_bm = boundary_extension(c_cur, self.alive, self.B)
        # Boundary minors: the n_bm survivors with most accumulated (election.boundary_roles).
        classes: dict[tuple[int, int], int] = {}
        left = n_bm
        for a in sorted(hist, reverse=True):
            n = hist[a]
            bm = min(left, n)
            left -= bm
            if bm:
                k = (_BM, a + g_ext - 1)
                classes[k] = classes.get(k, 0) + bm
            if n - bm:
                k = (_MAJ, a + g_ext)
                classes[k] = classes.get(k, 0) + n - bm
        self.classes = classes
        self.steps += g_ext
        self.boundary = True
        self.g_ext_total += g_ext
        self.discarded += discarded
        out = EventOutcome(victim_roles, True, census, contrib, c_cur, g_ext, n_bm, discarded)
        self.events.append(out)
        return out

    # ---- commit --------------------------------------------------------------------------
    def commit(self) -> IterationOutcome:
        """after_commit: check the step, install the next layout (algorithm 7 after a boundary)."""
        committed, divisor = self.committed(), self.divisor()
        if committed != divisor:
            raise PolicyError(f"iteration {self.iteration} commits {committed}, divisor "
                              f"{divisor}: invariant broken")
        n_bm = self.count(_BM) if self.boundary else 0
        if self.adaptive:
            nxt = Layout(self.g_init, self.alive)
        elif self.boundary:
            nxt = advance_layout(self.alive, self.B, self.layout.g)
        else:
            nxt = self.layout
        out = IterationOutcome(self.iteration + 1, self.start_layout, nxt, tuple(self.events),
                               self.boundary, self.g_ext_total, n_bm, self.discarded,
                               committed, divisor, self.steps, self.alive, self.g_init)
        self.layout = nxt
        self.iteration += 1
        self._start_iteration()
        return out

    # ---- random victims ------------------------------------------------------------------
    def random_victims(self, rng: random.Random, k: int) -> list[tuple[int, int]]:
        """k distinct uniformly random alive replicas, as classes."""
        if k == 1:  # the common case, without copying the class table
            x = rng.randrange(self.alive)
            for key, n in self.classes.items():
                if x < n:
                    return [key]
                x -= n
        pool = dict(self.classes)
        total = sum(pool.values())
        out = []
        for _ in range(k):
            x = rng.randrange(total)
            for key, n in pool.items():
                if x < n:
                    break
                x -= n
            out.append(key)
            pool[key] -= 1
            total -= 1
        return out


def plan(w_init: int, g_init: int, iterations: Iterable[Sequence[Sequence["Role | str"]]], *,
         adaptive: bool = False) -> Iterator[IterationOutcome]:
    """Scripted trace: each iteration is a list of failure events, each a list of role names
    (one victim per name, all dying in the same collective call). Events of one iteration
    happen one after the other: the second at the synchronisation of the blocking re-reduce or
    of the extension pass the first one caused. An empty iteration is failure-free."""
    model = CountModel(w_init, g_init, adaptive=adaptive)
    for n, events in enumerate(iterations, 1):
        for ev in events:
            try:
                model.fail_roles(ev)
            except PolicyError as e:
                raise PolicyError(f"iteration {n}: {e}") from None
        yield model.commit()


def random_plan(w_init: int, g_init: int, failures: int, seed: int, *,
                adaptive: bool = False) -> Iterator[IterationOutcome]:
    """Random trace of exactly `failures` replica losses (uniformly random alive replicas).

    Each iteration has one failure event (probability 0.9) or two (the second during the
    re-reduce or extension pass); an event kills 1 (p=0.8), 2 (0.15) or 3 (0.05) replicas, capped
    by what is left of the budget. Deterministic in `seed`.
    """
    if failures >= w_init:
        raise PolicyError(f"{failures} failures need at least {failures + 1} replicas")
    rng = random.Random(seed)
    model = CountModel(w_init, g_init, adaptive=adaptive)
    left = failures
    while left > 0:
        n_events = 2 if rng.random() < 0.1 else 1
        for _ in range(n_events):
            if not left:
                break
            x = rng.random()
            k = min(left, 1 if x < 0.8 else 2 if x < 0.95 else 3)
            model.fail(model.random_victims(rng, k))
            left -= k
        yield model.commit()
