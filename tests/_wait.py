"""Waits for tests: on the EVENT itself, never on a fixed time that decides an order.

    from tests._wait import Deadline, until, wait_dead

    dl = Deadline(240)                                   # the test's one budget, handed down
    until(lambda: marker.exists(), dl, "step 5 committed", alive=lambda: proc.poll() is None)
    wait_dead(pid, dl, "the SIGKILLed rank")             # pidfd: wakes on the death itself
    proc.communicate(timeout=dl.left())

`until` polls its predicate; the poll period only PACES the loop (the order is decided by the
predicate becoming true, and the loop also ends early when the process it waits on ended first).
It is one of the few waits tests/unit/test_no_fixed_waits.py allows (see ALLOWED there).
"""
from __future__ import annotations

import os
import select
import time
from typing import Callable, Optional

#: how often `until` re-checks its predicate (pacing only: no order depends on it)
PACE_S = 0.02


class Deadline:
    """One wall-clock budget for a whole test, handed down to its inner waits."""

    def __init__(self, seconds: float):
        self.total = float(seconds)
        self.end = time.monotonic() + self.total

    def left(self, floor: float = 0.1) -> float:
        """Seconds left (at least ``floor``, so a subprocess timeout is never 0)."""
        return max(floor, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def sub(self, seconds: float) -> "Deadline":
        """A part of this budget: ``seconds`` or what is left, whichever is smaller."""
        d = Deadline(min(float(seconds), self.left()))
        return d


def _deadline(d) -> Deadline:
    return d if isinstance(d, Deadline) else Deadline(float(d))


def until(pred: Callable[[], object], deadline, what: str, *,
          alive: Optional[Callable[[], bool]] = None,
          detail: Optional[Callable[[], str]] = None):
    """Return pred()'s first truthy value. AssertionError naming ``what`` when the deadline
    passes, or when ``alive()`` turns False first (the process we wait on ended before the
    event: the test would otherwise wait out its whole budget). ``detail()`` adds context
    (an output tail) to the failure."""
    dl = _deadline(deadline)
    while True:
        v = pred()
        if v:
            return v
        if alive is not None and not alive():
            v = pred()          # the event may have come just before the end
            if v:
                return v
            raise AssertionError(f"ended before {what}" + (f":\n{detail()}" if detail else ""))
        if dl.expired():
            raise AssertionError(f"no {what} within {dl.total:.0f} s"
                                 + (f":\n{detail()}" if detail else ""))
        time.sleep(PACE_S)


def wait_dead(pid: int, deadline, what: str = "process") -> None:
    """Block until ``pid`` has exited (a zombie counts: it runs no more), woken by the death
    itself (pidfd), not by a poll. AssertionError at the deadline."""
    dl = _deadline(deadline)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        while True:
            if _not_running(pid):
                return
            r, _, _ = select.select([fd], [], [], dl.left(floor=0.0))
            if r:
                return
            if dl.expired():
                raise AssertionError(f"{what} (pid {pid}) still alive after {dl.total:.0f} s")
    finally:
        os.close(fd)


def _not_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True
