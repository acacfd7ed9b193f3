"""recover_hsdp: resilient HSDP pre-training on PyTorch FSDP (the ReCoVer protocol).

Every committed optimizer step sums exactly B = W_init x G_init microbatches, all reduced under
one membership of the cross-replica group, and divides by B. Importing the package registers the
`ulfm` torch.distributed backend (the compiled extension itself loads on first use).

Registration needs torch.distributed. When it is already imported it happens here; otherwise a
one-shot import hook registers the backend right after torch.distributed loads, so pure tools such
as `recover-hsdp plan` do not pay for importing torch (recover_hsdp/collectives/_register.py).
"""
from __future__ import annotations

__version__ = "0.1.0"

from recover_hsdp.types import FailureRecord, Role, RoleCensus  # noqa: F401


def _register_backend() -> None:
    try:
        from recover_hsdp.collectives import register_backend
    except ImportError:  # collectives layer not present in this checkout
        return
    register_backend()


_register_backend()


def __getattr__(name: str):
    # The training manager pulls in FSDP; import it only when asked for.
    if name == "HSDPULFMTrainingManager":
        from recover_hsdp.hsdp import HSDPULFMTrainingManager

        return HSDPULFMTrainingManager
    if name == "CustomParts":   # a custom loop's user code, as verify rebuilds it
        from recover_hsdp.record.custom import CustomParts

        return CustomParts
    if name == "record_run":    # a custom loop's run record in one call (docs/custom_loop.md)
        from recover_hsdp.workers.custom import record_run

        return record_run
    if name == "shard_mesh":    # fsdp=2: the mesh a custom loop fully_shards over (docs/fsdp2.md)
        from recover_hsdp.hsdp.substrate import shard_mesh

        return shard_mesh
    raise AttributeError(f"module 'recover_hsdp' has no attribute {name!r}")
