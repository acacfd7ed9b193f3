"""Count-level arithmetic (layout.py) and the id-level election/mapping (election.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover_hsdp.policy import (Layout, PolicyError, admitted_spares, advance_layout,
                                 boundary_extension, boundary_roles, contrib_total, elect,
                                 roles_for_layout)
from recover_hsdp.types import Role

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

M, m, MS, mS, BM = (Role.MAJOR, Role.MINOR, Role.MAJOR_SPARE, Role.MINOR_SPARE,
                    Role.BOUNDARY_MINOR)


def test_layout_properties_and_validation():
    lay = Layout(9, 28, 1, 4, 1, 1)
    assert lay.replicas == 31 and lay.committed == 256
    assert lay.as_dict() == {"g": 9, "major": 28, "minor": 1, "r": 4, "major_spare": 1,
                             "minor_spare": 1}
    assert Layout.initial(32, 8) == Layout(8, 32, 0, 0, 0, 0)
    for bad in (dict(g=0, n_major=1), dict(g=2, n_major=-1), dict(g=4, n_major=1, r=4)):
        with pytest.raises(PolicyError):
            Layout(**bad)


def test_advance_worked_example():
    assert advance_layout(31, 256, 8) == Layout(9, 28, 1, 4, 1, 1)


@pytest.mark.parametrize("w,b,expected", [
    (1, 256, Layout(256, 1)),                 # the single survivor carries G = B
    (30, 256, Layout(9, 28, 1, 4, 1, 0)),     # one spare left over: a major-spare
    (29, 256, Layout(9, 28, 1, 4, 0, 0)),     # none left over
    (32, 256, Layout(8, 32)),                 # exact: no minor, no spare
    (16, 256, Layout(16, 16)),
    (3, 10, Layout(4, 2, 1, 2, 0, 0)),
])
def test_advance_table(w, b, expected):
    assert advance_layout(w, b) == expected


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 5000))
def test_advance_properties(w, b):
    lay = advance_layout(w, b)
    assert lay.committed == b and lay.replicas == w
    assert w * lay.g >= b and w * (lay.g - 1) < b  # the smallest G that covers B
    assert (lay.n_minor == 1) == (lay.r > 0) and lay.n_minor <= 1
    rest = w - lay.n_major - lay.n_minor
    assert lay.n_minor_spare == (1 if lay.n_minor and rest >= 2 else 0)


def test_advance_no_survivor():
    with pytest.raises(PolicyError, match="no replica survives"):
        advance_layout(0, 10)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 500), st.data())
def test_boundary_extension_lands_on_b(b, w, data):
    c = data.draw(st.integers(0, b))
    g_ext, n_bm = boundary_extension(c, w, b)
    assert g_ext >= 1 and 0 <= n_bm <= w
    assert c + (w - n_bm) * g_ext + n_bm * (g_ext - 1) == b
    assert g_ext == 1 or c + w * (g_ext - 1) < b  # smallest


def test_boundary_extension_worked_example_and_overshoot():
    assert boundary_extension(248, 31, 256) == (1, 23)
    with pytest.raises(PolicyError, match="exceeds B"):
        boundary_extension(261, 29, 256)


def test_admitted_spares():
    assert admitted_spares(252, [(9, 1)], 256) == [0]          # the overshoot case
    assert admitted_spares(247, [(9, 1), (4, 1)], 256) == [1, 0]
    assert admitted_spares(240, [(9, 3), (4, 2)], 256) == [1, 1]
    assert admitted_spares(200, [(9, 3), (4, 2)], 256) == [3, 2]


# ---- election ----------------------------------------------------------------------------
def test_elect_promotes_lowest_id_spare_of_the_role():
    roles = {0: M, 1: M, 2: m, 3: MS, 4: MS, 5: mS}
    after, b = elect(roles, [1])
    assert not b and after == {0: M, 2: m, 3: M, 4: MS, 5: mS}
    after, b = elect(roles, [2])
    assert not b and after[5] == m
    after, b = elect(roles, [0, 1])
    assert not b and after[3] == M and after[4] == M


def test_elect_boundary_means_no_promotion_at_all():
    roles = {0: M, 1: M, 2: M, 3: MS}
    after, b = elect(roles, [0, 1])  # two majors, one spare
    assert b and after == {2: M, 3: MS}
    after, b = elect({0: M, 1: m, 2: MS}, [1])  # a minor with only a major-spare
    assert b and after == {0: M, 2: MS}
    after, b = elect({0: M, 1: BM, 2: MS}, [1])  # a dead boundary minor takes a major-spare
    assert not b and after == {0: M, 2: M}


def test_elect_dead_spares_need_nothing():
    after, b = elect({0: M, 1: MS, 2: mS}, [1, 2])
    assert not b and after == {0: M}
    after, b = elect({0: M, 1: M, 2: MS}, [0, 2])  # the spare died with the major
    assert b and after == {1: M}


def test_elect_unknown_replica():
    with pytest.raises(PolicyError, match="not alive"):
        elect({0: M}, [5])


def test_contrib_total():
    roles = {0: M, 1: m, 2: MS, 3: mS}
    acc = {0: 9, 1: 4, 2: 9, 3: 4}
    assert contrib_total(roles, acc, False) == 13
    assert contrib_total(roles, acc, True) == 26  # at a boundary every survivor counts


def test_roles_for_layout_rule():
    roles = roles_for_layout([7, 2, 5, 9, 11], Layout(9, 2, 1, 4, 1, 1))
    assert roles == {2: M, 5: M, 7: m, 9: MS, 11: mS}
    with pytest.raises(PolicyError):
        roles_for_layout([1, 2], Layout(9, 2, 1, 4, 1, 1))


def test_boundary_roles_rule():
    # equal accumulation: the last ids become boundary minors
    assert boundary_roles({0: 8, 1: 8, 2: 8, 3: 8}, 2) == {0: M, 1: M, 2: BM, 3: BM}
    # otherwise the most accumulated first, ties by highest id
    assert boundary_roles({0: 9, 1: 4, 2: 9, 3: 0}, 2) == {0: BM, 1: M, 2: BM, 3: M}
    with pytest.raises(PolicyError):
        boundary_roles({0: 1}, 2)
