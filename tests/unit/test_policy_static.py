"""StaticWorldPolicy: the paper's worked example exactly, and the cases its spec names."""
from __future__ import annotations

import pytest

from recover_hsdp.policy import (DataAssignment, EventMismatchError, FailureEvent, Layout,
                                 PolicyError, RestoreMode, StaticWorldPolicy)
from recover_hsdp.types import FailureRecord, Role, RoleCensus

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def ids_with(pol, role):
    return [r for r in pol.alive if pol.role(r) == role]


def committed_ids(pol, data):
    ids = data.commit(pol)
    pol.after_commit()
    return ids


# ---- the worked example (section 4.3, appendix E, figure 5) --------------------------------
def test_worked_example_w32_g8():
    pol, data = StaticWorldPolicy(32, 8), DataAssignment(32)
    assert pol.B == 256 and pol.layout == Layout(8, 32) and pol.steps() == 8
    # (i) failure-free iteration: 32 majors x 8
    ids = committed_ids(pol, data)
    assert sum(map(len, ids.values())) == 256

    # (ii) r32 (replica 31) dies during synchronisation: boundary step
    ev = pol.expected_event([31], epoch=1)
    assert ev.contrib == 31 * 8 == 248 and ev.at_boundary and ev.census == RoleCensus(major=31)
    dec = pol.on_failure(ev)
    assert dec == dc(RestoreMode.NON_BLOCKING, True, 1, 23)
    assert pol.steps() == 9  # P(major) grows from 8 to 9
    majors, bms = ids_with(pol, Role.MAJOR), ids_with(pol, Role.BOUNDARY_MINOR)
    assert len(majors) == 8 and len(bms) == 23
    assert bms == list(range(8, 31))  # the last 23 alive ids (everyone accumulated 8)
    assert all(pol.accumulate_quota(r) == 9 for r in majors)
    assert all(pol.accumulate_quota(r) == 8 for r in bms)
    assert pol.keeps(0, 8) and not pol.keeps(30, 8)
    assert pol.committed() == 248 + 8 + 0 == 256
    ids = committed_ids(pol, data)
    assert sum(map(len, ids.values())) == 256 and 31 not in ids

    # (iii) algorithm 7: 28 majors at G=9, one minor at R=4, one major-spare, one minor-spare
    assert pol.layout == Layout(g=9, n_major=28, n_minor=1, r=4, n_major_spare=1,
                                n_minor_spare=1)
    assert pol.layout.committed == 28 * 9 + 4 == 256
    assert ids_with(pol, Role.MINOR) == [28]          # r29
    assert ids_with(pol, Role.MAJOR_SPARE) == [29]    # r30
    assert ids_with(pol, Role.MINOR_SPARE) == [30]    # r31
    assert pol.steps() == 9 and pol.accumulate_quota(28) == 4 and pol.accumulate_quota(30) == 4
    assert not pol.contributes(29) and not pol.contributes(30)
    ids = committed_ids(pol, data)
    assert sum(map(len, ids.values())) == 256 and ids[29] == () and ids[30] == ()

    # (iv) the minor r29 dies: the minor-spare r31 takes its place, no boundary step
    ev = pol.expected_event([28], epoch=2)
    assert not ev.at_boundary and ev.roles[30] == Role.MINOR and ev.contrib == 256
    dec = pol.on_failure(ev)
    assert dec == dc(RestoreMode.BLOCKING, False)
    assert pol.steps() == 9 and pol.role(30) == Role.MINOR and pol.committed() == 256
    committed_ids(pol, data)
    assert pol.layout == Layout(9, 28, 1, 4, 1, 0)
    assert pol.role(30) == Role.MINOR  # promotions are kept, not re-mapped


def dc(mode, at_boundary, g_ext=0, n_bm=0, discarded=()):
    from recover_hsdp.policy import PolicyDecision

    return PolicyDecision(mode, at_boundary, g_ext, n_bm, tuple(discarded))


def after_example():
    """The policy after the boundary of the worked example: 28/1(r=4)/1/1 at g=9."""
    pol = StaticWorldPolicy(32, 8)
    pol.fail([31])
    pol.after_commit()
    return pol


# ---- several failures, any order of roles -------------------------------------------------
@pytest.mark.parametrize("order", [
    ["major", "minor"], ["minor", "major"], ["major", "major"], ["minor", "minor"],
    ["major_spare", "major"], ["minor_spare", "minor"], ["major", "minor_spare", "minor"],
])
def test_sequential_failures_in_one_iteration(order):
    pol = after_example()
    for name in order:
        pol.fail_roles([name])
        assert pol.committed() == 256
    pol.after_commit()
    assert pol.layout.committed == 256


def test_simultaneous_major_and_major_spare_is_a_boundary():
    pol = after_example()
    dec = pol.fail_roles(["major", "major_spare"])
    # C = 256 - 9 (the dead major) + 4 (the admitted minor-spare) = 251, W = 29
    assert dec == dc(RestoreMode.NON_BLOCKING, True, 1, 29 - 5)
    assert pol.committed() == 256
    pol.after_commit()
    assert pol.layout == Layout(9, 28, 1, 4, 0, 0)


def test_two_majors_one_spare_no_partial_promotion():
    pol = after_example()
    ev = pol.expected_event([0, 1])
    assert ev.at_boundary and ev.roles[29] == Role.MAJOR_SPARE  # no promotion at a boundary
    dec = pol.on_failure(ev)
    assert dec.at_boundary and dec.discarded == ()
    assert not any(pol.role(r).is_spare for r in pol.alive)
    assert pol.committed() == 256


def test_spare_dying_needs_no_promotion():
    pol = after_example()
    dec = pol.fail_roles(["major_spare"])
    assert dec == dc(RestoreMode.BLOCKING, False)
    assert pol.layout == Layout(9, 28, 1, 4, 0, 1) and pol.steps() == 9
    dec = pol.fail_roles(["minor_spare"])
    assert dec == dc(RestoreMode.BLOCKING, False)
    pol.after_commit()
    assert pol.layout == Layout(9, 28, 1, 4, 0, 0)


def test_failure_during_extension_pass_composes():
    pol = StaticWorldPolicy(32, 8)
    d1 = pol.fail([31])
    assert pol.steps() == 9
    # a boundary minor dies at the extension's synchronisation: another boundary
    d2 = pol.fail_roles(["boundary_minor"])
    assert d2.at_boundary and d2.restore_mode is RestoreMode.NON_BLOCKING
    assert pol.steps() == 8 + d1.g_ext + d2.g_ext
    assert pol.committed() == 256
    # then a major dies during the second extension pass
    d3 = pol.fail_roles(["major"])
    assert d3.at_boundary and pol.committed() == 256
    kept = [list(rg) for rg in pol.kept_positions(pol.alive[0])]
    assert kept[0] == list(range(8))  # the first pass, then one range per extension
    pol.after_commit()
    assert pol.layout.committed == 256 and pol.layout.replicas == 29


def test_minor_dies_while_major_spare_survives_discards_the_spare():
    """The open case's refinement: admitting the major-spare would overshoot B."""
    pol = after_example()
    pol.fail_roles(["minor"])          # minor-spare promoted
    pol.after_commit()
    assert pol.layout == Layout(9, 28, 1, 4, 1, 0)
    ev = pol.expected_event([30])      # the (new) minor dies, no minor-spare, major-spare alive
    assert ev.at_boundary and ev.contrib == 28 * 9 + 9 == 261  # backend counts the spare
    dec = pol.on_failure(ev)
    assert dec.discarded == (29,)      # 261 > 256: the major-spare's 9 cannot be admitted
    assert dec.g_ext == 1 and dec.n_boundary_minor == 29 - 4
    # the ex-spare keeps only the extension position; the 25 boundary minors are the majors
    # with the highest ids (everyone else accumulated 9, the discarded spare 0)
    assert pol.kept_positions(29) == (range(9, 10),) and pol.role(29) == Role.MAJOR
    assert ids_with(pol, Role.BOUNDARY_MINOR) == list(range(3, 28))
    assert pol.discarded() == {29}
    assert pol.committed() == 256
    data = DataAssignment(32)
    ids = data.contributed(pol)
    assert sum(map(len, ids.values())) == 256
    assert all(i // 32 >= 9 for i in ids[29])  # only extension-pass ids from the ex-spare


def test_admission_is_greedy_spares_fill_dead_majors_surplus_dropped():
    """Minor + minor-spare + 2 majors die, 14 major-spares alive: 2 spares are admitted (they
    make up the dead majors' 6 microbatches), the other 12 would overshoot B and are dropped."""
    pol = StaticWorldPolicy(50, 2)    # B = 100
    pol.fail([49])
    pol.after_commit()
    assert pol.layout == Layout(3, 33, 1, 1, 14, 1)
    spares = ids_with(pol, Role.MAJOR_SPARE)
    ev = pol.expected_event([0, 1, 33, 48])  # two majors, the minor, the minor-spare
    assert ev.at_boundary and ev.contrib == 100 - 6 - 1 + 14 * 3
    dec = pol.on_failure(ev)
    assert dec.discarded == tuple(spares[2:])  # lowest ids admitted first
    assert (dec.g_ext, dec.n_boundary_minor) == (1, 45 - 1)  # C_cur = 93 + 6 = 99, W = 45
    assert pol.committed() == 100
    pol.after_commit()
    assert pol.layout == Layout(3, 33, 1, 1, 10, 1)


def test_down_to_single_survivor_carries_b():
    pol = StaticWorldPolicy(5, 3)
    data = DataAssignment(5)
    while len(pol.alive) > 1:
        pol.fail([pol.alive[-1]])
        assert pol.committed() == 15
        ids = data.commit(pol)
        assert sum(map(len, ids.values())) == 15
        pol.after_commit()
    assert pol.layout == Layout(15, 1) and pol.steps() == 15
    assert pol.accumulate_quota(pol.alive[0]) == 15
    with pytest.raises(PolicyError, match="no replica survives"):
        pol.fail([pol.alive[0]])


def test_w1_from_the_start():
    pol = StaticWorldPolicy(1, 4)
    assert pol.layout == Layout(4, 1) and pol.committed() == 4
    pol.after_commit()
    assert pol.steps() == 4


# ---- case (b): failure after every bucket reduced under the old membership ----------------
def test_case_b_commits_with_skip_and_applies_next_iteration():
    pol, data = StaticWorldPolicy(32, 8), DataAssignment(32)
    dec = pol.note_failure_after_commit(pol.expected_event([5]))
    assert dec == dc(RestoreMode.SKIP, True)
    assert 5 in pol.alive and pol.committed() == 256  # the step that commits still has r5
    ids = data.commit(pol)
    assert len(ids[5]) == 8
    pol.after_commit()
    assert 5 not in pol.alive
    assert pol.layout == Layout(9, 28, 1, 4, 1, 1)  # algorithm 7 for the 31 survivors
    assert pol.steps() == 9


def test_case_b_non_boundary_keeps_promotion():
    pol = after_example()
    dec = pol.on_failure(pol.expected_event([0]), committed_already=True)
    assert dec == dc(RestoreMode.SKIP, False)
    assert pol.role(29) == Role.MAJOR_SPARE  # unchanged until the iteration is closed
    pol.after_commit()
    assert pol.role(29) == Role.MAJOR and pol.layout == Layout(9, 28, 1, 4, 0, 1)
    with pytest.raises(PolicyError):
        pol.note_failure_after_commit(pol.expected_event([0]))  # 0 is gone


def test_on_failure_after_case_b_is_refused():
    pol = after_example()
    pol.note_failure_after_commit(pol.expected_event([0]))
    with pytest.raises(PolicyError, match="already committed"):
        pol.on_failure(pol.expected_event([1]))


# ---- events that disagree with the policy's election -------------------------------------
def test_event_roles_mismatch_raises():
    pol = after_example()
    ev = pol.expected_event([0])
    roles = dict(ev.roles)
    roles[29], roles[30] = Role.MAJOR_SPARE, Role.MAJOR  # wrong spare promoted
    bad = FailureEvent(ev.failed_replicas, roles, RoleCensus.of(roles.values()), ev.contrib,
                       ev.at_boundary, ev.epoch, ev.microbatch)
    with pytest.raises(EventMismatchError, match="roles disagree"):
        pol.on_failure(bad)


@pytest.mark.parametrize("field,value,match", [
    ("at_boundary", True, "at_boundary"),
    ("contrib", 255, "contrib"),
    ("census", RoleCensus(major=29), "census"),
    ("microbatch", 8, "microbatch"),
    ("failed_replicas", (99,), "not alive"),
    ("failed_replicas", (), "no failed replica"),
])
def test_event_field_mismatch_raises(field, value, match):
    pol = after_example()
    ev = pol.expected_event([0])
    kw = {f: getattr(ev, f) for f in ("failed_replicas", "roles", "census", "contrib",
                                      "at_boundary", "epoch", "microbatch")}
    kw[field] = value
    with pytest.raises(PolicyError, match=match):
        pol.on_failure(FailureEvent(**kw))
    # the policy state is untouched by a refused event
    assert 0 in pol.alive and pol.layout == Layout(9, 28, 1, 4, 1, 1)


def test_event_from_backend_record():
    pol = after_example()
    survivors = [r for r in pol.alive if r != 3]
    exp = pol.expected_event([3], epoch=4)
    rec = FailureRecord(ok=False, failed_ranks=(7,), epoch=4, census=exp.census,
                        contrib=exp.contrib, at_boundary=exp.at_boundary,
                        roles=tuple(exp.roles[r] for r in survivors))
    ev = FailureEvent.from_record(rec, [3], survivors, microbatch=pol.steps())
    assert ev == exp
    assert pol.on_failure(ev).restore_mode is RestoreMode.BLOCKING


def test_roles_in_group_order_and_divisor():
    pol = after_example()
    assert pol.divisor() == 256
    order = pol.roles_in_group_order()
    assert order[:28] == (Role.MAJOR,) * 28
    assert order[28:] == (Role.MINOR, Role.MAJOR_SPARE, Role.MINOR_SPARE)


def test_bad_constructor_arguments():
    with pytest.raises(PolicyError, match="w_init"):
        StaticWorldPolicy(0, 8)
    with pytest.raises(PolicyError, match="g_init"):
        StaticWorldPolicy(8, 0)
