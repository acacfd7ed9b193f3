"""Hot standbys (docs/rejoin.md) without processes: the config key, the policy's join
(slot resumed, layout grown back, B kept), exactly-once ids across a join, and the verifier's
independent derivation of joined runs."""
from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from recover_hsdp.config import (TrainConfigError, check_world, compose_config, resolve_config,
                                 validate)
from recover_hsdp.policy import DataAssignment, PolicyError, StaticWorldPolicy
from recover_hsdp.policy.standby import rejoin, vacant_slots
from recover_hsdp.verify.expected import check_expected

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)


def resolved(*overrides):
    return resolve_config(compose_config(list(overrides)), cwd=Path("/tmp/cwd"), now=NOW)


# ---- config ---------------------------------------------------------------------------------
def test_standby_is_off_by_default_and_launches_extra_ranks():
    assert resolved().parallel.standby == 0 and resolved().run.np == 2
    cfg = resolved("parallel.replicas=3", "parallel.shard_size=2", "parallel.standby=1")
    assert cfg.run.np == 8
    validate(cfg)
    check_world(cfg, 8)
    with pytest.raises(TrainConfigError, match=r"^\(parallel.replicas\(3\) \+ parallel.standby"
                       r"\(1\)\) \* parallel.shard_size\(2\) = 8 != 6 ranks launched$"):
        check_world(cfg, 6)
    cfg.run.np = 6                       # the error names the standbys the launch must hold
    with pytest.raises(TrainConfigError, match=r"^\(parallel.replicas\(3\) \+ parallel.standby"
                       r"\(1\)\) \* parallel.shard_size\(2\) = 8 != run.np\(6\) ranks to "
                       r"launch$"):
        validate(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.standby=-1"], "parallel.standby(-1) must be an integer >= 0"),
    (["parallel.standby=1", "policy=adaptive"], "parallel.standby(1) needs policy.name=static"),
    (["elastic.rejoin=true", "policy=adaptive"], "elastic.rejoin=true needs policy.name=static"),
    (["elastic.rejoin=true", "baseline=checkpoint_restart"], "elastic.rejoin=true runs only with"),
    (["elastic.max_rejoins=-1"], "elastic.max_rejoins(-1) must be an integer >= 0"),
    (["run.max_rejoins=-1"], "elastic.max_rejoins(-1) must be an integer >= 0"),   # the old key
    (["elastic.rejoin_backoff_s=-2"], "must be a number >= 0 (seconds)"),
])
def test_standby_config_errors_are_one_line(overrides, message):
    with pytest.raises(TrainConfigError) as info:
        validate(resolved(*overrides))
    assert "\n" not in str(info.value) and message in str(info.value), str(info.value)


def test_standby_combines_with_checkpoints_and_the_rejoin_relaunch():
    # one policy (docs/rejoin.md): standbys first, then the checkpoint + full-width relaunch
    cfg = resolved("parallel.replicas=3", "parallel.standby=1", "checkpoint.interval=2",
                   "elastic.min_replicas=1", "elastic.rejoin=true", "elastic.max_rejoins=2")
    validate(cfg)
    el = cfg.elastic
    assert el.rejoin is True and el.max_rejoins == 2 and el.rejoin_backoff_s == 1.0


# ---- policy + data ----------------------------------------------------------------------------
def _commit(pol, data, records, joins=()):
    contrib = data.commit(pol)
    records.append(SimpleNamespace(
        step=len(records), contributions={r: list(v) for r, v in contrib.items()},
        divisor=pol.divisor(), alive=list(pol.alive), boundary=bool(pol.at_boundary),
        failures=[], extra={"joins": [{"replica": j, "outcome": "joined"} for j in joins]}
        if joins else {}))
    pol.after_commit()
    return contrib


def _run(W, G, kill_step, victim, case_b=False, steps=8):
    pol, data, recs = StaticWorldPolicy(W, G), DataAssignment(W), []
    joined = []
    for s in range(steps):
        if s == kill_step:
            if case_b:
                pol.fail([victim], after_commit=True)
            else:
                pol.fail([victim])
        _commit(pol, data, recs, joins=joined)
        if s == kill_step:
            recs[-1].failures = [{"replicas": [victim], "case_b": case_b}]
        joined = []
        if len(pol.alive) < W:
            slot = vacant_slots(W, pol.alive)[0]
            rejoin(pol, data, slot)
            joined = [slot]
    return pol, data, recs


@pytest.mark.parametrize("W,G,case_b", [(3, 2, False), (3, 2, True), (4, 3, False), (2, 1, True)])
def test_join_regrows_the_layout_keeps_b_and_ids_once(W, G, case_b):
    pol, data, recs = _run(W, G, kill_step=3, victim=1, case_b=case_b)
    B = W * G
    assert pol.alive == tuple(range(W))
    assert pol.layout.g == G and pol.layout.n_major == W     # back to G_init after the join
    seen = set()
    for r in recs:
        ids = [i for v in r.contributions.values() for i in v]
        assert len(ids) == r.divisor == B
        assert not (seen & set(ids)), f"step {r.step} repeats {sorted(seen & set(ids))}"
        seen |= set(ids)
        for rep, v in r.contributions.items():
            assert all(i % W == rep for i in v)              # the slot's own slice
    assert recs[4].extra["joins"][0]["replica"] == 1 and sorted(recs[4].contributions) == list(
        range(W))
    # the newcomer resumes past every id its slot ever committed
    before = max(i for r in recs[:4] for i in r.contributions.get(1, []))
    assert min(recs[4].contributions[1]) > before
    steps = {r.step: r for r in recs}
    assert check_expected(steps, w_init=W, g_init=G) == []


def test_verifier_rejects_a_join_that_reuses_committed_ids():
    pol, data, recs = _run(3, 2, kill_step=3, victim=1)
    bad = recs[4].contributions[1]
    recs[4].contributions[1] = [bad[0] - 3 * 4, bad[1]]      # an id of slot 1 from step 2
    out = check_expected({r.step: r for r in recs}, w_init=3, g_init=2)
    assert out and out[0].step == 4 and "replica 1" in out[0].message


def test_verifier_rejects_an_unrecorded_join():
    pol, data, recs = _run(3, 2, kill_step=3, victim=1)
    recs[4].extra = {}
    out = check_expected({r.step: r for r in recs}, w_init=3, g_init=2)
    assert out and out[0].step == 4


def test_rejoin_refuses_an_alive_slot_and_mid_iteration():
    pol, data = StaticWorldPolicy(3, 2), DataAssignment(3)
    with pytest.raises(PolicyError):
        rejoin(pol, data, 1)
    pol.fail([1])            # a boundary step is open
    with pytest.raises(PolicyError):
        rejoin(pol, data, 1)


def test_relaunch_due_only_when_no_standby_is_left_and_the_launcher_counts_rejoins():
    from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager
    from recover_hsdp.launcher.resume import _rejoin_left, wants_supervisor

    def mgr(alive, standby=0, pool=()):
        return SimpleNamespace(policy=SimpleNamespace(alive=tuple(alive), w_init=3),
                               standby=standby, cross=SimpleNamespace(pool=list(pool)))

    due = HSDPULFMTrainingManager.relaunch_due
    assert not due(mgr([0, 1, 2])) and due(mgr([0, 2]))
    assert not due(mgr([0, 2], standby=1, pool=[3]))    # a standby takes the slot in place
    assert due(mgr([0, 2], standby=1, pool=[]))          # pool used up: relaunch
    cfg = resolved("elastic.rejoin=true", "elastic.max_rejoins=2")
    assert wants_supervisor(cfg) and [_rejoin_left(cfg, n) for n in range(4)] == [
        True, True, False, False]
    assert not _rejoin_left(resolved(), 0) and not wants_supervisor(resolved())


def test_a_resume_with_standbys_keeps_the_first_width():
    from recover_hsdp.launcher.resume import check_resume

    cfg = resolved("parallel.replicas=2", "parallel.grad_accum=3", "parallel.standby=1")
    why = check_resume(cfg, {"w_init": 3, "B": 6}, Path("ck/step_000004"))
    assert why == ("cannot resume from ck/step_000004 with parallel.standby(1): a run with "
                   "standbys resumes at its first width (parallel.replicas=3, got 2)")
    assert check_resume(resolved("parallel.replicas=3", "parallel.grad_accum=2",
                                 "parallel.standby=1"), {"w_init": 3, "B": 6}, Path("x")) is None
