"""The torch side of the test-only fault seam (recover_hsdp/faults/seam.py says what and why).

`RunFaults.from_env()` is None unless the seam is set AND allowed; the manager then calls
`contribute`, `after_microbatch` and `before_reduce` at the three points a fault can enter.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from recover_hsdp.faults.seam import TestFault, from_env


class RunFaults:
    def __init__(self, faults: list[TestFault]):
        self.faults = list(faults)
        self._prev: Optional[torch.Tensor] = None   # stale_bucket: last step's local bucket 0
        self.fired: list[tuple[str, int]] = []

    @classmethod
    def from_env(cls) -> Optional["RunFaults"]:
        faults = from_env()
        if not faults:
            return None
        print(f"recover-hsdp: TEST FAULT SEAM ACTIVE: {faults} (this run commits wrong steps)",
              file=sys.stderr, flush=True)
        return cls(faults)

    def _get(self, kind: str, step: int, replica: int) -> Optional[TestFault]:
        for f in self.faults:
            if f.kind == kind and f.step == step and f.replica == replica:
                return f
        return None

    def _first_kept(self, mgr, m: int) -> bool:
        return all(not mgr.policy.keeps(mgr.replica, k) for k in range(m))

    def contribute(self, mgr, step: int, m: int, keep: bool) -> bool:
        """drop_mb: the replica's first kept microbatch runs but is left out of the sum."""
        if keep and self._get("drop_mb", step, mgr.replica) and self._first_kept(mgr, m):
            self.fired.append(("drop_mb", step))
            return False
        return keep

    def after_microbatch(self, mgr, step: int, m: int, keep: bool, mb_id: int) -> None:
        """double_mb: train the same id again; extra_mb: train an unrecorded id of the slice."""
        if not keep or not self._first_kept(mgr, m):
            return
        if self._get("double_mb", step, mgr.replica):
            extra = mb_id
        elif self._get("extra_mb", step, mgr.replica):
            extra = mgr.data.microbatch_id(mgr.replica, mgr.policy.steps())  # next step's first
        else:
            return
        self.fired.append(("double_mb" if extra == mb_id else "extra_mb", step))
        x, y = mgr.microbatch_fn(mgr.replica, extra)
        x, y = mgr._rows(x).to(mgr.device), mgr._rows(y).to(mgr.device)
        mgr.acc.microbatch(lambda: mgr.loss_fn(mgr.module, x, y) / mgr.S, contribute=True)

    def before_reduce(self, mgr, step: int, buckets: list) -> None:
        """stale_bucket: bucket 0's local shard becomes the previous step's (then reduced)."""
        if not buckets:
            return
        if self._get("stale_bucket", step, mgr.replica) and self._prev is not None:
            self.fired.append(("stale_bucket", step))
            with torch.no_grad():
                buckets[0].copy_(self._prev)
        if self._get("stale_bucket", step + 1, mgr.replica):
            self._prev = buckets[0].detach().clone()
