"""The replicate data plane: how gradient bytes cross replicas (docs/dataplane.md).

ULFM is the control plane (detection, agreement, revoke/shrink, the election, the boundary
decision: hsdp/cross_replica.py). The data plane only moves bucket sums over the agreed
membership, chosen by ``parallel.replicate_data_plane``:

* ``ulfm``  the default and the card's shape: each bucket on the C++ ULFM backend (a Detect
  agreement, then a blocking MPI_Allreduce; spares' contributions zeroed inside).
* ``gloo``  ProcessGroupGloo per (replicate group j, membership) on a PrefixStore of the
  launcher-hosted store: asynchronous, every bucket posted at once, waited on under a monitor
  that abandons it when the control plane knows of a failure (dataplane/gloo.py).
* ``nccl``  the same on ProcessGroupNCCL (non-blocking communicators, ``abort()`` on a known
  failure; dataplane/nccl.py).

This function is the one place a plane is chosen; nothing else in the package tree branches on
the name.
"""
from __future__ import annotations

from recover_hsdp.hsdp.dataplane.base import (DataPlane, DataPlaneError, DataPlaneWork,
                                              DoneWork)

PLANES: tuple[str, ...] = ("ulfm", "gloo", "nccl")

__all__ = ["PLANES", "DataPlane", "DataPlaneError", "DataPlaneWork", "DoneWork",
           "make_data_plane"]


def make_data_plane(name: str, cross, **kw) -> DataPlane:
    """The data plane ``name`` for the cross-replica group ``cross`` (hsdp/cross_replica.py).
    ``kw`` go to an async plane (timeout_s, poll_s, log; the ulfm plane takes none). Unknown name: ValueError naming the
    key and the choices."""
    if name == "ulfm":
        from recover_hsdp.hsdp.dataplane.ulfm import UlfmPlane

        return UlfmPlane(cross)
    if name == "gloo":
        from recover_hsdp.hsdp.dataplane.gloo import GlooPlane

        return GlooPlane(cross, **kw)
    if name == "nccl":
        from recover_hsdp.hsdp.dataplane.nccl import NcclPlane

        return NcclPlane(cross, **kw)
    raise ValueError(f"parallel.replicate_data_plane({name!r}) must be one of "
                     f"{', '.join(PLANES)}")
