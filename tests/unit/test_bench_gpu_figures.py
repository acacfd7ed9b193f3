"""`bench gpu`'s reduction figures without a launch: llama_1b's bucket sizes from its config
(checked against a built model's parameters), section 4's rates, the reduction's share of a
step from step records, what sections 4 and 8 start on each kind of machine (the GPU branches
run here with the launch replaced), and the plan with section 8. The CPU shape runs them for
real in tests/mpi/test_bench_gpu.py."""
from __future__ import annotations

import math
import re

import pytest

from recover_hsdp.bench import gpu, gpu_plan as P
from recover_hsdp.bench.gpu_report import (fsdp_unit_buckets, layout_check,
                                           model_flops_per_token, reduction_share,
                                           staging_figures, table)

pytestmark = pytest.mark.quick


def test_llama_1b_buckets_are_its_fsdp_units_at_shard_size_s():
    d, kv, ffn = 2048, 8 * 64, 8192
    block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d    # q,o + k,v + SwiGLU + 2 norms
    root = 4096 * d + d                                     # tied embedding/head + final norm
    b1 = fsdp_unit_buckets("llama_1b", 1)
    assert [(b["name"], b["count"], b["numel"], b["bytes"]) for b in b1] == [
        ("block", 16, block, 4 * block), ("root", 1, root, 4 * root)]
    assert 16 * block + root == model_flops_per_token("llama_1b", 2048)[1]
    assert round(4 * block / 2**20) == 232 and round(4 * root / 2**20) == 32
    b3 = fsdp_unit_buckets("llama_1b", 3)          # padded to a multiple of S, then split
    assert [b["numel"] for b in b3] == [-(-block // 3), -(-root // 3)]


def test_llama_debug_buckets_match_a_built_model():
    """The formula against the real modules (the CPU shape's model; llama_1b is the same code)."""
    from recover_hsdp.model import build_model
    from recover_hsdp.model.config import LLAMA_DEBUG

    m = build_model(LLAMA_DEBUG.with_vocab(4096), seed=0)
    block = sum(p.numel() for p in m.layers[0].parameters())
    total = sum(p.numel() for p in m.parameters())     # tied: the embedding counted once
    b = {x["name"]: x for x in fsdp_unit_buckets("llama_debug", 1)}
    assert b["block"]["params"] == block and b["block"]["count"] == len(m.layers)
    assert b["root"]["params"] == total - len(m.layers) * block


def test_layout_check_compares_sizes_and_counts():
    bk = fsdp_unit_buckets("llama_debug", 1)
    meta = {"param_layout": [{"padded_numel": x["numel"], "shard_size": 1}
                             for x in bk for _ in range(x["count"])]}
    assert layout_check(bk, meta)["match"] is True
    meta["param_layout"].pop()
    assert layout_check(bk, meta)["match"] is False


def test_staging_figures_per_bucket_and_for_the_step():
    bk = [{"name": "block", "count": 2, "bytes": 1000}, {"name": "root", "count": 1, "bytes": 4000}]
    raw = {"times": {"block": {"ulfm": 1e-6, "copy": 5e-7, "plane": 2e-6},
                     "root": {"ulfm": 2e-6, "copy": 1e-6, "plane": 8e-6}}}
    f = staging_figures(bk, raw)
    assert math.isclose(f["buckets"][0]["ulfm_gbps"], 1.0)
    assert math.isclose(f["buckets"][1]["plane_over_ulfm"], 4.0)
    assert f["step_bytes"] == 6000
    assert math.isclose(f["ulfm_step_s"], 4e-6) and math.isclose(f["plane_step_s"], 12e-6)
    assert math.isclose(f["ulfm_gbps"], 1.5) and math.isclose(f["plane_over_ulfm"], 3.0)
    raw["times"]["root"]["plane"] = None              # no plane column: no plane figures
    assert "plane_gbps" not in staging_figures(bk, raw)


def test_reduction_share_from_step_records():
    def rec(step, t, red=None, cons=0.01, failures=None):
        loc = {"time": t, "consensus_s": cons}
        if red is not None:
            loc["reduce_exposed_s"] = red
        return {"step": step, "local": loc, "failures": failures}

    r0 = [rec(0, 10.0, 0.5), rec(1, 12.0, 0.5), rec(2, 13.0, 0.25),
          rec(3, 20.0, 1.0, failures=[{"x": 1}]), rec(4, 21.0)]
    # rank 1 arrives later at step 1 (waits less), earlier at step 2; commits at the same times
    r1 = [rec(0, 10.0, 0.5), rec(1, 12.0, 0.25, cons=0.02), rec(2, 13.0, 0.75),
          rec(3, 20.0, 1.0), rec(4, 21.0, 0.1)]
    r = reduction_share({0: r0, 1: r1}, range(1, 5))
    assert r["steps"] == [1, 2]          # 3 had a failure, 4 lacks reduce_exposed_s on rank 0
    assert [x["reduce_s"] for x in r["per_step"]] == [0.25, 0.25]      # the least over ranks
    assert [x["reduce_max_s"] for x in r["per_step"]] == [0.5, 0.75]
    assert math.isclose(r["share_median"], (0.25 / 2 + 0.25) / 2)
    assert math.isclose(r["share_with_consensus_median"], (0.26 / 2 + 0.26) / 2)
    assert math.isclose(r["step_s_median"], 1.5)
    assert "error" in reduction_share({0: r0, 1: r1}, [4])
    assert reduction_share({0: r0, 1: []}, [1, 2])["error"]        # every rank must have it


def _bench(tmp_path, gpus: int):
    b = gpu.Bench(gpu.parse_args(["--cpu", "--out", str(tmp_path), "--budget-s", "100000"]))
    if gpus:                      # a GPU machine's branches, the launch replaced
        b.cpu, b.info = False, dict(b.info, gpus=gpus, cuda=True)
        b.big_model = "llama_1b"
    return b


@pytest.mark.parametrize("gpus,plane,skipped", [(0, "gloo", False), (1, "none", True),
                                                (2, "nccl", False)])
def test_section4_starts_nccl_only_with_two_gpus(tmp_path, monkeypatch, gpus, plane, skipped):
    b = _bench(tmp_path, gpus)
    cmds = []
    monkeypatch.setattr(b, "_run", lambda cmd, log, cap, env=None: cmds.append(cmd) or (1, 0.0))
    res = b.s4_staging()
    cmd = cmds[0]
    assert cmd[cmd.index("--staging-plane") + 1] == plane
    assert ("RECOVER_HSDP_STORE" in cmd) == (plane != "none")   # -x: the plane's store
    spec = cmd[cmd.index("--staging-buckets") + 1]
    model = "llama_debug" if gpus == 0 else "llama_1b"
    assert spec == ",".join(f"{x['name']}:{x['numel']}" for x in fsdp_unit_buckets(model, 1))
    if skipped:
        assert res["plane"] is None and "one GPU cannot host two ranks of one NCCL " \
            "communicator" in res["plane_label"], res
    assert res["ok"] is False          # the launch was replaced: no results


@pytest.mark.parametrize("gpus,plane,ranks", [(0, "gloo", 3), (1, "gloo", 3), (2, "nccl", 2),
                                              (8, "nccl", 4)])
def test_section8_plane_and_ranks(tmp_path, monkeypatch, gpus, plane, ranks):
    b = _bench(tmp_path, gpus)
    cmds = []
    monkeypatch.setattr(b, "_run", lambda cmd, log, cap, env=None: cmds.append(cmd) or (0, 0.0))
    res = b.s8_abort_rebuild()
    cmd = cmds[0]
    assert cmd[cmd.index("-n") + 1] == str(ranks)
    assert cmd[cmd.index("--plane") + 1] == plane and "recover_hsdp.bench.collectives" in cmd
    assert cmd[cmd.index("--kills-per-job") + 1] == str(max(1, ranks - 2))
    assert res["plane"] == plane and res["ok"] is False and "error" in res
    if gpus == 1:
        assert "one GPU cannot host two ranks of one NCCL communicator" in res["label"]
    if plane == "nccl":
        assert "first collective" in res["note"]
        assert ("one rank (no communicator)" in res["note"]) == (ranks == 2)


def test_default_plan_for_one_gpu_runs_section_8_within_360_s():
    sections = {int(x) for x in P.DEFAULT_SECTIONS.split(",")}
    assert sections == {1, 2, 3, 4, 5, 8}
    plan, total = P.make_plan(sections, P.DEFAULT_BUDGET_S, cpu=False, gpus=1,
                              setup_s=P.SETUP_S)
    assert total <= 360.0 and all(p.included for p in plan), \
        P.format_plan(plan, total, 360, P.SETUP_S, "gpu")
    s8 = next(p for p in plan if p.est.section == 8)
    assert "gloo" in s8.est.source and "measured here" in s8.est.source
    plan2, _ = P.make_plan(sections, 10_000, cpu=False, gpus=2)
    est = {p.est.section: p.est for p in plan2}
    assert est[8].source.startswith("assumed") and "nccl" in est[8].source
    assert est[4].seconds() == P.GPU_ESTIMATES[4].seconds() + P.NCCL_STAGING_S


def test_table_rows_for_the_new_figures(tmp_path):
    b = _bench(tmp_path, 0)
    b.results = {
        "1b_kill": {"reduction": {"reduce_s_median": 0.5, "consensus_s_median": 0.1,
                                  "step_s_median": 2.0, "share_median": 0.25,
                                  "share_with_consensus_median": 0.3, "steps": [1, 2],
                                  "reduce_max_s_median": 0.7}},
        "staging": {"plane": None, "plane_label": "nccl skipped: x", "model": "llama_1b",
                    "buckets": [{"name": "block", "count": 16, "bytes": 2**20,
                                 "ulfm_gbps": 5.0, "copy_gbps": 20.0}],
                    "step_bytes": 16 * 2**20, "ulfm_step_s": 1.0, "ulfm_gbps": 5.0,
                    "copy_step_s": 0.25, "rc": 0},
        "abort_rebuild": {"skipped": "deferred by the plan", "plane": "gloo"}}
    t = table(b)
    assert ("reduce 0.5 s (+ consensus 0.1 s) of a 2 s step: 25 % (30 % with consensus; the "
            "first rank in waits 0.7 s)") in t
    assert "4 staging block x16" in t and "1 MiB: ulfm 5 GB/s vs pinned copy 20 GB/s" in t
    assert "nccl skipped: x" in t
    assert re.search(r"8 abort \+ rebuild \(gloo\)\s+deferred by the plan", t), t
