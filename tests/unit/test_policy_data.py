"""DataAssignment: disjoint slices, computed ids consumed, contributed ids = kept positions."""
from __future__ import annotations

import pytest

from recover_hsdp.policy import DataAssignment, PolicyError, StaticWorldPolicy

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_slices_and_cursors():
    pol, data = StaticWorldPolicy(4, 3), DataAssignment(4)
    assert [data.microbatch_id(2, p) for p in range(3)] == [2, 6, 10]
    ids = data.commit(pol)
    assert ids == {0: (0, 4, 8), 1: (1, 5, 9), 2: (2, 6, 10), 3: (3, 7, 11)}
    pol.after_commit()
    assert data.cursor(2) == 3 and data.microbatch_id(2, 0) == 14
    assert data.owner(14) == 2


def test_spares_and_minors_consume_without_contributing():
    pol, data = StaticWorldPolicy(4, 3), DataAssignment(4)   # B = 12
    data.commit(pol)
    pol.after_commit()
    pol.fail([3])
    ids = data.commit(pol)            # boundary: 3 survivors, C = 9, g_ext = 1, no boundary minor
    assert sum(map(len, ids.values())) == 12 and 3 not in ids
    pol.after_commit()
    assert pol.layout.g == 4
    with pytest.raises(PolicyError, match="no slice"):
        data.microbatch_id(3, 0)       # the dead replica's slice is dropped
    # every survivor computed 4 microbatches in the boundary step: cursors moved by 4
    assert data.cursor(0) == 3 + 4


def test_minor_contributes_its_prefix_only():
    pol, data = StaticWorldPolicy(32, 8), DataAssignment(32)
    pol.fail([31])
    data.commit(pol)
    pol.after_commit()                # 28 majors, minor 28 at r = 4, spares 29, 30
    k0 = data.cursor(28)
    ids = data.commit(pol)
    assert ids[28] == tuple((k0 + p) * 32 + 28 for p in range(4))
    assert ids[29] == () and ids[30] == ()
    assert data.cursor(28) == k0 + 9  # but it computed all 9


def test_kept_before_tracks_set_contributed():
    pol = StaticWorldPolicy(32, 8)
    pol.fail([31])
    pol.after_commit()
    pol.fail([28])                 # minor dies, minor-spare 30 promoted
    pol.after_commit()
    pol.fail([30])                 # the new minor dies: the major-spare 29 is discarded
    assert pol.discarded() == {29}
    assert [pol.kept_before(29, m) for m in (0, 9, 10)] == [0, 0, pol.accumulate_quota(29)]
    assert [pol.kept_before(0, m) for m in (0, 4, 9, 10)] == [0, 4, 9, pol.accumulate_quota(0)]
