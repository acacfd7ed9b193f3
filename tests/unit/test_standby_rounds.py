"""Hot standbys in the world rounds of HSDPCrossReplicaGroup.consensus, in one process.

The in-process ULFM of test_cross_replica_recovery (threads = ranks, uniform Detect -> Repair,
deaths at the group's kill points) drives W replicas that run steps and K standbys that only loop
on the consensus rounds (recover_hsdp.hsdp.standby). Every collective must pair up (a mismatch or a
hang fails), and replicas and standbys must share one view: the alive slots, the standby pool, the
epoch; a standby's death is no policy event; a death in a join round is carried into the next
step's consensus; the done round releases the standbys.
"""
from __future__ import annotations

import threading

import pytest
import torch

from recover_hsdp.hsdp.cross_replica import HSDPCrossReplicaGroup
from recover_hsdp.hsdp.standby import J_DONE, J_JOIN, _round
from recover_hsdp.policy import contrib_total, elect
from tests.unit.test_cross_replica_recovery import Dead, Fabric, Handle

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def run(W, S, K, kills, *, steps=2, join_round_at=None, G=2):
    """kills: {rank: (step, location)} (a standby's 'step' counts its rounds). join_round_at: a
    step after which the replicas run one join-request round. Returns {rank: views}."""
    n = (W + K) * S
    fab = Fabric(n)
    world_comm = fab.comm(tuple(range(n)), "world")
    out: dict[int, list] = {}
    errors: list[BaseException] = []

    def body(rank):
        step, gen = [0], [0]

        def checkpoint(location, **kw):
            if kills.get(rank) == (step[0], location):
                fab.kill(rank)

        def barrier():
            gen[0] += 1
            if S > 1:
                fab.shard_barrier(rank, S, gen[0])

        g = HSDPCrossReplicaGroup(
            world=Handle(fab, rank, world_comm), replicas=W, shard_size=S, global_rank=rank,
            make_group=lambda ranks: Handle(fab, rank, fab.comm(tuple(ranks))),
            shard_barrier=barrier, elect=elect, contrib_total=contrib_total,
            checkpoint=checkpoint, die=lambda: fab.kill(rank), standby=K)
        res = []
        if g.is_standby:
            assert g.rg is None
            while True:
                r, fl = _round(g)
                res.append(("round", r.ok, tuple(g.alive), tuple(g.pool), g.epoch, fl[J_JOIN]))
                step[0] += 1
                if fl[J_DONE] > 0.5:
                    break
            out[rank] = res
            return
        for s in range(steps):
            step[0] = s
            g.begin_pass()
            g.set_contributed(G)
            g.set_loss_sum(1.0)
            g.allreduce(torch.ones(3))
            checkpoint("reduce")
            r = g.consensus()
            res.append(("step", tuple(r.failed_replicas), tuple(g.alive), tuple(g.pool),
                        g.epoch, tuple(g.standbys_lost)))
            g.set_quiesce(False)
            t = torch.ones(2)
            assert g.rg.allreduce(t).ok
            assert t.tolist() == [float(len(g.alive))] * 2   # standbys are not in the reduction
            if s == join_round_at:
                step[0] = ("join", s)          # kill points of the join round
                jr, _ = _round(g, join=1)
                res.append(("join", jr.ok, tuple(g.alive), tuple(g.pool)))
        if g.pool:
            _round(g, done=1)
        out[rank] = res

    def target(rank):
        try:
            body(rank)
        except Dead:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "ranks did not finish (hang)"
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("S", [1, 2])
def test_standbys_follow_a_replica_loss(S):
    W, K = 3, 1
    out = run(W, S, K, {1 * S: (0, "reduce")})
    actives = [g for g in range(W * S) if g // S != 1]
    standby = list(range(W * S, (W + K) * S))
    assert sorted(out) == sorted(actives + standby)
    views = {tuple(out[g]) for g in actives}
    assert len(views) == 1
    view = views.pop()
    assert view[0][1:4] == ((1,), (0, 2), (W,))
    assert view[0][5] == ()      # a replica's loss is not a standby's
    for g in standby:     # same alive set and pool; one round per consensus, then released
        rounds = out[g]
        assert rounds[0][2:4] == ((0, 2), (W,)) and rounds[0][4] == view[0][4]
        assert len(rounds) == 3


def test_a_standby_death_is_no_policy_event():
    W, S, K = 3, 2, 1
    out = run(W, S, K, {W * S + 1: (0, "agreed")})
    views = {tuple(out[g]) for g in range(W * S)}
    assert len(views) == 1
    view = views.pop()
    assert view[0][1] == () and view[0][2] == (0, 1, 2) and view[0][3] == ()
    assert view[0][4] >= 1      # the world was repaired: the epoch moved (buckets re-reduced)
    assert view[0][5] == (W,)   # reported lost (the step's extra.standbys_lost)
    assert not any(g >= W * S for g in out)   # both ranks of the standby are gone


def test_a_death_in_the_join_round_is_carried_to_the_next_step():
    W, S, K = 3, 1, 1
    # replica 2 dies before the agreed vector of the join round run after step 0
    out = run(W, S, K, {2: (("join", 0), "agreed")}, join_round_at=0, steps=2)
    views = {tuple(out[g]) for g in (0, 1)}
    assert len(views) == 1
    step0, join, step1 = views.pop()
    assert step0[1] == () and join[1] is False      # no join: the round saw a death
    assert join[2] == (0, 1, 2)                       # ... not applied in the round
    assert step1[1] == (2,) and step1[2] == (0, 1)    # the next step's consensus handles it
    assert out[3][1][1] is False and out[3][1][5] > 0.5   # the standby saw the same round
