"""verify's window selection (recover_hsdp/verify/windows.py): no torch, no run."""
from __future__ import annotations

import pytest

from recover_hsdp.verify import windows as wn
from recover_hsdp.verify.windows import CHECKPOINT, SNAPSHOT, Window

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_points_snapshot_after_step_s_checkpoint_before_step_n():
    # snapshots of steps 0 and 9 (and the init, -1: not a point); checkpoints step_2, 4, 6, 10
    pts = wn.points(9, [-1, 0, 9], [2, 4, 6, 10])
    assert pts == {0: SNAPSHOT, 1: CHECKPOINT, 3: CHECKPOINT, 5: CHECKPOINT, 9: SNAPSHOT}
    assert wn.points(9, [], [20]) == {}          # a checkpoint past the record: no point


def test_a_snapshot_wins_over_a_checkpoint_of_the_same_state():
    assert wn.points(5, [3], [4]) == {3: SNAPSHOT}


def test_starts_are_the_init_and_every_checkpoint_inside_the_record():
    assert wn.starts(9, [2, 4, 6, 10]) == [0, 2, 4, 6]
    assert wn.starts(9, []) == [0]


def test_steps_is_half_open_and_starts_at_the_nearest_start_at_or_before_a():
    wins, pts = wn.plan(9, [9], [2, 4, 6], steps="5:8")
    assert wins == [Window(4, 7)] and pts[5] == CHECKPOINT
    assert wn.plan(9, [9], [2, 4, 6], steps="4:")[0] == [Window(4, 9)]
    assert wn.plan(9, [9], [], steps="5:8")[0] == [Window(0, 7)]     # no checkpoint: the init
    assert wn.plan(9, [9], [2, 4, 6], steps="2:100")[0] == [Window(2, 9)]   # clamped
    assert wn.plan(9, [9], [2, 4, 6], steps="5:8", use_checkpoints=False)[0] == [Window(0, 7)]


@pytest.mark.parametrize("text", ["5", "x:3", "4:4", "6:2", "-1:3", "10:12"])
def test_steps_refuses_what_is_not_a_range_of_the_run(text):
    with pytest.raises(ValueError, match="--steps"):
        wn.parse_steps(text, 9)


def test_candidate_windows_lie_between_consecutive_starts_and_hold_a_point():
    pts = wn.points(9, [9], [2, 4, 8])         # points 1, 3, 7, 9; no point in 4..6... except 7
    cands = wn.candidate_windows(9, wn.starts(9, [2, 4, 8]), pts)
    assert cands == [Window(0, 1), Window(2, 3), Window(4, 7), Window(8, 9)]
    # a window without any point is never a candidate (nothing to compare)
    assert wn.candidate_windows(9, [0, 5], {2: SNAPSHOT}) == [Window(0, 4)]


def test_sample_is_reproducible_sorted_and_all_when_k_is_large():
    cands = [Window(a, a + 1) for a in range(0, 40, 2)]
    a = wn.sample_windows(cands, 5, seed=7)
    assert a == wn.sample_windows(cands, 5, seed=7) and len(a) == 5
    assert a == sorted(a, key=lambda w: w.start) and set(a) <= set(cands)
    assert any(wn.sample_windows(cands, 5, seed=s) != a for s in range(1, 6))
    assert wn.sample_windows(cands, 50, seed=0) == cands
    with pytest.raises(ValueError, match="--sample"):
        wn.plan(9, [], [2], sample=0)


def test_default_plan_is_the_whole_run_from_the_init():
    wins, pts = wn.plan(9, [0, 9], [4])
    assert wins == [Window(0, 9)] and pts == {0: SNAPSHOT, 3: CHECKPOINT, 9: SNAPSHOT}


def test_ranges():
    assert wn.ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert wn.ranges([]) == "none"
