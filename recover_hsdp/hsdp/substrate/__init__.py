"""The FSDP substrate seam (``parallel.fsdp: 1 | 2``): what of the training step depends on
which FSDP holds the model. :func:`make_substrate` is the one place a substrate is chosen; the
manager, the checkpointer, the standby transfer and the trainer's snapshots talk to the object it
returns, never to FSDP1 or FSDP2 directly (docs/fsdp2.md).

A substrate provides, for the module it wrapped:

* ``wrap(model, shard_pg, *, auto_wrap_policy, device, topology, mixed_precision)``: shard the
  model over the replica's shard group only, intra-replica reduce-scatter as a plain SUM, never a
  cross-replica byte, never a divide (the manager divides once by the fixed B);
* ``buckets(module)``: the accumulated gradient shards, 1-D fp32 tensors mutated IN PLACE only,
  identical order and sizes on every rank of one shard index; ``bucket_names(module)``;
* ``accumulator(module)``: runs one microbatch (``microbatch(closure, contribute=)``, ``reset()``);
* ``param_shards(module)`` / ``load_param_shards(module, tensors)``: this rank's parameter shards
  per bucket (the verifier's snapshot; a standby's install), and ``layout(module)``: how a plain
  model's tensors map onto them (hsdp/layout.py: ``FlatParamLayout`` / ``RowShardLayout``);
* ``state_dicts(mgr)`` / ``load_state_dicts(mgr, state)``: the sharded DCP state dicts, FQN-keyed
  ("model.<fqn>", "optim.state.<fqn>.<name>"), so DCP reshards across S, W and substrate;
* ``overlap_ok``: whether ``parallel.overlap`` is supported (FSDP1 only).
"""
from __future__ import annotations

SUBSTRATES = (1, 2)


def make_substrate(fsdp):
    """The substrate of ``parallel.fsdp`` (1: FSDP1 HYBRID_SHARD, the default; 2: fully_shard)."""
    if fsdp == 1 or fsdp == "1":
        from recover_hsdp.hsdp.substrate.fsdp1 import Fsdp1Substrate

        return Fsdp1Substrate()
    if fsdp == 2 or fsdp == "2":
        from recover_hsdp.hsdp.substrate.fsdp2 import Fsdp2Substrate

        return Fsdp2Substrate()
    raise ValueError(f"parallel.fsdp must be 1 or 2 (got {fsdp!r})")


_GROUPS: dict = {}


def shard_group(topology, *, timeout_s=None, device=None):
    """This rank's shard group for ``topology``, made once per process (collective over the
    world the first time: every rank, same point) and reused after: what :func:`shard_mesh`
    hands a custom loop is the group the manager then trains on."""
    from recover_hsdp.hsdp.topology import new_shard_groups

    key = (topology.replicas, topology.shard_size, topology.rank, topology.world_size)
    if key not in _GROUPS:
        _GROUPS[key] = new_shard_groups(topology, timeout_s=timeout_s, device=device)
    return _GROUPS[key]


def shard_mesh(*, replicas: int, shard_size: int, standby: int = 0, timeout_s=None,
               device=None):
    """The 1-D DeviceMesh over this rank's replica's shard group, for a custom loop that
    ``fully_shard``s its own model (fsdp=2) before handing it to HSDPULFMTrainingManager (give
    the manager the same replicas, shard_size, standby and shard_timeout_s). Call it on every
    rank, at the same point; it initialises torch.distributed from the launcher's environment
    if needed (docs/fsdp2.md)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from recover_hsdp.hsdp.topology import (HybridTopology, init_distributed_from_env,
                                            local_device)

    if not dist.is_initialized():
        init_distributed_from_env(backend="gloo")
    topo = HybridTopology.for_world(replicas + standby, shard_size, dist.get_rank(),
                                    dist.get_world_size())
    device = device or local_device()
    pg = shard_group(topo, timeout_s=timeout_s, device=device)
    return DeviceMesh.from_group(pg, device.type if hasattr(device, "type") else str(device))


def resolve_mixed_precision(mp, device):
    """"auto" -> "bf16" on CUDA, "fp32" elsewhere; None -> "fp32"; a policy object as is."""
    import torch

    if mp is None:
        return "fp32"
    if isinstance(mp, str):
        if mp == "auto":
            return "bf16" if torch.device(device).type == "cuda" else "fp32"
        if mp in ("bf16", "fp32"):
            return mp
        raise ValueError(f"mixed_precision must be auto, bf16 or fp32 (got {mp!r})")
    return mp
