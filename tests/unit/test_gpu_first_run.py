"""The first GPU run must work the first time. Resolved on CPU with CUDA faked (a
patched ``torch.cuda``): device mapping, backend choice, shard barrier, distinct GPUs, NCCL
bounds, core dumps."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a machine with ``n`` GPUs would show it (set_device recorded)."""
    state = {"n": 1, "current": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["n"])

    def set_device(d):
        state["current"] = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: (state["current"] or
                                                               torch.device("cuda", 0)).index)
    for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    return state


# --- item 1: one mapping for local_device and rank_device ------------------------------------
def test_local_device_wraps_the_local_rank_over_the_visible_gpus(fake_cuda, monkeypatch):
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.workers.resilient import rank_device

    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    # one visible GPU (a one-GPU machine, or CUDA_VISIBLE_DEVICES binding): cuda:0, not cuda:3
    assert fh.local_device() == torch.device("cuda", 0)
    assert fake_cuda["current"] == torch.device("cuda", 0)
    assert rank_device(None, 1) == torch.device("cuda", 0)
    fake_cuda["n"] = 2
    assert fh.local_device() == torch.device("cuda", 1)
    assert rank_device(None, 1) == fh.local_device()
    assert rank_device(1, 1) == torch.device("cuda", 0)          # gpus_per_node narrows it
    with pytest.raises(ValueError, match="gpus_per_node"):
        rank_device(3, 1)


# --- item 3: the backend follows the rank's device; --cpu means CPU everywhere ---------------
def test_cpu_device_on_a_gpu_machine_means_gloo_shard_groups(fake_cuda, monkeypatch):
    from recover_hsdp.hsdp import topology
    from recover_hsdp.workers.resilient import rank_device

    fake_cuda["n"] = 4
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append(kw["backend"]) or
                        object())
    topo = topology.HybridTopology(2, 1, 0)     # two replicas of one rank: two groups
    dev = rank_device(None, 1, "cpu")
    assert dev == torch.device("cpu")
    topology.new_shard_groups(topo, device=dev)
    assert made == ["gloo", "gloo"]
    topology.new_shard_groups(topo, device=torch.device("cuda", 0))
    assert made == ["gloo", "gloo", "nccl", "nccl"]
    # no device given: the one the rank would train on (local_device: cuda here)
    topology.new_shard_groups(topo)
    assert made[-1] == "nccl"


def test_bench_gpu_cpu_passes_run_device_cpu_to_every_run(fake_cuda, tmp_path):
    from recover_hsdp.bench.gpu import Bench, parse_args
    from recover_hsdp.config.groups import RunConfig, TrainConfigError

    b = Bench(parse_args(["--cpu", "--out", str(tmp_path)]))
    assert b.cpu and b.dev == "cpu"
    assert "run.device=cpu" in b.big and "run.device=cpu" in b.small
    assert RunConfig(device="cpu").device == "cpu"
    with pytest.raises(TrainConfigError, match="run.device"):
        RunConfig(device="gpu")


def test_run_device_cuda_without_cuda_is_one_clear_error(monkeypatch):
    from recover_hsdp.workers.resilient import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device(None, 1) is None
    assert rank_device(None, 1, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        rank_device(None, 1, "cuda")


# --- item 5: dist.barrier(shard_pg) names the device on NCCL ---------------------------------
@pytest.mark.parametrize("device,ids", [(torch.device("cuda", 1), [1]),
                                        (torch.device("cpu"), None)])
def test_manager_shard_barrier_passes_device_ids_on_cuda(monkeypatch, device, ids):
    from recover_hsdp.hsdp.manager import HSDPULFMTrainingManager

    calls = []
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw))
    mgr = HSDPULFMTrainingManager.__new__(HSDPULFMTrainingManager)
    mgr.S, mgr.shard_pg, mgr.device = 2, "PG", device
    mgr._shard_barrier()
    assert calls == [{"group": "PG", **({"device_ids": ids} if ids else {})}]


# --- item 4: NCCL bounds from the longest announced phase; no core dumps unless asked --------
def test_nccl_shard_groups_outlast_a_synchronous_checkpoint_save(fake_cuda, monkeypatch):
    from recover_hsdp.hsdp import topology

    timeouts = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: timeouts.append(
        (kw["backend"], kw["timeout"].total_seconds())) or object())
    topo = topology.HybridTopology(2, 1, 0)
    topology.new_shard_groups(topo, timeout_s=60.0, device=torch.device("cuda", 0))
    topology.new_shard_groups(topo, timeout_s=60.0, device=torch.device("cpu"))
    (nb, nt), _, (gb, gt), _ = timeouts
    assert nb == "nccl" and nt > 300.0          # the synchronous save's bound (300 s) + margin
    assert gb == "gloo" and gt == 60.0          # gloo keeps the hang detector's chain
    assert nt == topology.CKPT_SAVE_BOUND_S + topology.PHASE_MARGIN_S
    assert topology.shard_group_timeout_s("nccl", 900.0) == 900.0   # a longer setting stays


def test_ranks_run_without_core_dumps_unless_asked(monkeypatch):
    import resource

    from recover_hsdp.hsdp import topology

    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setenv(topology.ENV_STORE, "127.0.0.1:1")
    monkeypatch.delenv("RECOVER_HSDP_CORE_DUMPS", raising=False)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: "STORE")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: None)
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (want, hard))
        assert topology.init_distributed_from_env() == (0, 1)
        assert resource.getrlimit(resource.RLIMIT_CORE)[0] == 0
        resource.setrlimit(resource.RLIMIT_CORE, (want, hard))
        monkeypatch.setenv("RECOVER_HSDP_CORE_DUMPS", "1")          # asked for: left alone
        topology.init_distributed_from_env()
        assert resource.getrlimit(resource.RLIMIT_CORE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


# --- item 2: S >= 2 on distinct GPUs, judged on the devices the ranks hold (UUIDs) -----------
def _gather(monkeypatch, uuids):
    """dist as a 2-rank world whose ranks report ``uuids`` when the groups are made."""
    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(uuids))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append(ranks) or object())

    def all_gather_object(out, obj, group=None):
        assert obj == uuids[0]          # this rank's own device's UUID
        out[:] = list(uuids)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return made


def test_per_rank_gpu_binding_allows_s2_and_a_shared_gpu_is_refused(fake_cuda, monkeypatch):
    from recover_hsdp.hsdp import topology
    from recover_hsdp.workers.resilient import rank_device

    class Props:
        def __init__(self, uuid):
            self.uuid = uuid

    fake_cuda["n"] = 1         # CUDA_VISIBLE_DEVICES=<one GPU per rank>: device_count() == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props("GPU-aaaa"))
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    dev = rank_device(None, 2)                 # a valid S=2 layout: not refused on the count
    assert dev == torch.device("cuda", 0)
    topo = topology.HybridTopology(1, 2, 0)
    made = _gather(monkeypatch, ["GPU-aaaa", "GPU-bbbb"])     # distinct physical GPUs
    topology.new_shard_groups(topo, device=dev)
    assert made == [[0, 1]]
    _gather(monkeypatch, ["GPU-aaaa", "GPU-aaaa"])           # both ranks on one GPU
    with pytest.raises(ValueError, match=r"ranks 0 and 1 of replica 0 are on the same GPU"):
        topology.new_shard_groups(topo, device=dev)
    # W=2, S=1 on one GPU (ranks share it across replicas): allowed
    topology.check_distinct_devices(topology.HybridTopology(2, 1, 0), ["GPU-aaaa"] * 2)
