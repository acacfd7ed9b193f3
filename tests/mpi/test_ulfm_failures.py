"""ULFM collectives under real SIGKILLs (`mpirun --with-ft ulfm`).

Each launch runs a table of failure stages on one group that shrinks stage after stage (every
stage starts from the previous stage's agreed final consensus), so one mpirun covers several
kill schedules. For every stage the tests check: every survivor returned; the records are
identical on every survivor; the lost ranks are reported exactly once; the next all-reduce sums
exactly over the survivors (spares send zeros); a pg from before a repair refuses and the rebuilt
one works. Expected census/contrib/at_boundary come from a reference election written here.
"""
from __future__ import annotations

import json

import pytest

from _mpi import WORKERS, run_mpi

from recover_hsdp.collectives.errors import ERR_PROC_FAILED

SCEN = WORKERS / "ulfm_scenarios.py"
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("ulfm_ready")]

MAJ, MIN, MAJ_SP, MIN_SP, BMIN = 0, 1, 2, 3, 4
REPAIR_IN_CALL = {"before", "detect", "record"}  # the first call itself repairs


def reference_election(roles, alive, contributed):
    """Independent of the C++ one: -> (roles of survivors, census, contrib, at_boundary)."""
    dead_major = sum(1 for r, a in zip(roles, alive) if not a and r in (MAJ, BMIN))
    dead_minor = sum(1 for r, a in zip(roles, alive) if not a and r == MIN)
    maj_spares = [i for i, (r, a) in enumerate(zip(roles, alive)) if a and r == MAJ_SP]
    min_spares = [i for i, (r, a) in enumerate(zip(roles, alive)) if a and r == MIN_SP]
    boundary = dead_major > len(maj_spares) or dead_minor > len(min_spares)
    new = list(roles)
    if not boundary:
        for i in maj_spares[:dead_major]:
            new[i] = MAJ
        for i in min_spares[:dead_minor]:
            new[i] = MIN
    surv = [i for i, a in enumerate(alive) if a]
    out_roles = [new[i] for i in surv]
    census = [out_roles.count(k) for k in range(5)]
    contrib = sum(contributed[i] for i in surv if boundary or new[i] not in (MAJ_SP, MIN_SP))
    return out_roles, census, contrib, boundary


def launch(nprocs, scenario, args, timeout):
    run = run_mpi(nprocs, SCEN, [scenario, json.dumps(args)], timeout=timeout)
    for rank, r in run.results.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    # a rank killed in a later stage left partial results: it is not a survivor (the tests
    # compare run.survivors with the expected survivors)
    run.staged = dict(run.results)  # every rank's stages, victims of later stages included
    run.results = {k: r for k, r in run.results.items() if not r.get("partial")}
    return run


def identical(records: dict[int, dict], what: str) -> dict:
    values = list(records.values())
    for rank, rec in records.items():
        assert rec == values[0], f"{what} differs on rank {rank}: {rec} vs {values[0]}"
    return values[0]


def check_stage(per_rank: dict[int, dict], members: list[int], stage: dict, roles=None):
    """per_rank: this stage's output of every survivor of this group. Returns the survivors."""
    victims = {int(k): v for k, v in stage.get("victims", {}).items() if int(k) in members}
    survivors = [m for m in members if m not in victims]
    assert sorted(per_rank) == sorted(survivors), (sorted(per_rank), survivors)
    for r in per_rank.values():
        assert r["members_before"] == members

    firsts = {k: r["first"] for k, r in per_rank.items()}
    gate = identical({k: r["gate"] for k, r in per_rank.items()}, "gate record")
    points = set(victims.values())
    if not any(f["reduce_failed"] for f in firsts.values()):
        first = identical(firsts, "first record")
    else:
        first = None
    # the loss is reported exactly once, by the first call or by the gate
    reported = sorted((first or {"failed_ranks": []})["failed_ranks"] + gate["failed_ranks"])
    assert reported == sorted(victims), (reported, victims)

    if victims and points <= REPAIR_IN_CALL:
        assert first is not None and not first["ok"] and first["failed_ranks"] == sorted(victims)
        assert gate["ok"] and gate["failed_ranks"] == []
        record = first
    elif points and points <= {"data", "data_mid"}:
        # data: died after Detect passed, before the transfer; data_mid: inside it (the
        # transfer split in parts, the victim gone after the first): every survivor's data
        # call fails, none completes, the gate reports the loss
        for f in firsts.values():
            assert f["reduce_failed"] and not f["ok"] and f["failed_ranks"] == []
            assert f["epoch"] == per_rank[survivors[0]]["epoch_before"]
        assert not gate["ok"] and gate["failed_ranks"] == sorted(victims)
        record = gate
    elif points == {"after"}:
        assert first is not None and first["ok"]
        for r in per_rank.values():
            if r["expected_first"] is not None:
                assert r["first_value"] == r["expected_first"] and r["first_uniform"]
        assert not gate["ok"] and gate["failed_ranks"] == sorted(victims)
        record = gate
    elif victims:
        raise AssertionError(f"no expected outcome for kill points {points} (data_async lands "
                             f"by timing, anywhere around the transfer: use data_mid)")
    else:
        assert first["ok"] and gate["ok"]
        record = None

    if record is not None:
        epoch_before = per_rank[survivors[0]]["epoch_before"]
        assert record["epoch"] >= epoch_before + 1
        if len(victims) == 1:
            assert record["epoch"] == epoch_before + 1
        if roles is not None:
            alive = [m not in victims for m in members]
            exp_roles, census, contrib, boundary = reference_election(
                roles, alive, stage.get("contributed", [0] * len(members)))
            assert record["roles"] == exp_roles
            assert record["census"] == census
            assert record["contrib"] == contrib
            assert record["at_boundary"] == boundary
            for r in per_rank.values():
                assert r["roles_after"] == exp_roles
        for r in per_rank.values():
            err = r.get("stale_pg_error")
            assert err and "stale" in err["msg"], err
    for k, r in per_rank.items():
        c = r["check"]
        assert c["res"]["ok"] and c["members"] == survivors, c
        assert c["value"] == c["expected"] and c["uniform"], c
        assert c["rank"] == survivors.index(k) and c["size"] == len(survivors)
        cb = r["check_bf16"]
        assert cb["res"]["ok"] and cb["value"] == c["expected"] and cb["uniform"]
        assert r["pg"]["value"] == c["expected"] and r["pg"]["size"] == len(survivors)
        assert r["final"]["ok"]
    identical({k: r["check"]["res"] for k, r in per_rank.items()}, "check record")
    return survivors


def check_chain(run, groups: list[list[int]], stages: list[dict]):
    for members in groups:
        roles_given = None
        for idx, stage in enumerate(stages):
            per_rank = {k: r["stages"][idx] for k, r in run.staged.items()
                        if k in members and len(r["stages"]) > idx}
            roles_given = stage.get("roles")
            members = check_stage(per_rank, members, stage, roles_given)


@pytest.mark.timeout(200)
def test_kill_points_before_during_after_rank0_and_two_in_one_call():
    """allreduce, broadcast, consensus and barrier share the protocol: one table over all four."""
    stages = [
        {"victims": {"7": "before"}},                       # before an all-reduce
        {"victims": {"6": "data"}},                         # inside it, after Detect passed
        {"victims": {"5": "after"}, "op": "broadcast"},     # right after a broadcast
        {"victims": {"0": "detect"}, "op": "consensus"},    # inside a consensus; global rank 0
        {"victims": {"1": "before", "3": "record"}, "op": "barrier"},  # two in one call, one
    ]                                                       # of them mid-Record
    run = launch(8, "chain", {"stages": stages, "after_failures": True}, timeout=190)
    assert run.survivors == [2, 4], run.tail()
    check_chain(run, [list(range(8))], stages)
    for k, r in run.results.items():
        # once ranks died, MPI_COMM_WORLD cannot parent new groups: a clean typed error ...
        for err in (r["from_ranks_error"], r["world_error"]):
            assert err["type"] == "UlfmError" and err["error_class"] == ERR_PROC_FAILED, err
        # ... while a repaired group can
        assert r["subgroup"] == {"global_ranks": [4, 2], "rank": [4, 2].index(k), "ok": True,
                                 "value": 8.0}
        assert r["after_subgroup"]["ok"]
    # the mid-Record death made the call repair twice: epoch 5 -> ... one per repair
    last = run.results[2]["stages"][4]["first"]
    assert last["failed_ranks"] == [1, 3] and last["epoch"] == run.results[2]["stages"][4][
        "epoch_before"] + 2


@pytest.mark.timeout(200)
def test_roles_spare_killed_promotions_and_boundary():
    stages = [
        # a spare dies: no promotion, not a boundary
        {"roles": [MAJ, MAJ, MAJ, MAJ_SP, MIN, MIN_SP, MIN], "contributed": [3, 3, 3, 3, 2, 2, 2],
         "victims": {"3": "before"}},
        # a major dies (global rank 0) with a major-spare: promotion
        {"roles": [MAJ, MAJ, MAJ_SP, MIN, MIN_SP, MIN], "contributed": [3, 3, 3, 2, 2, 2],
         "victims": {"0": "before"}},
        # a boundary-minor and a minor die in the same call (a broadcast): both spares promoted
        {"roles": [MAJ, BMIN, MIN, MAJ_SP, MIN_SP], "contributed": [3, 2, 2, 3, 2],
         "victims": {"2": "before", "4": "before"}, "op": "broadcast"},
        # a major dies with no major-spare: boundary, the minor-spare is admitted (contrib)
        {"roles": [MAJ, MAJ, MIN_SP], "contributed": [3, 3, 1], "victims": {"5": "before"}},
    ]
    run = launch(7, "chain", {"stages": stages}, timeout=190)
    assert run.survivors == [1, 6], run.tail()
    check_chain(run, [list(range(7))], stages)
    s = run.results[1]["stages"]
    assert s[0]["first"]["census"] == [3, 2, 0, 1, 0] and not s[0]["first"]["at_boundary"]
    assert s[1]["first"]["census"] == [2, 2, 0, 1, 0] and s[1]["first"]["roles"][1] == MAJ
    assert s[2]["first"]["census"] == [2, 1, 0, 0, 0]
    assert s[3]["first"]["at_boundary"] and s[3]["first"]["contrib"] == 4
    assert s[3]["check"]["value"] == 2.0  # world rank 1 (value 2) + the spare's zeros


@pytest.mark.quick
@pytest.mark.timeout(150)
def test_asymmetric_outcome_becomes_one_verdict():
    run = launch(4, "asymmetric", {"fails": 1, "victim": 3}, timeout=140)
    assert run.survivors == [0, 1, 2], run.tail()
    res = run.results
    # round 1: rank 1 saw a failed reduction, ranks 0 and 2 a clean one (sum over 4 ranks)
    assert res[1]["first"]["reduce_failed"] and not res[1]["first"]["ok"]
    for k in (0, 2):
        assert res[k]["first"]["ok"] and res[k]["first_value"] == 10.0
    gate = identical({k: r["gate"] for k, r in res.items()}, "gate")
    assert not gate["ok"] and gate["failed_ranks"] == [3] and gate["epoch"] == 1
    for r in res.values():
        assert r["check"]["value"] == 6.0 and r["check"]["res"]["ok"]
    # round 2: nobody died, rank 0 "failed": still one verdict, a repair that lost no one
    assert res[0]["second"]["reduce_failed"]
    for k in (1, 2):
        assert res[k]["second"]["ok"] and res[k]["second_value"] == 6.0
    gate2 = identical({k: r["second_gate"] for k, r in res.items()}, "second gate")
    assert not gate2["ok"] and gate2["failed_ranks"] == [] and gate2["epoch"] == 2
    for r in res.values():
        assert r["second_check"]["value"] == 6.0 and r["second_check"]["members"] == [0, 1, 2]
        assert r["final"]["ok"]


@pytest.mark.quick
@pytest.mark.timeout(150)
def test_subgroups_2_of_4():
    """Replicate groups {0,2} and {1,3}: a death in one leaves the other untouched, and the
    repaired group is a usable group of one."""
    stages = [{"victims": {"2": "before"}}, {"victims": {}}]
    run = launch(4, "chain", {"shard": 2, "stages": stages}, timeout=140)
    assert run.survivors == [0, 1, 3], run.tail()
    check_chain(run, [[0, 2], [1, 3]], stages)
    assert run.results[0]["stages"][0]["first"]["failed_ranks"] == [2]
    for k in (1, 3):
        assert run.results[k]["stages"][0]["first"]["ok"]
        assert run.results[k]["stages"][0]["gate"]["epoch"] == 0


@pytest.mark.timeout(200)
def test_subgroups_3_of_6_with_a_64mb_transfer_cut():
    """Replicate groups {0,2,4} and {1,3,5}; rank 4 dies INSIDE a 64 MB all-reduce of its group
    (the transfer split in two MPI calls on every member; rank 4 dies after the first, so its
    peers are in the second: they must see reduce_failed, never a completed sum), then rank 1
    dies inside the Detect of the next all-reduce of the other group."""
    stages = [
        {"victims": {"4": "data_mid"}, "numel": 16 * 1024 * 1024, "split": 2},
        {"victims": {"1": "detect"}},
    ]
    run = launch(6, "chain", {"shard": 2, "stages": stages}, timeout=190)
    assert run.survivors == [0, 2, 3, 5], run.tail()
    check_chain(run, [[0, 2, 4], [1, 3, 5]], stages)
    for k in (0, 2):       # the in-transfer outcome, stated where it happened
        first = run.results[k]["stages"][0]["first"]
        assert first["reduce_failed"] and not first["ok"], first
        assert run.results[k]["stages"][0]["gate"]["failed_ranks"] == [4]
