"""StepTxnOrchestrator against the fake ULFM world (tests/unit/_fake_ulfm.py), real policy.

Every simulated replica runs the loop the HSDP path runs: microbatches up to policy.steps()
(keeping position m iff policy.keeps), enqueue every bucket, fire, consensus, EXTEND -> more
microbatches, COMMIT -> divide by policy.divisor(). Microbatch id i has a fixed pseudo-random
gradient, so the committed gradient must equal (sum over exactly the ids DataAssignment.commit
reports) / divisor to fp32 rounding, bitwise identical on every survivor. The same scenarios with
restore_enabled=False must commit a WRONG gradient, whenever some bucket was reduced before the
failure showed up (the check can fail).

Call indices in Kill(...) are per iteration, as the victim counts them (quiesced allreduces do not
communicate and are not counted). With the default 4 buckets a clean first pass is allreduce
#0-#3 then consensus #0.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch

from _fake_ulfm import FakeProtocolError, FakeWorld, Kill, PlainFakeGroup, run_threads
from recover_hsdp.policy import (AdaptiveWorldPolicy, DataAssignment, RestoreMode,
                                 StaticWorldPolicy)
from recover_hsdp.recovery import RecoveryProtocolError, StepTxnOrchestrator, Verdict
from recover_hsdp.types import Role

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

BUCKETS = (6, 3, 5, 4)
NUMEL = sum(BUCKETS)


@functools.lru_cache(maxsize=None)
def grad_of(mb_id: int) -> torch.Tensor:
    """The fake gradient of microbatch `mb_id` (every bucket concatenated)."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7919 + mb_id))


@dataclass
class Commit:
    grad: torch.Tensor
    ids: dict
    divisor: int
    modes: list
    failures: list
    case_b: bool
    alive: tuple
    steps: int
    bucket_epochs: list = field(default_factory=list)


@dataclass
class Sim:
    world: FakeWorld
    commits: dict = field(default_factory=dict)   # (replica, iteration) -> Commit
    orchs: dict = field(default_factory=dict)     # replica -> orchestrator (survivors and dead)
    survivors: dict = field(default_factory=dict)

    def at(self, it: int) -> list[Commit]:
        return [c for (r, i), c in sorted(self.commits.items()) if i == it]


def simulate(w: int, g: int, *, kills=(), iterations: int = 2, policy: str = "static",
             prefail=(), restore_enabled: bool = True, rewind: str = "copy",
             hsdp_style: bool = False, plain: bool = False, expect_all_fired: bool = True,
             timeout: float = 20.0) -> Sim:
    world = FakeWorld(w, kills, dead=prefail, hsdp_style=hsdp_style, timeout=timeout)
    sim = Sim(world)
    # buckets are preallocated once per replica, before the threads start (grad_of is cached)
    for i in range(4 * w * g * (iterations + 2)):
        grad_of(i)

    def body(r: int):
        grp = world.group(r)
        handle = PlainFakeGroup(grp) if plain else grp
        pol = (StaticWorldPolicy if policy == "static" else AdaptiveWorldPolicy)(w, g)
        data = DataAssignment(w)
        if prefail:  # an earlier, already committed iteration lost these replicas
            pol.fail(list(prefail))
            data.commit(pol)
            pol.after_commit()
        orch = StepTxnOrchestrator(handle, pol, lambda x: x, restore_enabled=restore_enabled,
                                   rewind=rewind)
        sim.orchs[r] = orch
        tensors = [torch.zeros(n) for n in BUCKETS]
        for it in range(iterations):
            grp.set_iteration(it)
            orch.begin_iteration()
            for t in tensors:
                t.zero_()
            m = 0
            while True:
                while m < pol.steps():
                    orch.wait_restore_before_backward()
                    world.checkpoint(r, "compute", m)
                    if pol.keeps(r, m):
                        parts = grad_of(data.microbatch_id(r, m)).split(BUCKETS)
                        for t, part in zip(tensors, parts):
                            t.add_(part)
                    orch.note_microbatch(m + 1)
                    m += 1
                for t in tensors:
                    orch.enqueue_bucket(t)
                orch.fire_deferred_allreduces()
                if orch.consensus() is Verdict.COMMIT:
                    break
            divisor = pol.divisor()
            for t in tensors:
                t.div_(divisor)
            log = orch.iteration_log
            alive, steps = tuple(pol.alive), pol.steps()
            ids = data.commit(pol)  # before after_commit: the step being committed
            sim.commits[(r, it)] = Commit(torch.cat(tensors).clone(), ids, divisor,
                                          list(log.modes), list(log.failures), log.case_b,
                                          alive, steps, orch.bucket_epochs())
            orch.after_successful_commit()
        return orch

    sim.survivors = run_threads(world, body)
    if expect_all_fired:
        assert not world.kills, f"kills never reached: {world.kills}"
    else:
        assert_unfired_unreachable(world)
    return sim


def unreachable(world: FakeWorld, kills) -> list:
    """The kills of `kills` whose victim never reached the planned position: in that iteration
    it made fewer calls of that kind (computed fewer microbatches) than the kill's index + 1."""
    return [k for k in kills
            if world.reached.get((k.replica, k.iteration, k.at), 0) <= k.index]


def assert_unfired_unreachable(world: FakeWorld) -> None:
    """Every planned kill either fired, or provably could not: its victim lived through the
    whole run (no other kill took it) and never reached the planned call/position. A kill that
    was reached but did not fire fails here."""
    planned = world.fired + world.kills
    assert sorted(map(repr, world.kills)) == sorted(map(repr, unreachable(world, planned))), (
        f"unfired {world.kills}, unreachable {unreachable(world, planned)}, "
        f"reached {world.reached}")
    for k in world.kills:
        assert k.replica in world.alive, (k, "victim died, yet its kill did not fire")


def expected_grad(ids: dict, divisor: int) -> torch.Tensor:
    all_ids = [i for v in ids.values() for i in v]
    acc = torch.zeros(NUMEL, dtype=torch.float64)
    for i in all_ids:
        acc += grad_of(i).double()
    return acc / divisor


def check(sim: Sim, it: int, *, correct: bool = True, B: int | None = None) -> Commit:
    """Every survivor committed the same step; it sums exactly the policy's ids / divisor."""
    cs = sim.at(it)
    assert cs, f"nobody committed iteration {it}"
    ref = cs[0]
    all_ids = [i for v in ref.ids.values() for i in v]
    assert len(all_ids) == len(set(all_ids)), "a microbatch id committed twice"
    assert len(all_ids) == ref.divisor, (len(all_ids), ref.divisor)
    if B is not None:
        assert ref.divisor == B
    for c in cs[1:]:
        assert c.ids == ref.ids
        assert c.divisor == ref.divisor
    exp = expected_grad(ref.ids, ref.divisor)
    oks = [torch.allclose(c.grad.double(), exp, rtol=1e-5, atol=1e-6) for c in cs]
    if correct:
        for c in cs[1:]:
            assert torch.equal(c.grad, ref.grad), "survivors committed different gradients"
        err = (ref.grad.double() - exp).abs().max().item()
        assert all(oks), f"committed gradient off by {err:.3g} (iteration {it})"
    else:
        assert not all(oks), "restore disabled, yet the committed gradient is right"
    return ref


# ---- failure-free ---------------------------------------------------------------------------

def test_failure_free_commits_exact_sums_and_allocates_snapshots_once():
    sim = simulate(3, 2, iterations=3)
    for it in range(3):
        c = check(sim, it, B=6)
        assert c.modes == ["skip"] and not c.failures
    for orch in sim.orchs.values():
        assert orch.store.allocations == len(BUCKETS)  # no per-step allocation
        assert orch.snapshot_nbytes() == NUMEL * 4 == orch.store.grad_nbytes()
        assert orch.store.snapshots_taken == 3 * len(BUCKETS)
        assert orch.rewinder.stats.rewinds == 0
        assert orch.stats.reduces == 3 * len(BUCKETS)


# ---- a failure at bucket k: boundary, NON_BLOCKING ------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 3])
def test_boundary_failure_at_bucket_k_extends_and_commits_B(k):
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", k)])
    c = check(sim, 0, B=8)
    assert c.modes == ["non_blocking", "skip"]
    assert c.failures[0]["replicas"] == [3] and c.failures[0]["at_boundary"]
    assert c.steps == 3 and 3 not in c.ids
    check(sim, 1, B=8)  # algorithm 7's layout for 3 survivors: g=3, 2 majors, 1 minor r=2
    assert sim.at(1)[0].steps == 3


@pytest.mark.parametrize("k", [1, 3])
def test_boundary_failure_without_rewind_commits_wrong_gradient(k):
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", k)], restore_enabled=False)
    check(sim, 0, correct=False)


def test_failure_before_any_reduction_needs_no_rewind():
    """Case (a): the victim dies before bucket 0's reduction, nothing was reduced under the old
    membership, so even without rewinds the gradient is right (the bookkeeping, not luck)."""
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 0)], restore_enabled=False)
    check(sim, 0, B=8)
    assert all(o.rewinder.stats.rewinds == 0 for o in sim.survivors.values())


def test_failure_during_compute_surfaces_at_first_reduction():
    sim = simulate(4, 2, kills=[Kill(2, 0, "compute", 1)])
    c = check(sim, 0, B=8)
    assert c.failures[0]["where"] == "bucket 0"


def test_mid_reduce_failure_marks_bucket_undefined_and_surfaces_at_next_detect():
    """Victim dies inside bucket 1's data phase: replica 1 gets reduce_failed (undefined), the
    others a full old-membership sum; bucket 2's Detect reports the loss to all alike."""
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 1, phase="data", reduce_failed_on=(1,))])
    c = check(sim, 0, B=8)
    assert c.failures[0]["where"] == "bucket 2"
    assert c.modes == ["non_blocking", "skip"]
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 1, phase="data", reduce_failed_on=(1,))],
                   restore_enabled=False)
    check(sim, 0, correct=False)


# ---- spares: BLOCKING --------------------------------------------------------------------------

def _spare_layout_check():
    pol = StaticWorldPolicy(4, 1)
    pol.fail([3])
    pol.after_commit()
    assert pol.roles() == {0: Role.MAJOR, 1: Role.MAJOR, 2: Role.MAJOR_SPARE}


@pytest.mark.parametrize("k", [1, 3])
def test_spare_promoted_blocking_rewind_admits_its_gradient(k):
    _spare_layout_check()
    # alive 0, 1 (majors, g=2) and 2 (major-spare); B = 4
    sim = simulate(4, 1, prefail=(3,), kills=[Kill(0, 0, "allreduce", k)])
    c = check(sim, 0, B=4)
    assert c.modes == ["blocking", "skip"]
    assert c.ids[2] and not c.ids.get(0)  # the promoted spare's ids are committed
    check(sim, 1, B=4)
    sim = simulate(4, 1, prefail=(3,), kills=[Kill(0, 0, "allreduce", k)], restore_enabled=False)
    check(sim, 0, correct=False)


def test_minor_spare_promotion():
    pol = StaticWorldPolicy(7, 1)
    pol.fail([6])
    pol.after_commit()
    assert pol.role(3) == Role.MINOR and pol.role(5) == Role.MINOR_SPARE
    sim = simulate(7, 1, prefail=(6,), kills=[Kill(3, 0, "allreduce", 2)])
    c = check(sim, 0, B=7)
    assert c.modes == ["blocking", "skip"] and len(c.ids[5]) == 1


def test_spare_death_alone_changes_no_contribution_but_rereduces():
    sim = simulate(4, 1, prefail=(3,), kills=[Kill(2, 0, "allreduce", 2)])
    c = check(sim, 0, B=4)
    assert c.modes == ["blocking", "skip"] and not c.failures[0]["at_boundary"]


# ---- failures during restoration -------------------------------------------------------------

def test_failure_during_blocking_rereduce_absorbed_by_second_spare_retries():
    # alive 0..4: majors 0, 1, 2 (g=2), major-spares 3, 4; B = 6
    # pass 1: #0 #1 ok, #2 record (0 dies, 3 promoted), #3 bucket 3 under the new epoch;
    # blocking re-reduce of buckets 0, 1, 2 = #4 #5 #6: 1 dies at #5 (4 promoted) -> retry
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(0, 0, "allreduce", 2),
                                              Kill(1, 0, "allreduce", 5)])
    c = check(sim, 0, B=6)
    assert [f["replicas"] for f in c.failures] == [[0], [1]]
    assert c.modes[:2] == ["blocking", "blocking"] and c.modes[-1] == "skip"
    assert "non_blocking" not in c.modes
    assert sorted(c.ids) == [2, 3, 4] and all(len(v) == 2 for v in c.ids.values())
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(0, 0, "allreduce", 2),
                                              Kill(1, 0, "allreduce", 5)], restore_enabled=False)
    check(sim, 0, correct=False)


def test_failure_during_blocking_rereduce_without_spare_falls_through_to_boundary():
    # alive 0, 1 (majors), 2 (spare): 0 dies at #1 (2 promoted), 1 dies in the re-reduce (#4)
    sim = simulate(4, 1, prefail=(3,), kills=[Kill(0, 0, "allreduce", 1),
                                              Kill(1, 0, "allreduce", 4)])
    c = check(sim, 0, B=4)
    assert c.modes == ["blocking", "non_blocking", "skip"]
    assert list(c.ids) == [2] and len(c.ids[2]) == 4  # the last survivor carries all of B
    check(sim, 1, B=4)


def test_mid_reduce_failure_during_rereduce():
    sim = simulate(6, 1, prefail=(5,), kills=[
        Kill(0, 0, "allreduce", 2),
        Kill(1, 0, "allreduce", 4, phase="data", reduce_failed_on=(2, 4))])
    check(sim, 0, B=6)


@pytest.mark.parametrize("where", ["compute", "allreduce"])
def test_failure_during_extension_pass_extends_again(where):
    # iteration 0: 3 dies at bucket 1 (boundary: G_ext=1, steps 2 -> 3); then replica 2 dies in
    # the extension: before computing position 2, or at the extension pass's bucket 1 (#3)
    second = Kill(2, 0, "compute", 2) if where == "compute" else Kill(2, 0, "allreduce", 3)
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 1), second])
    c = check(sim, 0, B=8)
    assert [f["replicas"] for f in c.failures] == [[3], [2]]
    assert c.modes == ["non_blocking", "non_blocking", "skip"]
    assert sorted(c.ids) == [0, 1]
    check(sim, 1, B=8)
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 1), second], restore_enabled=False)
    check(sim, 0, correct=False)


def test_two_failures_in_one_pass():
    # 0 dies at #1 (spare 3 promoted), 1 dies at #3 (spare 4 promoted), both absorbed
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(0, 0, "allreduce", 1),
                                              Kill(1, 0, "allreduce", 2)])
    c = check(sim, 0, B=6)
    assert [f["replicas"] for f in c.failures] == [[0], [1]]


def test_two_victims_one_call_and_a_death_during_repair():
    # 4 dies before #1, 3 dies inside the repair of that same call: one record, epoch + 2
    sim = simulate(5, 2, kills=[Kill(4, 0, "allreduce", 1), Kill(3, 0, "allreduce", 1,
                                                                   phase="record")])
    c = check(sim, 0, B=10)
    assert c.failures[0]["replicas"] == [3, 4] and c.failures[0]["epoch"] == 2
    check(sim, 1, B=10)


def test_failures_in_consecutive_iterations():
    sim = simulate(5, 2, iterations=4, kills=[Kill(4, 0, "allreduce", 2),
                                              Kill(0, 1, "allreduce", 1),
                                              Kill(2, 3, "consensus", 0)])
    for it in range(4):
        check(sim, it, B=10)
    for orch in sim.survivors.values():
        assert orch.store.allocations == len(BUCKETS)
        assert orch.snapshot_nbytes() == NUMEL * 4


# ---- the discarded spare (policy's open case) -------------------------------------------------

def test_discarded_spare_is_zeroed_not_restored():
    # alive 0..6: majors 0-4 (g=3), minor 5 (r=1), major-spare 6; the minor dies with no
    # minor-spare; admitting spare 6's 3 microbatches would overshoot B=16 -> discarded
    sim = simulate(8, 2, prefail=(7,), kills=[Kill(5, 0, "allreduce", 2)])
    c = check(sim, 0, B=16)
    assert c.modes == ["non_blocking", "skip"]
    pol = StaticWorldPolicy(8, 2)
    pol.fail([7])
    pol.after_commit()
    assert pol.fail([5]).discarded == (6,)
    sim = simulate(8, 2, prefail=(7,), kills=[Kill(5, 0, "allreduce", 2)], restore_enabled=False)
    check(sim, 0, correct=False)


# ---- case (b): failure seen only at the consensus ---------------------------------------------

def test_case_b_commits_old_membership_sum_and_policy_applies_it_next_iteration():
    sim = simulate(4, 2, kills=[Kill(3, 0, "consensus", 0)])
    c = check(sim, 0, B=8)
    assert c.case_b and c.modes == ["skip"]
    assert 3 in c.ids and len(c.ids[3]) == 2  # the dead replica's reduced share is committed
    assert c.failures[0]["case_b"] and c.failures[0]["mode"] == "skip"
    c1 = check(sim, 1, B=8)
    assert 3 not in c1.alive and c1.steps == 3  # algorithm 7 ran after the commit
    # nothing was rewound: the reduced buckets were kept
    assert all(o.rewinder.stats.rewinds == 0 for o in sim.survivors.values())
    # the restore switch plays no role in case (b)
    check(simulate(4, 2, kills=[Kill(3, 0, "consensus", 0)], restore_enabled=False), 0)


def test_case_b_with_spares_broadcasts_and_promotes_after_commit():
    # alive 0..4: majors 0-2, major-spares 3, 4. 0 dies at the consensus: 3 is promoted by the
    # election, 4 stays a spare whose vote the backend zeroes -> the window cannot see that every
    # survivor is clean and repairs the last bucket by a broadcast from the lowest clean rank
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(0, 0, "consensus", 0)])
    c = check(sim, 0, B=6)
    assert c.case_b and 0 in c.ids and not c.ids[3] and not c.ids[4]
    c1 = check(sim, 1, B=6)
    assert c1.ids[3] and not c1.ids[4]  # 3 promoted after the commit, 4 still a spare
    assert sim.world.calls.count((1, "broadcast", 4)) == 1


@pytest.mark.parametrize("failing", [(0,), (1, 2)])
def test_case_b_after_mid_reduce_failure_of_the_last_bucket(failing):
    """The victim dies inside the LAST bucket's reduction: some survivors hold the old sum, the
    others garbage. A purely local case-(b) test would diverge; the window repairs it."""
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 3, phase="data",
                                     reduce_failed_on=failing)])
    c = check(sim, 0, B=8)
    assert c.case_b and 3 in c.ids
    check(sim, 1, B=8)


def test_case_b_impossible_when_every_survivor_lost_the_last_bucket():
    # W=2: the only survivor's last reduction failed: nobody holds the old sum -> boundary path
    sim = simulate(2, 2, kills=[Kill(1, 0, "allreduce", 3, phase="data", reduce_failed_on=(0,))])
    c = check(sim, 0, B=4)
    assert not c.case_b and c.modes == ["non_blocking", "skip"] and list(c.ids) == [0]
    sim = simulate(2, 2, kills=[Kill(1, 0, "allreduce", 3, phase="data", reduce_failed_on=(0,))],
                   restore_enabled=False)
    check(sim, 0, correct=False)


def test_case_b_on_a_group_without_broadcast_falls_back_to_restoration():
    # a spare survives the election (its vote is unreadable) and the group cannot broadcast:
    # the window gives up and restores as for any failure - correct, just slower
    sim = simulate(6, 1, prefail=(5,), plain=True, kills=[Kill(0, 0, "consensus", 0)])
    c = check(sim, 0, B=6)
    assert not c.case_b and c.modes == ["blocking", "skip"]
    check(sim, 1, B=6)
    # with no spare left after the election, the vote alone decides: case (b)
    c = check(simulate(4, 1, prefail=(3,), plain=True, kills=[Kill(0, 0, "consensus", 0)]), 0)
    assert c.case_b


def test_failure_during_case_b_vote_is_folded_into_the_window():
    # 4 dies at the consensus (case (b)), 3 dies at the vote (allreduce #4): both are case-(b)
    # failures of the same committed step (no spare: everybody votes, no broadcast needed)
    sim = simulate(5, 2, kills=[Kill(4, 0, "consensus", 0), Kill(3, 0, "allreduce", 4)])
    c = check(sim, 0, B=10)
    assert c.case_b and 3 in c.ids and 4 in c.ids
    assert [f["replicas"] for f in c.failures] == [[4], [3]]
    c1 = check(sim, 1, B=10)
    assert c1.alive == (0, 1, 2)


def test_failure_during_case_b_broadcast():
    # spare present -> broadcast (#5 after the vote #4); replica 1 (not the source) dies in it
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(2, 0, "consensus", 0),
                                              Kill(1, 0, "broadcast", 0)])
    c = check(sim, 0, B=6)
    assert c.case_b and 2 in c.ids and 1 in c.ids
    check(sim, 1, B=6)


def test_case_b_after_a_blocking_restore():
    # 0 dies at #1 (spare promoted, blocking re-reduce), 1 dies at the confirming consensus:
    # every bucket was reduced under the post-repair membership -> case (b)
    sim = simulate(6, 1, prefail=(5,), kills=[Kill(0, 0, "allreduce", 1),
                                              Kill(1, 0, "consensus", 0)])
    c = check(sim, 0, B=6)
    assert c.case_b and c.modes[0] == "blocking" and 1 in c.ids and 0 not in c.ids


# ---- the HSDP cross-replica group's contract (records only at the consensus, all_clean) ------

@pytest.mark.parametrize("kill,case_b", [
    (Kill(3, 0, "allreduce", 1), False),
    (Kill(3, 0, "allreduce", 3, phase="data", reduce_failed_on=(1,)), False),
    (Kill(3, 0, "consensus", 0), True),
])
def test_hsdp_style_group(kill, case_b):
    sim = simulate(4, 2, kills=[kill], hsdp_style=True)
    c = check(sim, 0, B=8)
    assert c.case_b == case_b
    check(sim, 1, B=8)
    if not case_b:
        check(simulate(4, 2, kills=[kill], hsdp_style=True, restore_enabled=False), 0,
              correct=False)


def test_hsdp_style_spare_promotion():
    sim = simulate(4, 1, prefail=(3,), hsdp_style=True, kills=[Kill(0, 0, "allreduce", 2)])
    c = check(sim, 0, B=4)
    assert c.modes == ["blocking", "skip"]


# ---- adaptive baseline ----------------------------------------------------------------------

def test_adaptive_policy_commits_shrunk_batch_divided_by_committed_count():
    sim = simulate(4, 2, policy="adaptive", kills=[Kill(1, 0, "allreduce", 2)])
    c = check(sim, 0)
    assert c.divisor == 6 and c.modes == ["blocking", "skip"]
    check(sim, 1)
    check(simulate(4, 2, policy="adaptive", kills=[Kill(1, 0, "allreduce", 2)],
                   restore_enabled=False), 0, correct=False)


# ---- rewind engines ---------------------------------------------------------------------------

def test_worker_thread_rewind_gives_the_same_gradient():
    a = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 2)], rewind="thread")
    b = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 2)], rewind="copy")
    check(a, 0, B=8)
    assert torch.equal(a.at(0)[0].grad, b.at(0)[0].grad)
    for o in a.survivors.values():
        o.close()


# ---- the fake itself can fail a wrong protocol ------------------------------------------------

def test_fake_reports_collective_sequence_divergence():
    world = FakeWorld(2)

    def body(r):
        g = world.group(r)
        if r == 0:
            g.allreduce(torch.ones(3))
        else:
            g.consensus()

    with pytest.raises(FakeProtocolError, match="mismatch"):
        run_threads(world, body)


def test_contributed_counts_pushed_are_honest():
    """set_contributed tracks policy.kept_before as microbatches complete, is reset after the
    commit, and never counts extension microbatches before they are computed (the policy also
    cross-checks every event's contrib: a dishonest census raises EventMismatchError)."""
    sim = simulate(4, 2, iterations=1, kills=[Kill(3, 0, "allreduce", 1)])
    c = sim.at(0)[0]
    for r in sim.survivors:
        pushes = sim.world.group(r).contributed_pushes
        assert pushes[0] == 0 and pushes[-1] == 0
        # first pass: 1, 2 (and 2 again at fire); extension: kept or not, then reset
        assert pushes[1:4] == [1, 2, 2]
        assert max(pushes) == len(c.ids[r])


def test_naive_local_case_b_decision_is_caught(monkeypatch):
    """Negative control: deciding case (b) from the local view alone (no agreement) lets the
    survivor whose last reduction failed take another path than its peers: the fake must see it."""
    def naive(self, first):
        if all(b.content.value == "reduced" for b in self._buckets()):
            self._commit_case_b([(first, self._members())])
            return True
        self._on_failure(first, where="consensus")
        return False

    monkeypatch.setattr(StepTxnOrchestrator, "_case_b_window", naive)
    with pytest.raises(FakeProtocolError, match="deadlock|mismatch"):
        simulate(4, 2, iterations=1, timeout=1.0, kills=[
            Kill(3, 0, "allreduce", 3, phase="data", reduce_failed_on=(1,))])


def test_window_repairs_the_undefined_bucket_by_broadcast():
    sim = simulate(4, 2, iterations=1, kills=[
        Kill(3, 0, "allreduce", 3, phase="data", reduce_failed_on=(0,))])
    check(sim, 0, B=8)
    # 4 buckets, the consensus that reports the loss, then the window: vote (allreduce of 3
    # flags), consensus, broadcast from the lowest clean rank, confirming consensus
    kinds = [k for (_, k, _) in sim.world.calls]
    assert kinds[4:] == ["consensus", "allreduce", "consensus", "broadcast", "consensus"]


# ---- misuse --------------------------------------------------------------------------------------

def _solo():
    world = FakeWorld(1)
    pol = StaticWorldPolicy(1, 1)
    return world, pol, StepTxnOrchestrator(world.group(0), pol, lambda x: x)


def test_calls_out_of_order_are_protocol_errors():
    world, pol, orch = _solo()
    with pytest.raises(RecoveryProtocolError, match="begin_iteration"):
        orch.enqueue_bucket(torch.zeros(2))
    orch.begin_iteration()
    with pytest.raises(RecoveryProtocolError, match="before the first"):
        orch.consensus()
    orch.enqueue_bucket(torch.zeros(2))
    with pytest.raises(RecoveryProtocolError, match="not fired"):
        orch.consensus()
    orch.fire_deferred_allreduces()
    with pytest.raises(RecoveryProtocolError, match="COMMIT verdict"):
        orch.after_successful_commit()
    assert orch.consensus() is Verdict.COMMIT
    assert orch.restore_mode is None
    orch.after_successful_commit()


def test_bucket_shape_change_within_an_iteration_is_refused():
    world, pol, orch = _solo()
    orch.begin_iteration()
    orch.enqueue_bucket(torch.zeros(2))
    orch.fire_deferred_allreduces()
    orch._extension = True  # as after a NON_BLOCKING dispatch
    with pytest.raises(RecoveryProtocolError, match="changed"):
        orch.enqueue_bucket(torch.zeros(3))


def test_snapshot_buffer_follows_a_new_bucket_shape_across_iterations():
    world, pol, orch = _solo()
    for n in (2, 2, 5):
        orch.begin_iteration()
        orch.enqueue_bucket(torch.ones(n))
        orch.fire_deferred_allreduces()
        assert orch.consensus() is Verdict.COMMIT
        orch.after_successful_commit()
    assert orch.store.allocations == 2 and orch.snapshot_nbytes() == 5 * 4


def test_restore_mode_is_latched_until_dispatch():
    """restore_mode is BLOCKING right after a non-boundary failure (before consensus() runs the
    restoration), NON_BLOCKING after a boundary one; SKIP/None once restored and committed."""
    world = FakeWorld(3, [Kill(2, 0, "allreduce", 0)])
    seen = {}

    def body(r):
        pol = StaticWorldPolicy(3, 1)
        orch = StepTxnOrchestrator(world.group(r), pol, lambda x: x)
        orch.begin_iteration()
        t = torch.ones(4)
        orch.enqueue_bucket(t)
        orch.fire_deferred_allreduces()
        seen[r] = [orch.restore_mode]
        assert orch.consensus() is Verdict.EXTEND and orch.needs_extension()
        seen[r].append(orch.restore_mode)
        orch.wait_restore_before_backward()
        orch.enqueue_bucket(t)
        orch.fire_deferred_allreduces()
        assert not orch.needs_extension()
        assert orch.consensus() is Verdict.COMMIT
        orch.after_successful_commit()
        seen[r].append(orch.restore_mode)

    run_threads(world, body)
    assert seen[0] == seen[1] == [RestoreMode.NON_BLOCKING, None, None]


def test_mid_reduce_failure_of_the_last_rereduced_bucket_is_case_b():
    # pass 1: 0 dies at #2 (spare 3 promoted); blocking re-reduce of buckets 0-2 = #4 #5 #6;
    # 1 dies inside #6's data phase (replica 2 fails, 3 and 4 succeed): the loss shows only at
    # the consensus, every bucket was reduced under the post-repair membership -> case (b)
    sim = simulate(6, 1, prefail=(5,), kills=[
        Kill(0, 0, "allreduce", 2),
        Kill(1, 0, "allreduce", 6, phase="data", reduce_failed_on=(2,))])
    c = check(sim, 0, B=6)
    assert c.case_b and c.modes[0] == "blocking" and 1 in c.ids
    check(sim, 1, B=6)


# ---- random kill schedules ----------------------------------------------------------------------

def _random_schedule(seed: int):
    import random

    rnd = random.Random(seed)
    w, g = rnd.randint(3, 6), rnd.randint(1, 3)
    prefail = (w - 1,) if rnd.random() < 0.4 else ()
    alive = [r for r in range(w) if r not in prefail]
    victims = rnd.sample(alive, rnd.randint(1, len(alive) - 1))
    kills = []
    for v in victims:
        at = rnd.choice(["compute", "allreduce", "allreduce", "allreduce", "consensus"])
        phase = "before"
        if at == "allreduce":
            phase = rnd.choice(["before", "before", "data", "record"])
        # mostly positions of a clean first pass (g microbatches, allreduce #0-#3, consensus
        # #0), sometimes beyond it (reached only when an EXTEND pass runs in that iteration)
        far = rnd.random() < 0.3
        hi = {"compute": 7 if far else g - 1, "allreduce": 7 if far else 3,
              "consensus": 2 if far else 0}[at]
        kills.append(Kill(v, rnd.randint(0, 2), at, rnd.randint(0, hi), phase=phase))
    return w, g, prefail, kills, rnd.random() < 0.3


@pytest.mark.parametrize("seed", range(30))
def test_random_kill_schedules(seed):
    w, g, prefail, kills, hsdp = _random_schedule(seed)
    sim = simulate(w, g, prefail=prefail, kills=kills, iterations=3, hsdp_style=hsdp,
                   expect_all_fired=False)
    for it in range(3):
        check(sim, it, B=w * g)
    # every planned kill fired, except exactly those whose victim (alive to the end) never
    # reached the planned call: e.g. allreduce #5 of an iteration with no EXTEND pass (4
    # buckets: #0-#3), a microbatch position past the victim's policy.steps()
    world = sim.world
    fired, unfired = set(map(repr, world.fired)), set(map(repr, world.kills))
    assert fired | unfired == set(map(repr, kills)) and not fired & unfired
    assert unfired == set(map(repr, unreachable(world, kills))), (world.kills, world.reached)
    assert all(k.replica not in world.alive for k in world.fired)
    assert all(k.replica in world.alive for k in world.kills)
    # a victim alive at an iteration's start computes microbatch positions 0..g-1 and enters
    # consensus #0 whatever else happens: those kills must have fired
    sure = {repr(k) for k in kills if (k.at == "compute" and k.index < g)
            or (k.at == "consensus" and k.index == 0)}
    assert sure <= fired, (sure - fired, world.reached)


# ---- the per-bucket membership record (verify's one-membership check) -----------------------

ONE_MEMBERSHIP_CASES = [
    dict(w=4, g=2, kills=[Kill(3, 0, "allreduce", 2)]),                    # boundary mid-pass
    dict(w=4, g=1, prefail=(3,), kills=[Kill(0, 0, "allreduce", 2)]),      # spare, blocking
    dict(w=4, g=2, kills=[Kill(3, 0, "allreduce", 1), Kill(2, 0, "allreduce", 5)]),
    dict(w=4, g=2, kills=[Kill(3, 0, "allreduce", 2)], hsdp_style=True),
]


@pytest.mark.parametrize("case", ONE_MEMBERSHIP_CASES, ids=range(len(ONE_MEMBERSHIP_CASES)))
def test_bucket_epochs_one_membership_iff_restored(case):
    """Restored: every bucket of every commit holds exactly one reduction, all under the same
    epoch. Restore disabled: some bucket of the failure's commit holds two (a missing rewind)."""
    good = simulate(**case)
    for (r, it), c in good.commits.items():
        assert c.bucket_epochs and all(len(e) == 1 for e in c.bucket_epochs), (r, it, c)
        assert len({e[0] for e in c.bucket_epochs}) == 1, (r, it, c.bucket_epochs)
    bad = simulate(**case, restore_enabled=False)
    multi = [(r, it, c.bucket_epochs) for (r, it), c in bad.commits.items()
             if any(len(set(e)) > 1 for e in c.bucket_epochs)]
    assert multi, "restore disabled after a mid-pass failure, yet one membership per bucket"


def test_bucket_epochs_of_a_failure_before_any_reduction_are_clean_either_way():
    sim = simulate(4, 2, kills=[Kill(3, 0, "allreduce", 0)], restore_enabled=False)
    for c in sim.commits.values():
        assert all(len(e) == 1 for e in c.bucket_epochs)
