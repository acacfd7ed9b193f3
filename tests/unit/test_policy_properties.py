"""Property tests: random worlds, random failure sequences down to one survivor.

Each example drives three things with the same failures:
  * the id-level policy (StaticWorldPolicy / AdaptiveWorldPolicy) with the event a correct backend
    would report (FailureEvent.from_failed_roles, i.e. the pure `elect`),
  * the count-level model (CountModel, the planner's engine), victims given by (role, accumulated),
  * the data assignment (DataAssignment),
and checks: every iteration commits exactly B (static) / W_cur * G (adaptive) microbatches; the
contributed ids are unique over the whole run and come from the contributor's own slice and from
what it computed this step; the two policy layers agree on every census, decision and layout.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from recover_hsdp.policy import (AdaptiveWorldPolicy, CountModel, DataAssignment, Layout,
                                 RestoreMode, StaticWorldPolicy)
from recover_hsdp.types import Role

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Mostly small worlds (where the interesting corner cases are dense), sometimes up to 1024.
W_INIT = st.one_of(st.integers(1, 40), st.integers(1, 1024))
G_INIT = st.one_of(st.integers(1, 8), st.integers(1, 64))


def draw_victims(data, policy, *, big: bool) -> list[int]:
    """Choose victims by role first (so rare roles get hit), then by index among holders."""
    alive = len(policy.alive)
    cap = max(1, alive // 3) if big else min(3, alive - 1)
    k = data.draw(st.integers(1, min(alive - 1, max(1, cap))), label="victims")
    by_role: dict[Role, list[int]] = {}
    for r, role in policy.roles().items():
        by_role.setdefault(role, []).append(r)
    victims: list[int] = []
    for _ in range(k):
        role = data.draw(st.sampled_from(sorted(r for r in by_role if by_role[r])), label="role")
        holders = by_role[role]
        victims.append(holders.pop(data.draw(st.integers(0, len(holders) - 1), label="who")))
    return victims


def classes_of(policy) -> Counter:
    acc = policy.accumulated()
    return Counter((int(policy.role(r)), acc[r]) for r in policy.alive)


def check_alg7(layout: Layout, b: int, w: int) -> None:
    assert layout.committed == b
    assert layout.replicas == w
    assert layout.n_minor in (0, 1) and (layout.n_minor == 1) == (layout.r > 0)
    assert layout.n_minor_spare <= layout.n_minor
    assert w * layout.g >= b and (layout.g == 1 or w * (layout.g - 1) < b)


def run_world(data, policy_cls, *, big: bool, max_iterations: int = 60, w_init=W_INIT,
              g_init=G_INIT):
    w = data.draw(w_init, label="W_init")
    g = data.draw(g_init, label="G_init")
    adaptive = policy_cls is AdaptiveWorldPolicy
    pol = policy_cls(w, g)
    model = CountModel(w, g, adaptive=adaptive)
    da = DataAssignment(w)
    used: set[int] = set()
    iterations = 0
    while len(pol.alive) > 1:
        iterations += 1
        n_events = data.draw(st.integers(0, 3), label="events")
        if iterations >= max_iterations:
            n_events = 1
        for _ in range(n_events):
            if len(pol.alive) == 1:
                break
            if iterations >= max_iterations:  # finish: everyone but one dies now
                victims = list(pol.alive[1:])
            else:
                victims = draw_victims(data, pol, big=big)
            acc, roles = pol.accumulated(), pol.roles()
            dec = pol.fail(victims)
            ev = model.fail([(roles[v], acc[v]) for v in victims])
            # the two layers agree on the decision and on the survivors' (role, accumulated)
            assert dec.at_boundary == ev.at_boundary
            assert (dec.g_ext, dec.n_boundary_minor) == (ev.g_ext, ev.n_boundary_minor)
            assert len(dec.discarded) == ev.discarded
            if dec.discarded:
                event("boundary discarded a spare")
            if dec.at_boundary and pol.steps() - dec.g_ext > pol.layout.g:
                event("boundary during an extension pass")
            if not dec.at_boundary and not adaptive:
                event("absorbed by spares (or only spares died)")
            assert classes_of(pol) == Counter(model.classes)
            assert pol.census() == model.census()
            assert pol.steps() == model.steps
            if adaptive:
                assert dec.restore_mode is RestoreMode.BLOCKING and not dec.at_boundary
                assert pol.committed() == pol.divisor() == len(pol.alive) * g
            else:
                assert dec.restore_mode is (RestoreMode.NON_BLOCKING if dec.at_boundary
                                            else RestoreMode.BLOCKING)
                assert pol.committed() == pol.B  # the step still lands on B after every event
                if dec.at_boundary:
                    assert not any(pol.role(r).is_spare for r in pol.alive)
        # ---- commit -----------------------------------------------------------------------
        steps = pol.steps()
        before = {r: da.cursor(r) for r in pol.alive}
        for r in pol.alive:
            kept = [p for rg in pol.kept_positions(r) for p in rg]
            assert len(kept) == pol.accumulate_quota(r) and all(0 <= p < steps for p in kept)
        ids = da.commit(pol)
        total = 0
        for r, rids in ids.items():
            total += len(rids)
            assert len(rids) == (pol.accumulate_quota(r) if pol.contributes(r) else 0)
            for i in rids:
                assert i % w == r, "id from another replica's slice"
                assert before[r] <= i // w < before[r] + steps, "id not computed this step"
                assert i not in used, "microbatch id used twice"
                used.add(i)
        assert total == pol.divisor() == (len(pol.alive) * g if adaptive else w * g)
        pol.after_commit()
        out = model.commit()
        assert out.committed == total and out.steps == steps
        assert pol.layout == out.next_layout
        assert Counter(model.classes) == classes_of(pol)
        if not adaptive and out.boundary:
            check_alg7(pol.layout, w * g, len(pol.alive))
    if not adaptive:
        assert pol.layout == Layout(w * g, 1)  # the last survivor carries G = B
        assert pol.role(pol.alive[0]) == Role.MAJOR and pol.steps() == w * g


@SETTINGS
@given(st.data())
def test_static_many_victims_per_event(data):
    run_world(data, StaticWorldPolicy, big=True)


@settings(SETTINGS, max_examples=60)
@given(st.data())
def test_static_few_victims_per_event(data):
    """One to three victims per event: long runs through spares, promotions and boundaries."""
    run_world(data, StaticWorldPolicy, big=False, max_iterations=120,
              w_init=st.integers(1, 48))


@settings(SETTINGS, max_examples=20)
@given(st.data())
def test_adaptive_shrinks_and_agrees(data):
    run_world(data, AdaptiveWorldPolicy, big=True)
