"""HSDP integration: FSDP1 HYBRID_SHARD with a deferred, fault-tolerant cross-replica reduction.

`HSDPULFMTrainingManager` is the public face (also `from recover_hsdp import
HSDPULFMTrainingManager`); `fsdp_hybrid` holds the FSDP plumbing, `cross_replica` the agreement
over the S replicate groups, `trainer` the per-rank worker behind `recover-hsdp train`.

The manager (and with it FSDP, ~1.6 CPU-s to import) loads on first use, so a process that needs
only the store or the topology (`recover-hsdp train`'s launcher: ``topology.serve_store``) or the
parameter layout (`recover-hsdp verify`) does not pay for it.
"""
import torch  # noqa: F401  (registration below needs torch loaded)

from recover_hsdp.collectives import register_backend

register_backend()


def __getattr__(name: str):
    if name == "HSDPULFMTrainingManager":
        from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager

        return HSDPULFMTrainingManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
