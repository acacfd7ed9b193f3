"""The middle protocol layer: the per-iteration transaction (docs/recovery.md).

`StepTxnOrchestrator` snapshots every gradient bucket before its cross-replica reduction, tags it
with the group's world epoch, and after a failure rewinds exactly the buckets whose content is no
longer a sum under the current membership (algorithms 4 and 5 of the paper), so a committed step
always sums the policy's microbatches under ONE membership.
"""
from recover_hsdp.recovery.orchestrator import (IterationLog, RecoveryProtocolError,
                                                StepTxnOrchestrator, TxnStats, Verdict)
from recover_hsdp.recovery.snapshots import (CPU_REWIND_DEFAULT, Bucket, Content, Rewinder,
                                             SnapshotStore)

__all__ = [
    "CPU_REWIND_DEFAULT", "Bucket", "Content", "IterationLog", "RecoveryProtocolError",
    "Rewinder", "SnapshotStore", "StepTxnOrchestrator", "TxnStats", "Verdict",
]
