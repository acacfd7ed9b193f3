"""`recover-hsdp chaos --standby K`: which rank blocks it may fault, and how a faulted
block is found reported lost in a run record with standbys (a replica slot, a standby lost idle,
an abandoned join, a promoted standby's slot). No processes."""
from __future__ import annotations

import random
from types import SimpleNamespace as NS

import pytest

from recover_hsdp.tools import chaos

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


@pytest.mark.parametrize("W,K,faults", [(3, 0, 2), (3, 1, 3), (2, 2, 3), (3, 2, 4)])
def test_victims_leave_a_replica_alive(W, K, faults):
    rng = random.Random(0)
    seen = set()
    for _ in range(300):
        v = chaos._victims(rng, W, K, faults)
        assert 1 <= len(v) <= min(faults, W - 1 + K) and len(set(v)) == len(v)
        assert all(0 <= b < W + K for b in v)
        assert sum(b < W for b in v) <= W - 1      # one of the first W blocks always survives
        seen |= set(v)
    assert seen == set(range(W + K))               # standbys are victims too
    assert chaos._victims(rng, W, K, 0) == []


def _step(failed=(), joins=(), standbys_lost=()):
    extra = {}
    if joins:
        extra["joins"] = [dict(replica=d, standby=p, outcome=o) for d, p, o in joins]
    if standbys_lost:
        extra["standbys_lost"] = list(standbys_lost)
    return NS(failures=[{"replicas": list(failed)}] if failed else [], extra=extra)


def test_lost_blocks_follow_the_slots():
    # W=3 + 3: slot 1 lost at step 2, standby 3 takes it before step 3; standby 5 lost idle at
    # step 3; block 3 (slot 1) lost at step 4; standby 4's join abandoned before step 5
    rec = NS(steps={0: _step(), 1: _step(), 2: _step(failed=[1]),
                    3: _step(joins=[(1, 3, "joined")], standbys_lost=[5]),
                    4: _step(failed=[1]), 5: _step(joins=[(1, 4, "abandoned")])})
    assert chaos._lost_blocks(rec) == {1: 2, 5: 3, 3: 4, 4: 5}


def test_report_counts_standby_faults_and_joins():
    r = [{"run": 0, "ok": True, "hung": False, "committed": 5, "steps": 5, "dir": "d",
          "reason": "", "replicas": 3, "standby": 2,
          "faults": [{"kind": "kill", "replica": 4, "recovery_s": 1.0},
                     {"kind": "stop", "replica": 1, "at": "boundary", "detection_s": 1.5}],
          "joins": [{"outcome": "joined"}, {"outcome": "abandoned"}]}]
    text = chaos.report(r)
    assert ("standbys: faults on standby blocks 1, at a join boundary 1; joins 1 joined, "
            "1 abandoned") in text


def test_bad_standby_is_exit_2(tmp_path, capsys):
    assert chaos.main(["--standby", "-1", "--out", str(tmp_path)]) == 2
    assert "--standby" in capsys.readouterr().err
