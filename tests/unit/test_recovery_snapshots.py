"""SnapshotStore and the rewind engines (recover_hsdp/recovery/snapshots.py)."""
from __future__ import annotations

import pytest
import torch

from recover_hsdp.recovery import Content, Rewinder, SnapshotStore
from tests import _procs

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_one_buffer_per_bucket_reused_and_snapshot_taken_once_per_content():
    store = SnapshotStore()
    a, b = torch.randn(5), torch.randn(3)
    for _ in range(3):
        ba, bb = store.bind(0, a), store.bind(1, b)
        ba.snap_valid = bb.snap_valid = False  # new iteration: new local content
        store.snapshot(ba, 0)
        store.snapshot(ba, 1)  # re-tag only: the content did not change
        store.snapshot(bb, 0)
    assert store.allocations == 2
    assert store.snapshots_taken == 6
    assert ba.snap_epoch == 1 and torch.equal(ba.snap, a)
    assert store.nbytes() == store.grad_nbytes() == 8 * 4
    # a new shape (or dtype) reallocates exactly that bucket's buffer
    store.bind(1, torch.zeros(4, dtype=torch.float64))
    assert store.allocations == 3 and store.nbytes() == 5 * 4 + 4 * 8
    with pytest.raises(IndexError):
        store.bind(5, a)


def test_bucket_reduced_at():
    store = SnapshotStore()
    bk = store.bind(0, torch.zeros(2))
    assert bk.content is Content.LOCAL and not bk.reduced_at(0)
    bk.content, bk.epoch = Content.REDUCED, 3
    assert bk.reduced_at(3) and not bk.reduced_at(4)
    bk.content = Content.UNDEFINED
    assert not bk.reduced_at(3)


@pytest.mark.parametrize("mode", ["copy", "thread", "auto"])
def test_rewind_engines_restore_and_zero(mode):
    dst = [torch.randn(1000) for _ in range(3)]
    src = [torch.randn(1000) for _ in range(2)]
    r = Rewinder(mode)
    used = r.start([(dst[0], src[0]), (dst[1], src[1])], [dst[2]])
    assert used in ("copy", "thread")
    r.wait()
    assert not r.pending
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
    assert not dst[2].any()
    assert r.stats.rewinds == 2 and r.stats.zeroed == 1 and r.stats.bytes == 8000
    r.run_sync([(dst[2], src[0])])
    assert torch.equal(dst[2], src[0])
    r.close()


def test_rewind_nothing_is_a_no_op():
    r = Rewinder("thread")
    assert r.start([], []) == "none" and not r.pending


def test_bad_mode():
    with pytest.raises(ValueError, match="rewind mode"):
        Rewinder("gpu")


def test_recovery_layer_does_not_load_the_collectives_extension():
    import subprocess
    import sys

    code = ("import sys, torch, recover_hsdp.recovery\n"
            "bad = [m for m in sys.modules if m == 'recover_hsdp._C' or "
            "m.startswith('recover_hsdp.collectives.group') or m == 'mpi4py']\n"
            "assert not bad, bad\n")
    _procs.run([sys.executable, "-c", code], check=True, timeout=120)
