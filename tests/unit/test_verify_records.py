"""verify's record-level invariants (pure Python, no replay) and its tolerance arithmetic."""
from __future__ import annotations

import math

import pytest

from recover_hsdp.record import StepRecord
from recover_hsdp.verify import Tolerance, check_records
from recover_hsdp.verify.tolerance import ulp_floor

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def steps(*contribs, divisor=4):
    return {i: StepRecord(step=i, contributions=c, divisor=divisor) for i, c in enumerate(contribs)}


GOOD = [{0: [0, 2], 1: [1, 3]}, {0: [4, 6], 1: [5, 7]}, {0: [8, 10, 12, 14]}]


def test_good_record_passes_including_a_lost_replica():
    assert check_records(steps(*GOOD), w_init=2, B=4) == []


@pytest.mark.parametrize("mutate, step, text", [
    (lambda s: s.pop(1), 1, "step 1 never committed"),
    (lambda s: setattr(s[2], "divisor", 3), 2, "divisor 3 != B 4"),
    (lambda s: s[2].contributions[0].pop(), 2, "3 microbatch ids contributed, divisor is 4"),
    (lambda s: s[1].contributions[0].__setitem__(0, 5), 1, "in replica 1's slice"),
    (lambda s: s[1].contributions[0].__setitem__(0, 2), 1,
     "id 2 contributed twice (also in step 0)"),
    (lambda s: s[0].contributions.__setitem__(7, []), 0, "not an initial replica"),
    (lambda s: setattr(s[0], "divisor", None), 0, "divisor None is not a positive integer"),
])
def test_each_violation_is_named_at_its_step(mutate, step, text):
    s = steps(*[{r: list(ids) for r, ids in c.items()} for c in GOOD])
    mutate(s)
    v = check_records(s, w_init=2, B=4)
    assert v and v[0].step == step and text in v[0].message, v


def test_cursor_moving_back_is_caught():
    s = steps({0: [4, 6], 1: [1, 3]}, {0: [0, 2], 1: [5, 7]})
    v = check_records(s, w_init=2, B=4)
    assert v[0].step == 1 and "slice cursor moved back" in v[0].message


def test_adaptive_divisor_is_the_count():
    s = {0: StepRecord(step=0, contributions={0: [0, 2], 1: [1, 3]}, divisor=4),
         1: StepRecord(step=1, contributions={0: [4, 6]}, divisor=2)}
    assert check_records(s, w_init=2, B=4, policy="adaptive") == []
    assert check_records(s, w_init=2, B=4, policy="static")[0].message.startswith("divisor 2 != B")


def test_first_only_and_missing_first_steps():
    s = {2: StepRecord(step=2, contributions={0: [0, 2], 1: [1, 3]}, divisor=4)}
    v = check_records(s, w_init=2, B=4, first_only=True)
    assert len(v) == 1 and v[0].step == 0 and "step 0..1 never committed" in v[0].message


def test_tolerance_window_and_overrides():
    tol = Tolerance(c=0.1, c_rms=1e-3, floor=1e-7)
    for lr in (3e-4, 4e-4):
        tol.add_step(lr)
    assert tol.element == pytest.approx(0.1 * 5e-4 + 1e-7)
    assert tol.bulk == pytest.approx(1e-3 * 5e-4 + 1e-7)
    tol.reset_window()
    assert tol.element == pytest.approx(1e-7)
    fixed = Tolerance(atol=1e-5, rms_atol=math.inf)
    fixed.add_step(1.0)
    assert fixed.element == 1e-5 and fixed.bulk == math.inf
    assert ulp_floor(0.5) == ulp_floor(1.0) < ulp_floor(4.0)
    with pytest.raises(ValueError):
        Tolerance(c=-1)
