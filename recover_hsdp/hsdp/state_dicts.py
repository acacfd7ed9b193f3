"""The sharded state dicts a checkpoint holds (hsdp/checkpoint.py saves and loads them with DCP).

The model goes through torch's supported API, ``torch.distributed.checkpoint.state_dict``
(``get_model_state_dict`` / ``set_model_state_dict``, ``full_state_dict=False``): each rank its
shard as a ShardedTensor over its replica's shard group, which DCP reshards at load to another
S or W. The optimizer goes through FSDP's ``optim_state_dict`` / ``optim_state_dict_to_load``
with the shard group named (torch's ``get_optimizer_state_dict`` cannot name it for HYBRID_SHARD:
see :func:`_sharded_optim`). The keys are those FSDP's SHARDED state dicts always had
("model.<fqn>", "optim.state.<fqn>.<name>", "optim.param_groups"), so checkpoints written by
earlier versions (``FSDP.state_dict_type`` + ``module.state_dict()``) load unchanged
(tests/mpi/test_state_dict_api_mpi.py). No torch deprecation warning reaches the console.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

#: torch's own warnings about FSDP1's sharded state dicts, which a user cannot act on: the
#: ShardedTensor deprecation (FSDP1's SHARDED_STATE_DICT is made of them, torch 2.11-2.13), the
#: state-dict-type setting (the optimizer's group below), the device query of torch's
#: optimizer-key check and, at S=1 (NO_SHARD), that the state dict is the full one. Filtered
#: by message, once per process (thread-safe, unlike catch_warnings: an asynchronous save
#: writes from a thread), so nothing else is hidden.
_TORCH_NOISE = ((FutureWarning, r"Please use DTensor instead and we are deprecating Sharded"),
                (FutureWarning, r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\)"),
                (UserWarning, r"`_get_pg_default_device` will be deprecated"),
                (UserWarning, r"Multiple backends are registered with this ProcessGroup"),
                (UserWarning, r"When using ``NO_SHARD`` for ``ShardingStrategy``"))


def quiet_torch_checkpoint_warnings() -> None:
    """Install the filters of ``_TORCH_NOISE`` where missing (a ``catch_warnings`` of the
    caller's may have dropped them): a save or load prints nothing."""
    have = {(f[2], getattr(f[1], "pattern", None)) for f in warnings.filters if f[0] == "ignore"}
    for cat, msg in _TORCH_NOISE:
        if (cat, msg) not in have:
            warnings.filterwarnings("ignore", message=msg, category=cat)


_SHARDED = None


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    global _SHARDED
    if _SHARDED is None:      # the sharded form: each rank its shard, DCP reshards at load
        _SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)
    return _SHARDED


@contextmanager
def _sharded_optim(module):
    """The module's state-dict type set to SHARDED for FSDP's optimizer API, exactly as torch's
    get_state_dict enters it internally (state_dict._verify_options: FSDP.state_dict_type with
    its deprecation filtered). Needed because torch's get/set_optimizer_state_dict pass
    group=None for HYBRID_SHARD (state_dict._get_fsdp_process_group): FSDP then gathers the
    optimizer keys over the WORLD, which holds the other replicas (not saving) and dead ranks."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import (ShardedOptimStateDictConfig, ShardedStateDictConfig,
                                        StateDictType)

    quiet_torch_checkpoint_warnings()
    with FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT,
                              ShardedStateDictConfig(), ShardedOptimStateDictConfig()):
        yield


def state_dicts(mgr) -> dict:
    """{"model", "optim"}: the sharded state dicts of this rank, keyed as FSDP's SHARDED
    state dicts always were (checkpoints of earlier versions load): the model through torch's
    supported API (get_model_state_dict); the optimizer through FSDP's optimizer API over the
    replica's own shard group (see _sharded_optim)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    quiet_torch_checkpoint_warnings()
    model = get_model_state_dict(mgr.module, options=_options())
    _init_optim_state(mgr.optimizer)
    with _sharded_optim(mgr.module):
        optim = FSDP.optim_state_dict(mgr.module, mgr.optimizer, group=mgr.shard_pg)
    return {"model": model, "optim": optim}


def load_state_dicts(mgr, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    quiet_torch_checkpoint_warnings()
    set_model_state_dict(mgr.module, state["model"], options=_options())
    with _sharded_optim(mgr.module):
        osd = FSDP.optim_state_dict_to_load(mgr.module, mgr.optimizer, state["optim"],
                                            group=mgr.shard_pg)
    mgr.optimizer.load_state_dict(osd)


def stage(obj):
    """A CPU copy of a state dict (DCP's own async stager refuses FSDP1's ShardedTensors;
    FSDP2's DTensors keep their mesh and placement)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    quiet_torch_checkpoint_warnings()
    if isinstance(obj, ShardedTensor):
        shards = [Shard(sh.tensor.detach().to("cpu", copy=True), sh.metadata)
                  for sh in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group)
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):   # fsdp=2: the local shard copied, the same placement
        return DTensor.from_local(obj.to_local().detach().to("cpu", copy=True), obj.device_mesh,
                                  obj.placements, shape=obj.shape, stride=obj.stride(),
                                  run_check=False)
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: stage(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v) for v in obj)
    return obj
