"""The test gate: hold a running job at a step boundary so a test acts at a KNOWN point.

TEST ONLY, off by default. ``RECOVER_HSDP_TEST_GATE=DIR`` is honoured only with
``RECOVER_HSDP_ALLOW_TEST_FAULT=1`` (the seam's allow variable); a rank that sees the first
without the second refuses to start (one line), and `recover-hsdp train` refuses it up front.

At the start of ``HSDPULFMTrainingManager.train_step`` for step ``s`` (so: steps < s committed,
and whatever the loop did after step s-1 - the record, a save, a stop check - done) every rank
writes the marker ``DIR/before.step{s}.rank{g}``. If ``s`` is listed in ``DIR/holds.json``
(``{"steps": [s, ...], "timeout_s": T}``, written by the test before the launch), the rank then
waits until ``DIR/release.step{s}`` exists: inside an announced long phase (the hang watchdog
does not judge it), bounded by ``T`` (default 120 s), after which the rank fail-stops with
GateTimeout (a test that forgot to release fails in bounded time). The heartbeat keeps beating
while held, so a SIGSTOP or SIGKILL sent then is judged exactly as in a free run.

Every rank holds at the same step, so no collective is in flight while held: the test acts
(SIGKILL a rank or the job, SIGSTOP, SIGUSR1 to the launcher), waits for the effect it needs,
then releases. The job can neither pass the point early nor end before the action lands.
The test side is tests/_gate.py.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from recover_hsdp.faults.seam import ENV_GATE, refusal

HOLDS = "holds.json"
DEFAULT_TIMEOUT_S = 120.0
#: how often a held rank looks for its release (pacing only: the release file decides)
PACE_S = 0.01


class GateTimeout(RuntimeError):
    """A held step was not released within the gate's bound."""


def marker(d: os.PathLike | str, step: int, rank: int) -> Path:
    return Path(d) / f"before.step{int(step)}.rank{int(rank)}"


def release_file(d: os.PathLike | str, step: int) -> Path:
    return Path(d) / f"release.step{int(step)}"


class Gate:
    """The rank side; ``Gate.from_env()`` is None unless the gate is set and allowed."""

    def __init__(self, d: os.PathLike | str, rank: int):
        self.dir = Path(d)
        self.rank = int(rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            spec = json.loads((self.dir / HOLDS).read_text())
        except FileNotFoundError:
            spec = {}
        self.holds = {int(s) for s in spec.get("steps", ())}
        self.timeout_s = float(spec.get("timeout_s") or DEFAULT_TIMEOUT_S)
        # bytes each rank prints to stdout at every boundary after the first hold (a test of a
        # launcher daemon that stopped reading: more than a pipe holds must not wedge a rank)
        self.chatter = int(spec.get("chatter_bytes") or 0)

    @classmethod
    def from_env(cls, rank: int) -> Optional["Gate"]:
        why = refusal()       # faults/seam.py: the gate without the allow variable
        if why:
            raise RuntimeError(why)
        d = os.environ.get(ENV_GATE)
        return cls(d, rank) if d else None

    def before_step(self, step: int) -> None:
        """Mark the boundary; hold here when the test asked for this step."""
        m = marker(self.dir, step, self.rank)
        tmp = m.with_name(m.name + f".tmp{os.getpid()}")
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, m)
        if self.chatter and self.holds and step > min(self.holds):
            line = f"[gate chatter] rank {self.rank} step {step} " + "x" * 1000 + "\n"
            sys.stdout.write(line * max(1, self.chatter // len(line)))
            sys.stdout.flush()
        if step not in self.holds:
            return
        from recover_hsdp.faults import failstop

        rel = release_file(self.dir, step)
        end = time.monotonic() + self.timeout_s
        with failstop.long_phase("test gate", self.timeout_s):
            while not rel.exists():
                if time.monotonic() >= end:
                    raise GateTimeout(f"test gate: step {step} not released within "
                                      f"{self.timeout_s:g} s ({rel})")
                time.sleep(PACE_S)
