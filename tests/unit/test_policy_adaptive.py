"""AdaptiveWorldPolicy (algorithm 8): repair and continue, the batch shrinks with the world."""
from __future__ import annotations

from recover_hsdp.policy import (AdaptiveWorldPolicy, DataAssignment, Layout, PolicyDecision,
                                 RestoreMode)
from recover_hsdp.types import Role

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_adaptive_shrinks_the_batch():
    pol, data = AdaptiveWorldPolicy(32, 8), DataAssignment(32)
    assert pol.divisor() == 256 and pol.steps() == 8
    ev = pol.expected_event([31])
    assert ev.at_boundary  # what the backend reports: a major died, no spare
    dec = pol.on_failure(ev)
    assert dec == PolicyDecision(RestoreMode.BLOCKING, False)  # algorithm 8 ignores it
    assert pol.steps() == 8 and pol.divisor() == 31 * 8 == pol.committed()
    ids = data.commit(pol)
    assert sum(map(len, ids.values())) == 248
    pol.after_commit()
    assert pol.layout == Layout(8, 31) and pol.divisor() == 248
    assert set(pol.roles().values()) == {Role.MAJOR}
    pol.fail([0, 1, 2])
    assert pol.divisor() == 28 * 8
    pol.after_commit()
    assert pol.layout == Layout(8, 28)


def test_adaptive_case_b():
    pol = AdaptiveWorldPolicy(4, 2)
    dec = pol.note_failure_after_commit(pol.expected_event([1]))
    assert dec == PolicyDecision(RestoreMode.SKIP, False)
    assert pol.divisor() == 8  # the committed step still had 4 replicas
    pol.after_commit()
    assert pol.divisor() == 6 and pol.alive == (0, 2, 3)
