"""Checkpoints through torch's supported state-dict API keep the old format. Two ranks,
one replica of S=2 (ShardedTensors across ranks), launched by launch/local.sh:

    NP=2 launch/local.sh python tests/mpi/workers/state_dict_api_worker.py OUT_DIR

1. after two steps the new state dicts (hsdp/state_dicts.py) have exactly the keys and values of
   the code path earlier versions saved with (``_legacy_state_dicts``, kept here verbatim);
2. a checkpoint written by the legacy path loads with the new one (model and optimizer back to
   the saved values after a third step moved them), and one written by the new path loads with
   the legacy loader (nothing about the format changed).
Each rank writes OUT_DIR/rank{g}.json; the test reads the console for warnings.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recover_hsdp import HSDPULFMTrainingManager
from recover_hsdp.data import DataConfig, build_microbatch_source
from recover_hsdp.hsdp.state_dicts import load_state_dicts, state_dicts
from recover_hsdp.model import build_model, fsdp_wrap_policy, next_token_loss
from recover_hsdp.model.config import ModelConfig

REPLICAS, SHARD = 1, 2


def _legacy_state_dicts(mgr) -> dict:
    """The save path of earlier versions (FSDP.state_dict_type), its deprecation silenced."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    _init_optim_state(mgr.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(mgr.module, StateDictType.SHARDED_STATE_DICT):
            return {"model": mgr.module.state_dict(),
                    "optim": FSDP.optim_state_dict(mgr.module, mgr.optimizer,
                                                   group=mgr.shard_pg)}


def _legacy_load(mgr, state: dict) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(mgr.module, StateDictType.SHARDED_STATE_DICT):
            mgr.module.load_state_dict(state["model"])
            osd = FSDP.optim_state_dict_to_load(mgr.module, mgr.optimizer, state["optim"],
                                                group=mgr.shard_pg)
            mgr.optimizer.load_state_dict(osd)


def _flat(obj, prefix=""):
    """{dotted key: local tensor (a ShardedTensor: its local shards) or value}."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}{i}."))
    elif hasattr(obj, "local_shards"):
        out[prefix[:-1]] = [s.tensor.detach().clone() for s in obj.local_shards()]
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj.detach().clone()
    else:
        out[prefix[:-1]] = obj
    return out


def _same(a: dict, b: dict) -> list[str]:
    """The keys where a and b differ (missing on one side, or another value)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            ok = len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
        elif isinstance(x, torch.Tensor):
            ok = isinstance(y, torch.Tensor) and torch.equal(x, y)
        else:
            ok = x == y
        if not ok:
            bad.append(k)
    return bad


def _snapshot(mgr) -> dict:
    return {"params": [p.detach().clone() for p in mgr.module.parameters()],
            "optim": _flat(mgr.optimizer.state_dict()["state"])}


def _matches(mgr, snap: dict) -> bool:
    return (all(torch.equal(p, q) for p, q in zip(mgr.module.parameters(), snap["params"]))
            and not _same(_flat(mgr.optimizer.state_dict()["state"]), snap["optim"]))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dc = DataConfig(seq_len=16, micro_batch_size=2 * SHARD)
    src: dict = {}

    def mfn(r, k):
        if r not in src:
            src[r] = build_microbatch_source(dc, r, REPLICAS)
        return src[r].get(k)

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=96,
                      max_seq_len=16, vocab_size=4096)
    mgr = HSDPULFMTrainingManager(
        build_model(cfg, seed=0),
        optimizer_factory=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
        microbatch_fn=mfn, loss_fn=lambda m, x, y: next_token_loss(m(x), y),
        replicas=REPLICAS, shard_size=SHARD, grad_accum=1, auto_wrap_policy=fsdp_wrap_policy())
    pg = dist.new_group(list(range(SHARD)), backend="gloo")
    res: dict = {"rank": mgr.rank}
    for _ in range(2):
        mgr.train_step()
    old, new = _flat(_legacy_state_dicts(mgr)), _flat(state_dicts(mgr))
    res["n_keys"] = len(new)
    res["optim_keys"] = sum(k.startswith("optim.state.") for k in new)
    res["differ"] = _same(old, new)
    # a checkpoint of the legacy path, loaded by the new one after a step moved everything
    snap = _snapshot(mgr)
    dcp.save(_legacy_state_dicts(mgr), checkpoint_id=str(out / "ckpt_legacy"), process_group=pg)
    mgr.train_step()
    res["moved"] = not _matches(mgr, snap)
    state = state_dicts(mgr)
    dcp.load(state, checkpoint_id=str(out / "ckpt_legacy"), process_group=pg)
    load_state_dicts(mgr, state)
    res["legacy_loads"] = _matches(mgr, snap)
    # and the other way: the new path's checkpoint read by the legacy loader
    snap = _snapshot(mgr)
    dcp.save(state_dicts(mgr), checkpoint_id=str(out / "ckpt_new"), process_group=pg)
    mgr.train_step()
    state = _legacy_state_dicts(mgr)
    dcp.load(state, checkpoint_id=str(out / "ckpt_new"), process_group=pg)
    _legacy_load(mgr, state)
    res["new_loads_legacy"] = _matches(mgr, snap)
    (out / f"rank{mgr.rank}.json").write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ULFM: MPI_Finalize may hang (Open MPI #11404)
