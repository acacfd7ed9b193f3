"""The rig of a data-plane benchmark job (bench collectives' plane kills, bench gpu sections 4
and 8): the cross-replica group a plane needs, over the world group; each rank's device; the
launcher-hosted store a plane rendezvouses on, and the mpirun arguments that hand it to the
ranks."""
from __future__ import annotations

import contextlib
import os
from typing import Iterable


class PlaneCross:
    """What GlooPlane needs of the cross-replica group, over the world group (one replica per
    rank, one replicate group: the bench's shape)."""

    def __init__(self, world):
        self.world, self.shard_index, self.is_standby = world, 0, False
        self.global_rank = world.global_ranks[world.rank]

    @property
    def global_ranks(self):
        return list(self.world.global_ranks)

    @property
    def epoch(self):
        return self.world.epoch

    def my_role(self):
        from recover_hsdp.types import Role

        return Role.MAJOR

    def result(self, *, ok, quiesced=False, reduce_failed=False):
        from recover_hsdp.types import FailureRecord

        return FailureRecord(ok=ok, epoch=self.epoch)

    def note_unclean(self, quiesce_group=False):
        pass


def rank_device(plane: str):
    """The device of this rank's tensors on ``plane``: CPU for gloo, ``cuda:(local rank %
    visible GPUs)`` for nccl (one rank per GPU: NCCL refuses two ranks of one communicator on one
    device, so the caller starts no more ranks than GPUs)."""
    import torch

    if plane != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                               os.environ["OMPI_COMM_WORLD_RANK"]))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def plane_store():
    """A launcher-hosted store for one data-plane job, as a launch has: its address and job key
    (docs/security.md) in this process's environment while it lasts; yields the names to export
    to the ranks (mpirun ``-x``)."""
    from recover_hsdp.faults.signing import ENV_KEY, served_keys
    from recover_hsdp.hsdp.topology import ENV_STORE, serve_store

    with serve_store("127.0.0.1") as addr:
        os.environ[ENV_STORE] = addr
        os.environ[ENV_KEY] = served_keys[addr].hex()
        try:
            yield [ENV_STORE, ENV_KEY]
        finally:
            os.environ.pop(ENV_STORE, None)
            os.environ.pop(ENV_KEY, None)


def export_args(names: Iterable[str]) -> list[str]:
    """mpirun's ``-x NAME`` for each name: variables the ranks get from this environment."""
    return [a for name in names for a in ("-x", name)]
