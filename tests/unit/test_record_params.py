"""Parameter snapshots: atomic per (step, shard, replica), any surviving copy, copies agree."""
from __future__ import annotations

import os

import pytest
import torch

from recover_hsdp.record import (
    INIT_STEP,
    ParamWriter,
    RecordError,
    load_params,
    param_copies,
    param_file,
    param_steps,
)

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)


def shard(j, step, n=4):
    return {"layers.0.w": torch.arange(n, dtype=torch.float32) + 10 * j + step,
            "layers.0.b": torch.full((2,), float(step)), "count": torch.tensor([step])}


def test_save_and_load_any_surviving_replica(tmp_path):
    for r in (1, 2):  # replica 0 is dead: no copy from it
        for j in (0, 1):
            w = ParamWriter(tmp_path, global_rank=r * 2 + j, replica=r, shard_index=j)
            w.save_initial(shard(j, -1))
            w.save(0, shard(j, 0))
    assert param_steps(tmp_path) == [INIT_STEP, 0]
    assert sorted(param_copies(tmp_path, 0)) == [0, 1]
    assert sorted(param_copies(tmp_path, 0)[1]) == [1, 2]
    got = load_params(tmp_path, 0, shard_index=1)
    assert set(got) == {"layers.0.w", "layers.0.b", "count"}
    assert torch.equal(got["layers.0.w"], shard(1, 0)["layers.0.w"])
    assert torch.equal(load_params(tmp_path, INIT_STEP, 0, replica=2)["layers.0.b"],
                       torch.full((2,), -1.0))
    assert param_file(tmp_path, 7, 1, 2).as_posix().endswith("params/step000007/shard1.replica2.pt")
    with pytest.raises(RecordError, match="no copy from replica 0"):
        load_params(tmp_path, 0, 0, replica=0)
    with pytest.raises(RecordError, match=r"no parameter snapshot for step 5, shard 0 "
                                          r"\(saved steps: \[-1, 0\]\)"):
        load_params(tmp_path, 5, 0)


def test_every_and_last_step(tmp_path):
    w = ParamWriter(tmp_path, 0, 0, 0, every=3, final_step=7)
    saved = [s for s in range(8) if w.save(s, shard(0, s)) is not None]
    assert saved == [0, 3, 6, 7] and w.saved == saved
    w = ParamWriter(tmp_path / "b", 0, 0, 0, every=0)
    assert w.save(4, shard(0, 4)) is None and w.save(4, shard(0, 4), force=True) is not None
    assert param_steps(tmp_path / "b") == [4]


def test_copies_must_agree(tmp_path):
    ParamWriter(tmp_path, 0, 0, 0).save(2, shard(0, 2))
    other = shard(0, 2)
    other["layers.0.w"][1] += 1e-3
    ParamWriter(tmp_path, 2, 1, 0).save(2, other)
    with pytest.raises(RecordError, match=r"step 2, shard 0: tensor 'layers.0.w' differs between "
                                          r"replicas 0 and 1 \(max \|diff\| 0.00"):
        load_params(tmp_path, 2, 0)
    assert load_params(tmp_path, 2, 0, check=False)["layers.0.w"][1] == 3.0
    assert load_params(tmp_path, 2, 0, atol=1e-2)  # within a caller's tolerance


def test_copies_agree_to_rounding_by_default_and_bitwise_on_request(tmp_path):
    ParamWriter(tmp_path, 0, 0, 0).save(0, {"w": torch.tensor([1.0, 2.0])})
    ParamWriter(tmp_path, 1, 1, 0).save(0, {"w": torch.tensor([1.0, 2.0 + 2.4e-7])})
    load_params(tmp_path, 0, 0)
    with pytest.raises(RecordError, match="differs"):
        load_params(tmp_path, 0, 0, rtol=0, atol=0)


def test_views_are_saved_without_their_storage(tmp_path):
    flat = torch.zeros(1_000_000)
    path = ParamWriter(tmp_path, 0, 0, 0).save(0, {"w": flat[:10]})
    assert os.path.getsize(path) < 20_000


def test_partial_files_are_ignored(tmp_path):
    ParamWriter(tmp_path, 0, 0, 0).save(1, shard(0, 1))
    d = param_file(tmp_path, 1, 0, 0).parent
    (d / ".shard0.replica1.pt.123.abcd.tmp").write_bytes(b"torn")
    (tmp_path / "params" / "step000002").mkdir()
    (tmp_path / "params" / "step000002" / ".shard0.replica0.pt.9.ff.tmp").write_bytes(b"torn")
    assert param_steps(tmp_path) == [1]
    assert list(param_copies(tmp_path, 1)[0]) == [0]


def test_corrupt_snapshot_is_a_record_error(tmp_path):
    p = param_file(tmp_path, 0, 0, 0)
    p.parent.mkdir(parents=True)
    p.write_bytes(b"not a torch file")
    with pytest.raises(RecordError, match="cannot load parameter snapshot"):
        load_params(tmp_path, 0, 0)
