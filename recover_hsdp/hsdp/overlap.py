"""Overlap (``parallel.overlap=true``, async data planes only): the cross-replica reduction of a
bucket is posted from INSIDE the last backward of a pass, as soon as its shard is final.

Where the final shard appears (FSDP1, torch/distributed/fsdp/_runtime_utils.py): in a synced
backward each unit's post-backward reduce-scatters (S >= 2) or keeps (S = 1, NO_SHARD) its
gradient, accumulates it into the unit's shard and then calls the module global
``_post_reduce_grad_callback(state, handle, grad)`` with that final, padded shard (the storage
of ``flat_param.grad`` after the backward). This module wraps that global once (every unit, every
FSDP instance); the wrapper only forwards to a sink while one is installed, i.e. only during the
last microbatch of a pass on a rank whose microbatch is kept. FSDP's own replicate hook is not
used: it runs before accumulation and sees one microbatch.

Order: every rank posts the buckets in ONE fixed order (reverse pre-order: the last decoder
block first, the root last: the order their post-backwards run), so the collectives pair up
whatever each rank's timing; a unit finishing out of that order waits for its predecessors, and a
rank that posts nothing early (its last microbatch is not kept: the shard is restored after the
backward) posts them all after the loop, in the same order. On CUDA the post runs on FSDP's
post-backward stream, so the reduction is ordered after the accumulation by construction.
The first iteration of an orchestrator runs deferred (its buckets are bound then).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

_SINK: Optional[Callable[[Any, Any], None]] = None
_INSTALLED = False


def _install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.distributed.fsdp._runtime_utils as ru

    orig = ru._post_reduce_grad_callback

    def _post_reduce_grad_callback(state, handle, grad_to_offload):
        orig(state, handle, grad_to_offload)
        sink = _SINK
        if sink is not None:
            sink(handle, grad_to_offload)

    ru._post_reduce_grad_callback = _post_reduce_grad_callback
    _INSTALLED = True


class Overlap:
    """The manager's overlap switch: ``microbatch(m, contribute)`` is a context for the
    backward of microbatch m of the current pass."""

    def __init__(self, mgr, enabled: bool):
        self.mgr = mgr
        self.enabled = bool(enabled)
        self.posted_early = 0      # buckets posted from inside a backward (tests, bench)
        if not self.enabled:
            return
        if not getattr(mgr.cross.plane, "is_async", False):
            raise ValueError("parallel.overlap=true needs an async replicate data plane "
                             f"(parallel.replicate_data_plane=gloo or nccl, got "
                             f"{mgr.cross.plane.name})")
        if not mgr.substrate.overlap_ok:
            raise ValueError(f"parallel.overlap=true is not supported at parallel.fsdp="
                             f"{mgr.substrate.fsdp} (FSDP1 only; docs/fsdp2.md)")
        from recover_hsdp.hsdp.buckets import flat_param_handles

        self.handles = [h for _, h in flat_param_handles(mgr.module)]
        self.index = {id(h): i for i, h in enumerate(self.handles)}
        self.order = list(reversed(range(len(self.handles))))
        _install()

    def microbatch(self, last: bool, contribute: bool):
        """``last``: the pass's last microbatch (the manager's one definition of it)."""
        orch = getattr(self.mgr, "orch", None)
        if self.enabled and orch is not None:
            orch.post_order = self.order   # every rank posts in this order, early or not
        if (not self.enabled or orch is None or not contribute or not last
                or len(orch.store) < len(self.handles)):
            return contextlib.nullcontext()
        return self._last_backward(orch)

    @contextlib.contextmanager
    def _last_backward(self, orch):
        global _SINK
        orch.begin_early_posts(self.order)
        ready: dict[int, Any] = {}
        nxt = [0]                       # position in self.order of the next bucket to post
        bucket_index = self.mgr.hooks._bucket_index   # kill points name buckets by index

        def sink(handle, grad) -> None:
            i = self.index.get(id(handle))
            if i is None:
                return
            ready[i] = grad
            while nxt[0] < len(self.order) and self.order[nxt[0]] in ready:
                j = self.order[nxt[0]]
                t = ready.pop(j)
                bucket_index[t.data_ptr()] = j
                orch.post_early(j, t)
                self.posted_early += 1
                nxt[0] += 1

        _SINK = sink
        try:
            yield
        finally:
            _SINK = None
