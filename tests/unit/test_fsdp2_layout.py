"""The fsdp=2 substrate's pieces that need no process group: the verifier's row-sharded layout
(hsdp/layout.RowShardLayout) against torch.chunk (FSDP2's Shard(0) split), the layout kinds in
meta.json, the substrate choice and the parallel.fsdp key's refusals."""
from __future__ import annotations

import pytest
import torch

from recover_hsdp.hsdp.layout import (FlatParamLayout, ParamSlot, RowShardLayout,
                                      layout_from_dict, row_range)

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("dim0", [0, 1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 8])
def test_row_range_is_torch_chunk(dim0, S):
    """FSDP2 shards dim 0 as torch.chunk does (chunks of ceil(d/S), the last shorter or none)."""
    t = torch.arange(dim0)
    chunks = list(torch.chunk(t, S)) if dim0 else []
    for j in range(S):
        a, b = row_range(dim0, S, j)
        want = chunks[j].tolist() if j < len(chunks) else []
        assert t[a:b].tolist() == want, (dim0, S, j, (a, b))


def _layout(S: int) -> RowShardLayout:
    slots = (ParamSlot("w", (5, 3), 15, 0), ParamSlot("b", (5,), 5, 0),
             ParamSlot("tiny", (1, 4), 4, 0))
    return RowShardLayout(index=0, module_fqn="layers.0", params=slots, shard_size=S,
                          dtype="float32")


@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_row_shards_rebuild_the_full_parameters(S):
    g = torch.Generator().manual_seed(S)
    state = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(5, generator=g),
             "tiny": torch.randn(1, 4, generator=g)}
    fl = _layout(S)
    shards = [fl.shard_from_full(state, j) for j in range(S)]
    # shard j: each parameter's rows of shard j, flattened, concatenated, no padding
    for j, sh in enumerate(shards):
        want = torch.cat([state[k][slice(*row_range(state[k].shape[0], S, j))].reshape(-1)
                          for k in ("w", "b", "tiny")])
        assert torch.equal(sh, want) and sh.numel() == fl.shard_numel_of(j)
    back = fl.full_from_shards(shards)
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k]), k
    # locate names the element a position holds
    j = S - 1
    for pos in range(shards[j].numel()):
        name = fl.locate(j, pos)
        fqn, idx = name.split("[")
        idx = tuple(int(i) for i in idx.rstrip("]").split(","))
        assert float(state[fqn][idx]) == float(shards[j][pos]), (name, pos)


def test_layout_kinds_round_trip_and_refuse_unknown():
    fl2 = _layout(2)
    d2 = fl2.for_shard0()
    assert d2["kind"] == "fsdp2" and layout_from_dict(d2) == fl2
    fl1 = FlatParamLayout(index=0, module_fqn="", params=(ParamSlot("w", (2, 2), 4, 0),),
                          unpadded_numel=4, padded_numel=4, shard_size=2, shard_index=1,
                          start=2, end=4, dtype="float32")
    d1 = fl1.for_shard0()
    assert "kind" not in d1 and d1["shard_index"] == 0 and d1["end"] == 2   # meta as before
    assert isinstance(layout_from_dict(d1), FlatParamLayout)
    with pytest.raises(ValueError, match="unknown layout kind"):
        layout_from_dict({**d2, "kind": "fsdp3"})


def test_substrate_choice_and_refusals():
    from recover_hsdp.config.groups import ParallelConfig, TrainConfigError
    from recover_hsdp.hsdp.substrate import make_substrate

    assert make_substrate(1).fsdp == 1 and make_substrate(1).overlap_ok
    assert make_substrate(2).fsdp == 2 and not make_substrate(2).overlap_ok
    with pytest.raises(ValueError, match="parallel.fsdp must be 1 or 2"):
        make_substrate(3)
    assert ParallelConfig(fsdp=2).fsdp == 2
    for bad in (0, 3, "2", True):
        with pytest.raises(TrainConfigError, match=r"parallel\.fsdp"):
            ParallelConfig(fsdp=bad)
    with pytest.raises(TrainConfigError, match=r"parallel\.overlap=true is not supported at "
                                               r"parallel\.fsdp=2"):
        ParallelConfig(fsdp=2, overlap=True, replicate_data_plane="gloo")
