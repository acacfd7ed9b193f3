"""Fault-tolerant collectives over ULFM MPI: the `ulfm` torch.distributed backend.

Cheap to import (no torch, no extension); `UlfmGroup` & co. load torch and the compiled
extension `recover_hsdp._C` on first access. See docs/collectives.md.

    g = UlfmGroup.from_ranks([0, 2])      # collective over ranks 0 and 2
    res = g.allreduce(t)                  # in-place SUM; res is a UlfmResult (a FailureRecord)
    if not res.ok: ...                    # a peer failed: identical record on every survivor
    res = g.consensus()                   # the iteration's final gate
"""
from __future__ import annotations

from recover_hsdp.collectives._register import BACKEND_NAME, register_backend
from recover_hsdp.collectives.errors import (
    ERR_PROC_FAILED,
    ERR_REVOKED,
    EXIT_UNAVAILABLE,
    UlfmError,
    UlfmUnavailableError,
    exit_on_unavailable,
)

__all__ = [
    "BACKEND_NAME",
    "ERR_PROC_FAILED",
    "ERR_REVOKED",
    "EXIT_UNAVAILABLE",
    "UlfmError",
    "UlfmGroup",
    "UlfmResult",
    "UlfmUnavailableError",
    "cuda_aware_mpi",
    "elect",
    "exit_on_unavailable",
    "register_backend",
    "ulfm_allreduce",
    "ulfm_barrier",
    "ulfm_broadcast",
    "ulfm_consensus",
]

_LAZY = {"UlfmGroup", "UlfmResult", "elect", "ulfm_allreduce", "ulfm_barrier", "ulfm_broadcast",
         "ulfm_consensus"}


def cuda_aware_mpi() -> bool:
    """Whether the MPI the extension was built against passes CUDA pointers (no host staging)."""
    from recover_hsdp.collectives import _ext

    return bool(_ext.load().cuda_aware_mpi())


def __getattr__(name: str):
    if name in _LAZY:
        from recover_hsdp.collectives import group

        return getattr(group, name)
    raise AttributeError(f"module 'recover_hsdp.collectives' has no attribute {name!r}")
