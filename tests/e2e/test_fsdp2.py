"""parallel.fsdp=2 (FSDP2 fully_shard over the replica's shard group) against fsdp=1 (FSDP1
HYBRID_SHARD): the same seed, data and kill schedule give runs that both verify OK, whose
parameter snapshots agree within verify's element and RMS tolerances at every step and whose
committed losses agree to a relative 1e-5 (issue 41). Real SIGKILLs under mpirun --with-ft ulfm."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e._launch import run_training
from tests.e2e.test_hsdp_kills import K, _cfg, check_bitwise_and_verify

pytestmark = pytest.mark.mpi

STEPS = 4


def _run(tmp: Path, fsdp: int, W: int, S: int, G: int, schedule) -> tuple[Path, object]:
    cfg = _cfg(tmp / f"fsdp{fsdp}", W=W, S=S, G=G, schedule=schedule, steps=STEPS)
    cfg["parallel"]["fsdp"] = fsdp
    out = run_training(cfg)
    run_dir = Path(cfg["run"]["output_dir"])
    assert out.returncode == 0, (out.stdout or "")[-4000:] + (out.stderr or "")[-4000:]
    return run_dir, out


def _params(run_dir: Path, step: int) -> dict:
    """The run's parameters of ``step`` by fqn, rebuilt through its own layout."""
    from recover_hsdp.hsdp.layout import layout_from_dict
    from recover_hsdp.record import load_params

    meta = json.loads((run_dir / "meta.json").read_text())
    S = int(meta["shard_size"])
    shards = [load_params(run_dir, step, j, check=False) for j in range(S)]
    out = {}
    for i, d in enumerate(meta["param_layout"]):
        out.update(layout_from_dict(d).full_from_shards([shards[j][f"flat{i}"]
                                                        for j in range(S)]))
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    from recover_hsdp.record.steps import merge_steps

    return {s: r.loss for s, r in merge_steps(run_dir).steps.items()}


def _lrs(run_dir: Path) -> list[float]:
    from recover_hsdp.optim import lr_at
    from recover_hsdp.verify.spec import RunSpec

    cfg = RunSpec.load(run_dir).optim_cfg
    return [lr_at(s, cfg) for s in range(STEPS)]


# (id, W, S, G, schedule): a kill in the reduction at S=2 (boundary: the dead replica's
# microbatches taken over), and at S=1 a kill in a backward down to one replica
ROWS = [("W3S2G2-reduce-kill", 3, 2, 2, [K(1, 2, "reduce", bucket=0)]),
        ("W2S1G1-backward-kill", 2, 1, 1, [K(1, 1, "backward", microbatch=0)])]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_fsdp2_agrees_with_fsdp1(tmp_path, row):
    from recover_hsdp.verify.tolerance import Tolerance, ulp_floor

    _, W, S, G, schedule = row
    r1, o1 = _run(tmp_path, 1, W, S, G, schedule)
    r2, o2 = _run(tmp_path, 2, W, S, G, schedule)
    for run_dir, out in ((r1, o1), (r2, o2)):
        check_bitwise_and_verify(run_dir, STEPS, S, out)
    meta2 = json.loads((r2 / "meta.json").read_text())
    meta1 = json.loads((r1 / "meta.json").read_text())
    # what was built: FSDP2 modules with DTensor parameters, no FSDP1 FlatParameter
    assert meta2["fsdp"] == 2 and "fsdp" not in meta1, (meta1.get("fsdp"), meta2.get("fsdp"))
    built = meta2["fsdp2"]
    assert built["flat_parameters"] == 0 and built["fsdp_modules"] >= 2, built
    assert built["dtensor_parameters"] > 0, built
    assert {d.get("kind") for d in meta2["param_layout"]} == {"fsdp2"}
    assert len(meta2["param_layout"]) == len(meta1["param_layout"])   # one bucket per unit
    # the same committed steps, losses to a relative 1e-5
    l1, l2 = _losses(r1), _losses(r2)
    assert sorted(l1) == sorted(l2) == list(range(STEPS)), (l1, l2)
    for s in l1:
        assert math.isfinite(l1[s]) and abs(l1[s] - l2[s]) <= 1e-5 * abs(l1[s]), (s, l1[s], l2[s])
    # parameters at every step within verify's element and per-unit RMS tolerances, the
    # window growing from the identical initial parameters (no re-anchoring between the runs)
    init1, init2 = _params(r1, -1), _params(r2, -1)
    assert init1.keys() == init2.keys()
    for k in init1:
        assert (init1[k] == init2[k]).all(), k       # the same initial model, bit for bit
    floor = ulp_floor(max(float(v.abs().max()) for v in init1.values()))
    tol = Tolerance(floor=floor)
    groups = [[p["fqn"] for p in d["params"]] for d in meta1["param_layout"]]
    for step, lr in enumerate(_lrs(r1)):
        tol.add_step(lr)
        p1, p2 = _params(r1, step), _params(r2, step)
        worst = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
        assert worst <= tol.element, (step, worst, tol.element)
        for names in groups:
            sq = sum(float((p1[k] - p2[k]).double().square().sum()) for k in names)
            n = sum(p1[k].numel() for k in names)
            assert math.sqrt(sq / n) <= tol.bulk, (step, names[0], tol.bulk)
    # the runs did train: the parameters moved by far more than the tolerance
    moved = max(float((_params(r1, STEPS - 1)[k] - init1[k]).abs().max()) for k in init1)
    assert moved > 10 * tol.element, (moved, tol.element)
