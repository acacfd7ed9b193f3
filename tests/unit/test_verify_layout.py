"""The synthetic writer's FSDP-like layout is the real one (2 gloo ranks, FSDP1 HYBRID_SHARD).

verify itself reads the layout the run recorded; this keeps the synthetic runs (tests, the
tolerance calibration) faithful: same units, offsets, alignment and shard padding, and the
real local flat shards equal flat_shard_from_full of the plain model bit for bit, padding
included.
"""
from __future__ import annotations

import os
import socket

from _spawn import run_workers

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, n: int, port: int):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    from recover_hsdp.hsdp import fsdp_hybrid as fh
    from recover_hsdp.model import build_model, fsdp_wrap_policy
    from experiments.verify_synthetic import fsdp_like_layout, tiny_model_config

    cfg = tiny_model_config()
    fsdp = fh.wrap_hybrid_shard(build_model(cfg, 0), dist.group.WORLD,
                                auto_wrap_policy=fsdp_wrap_policy(), device="cpu",
                                topology=fh.HybridTopology(1, n, rank))
    real = fh.parameter_layout(fsdp)
    mine = fsdp_like_layout(build_model(cfg, 0), n)

    def strip(fl):
        d = fl.to_dict()
        for k in ("shard_index", "start", "end"):
            d.pop(k)
        return d

    state = {k: v.detach() for k, v in build_model(cfg, 0).state_dict(keep_vars=True).items()}
    expected = fh.flat_shard_from_full(state, mine, rank, n, pad_value=fh.PARAM_PADDING_VALUE)
    got = fh.local_flat_shards(fsdp)
    has_padding = any(s.offset + s.numel < t.offset for fl in mine
                      for s, t in zip(fl.params, fl.params[1:]))
    return ([strip(f) for f in real] == [strip(f) for f in mine],
            len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got)),
            has_padding)


def test_fsdp_like_layout_matches_fsdp_s2():
    results = run_workers(_worker, 2, (_free_port(),), timeout_s=120)
    assert results == [(True, True, True)] * 2, results
