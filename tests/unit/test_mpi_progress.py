"""collectives/progress.py: the thread that drives MPI progress while the main thread is outside
MPI (the real effect, an agreement subtree released after its parent's death while the others
wait in gloo, is the gloo chaos soak's seed 53 run 9: docs/faults.md)."""
from __future__ import annotations

import threading

import pytest

from recover_hsdp.collectives.progress import MpiProgress

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


class Group:
    def __init__(self, fail_first: int = 0):
        self.calls = 0
        self.fail_first = fail_first
        self.third = threading.Event()

    def poll_failures(self):
        self.calls += 1
        if self.calls >= 3:
            self.third.set()
        if self.calls <= self.fail_first:
            raise RuntimeError("communicator freed")
        return False, ()


@pytest.mark.parametrize("fail_first", [0, 2])
def test_progress_thread_polls_until_stopped_and_survives_errors(fail_first):
    g = Group(fail_first)
    p = MpiProgress(g, period_s=0.001).start()
    assert g.third.wait(30), "the progress thread never polled three times"
    p.stop()
    assert not p._thread.is_alive()
    assert p.errors == fail_first and p.polls + p.errors == g.calls
    n = g.calls
    p.stop()                       # idempotent; nothing polls after stop
    assert g.calls == n
