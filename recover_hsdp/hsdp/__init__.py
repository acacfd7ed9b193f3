"""HSDP integration: FSDP1 HYBRID_SHARD with a deferred, fault-tolerant cross-replica reduction.

`HSDPULFMTrainingManager` is the public face (also `from recover_hsdp import
HSDPULFMTrainingManager`); `fsdp_hybrid` holds the FSDP plumbing, `cross_replica` the agreement
over the S replicate groups, `trainer` the per-rank worker behind `recover-hsdp train`.
"""
import torch  # noqa: F401  (registration below needs torch loaded)

from recover_hsdp.collectives import register_backend

register_backend()

from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager  # noqa: E402,F401
