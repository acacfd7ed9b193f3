"""The test gate (recover_hsdp/faults/gate.py): a marker per boundary, a hold until released,
a bound on the hold, refused without the allow variable."""
from __future__ import annotations

import threading

import pytest

from recover_hsdp.faults import gate as g
from recover_hsdp.faults.seam import ENV_ALLOW, ENV_GATE, refusal
from tests._gate import TestGate
from tests._wait import Deadline, until

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_marker_per_boundary_and_no_hold_elsewhere(tmp_path):
    t = TestGate(tmp_path, hold=[3], ranks=[0])
    r = g.Gate(tmp_path, rank=0)
    for s in (0, 1, 2):
        r.before_step(s)             # not held: returns at once
    assert t.reached(2) and not t.reached(3)


def test_hold_until_released(tmp_path):
    t = TestGate(tmp_path, hold=[1], ranks=[0, 1])
    ranks = [g.Gate(tmp_path, rank=k) for k in (0, 1)]
    passed = []

    def run(k):
        ranks[k].before_step(1)
        passed.append(k)

    th = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for x in th:
        x.start()
    t.wait_held(1, Deadline(30))
    assert passed == []              # both stand at the gate: neither may pass before release
    t.release(1)
    for x in th:
        x.join(30)
    assert not any(x.is_alive() for x in th), "a rank still held after the release"
    assert sorted(passed) == [0, 1]


def test_unreleased_hold_fails_in_bounded_time(tmp_path):
    TestGate(tmp_path, hold=[0], ranks=[0], timeout_s=0.2)
    with pytest.raises(g.GateTimeout, match="step 0 not released within 0.2 s"):
        g.Gate(tmp_path, rank=0).before_step(0)


def test_refused_without_allow(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_GATE, str(tmp_path))
    monkeypatch.delenv(ENV_ALLOW, raising=False)
    assert "test-only gate" in refusal()
    with pytest.raises(RuntimeError, match=ENV_ALLOW):
        g.Gate.from_env(0)
    monkeypatch.setenv(ENV_ALLOW, "1")
    assert refusal() is None and g.Gate.from_env(0) is not None


def test_until_fails_early_when_the_process_ended():
    with pytest.raises(AssertionError, match="ended before the thing"):
        until(lambda: False, Deadline(60), "the thing", alive=lambda: False)
