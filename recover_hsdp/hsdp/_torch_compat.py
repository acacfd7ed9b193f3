"""Import-time check of every private FSDP1 internal that fsdp_hybrid (and the baselines) touch.

Run once when recover_hsdp.hsdp.fsdp_hybrid is imported: a private name that moved in the
installed torch is reported as ONE line naming it, instead of a wrong result or an AttributeError
deep inside a training step. Module-level names are looked up; attributes that only exist on
instances (FSDP states, flat parameters) are looked up in the source of the torch module that
sets them (the same check runs again on the live objects at wrap time). docs/hsdp.md says why each
one is touched.
"""
from __future__ import annotations

import importlib
import inspect

# (module, names that must be attributes of the module, or "Class.attr")
_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.fsdp._common_utils", ("clean_tensor_name",)),
    ("torch.distributed.fsdp._flat_param", ("_FLAT_PARAM_PADDING_VALUE", "FlatParameter",
                                            "FlatParamHandle.uses_sharded_strategy")),
    ("torch.distributed.fsdp._runtime_utils", ("_reduce_grad", "_reduce_grad_no_shard")),
    ("torch.distributed.fsdp._init_utils", ("_init_process_group_state_for_hybrid_shard",)),
    ("torch.distributed.fsdp", ("FullyShardedDataParallel.no_sync",
                                "FullyShardedDataParallel.clip_grad_norm_", "MixedPrecision",
                                "ShardingStrategy.HYBRID_SHARD")),
)
# (module, identifiers its source must still contain: instance attributes set or read there)
_SOURCE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.fsdp._init_utils", ("_inter_node_pg", "_gradient_predivide_factor",
                                            "_gradient_postdivide_factor")),
    ("torch.distributed.fsdp._runtime_utils", ("_inter_node_pg", "_gradient_predivide_factor",
                                               "_gradient_postdivide_factor",
                                               "_saved_grad_shard")),
    ("torch.distributed.fsdp._flat_param", ("_fqns", "_shapes", "_numels",
                                            "_numels_with_padding", "_is_padding_mask",
                                            "_unpadded_unsharded_size", "_local_shard",
                                            "_sharded_size", "self.world_size", "self.rank")),
)


def missing_internals() -> list[str]:
    """Every private FSDP internal that the installed torch lacks, as 'module.name' strings."""
    out: list[str] = []
    for mod_name, names in _NAMES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            out.append(mod_name)
            continue
        for name in names:
            obj = mod
            for part in name.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is None:
                out.append(f"{mod_name}.{name}")
    for mod_name, idents in _SOURCE:
        try:
            src = inspect.getsource(importlib.import_module(mod_name))
        except (ImportError, OSError, TypeError):
            out.append(f"{mod_name} (source unreadable)")
            continue
        out.extend(f"{mod_name}: {i}" for i in idents if i not in src)
    return out


def check_fsdp_internals(error: type[Exception] = RuntimeError) -> None:
    """Raise ``error`` with one line naming the first moved internal (and how many moved)."""
    miss = missing_internals()
    if miss:
        import torch

        more = f" (and {len(miss) - 1} more)" if len(miss) > 1 else ""
        raise error(f"recover_hsdp: torch {torch.__version__} lacks the FSDP1 internal "
                    f"{miss[0]}{more} that recover_hsdp.hsdp.fsdp_hybrid relies on "
                    f"(docs/hsdp.md lists them); supported: torch 2.11-2.13")
