"""FSDP1 HYBRID_SHARD wrapping with the cross-replica reduction deferred (split out of
fsdp_hybrid.py, whose docstring states the invariants; ``recover_hsdp.hsdp.fsdp_hybrid``
re-exports the public names).

* FSDP never moves a byte across replicas: every FSDP state's replicate group is a
  :class:`NoOpReplicateGroup` (the per-backward ``all_reduce`` on it is a counted no-op, any other
  collective raises :class:`DeferredReductionViolation`).
* FSDP never divides: both gradient divide factors are 1 on every state
  (:func:`assert_divide_stripped`).
* Every FSDP private attribute touched is listed here and checked at wrap time against the torch
  version this was verified on (:data:`VERIFIED_TORCH`, :func:`check_torch_version`).
"""
from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

from recover_hsdp.hsdp.topology import HybridTopology

#: torch minor versions whose FSDP1 internals were read and tested against this module.
VERIFIED_TORCH: tuple[str, ...] = ("2.11", "2.12", "2.13")
#: Set to 1 to run on an unverified torch anyway (you own the consequences).
ENV_ALLOW_UNVERIFIED = "RECOVER_HSDP_ALLOW_UNVERIFIED_TORCH"


class UnsupportedTorchError(RuntimeError):
    """The installed torch was not verified against the FSDP internals this module touches."""


class DeferredReductionViolation(RuntimeError):
    """Something tried to communicate across replicas through FSDP's replicate group."""


def check_torch_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTorchError` unless torch's major.minor is in VERIFIED_TORCH."""
    version = version or torch.__version__
    if ".".join(version.split("+")[0].split(".")[:2]) in VERIFIED_TORCH:
        return
    if os.environ.get(ENV_ALLOW_UNVERIFIED) == "1":
        return
    raise UnsupportedTorchError(
        f"recover_hsdp.hsdp.fsdp_hybrid touches FSDP1 private attributes verified on torch "
        f"{'/'.join(VERIFIED_TORCH)}.x only, found torch {version}. Re-read "
        f"torch/distributed/fsdp/_runtime_utils.py::_reduce_grad and _init_utils.py (see "
        f"docs/hsdp.md), update VERIFIED_TORCH, or set {ENV_ALLOW_UNVERIFIED}=1 to override."
    )


from recover_hsdp.hsdp._torch_compat import check_fsdp_internals  # noqa: E402

check_fsdp_internals(UnsupportedTorchError)  # every private FSDP1 name used here, at import


def check_param_padding_value() -> None:
    """The layout's PARAM_PADDING_VALUE (a constant, so verify needs no FSDP) is torch's."""
    from torch.distributed.fsdp._flat_param import _FLAT_PARAM_PADDING_VALUE

    from recover_hsdp.hsdp.layout import PARAM_PADDING_VALUE

    if float(_FLAT_PARAM_PADDING_VALUE) != PARAM_PADDING_VALUE:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} pads flat parameters with {_FLAT_PARAM_PADDING_VALUE!r}, "
            f"recover_hsdp.hsdp.layout.PARAM_PADDING_VALUE is {PARAM_PADDING_VALUE!r}: update it")


check_param_padding_value()  # before any rank writes a snapshot the verifier compares


# --------------------------------------------------------------------------------------------
# The no-op replicate group handed to FSDP
# --------------------------------------------------------------------------------------------
class _CompletedWork(dist.Work):
    """A Work that is already done (what FSDP's synchronous all_reduce waits on)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut


class NoOpReplicateGroup(dist.ProcessGroup):
    """Stand-in for FSDP's ``_inter_node_pg``: FSDP sees the right size/rank, no bytes move.

    ``size`` = number of replicas and ``rank`` = this replica's index (what FSDP's init reads).
    ``allreduce`` is the one op FSDP issues on it (``_reduce_grad`` after every reduce-scatter): it
    is counted in ``calls`` and leaves the tensor untouched. Every other collective is counted and
    raises :class:`DeferredReductionViolation` (e.g. ``sync_module_states``'s broadcast). Ops that
    torch.distributed resolves through its group map (broadcast, all_gather, barrier, ...) raise
    ValueError before reaching here because this group is deliberately not registered.
    """

    ALLOWED = frozenset({"allreduce"})

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self.calls: Counter[str] = Counter()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "recover_hsdp_noop"

    def _refuse(self, op: str) -> None:
        self.calls[op] += 1
        raise DeferredReductionViolation(
            f"{op} reached FSDP's no-op replicate group: cross-replica traffic must go through "
            f"the deferred reduction after the microbatch loop"
        )

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        self.calls["allreduce"] += 1
        return _CompletedWork(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors])

    def allreduce_coalesced(self, *a, **k):  # type: ignore[override]
        self._refuse("allreduce_coalesced")

    def broadcast(self, *a, **k):  # type: ignore[override]
        self._refuse("broadcast")

    def allgather(self, *a, **k):  # type: ignore[override]
        self._refuse("allgather")

    def _allgather_base(self, *a, **k):  # type: ignore[override]
        self._refuse("_allgather_base")

    def reduce_scatter(self, *a, **k):  # type: ignore[override]
        self._refuse("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):  # type: ignore[override]
        self._refuse("_reduce_scatter_base")

    def barrier(self, *a, **k):  # type: ignore[override]
        self._refuse("barrier")

    def reduce(self, *a, **k):  # type: ignore[override]
        self._refuse("reduce")

    def send(self, *a, **k):  # type: ignore[override]
        self._refuse("send")

    def recv(self, *a, **k):  # type: ignore[override]
        self._refuse("recv")


# --------------------------------------------------------------------------------------------
# Wrapping
# --------------------------------------------------------------------------------------------
# FSDP1 private attributes read or written here; checked on every FSDP state at wrap time.
_STATE_ATTRS = ("_inter_node_pg", "_gradient_predivide_factor", "_gradient_postdivide_factor",
                "_handle", "process_group", "sharding_strategy")
_FLAT_PARAM_ATTRS = ("_fqns", "_shapes", "_numels", "_numels_with_padding", "_is_padding_mask",
                     "_unpadded_unsharded_size")


def bf16_mixed_precision() -> MixedPrecision:
    """The GPU recipe: bf16 compute and all-gather, fp32 reduce-scatter, fp32 grad shards.

    Buffers keep their dtype (e.g. rotary tables stay fp32); the fp32 master parameters and the
    fp32 accumulated shards are what the optimizer and the recovery layer see.
    """
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                          buffer_dtype=None)


def fsdp_states(fsdp_module: nn.Module) -> list[FSDP]:
    """Every FSDP instance under (and including) ``fsdp_module``, module pre-order."""
    return [m for m in fsdp_module.modules() if isinstance(m, FSDP)]


def wrap_hybrid_shard(
    module: nn.Module,
    shard_pg: dist.ProcessGroup,
    *,
    auto_wrap_policy: Any,
    device: torch.device | str,
    mixed_precision: MixedPrecision | None = None,
    use_orig_params: bool = True,
    topology: HybridTopology | None = None,
    **fsdp_kwargs: Any,
) -> FSDP:
    """Wrap ``module`` in FSDP1 HYBRID_SHARD with deferred, undivided cross-replica reduction.

    ``module``'s parameters must be identical on every rank (initialise from one seed; on CPU
    ``sync_module_states`` is refused and it would need the replicate group anyway).
    ``topology`` defaults to (world // shard size, shard size, global rank) -- contiguous replicas.
    ``mixed_precision`` must reduce in fp32 and keep fp32 grads (see :func:`bf16_mixed_precision`).
    Extra keyword arguments go to FSDP (not ``process_group``/``sharding_strategy``/``device_mesh``/
    ``sync_module_states``). The returned module carries ``_recover_noop_pg`` (the
    :class:`NoOpReplicateGroup`, for assertions) and ``_recover_default_divide`` (FSDP's factors
    before stripping, for tests that prove the stripping matters).
    """
    check_torch_version()
    for key in ("process_group", "sharding_strategy", "device_mesh", "sync_module_states"):
        if fsdp_kwargs.get(key):
            raise ValueError(f"wrap_hybrid_shard sets {key} itself; do not pass it")
        fsdp_kwargs.pop(key, None)
    if mixed_precision is not None:
        if mixed_precision.reduce_dtype not in (None, torch.float32) or (
            mixed_precision.reduce_dtype is None
            and mixed_precision.param_dtype not in (None, torch.float32)
        ):
            raise ValueError(
                f"mixed_precision.reduce_dtype must be torch.float32 (got "
                f"{mixed_precision.reduce_dtype}, param_dtype {mixed_precision.param_dtype}): "
                f"the grad shards are the fp32 buckets the recovery layer snapshots and reduces"
            )
        if mixed_precision.keep_low_precision_grads:
            raise ValueError("mixed_precision.keep_low_precision_grads must be False")
    if topology is None:
        topology = HybridTopology.for_world(
            dist.get_world_size() // shard_pg.size(), shard_pg.size(), dist.get_rank(),
            dist.get_world_size(),
        )
    if shard_pg.size() != topology.shard_size or shard_pg.rank() != topology.shard_index:
        raise ValueError(
            f"shard group (size {shard_pg.size()}, rank {shard_pg.rank()}) does not match "
            f"parallel.shard_size({topology.shard_size}) / shard index {topology.shard_index}"
        )
    noop = NoOpReplicateGroup(topology.replica, topology.replicas)
    device = torch.device(device)
    with warnings.catch_warnings():
        # Shard size 1: FSDP clamps HYBRID_SHARD to NO_SHARD (expected; buckets are then the
        # whole flat gradient and FSDP never even calls the replicate group).
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        fsdp = FSDP(
            module,
            process_group=(shard_pg, noop),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=auto_wrap_policy,
            device_id=device,
            mixed_precision=mixed_precision,
            use_orig_params=use_orig_params,
            sync_module_states=False,
            **fsdp_kwargs,
        )
    defaults = set()
    for state in fsdp_states(fsdp):
        missing = [a for a in _STATE_ATTRS if not hasattr(state, a)]
        if missing:
            raise UnsupportedTorchError(f"FSDP state lacks {missing} (torch {torch.__version__})")
        if state._inter_node_pg is not noop:
            raise RuntimeError("an FSDP unit did not inherit the no-op replicate group")
        defaults.add((state._gradient_predivide_factor, state._gradient_postdivide_factor))
        # FSDP divides by shard_size * replicas (pre: before reduce-scatter, post: after its
        # cross-replica all-reduce); the manager divides once by the fixed B instead.
        state._gradient_predivide_factor = 1.0
        state._gradient_postdivide_factor = 1.0
        if state._handle is not None:
            fp = state._handle.flat_param
            missing = [a for a in _FLAT_PARAM_ATTRS if not hasattr(fp, a)]
            if missing:
                raise UnsupportedTorchError(
                    f"FlatParameter lacks {missing} (torch {torch.__version__})")
    fsdp._recover_noop_pg = noop  # type: ignore[attr-defined]
    fsdp._recover_default_divide = sorted(defaults)  # type: ignore[attr-defined]
    fsdp._recover_topology = topology  # type: ignore[attr-defined]
    return fsdp


def assert_divide_stripped(fsdp_module: nn.Module) -> None:
    """Raise if any FSDP state would divide gradients (cheap; call it once per step if paranoid)."""
    for state in fsdp_states(fsdp_module):
        if (state._gradient_predivide_factor, state._gradient_postdivide_factor) != (1.0, 1.0):
            raise DeferredReductionViolation(
                f"FSDP unit {type(state._fsdp_wrapped_module).__name__} divides gradients "
                f"(pre {state._gradient_predivide_factor}, post "
                f"{state._gradient_postdivide_factor}); wrap with wrap_hybrid_shard"
            )
