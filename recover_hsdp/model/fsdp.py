"""FSDP glue for the decoder: the wrap unit, the auto-wrap policy, the precision policies.

The HSDP layer wraps with `auto_wrap_policy=fsdp_wrap_policy()` (FSDP1) or calls `fully_shard`
on each of `decoder_blocks(model)` and then the root (FSDP2). Precision: fp32 everywhere on CPU
(`mixed_precision("cpu") is None`); on GPU bf16 parameters/activations for compute, with fp32
gradient reduction and fp32 sharded master parameters/gradients (FSDP keeps the original fp32
flat parameter as the master copy and casts the reduced gradient back to it, so accumulation
across microbatches happens in fp32).
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import Transformer, TransformerBlock

# The FSDP wrapping unit: one flat parameter (FSDP1) / one FSDPParamGroup (FSDP2) per block.
decoder_block_class: type[nn.Module] = TransformerBlock


def fsdp_wrap_policy(units: str = "blocks"):
    """FSDP1 `auto_wrap_policy` (FSDP2 reads the same): wrap each decoder block; the root takes
    the rest (embedding, final norm, output projection; tied embedding and output stay in the
    same unit). ``units="one"`` (``parallel.fsdp_units``): None, the whole model is the root
    unit, one gradient bucket."""
    if units == "one":
        return None
    if units != "blocks":
        raise ValueError(f"fsdp units {units!r}: blocks or one")
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({decoder_block_class})


def decoder_blocks(model: Transformer) -> list[nn.Module]:
    """The modules to `fully_shard` individually (FSDP2), in forward order."""
    return list(model.layers)


def _is_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type != "cpu"


def mixed_precision(device: str | torch.device):
    """FSDP1 `mixed_precision=` argument: None on CPU (fp32), else bf16 compute with fp32
    gradient reduction. buffer_dtype is bf16 as well; the model has no buffers (rotary tables are
    computed in fp32 on the fly), so this casts nothing that needs precision."""
    if not _is_gpu(device):
        return None
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                          buffer_dtype=torch.bfloat16)


def mixed_precision_policy(device: str | torch.device):
    """FSDP2 `mp_policy=` argument, same meaning as `mixed_precision`; None on CPU."""
    if not _is_gpu(device):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
