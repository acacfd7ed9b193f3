"""MPI progress while the main thread works outside MPI (docs/faults.md, "The gloo soak's lost
run").

ob1/tcp has no progress thread: a process answers its peers' MPI messages only while one of its
threads is inside an MPI call. ULFM's agreement (ftagree's early-returning agreement) needs that:
when a rank of its tree dies after the root decided and before it passed the decision down, its
subtree asks a surviving ancestor for the decision, and that ancestor answers from its progress
engine. On the gloo/nccl data plane (and at S >= 2 on any plane) the survivors that committed
the step are soon waiting in gloo (an FSDP all-gather with a mate of that very subtree), not in
MPI: nobody answers, the subtree waits for good, and the survivors wait on it. Seen in the gloo
soak (W=4 S=2, seed 53 run 9, reproduced): rank 1 SIGSTOPped inside the end-of-step agreement,
ranks {3, 4, 7} (its subtree) never left it after rank 1's death.

``MpiProgress`` is a daemon thread that drives MPI progress every ``period_s``
(``UlfmGroup.poll_failures``: one MPI_Iprobe on MPI_COMM_SELF, local, no collective; under the
group's own lock, so it waits while the main thread is in an operation on that communicator,
which progresses MPI itself). Stopped at interpreter exit before MPI is finalized.
"""
from __future__ import annotations

import atexit
import threading
from typing import Optional

#: how often the thread drives MPI progress (seconds): an answer to a peer's agreement request
#: comes at most this late; ~20 MPI_Iprobe calls a second cost nothing measurable
DEFAULT_PERIOD_S = 0.05


class MpiProgress:
    def __init__(self, group, period_s: float = DEFAULT_PERIOD_S):
        self.group = group
        self.period_s = float(period_s)
        self.polls = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MpiProgress":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rh-mpi-progress",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.stop)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.group.poll_failures()
                self.polls += 1
            except Exception:  # noqa: BLE001 - a dead or freed communicator: keep quiet
                self.errors += 1

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (at most one poll plus ``timeout_s``)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout_s)
