"""The nccl data plane: the gloo plane's monitor and generations on ProcessGroupNCCL.

Differences from gloo (hsdp/dataplane/gloo.py), from the facts in docs/dataplane.md:

* non-blocking communicators (``Options.config.blocking = False``) and
  ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` set to the plane's timeout before the first NCCL call (its
  default, 1800 s, bounds every ``ncclInProgress`` poll: init, collectives, finalize), so that
  ``abort()`` is safe and bounded;
* an op the monitor gives up (a failure known to the control plane, an async NCCL error, the
  timeout) ABORTS its generation (``ncclCommAbort`` on every comm of it, in a thread: a hung
  abort must not block the survivors' recovery), after which NCCL writes nothing more: the
  bucket is reduced in place, no staging copy;
* a bucket's reduction is ordered after the stream that accumulated it by ProcessGroupNCCL
  itself (its stream waits on the current stream at the post).

NOT RUN ON A GPU YET: one H200 cannot host two ranks of one NCCL communicator, so the lent
machine cannot run it (docs/gpu.md). Unit-tested up to the NCCL calls with CPU stand-ins
(tests/unit/test_dataplane.py).
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

from recover_hsdp.hsdp.dataplane.gloo import GlooPlane, _Generation

ENV_NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def nccl_options(timeout_s: float, options_cls=None):
    """ProcessGroupNCCL.Options for the plane: non-blocking comms, the plane's timeout."""
    if options_cls is None:
        import torch.distributed as dist

        options_cls = dist.ProcessGroupNCCL.Options
    opts = options_cls()
    opts.config.blocking = False
    opts._timeout = timedelta(seconds=timeout_s)
    return opts


class NcclPlane(GlooPlane):
    name = "nccl"
    stages = False   # abort() stops every write: the bucket is reduced in place

    def __init__(self, cross, **kw):
        super().__init__(cross, **kw)
        # read once per process by torch, before the first NCCL call: bound every poll
        os.environ.setdefault(ENV_NONBLOCKING_TIMEOUT, str(max(1, int(self.timeout_s))))
        self.aborts: list[threading.Thread] = []

    @staticmethod
    def _new_pg(store, rank: int, size: int, timeout_s: float):
        import torch.distributed as dist

        return dist.ProcessGroupNCCL(store, rank, size, nccl_options(timeout_s))

    def _device(self):
        """A join's tensors travel in this rank's GPU memory (NCCL moves device tensors only)."""
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def _give_up(self, gen: _Generation) -> None:
        """Abort the generation's communicators off the critical path (bounded by the
        non-blocking timeout inside torch; a hung abort only holds its own thread)."""
        pg = gen.pg
        if pg is None:
            return

        def abort():
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - already broken: nothing more to stop
                pass
        t = threading.Thread(target=abort, daemon=True, name="rh-dp-nccl-abort")
        t.start()
        self.aborts.append(t)
