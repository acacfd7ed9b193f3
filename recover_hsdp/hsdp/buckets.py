"""The buckets (every FSDP handle's ``flat_param.grad``, in module pre-order) and the microbatch
loop that fills them (split out of fsdp_hybrid.py; ``recover_hsdp.hsdp.fsdp_hybrid``
re-exports the public names). Buckets are mutated IN PLACE only: with ``use_orig_params=True``
the original parameters' ``.grad`` are views into them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


# --------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------
def flat_param_handles(fsdp_module: nn.Module) -> list[tuple[str, Any]]:
    """(clean module fqn, FlatParamHandle) for every FSDP unit with parameters, pre-order."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    out = []
    for name, m in fsdp_module.named_modules():
        if isinstance(m, FSDP) and m._handle is not None:
            out.append((clean_tensor_name(name), m._handle))
    return out


def grad_shards(fsdp_module: nn.Module) -> list[torch.Tensor]:
    """This rank's accumulated gradient shard of every FSDP unit: the buckets, in pre-order.

    Call after the microbatch loop (FSDP idle). Each is ``flat_param.grad``: 1-D, fp32, this
    rank's padded shard (the full flat gradient when shard size is 1), holding the UNDIVIDED sum
    over this replica's contributing microbatches. Mutate in place only. Raises if a unit has no
    gradient (every unit must run backward at least once per step, or replicas would pair
    different buckets).
    """
    out = []
    for name, handle in flat_param_handles(fsdp_module):
        grad = handle.flat_param.grad
        if grad is None:
            raise RuntimeError(
                f"FSDP unit {name or '<root>'!r} has no gradient: run at least one "
                f"forward/backward through every unit before reading the grad shards"
            )
        out.append(grad)
    return out


def grad_shard_names(fsdp_module: nn.Module) -> list[str]:
    """One short label per bucket, same order as :func:`grad_shards` (for logs/snapshots)."""
    handles = flat_param_handles(fsdp_module)
    return [f"{i}:{name or '<root>'}" for i, (name, _) in enumerate(handles)]


def allreduce_grad_shards(
    fsdp_module: nn.Module, group: dist.ProcessGroup, divisor: int | float
) -> None:
    """Plain (not fault-tolerant) deferred reduction: SUM each bucket over ``group``, then / divisor.

    The reference the tests use; the ULFM manager does the same per bucket with its own group.
    """
    for shard in grad_shards(fsdp_module):
        dist.all_reduce(shard, group=group)
        shard.div_(divisor)


# --------------------------------------------------------------------------------------------
# Microbatch loop
# --------------------------------------------------------------------------------------------
def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host sync: on CUDA through pinned memory, non-blocking.

    A plain ``.to(cuda)`` from pageable memory waits for the whole stream, so the host would
    stop queueing work once per microbatch. The pinned buffer comes from torch's caching host
    allocator, which keeps it until the copy's stream has passed it. Both the resilient trainer
    and the plain-FSDP baseline use this (a fair ratio in ``bench gpu``).
    """
    if device is None or torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device) if device is not None else t
    return t.pin_memory().to(device, non_blocking=True)


def _sync_is_bookkeeping_only(fsdp_module: FSDP) -> bool:
    """True when FSDP's synced post-backward changes no gradient byte: every unit NO_SHARD (shard
    size 1), parameters in fp32 (no mixed-precision cast of the gradient), no CPU offload."""
    handles = [h for _, h in flat_param_handles(fsdp_module)]
    try:
        return bool(handles) and all(
            not h.uses_sharded_strategy and not h._uses_param_mixed_precision
            and not h._offload_params and h.flat_param.dtype == torch.float32 for h in handles)
    except AttributeError:   # another torch's FlatParamHandle: keep FSDP's own sync
        return False


class MicrobatchAccumulator:
    """Runs one optimizer step's microbatches on an FSDP HYBRID_SHARD module.

    Default ``no_sync=False``: every backward reduce-scatters on the shard group and FSDP adds the
    result into the sharded accumulator (``flat_param.grad``), so memory stays at 1/S of the model's
    gradients and grads accumulate in fp32 even under bf16 compute. ``no_sync=True`` skips the
    reduce-scatter on all but the ``last`` microbatch (FSDP then holds UNSHARDED grads, in the
    compute dtype, between microbatches); see docs/hsdp.md for the measurements behind the default.

    A microbatch with ``contribute=False`` (the replica met its quota, or is a spare) still runs
    forward and backward -- the shard group's collectives stay in lockstep inside the replica --
    but leaves the accumulated shard exactly as it was. With ``no_sync=False`` this is a snapshot
    of the shard before and an in-place restore after (bit-exact, immune to NaN/inf in the
    discarded microbatch); with ``no_sync=True`` the loss is multiplied by 0.0 (a NaN/inf anywhere
    in that microbatch's backward then poisons the accumulated grads: 0 * inf = NaN).

    Shard size 1 (every unit NO_SHARD), fp32 parameters, no CPU offload: the two modes hold the
    same bytes (a NO_SHARD unit's "shard" is its whole gradient, accumulated by autograd in place)
    and give bit-identical buckets, so the default then skips FSDP's post-backward work on every
    microbatch but the ``last`` one (``sync_last_only``): FSDP's per-unit post-backward (the
    reduction over a group of one, the cast, the view bookkeeping) is pure overhead there. The
    snapshot/restore of a discarded microbatch is kept. ``last=None`` (not known) syncs.
    """

    def __init__(self, fsdp_module: FSDP, *, no_sync: bool = False):
        if not isinstance(fsdp_module, FSDP):
            raise TypeError("MicrobatchAccumulator needs the root FSDP module")
        self.module = fsdp_module
        self.no_sync = no_sync
        self.sync_last_only = not no_sync and _sync_is_bookkeeping_only(fsdp_module)
        self.computed = 0      # microbatches run this step
        self.contributed = 0   # of which kept in the accumulated shards

    def reset(self) -> None:
        """Start a new optimizer step (call after zero_grad)."""
        self.computed = 0
        self.contributed = 0

    def microbatch(
        self,
        loss_fn: Callable[[], torch.Tensor],
        *,
        contribute: bool = True,
        last: Optional[bool] = None,
    ) -> torch.Tensor:
        """Run ``loss_fn()`` (forward, returns a scalar loss) and its backward; return loss.detach().

        ``last``: whether this is the last microbatch before the buckets are read. With
        ``no_sync=True`` it is the one that reduce-scatters (None: not last); with
        ``sync_last_only`` the only one FSDP's post-backward runs for (None: it runs). Every
        rank of a replica must make the same calls with the same flags.
        """
        skip_sync = (self.no_sync and not last) or (self.sync_last_only and last is False)
        ctx = self.module.no_sync() if skip_sync else contextlib.nullcontext()
        snapshot = None
        if not contribute and not self.no_sync:
            snapshot = [(h.flat_param, None if h.flat_param.grad is None
                         else h.flat_param.grad.detach().clone())
                        for _, h in flat_param_handles(self.module)]
        with ctx:
            loss = loss_fn()
            (loss if contribute or snapshot is not None else loss * 0.0).backward()
        if snapshot is not None:
            with torch.no_grad():
                for flat_param, saved in snapshot:
                    if flat_param.grad is None:
                        continue
                    if saved is None:
                        flat_param.grad.zero_()
                    else:
                        flat_param.grad.copy_(saved)
        self.computed += 1
        self.contributed += int(contribute)
        return loss.detach()
