"""The test side of the test gate (recover_hsdp/faults/gate.py): hold a job at a step, act,
release. Order is decided by the markers the ranks write, never by a sleep.

    gate = TestGate(tmp_path / "gate", hold=[5], ranks=range(4))
    env.update(gate.env())                               # before the launch
    p = start(...)
    gate.wait_held(5, dl, alive=lambda: p.poll() is None)   # every rank holds before step 5
    os.kill(pid_of_rank_3, signal.SIGKILL)               # act
    gate.release(5)                                      # let the job go on
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

from recover_hsdp.faults.gate import HOLDS, marker, release_file
from recover_hsdp.faults.seam import ENV_ALLOW, ENV_GATE
from tests._wait import until


class TestGate:
    __test__ = False  # not a pytest class

    def __init__(self, d: Path, hold: Iterable[int] = (), ranks: Iterable[int] = (),
                 timeout_s: float = 120.0, chatter_bytes: int = 0):
        self.dir = Path(d)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ranks = sorted(int(r) for r in ranks)
        self.holds = sorted(int(s) for s in hold)
        (self.dir / HOLDS).write_text(json.dumps({"steps": self.holds,
                                                  "timeout_s": float(timeout_s),
                                                  "chatter_bytes": int(chatter_bytes)}))

    def env(self) -> dict[str, str]:
        return {ENV_GATE: str(self.dir), ENV_ALLOW: "1"}

    def reached(self, step: int, ranks: Optional[Iterable[int]] = None) -> bool:
        """Every rank of ``ranks`` (default: all) reached the boundary before ``step``."""
        return all(marker(self.dir, step, g).exists()
                   for g in (self.ranks if ranks is None else ranks))

    def wait_held(self, step: int, deadline, *, ranks: Optional[Iterable[int]] = None,
                  alive: Optional[Callable[[], bool]] = None,
                  detail: Optional[Callable[[], str]] = None) -> None:
        """Wait until every rank of ``ranks`` stands at the boundary before ``step`` (held
        there when ``step`` is a hold). Fails early if ``alive()`` turns False."""
        rs = list(self.ranks if ranks is None else ranks)
        until(lambda: self.reached(step, rs), deadline,
              f"ranks {rs} at the gate before step {step}", alive=alive, detail=detail)

    def release(self, step: int) -> None:
        assert step in self.holds, f"step {step} is not held (holds: {self.holds})"
        release_file(self.dir, step).write_text("go\n")
