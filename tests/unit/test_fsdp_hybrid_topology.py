"""Pure checks of the hybrid topology, version pin and no-op group (no processes spawned)."""
from __future__ import annotations

import pytest
import torch

from recover_hsdp.hsdp import fsdp_hybrid as fh

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def test_ranks_of_replicas_and_shards():
    t = fh.HybridTopology(3, 2, 5)
    assert (t.world_size, t.replica, t.shard_index) == (6, 2, 1)
    assert [t.replica_ranks(r) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [t.replicate_ranks(j) for j in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert t.replica_of_rank(3) == 1
    # every rank sits in exactly one replica and one replicate group, at the crossing
    for rank in range(6):
        u = fh.HybridTopology(3, 2, rank)
        assert rank in t.replica_ranks(u.replica) and rank in t.replicate_ranks(u.shard_index)


def test_errors_name_keys_and_values():
    with pytest.raises(ValueError, match=r"parallel.replicas\(3\) \* parallel.shard_size\(2\) "
                                         r"= 6 != world size 4"):
        fh.HybridTopology.for_world(3, 2, 0, 4)
    with pytest.raises(ValueError, match=r"parallel.shard_size must be an integer >= 1, got 0"):
        fh.HybridTopology(2, 0, 0)
    with pytest.raises(ValueError, match=r"rank 4 is outside"):
        fh.HybridTopology(2, 2, 4)
    with pytest.raises(ValueError, match="shard index 2"):
        fh.HybridTopology(2, 2, 0).replicate_ranks(2)


def test_torch_version_pin(monkeypatch):
    fh.check_torch_version()  # the installed torch is the verified one
    monkeypatch.delenv(fh.ENV_ALLOW_UNVERIFIED, raising=False)
    with pytest.raises(fh.UnsupportedTorchError, match="found torch 2.14.0"):
        fh.check_torch_version("2.14.0+cu128")
    monkeypatch.setenv(fh.ENV_ALLOW_UNVERIFIED, "1")
    fh.check_torch_version("2.14.0")


def test_noop_group_counts_allreduce_and_refuses_the_rest():
    pg = fh.NoOpReplicateGroup(1, 3)
    assert (pg.size(), pg.rank(), pg.getBackendName()) == (3, 1, "recover_hsdp_noop")
    t = torch.ones(2)
    work = pg.allreduce([t])
    assert work.wait() and torch.equal(t, torch.ones(2))  # untouched
    for op in ("broadcast", "allgather", "reduce_scatter", "barrier", "allreduce_coalesced"):
        with pytest.raises(fh.DeferredReductionViolation, match=op):
            getattr(pg, op)([t])
    assert pg.calls["allreduce"] == 1 and pg.calls["broadcast"] == 1


def test_failure_kind():
    assert fh.shard_group_failure_kind(RuntimeError("x Connection closed by peer [::1]")) \
        == "peer_closed"
    assert fh.shard_group_failure_kind(RuntimeError("Timed out waiting 1000ms for recv")) \
        == "timeout"
    assert fh.shard_group_failure_kind(ValueError("Timed out")) is None


def test_layout_dict_round_trip():
    fl = fh.FlatParamLayout(0, "blocks.0", (fh.ParamSlot("blocks.0.up.weight", (3, 2), 6, 0),),
                            8, 8, 2, 1, 4, 8, "float32")
    assert fh.FlatParamLayout.from_dict(fl.to_dict()) == fl
    state = {"blocks.0.up.weight": torch.arange(6.0).reshape(3, 2)}
    shard0, = fh.flat_shard_from_full(state, [fl], 0)
    shard1, = fh.flat_shard_from_full(state, [fl], 1, pad_value=42.0)
    assert shard0.tolist() == [0, 1, 2, 3] and shard1.tolist() == [4, 5, 42, 42]
